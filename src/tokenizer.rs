//! Tokenizers: the checkpoint's own `tokenizer.json`, or the offline copies bundled in
//! `assets/tokenizers` (gzipped) for the model families without one.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};
use tokenizers::Tokenizer;

/// The tokenizers bundled in `assets/tokenizers` (gzipped), by `model_type`.
fn bundled_tokenizer_bytes(model_type: &str) -> Option<&'static [u8]> {
    match model_type {
        "olmoe" => Some(include_bytes!("../assets/tokenizers/olmoe.json.gz")),
        "qwen2_moe" => Some(include_bytes!("../assets/tokenizers/qwen1.5.json.gz")),
        _ => None,
    }
}

/// The `tokenizer.json` text of the bundled tokenizer of a family (`olmoe` or `qwen2_moe`).
fn bundled_tokenizer_json(model_type: &str) -> Result<Vec<u8>> {
    let gz = bundled_tokenizer_bytes(model_type)
        .with_context(|| format!("no bundled tokenizer for model_type `{model_type}`"))?;
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut json)
        .context("corrupt bundled tokenizer")?;
    Ok(json)
}

/// The bundled offline tokenizer of a model family (`olmoe` or `qwen2_moe`).
pub fn bundled_tokenizer(model_type: &str) -> Result<Tokenizer> {
    Tokenizer::from_bytes(bundled_tokenizer_json(model_type)?).map_err(anyhow::Error::msg)
}

/// The tokenizer files of a checkpoint folder of the family `model_type`, from the bundled
/// tokenizer: `tokenizer.json` and the `tokenizer_config.json` that transformers'
/// `AutoTokenizer` (and so llama.cpp's `convert_hf_to_gguf.py`) reads to pick the tokenizer
/// class and the special tokens, as in the released models' folders.
pub fn bundled_tokenizer_files(model_type: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let config = match model_type {
        "olmoe" => serde_json::json!({
            "tokenizer_class": "GPTNeoXTokenizer",
            "add_bos_token": false,
            "add_eos_token": false,
            "bos_token": null,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|padding|>",
            "unk_token": null,
            "clean_up_tokenization_spaces": true,
            "model_max_length": 4096,
        }),
        "qwen2_moe" => serde_json::json!({
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": null,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "unk_token": null,
            "errors": "replace",
            "clean_up_tokenization_spaces": false,
            "split_special_tokens": false,
            "model_max_length": 8192,
        }),
        other => bail!("no bundled tokenizer for model_type `{other}`"),
    };
    Ok(vec![
        ("tokenizer.json", bundled_tokenizer_json(model_type)?),
        ("tokenizer_config.json", serde_json::to_vec_pretty(&config)?),
    ])
}

/// `dir/tokenizer.json`, or else the bundled tokenizer of the family (with a note); an error
/// saying what to do when the folder has none and no tokenizer of the family is bundled.
pub fn load_tokenizer(dir: &Path, model_type: &str) -> Result<Tokenizer> {
    let path = dir.join("tokenizer.json");
    if path.is_file() {
        return Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("cannot read `{}`: {e}", path.display()));
    }
    if bundled_tokenizer_bytes(model_type).is_none() {
        bail!(
            "no tokenizer.json in `{}`, and no tokenizer is bundled for model_type `{model_type}`: \
             put the model's tokenizer.json in the folder",
            dir.display()
        );
    }
    eprintln!(
        "note: no tokenizer.json in `{}`, using the bundled {model_type} tokenizer",
        dir.display()
    );
    bundled_tokenizer(model_type)
}
