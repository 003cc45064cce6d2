//! Mixtral (`model_type: mixtral`, `MixtralForCausalLM`): mistralai/Mixtral-8x7B and -8x22B and
//! their Instruct variants.
//!
//! Every layer is a MoE block named `block_sparse_moe` whose experts are `w1` (gate), `w3` (up)
//! and `w2` (down) of `intermediate_size` ([`MoeNames::MIXTRAL`]); routing takes the top-k of
//! the router logits and a softmax over them, which is softmax → top-k → renormalise. Attention
//! is plain GQA without bias or q/k norm. Sliding-window attention (a `sliding_window` shorter
//! than `max_position_embeddings`) is not implemented and refused. Only the mapping from
//! `config.json` lives here; the model itself is the shared [`super::MoeForCausalLm`].

use serde::{Deserialize, Serialize};

use super::config::{
    AttentionSpec, CommonConfig, FamilyDefaults, FfnSpec, ModelConfig, ModelSpec, MoeNames,
    MoeSpec, QkNorm,
};
use crate::QmoeError;

/// The `model_type` this port reads.
pub const MODEL_TYPE: &str = "mixtral";

/// What transformers' `MixtralConfig` assumes for fields a `config.json` leaves out.
pub const DEFAULTS: FamilyDefaults = FamilyDefaults {
    rms_norm_eps: 1e-5,
    rope_theta: 1_000_000.0,
    num_key_value_heads: Some(8),
    max_position_embeddings: 131_072,
};

/// The `architectures` entry of this family.
pub const ARCHITECTURE: &str = "MixtralForCausalLM";

/// A Mixtral `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// Fields every family shares (the expert count as `num_local_experts`).
    #[serde(flatten)]
    pub common: CommonConfig,
    /// Sliding-window size; only `null`, absent or at least `max_position_embeddings` (full
    /// attention, all three) is supported.
    #[serde(default)]
    pub sliding_window: Option<serde_json::Value>,
}

impl Config {
    /// Parses a `config.json` text.
    pub fn from_json_str(json: &str) -> crate::Result<Self> {
        super::parse_json_with_local_experts(json, MODEL_TYPE)
    }
}

impl ModelConfig for Config {
    fn spec(&self) -> crate::Result<ModelSpec> {
        let c = &self.common;
        let attention = AttentionSpec::with_bias(false, QkNorm::None);
        let moe = MoeSpec {
            norm_topk_prob: true,
            names: MoeNames::MIXTRAL,
            ..c.moe(c.intermediate_size, None)
        };
        let spec = c.to_spec(MODEL_TYPE, &DEFAULTS, attention, |_| {
            FfnSpec::Moe(moe.clone())
        })?;
        // A window at least as long as the longest sequence is full attention.
        let max_positions = spec.max_position_embeddings;
        let full = |w: &serde_json::Value| w.as_u64().is_some_and(|w| w >= max_positions as u64);
        if let Some(w) = self.sliding_window.as_ref().filter(|w| !full(w)) {
            return Err(QmoeError::unsupported(
                "sliding_window",
                w,
                format!(
                    "is not supported (only full attention: `sliding_window: null`, or a window \
                     of at least max_position_embeddings = {max_positions})"
                ),
            ));
        }
        Ok(spec)
    }
}

/// The Mixtral causal LM: the shared trunk built from a Mixtral [`Config`].
pub type Model = super::MoeForCausalLm;
