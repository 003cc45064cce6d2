//! The architecture every port shares, in one vocabulary: [`ModelSpec`].
//!
//! Each port's `Config` reads a Hugging Face `config.json` (fields common to all families live
//! in [`CommonConfig`], flattened into each port's struct) and maps it onto a [`ModelSpec`], which
//! is validated once here and drives the shared trunk ([`super::MoeForCausalLm`]).

use serde::{Deserialize, Serialize};

use crate::pack::ExpertNames;
use crate::QmoeError;

/// Something that describes a model the shared trunk can build: the ports' `Config`s,
/// [`super::AnyConfig`], or a [`ModelSpec`] itself.
pub trait ModelConfig {
    /// The validated architecture.
    fn spec(&self) -> crate::Result<ModelSpec>;
}

/// Where the q and k RMSNorm of attention applies, if anywhere.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QkNorm {
    /// No q/k norm (Qwen2-MoE, Mixtral).
    #[default]
    None,
    /// Over the full q and k projections, before the heads are split (OLMoE): weights
    /// `[heads · head_dim]` and `[kv_heads · head_dim]`.
    Projection,
    /// Over each head's `head_dim` values, one weight `[head_dim]` shared by all heads (Qwen3-MoE).
    PerHead,
}

/// Attention options that differ between the families.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Bias on `q_proj`, `k_proj` and `v_proj` (Qwen2-MoE; OLMoE's and Qwen3-MoE's
    /// `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on `o_proj` (OLMoE's and Qwen3-MoE's `attention_bias`; never for Qwen2-MoE).
    pub o_bias: bool,
    /// The RMSNorm of q and k before RoPE (`self_attn.{q,k}_norm`).
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to `[-c, c]` after the q/k norm (OLMoE's `clip_qkv`).
    pub clip_qkv: Option<f64>,
    /// The factor of the attention scores `q·k`; `None` is `1 / sqrt(head_dim)` (GraniteMoE's
    /// `attention_multiplier` replaces it).
    pub scale: Option<f64>,
}

impl AttentionSpec {
    /// Transformers' `attention_bias` convention: a bias on all four projections or on none,
    /// with the given q/k norm and no clamp.
    pub fn with_bias(attention_bias: bool, qk_norm: QkNorm) -> Self {
        Self {
            qkv_bias: attention_bias,
            o_bias: attention_bias,
            qk_norm,
            clip_qkv: None,
            scale: None,
        }
    }

    /// The factor of the attention scores for heads of `head_dim`: [`Self::scale`], else
    /// `1 / sqrt(head_dim)`.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
    }
}

/// The scalar multipliers some families put around the decoder stack (GraniteMoE's
/// `embedding_multiplier`, `residual_multiplier` and `logits_scaling`); all 1 elsewhere.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Multipliers {
    /// The token embeddings are multiplied by this before the first layer.
    pub embedding: f64,
    /// Each attention and feed-forward output is multiplied by this before it is added to
    /// the residual stream.
    pub residual: f64,
    /// The logits are divided by this (transformers' `logits_scaling`).
    pub logits_divisor: f64,
}

impl Multipliers {
    /// No scaling: 1, 1, 1.
    pub const NONE: Self = Self {
        embedding: 1.0,
        residual: 1.0,
        logits_divisor: 1.0,
    };
}

impl Default for Multipliers {
    fn default() -> Self {
        Self::NONE
    }
}

/// How a MoE block stores its routed experts' weights in a checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertStorage {
    /// One tensor per expert and projection: `experts.{e}.{gate,up,down}.weight`, with the
    /// projection names of [`MoeNames::experts`] (OLMoE, Qwen-MoE, Mixtral).
    #[default]
    PerExpert,
    /// Every expert of the block in two 3-D tensors: `{gate_up}.weight [E, 2I, H]`, each
    /// expert's gate rows `0..I` then its up rows `I..2I`, and `{down}.weight [E, H, I]`
    /// (GraniteMoE's `input_linear` and `output_linear`).
    Fused {
        /// The stacked gate and up projections, inside the block.
        gate_up: &'static str,
        /// The down projections, inside the block.
        down: &'static str,
    },
}

impl ExpertStorage {
    /// Where the gate `[I, H]`, up `[I, H]` and down `[H, I]` weights of expert `e` of the MoE
    /// block `block` (its full prefix, e.g. `model.layers.3.mlp`) lie, and their shapes, for a
    /// model of `hidden` size and experts of `intermediate` rows, `names` naming the
    /// projections of [`Self::PerExpert`] experts.
    pub fn expert_tensors(
        &self,
        block: &str,
        names: ExpertNames,
        e: usize,
        hidden: usize,
        intermediate: usize,
    ) -> [ExpertTensor; 3] {
        let shapes = [
            [intermediate, hidden],
            [intermediate, hidden],
            [hidden, intermediate],
        ];
        let (mut names, fused) = match *self {
            Self::PerExpert => (names.weights(&ExpertNames::expert(block, e)), [None; 3]),
            Self::Fused { gate_up, down } => {
                let rows = |first_row| {
                    Some(FusedRows {
                        expert: e,
                        first_row,
                    })
                };
                (
                    [gate_up, gate_up, down].map(|t| format!("{block}.{t}.weight")),
                    [rows(0), rows(intermediate), rows(0)],
                )
            }
        };
        std::array::from_fn(|j| ExpertTensor {
            name: std::mem::take(&mut names[j]),
            shape: shapes[j],
            fused: fused[j],
        })
    }
}

/// Where one expert projection lies in a checkpoint: a whole 2-D tensor, or rows of one
/// expert of a fused 3-D tensor ([`ExpertStorage::Fused`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertTensor {
    /// The stored tensor's full name.
    pub name: String,
    /// The projection's `[rows, cols]`: gate and up `[I, H]`, down `[H, I]`.
    pub shape: [usize; 2],
    /// For a fused tensor `[E, R, C]`: the expert (index along the first dimension) and the
    /// first of its rows that this projection takes.
    pub fused: Option<FusedRows>,
}

/// A projection's place in a fused 3-D expert tensor (see [`ExpertTensor`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedRows {
    /// The expert: the index along the tensor's first dimension.
    pub expert: usize,
    /// The projection's first row within the expert's matrix.
    pub first_row: usize,
}

impl std::fmt::Display for ExpertTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.fused {
            None => write!(f, "{}", self.name),
            Some(FusedRows { expert, first_row }) => {
                let end = first_row + self.shape[0];
                write!(f, "{}[{expert}, {first_row}..{end}]", self.name)
            }
        }
    }
}

/// Where a family keeps a MoE block's tensors in a checkpoint: the block
/// `model.layers.{i}.{block}` holds the router `gate.weight`, the routed experts
/// `experts.{e}.{projection}.weight` and, when there is one, the shared expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeNames {
    /// The block inside a decoder layer (`mlp`; Mixtral `block_sparse_moe`).
    pub block: &'static str,
    /// The routed experts' projections.
    pub experts: ExpertNames,
    /// The router inside the block (`gate`; GraniteMoE `router.layer`), whose `weight` is
    /// `[E, H]`.
    pub router: &'static str,
    /// How the routed experts are stored.
    pub storage: ExpertStorage,
}

impl MoeNames {
    /// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj` (OLMoE, Qwen2-MoE, Qwen3-MoE).
    pub const MLP: Self = Self {
        block: "mlp",
        experts: ExpertNames::PROJ,
        router: "gate",
        storage: ExpertStorage::PerExpert,
    };
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}` (Mixtral).
    pub const MIXTRAL: Self = Self {
        block: "block_sparse_moe",
        experts: ExpertNames::MIXTRAL,
        router: "gate",
        storage: ExpertStorage::PerExpert,
    };
    /// `block_sparse_moe.router.layer`, every expert fused in `block_sparse_moe.input_linear`
    /// (gate and up) and `block_sparse_moe.output_linear` (down) (GraniteMoE). No tensor has
    /// the projection names: messages name an expert's part by the fused tensor, its expert
    /// and rows (`input_linear.weight[7, 512..1024]`, see [`ExpertTensor`]).
    pub const GRANITE: Self = Self {
        block: "block_sparse_moe",
        experts: ExpertNames {
            gate: "gate",
            up: "up",
            down: "down",
        },
        router: "router.layer",
        storage: ExpertStorage::Fused {
            gate_up: "input_linear",
            down: "output_linear",
        },
    };

    /// The MoE block of decoder layer `layer`: `model.layers.{layer}.{block}`.
    pub fn block_prefix(&self, layer: usize) -> String {
        format!("model.layers.{layer}.{}", self.block)
    }

    /// The router weight of decoder layer `layer`.
    pub fn router_weight(&self, layer: usize) -> String {
        format!("{}.{}.weight", self.block_prefix(layer), self.router)
    }

    /// The weights of expert `e` of decoder layer `layer` when each expert has tensors of its
    /// own ([`ExpertStorage::PerExpert`]): gate, up, down. For any storage use
    /// [`Self::expert_tensors`].
    pub fn expert_weights(&self, layer: usize, e: usize) -> [String; 3] {
        let expert = ExpertNames::expert(&self.block_prefix(layer), e);
        self.experts.weights(&expert)
    }

    /// Where the gate `[I, H]`, up `[I, H]` and down `[H, I]` weights of expert `e` of decoder
    /// layer `layer` lie, and their shapes, for a model of `hidden` size and experts of
    /// `intermediate` rows: what every reader of a checkpoint's experts uses (the oracle, INT4
    /// at load, the quantizer, the fingerprint).
    pub fn expert_tensors(
        &self,
        layer: usize,
        e: usize,
        hidden: usize,
        intermediate: usize,
    ) -> [ExpertTensor; 3] {
        self.storage.expert_tensors(
            &self.block_prefix(layer),
            self.experts,
            e,
            hidden,
            intermediate,
        )
    }
}

/// A routed MoE block.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Intermediate size of each routed expert.
    pub intermediate_size: usize,
    /// Renormalise the top-k probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Intermediate size of the sigmoid-gated shared expert, when there is one (Qwen2-MoE).
    pub shared_intermediate_size: Option<usize>,
    /// The tensor names of the block.
    pub names: MoeNames,
}

impl MoeSpec {
    /// [`MoeNames::expert_tensors`] of expert `e` of decoder layer `layer` in a model of
    /// `hidden` size.
    pub fn expert_tensors(&self, layer: usize, e: usize, hidden: usize) -> [ExpertTensor; 3] {
        self.names
            .expert_tensors(layer, e, hidden, self.intermediate_size)
    }
}

/// The feed-forward part of one decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub enum FfnSpec {
    /// A dense gated SiLU MLP (`mlp.{gate,up,down}_proj`).
    Dense {
        /// Its intermediate size.
        intermediate_size: usize,
    },
    /// A sparse MoE block (`{block}.gate`, `{block}.experts.{e}.*`, optional
    /// `{block}.shared_expert*`; see [`MoeNames`]).
    Moe(MoeSpec),
}

/// A decoder-only MoE transformer in the shared vocabulary of the ports.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Family name used in messages (`olmoe`, `qwen2_moe`, `qwen3_moe`, `mixtral`).
    pub model_type: String,
    /// Vocabulary size (rows of `embed_tokens` and `lm_head`).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Longest sequence (prompt plus generated tokens) the model accepts.
    pub max_position_embeddings: usize,
    /// `lm_head` shares `embed_tokens`' weights.
    pub tie_word_embeddings: bool,
    /// Attention options.
    pub attention: AttentionSpec,
    /// Scalars around the decoder stack (all 1 but for GraniteMoE).
    pub multipliers: Multipliers,
    /// One entry per decoder layer.
    pub layers: Vec<FfnSpec>,
}

/// Most decoder layers a config may declare (released MoE models have fewer than 100): the
/// per-layer specs are built before any weight is read, so a damaged `num_hidden_layers` must not
/// size an allocation.
pub const MAX_LAYERS: usize = 1 << 12;

/// Most elements of each rotary table (`max_position_embeddings × head_dim / 2`, F32), which
/// grows with the positions used up to that size: 2³¹, i.e. 8 GiB, beyond the 1M-token contexts
/// of released models with 128-wide heads.
pub const MAX_ROTARY_ELEMENTS: usize = 1 << 31;

/// Refuses more than [`MAX_LAYERS`] decoder layers.
fn check_layer_count(layers: usize) -> crate::Result<()> {
    if layers > MAX_LAYERS {
        return Err(QmoeError::unsupported(
            "num_hidden_layers",
            layers,
            format!("exceeds the supported {MAX_LAYERS}"),
        ));
    }
    Ok(())
}

impl ModelSpec {
    /// Checks that the numbers are consistent; every problem is a
    /// [`QmoeError::UnsupportedConfig`].
    pub fn validate(&self) -> crate::Result<()> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
            ("num_hidden_layers", self.layers.len()),
        ] {
            if v == 0 {
                return Err(QmoeError::unsupported(name, v, "must be > 0"));
            }
        }
        check_layer_count(self.layers.len())?;
        let rotary = self.max_position_embeddings.checked_mul(self.head_dim / 2);
        if rotary.is_none_or(|n| n > MAX_ROTARY_ELEMENTS) {
            return Err(QmoeError::unsupported(
                "max_position_embeddings",
                self.max_position_embeddings,
                format!(
                    "× head_dim = {} needs rotary tables larger than the supported \
                     {MAX_ROTARY_ELEMENTS} elements",
                    self.head_dim
                ),
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(QmoeError::unsupported(
                "num_key_value_heads",
                self.num_kv_heads,
                format!("does not divide num_attention_heads = {}", self.num_heads),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(QmoeError::unsupported(
                "head_dim",
                self.head_dim,
                "must be even for rotary embeddings",
            ));
        }
        if self.attention.qk_norm == QkNorm::Projection
            && self.num_heads * self.head_dim != self.hidden_size
        {
            return Err(QmoeError::unsupported(
                "hidden_size",
                self.hidden_size,
                format!(
                    "must be num_attention_heads × head_dim = {} × {} for the q/k norm",
                    self.num_heads, self.head_dim
                ),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(QmoeError::unsupported(
                "rope_theta",
                self.rope_theta,
                "must be a positive number",
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(QmoeError::unsupported(
                "rms_norm_eps",
                self.rms_norm_eps,
                "must be a positive number",
            ));
        }
        if let Some(c) = self.attention.clip_qkv {
            if !(c.is_finite() && c > 0.0) {
                return Err(QmoeError::unsupported(
                    "clip_qkv",
                    c,
                    "must be a positive number",
                ));
            }
        }
        let m = &self.multipliers;
        for (name, v) in [
            ("attention_multiplier", self.attention.scale.unwrap_or(1.0)),
            ("embedding_multiplier", m.embedding),
            ("residual_multiplier", m.residual),
            ("logits_scaling", m.logits_divisor),
        ] {
            if !(v.is_finite() && v != 0.0) {
                return Err(QmoeError::unsupported(
                    name,
                    v,
                    "must be a finite, non-zero number",
                ));
            }
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let (inter, what) = match layer {
                FfnSpec::Dense { intermediate_size } => (*intermediate_size, "intermediate_size"),
                FfnSpec::Moe(m) => {
                    if m.num_experts == 0 {
                        return Err(QmoeError::unsupported(
                            "num_experts",
                            0,
                            format!("but layer {i} is a MoE layer"),
                        ));
                    }
                    if m.top_k == 0 || m.top_k > m.num_experts {
                        return Err(QmoeError::unsupported(
                            "num_experts_per_tok",
                            m.top_k,
                            format!("must be between 1 and num_experts = {}", m.num_experts),
                        ));
                    }
                    if m.shared_intermediate_size == Some(0) {
                        return Err(QmoeError::unsupported(
                            "shared_expert_intermediate_size",
                            0,
                            "must be > 0",
                        ));
                    }
                    (m.intermediate_size, "expert intermediate size")
                }
            };
            if inter == 0 {
                return Err(QmoeError::unsupported(
                    what,
                    0,
                    format!("must be > 0 (layer {i})"),
                ));
            }
        }
        if self.moe_blocks().next().is_none() {
            return Err(no_moe_layer(&self.model_type));
        }
        Ok(())
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The routed-expert settings every MoE layer shares (what one expert pack describes); an
    /// error when the model has no MoE layer or its MoE layers differ.
    pub fn uniform_moe(&self) -> crate::Result<&MoeSpec> {
        let mut moe = self.moe_blocks().map(|(_, m)| m);
        let first = moe.next().ok_or_else(|| no_moe_layer(&self.model_type))?;
        if moe.any(|m| m != first) {
            return Err(QmoeError::unsupported(
                "model_type",
                &self.model_type,
                "with MoE layers of different expert shapes (they cannot share one expert pack)",
            ));
        }
        Ok(first)
    }

    /// The sizes of the q and k norm weights, when attention has them (see [`QkNorm`]).
    pub fn qk_norm_sizes(&self) -> Option<(usize, usize)> {
        let d = self.head_dim;
        match self.attention.qk_norm {
            QkNorm::None => None,
            QkNorm::Projection => Some((self.num_heads * d, self.num_kv_heads * d)),
            QkNorm::PerHead => Some((d, d)),
        }
    }

    /// The MoE blocks as `(layer index, spec)`, in layer order.
    pub fn moe_blocks(&self) -> impl Iterator<Item = (usize, &MoeSpec)> {
        self.layers.iter().enumerate().filter_map(|(i, l)| match l {
            FfnSpec::Moe(m) => Some((i, m)),
            FfnSpec::Dense { .. } => None,
        })
    }

    /// Indices of the MoE layers, in order.
    pub fn moe_layers(&self) -> Vec<usize> {
        self.moe_blocks().map(|(i, _)| i).collect()
    }
}

/// The error of a model whose every layer is dense: nothing for an expert pack to hold.
fn no_moe_layer(model_type: &str) -> QmoeError {
    QmoeError::unsupported(
        "model_type",
        model_type,
        "with no MoE layer: every decoder layer is dense (num_experts is 0, or \
         decoder_sparse_step and mlp_only_layers leave no sparse layer); candle-qmoe runs \
         mixture-of-experts models",
    )
}

impl ModelConfig for ModelSpec {
    fn spec(&self) -> crate::Result<ModelSpec> {
        self.validate()?;
        Ok(self.clone())
    }
}

/// What a family's transformers config class assumes for the fields a `config.json` may leave
/// out, so that an absent field means what it means to transformers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FamilyDefaults {
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (Mixtral's `default_theta` is 10⁶, the others' 10⁴).
    pub rope_theta: f64,
    /// Key/value heads; `None` means `num_attention_heads` (OLMoE).
    pub num_key_value_heads: Option<usize>,
    /// Longest sequence.
    pub max_position_embeddings: usize,
}

/// Refuses a RoPE type other than `default` (the only one the ports implement).
fn check_rope_type(rope_type: &str) -> crate::Result<()> {
    if rope_type == "default" {
        return Ok(());
    }
    Err(QmoeError::unsupported(
        "rope_type",
        rope_type,
        "is not supported (only the default RoPE)",
    ))
}

/// The newer transformers spelling of the RoPE settings (`rope_parameters`).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct RopeParameters {
    /// RoPE base.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// `default` is the only type the ports implement.
    #[serde(default)]
    pub rope_type: Option<String>,
    /// The older spelling of `rope_type`, read the same way.
    #[serde(default, rename = "type")]
    pub legacy_type: Option<String>,
}

/// The `config.json` fields every family shares; each port flattens it into its `Config`.
///
/// Optional fields are `Option` so that both an absent key and an explicit `null` are accepted.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct CommonConfig {
    /// The family (`olmoe`, `qwen2_moe`, …); checked against the port that reads it.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Intermediate size of dense MLPs (OLMoE, Mixtral: of each routed expert).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads; absent means the family's default ([`FamilyDefaults`]).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head size; absent means `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Longest sequence the model accepts; absent means the family's default.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// RMSNorm epsilon (family default when absent).
    #[serde(default)]
    pub rms_norm_eps: Option<f64>,
    /// RoPE base (older spelling).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE settings (newer spelling, `rope_parameters.rope_theta`).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Only `null` or a `default` RoPE type is supported (see [`Self::rope_theta`]).
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// `lm_head` shares the embedding weights (default `false`).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Routed experts per MoE layer (also read as `num_local_experts`, the Mixtral and
    /// transformers 5 spelling).
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    /// Experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Renormalise the top-k probabilities (default `false`).
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// Activation; only `silu` (or its other name `swish`) is supported.
    #[serde(default)]
    pub hidden_act: Option<String>,
}

impl CommonConfig {
    /// The RoPE base, as transformers 5 reads it: from `rope_scaling` when it is set (it
    /// replaces `rope_parameters`), else from `rope_parameters`, else the top-level
    /// `rope_theta`, else `default` (the family's). RoPE scaling is not implemented: a RoPE type
    /// (`rope_type`, or `type` in older configs) other than `default` is a
    /// [`QmoeError::UnsupportedConfig`] naming the type, or naming `rope_scaling` when it gives
    /// none.
    pub fn rope_theta(&self, default: f64) -> crate::Result<f64> {
        // `null` and `{}` are unset, as transformers takes them.
        let scaling = self
            .rope_scaling
            .as_ref()
            .filter(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()));
        if let Some(v) = scaling {
            let rope_type = v
                .get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(|t| t.as_str())
                .ok_or_else(|| {
                    QmoeError::unsupported(
                        "rope_scaling",
                        v,
                        "names no RoPE type (only the default RoPE is supported)",
                    )
                })?;
            check_rope_type(rope_type)?;
            let theta = v.get("rope_theta").and_then(|t| t.as_f64());
            return Ok(theta.or(self.rope_theta).unwrap_or(default));
        }
        let params = self.rope_parameters.as_ref();
        if let Some(rope_type) =
            params.and_then(|p| p.rope_type.as_ref().or(p.legacy_type.as_ref()))
        {
            check_rope_type(rope_type)?;
        }
        Ok(params
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(default))
    }

    /// Maps the shared fields onto a [`ModelSpec`] and validates it.
    ///
    /// `expected_type` is the port's `model_type`; `defaults` what it assumes for absent fields;
    /// `layer` gives the feed-forward block of each layer index.
    pub fn to_spec(
        &self,
        expected_type: &str,
        defaults: &FamilyDefaults,
        attention: AttentionSpec,
        layer: impl Fn(usize) -> FfnSpec,
    ) -> crate::Result<ModelSpec> {
        if let Some(t) = self.model_type.as_deref().filter(|t| *t != expected_type) {
            return Err(QmoeError::unsupported(
                "model_type",
                t,
                format!("is not supported by the `{expected_type}` port"),
            ));
        }
        // `swish` is transformers' other name for SiLU.
        if let Some(act) = self
            .hidden_act
            .as_deref()
            .filter(|a| !matches!(*a, "silu" | "swish"))
        {
            return Err(QmoeError::unsupported(
                "hidden_act",
                act,
                "is not supported (only silu, also called swish)",
            ));
        }
        // Checked before the per-layer specs are built.
        check_layer_count(self.num_hidden_layers)?;
        let heads = self.num_attention_heads;
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if heads == 0 || !self.hidden_size.is_multiple_of(heads) => {
                return Err(QmoeError::unsupported(
                    "num_attention_heads",
                    heads,
                    format!("does not divide hidden_size = {}", self.hidden_size),
                ))
            }
            None => self.hidden_size / heads,
        };
        if let (None, Some(kv)) = (self.num_key_value_heads, defaults.num_key_value_heads) {
            if kv == 0 || !heads.is_multiple_of(kv) {
                return Err(QmoeError::unsupported(
                    "num_key_value_heads",
                    kv,
                    format!(
                        "(transformers' default for `{expected_type}`, as config.json gives \
                         none) does not divide num_attention_heads = {heads}"
                    ),
                ));
            }
        }
        let spec = ModelSpec {
            model_type: expected_type.to_string(),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_heads: heads,
            num_kv_heads: self
                .num_key_value_heads
                .or(defaults.num_key_value_heads)
                .unwrap_or(heads),
            head_dim,
            rms_norm_eps: self.rms_norm_eps.unwrap_or(defaults.rms_norm_eps),
            rope_theta: self.rope_theta(defaults.rope_theta)?,
            max_position_embeddings: self
                .max_position_embeddings
                .unwrap_or(defaults.max_position_embeddings),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            attention,
            multipliers: Multipliers::NONE,
            layers: (0..self.num_hidden_layers).map(layer).collect(),
        };
        spec.validate()?;
        Ok(spec)
    }

    /// A routed MoE block with this config's expert count, top-k and `norm_topk_prob`, and
    /// the usual tensor names ([`MoeNames::MLP`]).
    pub fn moe(&self, intermediate_size: usize, shared: Option<usize>) -> MoeSpec {
        MoeSpec {
            num_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            intermediate_size,
            norm_topk_prob: self.norm_topk_prob.unwrap_or(false),
            shared_intermediate_size: shared,
            names: MoeNames::MLP,
        }
    }
}
