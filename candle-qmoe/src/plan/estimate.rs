//! Per-component predictions: what a model configuration needs, worked out from its shapes
//! alone.

use candle::DType;

use super::bytes::{ByteRange, MIB};
use super::{moe_layers, plan_err, Component, ComponentBytes, Plan};
use crate::kernels::attention::KvDtype;
use crate::models::layers::ROTARY_INITIAL_POSITIONS;
use crate::models::{FfnSpec, ModelSpec, MoeSpec};
use crate::pack::{ExpertLayout, GroupSize};
use crate::residency::Resident;
use crate::QmoeError;

/// Default tokens per prefill chunk (the workspace is sized for one chunk): what
/// [`crate::generation::generate`] uses.
pub const DEFAULT_PREFILL_CHUNK: usize = crate::generation::PREFILL_CHUNK;
/// Default number of staging buffers: what the runtime's [`crate::residency::ResidencyOptions`]
/// uses.
pub const DEFAULT_STAGING_BUFFERS: usize = crate::residency::DEFAULT_STAGING_BUFFERS;

/// Product of sizes, saturating instead of overflowing on absurd configs.
fn product(factors: &[usize]) -> u64 {
    factors
        .iter()
        .fold(1u64, |acc, &f| acc.saturating_mul(f as u64))
}

/// Sum of sizes, saturating like [`product`].
fn sum(terms: &[u64]) -> u64 {
    terms.iter().fold(0u64, |acc, &t| acc.saturating_add(t))
}

/// Where the model runs. The default is [`Target::Cuda`], the VRAM budget the planner exists
/// for; plan for the device you load on with [`Target::of`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Target {
    /// The CPU: every component lives in host memory and sums into the process RSS.
    Cpu,
    /// A CUDA GPU: the components are device memory; the pack source stays on the host.
    #[default]
    Cuda,
}

impl Target {
    /// Where a model on `device` runs: [`Target::Cuda`] on a CUDA device, else the CPU.
    pub fn of(device: &candle::Device) -> Self {
        if device.is_cuda() {
            Self::Cuda
        } else {
            Self::Cpu
        }
    }

    /// The default dtype of the non-expert weights: BF16, the checkpoints' own (on the CPU
    /// computed with F32 activations, see [`Self::activation_dtype`]).
    pub fn default_dtype(self) -> DType {
        DType::BF16
    }

    /// The dtype activations are computed in for non-expert weights of `weights`: as
    /// [`crate::linear::activation_dtype`] on this target.
    pub fn activation_dtype(self, weights: DType) -> DType {
        match self {
            Self::Cpu if weights == DType::BF16 => DType::F32,
            _ => weights,
        }
    }

    /// Whether attention runs the fused CPU kernel over an in-place KV cache (else Candle
    /// tensor code that concatenates the cache and repeats kv heads).
    fn fused_attention(self, weights: DType) -> bool {
        self == Self::Cpu && self.activation_dtype(weights) == DType::F32
    }

    /// The dtype the KV cache stores: the fused CPU kernel's `KvDtype::for_weights` (BF16
    /// unless the weights are F32); Candle's tensor path keeps the activations' dtype.
    pub fn kv_dtype(self, weights: DType) -> DType {
        if self.fused_attention(weights) {
            KvDtype::for_weights(weights).dtype()
        } else {
            self.activation_dtype(weights)
        }
    }

    /// The name used on command lines and in evidence files (`cpu`, `cuda`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }

    /// Memory the runtime takes besides the model. CUDA: context, cuBLAS handles, loaded kernels
    /// and allocator slack in device memory; on an H200 (driver 580, CUDA 13.0) the device
    /// memory in use beyond every other component's maximum was 695–748 MiB over 16 synthetic
    /// OLMoE and Qwen1.5-MoE runs (`residency_sweep`), so the range ends at 768 MiB; smaller
    /// GPUs keep smaller contexts, hence the 300 MiB floor. CPU: the process baseline: from the
    /// binary and its libraries alone (about 3 MiB measured) up to a tokenizer, allocator slack
    /// and, with a host-memory expert cache, the one-off probe of the copy bandwidth (two 32 MiB
    /// buffers).
    pub fn runtime_overhead(self) -> ByteRange {
        match self {
            Self::Cpu => ByteRange::new(2 * MIB, 200 * MIB),
            Self::Cuda => ByteRange::new(300 * MIB, 768 * MIB),
        }
    }

    /// Host memory of the process besides the model's own buffers: on the CPU the same as
    /// [`Self::runtime_overhead`]; with CUDA, the process baseline plus the CUDA and cuBLAS host
    /// libraries and their allocations.
    pub fn host_baseline(self) -> ByteRange {
        match self {
            Self::Cpu => self.runtime_overhead(),
            Self::Cuda => ByteRange::new(150 * MIB, 1024 * MIB),
        }
    }
}

/// How the routed experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertStorage {
    /// The INT4 pack with FP16 scales per group of this many columns; allows partial residency.
    Int4(GroupSize),
    /// Dense experts in this dtype (BF16, F16 or F32), all resident.
    Dense(DType),
}

impl Default for ExpertStorage {
    fn default() -> Self {
        Self::Int4(GroupSize::default())
    }
}

impl ExpertStorage {
    /// Bytes of one expert of a layer with this hidden and expert intermediate size: the INT4
    /// slab ([`ExpertLayout::slab_bytes`]) or `3 · hidden · intermediate` dense weights.
    pub fn expert_bytes(self, hidden: usize, intermediate: usize) -> u64 {
        match self {
            Self::Int4(group_size) => ExpertLayout {
                hidden,
                intermediate,
                group_size,
            }
            .slab_bytes() as u64,
            Self::Dense(dtype) => product(&[3, hidden, intermediate, dtype.size_in_bytes()]),
        }
    }
}

/// What to plan for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Where the model runs.
    pub target: Target,
    /// Dtype of the non-expert weights (BF16, F16 or F32); activations are in
    /// [`Target::activation_dtype`] of it.
    pub dtype: DType,
    /// Non-expert projections requantized to INT8 after loading in `dtype` (CPU only; see
    /// [`crate::models::MoeForCausalLm::quantize_dense_int8`]).
    pub dense_int8: bool,
    /// How the routed experts are stored.
    pub experts: ExpertStorage,
    /// Context length (prompt plus generated tokens); `None`: `max_position_embeddings`.
    pub ctx: Option<usize>,
    /// Sequences decoded together.
    pub batch: usize,
    /// Tokens per forward pass during prefill; the workspace is sized for one such chunk.
    pub prefill_chunk: usize,
    /// Resident experts per MoE layer, as the runtime takes them ([`Plan::fit`] chooses its
    /// own). Unlike the runtime, the plan refuses counts above a layer's expert count.
    pub residency: Resident,
    /// Staging buffers of one expert each, shared by all layers (used with partial residency,
    /// and on the CPU with any expert cache).
    pub staging_buffers: usize,
}

impl PlanOptions {
    /// The defaults for `target`: its default dtype, INT4 experts with groups of 128, the
    /// model's full context, batch 1, prefill chunks of [`DEFAULT_PREFILL_CHUNK`] tokens, full
    /// residency and [`DEFAULT_STAGING_BUFFERS`] staging buffers.
    pub fn new(target: Target) -> Self {
        Self {
            target,
            dtype: target.default_dtype(),
            dense_int8: false,
            experts: ExpertStorage::default(),
            ctx: None,
            batch: 1,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            residency: Resident::All,
            staging_buffers: DEFAULT_STAGING_BUFFERS,
        }
    }
}

/// Options for a CUDA target ([`Target::default`]); `PlanOptions::new(Target::of(&device))` plans
/// for the device at hand.
impl Default for PlanOptions {
    fn default() -> Self {
        Self::new(Target::default())
    }
}

/// Parameters of everything but the routed experts, split into the projections INT8 dense
/// weights requantize (attention, dense MLPs, shared-expert MLPs, `lm_head`) and the rest
/// (embeddings, norms, routers, biases, shared-expert gates and the RoPE tables,
/// `[positions, head_dim / 2]` each for the positions a context of `ctx` tokens makes them hold
/// (see [`rotary_positions`]), stored in the compute dtype too).
struct NonExpertElements {
    projections: u64,
    rest: u64,
}

fn non_expert_elements(spec: &ModelSpec, ctx: usize) -> NonExpertElements {
    let (h, a) = (spec.hidden_size, &spec.attention);
    let q = spec.num_heads * spec.head_dim;
    let kv = spec.num_kv_heads * spec.head_dim;
    let if_set = |on: bool, n: u64| if on { n } else { 0 };
    let attention = sum(&[product(&[h, q + 2 * kv]), product(&[q, h])]);
    let attention_rest = sum(&[
        if_set(a.qkv_bias, (q + 2 * kv) as u64),
        if_set(a.o_bias, h as u64),
        spec.qk_norm_sizes().map_or(0, |(qn, kn)| (qn + kn) as u64),
    ]);
    let ffn = |layer: &FfnSpec| match layer {
        FfnSpec::Dense { intermediate_size } => (product(&[3, h, *intermediate_size]), 0),
        FfnSpec::Moe(m) => (
            m.shared_intermediate_size
                .map_or(0, |si| product(&[3, h, si])),
            sum(&[
                product(&[m.num_experts, h]),
                m.shared_intermediate_size.map_or(0, |_| h as u64),
            ]),
        ),
    };
    let (mut projections, mut rest) = (0u64, 0u64);
    for layer in &spec.layers {
        let (p, r) = ffn(layer);
        projections = sum(&[projections, attention, p]);
        rest = sum(&[rest, attention_rest, product(&[2, h]), r]);
    }
    let embedding = product(&[spec.vocab_size, h]);
    NonExpertElements {
        // `lm_head` (tied or not: INT8 makes a copy of a tied one).
        projections: projections.saturating_add(embedding),
        rest: rest
            .saturating_add(if spec.tie_word_embeddings {
                0
            } else {
                embedding
            })
            .saturating_add(h as u64)
            .saturating_add(product(&[rotary_positions(spec, ctx), spec.head_dim])),
    }
}

/// Most rows the rotary tables grow to for a context of `ctx` tokens: they start at
/// [`ROTARY_INITIAL_POSITIONS`] and double when a position passes them, so they never hold more
/// than twice the context (nor more than `max_position_embeddings`).
fn rotary_positions(spec: &ModelSpec, ctx: usize) -> usize {
    ROTARY_INITIAL_POSITIONS
        .max(ctx.saturating_mul(2))
        .min(spec.max_position_embeddings)
}

/// Bytes of the non-expert weights: everything in the weights' dtype, or with INT8 dense
/// weights the projections at 1 byte plus an FP16 scale per 32 and the rest in BF16.
fn non_expert_bytes(spec: &ModelSpec, opts: &PlanOptions, ctx: usize) -> u64 {
    let e = non_expert_elements(spec, ctx);
    if opts.dense_int8 {
        let scales = e
            .projections
            .div_ceil(crate::kernels::dense::INT8_GROUP as u64);
        sum(&[e.projections, scales * 2, e.rest.saturating_mul(2)])
    } else {
        (e.projections.saturating_add(e.rest)).saturating_mul(opts.dtype.size_in_bytes() as u64)
    }
}

/// Peak activations of one forward pass of `batch × chunk` tokens whose keys span `ctx`
/// positions (the last prefill chunk): the residual stream, plus the largest of the attention
/// stage, the feed-forward stage and the logits.
fn workspace(spec: &ModelSpec, opts: &PlanOptions, ctx: usize) -> ByteRange {
    let dt = opts.target.activation_dtype(opts.dtype).size_in_bytes();
    let (b, h, v) = (opts.batch, spec.hidden_size, spec.vocab_size);
    let chunk = opts.prefill_chunk.min(ctx);
    let n = b.saturating_mul(chunk);
    let hidden = product(&[n, h, dt]);
    let residual = ByteRange::new(hidden.saturating_mul(2), hidden.saturating_mul(4));

    // q, k, v (and their rotated, contiguous copies); the previous KV cache of a layer while
    // the longer one is concatenated (or, fused, while it grows into a new allocation); K/V
    // repeated to every query head under GQA (not fused); the scores (at least the softmax's
    // F32 input next to the probabilities in the dtype; at most also the matmul result and the
    // scaled and masked copies; fused, at most one row per sequence and head); the F32 causal
    // mask (not fused only).
    let fused = opts.target.fused_attention(opts.dtype);
    let (nh, nkv, hd) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    let qkv = product(&[n, nh + 2 * nkv, hd, dt]);
    let kv_dt = opts.target.kv_dtype(opts.dtype).size_in_bytes();
    let kv_grow = product(&[b, 2, nkv, hd, ctx, kv_dt]);
    let repeat = if nh == nkv || fused {
        0
    } else {
        product(&[b, 2, nh, hd, ctx, dt])
    };
    let scores = if fused {
        product(&[b, nh, ctx])
    } else {
        product(&[b, nh, chunk, ctx])
    };
    let mask = if fused { 0 } else { product(&[chunk, ctx, 4]) };
    let fixed = sum(&[kv_grow, repeat, mask]);
    let attention = ByteRange::new(
        sum(&[qkv, fixed, scores.saturating_mul(4 + dt as u64)]),
        sum(&[
            qkv.saturating_mul(2),
            fixed,
            scores.saturating_mul(12 + 2 * dt as u64),
        ]),
    );
    // An intermediate of `inter` bytes: at least gate, up and their product, at most also the
    // activation and the output.
    let mlp = |inter: u64| {
        ByteRange::new(
            inter.saturating_mul(3),
            sum(&[inter.saturating_mul(4), hidden]),
        )
    };

    let ffn = spec
        .layers
        .iter()
        .map(|layer| match layer {
            FfnSpec::Dense { intermediate_size } => mlp(product(&[n, *intermediate_size, dt])),
            FfnSpec::Moe(m) => {
                // Router logits (dtype), F32 probabilities and the u32 argsort; the routed
                // experts' intermediates (dtype at least, F32 in the kernels' scratch) and
                // output; the shared expert's gate, up and product.
                let router = product(&[n, m.num_experts, dt + 8]);
                let pairs = n.saturating_mul(m.top_k);
                let routed = ByteRange::new(
                    sum(&[product(&[pairs, m.intermediate_size, dt]), hidden]),
                    sum(&[
                        product(&[pairs, m.intermediate_size + h, 4]),
                        product(&[n, h, 4]),
                    ]),
                );
                let shared = m
                    .shared_intermediate_size
                    .map_or(ByteRange::default(), |si| mlp(product(&[n, si, dt])));
                ByteRange::exact(router) + routed + shared
            }
        })
        .fold(ByteRange::default(), ByteRange::max_of);

    // `lm_head` output in the dtype and its F32 copy: the last position of each sequence, or
    // every position (full-sequence logits, e.g. perplexity and parity).
    let logits = ByteRange::new(product(&[b, v, dt + 4]), product(&[n, v, dt + 4]));
    residual + attention.max_of(ffn).max_of(logits)
}

impl Plan {
    /// Predicts the memory of `spec` under `options`; an error for a model that is not valid
    /// or options it cannot run with (context beyond `max_position_embeddings`, residency below
    /// top-k or above the expert count, partial residency of dense experts, unsupported dtypes,
    /// zero sizes, sizes beyond `u64`).
    pub fn new(spec: &ModelSpec, options: &PlanOptions) -> crate::Result<Self> {
        spec.validate()?;
        Self::estimate(spec, options)
    }

    /// [`Plan::new`] for a model already validated.
    pub(super) fn estimate(spec: &ModelSpec, options: &PlanOptions) -> Result<Self, QmoeError> {
        let o = options;
        let float = |d: DType| matches!(d, DType::BF16 | DType::F16 | DType::F32);
        if !float(o.dtype) {
            return Err(plan_err(format!(
                "compute dtype {:?} is not supported (use bf16, f16 or f32)",
                o.dtype
            )));
        }
        if let ExpertStorage::Dense(d) = o.experts {
            if !float(d) {
                return Err(plan_err(format!(
                    "dense experts in {d:?} are not supported (use bf16, f16 or f32)"
                )));
            }
        }
        if o.dense_int8 && o.target != Target::Cpu {
            return Err(plan_err(
                "INT8 dense weights run on the CPU only (use bf16 on a GPU)",
            ));
        }
        if o.batch == 0 || o.prefill_chunk == 0 {
            return Err(plan_err("batch and prefill chunk must be at least 1"));
        }
        let max_ctx = spec.max_position_embeddings;
        let ctx = o.ctx.unwrap_or(max_ctx);
        if ctx == 0 || ctx > max_ctx {
            return Err(plan_err(format!(
                "context {ctx} must be between 1 and the model's max_position_embeddings = \
                 {max_ctx}"
            )));
        }
        let moe = moe_layers(spec);
        let resident = resolve(spec, &moe, o)?;
        let expert = |m: &MoeSpec| {
            o.experts
                .expert_bytes(spec.hidden_size, m.intermediate_size)
        };
        let full = moe.iter().all(|&(i, m)| resident[i] == m.num_experts);
        let int4 = matches!(o.experts, ExpertStorage::Int4(_));
        // On the CPU, INT4 experts at `Resident::All` are computed from the pack in place; an
        // explicit count runs a host-memory cache, even one of every expert.
        let in_place = int4 && o.target == Target::Cpu && o.residency == Resident::All;
        let expert_cache = match in_place {
            true => 0,
            false => moe
                .iter()
                .map(|&(i, m)| (resident[i] as u64).saturating_mul(expert(m)))
                .fold(0, u64::saturating_add),
        };
        // The runtime creates the staging ring with the cache; the plan counts it where the cache
        // misses, and on the CPU wherever a cache runs.
        let staged = int4 && !in_place && (!full || o.target == Target::Cpu);
        let staging = if !staged {
            0
        } else {
            let largest = moe.iter().map(|&(_, m)| expert(m)).max().unwrap_or(0);
            (o.staging_buffers as u64).saturating_mul(largest)
        };
        let pack_source = match o.experts {
            ExpertStorage::Int4(_) => moe
                .iter()
                .map(|&(_, m)| (m.num_experts as u64).saturating_mul(expert(m)))
                .fold(0, u64::saturating_add),
            ExpertStorage::Dense(_) => 0,
        };
        // The KV cache holds keys and values in `kv_dtype` (BF16 on the CPU with BF16 weights).
        // The fused path allocates ahead in chunks, but zeroed pages are mapped only when
        // written: what it holds is the positions used.
        let kv_dt = o.target.kv_dtype(o.dtype).size_in_bytes();
        let kv_cache = product(&[
            spec.num_layers(),
            2,
            spec.num_kv_heads,
            spec.head_dim,
            ctx,
            o.batch,
            kv_dt,
        ]);
        let exact = |component, bytes| ComponentBytes {
            component,
            bytes: ByteRange::exact(bytes),
        };
        let mut components = vec![exact(
            Component::NonExpertWeights,
            non_expert_bytes(spec, o, ctx),
        )];
        if o.target == Target::Cpu {
            components.push(exact(Component::PackSource, pack_source));
        }
        components.extend([
            exact(Component::ExpertCache, expert_cache),
            exact(Component::KvCache, kv_cache),
            exact(Component::Staging, staging),
            ComponentBytes {
                component: Component::Workspace,
                bytes: workspace(spec, o, ctx),
            },
            ComponentBytes {
                component: Component::RuntimeOverhead,
                bytes: o.target.runtime_overhead(),
            },
        ]);
        let process_rss = match o.target {
            Target::Cpu => components.iter().map(|c| c.bytes).sum(),
            // Pinned staging buffers live in host memory too.
            Target::Cuda => {
                ByteRange::exact(pack_source.saturating_add(staging)) + o.target.host_baseline()
            }
        };
        // Sizes saturate instead of overflowing; a saturated one is no prediction at all.
        let total: ByteRange = components.iter().map(|c| c.bytes).sum();
        if total.max == u64::MAX || process_rss.max == u64::MAX {
            let what = components
                .iter()
                .find(|c| c.bytes.max == u64::MAX)
                .map_or("the total", |c| c.component.name());
            return Err(plan_err(format!(
                "{what} needs 2^64 bytes or more (batch {}, context {ctx}, prefill chunk {}, \
                 {} staging buffers): no machine can hold it",
                o.batch, o.prefill_chunk, o.staging_buffers
            )));
        }
        let host = vec![
            exact(Component::PackSource, pack_source),
            ComponentBytes {
                component: Component::ProcessRss,
                bytes: process_rss,
            },
        ];
        Ok(Self {
            spec: spec.clone(),
            options: o.clone(),
            ctx,
            resident,
            components,
            host,
        })
    }
}

/// Resident experts per decoder layer (0 for dense layers), checked against each layer's top-k
/// and expert count.
fn resolve(
    spec: &ModelSpec,
    moe: &[(usize, &MoeSpec)],
    o: &PlanOptions,
) -> Result<Vec<usize>, QmoeError> {
    let mut resident = vec![0; spec.num_layers()];
    if let Resident::PerLayer(v) = &o.residency {
        if v.len() != spec.num_layers() {
            return Err(plan_err(format!(
                "the per-layer residency lists {} layers, the model has {}",
                v.len(),
                spec.num_layers()
            )));
        }
    }
    for &(i, m) in moe {
        let n = match &o.residency {
            Resident::All => m.num_experts,
            Resident::Uniform(n) => *n,
            Resident::PerLayer(v) => v[i],
        };
        if n < m.top_k || n > m.num_experts {
            return Err(plan_err(format!(
                "layer {i}: {n} resident experts is outside [top-k = {}, experts = {}]: a token \
                 needs its top-k experts of a layer at once",
                m.top_k, m.num_experts
            )));
        }
        if n < m.num_experts && matches!(o.experts, ExpertStorage::Dense(_)) {
            return Err(plan_err(format!(
                "layer {i}: {n} of {} experts resident, but dense experts are always fully \
                 resident (partial residency needs INT4 experts)",
                m.num_experts
            )));
        }
        if n < m.num_experts && o.staging_buffers == 0 {
            return Err(plan_err(
                "partial residency needs at least one staging buffer",
            ));
        }
        resident[i] = n;
    }
    Ok(resident)
}
