//! Tokenizers: the checkpoint's own `tokenizer.json`, or the offline copies bundled in
//! `assets/tokenizers` (gzipped) for the model families without one.

use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result};
use tokenizers::Tokenizer;

/// The tokenizers bundled in `assets/tokenizers` (gzipped), by `model_type`.
fn bundled_tokenizer_bytes(model_type: &str) -> Option<&'static [u8]> {
    match model_type {
        "olmoe" => Some(include_bytes!("../assets/tokenizers/olmoe.json.gz")),
        "qwen2_moe" => Some(include_bytes!("../assets/tokenizers/qwen1.5.json.gz")),
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
