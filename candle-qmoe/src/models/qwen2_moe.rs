//! Qwen2-MoE (`model_type: qwen2_moe`, `Qwen2MoeForCausalLM`): Qwen/Qwen1.5-MoE-A2.7B and -Chat.
//!
//! Layer `i` is a MoE block or a dense MLP of `intermediate_size` as [`SparseLayers`] says. MoE
//! blocks have routed experts of `moe_intermediate_size` plus a shared expert of
//! `shared_expert_intermediate_size` scaled by `sigmoid(shared_expert_gate(x))`. Attention has
//! q/k/v bias and a bias-free `o_proj`. Only the mapping from `config.json` lives here; the model
//! itself is the shared [`super::MoeForCausalLm`].

use serde::{Deserialize, Serialize};

use super::config::{
    AttentionSpec, CommonConfig, FamilyDefaults, FfnSpec, ModelConfig, ModelSpec, QkNorm,
};
use crate::QmoeError;

/// The `model_type` this port reads.
pub const MODEL_TYPE: &str = "qwen2_moe";

/// What transformers' `Qwen2MoeConfig` assumes for fields a `config.json` leaves out.
pub const DEFAULTS: FamilyDefaults = FamilyDefaults {
    rms_norm_eps: 1e-6,
    rope_theta: 10_000.0,
    num_key_value_heads: Some(16),
    max_position_embeddings: 32_768,
};

/// The `architectures` entry of this family.
pub const ARCHITECTURE: &str = "Qwen2MoeForCausalLM";

/// Which layers of a Qwen-MoE model (Qwen2-MoE, Qwen3-MoE) are sparse, and the size of their
/// routed experts: transformers' `Qwen2MoeDecoderLayer` rule, which `Qwen3MoeDecoderLayer`
/// keeps. Flattened into both ports' `Config`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct SparseLayers {
    /// Intermediate size of each routed expert.
    pub moe_intermediate_size: usize,
    /// Every `decoder_sparse_step`-th layer is sparse (default 1).
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    /// Layers that use a dense MLP whatever `decoder_sparse_step` says.
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Sliding-window attention is not implemented; `true` is refused.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
}

impl SparseLayers {
    /// Whether layer `i` is a MoE block: `i` is not in `mlp_only_layers`, the model has experts,
    /// and `(i + 1) % decoder_sparse_step == 0`.
    pub fn is_moe_layer(&self, common: &CommonConfig, i: usize) -> bool {
        let step = self.decoder_sparse_step.unwrap_or(1);
        let dense_only = self.mlp_only_layers.as_deref().unwrap_or(&[]);
        !dense_only.contains(&i)
            && common.num_experts > 0
            && step > 0
            && (i + 1).is_multiple_of(step)
    }

    /// Maps the config onto a [`ModelSpec`] with `attention`: layer `i` is a MoE block with a
    /// shared expert of `shared` (if any) when [`Self::is_moe_layer`], else a dense MLP of
    /// `intermediate_size`. Refuses `decoder_sparse_step = 0` and sliding-window attention.
    pub fn to_spec(
        &self,
        common: &CommonConfig,
        model_type: &str,
        defaults: &FamilyDefaults,
        attention: AttentionSpec,
        shared: Option<usize>,
    ) -> crate::Result<ModelSpec> {
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
        common.to_spec(model_type, defaults, attention, |i| {
            if self.is_moe_layer(common, i) {
                FfnSpec::Moe(common.moe(self.moe_intermediate_size, shared))
            } else {
                FfnSpec::Dense {
                    intermediate_size: common.intermediate_size,
                }
            }
        })
    }
}

/// A Qwen2-MoE `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// Fields every family shares.
    #[serde(flatten)]
    pub common: CommonConfig,
    /// The sparse layers and their experts' size.
    #[serde(flatten)]
    pub layers: SparseLayers,
    /// Intermediate size of the shared expert.
    pub shared_expert_intermediate_size: usize,
    /// Bias on q/k/v (default `true`, the only value Qwen1.5-MoE uses).
    #[serde(default)]
    pub qkv_bias: Option<bool>,
}

impl Config {
    /// Parses a `config.json` text.
    pub fn from_json_str(json: &str) -> crate::Result<Self> {
        super::parse_json(json, MODEL_TYPE)
    }
}

impl ModelConfig for Config {
    fn spec(&self) -> crate::Result<ModelSpec> {
        let attention = AttentionSpec {
            qkv_bias: self.qkv_bias.unwrap_or(true),
            o_bias: false,
            qk_norm: QkNorm::None,
            clip_qkv: None,
            scale: None,
        };
        let shared = Some(self.shared_expert_intermediate_size);
        self.layers
            .to_spec(&self.common, MODEL_TYPE, &DEFAULTS, attention, shared)
    }
}

/// The Qwen2-MoE causal LM: the shared trunk built from a Qwen2-MoE [`Config`].
pub type Model = super::MoeForCausalLm;
