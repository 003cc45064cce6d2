//! Finding a checkpoint: a local Hugging Face folder or a download from the hub; the
//! quantization of its routed experts into a pack with a progress bar; a synthetic model written
//! as a checkpoint folder.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_qmoe::models::{
    quantize_checkpoint, quantize_checkpoint_to_file, AnyConfig, ModelConfig, QuantizeOptions,
};
use candle_qmoe::pack::{PackFile, PackMeta};
use candle_qmoe::synthetic::checkpoint::{SyntheticCheckpoint, WrittenCheckpoint};
use candle_qmoe::synthetic::SyntheticKind;
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
        if dir.is_file() {
            bail!(
                "--model-dir `{}` is a file: pass the model folder that holds it",
                dir.display()
            );
        }
        if !dir.is_dir() {
            bail!("--model-dir `{}`: no such folder", dir.display());
        }
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
                // The hub client joins the name to its cache folder: nothing outside it.
                if !candle_qmoe::models::checkpoint::is_shard_file_name(shard) {
                    bail!(
                        "the checkpoint index of `{model_id}` names shard `{shard}`, which is not \
                         a file name inside the checkpoint folder"
                    );
                }
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

/// A progress bar over the (layer, expert)s of the checkpoint in `dir` that shows the MoE layer
/// being quantized, and its `on_progress(done, total)` callback.
fn quantize_bar(dir: &Path) -> Result<(ProgressBar, impl Fn(usize, usize) + Sync)> {
    let spec = AnyConfig::from_file(dir.join("config.json"))?.spec()?;
    let (layers, experts) = (spec.moe_layers().len(), spec.uniform_moe()?.num_experts);
    let bar = ProgressBar::new((layers * experts) as u64).with_style(ProgressStyle::with_template(
        "quantizing experts [{elapsed_precise}] {wide_bar} {pos}/{len} {msg} ({eta} left)",
    )?);
    let tick = bar.clone();
    Ok((bar, move |done: usize, total: usize| {
        tick.set_length(total as u64);
        tick.set_position(done as u64);
        let layer = (done.saturating_sub(1) / experts.max(1) + 1).min(layers);
        tick.set_message(format!("(MoE layer {layer}/{layers})"));
    }))
}

/// Quantizes the checkpoint's routed experts into a pack in memory, with a progress bar.
pub fn quantize_with_progress(dir: &Path, opts: &QuantizeOptions) -> Result<PackFile> {
    let (bar, on_progress) = quantize_bar(dir)?;
    let pack = quantize_checkpoint(dir, opts, &on_progress);
    bar.finish();
    Ok(pack?)
}

/// Quantizes the checkpoint's routed experts straight into the `.qmoe` file `out`, one layer at
/// a time (see [`quantize_checkpoint_to_file`]), with a progress bar.
pub fn quantize_to_file_with_progress(
    dir: &Path,
    out: &Path,
    opts: &QuantizeOptions,
) -> Result<PackMeta> {
    let (bar, on_progress) = quantize_bar(dir)?;
    let meta = quantize_checkpoint_to_file(dir, out, opts, &on_progress);
    bar.finish();
    Ok(meta?)
}

/// Writes the synthetic model `kind` (weights from `seed`) as a Hugging Face checkpoint folder
/// `dir` with the bundled tokenizer its synthetic model uses
/// ([`crate::tokenizer::synthetic_tokenizer_family`]; none for `mixtral`, with a note) (see
/// [`SyntheticCheckpoint`]), with a progress bar.
pub fn write_synthetic_checkpoint(
    kind: SyntheticKind,
    seed: u64,
    dir: &Path,
) -> Result<WrittenCheckpoint> {
    let files = match crate::tokenizer::synthetic_tokenizer_family(kind) {
        Some(family) => crate::tokenizer::bundled_tokenizer_files(family)?,
        None => {
            eprintln!(
                "note: no {kind} tokenizer is bundled: the folder gets none (put the model's \
                 tokenizer.json there to load it with --model-dir)"
            );
            Vec::new()
        }
    };
    let files: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (*n, b.as_slice())).collect();
    let bar = ProgressBar::new(0).with_style(ProgressStyle::with_template(
        "writing checkpoint [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} \
         ({binary_bytes_per_sec}, {eta} left)",
    )?);
    let written = SyntheticCheckpoint::new(kind, seed).write(dir, &files, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish();
    Ok(written?)
}
