//! GraniteMoE (`model_type: granitemoe`, `GraniteMoeForCausalLM`): ibm-granite/granite-3.0 and
//! granite-3.1 `-1b-a400m` and `-3b-a800m`, base and instruct.
//!
//! Mixtral's layout with four scalars: the embeddings are multiplied by `embedding_multiplier`,
//! each attention and MoE output by `residual_multiplier` before its residual add, the attention
//! scores by `attention_multiplier` (instead of `1 / sqrt(head_dim)`), and the logits divided by
//! `logits_scaling` ([`Multipliers`], [`AttentionSpec::scale`]). Every layer is a MoE block named
//! `block_sparse_moe` whose router is `router.layer` and whose experts are stored fused:
//! `input_linear.weight [E, 2I, H]` (each expert's gate rows, then its up rows) and
//! `output_linear.weight [E, H, I]` ([`MoeNames::GRANITE`]); routing takes the top-k router
//! logits and a softmax over them (`norm_topk_prob: true`). Embeddings are usually tied. Only the
//! mapping from `config.json` lives here; the model itself is the shared
//! [`super::MoeForCausalLm`].

use serde::{Deserialize, Serialize};

use super::config::{
    AttentionSpec, CommonConfig, FamilyDefaults, FfnSpec, ModelConfig, ModelSpec, MoeNames,
    MoeSpec, Multipliers, QkNorm,
};

/// The `model_type` this port reads.
pub const MODEL_TYPE: &str = "granitemoe";

/// What transformers' `GraniteMoeConfig` assumes for fields a `config.json` leaves out.
pub const DEFAULTS: FamilyDefaults = FamilyDefaults {
    rms_norm_eps: 1e-6,
    rope_theta: 10_000.0,
    num_key_value_heads: None,
    max_position_embeddings: 2048,
};

/// The `architectures` entry of this family.
pub const ARCHITECTURE: &str = "GraniteMoeForCausalLM";

/// A GraniteMoE `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// Fields every family shares (the expert count as `num_local_experts`).
    #[serde(flatten)]
    pub common: CommonConfig,
    /// Bias on all four attention projections (default `false`).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Multiplies the token embeddings (default 1).
    #[serde(default)]
    pub embedding_multiplier: Option<f64>,
    /// Multiplies each attention and MoE output before the residual add (default 1).
    #[serde(default)]
    pub residual_multiplier: Option<f64>,
    /// The attention scores' factor, in place of `1 / sqrt(head_dim)` (default 1).
    #[serde(default)]
    pub attention_multiplier: Option<f64>,
    /// Divides the logits (default 1).
    #[serde(default)]
    pub logits_scaling: Option<f64>,
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
        let attention = AttentionSpec {
            scale: Some(self.attention_multiplier.unwrap_or(1.0)),
            ..AttentionSpec::with_bias(self.attention_bias.unwrap_or(false), QkNorm::None)
        };
        let moe = MoeSpec {
            norm_topk_prob: true,
            names: MoeNames::GRANITE,
            ..c.moe(c.intermediate_size, None)
        };
        let spec = c.to_spec(MODEL_TYPE, &DEFAULTS, attention, |_| {
            FfnSpec::Moe(moe.clone())
        })?;
        // `to_spec` knows no multipliers: set them, then check the whole again.
        let spec = ModelSpec {
            multipliers: Multipliers {
                embedding: self.embedding_multiplier.unwrap_or(1.0),
                residual: self.residual_multiplier.unwrap_or(1.0),
                logits_divisor: self.logits_scaling.unwrap_or(1.0),
            },
            ..spec
        };
        spec.validate()?;
        Ok(spec)
    }
}

/// The GraniteMoE causal LM: the shared trunk built from a GraniteMoE [`Config`].
pub type Model = super::MoeForCausalLm;
