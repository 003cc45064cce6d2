//! [`ResidentExperts`]: routed experts computed through a bounded [`ExpertStore`], and
//! [`Residency`], which builds one per layer and sums their counters.

use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};

use candle::Tensor;

use super::compute::{ExpertCompute, Piece};
use super::device::{HostMemory, MemoryBackend};
use super::stats::ResidencyStats;
use super::store::{ExpertStore, StagingRing};
use super::ResidencyOptions;
use crate::experts::check_call;
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
            other => Err(QmoeError::unsupported(
                "hybrid mode",
                other,
                "is not supported (expected off, auto or always)",
            )),
        }
    }
}

impl HybridMode {
    /// Whether this step's misses are computed on the CPU; `cost` (which may measure
    /// bandwidths the first time) is only consulted in `Auto` mode.
    pub fn misses_on_cpu(self, cost: impl FnOnce() -> CostModel) -> bool {
        match self {
            Self::Off => false,
            Self::Auto => cost().prefers_cpu(),
            Self::Always => true,
        }
    }
}

/// Bandwidths the hybrid decision compares, in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Host → device copies.
    pub link: f64,
    /// The CPU streaming a slab through its kernel.
    pub cpu: f64,
    /// The device streaming a slab through its kernels.
    pub device: f64,
}

impl CostModel {
    /// Whether reading a slab once on the CPU beats copying it and reading it on the device.
    pub fn prefers_cpu(&self) -> bool {
        1.0 / self.cpu < 1.0 / self.link + 1.0 / self.device
    }
}

/// Routed experts of one layer served through a bounded expert cache in the memory of backend
/// `B` (by default [`HostMemory`], computed by the CPU W4A16 kernel reading the cache's slots;
/// `cuda::CudaResidentExperts` runs the CUDA kernels over GPU slots).
///
/// A call groups its routed rows by expert. Experts the cost model sends to the CPU are read
/// from the host source; the others are made resident and read from their slots. When a call
/// needs more experts than the cache holds (a long prefill), it runs in pieces that each fit
/// ([`ExpertCompute::SPLIT`]), so the result is bit-identical whatever the capacity or policy.
pub struct ResidentExperts<B: ExpertCompute = HostMemory> {
    store: Mutex<ExpertStore<B>>,
    /// The CPU kernel's instruction set (host slots, and misses computed from the host source).
    isa: cpu::CpuIsa,
    hybrid: HybridMode,
    hidden: usize,
    num_experts: usize,
}

impl<B: ExpertCompute> std::fmt::Debug for ResidentExperts<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentExperts")
            .field("store", &*self.store())
            .field("hybrid", &self.hybrid)
            .finish()
    }
}

impl<B: ExpertCompute> ResidentExperts<B> {
    /// Wraps a store; `hybrid` decides what happens to misses.
    pub fn new(store: ExpertStore<B>, hybrid: HybridMode) -> Self {
        Self {
            hidden: store.layout().hidden,
            num_experts: store.num_experts(),
            store: Mutex::new(store),
            isa: cpu::CpuIsa::detect(),
            hybrid,
        }
    }

    /// The store (locked).
    pub fn store(&self) -> MutexGuard<'_, ExpertStore<B>> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counters so far.
    pub fn stats(&self) -> ResidencyStats {
        self.store().stats().clone()
    }

    /// The CPU kernel's instruction set on this machine.
    pub fn isa(&self) -> cpu::CpuIsa {
        self.isa
    }

    /// Serves one step routed by `plan`: decides whether misses are computed from the host
    /// source (verifying those slabs against their checksums), starts the step, and for each
    /// [`Piece`] of the backend's split makes its cached experts resident, runs
    /// `compute(store, piece, on_cpu)` and retires them. Returns the store, still locked, and
    /// which experts are computed from the host source.
    pub fn serve(
        &self,
        plan: &RoutePlan,
        mut compute: impl FnMut(&ExpertStore<B>, &Piece, &[bool]) -> candle::Result<()>,
    ) -> candle::Result<(MutexGuard<'_, ExpertStore<B>>, Vec<bool>)> {
        let routed: Vec<usize> = plan.experts().collect();
        let mut store = self.store();
        // Bandwidths are measured once per backend, on the first `Auto` decision.
        let misses_on_cpu = self.hybrid.misses_on_cpu(|| store.backend().cost_model());
        let on_cpu = store.begin_step(&routed, misses_on_cpu);
        // Slabs read from the host source are verified here; copied ones as they are staged.
        store
            .source()
            .verify_experts(routed.iter().copied().filter(|&e| on_cpu[e]))?;
        for piece in B::SPLIT.pieces(plan, &on_cpu, store.capacity()) {
            store.ensure(&piece.cached)?;
            compute(&store, &piece, &on_cpu)?;
            store.retire(&piece.cached)?;
        }
        Ok((store, on_cpu))
    }
}

impl<B: ExpertCompute> RoutedExperts for ResidentExperts<B> {
    fn num_experts(&self) -> usize {
        self.num_experts
    }
    fn hidden_size(&self) -> usize {
        self.hidden
    }
    fn bytes_per_expert(&self) -> usize {
        self.store().layout().slab_bytes()
    }
    fn forward(
        &self,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor> {
        check_call(xs, expert_ids, weights, self.hidden)?;
        B::forward_resident(self, xs, expert_ids, weights)
    }
    fn prefetch(&self, expert_ids: &[u32]) -> candle::Result<()> {
        self.store().prefetch(expert_ids)
    }
    fn supports_prefetch(&self) -> bool {
        true
    }
}

/// What [`Residency`] reads from a layer's resident experts, whatever the backend.
pub trait ResidentLayer: RoutedExperts {
    /// The layer's counters so far.
    fn stats(&self) -> ResidencyStats;
    /// The layer's slots.
    fn capacity(&self) -> usize;
}

impl<B: ExpertCompute> ResidentLayer for ResidentExperts<B> {
    fn stats(&self) -> ResidencyStats {
        ResidentExperts::stats(self)
    }
    fn capacity(&self) -> usize {
        self.store().capacity()
    }
}

/// A backend's staging ring, created with the first layer (one expert per buffer by default).
type RingSlot<B> = Mutex<Option<Arc<Mutex<StagingRing<B>>>>>;

/// Builds the resident experts of every MoE layer of a model with one profile, one memory
/// backend per device kind and one staging ring per backend, and sums their counters.
pub struct Residency {
    options: ResidencyOptions,
    host: Arc<HostMemory>,
    host_ring: RingSlot<HostMemory>,
    #[cfg(feature = "cuda")]
    cuda: Mutex<Option<Arc<super::cuda::CudaMemory>>>,
    #[cfg(feature = "cuda")]
    cuda_ring: RingSlot<super::cuda::CudaMemory>,
    layers: Mutex<Vec<(usize, Arc<dyn ResidentLayer>)>>,
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
    /// A residency with this profile; each layer's cache goes to the device its model runs on.
    pub fn new(options: ResidencyOptions) -> Self {
        Self {
            host: Arc::new(HostMemory::new(options.device_memory_limit)),
            options,
            host_ring: Mutex::default(),
            #[cfg(feature = "cuda")]
            cuda: Mutex::default(),
            #[cfg(feature = "cuda")]
            cuda_ring: Mutex::default(),
            layers: Mutex::default(),
        }
    }

    /// The profile.
    pub fn options(&self) -> &ResidencyOptions {
        &self.options
    }

    /// The host-memory backend of CPU layers (e.g. to inject faults).
    pub fn host_memory(&self) -> &Arc<HostMemory> {
        &self.host
    }

    /// The resident experts of decoder layer `layer` (top-k `top_k`) over `source` on
    /// `device`, admitted against the profile: capacity below top-k, staging below one expert or
    /// a cache that does not fit the device memory is an error naming the numbers.
    pub fn layer(
        &self,
        layer: usize,
        top_k: usize,
        source: LayerPack,
        device: &candle::Device,
    ) -> candle::Result<Arc<dyn RoutedExperts>> {
        match device {
            candle::Device::Cpu => Ok(self.host_layer(layer, top_k, source)?),
            #[cfg(feature = "cuda")]
            candle::Device::Cuda(dev) => Ok(self.cuda_layer(layer, top_k, source, dev)?),
            _ => Err(QmoeError::UnsupportedDevice {
                backend: "resident experts".into(),
                device: format!("{device:?}"),
            }
            .into()),
        }
    }

    /// [`Residency::layer`] in host memory, computed by the CPU kernel.
    pub fn host_layer(
        &self,
        layer: usize,
        top_k: usize,
        source: LayerPack,
    ) -> candle::Result<Arc<ResidentExperts>> {
        self.build(&self.host, &self.host_ring, layer, top_k, source)
    }

    /// [`Residency::layer`] on a CUDA device, computed by the CUDA kernels.
    #[cfg(feature = "cuda")]
    pub fn cuda_layer(
        &self,
        layer: usize,
        top_k: usize,
        source: LayerPack,
        device: &candle::CudaDevice,
    ) -> candle::Result<Arc<super::cuda::CudaResidentExperts>> {
        let memory = {
            let mut slot = self.cuda.lock().unwrap_or_else(|p| p.into_inner());
            match &*slot {
                Some(m) if m.device().id() == device.id() => m.clone(),
                Some(_) => candle::bail!("resident experts: one residency serves one GPU"),
                None => slot
                    .insert(Arc::new(super::cuda::CudaMemory::new(
                        device,
                        self.options.device_memory_limit,
                    )?))
                    .clone(),
            }
        };
        self.build(&memory, &self.cuda_ring, layer, top_k, source)
    }

    /// Admits one layer's store on `backend` (creating the backend's staging ring with the first
    /// layer) and registers its resident experts.
    fn build<B: ExpertCompute>(
        &self,
        backend: &Arc<B>,
        ring: &RingSlot<B>,
        layer: usize,
        top_k: usize,
        source: LayerPack,
    ) -> candle::Result<Arc<ResidentExperts<B>>> {
        let o = &self.options;
        let capacity = o.resident.capacity(layer, source.num_experts())?;
        let ring = {
            let mut ring = ring.lock().unwrap_or_else(|p| p.into_inner());
            match &*ring {
                Some(r) => r.clone(),
                None => {
                    let bytes = o.staging_bytes.unwrap_or(source.layout().slab_bytes());
                    let r = StagingRing::new(&**backend, o.staging_buffers, bytes)?;
                    ring.insert(Arc::new(Mutex::new(r))).clone()
                }
            }
        };
        let store = ExpertStore::new(backend.clone(), source, capacity, top_k, ring, o.policy)
            .map_err(|e| e.context(format!("layer {layer}: cannot admit the expert cache")))?;
        let experts = Arc::new(ResidentExperts::new(store, o.hybrid));
        self.layers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((layer, experts.clone()));
        Ok(experts)
    }

    /// The layers built so far: `(decoder layer, experts)`.
    pub fn layers(&self) -> Vec<(usize, Arc<dyn ResidentLayer>)> {
        self.layers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Slots per MoE layer, in layer order.
    pub fn capacities(&self) -> Vec<usize> {
        self.layers().iter().map(|(_, x)| x.capacity()).collect()
    }

    /// The counters summed over layers.
    pub fn stats(&self) -> ResidencyStats {
        let mut total = ResidencyStats::default();
        for (_, x) in self.layers() {
            total.add(&x.stats());
        }
        total
    }

    /// Peak bytes held by the caches (and, in host memory, the staging ring).
    pub fn peak_device_bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(m) = &*self.cuda.lock().unwrap_or_else(|p| p.into_inner()) {
            return m.peak_bytes();
        }
        self.host.peak_bytes()
    }
}
