//! Qwen2-MoE (`model_type: qwen2_moe`, `Qwen2MoeForCausalLM`): Qwen/Qwen1.5-MoE-A2.7B and -Chat.
//!
//! Layer `i` is a MoE block when `i` is not in `mlp_only_layers` and
//! `(i + 1) % decoder_sparse_step == 0`, otherwise a dense MLP of `intermediate_size`. MoE blocks
//! have routed experts of `moe_intermediate_size` plus a shared expert of
//! `shared_expert_intermediate_size` scaled by `sigmoid(shared_expert_gate(x))`. Attention has
//! q/k/v bias and a bias-free `o_proj`. Only the mapping from `config.json` lives here; the model
//! itself is the shared [`super::MoeForCausalLm`].

use serde::{Deserialize, Serialize};

use super::config::{AttentionSpec, CommonConfig, FfnSpec, ModelConfig, ModelSpec};
use crate::QmoeError;

/// The `model_type` this port reads.
pub const MODEL_TYPE: &str = "qwen2_moe";

/// A Qwen2-MoE `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// Fields shared with OLMoE.
    #[serde(flatten)]
    pub common: CommonConfig,
    /// Intermediate size of each routed expert.
    pub moe_intermediate_size: usize,
    /// Intermediate size of the shared expert.
    pub shared_expert_intermediate_size: usize,
    /// Every `decoder_sparse_step`-th layer is sparse (default 1).
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    /// Layers that use a dense MLP whatever `decoder_sparse_step` says.
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Bias on q/k/v (default `true`, the only value Qwen1.5-MoE uses).
    #[serde(default)]
    pub qkv_bias: Option<bool>,
    /// Sliding-window attention is not implemented; `true` is refused.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
}

impl Config {
    /// Parses a `config.json` text.
    pub fn from_json_str(json: &str) -> crate::Result<Self> {
        super::parse_json(json, MODEL_TYPE)
    }

    /// Whether layer `i` is a MoE block (transformers' `Qwen2MoeDecoderLayer` rule).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        let step = self.decoder_sparse_step.unwrap_or(1);
        let dense_only = self.mlp_only_layers.as_deref().unwrap_or(&[]);
        !dense_only.contains(&i)
            && self.common.num_experts > 0
            && step > 0
            && (i + 1).is_multiple_of(step)
    }
}

impl ModelConfig for Config {
    fn spec(&self) -> crate::Result<ModelSpec> {
        if self.decoder_sparse_step == Some(0) {
            return Err(QmoeError::unsupported(
                "decoder_sparse_step",
                0,
                "must be > 0",
            ));
        }
        if self.use_sliding_window == Some(true) {
            return Err(QmoeError::unsupported(
                "use_sliding_window",
                true,
                "is not supported",
            ));
        }
        let c = &self.common;
        let attention = AttentionSpec {
            qkv_bias: self.qkv_bias.unwrap_or(true),
            o_bias: false,
            qk_norm: false,
            clip_qkv: None,
        };
        c.to_spec(MODEL_TYPE, 1e-6, attention, |i| {
            if self.is_moe_layer(i) {
                c.moe(
                    self.moe_intermediate_size,
                    Some(self.shared_expert_intermediate_size),
                )
            } else {
                FfnSpec::Dense {
                    intermediate_size: c.intermediate_size,
                }
            }
        })
    }
}

/// The Qwen2-MoE causal LM: the shared trunk built from a Qwen2-MoE [`Config`].
pub type Model = super::MoeForCausalLm;
