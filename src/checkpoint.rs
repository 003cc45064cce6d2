//! Finding a checkpoint: a local Hugging Face folder or a download from the hub, and the
//! quantization of its routed experts into a pack with a progress bar.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_qmoe::models::{quantize_checkpoint, QuantizeOptions};
use candle_qmoe::pack::PackFile;
use indicatif::{ProgressBar, ProgressStyle};

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
