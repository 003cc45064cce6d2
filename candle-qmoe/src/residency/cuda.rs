//! The CUDA backend of the residency protocol (feature `cuda`).
//!
//! [`CudaMemory`] keeps each layer's slot arena in device memory (a [`DeviceExperts`] with fewer
//! slots than experts, whose slot table the kernels index through), stages slabs through pinned
//! host buffers, copies them on a stream of its own, and orders everything with CUDA events: a
//! copy into a slot waits for the event recorded after the kernels that last read it
//! (retirement); the compute stream waits for a step's copies and then receives the new slot
//! table (publication), so kernels never see a half-copied expert. Its [`ExpertCompute`] runs the
//! W4A16 CUDA kernels over the slots: [`CudaResidentExperts`].
//!
//! Teardown: the copies read pinned staging buffers and write arena slots asynchronously, so an
//! arena, a staging buffer and the backend each synchronise the copy stream before they are
//! freed, whichever of them goes first.

use std::sync::{Arc, OnceLock};

use candle::cuda_backend::cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};
use candle::cuda_backend::{CudaDevice, WrapErr};
use candle::{DType, Tensor};

use super::compute::{ExpertCompute, Split};
use super::device::{host_copy_bytes_per_s, MemoryBackend, Reservation, Usage};
use super::experts::{CostModel, ResidentExperts};
use super::store::ExpertStore;
use crate::kernels::cuda::{kernel_inputs, CudaPath, DeviceExperts};
use crate::kernels::{cpu, RoutePlan};
use crate::pack::ExpertLayout;
use crate::{QmoeError, RoutedExperts};

/// A layer's slot arena on the GPU.
pub struct CudaArena {
    experts: DeviceExperts,
    /// The stream that copies into the slots, synchronised before the slots are freed.
    copy: Arc<CudaStream>,
    _reserved: Reservation,
}

impl Drop for CudaArena {
    fn drop(&mut self) {
        // No caller to report a failure to; the context records it.
        let _ = self.copy.synchronize();
    }
}

/// A pinned staging buffer; the copy stream reads it.
pub struct CudaStaging {
    pinned: PinnedHostSlice<u8>,
    /// The stream whose copies read the buffer, synchronised before the buffer is freed (the
    /// copies read it as a plain slice, so the buffer's own event never sees them).
    copy: Arc<CudaStream>,
}

impl Drop for CudaStaging {
    fn drop(&mut self) {
        let _ = self.copy.synchronize();
    }
}

impl CudaArena {
    /// The slots and slot table, as the kernels read them.
    pub fn experts(&self) -> &DeviceExperts {
        &self.experts
    }
}

/// [`MemoryBackend`] on a CUDA device (see the module docs).
pub struct CudaMemory {
    device: CudaDevice,
    copy: Arc<CudaStream>,
    limit: Option<usize>,
    usage: Arc<Usage>,
    link: OnceLock<f64>,
    hbm: OnceLock<f64>,
}

impl CudaMemory {
    /// Device memory of `device` for expert caches, at most `limit` bytes of arenas when given.
    pub fn new(device: &CudaDevice, limit: Option<usize>) -> candle::Result<Self> {
        let copy = device.cuda_stream().context().new_stream().w()?;
        Ok(Self {
            device: device.clone(),
            copy,
            limit,
            usage: Arc::default(),
            link: OnceLock::new(),
            hbm: OnceLock::new(),
        })
    }

    /// The GPU.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Bytes per second of a 64 MiB copy from pinned host memory (`device_to_device` false) or
    /// within the device, timed with events (best of three).
    fn measure(&self, device_to_device: bool) -> candle::Result<f64> {
        const BYTES: usize = 64 << 20;
        let stream = &self.copy;
        let ctx = stream.context();
        let mut dst = self.device.alloc_zeros::<u8>(BYTES)?;
        let src_dev = self.device.alloc_zeros::<u8>(BYTES)?;
        // SAFETY: the pinned buffer is only read by the copies below, after being zero-filled.
        let mut pinned: PinnedHostSlice<u8> = unsafe { ctx.alloc_pinned(BYTES) }.w()?;
        pinned.as_mut_slice().w()?.fill(0);
        let timing =
            Some(candle::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = f64::MAX;
        for _ in 0..3 {
            let start = stream.record_event(timing).w()?;
            if device_to_device {
                stream.memcpy_dtod(&src_dev, &mut dst).w()?;
            } else {
                stream.memcpy_htod(&pinned, &mut dst).w()?;
            }
            let end = stream.record_event(timing).w()?;
            end.synchronize().w()?;
            best = best.min(start.elapsed_ms(&end).w()? as f64 / 1e3);
        }
        // A device-to-device copy reads and writes every byte.
        let moved = if device_to_device { 2 * BYTES } else { BYTES };
        Ok(moved as f64 / best.max(1e-9))
    }

    /// Measured bandwidth of the device's memory (device-to-device copy).
    pub fn device_bytes_per_s(&self) -> f64 {
        *self.hbm.get_or_init(|| self.measure(true).unwrap_or(1e12))
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        // Copies still in flight finish before the stream goes (the arenas and staging buffers
        // wait for it too when they are freed after the backend).
        let _ = self.copy.synchronize();
    }
}

impl MemoryBackend for CudaMemory {
    type Event = Arc<CudaEvent>;
    type Arena = CudaArena;
    type Staging = CudaStaging;

    fn alloc_arena(
        &self,
        layout: ExpertLayout,
        slots: usize,
        num_experts: usize,
    ) -> candle::Result<CudaArena> {
        let bytes = slots * layout.slab_bytes();
        let what = format!(
            "an expert cache of {slots} slots × {} bytes",
            layout.slab_bytes()
        );
        let reserved = self.usage.reserve(bytes, self.limit, &what)?;
        let (free, total) = self.device.cuda_stream().context().mem_get_info().w()?;
        if bytes > free {
            return Err(QmoeError::OutOfMemory {
                what,
                needed: bytes,
                reason: format!("the GPU has {free} of {total} bytes free"),
            }
            .into());
        }
        let experts = DeviceExperts::with_capacity(layout, num_experts, slots, &self.device)
            .map_err(|e| QmoeError::OutOfMemory {
                what,
                needed: bytes,
                reason: e.to_string(),
            })?;
        Ok(CudaArena {
            experts,
            copy: self.copy.clone(),
            _reserved: reserved,
        })
    }

    fn alloc_staging(&self, bytes: usize) -> candle::Result<CudaStaging> {
        let ctx = self.device.cuda_stream().context().clone();
        // SAFETY: the buffer is zero-filled below, before any slice of it is handed out or any
        // copy reads it.
        let mut pinned =
            unsafe { ctx.alloc_pinned::<u8>(bytes) }.map_err(|e| QmoeError::OutOfMemory {
                what: "a pinned staging buffer".into(),
                needed: bytes,
                reason: e.to_string(),
            })?;
        // Once per buffer (staging buffers are reused), so `staging_mut` never lends
        // uninitialised bytes.
        pinned.as_mut_slice().w()?.fill(0);
        Ok(CudaStaging {
            pinned,
            copy: self.copy.clone(),
        })
    }

    fn staging_mut<'a>(&self, staging: &'a mut CudaStaging) -> candle::Result<&'a mut [u8]> {
        staging.pinned.as_mut_slice().w()
    }

    fn copy_to_slot(
        &self,
        src: &CudaStaging,
        len: usize,
        arena: &mut CudaArena,
        slot: usize,
        after: Option<&Arc<CudaEvent>>,
    ) -> candle::Result<Arc<CudaEvent>> {
        let n = arena.experts.layout().slab_bytes();
        if len > n {
            candle::bail!("copy of {len} bytes into a slot of {n} bytes");
        }
        if let Some(readers) = after {
            self.copy.wait(readers).w()?;
        }
        let bytes = &src.pinned.as_slice().w()?[..len];
        let mut dst = arena
            .experts
            .slabs_mut()
            .slice_mut(slot * n..slot * n + len);
        self.copy
            .memcpy_htod(bytes, &mut dst)
            .map_err(|e| QmoeError::CopyFailed {
                slot,
                bytes: len,
                reason: e.to_string(),
            })?;
        Ok(Arc::new(self.copy.record_event(None).w()?))
    }

    fn publish(
        &self,
        arena: &mut CudaArena,
        table: &[u32],
        copies: &[Arc<CudaEvent>],
    ) -> candle::Result<()> {
        let compute = self.device.cuda_stream();
        for ev in copies {
            compute.wait(ev).w()?;
        }
        compute
            .memcpy_htod(table, arena.experts.slot_table_mut())
            .w()
    }

    fn record_readers(&self) -> candle::Result<Arc<CudaEvent>> {
        Ok(Arc::new(self.device.cuda_stream().record_event(None).w()?))
    }

    fn wait(&self, event: &Arc<CudaEvent>) -> candle::Result<()> {
        event.synchronize().w()
    }

    fn allocated_bytes(&self) -> usize {
        self.usage.now()
    }

    fn peak_bytes(&self) -> usize {
        self.usage.peak()
    }

    fn link_bytes_per_s(&self) -> f64 {
        *self
            .link
            .get_or_init(|| self.measure(false).unwrap_or(1e10))
    }
}

/// Routed experts of one layer served through a bounded expert cache in GPU memory and computed
/// by the CUDA W4A16 kernels.
pub type CudaResidentExperts = ResidentExperts<CudaMemory>;

impl ExpertCompute for CudaMemory {
    /// The kernels write whole outputs, so a call that needs more experts than the cache holds
    /// runs in chunks of consecutive tokens whose experts fit, all with the kernel path the
    /// whole call would use: every token's output is the same as at full residency.
    const SPLIT: Split = Split::Tokens;

    fn cost_model(&self) -> CostModel {
        CostModel {
            link: self.link_bytes_per_s(),
            cpu: host_copy_bytes_per_s(),
            device: self.device_bytes_per_s(),
        }
    }

    /// Reads the routing back to the host (the copies depend on it), then serves the step.
    /// Misses sent to the CPU (`--hybrid`) become out-of-range ids, which the kernels skip; they
    /// are computed from the host source and added to the GPU's result (a different summation
    /// order than the GPU's own).
    fn forward_resident(
        experts: &CudaResidentExperts,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor> {
        let (x, ids, w) = kernel_inputs(xs, expert_ids, weights)?;
        let (t, k) = ids.dims2()?;
        let num_experts = experts.num_experts();
        let ids_host = ids.flatten_all()?.to_vec1::<u32>()?;
        let plan = RoutePlan::new(&ids_host, k, num_experts)?;
        let mut outs = Vec::new();
        let (store, on_cpu) = experts.serve(&plan, |store, piece, on_cpu| {
            let arena = store.arena().experts();
            let path = match arena.decode_fits(t, x.dtype()) {
                true => CudaPath::Decode,
                false => CudaPath::Prefill,
            };
            let (start, n) = (piece.tokens.start, piece.tokens.len());
            let any_cpu = on_cpu.iter().any(|&c| c);
            let chunk_ids = match (any_cpu, n == t) {
                (false, true) => ids.clone(),
                _ => {
                    let gpu_ids: Vec<u32> = ids_host[start * k..piece.tokens.end * k]
                        .iter()
                        .map(|&e| match on_cpu[e as usize] {
                            true => num_experts as u32,
                            false => e,
                        })
                        .collect();
                    Tensor::from_vec(gpu_ids, (n, k), x.device())?
                }
            };
            outs.push(arena.forward_tensors(
                &x.narrow(0, start, n)?,
                &chunk_ids,
                &w.narrow(0, start, n)?,
                path,
                false,
            )?);
            Ok(())
        })?;
        let mut out = match outs.len() {
            0 => x.zeros_like()?,
            1 => outs.remove(0),
            _ => Tensor::cat(&outs, 0)?,
        };
        if on_cpu.iter().any(|&c| c) {
            out = (out + cpu_part(experts.isa(), &store, &plan, &on_cpu, &x, &w)?)?;
        }
        out.to_dtype(xs.dtype())
    }
}

/// The experts of `plan` marked in `on_cpu`, computed by the CPU kernel from the host source:
/// `[T, H]` on `x`'s device in `x`'s dtype.
fn cpu_part(
    isa: cpu::CpuIsa,
    store: &ExpertStore<CudaMemory>,
    plan: &RoutePlan,
    on_cpu: &[bool],
    x: &Tensor,
    w: &Tensor,
) -> candle::Result<Tensor> {
    let sub = RoutePlan {
        top_k: plan.top_k,
        tokens: plan.tokens,
        groups: plan
            .groups
            .iter()
            .filter(|(e, _)| on_cpu[*e])
            .cloned()
            .collect(),
    };
    let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let ws = w.flatten_all()?.to_vec1::<f32>()?;
    let source = store.source();
    let y = cpu::routed_forward(
        isa,
        cpu::DecodeActivations::current(),
        store.layout(),
        &|e| source.slab(e).bytes,
        &sub,
        &xs,
        &ws,
    );
    Tensor::from_vec(y, (plan.tokens, store.layout().hidden), x.device())?.to_dtype(x.dtype())
}
