//! Generates the Rust side of `cuda/moe_geometry.h` (always) and compiles `cuda/*.cu` to PTX
//! with nvcc when the `cuda` feature is on.
//!
//! Geometry: every `#define QMOE_<NAME> <integer expression>` of the header becomes
//! `pub const <NAME>: usize` and its `MoeParams` struct a `#[repr(C)]` Rust struct with the same
//! field names (`$OUT_DIR/geometry.rs`). The header is then compiled by the host C compiler into a
//! small program that prints, as Rust `const` assertions (`$OUT_DIR/geometry_check.rs`), what C
//! makes of it: every constant, the struct's size, alignment and field offsets, and the
//! shared-memory size macros on sample shapes — so a disagreement fails the build.
//!
//! PTX: //! One PTX file per virtual architecture (compute_80 for Ampere/Ada, compute_90 for Hopper);
//! `src/lib.rs` embeds them. nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH
//! (`source scripts/cuda-env.sh` provides a CUDA 13.0 one). The PTX ISA must stay ≤ 9.0 so that a
//! CUDA 13.0 driver can JIT it: PTX with a newer `.version` (from a newer nvcc) fails the build,
//! naming the nvcc that wrote it.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Virtual architectures a PTX file is produced for.
const ARCHS: [u32; 2] = [80, 90];
/// Kernel sources (each becomes `<stem>.sm<arch>.ptx` in OUT_DIR).
const SOURCES: [&str; 1] = ["cuda/w4a16_moe.cu"];
/// The header shared by the kernels, the emulator and the Rust launcher.
const GEOMETRY_HEADER: &str = "cuda/moe_geometry.h";
/// Sample shapes for the shared-memory checks: reduction lengths, token counts, element sizes,
/// group sizes.
const SAMPLE_K: [u32; 9] = [8, 200, 264, 1024, 1408, 2048, 2304, 4096, 7168];
const SAMPLE_TOKENS: [u32; 4] = [1, 8, 9, 16];
const SAMPLE_ES: [u32; 2] = [2, 4];
const SAMPLE_GROUPS: [u32; 4] = [32, 64, 128, 256];
/// Highest PTX ISA a CUDA 13.0 driver accepts.
const MAX_PTX_ISA: (u32, u32) = (9, 0);

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    generate_geometry(&out);
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = nvcc();
    for src in SOURCES {
        let stem = Path::new(src)
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        for arch in ARCHS {
            let ptx = out.join(format!("{stem}.sm{arch}.ptx"));
            let status = Command::new(&nvcc)
                .args(["-ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
                .arg(format!("-arch=compute_{arch}"))
                .arg("-o")
                .arg(&ptx)
                .arg(src)
                .status()
                .unwrap_or_else(|e| {
                    panic!(
                        "candle-qmoe-kernels: cannot run nvcc ({}): {e}. Install the CUDA toolkit or \
                         `source scripts/cuda-env.sh`, or build without the `cuda` feature.",
                        nvcc.display()
                    )
                });
            assert!(status.success(), "nvcc failed on {src} for compute_{arch}");
            check_ptx_version(&ptx, &nvcc);
        }
    }
}

fn nvcc() -> PathBuf {
    if let Some(p) = env::var_os("NVCC") {
        return p.into();
    }
    if let Some(home) = env::var_os("CUDA_HOME") {
        let p = Path::new(&home).join("bin/nvcc");
        if p.exists() {
            return p;
        }
    }
    "nvcc".into()
}

/// Fails the build when `ptx` declares a PTX ISA newer than [`MAX_PTX_ISA`].
fn check_ptx_version(ptx: &Path, nvcc: &Path) {
    let text = std::fs::read_to_string(ptx).expect("read PTX");
    let Some(line) = text.lines().find(|l| l.starts_with(".version ")) else {
        panic!("{}: no .version directive", ptx.display());
    };
    let v = line.trim_start_matches(".version ").trim();
    let (major, minor) = v
        .split_once('.')
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
        .unwrap_or_else(|| panic!("{}: bad PTX version `{v}`", ptx.display()));
    if (major, minor) > MAX_PTX_ISA {
        panic!(
            "candle-qmoe-kernels: {} ({}) wrote PTX ISA {major}.{minor}, newer than the {}.{} a \
             CUDA 13.0 driver can JIT. Build with CUDA 13.0's nvcc (`source scripts/cuda-env.sh`, \
             or set NVCC).",
            nvcc.display(),
            nvcc_release(nvcc),
            MAX_PTX_ISA.0,
            MAX_PTX_ISA.1
        );
    }
}

/// The release line of `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88").
fn nvcc_release(nvcc: &Path) -> String {
    Command::new(nvcc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| l.contains("release"))
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "version unknown".to_string())
}

/// An object-like `#define QMOE_<NAME> <expression>` of the header.
struct Define {
    name: String,
    /// The Rust expression (outer parentheses and `QMOE_` prefixes removed).
    expr: String,
    doc: String,
}

/// A field of the header's `MoeParams`.
struct Field {
    name: String,
    rust_type: &'static str,
    doc: String,
}

/// Writes `geometry.rs` and `geometry_check.rs` into `out` (see the crate docs above).
fn generate_geometry(out: &Path) {
    let text = std::fs::read_to_string(GEOMETRY_HEADER).expect("read moe_geometry.h");
    let (defines, fields) = parse_header(&text);
    let mut rs = String::from(
        "// Generated by candle-qmoe-kernels/build.rs from cuda/moe_geometry.h; do not edit.\n\n",
    );
    for d in &defines {
        let doc = d.doc.trim_end_matches('.');
        writeln!(
            rs,
            "/// {doc} (`QMOE_{}`).\npub const {}: usize = {};",
            d.name, d.name, d.expr
        )
        .unwrap();
    }
    rs.push_str(
        "\n/// The kernels' one parameter, passed by value: `MoeParams` of `moe_geometry.h` \
         (pointers are device addresses).\n#[repr(C)]\n\
         #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]\npub struct MoeParams {\n",
    );
    for f in &fields {
        writeln!(
            rs,
            "    /// {}\n    pub {}: {},",
            f.doc, f.name, f.rust_type
        )
        .unwrap();
    }
    rs.push_str("}\n");
    std::fs::write(out.join("geometry.rs"), rs).expect("write geometry.rs");
    let check = c_view_of_header(out, &defines, &fields);
    std::fs::write(out.join("geometry_check.rs"), check).expect("write geometry_check.rs");
}

/// The object-like `QMOE_` defines with their trailing comments (function-like macros are left
/// to hand-written Rust, which the samples check) and the `MoeParams` fields.
fn parse_header(text: &str) -> (Vec<Define>, Vec<Field>) {
    let (mut defines, mut fields) = (Vec::new(), Vec::new());
    let mut in_struct = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with("typedef struct MoeParams") {
            in_struct = true;
        } else if in_struct && line.starts_with('}') {
            in_struct = false;
        } else if in_struct {
            fields.push(parse_field(line));
        } else if let Some(rest) = line.strip_prefix("#define QMOE_") {
            let (name, value) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
            if name.contains('(') {
                continue;
            }
            let (expr, doc) = value.split_once("/*").unwrap_or_else(|| {
                panic!("{GEOMETRY_HEADER}: QMOE_{name} needs a trailing /* comment */")
            });
            let expr = expr.trim();
            let ok = expr.chars().all(|c| {
                c.is_ascii_alphanumeric() || c == '_' || c.is_whitespace() || "+-*/()".contains(c)
            });
            let idents_ok = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|t| t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_'))
                .all(|t| t.starts_with("QMOE_"));
            assert!(
                ok && idents_ok && !expr.is_empty(),
                "{GEOMETRY_HEADER}: QMOE_{name} must be an integer expression of literals and \
                 QMOE_ names, got `{expr}`"
            );
            defines.push(Define {
                name: name.to_string(),
                expr: strip_outer_parens(expr).replace("QMOE_", ""),
                doc: sentence(doc.trim_end().trim_end_matches("*/")),
            });
        }
    }
    assert!(
        !fields.is_empty(),
        "{GEOMETRY_HEADER}: no `typedef struct MoeParams`"
    );
    (defines, fields)
}

/// `(a * b)` → `a * b` when the outer parentheses enclose the whole expression.
fn strip_outer_parens(expr: &str) -> &str {
    let Some(inner) = expr.strip_prefix('(').and_then(|e| e.strip_suffix(')')) else {
        return expr;
    };
    let mut depth = 0i32;
    for c in inner.chars() {
        depth += match c {
            '(' => 1,
            ')' => -1,
            _ => 0,
        };
        if depth < 0 {
            return expr;
        }
    }
    inner
}

/// A header comment as a doc sentence: capitalised, ending with a full stop, brackets escaped
/// (they are shapes, not links).
fn sentence(comment: &str) -> String {
    let c = comment.trim().replace('[', "\\[").replace(']', "\\]");
    let mut chars = c.chars();
    let first = chars.next().map(|f| f.to_uppercase().collect::<String>());
    let mut s = first.unwrap_or_default() + chars.as_str();
    if !s.ends_with('.') {
        s.push('.');
    }
    s
}

/// One `type name; /* comment */` line of `MoeParams`: pointers become `u64` device addresses.
fn parse_field(line: &str) -> Field {
    let (decl, doc) = match line.split_once("/*") {
        Some((d, c)) => (d.trim(), c.trim_end_matches("*/").trim()),
        None => (line, ""),
    };
    let decl = decl
        .strip_suffix(';')
        .unwrap_or_else(|| panic!("{GEOMETRY_HEADER}: bad MoeParams field `{line}`"));
    let (ty, name) = decl
        .rsplit_once(char::is_whitespace)
        .expect("type and name");
    let rust_type = match (ty.contains('*') || name.starts_with('*'), ty.trim()) {
        (true, _) => "u64",
        (false, "uint32_t") => "u32",
        (false, "uint64_t") => "u64",
        (false, other) => {
            panic!("{GEOMETRY_HEADER}: MoeParams field type `{other}` has no mapping")
        }
    };
    let pointer = ty.contains('*') || name.starts_with('*');
    Field {
        name: name.trim_start_matches('*').to_string(),
        rust_type,
        doc: match pointer {
            true => format!("{} (device address).", sentence(doc).trim_end_matches('.')),
            false => sentence(doc),
        },
    }
}

/// Compiles and runs a C program that prints the header's values as Rust `const` assertions.
fn c_view_of_header(out: &Path, defines: &[Define], fields: &[Field]) -> String {
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"moe_geometry.h\"\nint main(void) {\n",
    );
    let assert = |c: &mut String, rust: &str, value: &str| {
        writeln!(
            c,
            "    printf(\"const _: () = assert!({rust} == %llu);\\n\", (unsigned long long)({value}));"
        )
        .unwrap();
    };
    for d in defines {
        assert(&mut c, &d.name, &format!("QMOE_{}", d.name));
    }
    assert(
        &mut c,
        "std::mem::size_of::<MoeParams>()",
        "sizeof(MoeParams)",
    );
    assert(
        &mut c,
        "std::mem::align_of::<MoeParams>()",
        "_Alignof(MoeParams)",
    );
    for f in fields {
        assert(
            &mut c,
            &format!("std::mem::offset_of!(MoeParams, {})", f.name),
            &format!("offsetof(MoeParams, {})", f.name),
        );
        assert(
            &mut c,
            &format!("std::mem::size_of::<{}>()", f.rust_type),
            &format!("sizeof(((MoeParams*)0)->{})", f.name),
        );
    }
    for k in SAMPLE_K {
        for es in SAMPLE_ES {
            for g in SAMPLE_GROUPS {
                for t in SAMPLE_TOKENS {
                    assert(
                        &mut c,
                        &format!("decode_smem({k}, {t}, {es}, {g})"),
                        &format!("QMOE_DEC_SMEM({k}, {t}, {es}, {g})"),
                    );
                }
                assert(
                    &mut c,
                    &format!("prefill_smem({k}, {es}, {g})"),
                    &format!("QMOE_PRE_SMEM({k}, {es}, {g})"),
                );
            }
        }
    }
    c.push_str("    return 0;\n}\n");
    let src = out.join("geometry_check.c");
    let exe = out.join("geometry_check");
    std::fs::write(&src, c).expect("write geometry_check.c");
    let host = env::var("HOST").expect("HOST");
    let compiler = cc::Build::new()
        .cargo_metadata(false)
        .target(&host)
        .host(&host)
        .opt_level(0)
        .get_compiler();
    let status = compiler
        .to_command()
        .arg("-std=c11")
        .arg("-Icuda")
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("candle-qmoe-kernels: cannot run the C compiler: {e}"));
    assert!(
        status.success(),
        "the C compiler failed on {}",
        src.display()
    );
    let run = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    assert!(run.status.success(), "{} failed", exe.display());
    String::from_utf8(run.stdout).expect("UTF-8 output")
}
