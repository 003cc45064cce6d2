//! Residency-managed expert storage (docs/architecture.md §4): the full INT4 pack stays
//! immutable in host memory while each MoE layer keeps a bounded cache of experts in device
//! memory.
//!
//! * [`device`] — the device-memory abstraction [`MemoryBackend`] and [`HostMemory`], an
//!   implementation in ordinary memory that runs the same protocol, so all of it runs on a CPU.
//! * [`store`] — [`ExpertStore`]: one layer's slots, staging, publication and retirement.
//! * [`policy`] — LRU (default), LFU and LFRU eviction.
//! * [`stats`] — hits, misses, evictions, bytes copied, prefetches, stall time.
//! * [`ResidentExperts`] — a [`crate::RoutedExperts`] backend computing through a store on any
//!   backend, with optional prefetch and hybrid CPU compute; [`Residency`] builds one per layer
//!   on the model's device and sums their counters.
//! * [`ExpertCompute`] — what differs between backends: how a step's experts are computed from
//!   the slots (`host`: the CPU kernel over [`HostMemory`]; `cuda`, feature `cuda`: the CUDA
//!   backend and its kernels), and the [`Split`] of a step too large for the cache.
//!
//! ```
//! use candle_qmoe::residency::{Resident, ResidencyOptions};
//! use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
//! use candle_qmoe::GroupSize;
//! use candle::{DType, Device};
//!
//! # fn main() -> candle::Result<()> {
//! let synth = SyntheticModel::new(SyntheticKind::Tiny, 42, GroupSize::default())?;
//! let opts = ResidencyOptions { resident: Resident::Uniform(2), ..Default::default() };
//! let experts = synth.int4_experts().with_residency(opts);
//! let mut model = synth.load(DType::F32, &Device::Cpu, &experts)?;
//! let input = candle::Tensor::new(&[[50279u32, 510, 3158]], &Device::Cpu)?;
//! model.forward(&input, 0)?;
//! let stats = experts.residency().unwrap().stats();
//! assert!(stats.hits + stats.misses > 0);
//! # Ok(()) }
//! ```

mod compute;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod experts;
mod host;
pub mod policy;
pub mod stats;
pub mod store;

use std::str::FromStr;

pub use compute::{ExpertCompute, Piece, Split};
pub use device::{HostMemory, MemoryBackend};
pub use experts::{CostModel, HybridMode, Residency, ResidentExperts, ResidentLayer};
pub use policy::{EvictionPolicy, PolicyKind};
pub use stats::ResidencyStats;
pub use store::{ExpertStore, StagingRing};

use crate::QmoeError;

/// Slot-table entry of an expert that is not resident.
pub const NOT_RESIDENT: u32 = u32::MAX;

/// How many experts each MoE layer keeps in device memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Resident {
    /// Every expert (full residency: no copies after start-up).
    #[default]
    All,
    /// The same number of slots in every MoE layer.
    Uniform(usize),
    /// Slots per decoder layer, indexed by layer (entries of dense layers are ignored).
    PerLayer(Vec<usize>),
}

impl Resident {
    /// The slots of decoder layer `layer` with `num_experts` experts (`All` gives
    /// `num_experts`; larger requests are clamped to it).
    pub fn capacity(&self, layer: usize, num_experts: usize) -> Result<usize, QmoeError> {
        Ok(match self {
            Self::All => num_experts,
            Self::Uniform(n) => (*n).min(num_experts),
            Self::PerLayer(v) => (*v.get(layer).ok_or_else(|| {
                QmoeError::Residency(format!(
                    "per-layer residency lists {} layers, but layer {layer} is a MoE layer",
                    v.len()
                ))
            })?)
            .min(num_experts),
        })
    }
}

impl FromStr for Resident {
    type Err = QmoeError;
    /// `all`, one number for every layer, or comma-separated numbers per layer.
    fn from_str(s: &str) -> Result<Self, QmoeError> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("all") {
            return Ok(Self::All);
        }
        let parse = |p: &str| {
            p.trim().parse::<usize>().map_err(|_| {
                QmoeError::unsupported(
                    "residency",
                    s,
                    "is not `all`, a number of experts per layer, or comma-separated numbers per \
                     layer",
                )
            })
        };
        let v = s.split(',').map(parse).collect::<Result<Vec<_>, _>>()?;
        Ok(match v.as_slice() {
            [n] => Self::Uniform(*n),
            _ => Self::PerLayer(v),
        })
    }
}

/// A residency profile: capacities, policy, staging, prefetch and hybrid compute.
#[derive(Clone, Debug, PartialEq)]
pub struct ResidencyOptions {
    /// Slots per layer.
    pub resident: Resident,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Staging buffers in the ring shared by all layers.
    pub staging_buffers: usize,
    /// Bytes per staging buffer (default: one expert slab).
    pub staging_bytes: Option<usize>,
    /// Copy the next layer's likely experts while the current layer computes.
    pub prefetch: bool,
    /// Whether missed experts may be computed on the CPU from the host source.
    pub hybrid: HybridMode,
    /// Device memory available to the caches and staging (`None`: what the device has); with
    /// [`HostMemory`] this makes the host stand in for a GPU of that size.
    pub device_memory_limit: Option<usize>,
}

/// Staging buffers of the default residency profile: two, so one copy can fill a buffer while
/// the other's copy to the device is in flight.
pub const DEFAULT_STAGING_BUFFERS: usize = 2;

impl Default for ResidencyOptions {
    fn default() -> Self {
        Self {
            resident: Resident::All,
            policy: PolicyKind::Lru,
            staging_buffers: DEFAULT_STAGING_BUFFERS,
            staging_bytes: None,
            prefetch: false,
            hybrid: HybridMode::Off,
            device_memory_limit: None,
        }
    }
}
