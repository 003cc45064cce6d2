//! The example binaries as a user runs them, for behaviour that lives in their `main`: the
//! `parity` verdict's exit status, `quantize --out` inside the `--save-checkpoint` folder, and
//! `generate` piped into a reader that stops early.
//! `cargo test` builds the examples next to this test's own profile folder; a partial run
//! (`cargo test --test examples_cli`) needs `cargo build --examples` (with `--release` to match)
//! first, and fails naming it otherwise.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_qmoe_suite::testing::fixture_dir;

/// The example binary `name` of this test's profile.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> → target/<profile>/examples/<name>
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.is_file(),
        "`{}` is missing: run `cargo build --examples` (with the tests' profile) first",
        bin.display()
    );
    bin
}

fn run(name: &str, args: &[&str]) -> Output {
    Command::new(example(name))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn parity_exits_with_its_verdict() {
    let dir = fixture_dir("olmoe-tiny");
    let golden = dir.join("golden.safetensors");
    let (dir, golden) = (dir.to_str().unwrap(), golden.to_str().unwrap());
    let base = ["--model-dir", dir, "--golden", golden, "--experts", "int4"];
    let pass = run("parity", &base);
    assert!(pass.status.success(), "{}", text(&pass));
    assert!(text(&pass).contains("parity: pass"), "{}", text(&pass));
    // INT4 cannot reach the dense bound: exit status 1, naming the bound of each prompt.
    let fail = run("parity", &[&base[..], &["--max-mean-kl", "1e-6"]].concat());
    let out = text(&fail);
    assert_eq!(fail.status.code(), Some(1), "{out}");
    assert!(
        out.contains("parity: FAIL")
            && out.contains("prompt0: mean KL")
            && out.contains("prompt1: mean KL"),
        "{out}"
    );
    // A bound that would switch its check off is refused.
    let nan = run("parity", &[&base[..], &["--min-top1", "nan"]].concat());
    assert_eq!(nan.status.code(), Some(2), "{}", text(&nan));
    assert!(
        text(&nan).contains("'nan' for '--min-top1 <MIN_TOP1>': `nan` is not a fraction in [0, 1]"),
        "{}",
        text(&nan)
    );
}

/// `quantize --synthetic tiny --save-checkpoint FOLDER --out PACK`.
fn save_and_quantize_tiny(folder: &Path, pack: &Path) -> Output {
    let (folder, pack) = (folder.to_str().unwrap(), pack.to_str().unwrap());
    run(
        "quantize",
        &[
            "--synthetic",
            "tiny",
            "--save-checkpoint",
            folder,
            "--out",
            pack,
        ],
    )
}

#[test]
fn quantize_writes_its_pack_into_the_folder_it_creates() {
    let tmp = std::env::temp_dir().join(format!("qmoe-examples-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let folder = tmp.join("tiny");
    let pack = folder.join("tiny.qmoe");
    let out = save_and_quantize_tiny(&folder, &pack);
    assert!(out.status.success(), "{}", text(&out));
    assert!(pack.is_file() && folder.join("config.json").is_file());
    // A folder that does not exist and is not the one being created is still refused up front.
    let other = tmp.join("other");
    let missing = tmp.join("missing").join("x.qmoe");
    let out = save_and_quantize_tiny(&other, &missing);
    assert!(!out.status.success());
    assert!(text(&out).contains("does not exist"), "{}", text(&out));
    assert!(!other.exists(), "nothing written before the refusal");
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// `generate … | head -c 5`: when the reader of its output goes away, `generate` ends quietly
/// (SIGPIPE's default action, as C tools have) instead of panicking in `println!`.
#[cfg(unix)]
#[test]
fn generate_ends_quietly_when_its_reader_goes_away() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let mut child = Command::new(example("generate"))
        .args([
            "--synthetic",
            "tiny",
            "--cpu",
            "-n",
            "1000",
            "--prompt",
            "hi",
        ])
        .env_remove("RUST_BACKTRACE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 5];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    // The read end is dropped here: the next write gets EPIPE.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        out.status
    );
}

/// Flags that cannot apply together are refused, naming them, instead of one being ignored.
#[test]
fn contradictory_flags_are_refused() {
    let tiny = fixture_dir("olmoe-tiny");
    let tiny = tiny.to_str().unwrap();
    for (name, args, names) in [
        (
            "generate",
            vec!["--cpu", "--model-dir", tiny, "--model-id", "a/b"],
            ["--model-dir", "--model-id"],
        ),
        (
            "generate",
            vec!["--cpu", "--synthetic", "tiny", "--revision", "main"],
            ["--synthetic", "--revision"],
        ),
        (
            "generate",
            vec![
                "--cpu",
                "--synthetic",
                "tiny",
                "--experts",
                "f32",
                "--group-size",
                "64",
            ],
            ["--group-size", "--experts f32"],
        ),
        (
            "quantize",
            vec!["--model-dir", tiny, "--revision", "x", "--out", "x.qmoe"],
            ["--model-dir", "--revision"],
        ),
        (
            "plan",
            vec!["--synthetic", "tiny", "--revision", "x"],
            ["--synthetic", "--revision"],
        ),
        (
            "plan",
            vec!["--synthetic", "tiny", "--margin", "0.1"],
            ["--margin", "--vram-budget"],
        ),
        (
            "generate",
            vec!["--cpu", "--synthetic", "tiny", "--top-p", "0.9"],
            ["--top-p", "--temperature"],
        ),
        (
            "generate",
            vec![
                "--cpu",
                "--synthetic",
                "tiny",
                "--temperature",
                "0",
                "--top-p",
                "0.9",
            ],
            ["--top-p", "--temperature"],
        ),
        (
            "plan",
            vec![
                "--synthetic",
                "tiny",
                "--vram-budget",
                "8GiB",
                "--resident",
                "4",
                "--allow-ctx-reduction",
            ],
            ["--allow-ctx-reduction", "--resident"],
        ),
    ] {
        let out = run(name, &args);
        assert!(!out.status.success(), "{name} {args:?} accepted");
        for n in names {
            assert!(
                text(&out).contains(n),
                "{name} {args:?}: `{n}` not in {}",
                text(&out)
            );
        }
    }
}

/// A `--top-p` below the smallest positive F32 keeps the most probable token (greedy), as
/// the nucleus does, instead of failing in the sampler with no token left.
#[test]
fn a_vanishing_top_p_keeps_the_top_token() {
    let args = [
        "--cpu",
        "--synthetic",
        "tiny",
        "-n",
        "8",
        "--prompt",
        "hi",
        "--no-chat",
    ];
    let greedy = run("generate", &args);
    assert!(greedy.status.success(), "{}", text(&greedy));
    let nucleus = run(
        "generate",
        &[&args[..], &["--temperature", "1", "--top-p", "1e-46"]].concat(),
    );
    assert!(nucleus.status.success(), "{}", text(&nucleus));
    // The generated text: the line after the prompt's.
    let text_of = |o: &Output| {
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        out.lines()
            .skip_while(|l| *l != "hi")
            .nth(1)
            .map(String::from)
    };
    assert!(
        text_of(&greedy).is_some_and(|t| !t.trim().is_empty()),
        "{}",
        text(&greedy)
    );
    assert_eq!(text_of(&greedy), text_of(&nucleus));
}

/// Cache flags beside a budget that holds every expert: no cache is made and a note says the
/// flags have no effect (they were refused, asking for the `--vram-budget` already given).
/// Without a budget or `--resident` they are still refused.
#[test]
fn cache_flags_under_a_budget_that_holds_every_expert_are_noted() {
    let base = ["--synthetic", "tiny", "--cpu", "-n", "2", "--prompt", "hi"];
    let out = run(
        "generate",
        &[
            &base[..],
            &["--vram-budget", "1GiB", "--prefetch", "--policy", "lfu"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("have no effect"), "{}", text(&out));
    let out = run("generate", &[&base[..], &["--prefetch"]].concat());
    assert!(!out.status.success());
    assert!(
        text(&out).contains("apply to an expert cache"),
        "{}",
        text(&out)
    );
}
