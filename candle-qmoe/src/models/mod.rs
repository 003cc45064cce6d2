//! Candle-style ports of OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral and GraniteMoE whose MoE blocks
//! are [`crate::SparseMoe`] with a swappable routed-experts backend.
//!
//! The ports are thin: [`olmoe::Config`], [`qwen2_moe::Config`], [`qwen3_moe::Config`],
//! [`mixtral::Config`] and [`granitemoe::Config`] read a Hugging Face `config.json` and map it
//! onto a [`ModelSpec`]; one trunk, [`MoeForCausalLm`], built from the shared [`layers`], runs
//! any of them. The routed
//! experts of each MoE layer come from an [`ExpertsLoader`], e.g. [`ExpertsBackend::Dense`] (the
//! oracle) or [`ExpertsBackend::Int4`].
//!
//! ```no_run
//! use candle::{DType, Device, Tensor};
//! use candle_qmoe::models::{self, AnyConfig, ExpertsBackend, MoeForCausalLm};
//! use candle_qmoe::GroupSize;
//!
//! # fn main() -> candle::Result<()> {
//! let dir = std::path::Path::new("OLMoE-1B-7B-0924-Instruct");
//! let cfg = AnyConfig::from_file(dir.join("config.json"))?;
//! let vb = unsafe { models::mmap_checkpoint(dir, DType::BF16, &Device::Cpu)? };
//! let backend = ExpertsBackend::int4(GroupSize::new(128)?);
//! let mut model = MoeForCausalLm::new(&cfg, vb, &backend)?;
//! let prompt = Tensor::new(&[[50279u32, 510, 3158]], &Device::Cpu)?;
//! let logits = model.forward(&prompt, 0)?; // [1, vocab], F32
//! # let _ = logits; Ok(()) }
//! ```

pub mod causal_lm;
pub mod checkpoint;
pub mod config;
pub mod experts;
pub mod granitemoe;
pub mod layers;
pub mod mixtral;
pub mod olmoe;
pub mod quantize;
pub mod qwen2_moe;
pub mod qwen3_moe;

use std::path::Path;

pub use crate::moe::ExpertTraffic;
pub use causal_lm::{MoeForCausalLm, SequenceCache, SequenceInput};
pub use checkpoint::{
    checkpoint_files, fingerprint, mmap_checkpoint, stored_decoder_layers, stores_tensor,
    untie_if_stored_head, CheckpointTensors,
};
pub use config::{
    AttentionSpec, CommonConfig, ExpertStorage, ExpertTensor, FamilyDefaults, FfnSpec, FusedRows,
    ModelConfig, ModelSpec, MoeNames, MoeSpec, Multipliers, QkNorm,
};
pub use experts::{BlockExperts, ExpertDims, ExpertsBackend, ExpertsLoader, PackedExperts};
pub use quantize::{quantize_checkpoint, quantize_checkpoint_to_file, QuantizeOptions};

use crate::QmoeError;

/// The `model_type`s the ports support.
pub const SUPPORTED_MODEL_TYPES: [&str; 5] = [
    olmoe::MODEL_TYPE,
    qwen2_moe::MODEL_TYPE,
    qwen3_moe::MODEL_TYPE,
    mixtral::MODEL_TYPE,
    granitemoe::MODEL_TYPE,
];

/// The `architectures` entry of each supported family, in [`SUPPORTED_MODEL_TYPES`]' order.
const ARCHITECTURES: [&str; 5] = [
    olmoe::ARCHITECTURE,
    qwen2_moe::ARCHITECTURE,
    qwen3_moe::ARCHITECTURE,
    mixtral::ARCHITECTURE,
    granitemoe::ARCHITECTURE,
];

/// Parses a `config.json` text into a port's config; `what` names the port in errors.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    json: &str,
    what: &str,
) -> crate::Result<T> {
    serde_json::from_str(json).map_err(|e| QmoeError::InvalidFile {
        file: format!("{what} config.json"),
        reason: e.to_string(),
    })
}

/// [`parse_json`] for a family that names the expert count `num_local_experts` (an alias of
/// the shared `num_experts`, Mixtral's and GraniteMoE's spelling): a missing count is reported
/// under that name.
pub(crate) fn parse_json_with_local_experts<T: serde::de::DeserializeOwned>(
    json: &str,
    what: &str,
) -> crate::Result<T> {
    parse_json(json, what).map_err(|e| match e {
        QmoeError::InvalidFile { file, reason } => QmoeError::InvalidFile {
            file,
            reason: reason.replace(
                "missing field `num_experts`",
                "missing field `num_local_experts`",
            ),
        },
        e => e,
    })
}

/// The text of the `config.json` at `path`: a [`QmoeError::Io`] when it cannot be read, a
/// [`QmoeError::InvalidFile`] naming it when it is not UTF-8.
pub(crate) fn read_config_text(path: &Path) -> crate::Result<String> {
    let bytes = std::fs::read(path).map_err(|error| QmoeError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    String::from_utf8(bytes).map_err(|e| QmoeError::InvalidFile {
        file: format!("`{}`", path.display()),
        reason: format!("not UTF-8: {}", e.utf8_error()),
    })
}

/// `e`, raised by the `config.json` at `path`, naming the file: an [`QmoeError::InvalidFile`]
/// gets the path as its file, an [`QmoeError::UnsupportedConfig`] the path after its reason;
/// others are unchanged.
fn naming_file(e: QmoeError, path: &Path) -> QmoeError {
    match e {
        QmoeError::InvalidFile { reason, .. } => QmoeError::InvalidFile {
            file: format!("`{}`", path.display()),
            reason,
        },
        QmoeError::UnsupportedConfig {
            field,
            value,
            reason,
        } => QmoeError::UnsupportedConfig {
            field,
            value,
            reason: format!("{reason}, in `{}`", path.display()),
        },
        e => e,
    }
}

/// A config of any supported family, chosen by `model_type` (or `architectures`).
#[derive(Clone, Debug)]
pub enum AnyConfig {
    /// An OLMoE config.
    Olmoe(olmoe::Config),
    /// A Qwen2-MoE config.
    Qwen2Moe(qwen2_moe::Config),
    /// A Qwen3-MoE config.
    Qwen3Moe(qwen3_moe::Config),
    /// A Mixtral config.
    Mixtral(mixtral::Config),
    /// A GraniteMoE config.
    GraniteMoe(granitemoe::Config),
}

impl AnyConfig {
    /// Parses a `config.json` text, refusing unsupported model types by name. Without a
    /// `model_type`, the first `architectures` entry chooses the family.
    pub fn from_json_str(json: &str) -> crate::Result<Self> {
        let value: serde_json::Value = parse_json(json, "model")?;
        if !value.is_object() {
            let found = match value {
                serde_json::Value::Array(_) => "a list",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Bool(_) => "a boolean",
                _ => "null",
            };
            return Err(QmoeError::InvalidFile {
                file: "model config.json".into(),
                reason: format!("it holds {found}, not a JSON object of settings"),
            });
        }
        let model_type = value.get("model_type").and_then(|t| t.as_str());
        let arch = value
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str());
        let by_arch = arch.and_then(|a| ARCHITECTURES.iter().position(|&known| known == a));
        let kind = match (model_type, by_arch) {
            (Some(t), _) => t,
            (None, Some(i)) => SUPPORTED_MODEL_TYPES[i],
            (None, None) => {
                return Err(QmoeError::unsupported(
                    "architectures",
                    arch.unwrap_or("[]"),
                    format!(
                        "is not supported and model_type is absent (supported model types: \
                         {SUPPORTED_MODEL_TYPES:?})"
                    ),
                ))
            }
        };
        match kind {
            olmoe::MODEL_TYPE => Ok(Self::Olmoe(olmoe::Config::from_json_str(json)?)),
            qwen2_moe::MODEL_TYPE => Ok(Self::Qwen2Moe(qwen2_moe::Config::from_json_str(json)?)),
            qwen3_moe::MODEL_TYPE => Ok(Self::Qwen3Moe(qwen3_moe::Config::from_json_str(json)?)),
            mixtral::MODEL_TYPE => Ok(Self::Mixtral(mixtral::Config::from_json_str(json)?)),
            granitemoe::MODEL_TYPE => {
                Ok(Self::GraniteMoe(granitemoe::Config::from_json_str(json)?))
            }
            other => Err(QmoeError::unsupported(
                "model_type",
                other,
                format!("is not supported (supported: {SUPPORTED_MODEL_TYPES:?})"),
            )),
        }
    }

    /// Reads, parses and validates (see [`ModelConfig::spec`]) a `config.json` file; every
    /// error names the file.
    pub fn from_file(path: impl AsRef<Path>) -> crate::Result<Self> {
        let path = path.as_ref();
        let text = read_config_text(path)?;
        let config = Self::from_json_str(&text).and_then(|c| c.spec().map(|_| c));
        config.map_err(|e| naming_file(e, path))
    }

    /// The family's `model_type`.
    pub fn model_type(&self) -> &'static str {
        match self {
            Self::Olmoe(_) => olmoe::MODEL_TYPE,
            Self::Qwen2Moe(_) => qwen2_moe::MODEL_TYPE,
            Self::Qwen3Moe(_) => qwen3_moe::MODEL_TYPE,
            Self::Mixtral(_) => mixtral::MODEL_TYPE,
            Self::GraniteMoe(_) => granitemoe::MODEL_TYPE,
        }
    }

    /// The port's config, for what every family has.
    fn port(&self) -> (&CommonConfig, &dyn ModelConfig) {
        match self {
            Self::Olmoe(c) => (&c.common, c),
            Self::Qwen2Moe(c) => (&c.common, c),
            Self::Qwen3Moe(c) => (&c.common, c),
            Self::Mixtral(c) => (&c.common, c),
            Self::GraniteMoe(c) => (&c.common, c),
        }
    }

    /// The fields every family shares.
    pub fn common(&self) -> &CommonConfig {
        self.port().0
    }
}

impl ModelConfig for AnyConfig {
    fn spec(&self) -> crate::Result<ModelSpec> {
        self.port().1.spec()
    }
}
