//! The CUDA W4A16 kernels: launches the PTX of `candle-qmoe-kernels` through Candle's CUDA device.
//!
//! [`DeviceExperts`] holds one layer's expert slabs on a GPU together with the expert → slot
//! table the kernels index through (all experts resident, slot = expert id, until a residency
//! manager remaps them). [`DeviceExperts::forward`] runs either path on Candle CUDA storages:
//!
//! * **decode** (T ≤ [`DECODE_MAX_TOKENS`]): two launches. `qmoe_decode_gate_up_*` (grid
//!   ⌈I/16⌉ × min(E, T·k), 128 threads) computes `h = silu(gate·x) ⊙ (up·x)` for every routed
//!   pair, each block finding its expert from the top-k ids on the device; `qmoe_decode_down_*`
//!   (grid ⌈H/32⌉ × min(E, T·k)) computes the per-pair down projections and its last block per row
//!   range sums each token's k experts in the fixed order j = 0..k. No host synchronisation.
//! * **prefill** (any T): `qmoe_route` (one block) groups the T·k pairs by expert on the device
//!   and writes a tile list; `qmoe_prefill_gate_up_*` / `qmoe_prefill_down_*` run 64 weight rows ×
//!   64 routed rows per block with tensor-core MMA; `qmoe_combine_*` sums the k experts per token.
//!   Calls of more than [`PREFILL_PASS_TOKENS`] tokens run in passes of that many tokens.
//!
//! Activations may be BF16, F16 or F32 (the result has the same dtype); accumulation is F32.
//! Ids ≥ E mark pairs computed elsewhere (they add 0); a token that repeats an expert counts each
//! pair with its weight, as the CPU kernel does.
//!
//! The kernels are loaded once per [`DeviceExperts`], each with its dynamic shared-memory limit
//! set once to the device's opt-in limit minus the kernel's static shared memory (never per
//! launch, so threads sharing a function cannot race on the attribute). The decode path's scratch
//! (`h`, `y` and the arrival counters) comes from a pool keyed by calling thread and stream, so
//! concurrent calls never share buffers; the counters are zeroed on the stream at every call.
//! Prefill scratch, and any scratch of a call made while its stream is being captured into a
//! CUDA graph (the graph then owns it), is allocated per call on the calling thread's stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use candle::cuda_backend::cudarc::driver::sys::{
    CUdevice_attribute, CUfunction_attribute, CUstreamCaptureStatus,
};
use candle::cuda_backend::cudarc::driver::{
    self, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    PushKernelArg, ValidAsZeroBits,
};
use candle::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use candle_qmoe_kernels::geometry::{self as geo, MoeParams};
use half::{bf16, f16};

use crate::pack::{ExpertLayout, LayerPack};

pub use candle_qmoe_kernels::{ptx_for, W4A16_MOE_SM80, W4A16_MOE_SM90};

/// Most tokens the decode kernels take in one call (two 8-token MMA tiles per expert).
pub const DECODE_MAX_TOKENS: usize = geo::DEC_MAX_TOKENS;
/// Most routed experts per layer the kernels support (the decode bitmap and route scan).
pub const MAX_EXPERTS: usize = geo::MAX_EXPERTS;
/// Most tokens one pass of the prefill kernels takes: longer calls run in passes, which bounds
/// the scratch (`PREFILL_PASS_TOKENS · k · H` F32 outputs) and keeps the grids inside CUDA's limits.
pub const PREFILL_PASS_TOKENS: usize = 2048;

/// Which kernels run a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaPath {
    /// Decode for T ≤ [`DECODE_MAX_TOKENS`] (when its shared memory fits), prefill otherwise.
    Auto,
    /// The two-launch decode kernels (fails for T > [`DECODE_MAX_TOKENS`]).
    Decode,
    /// Device-side grouping + tensor-core prefill kernels (any T).
    Prefill,
}

/// [`MoeParams`] as a kernel argument.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct KernelArg(MoeParams);

// SAFETY: `MoeParams` is generated from the kernels' header (`moe_geometry.h`) as a `repr(C)`
// struct of integers whose size, alignment and field offsets the kernels crate checks at compile
// time against the C compiler's view of that header, so its bytes are a valid kernel parameter.
unsafe impl DeviceRepr for KernelArg {}

/// One loaded kernel of the module.
struct Kernel {
    name: String,
    func: CudaFunction,
    /// Most dynamic shared memory a launch may use: the device's opt-in limit minus the
    /// kernel's static shared memory, set once as the function's attribute at load time.
    max_dynamic_smem: usize,
}

impl Kernel {
    fn load(
        device: &CudaDevice,
        ptx: &str,
        name: String,
        smem_optin: usize,
    ) -> candle::Result<Self> {
        let func = device
            .get_or_load_custom_func(&name, candle_qmoe_kernels::MODULE_NAME, ptx)?
            .into_cuda_function();
        // The opt-in limit covers static and dynamic shared memory together.
        let static_smem = func.shared_size_bytes().w()? as usize;
        let max_dynamic_smem = smem_optin.saturating_sub(static_smem);
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            max_dynamic_smem as i32,
        )
        .w()?;
        Ok(Self {
            name,
            func,
            max_dynamic_smem,
        })
    }
}

/// The kernels of one activation type.
struct TypedKernels {
    /// Decode gate/up for one and two 8-token tiles.
    decode_gate_up: [Kernel; 2],
    /// Decode down (+ combine by the last block) for one and two 8-token tiles.
    decode_down: [Kernel; 2],
    prefill_gate_up: Kernel,
    prefill_down: Kernel,
    combine: Kernel,
}

/// Every kernel of the module, loaded once.
struct Kernels {
    bf16: TypedKernels,
    f16: TypedKernels,
    f32: TypedKernels,
    route: Kernel,
}

impl Kernels {
    fn load(device: &CudaDevice, ptx: &str, smem_optin: usize) -> candle::Result<Self> {
        let load = |name: String| Kernel::load(device, ptx, name, smem_optin);
        let typed = |dt: &str| -> candle::Result<TypedKernels> {
            Ok(TypedKernels {
                decode_gate_up: [
                    load(format!("qmoe_decode_gate_up_{dt}_nt1"))?,
                    load(format!("qmoe_decode_gate_up_{dt}_nt2"))?,
                ],
                decode_down: [
                    load(format!("qmoe_decode_down_{dt}_nt1"))?,
                    load(format!("qmoe_decode_down_{dt}_nt2"))?,
                ],
                prefill_gate_up: load(format!("qmoe_prefill_gate_up_{dt}"))?,
                prefill_down: load(format!("qmoe_prefill_down_{dt}"))?,
                combine: load(format!("qmoe_combine_{dt}"))?,
            })
        };
        Ok(Self {
            bf16: typed("bf16")?,
            f16: typed("f16")?,
            f32: typed("f32")?,
            route: load("qmoe_route".to_string())?,
        })
    }

    /// The kernels activations of `dtype` run with (other float types run as F32).
    fn typed(&self, dtype: DType) -> &TypedKernels {
        match dtype {
            DType::BF16 => &self.bf16,
            DType::F16 => &self.f16,
            _ => &self.f32,
        }
    }
}

/// Index of the decode kernels (one or two 8-token MMA tiles) for `t` tokens.
fn decode_tiles(t: usize) -> usize {
    usize::from(t > 8)
}

/// The decode path's scratch of one (thread, stream): `h`, `y` and the arrival counters.
struct DecodeScratch {
    h: CudaSlice<u8>,
    y: CudaSlice<f32>,
    counters: CudaSlice<u32>,
    /// Recorded on the stream after the launches that last used the buffers (none yet for a
    /// new scratch).
    done: Option<CudaEvent>,
}

impl DecodeScratch {
    fn alloc(
        device: &CudaDevice,
        h_bytes: usize,
        y_len: usize,
        counters: usize,
    ) -> candle::Result<Self> {
        // SAFETY: `h` and `y` are written by the kernels before they are read (checked by the
        // poisoned runs of the GPU check); the counters are zeroed at every call.
        let (h, y) = unsafe {
            (
                device.alloc::<u8>(h_bytes.max(1))?,
                device.alloc::<f32>(y_len.max(1))?,
            )
        };
        let counters = device.alloc_zeros::<u32>(counters.max(1))?;
        Ok(Self {
            h,
            y,
            counters,
            done: None,
        })
    }

    fn fits(&self, h_bytes: usize, y_len: usize, counters: usize) -> bool {
        self.h.len() >= h_bytes && self.y.len() >= y_len && self.counters.len() >= counters
    }
}

impl Drop for DecodeScratch {
    fn drop(&mut self) {
        // The buffers are freed on the dropping thread's stream, which need not be the stream of
        // their last use: wait for that use first (a failure has no caller to go to, and the
        // context's next call reports a sticky error anyway).
        if let Some(done) = &self.done {
            let _ = done.synchronize();
        }
    }
}

/// Whether `stream` is being captured into a CUDA graph.
pub(crate) fn stream_is_capturing(stream: &CudaStream) -> candle::Result<bool> {
    Ok(stream.capture_status().w()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Key of a [`DecodeScratch`]: Candle's per-thread default stream has the same handle on every
/// thread, so the thread is part of the key.
type ScratchKey = (ThreadId, usize);

/// One layer's packed experts resident on a CUDA device.
///
/// Calls are ordered on the calling thread's stream of the device; threads may share one
/// `DeviceExperts` (each thread and stream has its own decode scratch).
pub struct DeviceExperts {
    device: CudaDevice,
    layout: ExpertLayout,
    num_experts: usize,
    slabs: CudaSlice<u8>,
    slot_of: CudaSlice<u32>,
    kernels: Kernels,
    decode_scratch: Mutex<HashMap<ScratchKey, DecodeScratch>>,
}

impl std::fmt::Debug for DeviceExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceExperts")
            .field("device", &self.device)
            .field("layout", &self.layout)
            .field("num_experts", &self.num_experts)
            .field("slab_bytes", &self.slabs.len())
            .finish()
    }
}

impl DeviceExperts {
    /// Copies every slab of `pack` to `device` (one host → device copy) with the identity slot
    /// table, checking that the kernels support the shapes.
    pub fn upload(pack: &LayerPack, device: &CudaDevice) -> candle::Result<Self> {
        let slots: Vec<u32> = (0..pack.num_experts() as u32).collect();
        Self::upload_with_slots(pack, device, &slots)
    }

    /// Like [`DeviceExperts::upload`], but expert `e`'s slab goes to slot `slots[e]` (a
    /// permutation of `0..E`) and the kernels find it through the slot table: results must not
    /// depend on the placement.
    pub fn upload_with_slots(
        pack: &LayerPack,
        device: &CudaDevice,
        slots: &[u32],
    ) -> candle::Result<Self> {
        // A corrupt slab is refused before it reaches the device (verified once per slab).
        pack.verify()?;
        let (layout, num_experts) = (pack.layout(), pack.num_experts());
        let mut seen = vec![false; num_experts];
        for &s in slots {
            match seen.get_mut(s as usize) {
                Some(v) if !*v => *v = true,
                _ => candle::bail!("slot table {slots:?} is not a permutation of 0..{num_experts}"),
            }
        }
        if slots.len() != num_experts {
            candle::bail!(
                "slot table has {} entries for {num_experts} experts",
                slots.len()
            );
        }
        let mut d = Self::with_capacity(layout, num_experts, num_experts, device)?;
        let identity = slots.iter().enumerate().all(|(e, &s)| s as usize == e);
        let stream = device.cuda_stream();
        if identity {
            stream.memcpy_htod(pack.bytes(), &mut d.slabs).w()?;
        } else {
            let n = layout.slab_bytes();
            let mut placed = vec![0u8; pack.bytes().len()];
            for (e, &s) in slots.iter().enumerate() {
                placed[s as usize * n..(s as usize + 1) * n].copy_from_slice(pack.slab(e).bytes);
            }
            stream.memcpy_htod(placed.as_slice(), &mut d.slabs).w()?;
        }
        stream.memcpy_htod(slots, &mut d.slot_of).w()?;
        // Candle's stream is per host thread: finish the copies here so that a call from any
        // thread sees complete slabs.
        stream.synchronize().w()?;
        Ok(d)
    }

    /// An arena of `slots` zeroed slabs for a layer of `num_experts` experts with every slot
    /// table entry `u32::MAX` (not resident): a residency manager fills slots and publishes the
    /// table. Checks that the kernels support the shapes and the GPU.
    pub fn with_capacity(
        layout: ExpertLayout,
        num_experts: usize,
        slots: usize,
        device: &CudaDevice,
    ) -> candle::Result<Self> {
        if num_experts > MAX_EXPERTS {
            candle::bail!("CUDA routed experts: {num_experts} experts exceed {MAX_EXPERTS}");
        }
        if !layout.hidden.is_multiple_of(8) || !layout.intermediate.is_multiple_of(8) {
            candle::bail!(
                "CUDA routed experts need hidden and intermediate sizes divisible by 8, got {} and {}",
                layout.hidden,
                layout.intermediate
            );
        }
        let stream = device.cuda_stream();
        let ctx = stream.context();
        let (major, minor) = ctx.compute_capability().w()?;
        let ptx = candle_qmoe_kernels::ptx_for(major, minor).ok_or_else(|| {
            candle::Error::Msg(format!(
                "CUDA routed experts need compute capability 8.0 or newer, this GPU is {major}.{minor}"
            ))
        })?;
        let smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .w()? as usize;
        let kernels = Kernels::load(device, ptx, smem_optin)?;
        let slabs = device.alloc_zeros::<u8>((slots * layout.slab_bytes()).max(1))?;
        let slot_of = device.clone_htod(vec![u32::MAX; num_experts].as_slice())?;
        stream.synchronize().w()?;
        Ok(Self {
            device: device.clone(),
            layout,
            num_experts,
            slabs,
            slot_of,
            kernels,
            decode_scratch: Mutex::default(),
        })
    }

    /// The slab arena (slot `s` at byte `s × slab_bytes`), for a residency manager's copies.
    pub fn slabs_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.slabs
    }

    /// The expert → slot table, for a residency manager's publication.
    pub fn slot_table_mut(&mut self) -> &mut CudaSlice<u32> {
        &mut self.slot_of
    }

    /// The device the slabs live on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }
    /// The slab layout.
    pub fn layout(&self) -> ExpertLayout {
        self.layout
    }
    /// Number of routed experts.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    /// The expert → slot table the kernels index through (`u32` per expert).
    pub fn slot_table(&self) -> &CudaSlice<u32> {
        &self.slot_of
    }

    /// Dynamic shared memory of the decode kernel reading rows of `k_dim` columns for `t`
    /// tokens of `es` bytes.
    fn decode_smem(&self, k_dim: usize, t: usize, es: usize) -> usize {
        geo::decode_smem(
            k_dim,
            t.min(DECODE_MAX_TOKENS),
            es,
            self.layout.group_size.get(),
        )
    }

    /// Dynamic shared memory of a prefill kernel reading rows of `k_dim` columns.
    fn prefill_smem(&self, k_dim: usize, es: usize) -> usize {
        geo::prefill_smem(k_dim, es, self.layout.group_size.get())
    }

    /// Whether the decode kernels fit the device's shared memory for `t` tokens of `dtype`
    /// (other float types than BF16/F16 run as F32).
    pub fn decode_fits(&self, t: usize, dtype: DType) -> bool {
        let (kernels, es) = match dtype {
            DType::BF16 | DType::F16 => (self.kernels.typed(dtype), 2),
            _ => (self.kernels.typed(DType::F32), 4),
        };
        let tiles = decode_tiles(t);
        t <= DECODE_MAX_TOKENS
            && self.decode_smem(self.layout.hidden, t, es)
                <= kernels.decode_gate_up[tiles].max_dynamic_smem
            && self.decode_smem(self.layout.intermediate, t, es)
                <= kernels.decode_down[tiles].max_dynamic_smem
    }

    /// [`DeviceExperts::forward`] on tensors: `xs [T, H]` on this device (BF16/F16/F32, other
    /// float types run as F32), `expert_ids [T, k]` and `weights [T, k]` (converted to U32/F32).
    pub fn forward_tensors(
        &self,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
        path: CudaPath,
        poison: bool,
    ) -> candle::Result<Tensor> {
        let (x, ids, w) = kernel_inputs(xs, expert_ids, weights)?;
        let op = RoutedOp {
            experts: self,
            path,
            poison,
        };
        x.apply_op3_no_bwd(&ids, &w, &op)?.to_dtype(xs.dtype())
    }

    /// Runs the routed experts: `x [T, H]` (BF16/F16/F32, starting on a 16-byte boundary),
    /// `ids [T, k]` (U32) and `weights [T, k]` (F32), all contiguous on this device; returns
    /// `[T, H]` in the dtype of `x`. With `poison`
    /// every buffer the kernels write (result and scratch) is filled with NaN first, so an element
    /// they miss shows up.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        ids: &CudaStorage,
        ids_l: &Layout,
        weights: &CudaStorage,
        w_l: &Layout,
        path: CudaPath,
        poison: bool,
    ) -> candle::Result<CudaStorage> {
        let (t, hidden) = x_l.shape().dims2()?;
        let (t2, k) = ids_l.shape().dims2()?;
        if hidden != self.layout.hidden || t2 != t || w_l.shape().dims() != [t, k] {
            candle::bail!(
                "CUDA routed experts got x {:?}, ids {:?}, weights {:?} for hidden size {}",
                x_l.shape(),
                ids_l.shape(),
                w_l.shape(),
                self.layout.hidden
            );
        }
        let off = |l: &Layout, what: &str| match l.contiguous_offsets() {
            Some((a, _)) => Ok(a),
            None => Err(candle::Error::Msg(format!(
                "CUDA routed experts: {what} must be contiguous"
            ))),
        };
        let (x_off, ids_off, w_off) = (
            off(x_l, "xs")?,
            off(ids_l, "expert_ids")?,
            off(w_l, "weights")?,
        );
        let stream = self.device.cuda_stream();
        let ids_s = match &ids.slice {
            CudaStorageSlice::U32(s) => s,
            _ => candle::bail!("CUDA routed experts: expert_ids must be u32"),
        };
        let w_s = match &weights.slice {
            CudaStorageSlice::F32(s) => s,
            _ => candle::bail!("CUDA routed experts: weights must be f32"),
        };
        // The guards record the inputs' read events when dropped, after the launches.
        let (ids_p, _ids_guard) = ids_s.device_ptr(&stream);
        let (w_p, _w_guard) = w_s.device_ptr(&stream);
        let ids_p = ids_p + 4 * ids_off as u64;
        let w_p = w_p + 4 * w_off as u64;
        macro_rules! run_as {
            ($s:expr, $t:ty) => {{
                let x_bytes = std::mem::size_of::<$t>() * x_off;
                if x_bytes % 16 != 0 {
                    candle::bail!(
                        "CUDA routed experts: xs must start on a 16-byte boundary, its offset is {x_bytes} bytes"
                    );
                }
                let (p, _x_guard) = $s.device_ptr(&stream);
                let out = self.run::<$t>(&stream, p + x_bytes as u64, ids_p, w_p, t, k, path, poison)?;
                Ok(CudaStorage::wrap_cuda_slice(out, self.device.clone()))
            }};
        }
        match &x.slice {
            CudaStorageSlice::BF16(s) => run_as!(s, bf16),
            CudaStorageSlice::F16(s) => run_as!(s, f16),
            CudaStorageSlice::F32(s) => run_as!(s, f32),
            _ => candle::bail!("CUDA routed experts: xs must be bf16, f16 or f32"),
        }
    }

    /// Allocates `len` elements, NaN-filled (all-ones bytes) when `poison`.
    fn scratch<T: DeviceRepr>(
        &self,
        stream: &CudaStream,
        len: usize,
        poison: bool,
    ) -> candle::Result<CudaSlice<T>> {
        // SAFETY: the buffer is only handed to kernels that write every element they later read
        // (checked by the poisoned runs of the GPU check), or filled right below.
        let mut s = unsafe { self.device.alloc::<T>(len.max(1)) }?;
        if poison {
            fill(stream, &mut s, 0xff)?;
        }
        Ok(s)
    }

    /// The calling thread's decode scratch for this stream with room for `h_bytes`, `y_len` and
    /// `counters`: from the pool, or new (always new while the stream is being captured into a
    /// graph, which then owns it). Give it back with [`DeviceExperts::put_decode_scratch`].
    fn take_decode_scratch(
        &self,
        stream: &CudaStream,
        capturing: bool,
        h_bytes: usize,
        y_len: usize,
        counters: usize,
    ) -> candle::Result<DecodeScratch> {
        let pooled = match capturing {
            true => None,
            false => self.pool().remove(&scratch_key(stream)),
        };
        match pooled {
            Some(s) if s.fits(h_bytes, y_len, counters) => Ok(s),
            Some(s) => {
                // Grow to what this call needs and at least what the old buffers held.
                let (h, y, c) = (s.h.len(), s.y.len(), s.counters.len());
                drop(s);
                DecodeScratch::alloc(&self.device, h.max(h_bytes), y.max(y_len), c.max(counters))
            }
            None => DecodeScratch::alloc(&self.device, h_bytes, y_len, counters),
        }
    }

    /// Returns `scratch` to the pool after recording its last use on `stream` (dropped instead
    /// while capturing: the graph owns it).
    fn put_decode_scratch(
        &self,
        stream: &CudaStream,
        capturing: bool,
        mut scratch: DecodeScratch,
    ) -> candle::Result<()> {
        if capturing {
            return Ok(());
        }
        match &scratch.done {
            Some(done) => done.record(stream).w()?,
            None => scratch.done = Some(stream.record_event(None).w()?),
        }
        self.pool().insert(scratch_key(stream), scratch);
        Ok(())
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, HashMap<ScratchKey, DecodeScratch>> {
        self.decode_scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Launches `kernel` with `params` on `grid` × `block` threads and `smem` dynamic bytes.
    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &Kernel,
        params: &MoeParams,
        grid: (usize, usize),
        block: usize,
        smem: usize,
    ) -> candle::Result<()> {
        let name = &kernel.name;
        if grid.0 == 0 || grid.1 == 0 {
            return Ok(());
        }
        if grid.1 > 65535 {
            candle::bail!(
                "CUDA routed experts: grid y of {} exceeds 65535 ({name})",
                grid.1
            );
        }
        if smem > kernel.max_dynamic_smem {
            candle::bail!(
                "CUDA routed experts: {name} needs {smem} bytes of dynamic shared memory, the \
                 device allows {} beside the kernel's static shared memory",
                kernel.max_dynamic_smem
            );
        }
        let cfg = driver::LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, 1),
            block_dim: (block as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let arg = KernelArg(*params);
        let mut b = stream.launch_builder(&kernel.func);
        b.arg(&arg);
        // SAFETY: every kernel of the module takes exactly one `MoeParams` by value; the device
        // pointers in `params` are live allocations of this device that the caller keeps alive
        // until the stream has run the kernel (stream order: their frees are queued after it, or
        // wait for the scratch's `done` event), sized for the shapes in `params` as the kernels
        // index them.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run<
        T: DeviceRepr + ValidAsZeroBits + candle::WithDType + candle::cuda_backend::CudaDType,
    >(
        &self,
        stream: &Arc<CudaStream>,
        x: u64,
        ids: u64,
        route_w: u64,
        t: usize,
        k: usize,
        path: CudaPath,
        poison: bool,
    ) -> candle::Result<CudaSlice<T>> {
        let es = std::mem::size_of::<T>();
        let dtype = T::DTYPE;
        let kernels = self.kernels.typed(dtype);
        let l = self.layout;
        let (h, i) = (l.hidden, l.intermediate);
        let decode = match path {
            CudaPath::Auto => self.decode_fits(t, dtype),
            CudaPath::Decode => {
                if !self.decode_fits(t, dtype) {
                    candle::bail!(
                        "CUDA routed experts: the decode kernels take at most {DECODE_MAX_TOKENS} \
                         tokens within the device's shared memory, got {t}"
                    );
                }
                true
            }
            CudaPath::Prefill => false,
        };
        if t == 0 || k == 0 {
            return self.device.alloc_zeros::<T>((t * h).max(1));
        }
        let mut out = self.scratch::<T>(stream, t * h, poison)?;
        // Every guard records its buffer's use (read or write) when dropped, after the launches.
        let (out_p, out_guard) = out.device_ptr_mut(stream);
        let (slabs_p, _slabs_guard) = self.slabs.device_ptr(stream);
        let (slot_p, _slot_guard) = self.slot_of.device_ptr(stream);
        let o = l.offsets();
        let mut params = MoeParams {
            slabs: slabs_p,
            slot_of: slot_p,
            slab_bytes: o.total as u64,
            off_gu_w: o.gate_up_weights as u64,
            off_dn_w: o.down_weights as u64,
            off_gu_s: o.gate_up_scales as u64,
            off_dn_s: o.down_scales as u64,
            top_k: k as u32,
            num_experts: self.num_experts as u32,
            hidden: h as u32,
            inter: i as u32,
            group: l.group_size.get() as u32,
            ..Default::default()
        };
        // Points the kernels at tokens t0 .. t0 + tc of the call.
        let set_pass = |params: &mut MoeParams, t0: usize, tc: usize| {
            params.x = x + (t0 * h * es) as u64;
            params.ids = ids + (t0 * k * 4) as u64;
            params.route_w = route_w + (t0 * k * 4) as u64;
            params.out = out_p + (t0 * h * es) as u64;
            params.tokens = tc as u32;
        };
        let nthreads = geo::NTHREADS;
        if decode {
            let capturing = stream_is_capturing(stream)?;
            let n_counters = h.div_ceil(geo::DEC_ROWS);
            let mut scratch =
                self.take_decode_scratch(stream, capturing, t * k * i * es, t * k * h, n_counters)?;
            set_pass(&mut params, 0, t);
            let launched = self.run_decode(stream, kernels, &mut params, &mut scratch, es, poison);
            // Returned even after a failed launch: the buffers stay valid, the counters are
            // zeroed again by the next call.
            self.put_decode_scratch(stream, capturing, scratch)?;
            launched?;
        } else {
            let pass = t.min(PREFILL_PASS_TOKENS);
            let mut hbuf = self.scratch::<T>(stream, pass * k * i, poison)?;
            let mut ybuf = self.scratch::<f32>(stream, pass * k * h, poison)?;
            let (h_p, _h_guard) = hbuf.device_ptr_mut(stream);
            let (y_p, _y_guard) = ybuf.device_ptr_mut(stream);
            params.h = h_p;
            params.y = y_p;
            // Prefill tiles of `pairs` routed rows: full tiles plus one partial tile per expert.
            let tiles_for =
                |pairs: usize| pairs.div_ceil(geo::PRE_PAIRS) + self.num_experts.min(pairs);
            let max_tiles = tiles_for(pass * k);
            let mut rank = self.scratch::<u32>(stream, pass * k, false)?;
            let mut sorted = self.scratch::<u32>(stream, pass * k, poison)?;
            let mut tiles = self.scratch::<u32>(stream, 3 * max_tiles, poison)?;
            let mut ntiles = self.scratch::<u32>(stream, 1, poison)?;
            let (rank_p, _rank_guard) = rank.device_ptr_mut(stream);
            let (sorted_p, _sorted_guard) = sorted.device_ptr_mut(stream);
            let (tiles_p, _tiles_guard) = tiles.device_ptr_mut(stream);
            let (nt_p, _nt_guard) = ntiles.device_ptr_mut(stream);
            params.rank = rank_p;
            params.sorted = sorted_p;
            params.tiles = tiles_p;
            params.num_tiles = nt_p;
            for t0 in (0..t).step_by(pass) {
                let tc = pass.min(t - t0);
                let max_tiles = tiles_for(tc * k);
                set_pass(&mut params, t0, tc);
                params.max_tiles = max_tiles as u32;
                self.launch(
                    stream,
                    &self.kernels.route,
                    &params,
                    (1, 1),
                    geo::ROUTE_THREADS,
                    0,
                )?;
                self.launch(
                    stream,
                    &kernels.prefill_gate_up,
                    &params,
                    (i.div_ceil(geo::PRE_GATE_UP_ROWS), max_tiles),
                    nthreads,
                    self.prefill_smem(h, es),
                )?;
                self.launch(
                    stream,
                    &kernels.prefill_down,
                    &params,
                    (h.div_ceil(geo::PRE_ROWS), max_tiles),
                    nthreads,
                    self.prefill_smem(i, es),
                )?;
                self.launch(
                    stream,
                    &kernels.combine,
                    &params,
                    (h.div_ceil(geo::COMBINE_COLS), tc),
                    nthreads,
                    0,
                )?;
            }
        }
        drop(out_guard);
        Ok(out)
    }

    /// The two decode launches of the call `params` points at, on `scratch`, for activations of
    /// `es` bytes.
    fn run_decode(
        &self,
        stream: &Arc<CudaStream>,
        kernels: &TypedKernels,
        params: &mut MoeParams,
        scratch: &mut DecodeScratch,
        es: usize,
        poison: bool,
    ) -> candle::Result<()> {
        let (h, i) = (self.layout.hidden, self.layout.intermediate);
        let (t, k) = (params.tokens as usize, params.top_k as usize);
        if poison {
            fill(stream, &mut scratch.h, 0xff)?;
            fill(stream, &mut scratch.y, 0xff)?;
        }
        // Arrival counters: zero on entry (the kernel's last blocks leave them zero, but a call
        // that failed midway or a graph replay elsewhere must not leave this one a stale count).
        fill(stream, &mut scratch.counters, 0)?;
        let (h_p, _h_guard) = scratch.h.device_ptr_mut(stream);
        let (y_p, _y_guard) = scratch.y.device_ptr_mut(stream);
        let (c_p, _c_guard) = scratch.counters.device_ptr_mut(stream);
        params.h = h_p;
        params.y = y_p;
        params.counters = c_p;
        let tiles = decode_tiles(t);
        let blocks_y = self.num_experts.min(t * k);
        // (kernel, row blocks, reduction length): gate/up reads rows of H, down rows of I.
        let launches = [
            (
                &kernels.decode_gate_up[tiles],
                i.div_ceil(geo::DEC_GATE_UP_ROWS),
                h,
            ),
            (&kernels.decode_down[tiles], h.div_ceil(geo::DEC_ROWS), i),
        ];
        for (kernel, blocks_x, k_dim) in launches {
            let smem = self.decode_smem(k_dim, t, es);
            self.launch(
                stream,
                kernel,
                params,
                (blocks_x, blocks_y),
                geo::NTHREADS,
                smem,
            )?;
        }
        Ok(())
    }
}

/// Sets every byte of `buf` to `value` on `stream`.
fn fill<T>(stream: &CudaStream, buf: &mut CudaSlice<T>, value: u8) -> candle::Result<()> {
    let bytes = buf.num_bytes();
    let (p, _guard) = buf.device_ptr_mut(stream);
    // SAFETY: `p` points to the `bytes` bytes of `buf`, a live allocation of `stream`'s context;
    // the memset is ordered on `stream` and the guard records it as a write of `buf`.
    unsafe { driver::result::memset_d8_async(p, value, bytes, stream.cu_stream()) }.w()
}

/// The pool key of the calling thread on `stream`.
fn scratch_key(stream: &CudaStream) -> ScratchKey {
    (std::thread::current().id(), stream.cu_stream() as usize)
}

/// Contiguous kernel inputs: activations in BF16/F16/F32 (other dtypes become F32), ids in U32,
/// weights in F32.
pub(crate) fn kernel_inputs(
    xs: &Tensor,
    expert_ids: &Tensor,
    weights: &Tensor,
) -> candle::Result<(Tensor, Tensor, Tensor)> {
    let x = match xs.dtype() {
        DType::BF16 | DType::F16 | DType::F32 => xs.contiguous()?,
        _ => xs.to_dtype(DType::F32)?.contiguous()?,
    };
    // The kernels copy activation rows in 16-byte pieces: a view starting mid-row is copied.
    let aligned = x.layout().start_offset() * x.dtype().size_in_bytes() % 16 == 0;
    let x = if aligned { x } else { x.copy()? };
    Ok((
        x,
        expert_ids.to_dtype(DType::U32)?.contiguous()?,
        weights.to_dtype(DType::F32)?.contiguous()?,
    ))
}

/// The CUDA kernels as a Candle op with an explicit path.
struct RoutedOp<'a> {
    experts: &'a DeviceExperts,
    path: CudaPath,
    poison: bool,
}

impl CustomOp3 for RoutedOp<'_> {
    fn name(&self) -> &'static str {
        "qmoe-int4-routed-experts-cuda"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        candle::bail!("the CUDA routed-experts op needs CUDA tensors")
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle::Result<(CudaStorage, Shape)> {
        let out = self
            .experts
            .forward(s1, l1, s2, l2, s3, l3, self.path, self.poison)?;
        Ok((out, l1.shape().clone()))
    }
}
