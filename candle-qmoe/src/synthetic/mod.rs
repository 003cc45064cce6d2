//! Deterministic random weights, activations and routings with realistic scales, for
//! benchmarks, tests and offline demos (no download needed).
//!
//! [`SyntheticModel`] builds a whole model with the real shapes of OLMoE-1B-7B or
//! Qwen1.5-MoE-A2.7B (or a tiny one) in seconds: random non-expert weights (uniform, std 0.02,
//! norms = 1) in a VarBuilder and the routed experts generated directly as random INT4 slabs in
//! an in-memory [`PackFile`]. Random weights produce nonsense text; they exercise exactly the code
//! and memory traffic of the real model.
//!
//! Every weight is a BF16 value (the non-expert weights are rounded to BF16, and the experts'
//! scales have few enough significant bits that each dequantized weight is exact in BF16), so
//! [`checkpoint`] can write the same model as a Hugging Face checkpoint folder with BF16 tensors
//! that loads back to exactly these weights.

pub mod checkpoint;

use std::collections::HashMap;
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
    DenseExpert, ExpertLayout, GroupSize, LayerPack, PackFile, PackMeta, ScaleSearch,
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
    pub const ALL: [Self; 3] = [Self::Tiny, Self::Olmoe, Self::Qwen2Moe];

    /// The name used on command lines (`tiny`, `olmoe`, `qwen2moe`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Tiny => "tiny",
            Self::Olmoe => "olmoe",
            Self::Qwen2Moe => "qwen2moe",
        }
    }

    /// The routed-expert shape of each MoE layer.
    pub fn moe_shape(self) -> MoeShape {
        let (hidden, intermediate, experts, top_k) = match self {
            Self::Tiny => (256, 128, 8, 2),
            Self::Olmoe => (2048, 1024, 64, 8),
            Self::Qwen2Moe => (2048, 1408, 60, 4),
        };
        MoeShape {
            hidden,
            intermediate,
            experts,
            top_k,
        }
    }

    /// The Hugging Face `config.json` of this shape.
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
                    "is not supported (use one of: tiny, olmoe, qwen2moe)",
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
    const CHUNK: usize = 1 << 16;
    let a = std * 3f32.sqrt();
    let mut v = vec![0f32; n];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let mut rng = SplitMix64(derive_seed(seed, c as u64));
        for pair in out.chunks_mut(2) {
            let r = rng.next();
            for (x, bits) in pair.iter_mut().zip([r, r >> 32]) {
                *x = (2.0 * unit24(bits) - 1.0) * a;
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
        let n = self.shape.iter().product();
        match self.init {
            Init::Ones => vec![1f32; n],
            Init::Uniform(std) => {
                let mut v = uniform(name_seed(seed, &self.name), n, std);
                v.par_iter_mut()
                    .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
                v
            }
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

/// A model with the real shapes and deterministic random weights: the non-expert tensors (BF16,
/// on the CPU) for a VarBuilder and the routed experts as an in-memory INT4 [`PackFile`].
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
    /// Generates the weights of `kind` from `seed`, with experts packed at `group_size`.
    pub fn new(kind: SyntheticKind, seed: u64, group_size: GroupSize) -> candle::Result<Self> {
        let config_json = kind.config_json().to_string();
        let config = AnyConfig::from_json_str(&config_json)?;
        let spec = config.spec()?;
        let tensors = non_expert_tensors(&spec)
            .into_iter()
            .map(|t| {
                let values = t.values(seed);
                // Stored in BF16, as checkpoints are: the default path computes from these
                // bytes, and an F32 VarBuilder widens them exactly.
                let tensor =
                    Tensor::from_vec(values, t.shape, &Device::Cpu)?.to_dtype(DType::BF16)?;
                Ok((t.name, tensor))
            })
            .collect::<candle::Result<HashMap<_, _>>>()?;
        let moe = spec.uniform_moe()?;
        let layout = ExpertLayout {
            hidden: spec.hidden_size,
            intermediate: moe.intermediate_size,
            group_size,
        };
        let layers = spec
            .moe_layers()
            .into_iter()
            .map(|i| {
                let s = experts_seed(seed, i);
                Ok((i, random_layer_pack(s, layout, moe.num_experts)?))
            })
            .collect::<Result<Vec<_>, QmoeError>>()?;
        let meta = PackMeta {
            layout,
            num_experts: moe.num_experts,
            scale_search: ScaleSearch::Rtn,
            source_model: format!("synthetic:{kind}"),
            source_revision: format!("seed {seed}"),
            fingerprint: checkpoint_fingerprint(config_json.as_bytes(), [&seed.to_le_bytes()[..]]),
        };
        let pack = Arc::new(PackFile::from_layers(meta, layers)?);
        Ok(Self {
            kind,
            seed,
            config_json,
            config,
            spec,
            tensors,
            pack,
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
            "mixtral".parse::<SyntheticKind>(),
            Err(QmoeError::UnsupportedConfig { field, value, .. })
                if field == "synthetic model" && value == "mixtral"
        ));
    }
}
