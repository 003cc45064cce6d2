//! Helpers shared by the examples: finding a checkpoint (local folder
//! or Hugging Face hub), the bundled offline tokenizers, the quantization progress bar, and
//! memory figures, and the device/commit recorded in evidence files; building a model from the
//! command line ([`model`]) and the PERF-REAL benchmark contract ([`perf`]).
#![allow(dead_code)]

pub mod model;
pub mod perf;

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_qmoe::models::{quantize_checkpoint, QuantizeOptions};
use candle_qmoe::pack::PackFile;
use indicatif::{ProgressBar, ProgressStyle};
use tokenizers::Tokenizer;

/// A checkpoint folder on disk and where it came from.
pub struct Checkpoint {
    /// Folder with `config.json` and the safetensors weights.
    pub dir: PathBuf,
    /// Hub model id, or the folder's path.
    pub model_id: String,
    /// Hub commit (the snapshot folder's name) or `local`.
    pub revision: String,
}

/// A local folder (`model_dir`) or a hub download of `model_id` at `revision` (default `main`).
pub fn resolve_checkpoint(
    model_dir: Option<&Path>,
    model_id: &str,
    revision: Option<&str>,
) -> Result<Checkpoint> {
    if let Some(dir) = model_dir {
        if !dir.join("config.json").is_file() {
            bail!("`{}` has no config.json: not a model folder", dir.display());
        }
        return Ok(Checkpoint {
            dir: dir.to_path_buf(),
            model_id: dir.display().to_string(),
            revision: "local".into(),
        });
    }
    download(model_id, revision.unwrap_or("main"))
}

fn download(model_id: &str, revision: &str) -> Result<Checkpoint> {
    use hf_hub::{api::sync::ApiBuilder, Repo, RepoType};
    let api = ApiBuilder::from_env().with_progress(true).build()?;
    let repo = api.repo(Repo::with_revision(
        model_id.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let get = |file: &str| {
        repo.get(file).with_context(|| {
            format!(
                "cannot download `{file}` of `{model_id}` (revision {revision}) from the Hugging \
                 Face hub; without network use --model-dir with a local copy, or --synthetic"
            )
        })
    };
    let config = get("config.json")?;
    for optional in [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let _ = repo.get(optional);
    }
    match repo.get(candle_qmoe::models::checkpoint::INDEX_FILE) {
        Ok(index) => {
            let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&index)?)
                .with_context(|| format!("`{}` is not valid JSON", index.display()))?;
            let mut shards: Vec<&str> = json["weight_map"]
                .as_object()
                .context("the checkpoint index has no weight_map")?
                .values()
                .filter_map(|v| v.as_str())
                .collect();
            shards.sort_unstable();
            shards.dedup();
            for shard in shards {
                get(shard)?;
            }
        }
        Err(_) => {
            get(candle_qmoe::models::checkpoint::SINGLE_FILE)?;
        }
    }
    let dir = config
        .parent()
        .context("downloaded config.json has no parent folder")?
        .to_path_buf();
    let revision = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| revision.to_string());
    Ok(Checkpoint {
        dir,
        model_id: model_id.to_string(),
        revision,
    })
}

/// The tokenizers bundled in `assets/tokenizers` (gzipped), by `model_type`.
fn bundled_tokenizer_bytes(model_type: &str) -> Option<&'static [u8]> {
    match model_type {
        "olmoe" => Some(include_bytes!("../../assets/tokenizers/olmoe.json.gz")),
        "qwen2_moe" => Some(include_bytes!("../../assets/tokenizers/qwen1.5.json.gz")),
        _ => None,
    }
}

/// The bundled offline tokenizer of a model family (`olmoe` or `qwen2_moe`).
pub fn bundled_tokenizer(model_type: &str) -> Result<Tokenizer> {
    let gz = bundled_tokenizer_bytes(model_type)
        .with_context(|| format!("no bundled tokenizer for model_type `{model_type}`"))?;
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut json)
        .context("corrupt bundled tokenizer")?;
    Tokenizer::from_bytes(json).map_err(anyhow::Error::msg)
}

/// `dir/tokenizer.json`, or else the bundled tokenizer of the family (with a note).
pub fn load_tokenizer(dir: &Path, model_type: &str) -> Result<Tokenizer> {
    let path = dir.join("tokenizer.json");
    if path.is_file() {
        return Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("cannot read `{}`: {e}", path.display()));
    }
    eprintln!(
        "note: no tokenizer.json in `{}`, using the bundled {model_type} tokenizer",
        dir.display()
    );
    bundled_tokenizer(model_type)
}

/// Quantizes the checkpoint's routed experts with a progress bar over (layer, expert).
pub fn quantize_with_progress(dir: &Path, opts: &QuantizeOptions) -> Result<PackFile> {
    let bar = ProgressBar::new(0).with_style(ProgressStyle::with_template(
        "quantizing experts [{elapsed_precise}] {wide_bar} {pos}/{len} ({eta} left)",
    )?);
    let pack = quantize_checkpoint(dir, opts, &|done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish();
    Ok(pack?)
}

/// Peak resident set size of this process (`VmHWM`), in bytes; `None` where /proc is missing.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Resets the peak resident set size (`VmHWM`) to the current RSS, so that
/// [`peak_rss_bytes`] measures from now on; `false` where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Memory the kernel reports as available (`MemAvailable`), in bytes.
pub fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The CPU model name, or `null` when unknown.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split(':').nth(1)?.trim().to_string())
}

/// The NVIDIA kernel driver version (from `/proc/driver/nvidia/version`), or `null`.
pub fn nvidia_driver_version() -> Option<String> {
    let info = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = info.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
        .map(str::to_string)
}

/// The current git commit (with `-dirty` when the tree has changes), or `null`.
pub fn git_commit() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The GPU's name (CUDA builds only).
#[cfg(feature = "cuda")]
fn gpu_name(device: &candle::Device) -> Option<String> {
    device
        .as_cuda_device()
        .ok()?
        .cuda_stream()
        .context()
        .name()
        .ok()
}

/// The GPU's name (CUDA builds only).
#[cfg(not(feature = "cuda"))]
fn gpu_name(_: &candle::Device) -> Option<String> {
    None
}

/// The device a run used, for evidence files: kind, name, driver (`null` on the CPU), threads.
pub fn device_json(device: &candle::Device) -> serde_json::Value {
    let threads = std::thread::available_parallelism().ok().map(|n| n.get());
    if device.is_cuda() {
        serde_json::json!({
            "kind": "cuda",
            "name": gpu_name(device),
            "driver": nvidia_driver_version(),
            "host_cpu": cpu_model(),
            "host_threads": threads,
        })
    } else {
        serde_json::json!({"kind": "cpu", "name": cpu_model(), "driver": null, "threads": threads})
    }
}
