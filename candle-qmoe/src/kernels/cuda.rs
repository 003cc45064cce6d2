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
//! pair with its weight, as the CPU kernel does. Scratch buffers (and the decode path's arrival
//! counters) are allocated per call on the calling thread's stream, so calls from several threads
//! may overlap.

use std::sync::Arc;

use candle::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle::cuda_backend::cudarc::driver::{
    self, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg,
    ValidAsZeroBits,
};
use candle::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
use candle::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use half::{bf16, f16};

use crate::pack::{ExpertLayout, LayerPack};

pub use candle_qmoe_kernels::{ptx_for, W4A16_MOE_SM80, W4A16_MOE_SM90};

/// Most tokens the decode kernels take in one call (two 8-token MMA tiles per expert).
pub const DECODE_MAX_TOKENS: usize = 16;
/// Most routed experts per layer the kernels support (the decode bitmap and route scan).
pub const MAX_EXPERTS: usize = 1024;
/// Most tokens one pass of the prefill kernels takes: longer calls run in passes, which bounds
/// the scratch (`PREFILL_PASS_TOKENS · k · H` F32 outputs) and keeps the grids inside CUDA's limits.
pub const PREFILL_PASS_TOKENS: usize = 2048;

// Geometry shared with w4a16_moe.cu.
const NTHREADS: u32 = 128;
const W_PITCH: usize = 80;
const DEC_RING_BYTES: usize = 4 * 4 * 32 * W_PITCH;
const DEC_ROWS: usize = 32;
const PRE_ROWS: usize = 64;
const PRE_PAIRS: usize = 64;
const STEP_COLS: usize = 128;
/// Shared memory held back for the kernels' static `__shared__` variables when deciding whether
/// the decode kernels fit (they use about 256 bytes; launches check the real figure).
const STATIC_SMEM_RESERVE: usize = 1024;

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

/// Kernel parameters, mirrored by `struct MoeParams` in `w4a16_moe.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeParams {
    slabs: u64,
    slot_of: u64,
    x: u64,
    ids: u64,
    route_w: u64,
    h: u64,
    y: u64,
    out: u64,
    counters: u64,
    rank: u64,
    sorted: u64,
    tiles: u64,
    num_tiles: u64,
    slab_bytes: u64,
    off_gu_w: u64,
    off_dn_w: u64,
    off_gu_s: u64,
    off_dn_s: u64,
    t: u32,
    k: u32,
    e: u32,
    hidden: u32,
    inter: u32,
    group: u32,
    max_tiles: u32,
    pad: u32,
}

const _: () = assert!(std::mem::size_of::<MoeParams>() == 176);

// SAFETY: `MoeParams` is `repr(C)`, `Copy`, holds only integers and matches the field order,
// sizes and alignment of the kernels' `MoeParams` (176 bytes, checked above), so its bytes are a
// valid kernel parameter.
unsafe impl DeviceRepr for MoeParams {}

fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// Shared-memory pitch of a row of `cols` activations of `es` bytes (as `x_pitch` in the .cu).
fn x_pitch(cols: usize, es: usize) -> usize {
    round_up(cols * es, 128) + if es == 2 { 64 } else { 16 }
}

/// One layer's packed experts resident on a CUDA device.
///
/// Calls are ordered on the calling thread's stream of the device and keep no state between
/// them, so threads may share one `DeviceExperts`.
pub struct DeviceExperts {
    device: CudaDevice,
    layout: ExpertLayout,
    num_experts: usize,
    slabs: CudaSlice<u8>,
    slot_of: CudaSlice<u32>,
    ptx: &'static str,
    smem_optin: usize,
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
        let slabs = device.alloc_zeros::<u8>((slots * layout.slab_bytes()).max(1))?;
        let slot_of = device.clone_htod(vec![u32::MAX; num_experts].as_slice())?;
        stream.synchronize().w()?;
        Ok(Self {
            device: device.clone(),
            layout,
            num_experts,
            slabs,
            slot_of,
            ptx,
            smem_optin,
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
    /// Bytes of expert slabs resident on the device.
    pub fn resident_bytes(&self) -> usize {
        self.slabs.len()
    }
    /// The expert → slot table the kernels index through (`u32` per expert).
    pub fn slot_table(&self) -> &CudaSlice<u32> {
        &self.slot_of
    }

    /// Shared memory of the decode kernel reading rows of `k_dim` columns for `t` tokens.
    fn decode_smem(&self, k_dim: usize, t: usize, es: usize) -> usize {
        let groups = k_dim.div_ceil(self.layout.group_size.get());
        DEC_RING_BYTES
            + round_up(DEC_ROWS * groups * 2, 16)
            + t.min(DECODE_MAX_TOKENS) * x_pitch(k_dim, es)
    }

    /// Shared memory of a prefill kernel reading rows of `k_dim` columns (3 pipeline stages, 2
    /// for F32 activations, as `pre_stages` in the .cu).
    fn prefill_smem(&self, k_dim: usize, es: usize) -> usize {
        let groups = k_dim.div_ceil(self.layout.group_size.get());
        let stage = PRE_ROWS * W_PITCH + PRE_PAIRS * x_pitch(STEP_COLS, es);
        let stages = if es == 4 { 2 } else { 3 };
        stages * stage + round_up(PRE_ROWS * groups * 2, 16)
    }

    /// Whether the decode kernels fit the device's shared memory for `t` tokens of `dtype`.
    pub fn decode_fits(&self, t: usize, dtype: DType) -> bool {
        let es = dtype.size_in_bytes();
        let fits = |k_dim| self.decode_smem(k_dim, t, es) + STATIC_SMEM_RESERVE <= self.smem_optin;
        t <= DECODE_MAX_TOKENS && fits(self.layout.hidden) && fits(self.layout.intermediate)
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
        let s = unsafe { self.device.alloc::<T>(len.max(1)) }?;
        if poison {
            let (p, _guard) = s.device_ptr(stream);
            // SAFETY: `p` points to `len.max(1) * size_of::<T>()` bytes allocated on `stream`'s
            // context just above; the memset is ordered on the same stream.
            unsafe {
                driver::result::memset_d8_async(
                    p,
                    0xff,
                    len.max(1) * std::mem::size_of::<T>(),
                    stream.cu_stream(),
                )
            }
            .w()?;
        }
        Ok(s)
    }

    /// Launches kernel `name` with `params` on `grid` × 128 threads and `smem` dynamic bytes.
    fn launch(
        &self,
        name: &str,
        params: &MoeParams,
        grid: (u32, u32),
        block: u32,
        smem: usize,
    ) -> candle::Result<()> {
        if grid.0 == 0 || grid.1 == 0 {
            return Ok(());
        }
        if grid.1 > 65535 {
            candle::bail!(
                "CUDA routed experts: grid y of {} exceeds 65535 ({name})",
                grid.1
            );
        }
        let func = self.device.get_or_load_custom_func(
            name,
            candle_qmoe_kernels::MODULE_NAME,
            self.ptx,
        )?;
        // The opt-in limit covers static and dynamic shared memory together.
        let static_smem = func.shared_size_bytes().w()? as usize;
        if smem + static_smem > self.smem_optin {
            candle::bail!(
                "CUDA routed experts: {name} needs {} bytes of shared memory, the device allows {}",
                smem + static_smem,
                self.smem_optin
            );
        }
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
        let cfg = driver::LaunchConfig {
            grid_dim: (grid.0, grid.1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut b = func.builder();
        b.arg(params);
        // SAFETY: every kernel of the module takes exactly one `MoeParams` by value; the device
        // pointers in `params` are live allocations of this device that the caller keeps alive
        // until the stream has run the kernel (stream order: their frees are queued after it),
        // sized for the shapes in `params` as the kernels index them.
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
        let suffix = match dtype {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            _ => candle::bail!("CUDA routed experts: unsupported dtype {dtype:?}"),
        };
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
            k: k as u32,
            e: self.num_experts as u32,
            hidden: h as u32,
            inter: i as u32,
            group: l.group_size.get() as u32,
            ..Default::default()
        };
        let pass = if decode {
            t
        } else {
            t.min(PREFILL_PASS_TOKENS)
        };
        let mut hbuf = self.scratch::<T>(stream, pass * k * i, poison)?;
        let mut ybuf = self.scratch::<f32>(stream, pass * k * h, poison)?;
        let (h_p, _h_guard) = hbuf.device_ptr_mut(stream);
        let (y_p, _y_guard) = ybuf.device_ptr_mut(stream);
        params.h = h_p;
        params.y = y_p;
        // Points the kernels at tokens t0 .. t0 + tc of the call.
        let set_pass = |params: &mut MoeParams, t0: usize, tc: usize| {
            params.x = x + (t0 * h * es) as u64;
            params.ids = ids + (t0 * k * 4) as u64;
            params.route_w = route_w + (t0 * k * 4) as u64;
            params.out = out_p + (t0 * h * es) as u64;
            params.t = tc as u32;
        };
        // Prefill tiles of `pairs` routed rows: full tiles plus one partial tile per expert.
        let tiles_for = |pairs: usize| pairs.div_ceil(PRE_PAIRS) + self.num_experts.min(pairs);
        if decode {
            let nt = if t <= 8 { 1 } else { 2 };
            let blocks_y = self.num_experts.min(t * k) as u32;
            // Arrival counters, zero on entry; the kernel's last blocks leave them zero.
            let mut counters = self.device.alloc_zeros::<u32>(h.div_ceil(DEC_ROWS))?;
            let (c_p, _c_guard) = counters.device_ptr_mut(stream);
            params.counters = c_p;
            set_pass(&mut params, 0, t);
            self.launch(
                &format!("qmoe_decode_gate_up_{suffix}_nt{nt}"),
                &params,
                (i.div_ceil(16) as u32, blocks_y),
                NTHREADS,
                self.decode_smem(h, t, es),
            )?;
            self.launch(
                &format!("qmoe_decode_down_{suffix}_nt{nt}"),
                &params,
                (h.div_ceil(DEC_ROWS) as u32, blocks_y),
                NTHREADS,
                self.decode_smem(i, t, es),
            )?;
        } else {
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
                self.launch("qmoe_route", &params, (1, 1), 1024, 0)?;
                self.launch(
                    &format!("qmoe_prefill_gate_up_{suffix}"),
                    &params,
                    (i.div_ceil(32) as u32, max_tiles as u32),
                    NTHREADS,
                    self.prefill_smem(h, es),
                )?;
                self.launch(
                    &format!("qmoe_prefill_down_{suffix}"),
                    &params,
                    (h.div_ceil(PRE_ROWS) as u32, max_tiles as u32),
                    NTHREADS,
                    self.prefill_smem(i, es),
                )?;
                self.launch(
                    &format!("qmoe_combine_{suffix}"),
                    &params,
                    (h.div_ceil(4 * NTHREADS as usize) as u32, tc as u32),
                    NTHREADS,
                    0,
                )?;
            }
        }
        drop(out_guard);
        Ok(out)
    }
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
