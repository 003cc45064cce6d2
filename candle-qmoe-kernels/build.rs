//! Compiles `cuda/*.cu` to PTX with nvcc when the `cuda` feature is on.
//!
//! One PTX file per virtual architecture (compute_80 for Ampere/Ada, compute_90 for Hopper);
//! `src/lib.rs` embeds them. nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH
//! (`source scripts/cuda-env.sh` provides a CUDA 13.0 one). The PTX ISA must stay ≤ 9.0 so that a
//! CUDA 13.0 driver can JIT it: a newer nvcc's `.version` line is lowered to 9.0 (the kernels
//! use no instruction newer than sm_80's) with a build warning.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Virtual architectures a PTX file is produced for.
const ARCHS: [u32; 2] = [80, 90];
/// Kernel sources (each becomes `<stem>.sm<arch>.ptx` in OUT_DIR).
const SOURCES: [&str; 1] = ["cuda/w4a16_moe.cu"];
/// Highest PTX ISA a CUDA 13.0 driver accepts.
const MAX_PTX_ISA: (u32, u32) = (9, 0);

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
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
            cap_ptx_version(&ptx);
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

/// Lowers the `.version` directive to [`MAX_PTX_ISA`] when nvcc wrote a newer one.
fn cap_ptx_version(ptx: &Path) {
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
        println!(
            "cargo::warning=PTX ISA {major}.{minor} from this nvcc lowered to {}.{} for CUDA 13.0 drivers",
            MAX_PTX_ISA.0, MAX_PTX_ISA.1
        );
        let fixed = text.replacen(
            line,
            &format!(".version {}.{}", MAX_PTX_ISA.0, MAX_PTX_ISA.1),
            1,
        );
        std::fs::write(ptx, fixed).expect("write PTX");
    }
}
