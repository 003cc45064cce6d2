//! Finding the weight files of a Hugging Face checkpoint folder (single file or sharded).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use candle::{DType, Device};
use candle_nn::VarBuilder;

use crate::QmoeError;

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn missing(msg: String) -> candle::Error {
    QmoeError::Config(msg).into()
}

/// The safetensors files of the checkpoint in `dir`: `model.safetensors`, or else every shard
/// named in `model.safetensors.index.json`'s `weight_map` (sorted, each once). A missing file is an
/// error that names it.
pub fn checkpoint_files(dir: impl AsRef<Path>) -> candle::Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join(INDEX_FILE);
    if !index.is_file() {
        return Err(missing(format!(
            "no {SINGLE_FILE} or {INDEX_FILE} in `{}`",
            dir.display()
        )));
    }
    let text = std::fs::read_to_string(&index)
        .map_err(|e| missing(format!("cannot read `{}`: {e}", index.display())))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| missing(format!("`{}` is not valid JSON: {e}", index.display())))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| missing(format!("`{}` has no `weight_map` object", index.display())))?;
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    if shards.is_empty() {
        return Err(missing(format!(
            "`{}` names no shard files",
            index.display()
        )));
    }
    shards
        .into_iter()
        .map(|name| {
            let p = dir.join(name);
            if p.is_file() {
                Ok(p)
            } else {
                Err(missing(format!(
                    "shard `{}` listed in {INDEX_FILE} is missing",
                    p.display()
                )))
            }
        })
        .collect()
}

/// A VarBuilder over the memory-mapped checkpoint in `dir` (see [`checkpoint_files`]) that
/// converts tensors to `dtype` on `device` as they are read.
///
/// # Safety
/// The files are memory-mapped: they must not be modified while the VarBuilder or tensors
/// borrowed from it are alive (the same contract as
/// [`VarBuilder::from_mmaped_safetensors`]).
pub unsafe fn mmap_checkpoint(
    dir: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
) -> candle::Result<VarBuilder<'static>> {
    let files = checkpoint_files(dir)?;
    VarBuilder::from_mmaped_safetensors(&files, dtype, device)
}
