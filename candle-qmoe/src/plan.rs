//! Memory planning: predict what a model needs before anything is loaded, and fit the expert
//! cache to a memory budget.
//!
//! [`Plan::new`] turns a [`ModelSpec`] (from any `config.json`, no weights needed) and
//! [`PlanOptions`] into a byte range `[min, max]` per component:
//!
//! | component | what |
//! |---|---|
//! | `non_expert_weights` | embeddings, `lm_head` (unless tied), attention, norms, routers, shared experts, dense MLPs and the RoPE tables, in the compute dtype |
//! | `pack_source` | CPU only: the complete INT4 pack in host memory (on a GPU it is a host figure) |
//! | `expert_cache` | Σ over MoE layers of resident slots × bytes of one expert (INT4 slab or dense); on the CPU 0 for INT4 experts at [`Resident::All`], which are computed from the pack in place (no cache runs) |
//! | `kv_cache` | layers × 2 × KV heads × head dim × context × batch × dtype bytes |
//! | `staging` | the ring of staging buffers (one expert each) shared by all layers; 0 without a cache and, on a GPU, at full residency |
//! | `workspace` | activations of one forward pass at the prefill chunk size (attention scores, MLP intermediates, logits) |
//! | `runtime_overhead` | CUDA context and allocator slack, or on the CPU the process baseline |
//!
//! On [`Target::Cuda`] the components are device memory and [`Plan::host`] gives the host side
//! (the pack source and the process RSS). On [`Target::Cpu`] the "device" is host memory: every
//! component, the pack included, sums into the process RSS. There [`Resident::All`] means no
//! expert cache, as the runtime runs without a residency profile; an explicit count
//! ([`Resident::Uniform`], [`Resident::PerLayer`]) means a host-memory cache, whose slot arena
//! and staging ring come on top of the pack even when it holds every expert (as a runtime
//! residency of `all` does).
//!
//! The CPU figures are calibrated against the peak RSS of the synthetic models
//! (`bench/calibrate-cpu.sh`, `bench/results/calibration-cpu.jsonl`, `tests/calibration.rs`).
//!
//! [`Plan::fit`] picks the largest per-layer expert capacities whose maximum total fits a budget
//! (optionally weighted per layer, e.g. by recorded misses; optionally reducing the context), or
//! refuses with an error that names the component that does not fit, the breakdown, and what
//! would fit. [`parse_bytes`] reads budgets such as `6GiB` or `6000MB`.
//!
//! ```
//! use candle_qmoe::models::{AnyConfig, ModelConfig};
//! use candle_qmoe::plan::{parse_bytes, FitOptions, Plan, PlanOptions, Target};
//! use candle_qmoe::synthetic::SyntheticKind;
//!
//! # fn main() -> candle::Result<()> {
//! // OLMoE-1B-7B's config.json; no weights are read.
//! let config = AnyConfig::from_json_str(&SyntheticKind::Olmoe.config_json().to_string())?;
//! let opts = PlanOptions { ctx: Some(4096), ..PlanOptions::new(Target::Cuda) };
//! let plan = Plan::new(&config.spec()?, &opts)?;
//! println!("{}", plan.table(None));
//! let fit = plan.fit(parse_bytes("4GiB")?, &FitOptions::default())?;
//! assert!(fit.plan.resident_per_layer().iter().all(|&n| (8..64).contains(&n)));
//! assert!(plan.fit(parse_bytes("1GiB")?, &FitOptions::default()).is_err());
//! # Ok(()) }
//! ```

use candle::DType;
use serde::Serialize;

use crate::models::{FfnSpec, ModelSpec, MoeSpec};
use crate::pack::{ExpertLayout, GroupSize};
use crate::residency::Resident;
use crate::QmoeError;

/// Name of the non-expert weights component.
pub const NON_EXPERT_WEIGHTS: &str = "non_expert_weights";
/// Name of the INT4 pack source (a component on the CPU, a host figure on a GPU).
pub const PACK_SOURCE: &str = "pack_source";
/// Name of the expert cache component.
pub const EXPERT_CACHE: &str = "expert_cache";
/// Name of the KV cache component.
pub const KV_CACHE: &str = "kv_cache";
/// Name of the staging ring component.
pub const STAGING: &str = "staging";
/// Name of the activations workspace component.
pub const WORKSPACE: &str = "workspace";
/// Name of the runtime overhead component.
pub const RUNTIME_OVERHEAD: &str = "runtime_overhead";
/// Name of the predicted process resident set size (a host figure).
pub const PROCESS_RSS: &str = "process_rss";

/// The order in which a refusal adds components up: the runtime and the weights first (in the
/// order they are loaded), then what the context, the chunk size and the residency change.
const FIT_ORDER: [&str; 7] = [
    RUNTIME_OVERHEAD,
    NON_EXPERT_WEIGHTS,
    PACK_SOURCE,
    KV_CACHE,
    WORKSPACE,
    STAGING,
    EXPERT_CACHE,
];

/// Default tokens per prefill chunk (the workspace is sized for one chunk): what
/// [`crate::generation::generate`] uses.
pub const DEFAULT_PREFILL_CHUNK: usize = crate::generation::PREFILL_CHUNK;
/// Default number of staging buffers.
pub const DEFAULT_STAGING_BUFFERS: usize = 2;
/// Default fraction of the budget [`Plan::fit`] holds back on top of every range's maximum.
pub const DEFAULT_MARGIN: f64 = 0.02;

const MIB: u64 = 1 << 20;

fn plan_err(msg: impl Into<String>) -> candle::Error {
    QmoeError::Plan(msg.into()).into()
}

/// Product of sizes, saturating instead of overflowing on absurd configs.
fn product(factors: &[usize]) -> u64 {
    factors
        .iter()
        .fold(1u64, |acc, &f| acc.saturating_mul(f as u64))
}

/// `bytes` with a binary unit, two decimals above plain bytes (`512 B`, `5.73 GiB`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Parses a memory size: a whole number of bytes (`6442450944`), or a number with a decimal
/// unit `B`, `KB`, `MB`, `GB`, `TB` (powers of 1000) or a binary unit `KiB`, `MiB`, `GiB`, `TiB`
/// (powers of 1024), unit letters in any case, no space: `6GiB`, `6000MB`, `7.5GiB`.
///
/// Spaces inside (`6 GB`), signs (`-1`), words (`lots`), unknown units (`6G`), zero and sizes
/// beyond `u64` are errors that say what to write instead.
pub fn parse_bytes(s: &str) -> candle::Result<u64> {
    let bad = |why: &str| {
        plan_err(format!(
            "invalid memory size `{s}`: {why} (write e.g. 6GiB, 6000MB, 512MiB or a number of \
             bytes)"
        ))
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad("it is empty"));
    }
    if t.chars().any(char::is_whitespace) {
        return Err(bad("no space is allowed inside it"));
    }
    if t.starts_with('-') {
        return Err(bad("a memory size cannot be negative"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() || (number.contains('.') && frac.is_empty()) || frac.contains('.') {
        return Err(bad("it does not start with a number"));
    }
    let scale: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => {
            return Err(bad(&format!(
                "unknown unit `{unit}`; use B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, \
                 TiB (powers of 1024)"
            )))
        }
    };
    if !frac.is_empty() && scale == 1 {
        return Err(bad("a number of bytes must be whole"));
    }
    if int.len() > 20 || frac.len() > 12 {
        return Err(bad("it is too large or too precise"));
    }
    let digits = |d: &str| d.parse::<u128>().unwrap_or(0);
    let frac_bytes = digits(frac) * scale / 10u128.pow(frac.len() as u32);
    let bytes = digits(int) * scale + frac_bytes;
    if bytes == 0 {
        return Err(bad("it must be greater than zero"));
    }
    u64::try_from(bytes).map_err(|_| bad("it is too large"))
}

/// Where the model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Target {
    /// The CPU: every component lives in host memory and sums into the process RSS.
    Cpu,
    /// A CUDA GPU: the components are device memory; the pack source stays on the host.
    #[default]
    Cuda,
}

impl Target {
    /// The compute dtype the examples use here: F32 on the CPU, BF16 on a GPU.
    pub fn default_dtype(self) -> DType {
        match self {
            Self::Cpu => DType::F32,
            Self::Cuda => DType::BF16,
        }
    }

    /// The name used on command lines and in evidence files (`cpu`, `cuda`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }

    /// Memory the runtime takes besides the model. CUDA: context, cuBLAS handles and allocator
    /// slack in device memory. CPU: the process baseline: from the binary and its libraries
    /// alone (about 3 MiB measured) up to a tokenizer, allocator slack and, with a host-memory
    /// expert cache, the one-off probe of the copy bandwidth (two 32 MiB buffers).
    pub fn runtime_overhead(self) -> ByteRange {
        match self {
            Self::Cpu => ByteRange::new(2 * MIB, 200 * MIB),
            Self::Cuda => ByteRange::new(300 * MIB, 700 * MIB),
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
    /// Compute dtype of everything but the routed experts (BF16, F16 or F32).
    pub dtype: DType,
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
            experts: ExpertStorage::default(),
            ctx: None,
            batch: 1,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            residency: Resident::All,
            staging_buffers: DEFAULT_STAGING_BUFFERS,
        }
    }
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self::new(Target::default())
    }
}

/// A byte range `[min, max]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ByteRange {
    /// Lower bound in bytes.
    #[serde(rename = "min_bytes")]
    pub min: u64,
    /// Upper bound in bytes.
    #[serde(rename = "max_bytes")]
    pub max: u64,
}

impl ByteRange {
    /// `[min, max]`.
    pub const fn new(min: u64, max: u64) -> Self {
        Self { min, max }
    }

    /// A range of exactly `bytes`.
    pub const fn exact(bytes: u64) -> Self {
        Self::new(bytes, bytes)
    }

    /// The element-wise larger of two ranges.
    fn max_of(self, other: Self) -> Self {
        Self::new(self.min.max(other.min), self.max.max(other.max))
    }
}

impl std::ops::Add for ByteRange {
    type Output = Self;

    fn add(self, rhs: Self) -> Self {
        Self::new(
            self.min.saturating_add(rhs.min),
            self.max.saturating_add(rhs.max),
        )
    }
}

impl std::iter::Sum for ByteRange {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |a, b| a + b)
    }
}

/// One predicted component; serialises as `{name, min_bytes, max_bytes}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Component {
    /// Component name, one of the constants of this module (e.g. [`KV_CACHE`]).
    pub name: &'static str,
    /// Its predicted bytes.
    #[serde(flatten)]
    pub bytes: ByteRange,
}

/// The predicted memory of one model configuration.
#[derive(Clone, Debug)]
pub struct Plan {
    spec: ModelSpec,
    options: PlanOptions,
    ctx: usize,
    resident: Vec<usize>,
    components: Vec<Component>,
    host: Vec<Component>,
}

/// The MoE layers of `spec` as `(decoder layer index, block)`.
fn moe_layers(spec: &ModelSpec) -> Vec<(usize, &MoeSpec)> {
    spec.layers
        .iter()
        .enumerate()
        .filter_map(|(i, l)| match l {
            FfnSpec::Moe(m) => Some((i, m)),
            FfnSpec::Dense { .. } => None,
        })
        .collect()
}

/// Parameters of everything but the routed experts, plus the RoPE tables (`cos` and `sin`,
/// `[max_position_embeddings, head_dim / 2]` each), which are stored in the compute dtype too.
fn non_expert_elements(spec: &ModelSpec) -> u64 {
    let (h, a) = (spec.hidden_size, &spec.attention);
    let q = spec.num_heads * spec.head_dim;
    let kv = spec.num_kv_heads * spec.head_dim;
    let if_set = |on: bool, n: u64| if on { n } else { 0 };
    let attention = product(&[h, q + 2 * kv])
        + product(&[q, h])
        + if_set(a.qkv_bias, (q + 2 * kv) as u64)
        + if_set(a.o_bias, h as u64)
        + if_set(a.qk_norm, (q + kv) as u64);
    let ffn = |layer: &FfnSpec| match layer {
        FfnSpec::Dense { intermediate_size } => product(&[3, h, *intermediate_size]),
        FfnSpec::Moe(m) => {
            product(&[m.num_experts, h])
                + m.shared_intermediate_size
                    .map_or(0, |si| product(&[3, h, si]) + h as u64)
        }
    };
    let layers: u64 = spec
        .layers
        .iter()
        .map(|l| attention + 2 * h as u64 + ffn(l))
        .fold(0, u64::saturating_add);
    let heads = if spec.tie_word_embeddings { 1 } else { 2 };
    product(&[heads, spec.vocab_size, h])
        .saturating_add(h as u64)
        .saturating_add(layers)
        .saturating_add(product(&[spec.max_position_embeddings, spec.head_dim]))
}

/// Peak activations of one forward pass of `batch × chunk` tokens whose keys span `ctx`
/// positions (the last prefill chunk): the residual stream, plus the largest of the attention
/// stage, the feed-forward stage and the logits.
fn workspace(spec: &ModelSpec, opts: &PlanOptions, ctx: usize) -> ByteRange {
    let dt = opts.dtype.size_in_bytes();
    let (b, h, v) = (opts.batch, spec.hidden_size, spec.vocab_size);
    let chunk = opts.prefill_chunk.min(ctx);
    let n = b * chunk;
    let hidden = product(&[n, h, dt]);
    let residual = ByteRange::new(2 * hidden, 4 * hidden);

    // q, k, v (and their rotated, contiguous copies); the previous KV cache of a layer while
    // the longer one is concatenated; K/V repeated to every query head under GQA; the scores
    // (at least the softmax's F32 input next to the probabilities in the dtype; at most also
    // the matmul result and the scaled and masked copies); the F32 causal mask.
    let (nh, nkv, hd) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    let qkv = product(&[n, nh + 2 * nkv, hd, dt]);
    let kv_grow = product(&[b, 2, nkv, hd, ctx, dt]);
    let repeat = if nh == nkv {
        0
    } else {
        product(&[b, 2, nh, hd, ctx, dt])
    };
    let scores = product(&[b, nh, chunk, ctx]);
    let mask = product(&[chunk, ctx, 4]);
    let fixed = kv_grow + repeat + mask;
    let attention = ByteRange::new(
        qkv + fixed + scores * (4 + dt as u64),
        2 * qkv + fixed + scores * (12 + 2 * dt as u64),
    );

    let ffn = spec
        .layers
        .iter()
        .map(|layer| match layer {
            FfnSpec::Dense { intermediate_size } => {
                let inter = product(&[n, *intermediate_size, dt]);
                ByteRange::new(3 * inter, 4 * inter + hidden)
            }
            FfnSpec::Moe(m) => {
                // Router logits (dtype), F32 probabilities and the u32 argsort; the routed
                // experts' intermediates (dtype at least, F32 in the kernels' scratch) and
                // output; the shared expert's gate, up and product.
                let router = product(&[n, m.num_experts, dt + 8]);
                let pairs = n * m.top_k;
                let routed = ByteRange::new(
                    product(&[pairs, m.intermediate_size, dt]) + hidden,
                    product(&[pairs, m.intermediate_size + h, 4]) + product(&[n, h, 4]),
                );
                let shared = m
                    .shared_intermediate_size
                    .map_or(ByteRange::default(), |si| {
                        let inter = product(&[n, si, dt]);
                        ByteRange::new(3 * inter, 4 * inter + hidden)
                    });
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
    /// Predicts the memory of `spec` under `options`; an error for options the model cannot
    /// run with (context beyond `max_position_embeddings`, residency below top-k or above the
    /// expert count, partial residency of dense experts, unsupported dtypes, zero sizes).
    pub fn new(spec: &ModelSpec, options: &PlanOptions) -> candle::Result<Self> {
        spec.validate()?;
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
        let resident = Self::resolve(spec, &moe, o)?;
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
        let dt = o.dtype.size_in_bytes();
        let kv_cache = product(&[
            spec.num_layers(),
            2,
            spec.num_kv_heads,
            spec.head_dim,
            ctx,
            o.batch,
            dt,
        ]);
        let exact = |name, bytes| Component {
            name,
            bytes: ByteRange::exact(bytes),
        };
        let mut components = vec![exact(
            NON_EXPERT_WEIGHTS,
            non_expert_elements(spec).saturating_mul(dt as u64),
        )];
        if o.target == Target::Cpu {
            components.push(exact(PACK_SOURCE, pack_source));
        }
        components.extend([
            exact(EXPERT_CACHE, expert_cache),
            exact(KV_CACHE, kv_cache),
            exact(STAGING, staging),
            Component {
                name: WORKSPACE,
                bytes: workspace(spec, o, ctx),
            },
            Component {
                name: RUNTIME_OVERHEAD,
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
        let host = vec![
            exact(PACK_SOURCE, pack_source),
            Component {
                name: PROCESS_RSS,
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

    /// Resident experts per decoder layer (0 for dense layers), checked against each layer's
    /// top-k and expert count.
    fn resolve(
        spec: &ModelSpec,
        moe: &[(usize, &MoeSpec)],
        o: &PlanOptions,
    ) -> candle::Result<Vec<usize>> {
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
                    "layer {i}: {n} resident experts is outside [top-k = {}, experts = {}]: a \
                     token needs its top-k experts of a layer at once",
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

    /// The components that count against a budget, in a fixed order: device memory on a GPU,
    /// process memory on the CPU.
    pub fn components(&self) -> &[Component] {
        &self.components
    }

    /// The component called `name`, if this target has it.
    pub fn component(&self, name: &str) -> Option<ByteRange> {
        self.components
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.bytes)
    }

    /// The sum of [`Self::components`].
    pub fn total(&self) -> ByteRange {
        self.components.iter().map(|c| c.bytes).sum()
    }

    /// Host figures: [`PACK_SOURCE`] (every expert's INT4 slab; 0 for dense experts) and
    /// [`PROCESS_RSS`] (on the CPU equal to [`Self::total`]) after loading.
    pub fn host(&self) -> &[Component] {
        &self.host
    }

    /// Resident experts per decoder layer (0 for dense layers); usable as
    /// [`Resident::PerLayer`] for the runtime.
    pub fn resident_per_layer(&self) -> &[usize] {
        &self.resident
    }

    /// The context length planned for.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// The options the plan was made with (its residency is what [`Plan::fit`] chose).
    pub fn options(&self) -> &PlanOptions {
        &self.options
    }

    /// The model.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The same model and options at another context and residency.
    fn variant(&self, ctx: usize, residency: Resident) -> candle::Result<Self> {
        let options = PlanOptions {
            ctx: Some(ctx),
            residency,
            ..self.options.clone()
        };
        Self::new(&self.spec, &options)
    }

    /// The cheapest plan at `ctx`: top-k slots per MoE layer, or full residency where that
    /// costs less (dense experts; INT4 experts on the CPU, whose pack is in memory anyway).
    fn smallest(&self, ctx: usize) -> candle::Result<Self> {
        let full = self.variant(ctx, Resident::All)?;
        if matches!(self.options.experts, ExpertStorage::Dense(_)) {
            return Ok(full);
        }
        let top_k = self
            .spec
            .layers
            .iter()
            .map(|l| match l {
                FfnSpec::Moe(m) => m.top_k,
                FfnSpec::Dense { .. } => 0,
            })
            .collect();
        let top_k = self.variant(ctx, Resident::PerLayer(top_k))?;
        Ok(match top_k.total().max < full.total().max {
            true => top_k,
            false => full,
        })
    }

    /// The components as an aligned table: name, min, max and, with a budget, the max's share
    /// of it; a total row last.
    pub fn table(&self, budget: Option<u64>) -> String {
        let share = |bytes: u64| {
            budget.map_or(String::new(), |b| {
                format!(" {:>7.1}%", 100.0 * bytes as f64 / b as f64)
            })
        };
        let header = if budget.is_some() { "    share" } else { "" };
        let mut out = format!("{:<20} {:>12} {:>12}{header}\n", "component", "min", "max");
        let total = Component {
            name: "total",
            bytes: self.total(),
        };
        for c in self.components.iter().chain([&total]) {
            out += &format!(
                "{:<20} {:>12} {:>12}{}\n",
                c.name,
                format_bytes(c.bytes.min),
                format_bytes(c.bytes.max),
                share(c.bytes.max)
            );
        }
        out
    }

    /// One line describing the model, target, context and residency.
    pub fn summary(&self) -> String {
        let o = &self.options;
        let experts = match o.experts {
            ExpertStorage::Int4(g) => format!("int4 g{}", g.get()),
            ExpertStorage::Dense(d) => format!("dense {d:?}"),
        };
        format!(
            "{} on {}, {:?} compute, {experts} experts, ctx {}, batch {}, prefill chunk {}, \
             resident experts per layer {}",
            self.spec.model_type,
            o.target.name(),
            o.dtype,
            self.ctx,
            o.batch,
            o.prefill_chunk.min(self.ctx),
            describe_residency(&self.spec, &self.resident)
        )
    }

    /// Checks that this exact plan fits `budget` with `margin` (a fraction of the budget) held
    /// back on top of every component's maximum; otherwise an error naming the component that
    /// does not fit, with the breakdown and the smallest budget that fits this plan.
    pub fn admit(&self, budget: u64, margin: f64) -> candle::Result<()> {
        let usable = usable_budget(budget, margin)?;
        if self.total().max <= usable {
            return Ok(());
        }
        Err(self.refusal(
            budget,
            usable,
            &format!(
                "this plan needs a budget of at least {}",
                format_bytes(needed_budget(self.total().max, margin))
            ),
        ))
    }

    /// The largest per-layer expert capacities whose maximum total fits `budget`, or a refusal.
    ///
    /// Full residency is taken when it fits. Otherwise every MoE layer gets its top-k slots and
    /// the remaining budget is dealt out one slot at a time to the layer with the highest
    /// `weight / (extra slots + 1)` (equal weights: round-robin, so capacities differ by at most
    /// one). Partial residency only helps where it costs less than full residency: not for
    /// dense experts, and not for INT4 experts on the CPU, where the pack is in memory anyway
    /// and a slot arena only adds to it; there the fit is full residency or nothing.
    ///
    /// When even the cheapest plan does not fit, the context is reduced to the largest that fits
    /// if [`FitOptions::allow_ctx_reduction`]; otherwise the error names the component that does
    /// not fit and gives the breakdown of the cheapest plan, the smallest budget that holds it,
    /// and the largest context within this budget.
    pub fn fit(&self, budget: u64, opts: &FitOptions) -> candle::Result<Fit> {
        let usable = usable_budget(budget, opts.margin)?;
        let moe = moe_layers(&self.spec);
        let weights = match &opts.weights {
            None => vec![1.0; moe.len()],
            Some(w) if w.len() != moe.len() => {
                return Err(plan_err(format!(
                    "{} layer weights given for {} MoE layers",
                    w.len(),
                    moe.len()
                )))
            }
            Some(w) if w.iter().any(|x| !(x.is_finite() && *x >= 0.0)) => {
                return Err(plan_err(format!(
                    "layer weights must be finite and non-negative, got {w:?}"
                )))
            }
            Some(w) => w.clone(),
        };
        let fit = |plan| Fit {
            plan,
            budget,
            margin_bytes: budget - usable,
            requested_ctx: self.ctx,
        };
        if let Some(plan) = self.fit_at(self.ctx, usable, &weights)? {
            return Ok(fit(plan));
        }
        let largest_ctx = self.largest_ctx(usable)?;
        if let (true, Some(ctx)) = (opts.allow_ctx_reduction, largest_ctx) {
            if let Some(plan) = self.fit_at(ctx, usable, &weights)? {
                return Ok(fit(plan));
            }
        }
        let minimal = self.smallest(self.ctx)?;
        let need = needed_budget(minimal.total().max, opts.margin);
        let mut advice = format!(
            "a budget of at least {} at ctx {}",
            format_bytes(need),
            self.ctx
        );
        advice += &match largest_ctx {
            Some(c) if opts.allow_ctx_reduction => format!("; ctx {c} fits this budget"),
            Some(c) => format!(
                ", or ctx ≤ {c} within this budget (allow context reduction: \
                 --allow-ctx-reduction)"
            ),
            None => format!(
                "; no context length fits {} (the fixed costs alone exceed it)",
                format_bytes(budget)
            ),
        };
        Err(minimal.refusal(budget, usable, &advice))
    }

    /// The plan at `ctx` with the largest capacities within `usable` bytes, if any fits.
    fn fit_at(&self, ctx: usize, usable: u64, weights: &[f64]) -> candle::Result<Option<Self>> {
        let full = self.variant(ctx, Resident::All)?;
        if full.total().max <= usable {
            return Ok(Some(full));
        }
        let minimal = self.smallest(ctx)?;
        let Some(mut free) = usable.checked_sub(minimal.total().max) else {
            return Ok(None);
        };
        if minimal.resident == full.resident {
            return Ok(None);
        }
        let moe = moe_layers(&self.spec);
        let mut slots = minimal.resident.clone();
        let cost: Vec<u64> = moe
            .iter()
            .map(|&(_, m)| {
                self.options
                    .experts
                    .expert_bytes(self.spec.hidden_size, m.intermediate_size)
            })
            .collect();
        let extra = |j: usize, slots: &[usize]| slots[moe[j].0] - moe[j].1.top_k;
        loop {
            let next = (0..moe.len())
                .filter(|&j| slots[moe[j].0] < moe[j].1.num_experts && cost[j] <= free)
                .max_by(|&a, &b| {
                    let pa = weights[a] / (extra(a, &slots) + 1) as f64;
                    let pb = weights[b] / (extra(b, &slots) + 1) as f64;
                    pa.total_cmp(&pb)
                        .then(extra(b, &slots).cmp(&extra(a, &slots)))
                        .then(b.cmp(&a))
                });
            let Some(j) = next else { break };
            slots[moe[j].0] += 1;
            free -= cost[j];
        }
        Ok(Some(self.variant(ctx, Resident::PerLayer(slots))?))
    }

    /// The largest context below the requested one at which the cheapest plan fits.
    fn largest_ctx(&self, usable: u64) -> candle::Result<Option<usize>> {
        let fits =
            |ctx: usize| -> candle::Result<bool> { Ok(self.smallest(ctx)?.total().max <= usable) };
        if self.ctx <= 1 || !fits(1)? {
            return Ok(None);
        }
        // Invariant: `lo` fits, `hi` does not.
        let (mut lo, mut hi) = (1, self.ctx);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(Some(lo))
    }

    /// The error for a plan whose maximum exceeds `usable`: adds the components up in
    /// [`FIT_ORDER`] and names the first one that crosses the budget.
    fn refusal(&self, budget: u64, usable: u64, advice: &str) -> candle::Error {
        let mut ordered: Vec<&Component> = self.components.iter().collect();
        ordered.sort_by_key(|c| FIT_ORDER.iter().position(|n| *n == c.name));
        let mut used = 0u64;
        let mut before = Vec::new();
        let mut culprit = None;
        for c in ordered {
            if used.saturating_add(c.bytes.max) > usable {
                culprit = Some(c);
                break;
            }
            used += c.bytes.max;
            if c.bytes.max > 0 {
                before.push(format!("{} {}", c.name, format_bytes(c.bytes.max)));
            }
        }
        let what = culprit.map_or_else(
            || "the total".to_string(),
            |c| {
                let after = match before.is_empty() {
                    true => String::new(),
                    false => format!(" after {}", before.join(", ")),
                };
                format!(
                    "`{}` does not fit: it needs up to {} but only {} is left{after}",
                    c.name,
                    format_bytes(c.bytes.max),
                    format_bytes(usable - used),
                )
            },
        );
        plan_err(format!(
            "a budget of {} ({} after the margin) does not fit {}; {what}.\nbreakdown ({}):\n{}\
             what would fit: {advice}",
            format_bytes(budget),
            format_bytes(usable),
            self.spec.model_type,
            self.summary(),
            self.table(Some(budget)),
        ))
    }
}

/// `resident` (per decoder layer) in words: `64 of 64 (all)`, `26 of 64` or `26–27 of 64`.
fn describe_residency(spec: &ModelSpec, resident: &[usize]) -> String {
    let moe = moe_layers(spec);
    let slots = moe.iter().map(|&(i, _)| resident[i]);
    let (Some(lo), Some(hi)) = (slots.clone().min(), slots.max()) else {
        return "none (no MoE layer)".into();
    };
    let experts = moe.iter().map(|&(_, m)| m.num_experts).max().unwrap_or(0);
    match (lo, hi) {
        _ if moe.iter().all(|&(i, m)| resident[i] == m.num_experts) => {
            format!("{experts} of {experts} (all)")
        }
        _ if lo == hi => format!("{lo} of {experts}"),
        _ => format!("{lo}–{hi} of {experts}"),
    }
}

/// The budget minus the margin; an error for a margin outside `[0, 1)` or a zero budget.
fn usable_budget(budget: u64, margin: f64) -> candle::Result<u64> {
    if !(0.0..1.0).contains(&margin) {
        return Err(plan_err(format!(
            "margin {margin} must be a fraction of the budget in [0, 1)"
        )));
    }
    if budget == 0 {
        return Err(plan_err("the budget must be greater than zero"));
    }
    Ok(budget - (budget as f64 * margin).ceil() as u64)
}

/// The smallest budget whose usable part (after `margin`) holds `bytes`.
fn needed_budget(bytes: u64, margin: f64) -> u64 {
    let mut budget = (bytes as f64 / (1.0 - margin)).ceil() as u64;
    while budget < u64::MAX && usable_budget(budget, margin).is_ok_and(|u| u < bytes) {
        budget += 1;
    }
    budget
}

/// How [`Plan::fit`] chooses.
#[derive(Clone, Debug, PartialEq)]
pub struct FitOptions {
    /// One weight per MoE layer (e.g. its recorded misses): heavier layers get spare slots
    /// first, in proportion to their weight; `None`: all layers alike.
    pub weights: Option<Vec<f64>>,
    /// Reduce the context when top-k slots per layer do not fit at the requested one.
    pub allow_ctx_reduction: bool,
    /// Fraction of the budget held back on top of every component's maximum.
    pub margin: f64,
}

impl Default for FitOptions {
    fn default() -> Self {
        Self {
            weights: None,
            allow_ctx_reduction: false,
            margin: DEFAULT_MARGIN,
        }
    }
}

/// The result of [`Plan::fit`].
#[derive(Clone, Debug)]
pub struct Fit {
    /// The chosen plan: its residency and context.
    pub plan: Plan,
    /// The budget fitted to.
    pub budget: u64,
    /// Bytes held back as margin.
    pub margin_bytes: u64,
    /// The context that was asked for (the plan's is smaller when it was reduced).
    pub requested_ctx: usize,
}

impl Fit {
    /// Whether the context was reduced to fit.
    pub fn ctx_reduced(&self) -> bool {
        self.plan.ctx() < self.requested_ctx
    }

    /// Budget left after the margin and the plan's maximum.
    pub fn headroom(&self) -> u64 {
        (self.budget - self.margin_bytes).saturating_sub(self.plan.total().max)
    }
}
