//! OLMoE (`model_type: olmoe`, `OlmoeForCausalLM`): allenai/OLMoE-1B-7B-0924 and -0125 and their
//! Instruct variants.
//!
//! Every layer is a [`crate::SparseMoe`] block whose routed experts have `intermediate_size`;
//! attention applies RMSNorm over the full q and k projections, then the optional `clip_qkv`
//! clamp (that order, as in transformers' `OlmoeAttention`), then RoPE. Only the mapping from
//! `config.json` lives here; the model itself is the shared [`super::MoeForCausalLm`].

use serde::{Deserialize, Serialize};

use super::config::{
    AttentionSpec, CommonConfig, FamilyDefaults, FfnSpec, ModelConfig, ModelSpec, QkNorm,
};

/// The `model_type` this port reads.
pub const MODEL_TYPE: &str = "olmoe";

/// What transformers' `OlmoeConfig` assumes for fields a `config.json` leaves out.
pub const DEFAULTS: FamilyDefaults = FamilyDefaults {
    rms_norm_eps: 1e-5,
    rope_theta: 10_000.0,
    num_key_value_heads: None,
    max_position_embeddings: 4096,
};

/// The `architectures` entry of this family.
pub const ARCHITECTURE: &str = "OlmoeForCausalLM";

/// An OLMoE `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// Fields every family shares.
    #[serde(flatten)]
    pub common: CommonConfig,
    /// Clamp q, k, v to `[-clip_qkv, clip_qkv]` after the q/k norm.
    #[serde(default)]
    pub clip_qkv: Option<f64>,
    /// Bias on all four attention projections (default `false`).
    #[serde(default)]
    pub attention_bias: Option<bool>,
}

impl Config {
    /// Parses a `config.json` text.
    pub fn from_json_str(json: &str) -> crate::Result<Self> {
        super::parse_json(json, MODEL_TYPE)
    }
}

impl ModelConfig for Config {
    fn spec(&self) -> crate::Result<ModelSpec> {
        let c = &self.common;
        let bias = self.attention_bias.unwrap_or(false);
        let attention = AttentionSpec {
            clip_qkv: self.clip_qkv,
            ..AttentionSpec::with_bias(bias, QkNorm::Projection)
        };
        c.to_spec(MODEL_TYPE, &DEFAULTS, attention, |_| {
            FfnSpec::Moe(c.moe(c.intermediate_size, None))
        })
    }
}

/// The OLMoE causal LM: the shared trunk built from an OLMoE [`Config`].
pub type Model = super::MoeForCausalLm;
