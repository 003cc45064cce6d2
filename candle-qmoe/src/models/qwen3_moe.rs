//! Qwen3-MoE (`model_type: qwen3_moe`, `Qwen3MoeForCausalLM`): Qwen/Qwen3-30B-A3B,
//! Qwen3-235B-A22B and their variants.
//!
//! Sparse and dense layers follow Qwen2-MoE's rule ([`SparseLayers`]), without a shared expert;
//! `norm_topk_prob` says whether the top-k weights are renormalised. Attention applies RMSNorm
//! to each head of q and k (`q_norm`/`k_norm` of size `head_dim`, which need not be
//! `hidden_size / num_attention_heads`) before RoPE, with `attention_bias` on all four
//! projections. Only the mapping from `config.json` lives here; the model itself is the shared
//! [`super::MoeForCausalLm`].

use serde::{Deserialize, Serialize};

use super::config::{AttentionSpec, CommonConfig, FamilyDefaults, ModelConfig, ModelSpec, QkNorm};
use super::qwen2_moe::SparseLayers;

/// The `model_type` this port reads.
pub const MODEL_TYPE: &str = "qwen3_moe";

/// What transformers' `Qwen3MoeConfig` assumes for fields a `config.json` leaves out.
pub const DEFAULTS: FamilyDefaults = FamilyDefaults {
    rms_norm_eps: 1e-6,
    rope_theta: 10_000.0,
    num_key_value_heads: Some(4),
    max_position_embeddings: 32_768,
};

/// The `architectures` entry of this family.
pub const ARCHITECTURE: &str = "Qwen3MoeForCausalLM";

/// A Qwen3-MoE `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// Fields every family shares.
    #[serde(flatten)]
    pub common: CommonConfig,
    /// The sparse layers and their experts' size.
    #[serde(flatten)]
    pub layers: SparseLayers,
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
        let bias = self.attention_bias.unwrap_or(false);
        let attention = AttentionSpec::with_bias(bias, QkNorm::PerHead);
        self.layers
            .to_spec(&self.common, MODEL_TYPE, &DEFAULTS, attention, None)
    }
}

/// The Qwen3-MoE causal LM: the shared trunk built from a Qwen3-MoE [`Config`].
pub type Model = super::MoeForCausalLm;
