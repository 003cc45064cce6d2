//! The routed-experts swap point: [`RoutedExperts`] and its dense and INT4 implementations.

use candle::quantized::{GgmlDType, QMatMul, QTensor};
#[cfg(feature = "cuda")]
use std::sync::{Arc, Mutex};

use candle::{CpuStorage, CustomOp3, DType, Device, Layout, Module, Shape, Tensor, D};

#[cfg(feature = "cuda")]
use crate::kernels::cuda;
use crate::kernels::{contiguous_slice, cpu, RoutePlan};
use crate::pack::{DenseExpert, ExpertLayout, LayerPack};
use crate::QmoeError;

/// Computes `Σ_j weights[t, j] · expert_{ids[t, j]}(xs[t])` for every token.
///
/// `xs` is `[T, H]` (F16, BF16, F32 or F64), `expert_ids` is `[T, k]` (any integer dtype, e.g.
/// `u32`), `weights` is `[T, k]` (floating point); the result is `[T, H]` in the dtype of `xs`.
/// Every backend refuses other ranks, dtypes and shapes with a [`QmoeError`] naming the
/// tensor. [`crate::SparseMoe`] does the routing and calls this.
pub trait RoutedExperts: Send + Sync {
    /// Number of routed experts.
    fn num_experts(&self) -> usize;
    /// Model hidden size.
    fn hidden_size(&self) -> usize;
    /// Bytes of one expert's weights as this backend reads them (an INT4 slab, or the dense
    /// or GGML-quantized matrices): what a token routed to it costs in memory traffic.
    fn bytes_per_expert(&self) -> usize;
    /// The weighted sum of the chosen experts' outputs.
    fn forward(&self, xs: &Tensor, expert_ids: &Tensor, weights: &Tensor)
        -> candle::Result<Tensor>;
    /// Starts making `expert_ids` (a guess at this layer's next routing) resident; a no-op for
    /// backends that hold every expert.
    fn prefetch(&self, _expert_ids: &[u32]) -> candle::Result<()> {
        Ok(())
    }
    /// Whether [`RoutedExperts::prefetch`] does anything.
    fn supports_prefetch(&self) -> bool {
        false
    }
}

/// Whether tensors of `dtype` can be computed with: F16, BF16, F32 or F64 (not integers, nor the
/// 8-, 6- and 4-bit float storage types).
pub(crate) fn is_compute_float(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

/// Checks the ranks, dtypes and shapes of a routed call and returns `(tokens, top_k)`:
/// `xs [T, H]` and `weights [T, k]` floating point (F16, BF16, F32 or F64), `expert_ids [T, k]`
/// integer.
pub(crate) fn check_call(
    xs: &Tensor,
    expert_ids: &Tensor,
    weights: &Tensor,
    hidden: usize,
) -> candle::Result<(usize, usize)> {
    for (name, t, ok, wanted) in [
        (
            "xs",
            xs,
            is_compute_float(xs.dtype()),
            "floating point (f16, bf16, f32 or f64)",
        ),
        (
            "expert_ids",
            expert_ids,
            expert_ids.dtype().is_int(),
            "integer (u32 or i64)",
        ),
        (
            "weights",
            weights,
            is_compute_float(weights.dtype()),
            "floating point (f16, bf16, f32 or f64)",
        ),
    ] {
        if !ok {
            return Err(QmoeError::InvalidArgument {
                argument: name.into(),
                reason: format!("must be {wanted}, got {:?}", t.dtype()),
            }
            .into());
        }
    }
    let rank2 = |name: &str, t: &Tensor, expected: &str| match t.dims() {
        &[a, b] => Ok((a, b)),
        got => Err(QmoeError::InvalidArgument {
            argument: name.into(),
            reason: format!("must be {expected} (2-D), got shape {got:?}"),
        }),
    };
    let (t, _) = rank2("xs", xs, "[tokens, hidden_size]")?;
    let (_, k) = rank2("expert_ids", expert_ids, "[tokens, top_k]")?;
    let shapes: [(&str, &[usize], [usize; 2]); 3] = [
        ("xs", xs.dims(), [t, hidden]),
        ("expert_ids", expert_ids.dims(), [t, k]),
        ("weights", weights.dims(), [t, k]),
    ];
    if let Some((tensor, got, expected)) = shapes.into_iter().find(|(_, g, e)| g[..] != e[..]) {
        return Err(QmoeError::ShapeMismatch {
            tensor: tensor.into(),
            got: got.to_vec(),
            expected: expected.to_vec(),
        }
        .into());
    }
    Ok((t, k))
}

/// The oracle: each expert as dense Candle matmuls in the checkpoint's dtype.
#[derive(Clone, Debug)]
pub struct DenseExperts {
    experts: Vec<DenseExpert>,
    hidden: usize,
}

impl DenseExperts {
    /// Wraps per-expert weights (`gate`/`up` `[I, H]`, `down` `[H, I]`, all of one floating
    /// point dtype), checking shapes and dtypes.
    pub fn new(experts: Vec<DenseExpert>) -> candle::Result<Self> {
        let first = experts.first().ok_or_else(|| QmoeError::InvalidArgument {
            argument: "experts".into(),
            reason: "zero experts".into(),
        })?;
        let (i, h) = match first.gate.dims() {
            &[i, h] => (i, h),
            got => {
                return Err(QmoeError::InvalidArgument {
                    argument: "expert 0 gate projection".into(),
                    reason: format!("must be [intermediate, hidden] (2-D), got shape {got:?}"),
                }
                .into())
            }
        };
        let dtype = first.gate.dtype();
        if !is_compute_float(dtype) {
            return Err(QmoeError::InvalidArgument {
                argument: "expert 0 gate projection".into(),
                reason: format!("must be f16, bf16, f32 or f64, got {dtype:?}"),
            }
            .into());
        }
        for (e, x) in experts.iter().enumerate() {
            for (name, t, want) in [
                ("gate", &x.gate, [i, h]),
                ("up", &x.up, [i, h]),
                ("down", &x.down, [h, i]),
            ] {
                if t.dtype() != dtype {
                    return Err(QmoeError::InvalidArgument {
                        argument: format!("expert {e} {name} projection"),
                        reason: format!(
                            "is {:?}, but expert 0's gate projection is {dtype:?}: all experts \
                             must share one dtype",
                            t.dtype()
                        ),
                    }
                    .into());
                }
                if t.dims() != want {
                    return Err(QmoeError::ShapeMismatch {
                        tensor: format!("expert {e} {name} projection"),
                        got: t.dims().to_vec(),
                        expected: want.to_vec(),
                    }
                    .into());
                }
            }
        }
        Ok(Self { experts, hidden: h })
    }

    /// The experts' weights.
    pub fn experts(&self) -> &[DenseExpert] {
        &self.experts
    }
}

/// Runs `expert(e, x_e)` on the tokens routed to each expert and index-adds the weighted
/// results, experts in ascending order (the summation order of transformers). `x` and the
/// weights are cast to `dtype` first; the result has the dtype of `xs`.
fn per_expert_forward(
    xs: &Tensor,
    expert_ids: &Tensor,
    weights: &Tensor,
    num_experts: usize,
    dtype: DType,
    expert: impl Fn(usize, &Tensor) -> candle::Result<Tensor>,
) -> candle::Result<Tensor> {
    let (_, k) = expert_ids.dims2()?;
    let plan = RoutePlan::new(
        &expert_ids
            .to_dtype(DType::U32)?
            .flatten_all()?
            .to_vec1::<u32>()?,
        k,
        num_experts,
    )?;
    // `index_select` needs a contiguous tensor (a view such as a narrowed or transposed `xs`).
    let x = xs.to_dtype(dtype)?.contiguous()?;
    // Transformers casts the routing weights to the activations' dtype before the product.
    let flat_w = weights
        .to_dtype(xs.dtype())?
        .to_dtype(dtype)?
        .flatten_all()?;
    let mut out = x.zeros_like()?;
    for (e, slots) in &plan.groups {
        let tokens: Vec<u32> = slots.iter().map(|&s| (s / k) as u32).collect();
        let slots: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        let tok = Tensor::new(tokens.as_slice(), xs.device())?;
        let ye = expert(*e, &x.index_select(&tok, 0)?)?;
        let we = flat_w.index_select(&Tensor::new(slots.as_slice(), xs.device())?, 0)?;
        out = out.index_add(&tok, &rounded_mul(&ye, &we.unsqueeze(D::Minus1)?)?, 0)?;
    }
    out.to_dtype(xs.dtype())
}

/// `a * b` (broadcast), each product rounded once to the operands' dtype, as transformers
/// computes it. Candle 0.11's NEON kernels for contiguous BF16 products and sums narrow the F32
/// result by truncation instead of rounding to nearest even (its x86 kernels round): on aarch64
/// (under qemu) that took the BF16 dense oracle of the Mixtral fixture to a mean KL of 7.7e-4
/// and a max |Δlogit| of 0.88 from the golden, against 2.2e-5 and 0.033 on x86. There, BF16 on
/// the CPU is multiplied in F32 and rounded once: exact, since the product of two BF16 values
/// fits an F32's 24-bit significand.
fn rounded_mul(a: &Tensor, b: &Tensor) -> candle::Result<Tensor> {
    if cfg!(target_arch = "aarch64") && a.dtype() == DType::BF16 && a.device().is_cpu() {
        let wide = a
            .to_dtype(DType::F32)?
            .broadcast_mul(&b.to_dtype(DType::F32)?)?;
        return wide.to_dtype(DType::BF16);
    }
    a.broadcast_mul(b)
}

impl RoutedExperts for DenseExperts {
    fn num_experts(&self) -> usize {
        self.experts.len()
    }
    fn hidden_size(&self) -> usize {
        self.hidden
    }
    fn bytes_per_expert(&self) -> usize {
        let e = &self.experts[0];
        [&e.gate, &e.up, &e.down]
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
    fn forward(
        &self,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor> {
        check_call(xs, expert_ids, weights, self.hidden)?;
        let dtype = self.experts[0].gate.dtype();
        per_expert_forward(
            xs,
            expert_ids,
            weights,
            self.experts.len(),
            dtype,
            |e, x| {
                let ex = &self.experts[e];
                let gate = candle_nn::ops::silu(&x.matmul(&ex.gate.t()?)?)?;
                rounded_mul(&gate, &x.matmul(&ex.up.t()?)?)?.matmul(&ex.down.t()?)
            },
        )
    }
}

/// Candle's own quantized CPU path (`QMatMul` over a GGML type such as Q4K) for each expert:
/// the in-framework baseline the INT4 kernels are measured against.
pub struct GgmlExperts {
    experts: Vec<[QMatMul; 3]>,
    hidden: usize,
    bytes_per_expert: usize,
}

impl GgmlExperts {
    /// Quantizes every expert's gate, up and down projections to `dtype`.
    pub fn quantize(experts: &[DenseExpert], dtype: GgmlDType) -> candle::Result<Self> {
        let dense = DenseExperts::new(experts.to_vec())?;
        let q =
            |t: &Tensor| QMatMul::from_qtensor(QTensor::quantize(&t.to_dtype(DType::F32)?, dtype)?);
        let bytes_per_expert =
            3 * dense.hidden * dense.experts[0].up.dim(0)? / dtype.block_size() * dtype.type_size();
        let experts = dense
            .experts
            .iter()
            .enumerate()
            .map(|(e, x)| {
                let q = |name: &str, t: &Tensor| {
                    q(t).map_err(|err| {
                        candle::Error::from(QmoeError::InvalidArgument {
                            argument: format!("expert {e} {name} projection"),
                            reason: format!(
                                "cannot be quantized to {dtype:?}: {}",
                                crate::error::message_without_backtrace(&err)
                            ),
                        })
                    })
                };
                Ok([q("gate", &x.gate)?, q("up", &x.up)?, q("down", &x.down)?])
            })
            .collect::<candle::Result<Vec<_>>>()?;
        Ok(Self {
            experts,
            hidden: dense.hidden,
            bytes_per_expert,
        })
    }

    /// A copy whose quantized blocks live in memory of their own (`clone` shares them): a
    /// benchmark that cycles through copies, as a model goes through its layers, never finds
    /// the next call's weights in cache.
    pub fn copied(&self) -> candle::Result<Self> {
        let copy = |m: &QMatMul| -> candle::Result<QMatMul> {
            match m {
                QMatMul::QTensor(q) => {
                    let storage = candle::quantized::QStorage::from_data(
                        q.data()?.into_owned().into(),
                        &q.device(),
                        q.dtype(),
                    )?;
                    Ok(QMatMul::from_qtensor(QTensor::new(storage, q.shape())?)?)
                }
                QMatMul::Tensor(t) => Ok(QMatMul::Tensor(t.copy()?)),
                QMatMul::TensorF16(t) => Ok(QMatMul::TensorF16(t.copy()?)),
            }
        };
        let experts = self
            .experts
            .iter()
            .map(|[g, u, d]| Ok([copy(g)?, copy(u)?, copy(d)?]))
            .collect::<candle::Result<Vec<_>>>()?;
        Ok(Self {
            experts,
            hidden: self.hidden,
            bytes_per_expert: self.bytes_per_expert,
        })
    }
}

impl RoutedExperts for GgmlExperts {
    fn num_experts(&self) -> usize {
        self.experts.len()
    }
    fn hidden_size(&self) -> usize {
        self.hidden
    }
    fn bytes_per_expert(&self) -> usize {
        self.bytes_per_expert
    }
    fn forward(
        &self,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor> {
        check_call(xs, expert_ids, weights, self.hidden)?;
        per_expert_forward(
            xs,
            expert_ids,
            weights,
            self.experts.len(),
            DType::F32,
            |e, x| {
                let [gate, up, down] = &self.experts[e];
                let g = candle_nn::ops::silu(&gate.forward(x)?)?;
                down.forward(&(g * up.forward(x)?)?)
            },
        )
    }
}

/// Routed experts computed by the fused W4A16 kernels straight from a [`LayerPack`].
///
/// On a CPU device the SIMD kernel of [`cpu`] runs on the host pack. On a CUDA device (feature
/// `cuda`) the slabs are uploaded once per device — on the first forward or by
/// [`Int4Experts::to_device`] — and the CUDA kernels run on them.
#[derive(Clone, Debug)]
pub struct Int4Experts {
    pack: LayerPack,
    isa: cpu::CpuIsa,
    decode_acts: Option<cpu::DecodeActivations>,
    #[cfg(feature = "cuda")]
    resident: Arc<Mutex<Vec<Arc<cuda::DeviceExperts>>>>,
}

impl Int4Experts {
    /// Uses the best CPU instruction set available.
    pub fn new(pack: LayerPack) -> Self {
        Self::with_isa(pack, cpu::CpuIsa::detect())
    }

    /// Forces a CPU instruction set (for tests and benchmarks); falls back to the detected one
    /// when `isa` is not available on this CPU.
    pub fn with_isa(pack: LayerPack, isa: cpu::CpuIsa) -> Self {
        let isa = if isa.is_available() {
            isa
        } else {
            cpu::CpuIsa::detect()
        };
        Self {
            pack,
            isa,
            decode_acts: None,
            #[cfg(feature = "cuda")]
            resident: Arc::default(),
        }
    }

    /// Computes decode-sized calls with these activations on the CPU, whatever the
    /// process-wide [`cpu::DecodeActivations::current`].
    pub fn with_decode_activations(mut self, acts: cpu::DecodeActivations) -> Self {
        self.decode_acts = Some(acts);
        self
    }

    /// The activations decode-sized calls on the CPU compute with.
    pub fn decode_activations(&self) -> cpu::DecodeActivations {
        self.decode_acts
            .unwrap_or_else(cpu::DecodeActivations::current)
    }

    /// The instruction-set path this backend computes with.
    pub fn isa(&self) -> cpu::CpuIsa {
        self.isa
    }

    /// The packed experts.
    pub fn pack(&self) -> &LayerPack {
        &self.pack
    }

    /// The slab layout.
    pub fn layout(&self) -> ExpertLayout {
        self.pack.layout()
    }

    /// Makes the experts resident on `device` ahead of the first forward: a no-op on the CPU,
    /// one host → device copy of every slab on a CUDA device (done once per device).
    pub fn to_device(&self, device: &Device) -> candle::Result<()> {
        match device {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => self.device_experts(dev).map(|_| ()),
            _ => Err(QmoeError::UnsupportedDevice {
                backend: "int4 routed experts".into(),
                device: format!("{device:?}"),
            }
            .into()),
        }
    }

    /// The copy of the experts resident on `dev`, uploaded on first use.
    #[cfg(feature = "cuda")]
    pub fn device_experts(
        &self,
        dev: &candle::CudaDevice,
    ) -> candle::Result<Arc<cuda::DeviceExperts>> {
        let mut resident = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = resident.iter().find(|d| d.device().id() == dev.id()) {
            return Ok(d.clone());
        }
        // The upload verifies every slab first.
        let d = Arc::new(cuda::DeviceExperts::upload(&self.pack, dev)?);
        resident.push(d.clone());
        Ok(d)
    }
}

impl RoutedExperts for Int4Experts {
    fn num_experts(&self) -> usize {
        self.pack.num_experts()
    }
    fn hidden_size(&self) -> usize {
        self.pack.layout().hidden
    }
    fn bytes_per_expert(&self) -> usize {
        self.pack.layout().slab_bytes()
    }
    fn forward(
        &self,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor> {
        check_call(xs, expert_ids, weights, self.hidden_size())?;
        #[cfg(feature = "cuda")]
        if xs.device().is_cuda() {
            let (x, ids, w) = cuda::kernel_inputs(xs, expert_ids, weights)?;
            return x.apply_op3_no_bwd(&ids, &w, self)?.to_dtype(xs.dtype());
        }
        apply_cpu_op(self, xs, expert_ids, weights)
    }
}

/// Runs a CPU routed-experts op on `xs` (as F32), `expert_ids` (U32) and `weights` (F32), all
/// made contiguous; the result has the dtype of `xs`.
pub(crate) fn apply_cpu_op(
    op: &impl CustomOp3,
    xs: &Tensor,
    expert_ids: &Tensor,
    weights: &Tensor,
) -> candle::Result<Tensor> {
    let x = xs.to_dtype(DType::F32)?.contiguous()?;
    let ids = expert_ids.to_dtype(DType::U32)?.contiguous()?;
    let w = weights.to_dtype(DType::F32)?.contiguous()?;
    x.apply_op3_no_bwd(&ids, &w, op)?.to_dtype(xs.dtype())
}

/// The CPU inputs of a routed call as slices — `xs [T, H]` F32, `weights [T, k]` F32 — and the
/// routing `expert_ids [T, k]` (U32) grouped by expert.
pub(crate) fn routed_inputs<'a>(
    xs: (&'a CpuStorage, &Layout),
    expert_ids: (&CpuStorage, &Layout),
    weights: (&'a CpuStorage, &Layout),
    num_experts: usize,
) -> candle::Result<(&'a [f32], &'a [f32], RoutePlan)> {
    let x = contiguous_slice::<f32>(xs.0, xs.1, "int4 routed experts: xs")?;
    let ids = contiguous_slice::<u32>(
        expert_ids.0,
        expert_ids.1,
        "int4 routed experts: expert_ids",
    )?;
    let w = contiguous_slice::<f32>(weights.0, weights.1, "int4 routed experts: weights")?;
    let (_, k) = expert_ids.1.shape().dims2()?;
    Ok((x, w, RoutePlan::new(ids, k, num_experts)?))
}

impl CustomOp3 for Int4Experts {
    fn name(&self) -> &'static str {
        "qmoe-int4-routed-experts"
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
        let (xs, w, plan) = routed_inputs((s1, l1), (s2, l2), (s3, l3), self.pack.num_experts())?;
        self.pack.verify_experts(plan.experts())?;
        let out = cpu::routed_forward(
            self.isa,
            self.decode_activations(),
            self.pack.layout(),
            &|e| self.pack.slab(e).bytes,
            &plan,
            xs,
            w,
        );
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> candle::Result<(candle::CudaStorage, Shape)> {
        let experts = self.device_experts(&s1.device)?;
        let out = experts.forward(s1, l1, s2, l2, s3, l3, cuda::CudaPath::Auto, false)?;
        Ok((out, l1.shape().clone()))
    }
}
