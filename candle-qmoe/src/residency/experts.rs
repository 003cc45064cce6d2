//! [`ResidentExperts`]: routed experts computed through a bounded [`ExpertStore`], and
//! [`Residency`], which builds one per layer and sums their counters.

use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};

use candle::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use super::device::{HostMemory, MemoryBackend};
use super::stats::ResidencyStats;
use super::store::{ExpertStore, StagingRing};
use super::ResidencyOptions;
use crate::experts::{check_call, contiguous_slice};
use crate::kernels::{cpu, RoutePlan};
use crate::pack::LayerPack;
use crate::{QmoeError, RoutedExperts};

/// Whether a missed expert may be computed on the CPU from the host source instead of being
/// copied into the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HybridMode {
    /// Always copy misses into the cache.
    #[default]
    Off,
    /// Compute a miss on the CPU when the cost model says that is faster than copying it and
    /// computing it on the device (bytes over the measured link bandwidth plus the device's
    /// time, against the CPU's time to read the slab once). With [`HostMemory`] the device *is*
    /// the CPU, so this never copies a miss.
    Auto,
    /// Compute every miss on the CPU; the cache keeps what it holds.
    Always,
}

impl FromStr for HybridMode {
    type Err = QmoeError;
    fn from_str(s: &str) -> Result<Self, QmoeError> {
        match s.to_ascii_lowercase().as_str() {
            "off" | "copy" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            "always" | "cpu" => Ok(Self::Always),
            other => Err(QmoeError::Residency(format!(
                "unknown hybrid mode `{other}` (expected off, auto or always)"
            ))),
        }
    }
}

/// Bandwidths the hybrid decision compares, in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
struct CostModel {
    link: f64,
    cpu: f64,
    device: f64,
}

impl CostModel {
    /// Whether reading a slab once on the CPU beats copying it and reading it on the device.
    fn prefers_cpu(&self) -> bool {
        1.0 / self.cpu < 1.0 / self.link + 1.0 / self.device
    }
}

/// Routed experts of one layer served through a bounded expert cache in host memory (the
/// [`HostMemory`] backend), computed by the CPU W4A16 kernel reading the cache's slots.
///
/// A call groups its routed rows by expert. Experts the cost model sends to the CPU are read
/// from the host source; the others are made resident and read from their slots. When a call
/// needs more experts than the cache holds (a long prefill), it runs in rounds of ascending
/// experts that each fit, and the kernel continues each output sum where the previous round
/// stopped — so the result is bit-identical whatever the capacity, policy or hybrid choice.
pub struct ResidentExperts {
    store: Mutex<ExpertStore<HostMemory>>,
    isa: cpu::CpuIsa,
    hybrid: HybridMode,
    cost: CostModel,
    hidden: usize,
    num_experts: usize,
}

impl std::fmt::Debug for ResidentExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentExperts")
            .field("store", &*self.store())
            .field("hybrid", &self.hybrid)
            .finish()
    }
}

impl ResidentExperts {
    /// Wraps a store; `hybrid` decides what happens to misses.
    pub fn new(store: ExpertStore<HostMemory>, hybrid: HybridMode) -> Self {
        let link = store.backend().link_bytes_per_s();
        let layout = store.layout();
        Self {
            hidden: layout.hidden,
            num_experts: store.num_experts(),
            store: Mutex::new(store),
            isa: cpu::CpuIsa::detect(),
            hybrid,
            cost: CostModel {
                link,
                cpu: link,
                device: link,
            },
        }
    }

    /// The store (locked).
    pub fn store(&self) -> MutexGuard<'_, ExpertStore<HostMemory>> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counters so far.
    pub fn stats(&self) -> ResidencyStats {
        self.store().stats().clone()
    }

    fn compute_on_cpu(&self, store: &ExpertStore<HostMemory>, expert: usize) -> bool {
        !store.is_resident(expert)
            && match self.hybrid {
                HybridMode::Off => false,
                HybridMode::Auto => self.cost.prefers_cpu(),
                HybridMode::Always => true,
            }
    }
}

impl RoutedExperts for ResidentExperts {
    fn num_experts(&self) -> usize {
        self.num_experts
    }
    fn hidden_size(&self) -> usize {
        self.hidden
    }
    fn forward(
        &self,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor> {
        check_call(xs, expert_ids, weights, self.hidden)?;
        if !xs.device().is_cpu() {
            candle::bail!(
                "host-memory resident experts run on the CPU, got {:?}",
                xs.device()
            );
        }
        let x = xs.to_dtype(DType::F32)?.contiguous()?;
        let ids = expert_ids.to_dtype(DType::U32)?.contiguous()?;
        let w = weights.to_dtype(DType::F32)?.contiguous()?;
        x.apply_op3_no_bwd(&ids, &w, self)?.to_dtype(xs.dtype())
    }
    fn prefetch(&self, expert_ids: &[u32]) -> candle::Result<()> {
        let mut seen = vec![false; self.num_experts];
        let guess: Vec<usize> = expert_ids
            .iter()
            .map(|&e| e as usize)
            .filter(|&e| e < seen.len() && !std::mem::replace(&mut seen[e], true))
            .collect();
        self.store().prefetch(&guess)
    }
    fn supports_prefetch(&self) -> bool {
        true
    }
}

impl CustomOp3 for ResidentExperts {
    fn name(&self) -> &'static str {
        "qmoe-resident-int4-routed-experts"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let xs = contiguous_slice::<f32>(s1, l1, "xs")?;
        let ids = contiguous_slice::<u32>(s2, l2, "expert_ids")?;
        let w = contiguous_slice::<f32>(s3, l3, "weights")?;
        let (_, k) = l2.shape().dims2()?;
        let plan = RoutePlan::new(ids, k, self.num_experts)?;
        let mut store = self.store();
        let routed: Vec<usize> = plan.experts().collect();
        store.settle_prefetch(&routed);
        let mut on_cpu = vec![false; self.num_experts];
        for &e in &routed {
            if self.compute_on_cpu(&store, e) {
                on_cpu[e] = true;
                store.count_hybrid_miss();
            }
        }
        // Rounds of ascending experts with at most `capacity` of them from the cache.
        let mut out = vec![0f32; xs.len()];
        let mut round: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut cached = Vec::new();
        let end = (usize::MAX, Vec::new());
        for group in plan.groups.iter().chain(std::iter::once(&end)) {
            let last = group.0 == usize::MAX;
            let joins_cache = !last && !on_cpu[group.0];
            if last || (joins_cache && cached.len() == store.capacity()) {
                store.ensure(&cached)?;
                let sub = RoutePlan {
                    top_k: plan.top_k,
                    tokens: plan.tokens,
                    groups: std::mem::take(&mut round),
                };
                let (arena, source) = (store.arena(), store.source());
                let slab_of = |e: usize| match on_cpu[e] {
                    true => source.slab(e).bytes,
                    false => arena.slot(arena.table()[e] as usize),
                };
                cpu::routed_forward_into(self.isa, store.layout(), &slab_of, &sub, xs, w, &mut out);
                store.retire(&cached)?;
                cached.clear();
            }
            if !last {
                if joins_cache {
                    cached.push(group.0);
                }
                round.push(group.clone());
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Builds the [`ResidentExperts`] of every MoE layer of a model with one profile, one memory
/// backend and one staging ring, and reports their counters.
pub struct Residency {
    options: ResidencyOptions,
    backend: Arc<HostMemory>,
    ring: Mutex<Option<Arc<Mutex<StagingRing<HostMemory>>>>>,
    layers: Mutex<Vec<(usize, Arc<ResidentExperts>)>>,
}

impl std::fmt::Debug for Residency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Residency")
            .field("options", &self.options)
            .field("capacities", &self.capacities())
            .finish()
    }
}

impl Residency {
    /// A residency in host memory (the CPU implementation of the protocol).
    pub fn host(options: ResidencyOptions) -> Self {
        Self {
            backend: Arc::new(HostMemory::new(options.device_memory_limit)),
            options,
            ring: Mutex::default(),
            layers: Mutex::default(),
        }
    }

    /// The profile.
    pub fn options(&self) -> &ResidencyOptions {
        &self.options
    }

    /// The memory backend (e.g. to inject faults or read the peak bytes).
    pub fn backend(&self) -> &Arc<HostMemory> {
        &self.backend
    }

    /// The resident experts of decoder layer `layer` (top-k `top_k`) over `source`, admitted
    /// against the profile: capacity below top-k, staging below one expert or a cache that does
    /// not fit the device memory is an error naming the numbers.
    pub fn layer(
        &self,
        layer: usize,
        top_k: usize,
        source: LayerPack,
    ) -> candle::Result<Arc<ResidentExperts>> {
        let capacity = self
            .options
            .resident
            .capacity(layer, source.num_experts())?;
        let ring = {
            let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            match &*ring {
                Some(r) => r.clone(),
                None => {
                    let bytes = self
                        .options
                        .staging_bytes
                        .unwrap_or(source.layout().slab_bytes());
                    let r = Arc::new(Mutex::new(StagingRing::new(
                        &*self.backend,
                        self.options.staging_buffers,
                        bytes,
                    )?));
                    ring.replace(r.clone());
                    r
                }
            }
        };
        let store = ExpertStore::new(
            self.backend.clone(),
            source,
            capacity,
            top_k,
            ring,
            self.options.policy,
        )
        .map_err(|e| {
            candle::Error::Msg(format!("layer {layer}: cannot admit the expert cache: {e}"))
        })?;
        let experts = Arc::new(ResidentExperts::new(store, self.options.hybrid));
        self.layers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((layer, experts.clone()));
        Ok(experts)
    }

    /// The layers built so far: `(decoder layer, experts)`.
    pub fn layers(&self) -> Vec<(usize, Arc<ResidentExperts>)> {
        self.layers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Slots per MoE layer, in layer order.
    pub fn capacities(&self) -> Vec<usize> {
        self.layers()
            .iter()
            .map(|(_, x)| x.store().capacity())
            .collect()
    }

    /// The counters summed over layers.
    pub fn stats(&self) -> ResidencyStats {
        let mut total = ResidencyStats::default();
        for (_, x) in self.layers() {
            total.add(&x.stats());
        }
        total
    }

    /// Peak bytes of device memory held by caches and staging.
    pub fn peak_device_bytes(&self) -> usize {
        self.backend.peak_bytes()
    }
}
