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
//! The components are named by [`Component`], whose names (above) are those of the tables and
//! the JSON evidence files.
//!
//! [`Plan::fit`] picks the largest per-layer expert capacities whose maximum total fits a budget
//! (optionally weighted per layer, e.g. by recorded misses; optionally reducing the context), or
//! refuses with [`QmoeError::DoesNotFit`]: the component that does not fit, the bytes it needs
//! and those left for it, the breakdown, and what would fit. [`parse_bytes`] reads budgets such
//! as `6GiB` or `6000MB`.
//!
//! The code is split by concern: `bytes` (byte ranges, reading and writing sizes), `estimate`
//! (the per-component predictions), `fit` (capacities for a budget) and `report` (the text
//! table and summary); everything public is re-exported here.
//!
//! ```
//! use candle_qmoe::models::{AnyConfig, ModelConfig};
//! use candle_qmoe::plan::{parse_bytes, Component, FitOptions, Plan, PlanOptions, Target};
//! use candle_qmoe::QmoeError;
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
//! // 1 GiB cannot hold the runtime overhead and the non-expert weights together.
//! let refused = plan.fit(parse_bytes("1GiB")?, &FitOptions::default());
//! assert!(matches!(
//!     refused,
//!     Err(QmoeError::DoesNotFit { component: Component::NonExpertWeights, .. })
//! ));
//! # Ok(()) }
//! ```

use serde::{Serialize, Serializer};

use crate::models::{ModelSpec, MoeSpec};
use crate::residency::Resident;
use crate::QmoeError;

mod bytes;
mod estimate;
mod fit;
mod report;

pub use bytes::{format_bytes, parse_bytes, ByteRange};
pub use estimate::{
    ExpertStorage, PlanOptions, Target, DEFAULT_PREFILL_CHUNK, DEFAULT_STAGING_BUFFERS,
};
pub use fit::{Fit, FitOptions, DEFAULT_MARGIN};

/// A planned memory figure; [`Display`](std::fmt::Display) and serde give its name in the
/// tables and evidence files (`kv_cache`, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Component {
    /// `non_expert_weights`: embeddings, `lm_head`, attention, norms, routers, shared experts,
    /// dense MLPs and the RoPE tables.
    NonExpertWeights,
    /// `pack_source`: the complete INT4 pack in host memory (a component on the CPU, a host
    /// figure on a GPU).
    PackSource,
    /// `expert_cache`: the resident expert slots of every MoE layer.
    ExpertCache,
    /// `kv_cache`: keys and values of every layer over the context.
    KvCache,
    /// `staging`: the ring of staging buffers shared by all layers.
    Staging,
    /// `workspace`: the activations of one forward pass.
    Workspace,
    /// `runtime_overhead`: CUDA context and allocator slack, or the CPU process baseline.
    RuntimeOverhead,
    /// `process_rss`: the predicted resident set size of the process (a host figure).
    ProcessRss,
}

impl Component {
    /// The name in tables and evidence files, e.g. `kv_cache`.
    pub fn name(self) -> &'static str {
        match self {
            Self::NonExpertWeights => "non_expert_weights",
            Self::PackSource => "pack_source",
            Self::ExpertCache => "expert_cache",
            Self::KvCache => "kv_cache",
            Self::Staging => "staging",
            Self::Workspace => "workspace",
            Self::RuntimeOverhead => "runtime_overhead",
            Self::ProcessRss => "process_rss",
        }
    }
}

impl std::fmt::Display for Component {
    /// [`Component::name`], honouring width and alignment (`{:<20}`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

impl Serialize for Component {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// One predicted component and its bytes; serialises as `{name, min_bytes, max_bytes}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ComponentBytes {
    /// Which component.
    #[serde(rename = "name")]
    pub component: Component,
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
    components: Vec<ComponentBytes>,
    host: Vec<ComponentBytes>,
}

impl Plan {
    /// The components that count against a budget, in a fixed order: device memory on a GPU,
    /// process memory on the CPU.
    pub fn components(&self) -> &[ComponentBytes] {
        &self.components
    }

    /// The bytes of `component`, if it counts against the budget on this target.
    pub fn component(&self, component: Component) -> Option<ByteRange> {
        self.components
            .iter()
            .find(|c| c.component == component)
            .map(|c| c.bytes)
    }

    /// The sum of [`Self::components`].
    pub fn total(&self) -> ByteRange {
        self.components.iter().map(|c| c.bytes).sum()
    }

    /// Host figures: [`Component::PackSource`] (every expert's INT4 slab; 0 for dense experts)
    /// and [`Component::ProcessRss`] (on the CPU equal to [`Self::total`]) after loading.
    pub fn host(&self) -> &[ComponentBytes] {
        &self.host
    }

    /// Resident experts per decoder layer (0 for dense layers); usable as
    /// [`Resident::PerLayer`] for the runtime.
    pub fn resident_per_layer(&self) -> &[usize] {
        &self.resident
    }

    /// The expert cache this plan asks the runtime for: `None` when every MoE layer keeps all
    /// its experts (no cache needed), else [`Resident::PerLayer`] with the chosen capacities;
    /// put it in [`ResidencyOptions::resident`](crate::residency::ResidencyOptions).
    pub fn expert_cache(&self) -> Option<Resident> {
        let all = moe_layers(&self.spec)
            .into_iter()
            .all(|(l, m)| self.resident[l] >= m.num_experts);
        (!all).then(|| Resident::PerLayer(self.resident.clone()))
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
}

/// A [`QmoeError::Plan`] with this message.
fn plan_err(msg: impl Into<String>) -> QmoeError {
    QmoeError::Plan(msg.into())
}

/// The MoE layers of `spec` as `(decoder layer index, block)`.
fn moe_layers(spec: &ModelSpec) -> Vec<(usize, &MoeSpec)> {
    spec.moe_blocks().collect()
}
