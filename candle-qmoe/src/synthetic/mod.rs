//! Deterministic random weights, activations and routings with realistic scales, for
//! benchmarks, tests and offline demos (no download needed).
//!
//! [`SyntheticModel`] builds a whole model with the real shapes of OLMoE-1B-7B,
//! Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B or Mixtral-8x7B (or a tiny one): random non-expert weights
//! (uniform, std 0.02, norms = 1) in a VarBuilder and the routed experts generated directly as
//! random INT4 slabs, in an in-memory [`PackFile`] (seconds for the small kinds) or, for the
//! 30B-class kinds, written to a `.qmoe` file one layer at a time and memory-mapped
//! ([`SyntheticModel::with_pack_file`]). Random weights produce nonsense text; they exercise
//! exactly the code and memory traffic of the real model.
//!
//! Every weight is a BF16 value (the non-expert weights are rounded to BF16, and the experts'
//! scales have few enough significant bits that each dequantized weight is exact in BF16), so
//! [`checkpoint`] can write the same model as a Hugging Face checkpoint folder with BF16 tensors
//! that loads back to exactly these weights.

pub mod checkpoint;

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use half::f16;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::models::{
    AnyConfig, ExpertsLoader, FfnSpec, ModelConfig, ModelSpec, MoeForCausalLm, PackedExperts,
};
use crate::pack::file::checkpoint_fingerprint;
use crate::pack::layout::nibble_position;
use crate::pack::{
    DenseExpert, ExpertLayout, GroupSize, LayerPack, PackFile, PackMeta, PackWriter, ScaleSearch,
};
use crate::QmoeError;

/// `n` normal samples with standard deviation `std` from seed `seed` (Box–Muller).
pub fn gaussian(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect()
}

/// `n` experts with `gate`/`up` `[inter, hidden]` and `down` `[hidden, inter]` drawn from
/// N(0, std²) in F32 (0.02 is a typical LLM weight scale), generated in parallel.
pub fn random_experts(
    seed: u64,
    n: usize,
    hidden: usize,
    inter: usize,
    std: f32,
) -> candle::Result<Vec<DenseExpert>> {
    (0..n as u64)
        .into_par_iter()
        .map(|e| {
            let s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (e << 20);
            let t = |i: u64, r: usize, c: usize| {
                Tensor::from_vec(gaussian(s + i, r * c, std), (r, c), &Device::Cpu)
            };
            Ok(DenseExpert {
                gate: t(0, inter, hidden)?,
                up: t(1, inter, hidden)?,
                down: t(2, hidden, inter)?,
            })
        })
        .collect()
}

/// A routing of `tokens` tokens: `k` distinct experts each (`[tokens, k]`, row-major) and
/// softmax-like positive weights.
pub fn random_routing(seed: u64, tokens: usize, k: usize, experts: usize) -> (Vec<u32>, Vec<f32>) {
    assert!(k <= experts, "top-k {k} exceeds {experts} experts");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut ids, mut weights) = (
        Vec::with_capacity(tokens * k),
        Vec::with_capacity(tokens * k),
    );
    for _ in 0..tokens {
        let start = ids.len();
        while ids.len() < start + k {
            let e = rng.random_range(0..experts as u32);
            if !ids[start..].contains(&e) {
                ids.push(e);
            }
        }
        let logits: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        weights.extend(logits.iter().map(|l| l.exp() / z));
    }
    (ids, weights)
}

/// A routing trace with skew, the way real MoE routers behave (unlike random weights, which
/// route almost uniformly): `tokens × k` distinct expert ids per token (row-major).
///
/// Each token first keeps each of the previous token's experts with probability `reuse`
/// (temporal locality); the remaining picks follow a Zipf law of exponent `zipf` over a
/// seed-dependent ranking of the experts (popularity skew: with `zipf = 1` and 64 experts the
/// top 8 experts take about 57% of the picks).
pub fn skewed_routing(
    seed: u64,
    tokens: usize,
    k: usize,
    experts: usize,
    zipf: f64,
    reuse: f64,
) -> Vec<u32> {
    assert!(k <= experts, "top-k {k} exceeds {experts} experts");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut rank: Vec<u32> = (0..experts as u32).collect();
    for i in (1..experts).rev() {
        rank.swap(i, rng.random_range(0..=i));
    }
    let cdf: Vec<f64> = (1..=experts)
        .scan(0.0, |acc, r| {
            *acc += (r as f64).powf(-zipf);
            Some(*acc)
        })
        .collect();
    let total = cdf[experts - 1];
    let mut ids: Vec<u32> = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let start = ids.len();
        if t > 0 {
            for j in 0..k {
                let prev = ids[start - k + j];
                if rng.random::<f64>() < reuse {
                    ids.push(prev);
                }
            }
        }
        while ids.len() < start + k {
            let u = rng.random::<f64>() * total;
            let e = rank[cdf.partition_point(|&c| c < u).min(experts - 1)];
            if !ids[start..].contains(&e) {
                ids.push(e);
            }
        }
    }
    ids
}

/// Standard deviation of the synthetic weights (a typical LLM init scale).
pub const WEIGHT_STD: f32 = 0.02;

/// The synthetic model shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyntheticKind {
    /// OLMoE layout with small dims (2 layers, H 256, 8 experts top-2, I 128) and OLMoE's real
    /// vocabulary (50304), so a real tokenizer works with it: builds in well under a second.
    Tiny,
    /// OLMoE-1B-7B: 16 layers, H 2048, 64 experts top-8, I 1024, q/k norm, vocab 50304.
    Olmoe,
    /// Qwen1.5-MoE-A2.7B: 24 layers, H 2048, 60 experts top-4, I 1408, shared expert 5632,
    /// q/k/v bias, vocab 151936.
    Qwen2Moe,
    /// Qwen3-30B-A3B: 48 layers, H 2048, 32 heads of 128 over 4 kv heads, per-head q/k norm,
    /// 128 experts top-8 (renormalised), I 768, vocab 151936. Its INT4 pack (15 GB at group
    /// size 128) is written to a file and memory-mapped ([`SyntheticKind::large`]).
    Qwen3Moe,
    /// Mixtral-8x7B: 32 layers, H 4096, 32 heads over 8 kv heads, 8 experts top-2, I 14336,
    /// vocab 32000. Its INT4 pack (23 GB at group size 128) is written to a file and
    /// memory-mapped ([`SyntheticKind::large`]).
    Mixtral,
}

/// The routed experts of one MoE layer: the shape the kernels, benches and sweeps use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// Model width (the experts' input and output size).
    pub hidden: usize,
    /// Each expert's intermediate size.
    pub intermediate: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
}

impl MoeShape {
    /// The INT4 layout of one expert of this shape at `group_size`.
    pub fn layout(&self, group_size: GroupSize) -> ExpertLayout {
        ExpertLayout {
            hidden: self.hidden,
            intermediate: self.intermediate,
            group_size,
        }
    }
}

impl SyntheticKind {
    /// Every kind.
    pub const ALL: [Self; 5] = [
        Self::Tiny,
        Self::Olmoe,
        Self::Qwen2Moe,
        Self::Qwen3Moe,
        Self::Mixtral,
    ];

    /// The name used on command lines (`tiny`, `olmoe`, `qwen2moe`, `qwen3moe`, `mixtral`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Tiny => "tiny",
            Self::Olmoe => "olmoe",
            Self::Qwen2Moe => "qwen2moe",
            Self::Qwen3Moe => "qwen3moe",
            Self::Mixtral => "mixtral",
        }
    }

    /// The 30B-class kinds, whose INT4 pack (15–23 GB) is too large to build in memory: it is
    /// written to a file one layer at a time and memory-mapped
    /// ([`SyntheticModel::with_pack_file`]).
    pub fn large(self) -> bool {
        matches!(self, Self::Qwen3Moe | Self::Mixtral)
    }

    /// The architecture of this kind (from [`Self::config_json`]).
    pub fn spec(self) -> crate::Result<ModelSpec> {
        AnyConfig::from_json_str(&self.config_json().to_string())?.spec()
    }

    /// Bytes of this kind's INT4 pack at `group_size` (every MoE layer's slabs).
    pub fn pack_bytes(self, group_size: GroupSize) -> crate::Result<u64> {
        let spec = self.spec()?;
        let slab = self.moe_shape().layout(group_size).slab_bytes();
        Ok((spec.moe_layers().len() * self.moe_shape().experts * slab) as u64)
    }

    /// The routed-expert shape of each MoE layer.
    pub fn moe_shape(self) -> MoeShape {
        let (hidden, intermediate, experts, top_k) = match self {
            Self::Tiny => (256, 128, 8, 2),
            Self::Olmoe => (2048, 1024, 64, 8),
            Self::Qwen2Moe => (2048, 1408, 60, 4),
            Self::Qwen3Moe => (2048, 768, 128, 8),
            Self::Mixtral => (4096, 14336, 8, 2),
        };
        MoeShape {
            hidden,
            intermediate,
            experts,
            top_k,
        }
    }

    /// The Hugging Face `config.json` of this shape: for the full-size kinds, the published
    /// `config.json` of the model they mimic (`examples/configs/`).
    pub fn config_json(self) -> serde_json::Value {
        use serde_json::json;
        let moe = self.moe_shape();
        let olmoe = |layers: usize, heads: usize| {
            let MoeShape {
                hidden,
                intermediate: inter,
                experts,
                top_k: k,
            } = moe;
            json!({
                "architectures": ["OlmoeForCausalLM"],
                "model_type": "olmoe",
                "vocab_size": 50304,
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "num_experts": experts,
                "num_experts_per_tok": k,
                "norm_topk_prob": false,
                "clip_qkv": null,
                "attention_bias": false,
                "tie_word_embeddings": false,
                "hidden_act": "silu",
                "bos_token_id": null,
                "eos_token_id": 50279,
                "pad_token_id": 1
            })
        };
        match self {
            Self::Tiny => olmoe(2, 4),
            Self::Olmoe => olmoe(16, 16),
            Self::Qwen2Moe => json!({
                "architectures": ["Qwen2MoeForCausalLM"],
                "model_type": "qwen2_moe",
                "vocab_size": 151936,
                "hidden_size": moe.hidden,
                "intermediate_size": 5632,
                "moe_intermediate_size": moe.intermediate,
                "shared_expert_intermediate_size": 5632,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "num_experts": moe.experts,
                "num_experts_per_tok": moe.top_k,
                "norm_topk_prob": false,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "use_sliding_window": false,
                "tie_word_embeddings": false,
                "hidden_act": "silu",
                "bos_token_id": 151643,
                "eos_token_id": 151643
            }),
            // Qwen/Qwen3-30B-A3B's config.json.
            Self::Qwen3Moe => json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "attention_bias": false,
                "attention_dropout": 0.0,
                "bos_token_id": 151643,
                "decoder_sparse_step": 1,
                "eos_token_id": 151645,
                "head_dim": 128,
                "hidden_act": "silu",
                "hidden_size": moe.hidden,
                "initializer_range": 0.02,
                "intermediate_size": 6144,
                "max_position_embeddings": 40960,
                "max_window_layers": 48,
                "mlp_only_layers": [],
                "model_type": "qwen3_moe",
                "moe_intermediate_size": moe.intermediate,
                "norm_topk_prob": true,
                "num_attention_heads": 32,
                "num_experts": moe.experts,
                "num_experts_per_tok": moe.top_k,
                "num_hidden_layers": 48,
                "num_key_value_heads": 4,
                "output_router_logits": false,
                "rms_norm_eps": 1e-6,
                "rope_scaling": null,
                "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.001,
                "sliding_window": null,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "transformers_version": "4.51.0",
                "use_cache": true,
                "use_sliding_window": false,
                "vocab_size": 151936
            }),
            // mistralai/Mixtral-8x7B-Instruct-v0.1's config.json.
            Self::Mixtral => json!({
                "architectures": ["MixtralForCausalLM"],
                "attention_dropout": 0.0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "hidden_act": "silu",
                "hidden_size": moe.hidden,
                "initializer_range": 0.02,
                "intermediate_size": moe.intermediate,
                "max_position_embeddings": 32768,
                "model_type": "mixtral",
                "num_attention_heads": 32,
                "num_experts_per_tok": moe.top_k,
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "num_local_experts": moe.experts,
                "output_router_logits": false,
                "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.02,
                "sliding_window": null,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "transformers_version": "4.36.0.dev0",
                "use_cache": true,
                "vocab_size": 32000
            }),
        }
    }
}

impl std::fmt::Display for SyntheticKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SyntheticKind {
    type Err = QmoeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                QmoeError::unsupported(
                    "synthetic model",
                    s,
                    "is not supported (use one of: tiny, olmoe, qwen2moe, qwen3moe, mixtral)",
                )
            })
    }
}

/// SplitMix64: a tiny, fast, statistically decent generator for bulk random bytes.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` from 24 random bits.
    fn unit(&mut self) -> f32 {
        unit24(self.next() >> 40)
    }
}

/// The low 24 bits of `bits` as a value uniform in `[0, 1)`.
fn unit24(bits: u64) -> f32 {
    (bits & 0xff_ffff) as f32 / (1u32 << 24) as f32
}

/// A seed derived from `seed` and a stream index, decorrelated by one SplitMix64 step.
fn derive_seed(seed: u64, stream: u64) -> u64 {
    SplitMix64(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03)).next()
}

/// A seed for the tensor `name` (FNV-1a of the name).
fn name_seed(seed: u64, name: &str) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    derive_seed(seed, h)
}

/// `n` values uniform in `[-std·√3, std·√3]` (standard deviation `std`), generated in parallel
/// chunks whose seeds depend only on `seed` and the chunk index, so the result does not depend
/// on the number of threads.
pub fn uniform(seed: u64, n: usize, std: f32) -> Vec<f32> {
    uniform_as(seed, n, std, |x| x)
}

/// [`uniform`]'s values converted by `conv` as they are drawn (no F32 copy of the whole).
fn uniform_as<T: Copy + Default + Send>(
    seed: u64,
    n: usize,
    std: f32,
    conv: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    const CHUNK: usize = 1 << 16;
    let a = std * 3f32.sqrt();
    let mut v = vec![T::default(); n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let mut rng = SplitMix64(derive_seed(seed, c as u64));
        for pair in out.chunks_mut(2) {
            let r = rng.next();
            for (x, bits) in pair.iter_mut().zip([r, r >> 32]) {
                *x = conv((2.0 * unit24(bits) - 1.0) * a);
            }
        }
    });
    v
}

/// FP16 scale of a synthetic expert: levels `-7..=7` times this span `±WEIGHT_STD·√3`, the same
/// range as the uniform non-expert weights.
fn synthetic_scale() -> f32 {
    WEIGHT_STD * 3f32.sqrt() / 7.0
}

/// `s` with its mantissa cut to 5 significant bits: a level (at most 3 bits) times such a scale
/// needs at most 8 significant bits, so every dequantized synthetic weight is exact in BF16.
fn bf16_exact_scale(s: f16) -> f16 {
    f16::from_bits(s.to_bits() & !0x3f)
}

/// Maps 16 random bits to a byte of two nibbles in `1..=15` (levels `-7..=7`), each pair of
/// levels equally likely to within 0.4%.
fn level_pair_table() -> Vec<u8> {
    (0..1u32 << 16)
        .map(|x| {
            let pair = (x * 225) >> 16;
            (1 + pair % 15) as u8 | (((1 + pair / 15) as u8) << 4)
        })
        .collect()
}

/// Fills one expert slab with random levels in `-7..=7` (zero in padding columns) and random
/// FP16 scales within ±25% of [`synthetic_scale`] (with 5 significant bits, see
/// [`bf16_exact_scale`]). `pairs` is [`level_pair_table`].
fn random_slab(layout: ExpertLayout, seed: u64, pairs: &[u8], slab: &mut [u8]) {
    let mut rng = SplitMix64(seed);
    let o = layout.offsets();
    for (start, m) in [
        (o.gate_up_weights, layout.gate_up()),
        (o.down_weights, layout.down()),
    ] {
        let weights = &mut slab[start..start + m.weight_bytes()];
        for four in weights.chunks_mut(4) {
            let r = rng.next();
            for (j, b) in four.iter_mut().enumerate() {
                *b = pairs[(r >> (16 * j)) as usize & 0xffff];
            }
        }
        for row in weights.chunks_exact_mut(m.row_bytes()) {
            for col in m.cols..m.padded_cols() {
                let (byte, half) = nibble_position(col);
                row[byte] = (row[byte] & !(0xf << (4 * half))) | (8 << (4 * half));
            }
        }
    }
    let base = synthetic_scale();
    for (start, m) in [
        (o.gate_up_scales, layout.gate_up()),
        (o.down_scales, layout.down()),
    ] {
        for d in slab[start..start + 2 * m.scale_count()].chunks_exact_mut(2) {
            let s = bf16_exact_scale(f16::from_f32(base * (0.75 + 0.5 * rng.unit())));
            d.copy_from_slice(&s.to_le_bytes());
        }
    }
}

/// `num_experts` random INT4 expert slabs of one layer, generated in parallel.
pub fn random_layer_pack(
    seed: u64,
    layout: ExpertLayout,
    num_experts: usize,
) -> Result<LayerPack, QmoeError> {
    let n = layout.slab_bytes();
    let pairs = level_pair_table();
    // SAFETY: all-zero bytes are valid `u8`s. Filling the shared buffer in place avoids a copy
    // of the whole layer (gigabytes for the full-size shapes).
    let mut bytes: Arc<[u8]> = unsafe { Arc::new_zeroed_slice(num_experts * n).assume_init() };
    Arc::get_mut(&mut bytes)
        .expect("a new Arc is unique")
        .par_chunks_mut(n)
        .enumerate()
        .for_each(|(e, slab)| random_expert_slab(seed, layout, e, &pairs, slab));
    LayerPack::from_bytes(layout, num_experts, bytes)
}

/// Expert `e`'s slab of the layer [`random_layer_pack`] makes from `seed` (zeroed `slab` of
/// `layout.slab_bytes()` bytes; `pairs` is [`level_pair_table`]).
fn random_expert_slab(seed: u64, layout: ExpertLayout, e: usize, pairs: &[u8], slab: &mut [u8]) {
    random_slab(layout, derive_seed(seed, e as u64), pairs, slab)
}

/// The seed of MoE layer `layer`'s experts in a synthetic model of seed `seed`.
fn experts_seed(seed: u64, layer: usize) -> u64 {
    name_seed(seed, &format!("model.layers.{layer}.mlp.experts"))
}

/// How a non-expert tensor is initialised.
#[derive(Clone, Copy)]
enum Init {
    Ones,
    /// Uniform with this standard deviation.
    Uniform(f32),
}

/// One non-expert tensor of a synthetic model: name, shape and initialisation.
struct NonExpert {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

impl NonExpert {
    fn new(name: String, shape: Vec<usize>, init: Init) -> Self {
        Self { name, shape, init }
    }

    /// Its values for the model of seed `seed`, rounded to BF16 (as a real checkpoint stores
    /// them).
    fn values(&self, seed: u64) -> Vec<f32> {
        self.values_as(seed, |x| half::bf16::from_f32(x).to_f32())
    }

    /// [`Self::values`] in BF16, drawn straight into BF16 (a loader holds no F32 copy).
    fn bf16_values(&self, seed: u64) -> Vec<half::bf16> {
        self.values_as(seed, half::bf16::from_f32)
    }

    /// Its values converted by `conv` as they are drawn.
    fn values_as<T: Copy + Default + Send>(
        &self,
        seed: u64,
        conv: impl Fn(f32) -> T + Sync,
    ) -> Vec<T> {
        let n = self.shape.iter().product();
        match self.init {
            Init::Ones => vec![conv(1.0); n],
            Init::Uniform(std) => uniform_as(name_seed(seed, &self.name), n, std, conv),
        }
    }
}

/// Standard deviation of the synthetic token embeddings. Embeddings as small as the other
/// weights are drowned by the first layers' outputs: every position then carries the same state
/// and a 16-layer model repeats one token with near-constant routing. With unit-scale embeddings
/// (and residual-scaled output projections, see `non_expert_tensors`) each token keeps its
/// identity, and the routing spreads over all experts as in a real model.
pub const EMBEDDING_STD: f32 = 1.0;

/// Every tensor the trunk loads except the routed experts, with its shape and initialisation:
/// norms 1, embeddings [`EMBEDDING_STD`], projections into the residual stream (`o_proj`, dense
/// and shared `down_proj`) [`WEIGHT_STD`]` / √(2·layers)` as in GPT-2's initialisation, every
/// other weight and bias [`WEIGHT_STD`]. Listed as a checkpoint stores them: the embeddings, then
/// each decoder layer's tensors (see [`layer_tensors`]), then the final norm and the head.
fn non_expert_tensors(spec: &ModelSpec) -> Vec<NonExpert> {
    let (h, v) = (spec.hidden_size, spec.vocab_size);
    let mut out = vec![NonExpert::new(
        "model.embed_tokens.weight".into(),
        vec![v, h],
        Init::Uniform(EMBEDDING_STD),
    )];
    out.extend((0..spec.num_layers()).flat_map(|i| layer_tensors(spec, i)));
    out.push(NonExpert::new(
        "model.norm.weight".into(),
        vec![h],
        Init::Ones,
    ));
    if !spec.tie_word_embeddings {
        out.push(NonExpert::new(
            "lm_head.weight".into(),
            vec![v, h],
            Init::Uniform(WEIGHT_STD),
        ));
    }
    out
}

/// The non-expert tensors of decoder layer `i` (see [`non_expert_tensors`]).
fn layer_tensors(spec: &ModelSpec, i: usize) -> Vec<NonExpert> {
    use Init::Ones;
    let uniform = Init::Uniform(WEIGHT_STD);
    let residual = Init::Uniform(WEIGHT_STD / (2.0 * spec.num_layers() as f32).sqrt());
    let h = spec.hidden_size;
    let q = spec.num_heads * spec.head_dim;
    let kv = spec.num_kv_heads * spec.head_dim;
    let a = &spec.attention;
    let p = format!("model.layers.{i}");
    let t = NonExpert::new;
    let mut out = vec![
        t(format!("{p}.input_layernorm.weight"), vec![h], Ones),
        t(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Ones,
        ),
    ];
    for (name, rows, cols, bias) in [
        ("q_proj", q, h, a.qkv_bias),
        ("k_proj", kv, h, a.qkv_bias),
        ("v_proj", kv, h, a.qkv_bias),
        ("o_proj", h, q, a.o_bias),
    ] {
        let init = if name == "o_proj" { residual } else { uniform };
        out.push(t(
            format!("{p}.self_attn.{name}.weight"),
            vec![rows, cols],
            init,
        ));
        if bias {
            out.push(t(format!("{p}.self_attn.{name}.bias"), vec![rows], uniform));
        }
    }
    if let Some((qn, kn)) = spec.qk_norm_sizes() {
        out.push(t(format!("{p}.self_attn.q_norm.weight"), vec![qn], Ones));
        out.push(t(format!("{p}.self_attn.k_norm.weight"), vec![kn], Ones));
    }
    let mlp = |m: &str, inter: usize| {
        [
            t(format!("{m}.gate_proj.weight"), vec![inter, h], uniform),
            t(format!("{m}.up_proj.weight"), vec![inter, h], uniform),
            t(format!("{m}.down_proj.weight"), vec![h, inter], residual),
        ]
    };
    match &spec.layers[i] {
        FfnSpec::Dense { intermediate_size } => {
            out.extend(mlp(&format!("{p}.mlp"), *intermediate_size))
        }
        FfnSpec::Moe(m) => {
            let block = m.names.block_prefix(i);
            out.push(t(m.names.router_weight(i), vec![m.num_experts, h], uniform));
            if let Some(si) = m.shared_intermediate_size {
                out.extend(mlp(&format!("{block}.shared_expert"), si));
                out.push(t(
                    format!("{block}.shared_expert_gate.weight"),
                    vec![1, h],
                    uniform,
                ));
            }
        }
    }
    out
}

/// The header of the INT4 pack of `kind` from `seed` at `group_size` (its fingerprint covers
/// the config and the seed), and the MoE layers it holds.
fn pack_header(
    kind: SyntheticKind,
    seed: u64,
    group_size: GroupSize,
) -> crate::Result<(PackMeta, Vec<usize>)> {
    let config_json = kind.config_json().to_string();
    let spec = AnyConfig::from_json_str(&config_json)?.spec()?;
    let moe = spec.uniform_moe()?;
    let meta = PackMeta {
        layout: ExpertLayout {
            hidden: spec.hidden_size,
            intermediate: moe.intermediate_size,
            group_size,
        },
        num_experts: moe.num_experts,
        scale_search: ScaleSearch::Rtn,
        source_model: format!("synthetic:{kind}"),
        source_revision: format!("seed {seed}"),
        fingerprint: checkpoint_fingerprint(config_json.as_bytes(), [&seed.to_le_bytes()[..]]),
    };
    Ok((meta, spec.moe_layers()))
}

/// MoE layer `layer`'s random slabs in the synthetic pack `meta` from `seed`.
fn synthetic_layer(seed: u64, meta: &PackMeta, layer: usize) -> crate::Result<LayerPack> {
    random_layer_pack(experts_seed(seed, layer), meta.layout, meta.num_experts)
}

/// Writes the INT4 pack of the synthetic model `kind` (weights from `seed`, at `group_size`) to
/// the `.qmoe` file `path` one MoE layer at a time ([`PackWriter::write_streamed`]), so only one
/// layer is ever in memory (311 MB for [`SyntheticKind::Qwen3Moe`]); the file holds the same
/// bytes as the in-memory pack of [`SyntheticModel::new`] saved with [`PackFile::save`].
/// `on_layer(done, total)` is called after each layer is written; the file appears under its name
/// only once complete. Returns the header written.
pub fn write_pack(
    kind: SyntheticKind,
    seed: u64,
    group_size: GroupSize,
    path: &Path,
    on_layer: &dyn Fn(usize, usize),
) -> crate::Result<PackMeta> {
    let (meta, layers) = pack_header(kind, seed, group_size)?;
    let mut done = 0;
    PackWriter::write_streamed(path, &meta, &layers, |i| {
        let pack = synthetic_layer(seed, &meta, i);
        done += 1;
        on_layer(done, layers.len());
        pack
    })?;
    Ok(meta)
}

/// A model with the real shapes and deterministic random weights: the non-expert tensors (BF16,
/// on the CPU) for a VarBuilder and the routed experts as an INT4 [`PackFile`], in memory
/// ([`Self::new`]) or memory-mapped from a file ([`Self::with_pack_file`]).
///
/// The same kind, seed and group size always give the same weights, whatever the thread count.
pub struct SyntheticModel {
    kind: SyntheticKind,
    seed: u64,
    config_json: String,
    config: AnyConfig,
    spec: ModelSpec,
    tensors: HashMap<String, Tensor>,
    pack: Arc<PackFile>,
}

impl SyntheticModel {
    /// Generates the weights of `kind` from `seed`, with experts packed at `group_size` in
    /// memory (for the [`SyntheticKind::large`] kinds that is 15–23 GB: use
    /// [`Self::with_pack_file`]).
    pub fn new(kind: SyntheticKind, seed: u64, group_size: GroupSize) -> candle::Result<Self> {
        let (meta, layers) = pack_header(kind, seed, group_size)?;
        let layers = layers
            .into_iter()
            .map(|i| Ok((i, synthetic_layer(seed, &meta, i)?)))
            .collect::<crate::Result<Vec<_>>>()?;
        Self::with_pack(kind, seed, PackFile::from_layers(meta, layers)?)
    }

    /// Like [`Self::new`], but the experts come from the `.qmoe` file `path`, written first (one
    /// layer at a time, see [`write_pack`]; `on_layer(done, total)` after each layer) when it
    /// does not exist, then opened by `open`: [`PackFile::open`] memory-maps it (only the pages
    /// of the experts in use become resident, so a 30B-class model runs in far less memory than
    /// its pack), [`PackFile::open_in_memory`] reads it into this process. An existing file
    /// must hold exactly this kind, seed and group size, else [`QmoeError::CorruptPack`] naming
    /// it.
    pub fn with_pack_file(
        kind: SyntheticKind,
        seed: u64,
        group_size: GroupSize,
        path: &Path,
        open: fn(&Path) -> crate::Result<PackFile>,
        on_layer: &dyn Fn(usize, usize),
    ) -> candle::Result<Self> {
        let (meta, _) = pack_header(kind, seed, group_size)?;
        if !path.exists() {
            write_pack(kind, seed, group_size, path, on_layer)?;
        }
        let pack = open(path)?;
        let m = pack.meta();
        if m != &meta {
            return Err(QmoeError::CorruptPack {
                path: path.to_path_buf(),
                reason: format!(
                    "it holds the experts of {} ({}, group size {}), not those of {} ({}, group \
                     size {}); delete it or choose another path",
                    m.source_model,
                    m.source_revision,
                    m.layout.group_size.get(),
                    meta.source_model,
                    meta.source_revision,
                    group_size.get()
                ),
            }
            .into());
        }
        Self::with_pack(kind, seed, pack)
    }

    /// The model of `kind` from `seed` with the experts `pack`: generates the non-expert
    /// weights.
    fn with_pack(kind: SyntheticKind, seed: u64, pack: PackFile) -> candle::Result<Self> {
        let config_json = kind.config_json().to_string();
        let config = AnyConfig::from_json_str(&config_json)?;
        let spec = config.spec()?;
        let tensors = non_expert_tensors(&spec)
            .into_iter()
            .map(|t| {
                // Stored in BF16, as checkpoints are: the default path computes from these
                // bytes, and an F32 VarBuilder widens them exactly.
                let tensor = Tensor::from_vec(t.bf16_values(seed), t.shape, &Device::Cpu)?;
                Ok((t.name, tensor))
            })
            .collect::<candle::Result<HashMap<_, _>>>()?;
        Ok(Self {
            kind,
            seed,
            config_json,
            config,
            spec,
            tensors,
            pack: Arc::new(pack),
        })
    }

    /// The shape.
    pub fn kind(&self) -> SyntheticKind {
        self.kind
    }

    /// The seed the weights come from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The model's `config.json` text.
    pub fn config_json(&self) -> &str {
        &self.config_json
    }

    /// The parsed config.
    pub fn config(&self) -> &AnyConfig {
        &self.config
    }

    /// The architecture.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The routed experts, INT4.
    pub fn pack(&self) -> &Arc<PackFile> {
        &self.pack
    }

    /// The fingerprint the pack records (config and seed).
    pub fn fingerprint(&self) -> &str {
        &self.pack.meta().fingerprint
    }

    /// A VarBuilder over the non-expert weights, converted to `dtype` on `device` as read
    /// (on the CPU in BF16 no copy is made).
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_tensors(self.tensors.clone(), dtype, device)
    }

    /// The routed experts served by the INT4 kernels.
    pub fn int4_experts(&self) -> PackedExperts {
        PackedExperts::new(self.pack.clone(), self.fingerprint())
    }

    /// The routed experts as dense `dtype` tensors (the dequantized slabs); see
    /// [`Self::dense_expert_bytes`] for their size.
    pub fn dense_experts(&self, dtype: DType) -> PackedExperts {
        self.int4_experts().dequantized(dtype)
    }

    /// Builds the model with non-expert weights in `dtype` on `device` and the given experts
    /// (e.g. [`Self::int4_experts`]).
    pub fn load(
        &self,
        dtype: DType,
        device: &Device,
        experts: &dyn ExpertsLoader,
    ) -> candle::Result<MoeForCausalLm> {
        MoeForCausalLm::new(&self.spec, self.var_builder(dtype, device), experts)
    }

    /// Bytes the routed experts take as dense `dtype` tensors.
    pub fn dense_expert_bytes(&self, dtype: DType) -> usize {
        let l = self.pack.meta().layout;
        let per_expert = 3 * l.hidden * l.intermediate * dtype.size_in_bytes();
        self.pack.layer_indices().count() * self.pack.meta().num_experts * per_expert
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::quant::level_at;

    #[test]
    fn random_slabs_hold_symmetric_levels_zero_padding_and_realistic_scales() {
        // K = 48 and 40: both matrices have padding columns up to 64.
        let layout = ExpertLayout {
            hidden: 48,
            intermediate: 40,
            group_size: GroupSize::new(32).unwrap(),
        };
        let pack = random_layer_pack(9, layout, 3).unwrap();
        let mut counts = [0usize; 16];
        for e in 0..3 {
            let slab = pack.slab(e);
            for (weights, m) in [
                (slab.gate_up_weights(), layout.gate_up()),
                (slab.down_weights(), layout.down()),
            ] {
                for row in weights.chunks_exact(m.row_bytes()) {
                    for c in 0..m.padded_cols() {
                        let q = level_at(row, c);
                        if c < m.cols {
                            counts[(q + 8) as usize] += 1;
                        } else {
                            assert_eq!(q, 0, "padding column {c}");
                        }
                    }
                }
            }
            let (g, u, d) = slab.dequantize();
            let all: Vec<f32> = g.into_iter().chain(u).chain(d).collect();
            let var = all.iter().map(|w| w * w).sum::<f32>() / all.len() as f32;
            assert!((0.015..0.03).contains(&var.sqrt()), "std {}", var.sqrt());
        }
        assert_eq!(counts[0], 0, "level -8 is never drawn");
        assert!(counts[1..].iter().all(|&c| c > 0));
        // Same seed, same bytes.
        assert_eq!(
            random_layer_pack(9, layout, 3).unwrap().bytes(),
            pack.bytes()
        );
    }

    /// Parameters of `kind`: the non-expert tensors and the routed experts.
    fn parameters(kind: SyntheticKind) -> (usize, usize) {
        let spec = kind.spec().unwrap();
        let dense = non_expert_tensors(&spec)
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        let m = kind.moe_shape();
        let experts = spec.moe_layers().len() * m.experts * 3 * m.hidden * m.intermediate;
        (dense, experts)
    }

    #[test]
    fn the_30b_class_kinds_have_the_published_shapes() {
        use crate::models::{MoeNames, QkNorm};
        // Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Mixtral-8x7B: 46.7B, 12.9B active (the
        // model cards' figures, to their rounding).
        for (kind, total, active) in [
            (SyntheticKind::Qwen3Moe, 30.5e9, 3.3e9),
            (SyntheticKind::Mixtral, 46.7e9, 12.9e9),
        ] {
            let (dense, experts) = parameters(kind);
            let m = kind.moe_shape();
            let per_token = dense + experts * m.top_k / m.experts;
            let close = |got: usize, want: f64| (got as f64 / want - 1.0).abs() < 0.02;
            assert!(close(dense + experts, total), "{kind}: {}", dense + experts);
            assert!(close(per_token, active), "{kind}: {per_token}");
            assert!(kind.large());
        }
        // Layers, hidden, heads, kv heads, head dim, experts, top-k, expert I, vocab, context.
        for (kind, want) in [
            (
                SyntheticKind::Qwen3Moe,
                [48, 2048, 32, 4, 128, 128, 8, 768, 151936, 40960],
            ),
            (
                SyntheticKind::Mixtral,
                [32, 4096, 32, 8, 128, 8, 2, 14336, 32000, 32768],
            ),
        ] {
            let s = kind.spec().unwrap();
            let m = s.uniform_moe().unwrap();
            let got = [
                s.num_layers(),
                s.hidden_size,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                m.num_experts,
                m.top_k,
                m.intermediate_size,
                s.vocab_size,
                s.max_position_embeddings,
            ];
            assert_eq!(got, want, "{kind}");
            assert!(m.norm_topk_prob && !s.tie_word_embeddings, "{kind}");
            assert_eq!(s.rope_theta, 1e6);
        }
        let q = SyntheticKind::Qwen3Moe.spec().unwrap();
        assert_eq!(q.attention.qk_norm, QkNorm::PerHead);
        let x = SyntheticKind::Mixtral.spec().unwrap();
        assert_eq!(x.attention.qk_norm, QkNorm::None);
        assert_eq!(x.uniform_moe().unwrap().names, MoeNames::MIXTRAL);
        // The Mixtral tensors a checkpoint names: its router lives in `block_sparse_moe`.
        let names: Vec<String> = non_expert_tensors(&x).into_iter().map(|t| t.name).collect();
        assert!(names.contains(&"model.layers.31.block_sparse_moe.gate.weight".to_string()));
        // INT4 g128: 0.5 byte per weight plus an FP16 scale per 128.
        let g = GroupSize::default();
        let pack = |k: SyntheticKind| k.pack_bytes(g).unwrap();
        assert_eq!(pack(SyntheticKind::Qwen3Moe), 48 * 128 * 2_433_024);
        assert_eq!(pack(SyntheticKind::Mixtral) / 1_000_000_000, 23);
        assert!(!SyntheticKind::Olmoe.large());
    }

    #[test]
    fn the_streamed_pack_file_is_the_in_memory_pack() {
        let dir = std::env::temp_dir().join(format!("qmoe-synth-pack-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (kind, seed, g) = (SyntheticKind::Tiny, 3, GroupSize::new(64).unwrap());
        let saved = dir.join("saved.qmoe");
        let model = SyntheticModel::new(kind, seed, g).unwrap();
        model.pack().save(&saved).unwrap();
        let streamed = dir.join("streamed.qmoe");
        let ticks = std::sync::Mutex::new(Vec::new());
        let mapped =
            SyntheticModel::with_pack_file(kind, seed, g, &streamed, PackFile::open, &|d, n| {
                ticks.lock().unwrap().push((d, n))
            })
            .unwrap();
        assert_eq!(ticks.into_inner().unwrap(), [(1, 2), (2, 2)]);
        // The same header (the metadata map's order in the JSON text may differ) and the same
        // data section, byte for byte.
        let (a, b) = (
            std::fs::read(&saved).unwrap(),
            std::fs::read(&streamed).unwrap(),
        );
        assert_eq!(a.len(), b.len());
        let header = |f: &[u8]| {
            let (n, h) = safetensors::SafeTensors::read_metadata(f).unwrap();
            let mut tensors: Vec<_> = h
                .tensors()
                .into_iter()
                .map(|(name, t)| (name, t.dtype, t.shape.clone(), t.data_offsets))
                .collect();
            tensors.sort_by(|x, y| x.0.cmp(&y.0));
            (n, h.metadata().clone(), tensors)
        };
        let (n, ..) = header(&a);
        assert_eq!(header(&a), header(&b));
        assert!(a[8 + n..] == b[8 + n..], "the data sections differ");
        assert_eq!(mapped.fingerprint(), model.fingerprint());
        assert_eq!(mapped.pack().meta(), model.pack().meta());
        // Opened again without writing; another seed or group size is refused, naming the file.
        let never = |_: usize, _: usize| panic!("an existing pack is not written again");
        SyntheticModel::with_pack_file(kind, seed, g, &streamed, PackFile::open, &never).unwrap();
        // Read into memory instead, through the opener given.
        static OPENED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        fn open_counted(path: &Path) -> crate::Result<PackFile> {
            OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            PackFile::open_in_memory(path)
        }
        let read = SyntheticModel::with_pack_file(kind, seed, g, &streamed, open_counted, &never);
        assert_eq!(read.unwrap().fingerprint(), model.fingerprint());
        assert_eq!(OPENED.load(std::sync::atomic::Ordering::Relaxed), 1);
        for (seed, g) in [(4, g), (seed, GroupSize::default())] {
            let err =
                SyntheticModel::with_pack_file(kind, seed, g, &streamed, PackFile::open, &never)
                    .err()
                    .unwrap();
            let err = QmoeError::find(&err).unwrap();
            assert!(
                matches!(err, QmoeError::CorruptPack { path, reason }
                    if path == &streamed && reason.contains("seed 3, group size 64")),
                "{err}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn uniform_has_the_requested_std_and_kinds_parse() {
        let v = uniform(4, 100_000, 0.02);
        let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!((std - 0.02).abs() < 5e-4, "{std}");
        assert!(v.iter().all(|x| x.abs() <= 0.02 * 3f32.sqrt()));
        for k in SyntheticKind::ALL {
            assert_eq!(k.name().parse::<SyntheticKind>().unwrap(), k);
            AnyConfig::from_json_str(&k.config_json().to_string())
                .unwrap()
                .spec()
                .unwrap();
        }
        assert!(matches!(
            "deepseek".parse::<SyntheticKind>(),
            Err(QmoeError::UnsupportedConfig { field, value, .. })
                if field == "synthetic model" && value == "deepseek"
        ));
    }
}
