//! [`DenseLinear`]: the projections of the non-expert weights (attention, routers, shared experts,
//! dense MLPs, `lm_head`).
//!
//! On the CPU, BF16 weights are kept as the checkpoint's bytes and computed with F32
//! activations by our own kernel ([`crate::kernels::dense`]): half the bytes of F32 weights, and
//! several times faster than Candle's BF16 CPU matmul. Everywhere else (F32 weights, a GPU) the
//! projection is Candle's `Linear`.

use candle::{CpuStorage, CustomOp2, DType, Device, Layout, Module, Shape, Tensor};
use candle_nn::{Linear, VarBuilder};

use crate::kernels::cpu::CpuIsa;
use crate::kernels::dense::bf16_matmul;

/// The dtype the activations are computed in for non-expert weights of dtype `weights` on
/// `device`: F32 for BF16 weights on the CPU (our kernel's inputs), else the weights' own.
pub fn activation_dtype(weights: DType, device: &Device) -> DType {
    if device.is_cpu() && weights == DType::BF16 {
        DType::F32
    } else {
        weights
    }
}

/// `y = x Wᵀ (+ b)` with `W [out, in]` (PyTorch orientation), computed by our CPU kernel when
/// `W` is BF16 on the CPU and `x` is F32, else by Candle's `Linear`.
#[derive(Clone, Debug)]
pub struct DenseLinear {
    inner: Linear,
    op: Option<Bf16MatMul>,
}

impl DenseLinear {
    /// Wraps `weight [out, in]` and an optional `bias [out]`; on the CPU with BF16 weights the
    /// bias is kept in F32, the activations' dtype there.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> candle::Result<Self> {
        let fast = weight.device().is_cpu() && weight.dtype() == DType::BF16;
        let bias = match bias {
            Some(b) if fast => Some(b.to_dtype(DType::F32)?),
            b => b,
        };
        Ok(Self {
            op: fast.then(|| Bf16MatMul {
                isa: CpuIsa::detect(),
            }),
            inner: Linear::new(weight.contiguous()?, bias),
        })
    }

    /// Loads `weight [out_dim, in_dim]` (and `bias [out_dim]` when `bias`) from `vb`.
    pub fn load(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> candle::Result<Self> {
        let weight = vb.get((out_dim, in_dim), "weight")?;
        let bias = bias.then(|| vb.get(out_dim, "bias")).transpose()?;
        Self::new(weight, bias)
    }

    /// [`Self::load`] without a bias.
    pub fn load_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> candle::Result<Self> {
        Self::load(in_dim, out_dim, false, vb)
    }

    /// The weight `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }

    /// Bytes of the weight and bias: what one token's projection reads.
    pub fn weight_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        bytes(self.weight()) + self.inner.bias().map_or(0, bytes)
    }

    /// Forces the instruction set of the CPU kernel (e.g. the portable path in tests); an
    /// instruction set this CPU lacks is refused.
    pub fn with_isa(mut self, isa: CpuIsa) -> candle::Result<Self> {
        if !isa.is_available() {
            candle::bail!("{isa:?} is not supported by this CPU");
        }
        if let Some(op) = &mut self.op {
            op.isa = isa;
        }
        Ok(self)
    }
}

impl From<Linear> for DenseLinear {
    fn from(l: Linear) -> Self {
        Self { op: None, inner: l }
    }
}

impl Module for DenseLinear {
    fn forward(&self, xs: &Tensor) -> candle::Result<Tensor> {
        let Some(op) = self.op.filter(|_| xs.dtype() == DType::F32) else {
            return self.inner.forward(xs);
        };
        let y = xs
            .contiguous()?
            .apply_op2_no_bwd(self.inner.weight(), &op)?;
        match self.inner.bias() {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// The Candle op of [`bf16_matmul`]: `x [..., K]` F32 by `W [N, K]` BF16 → `[..., N]` F32.
#[derive(Clone, Copy, Debug)]
struct Bf16MatMul {
    isa: CpuIsa,
}

impl CustomOp2 for Bf16MatMul {
    fn name(&self) -> &'static str {
        "qmoe-bf16-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let (n, k) = l2.shape().dims2()?;
        let dims = l1.shape().dims();
        if dims.last() != Some(&k) {
            return Err(candle::Error::ShapeMismatchBinaryOp {
                lhs: l1.shape().clone(),
                rhs: l2.shape().clone(),
                op: "qmoe-bf16-matmul",
            }
            .bt());
        }
        let (Some((x0, x1)), Some((w0, w1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle::bail!("qmoe-bf16-matmul: operands must be contiguous");
        };
        let x = &s1.as_slice::<f32>()?[x0..x1];
        let w = &s2.as_slice::<half::bf16>()?[w0..w1];
        let m = x.len() / k.max(1);
        let y = bf16_matmul(self.isa, x, m, k, w, n);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("checked above") = n;
        Ok((CpuStorage::F32(y), Shape::from(out_dims)))
    }
}
