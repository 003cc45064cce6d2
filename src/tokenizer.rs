//! Tokenizers: the checkpoint's own `tokenizer.json`, or the offline copies bundled in
//! `assets/tokenizers` (gzipped) for the model families without one.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_qmoe::synthetic::SyntheticKind;
use serde_json::json;
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

/// The family (`model_type`) whose bundled tokenizer and built-in chat template a synthetic model
/// of `kind` uses: its own, or for `qwen3moe` Qwen1.5's (Qwen3's tokenizer is not bundled; both
/// have the same ids for text and for the ChatML markers, and fit its 151936-row vocabulary);
/// `None` for `mixtral`, whose tokenizer is not bundled either (see [`synthetic_tokenizer`]).
pub fn synthetic_tokenizer_family(kind: SyntheticKind) -> Option<&'static str> {
    match kind {
        SyntheticKind::Tiny | SyntheticKind::Olmoe => Some("olmoe"),
        SyntheticKind::Qwen2Moe | SyntheticKind::Qwen3Moe => Some("qwen2_moe"),
        SyntheticKind::Mixtral => None,
    }
}

/// The tokenizer of a synthetic model of `kind`, and a note for people when it is not the
/// family's own: a bundled one (see [`synthetic_tokenizer_family`]), or for `mixtral`
/// [`byte_tokenizer`] over its 32000 ids.
pub fn synthetic_tokenizer(kind: SyntheticKind) -> Result<(Tokenizer, Option<String>)> {
    match (kind, synthetic_tokenizer_family(kind)) {
        (SyntheticKind::Qwen3Moe, Some(family)) => Ok((
            bundled_tokenizer(family)?,
            Some(
                "Qwen3's tokenizer is not bundled: the synthetic qwen3moe model uses Qwen1.5's \
                 (the same ids for text and the ChatML markers) and its ChatML template"
                    .into(),
            ),
        )),
        (_, Some(family)) => Ok((bundled_tokenizer(family)?, None)),
        (_, None) => {
            let vocab = kind.spec()?.vocab_size;
            Ok((
                byte_tokenizer(vocab)?,
                Some(format!(
                    "no {kind} tokenizer is bundled: the prompt is encoded as UTF-8 bytes \
                     (Mistral's byte tokens <0x00>..<0xFF>, ids 3..=258, after <s>) with no chat \
                     template, and generated ids outside the bytes print as [id]"
                )),
            ))
        }
    }
}

/// A stand-in tokenizer for Llama/Mistral-style vocabularies of `vocab_size` ids when the real
/// one is not at hand: `<unk>`, `<s>`, `</s>` at 0, 1, 2, SentencePiece's byte-fallback tokens
/// `<0x00>`..`<0xFF>` at 3..=258 (where Mistral's tokenizer has them) and `[id]` for every other
/// id. Text is encoded as its UTF-8 bytes after `<s>`; decoding turns byte tokens back into
/// text and prints other ids as `[id]`.
pub fn byte_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    const SPECIAL: [&str; 3] = ["<unk>", "<s>", "</s>"];
    if vocab_size < SPECIAL.len() + 256 {
        bail!("a byte tokenizer needs at least 259 ids, not {vocab_size}");
    }
    let vocab: serde_json::Map<String, serde_json::Value> = (0..vocab_size)
        .map(|id| {
            let token = match id {
                0..=2 => SPECIAL[id].to_string(),
                3..=258 => format!("<0x{:02X}>", id - 3),
                _ => format!("[{id}]"),
            };
            (token, json!(id))
        })
        .collect();
    let added: Vec<_> = SPECIAL
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let bos = json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
    let seq = |id: &str| json!({"Sequence": {"id": id, "type_id": 0}});
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, seq("A")],
            "pair": [bos, seq("A"), bos, seq("B")],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": [],
        },
    });
    Tokenizer::from_bytes(serde_json::to_vec(&spec)?).map_err(anyhow::Error::msg)
}
