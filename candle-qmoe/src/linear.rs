//! [`DenseLinear`]: the projections of the non-expert weights (attention, routers, shared experts,
//! dense MLPs, `lm_head`).
//!
//! On the CPU, BF16 weights are kept as the checkpoint's bytes and computed with F32
//! activations by our own kernel ([`crate::kernels::dense`]): half the bytes of F32 weights, and
//! several times faster than Candle's BF16 CPU matmul. They can also be requantized to INT8
//! ([`DenseLinear::to_int8`], W8A8 per group of 32) for llama.cpp-class bytes per token.
//! Everywhere else (F32 weights, a GPU) the projection is Candle's matmul.

use std::sync::Arc;

use candle::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Module, Shape, Tensor};
use candle_nn::{Linear, VarBuilder};

use crate::kernels::contiguous_slice;
use crate::kernels::cpu::CpuIsa;
use crate::kernels::dense::{bf16_matmul, int8_matmul, Int8Matrix};
use crate::QmoeError;

/// The dtype the activations are computed in for non-expert weights of dtype `weights` on
/// `device`: F32 for BF16 weights on the CPU (our kernel's inputs), else the weights' own.
pub fn activation_dtype(weights: DType, device: &Device) -> DType {
    if device.is_cpu() && weights == DType::BF16 {
        DType::F32
    } else {
        weights
    }
}

/// How a [`DenseLinear`]'s weight is stored and multiplied.
#[derive(Clone, Debug)]
enum Kernel {
    /// Candle's `Linear` (F32 or F16 weights on the CPU, any dtype on a GPU).
    Candle(Linear),
    /// BF16 weight on the CPU, our kernel (F32 activations).
    Bf16 { weight: Tensor, op: Bf16MatMul },
    /// INT8 weight on the CPU, our W8A8 kernel (F32 activations).
    Int8(Int8MatMul),
}

/// `y = x Wᵀ (+ b)` with `W [out, in]` (PyTorch orientation), computed by our CPU kernels when
/// `W` is BF16 or INT8 on the CPU (with F32 activations), else by Candle's `Linear`.
#[derive(Clone, Debug)]
pub struct DenseLinear {
    kernel: Kernel,
    bias: Option<Tensor>,
    dims: (usize, usize),
}

impl DenseLinear {
    /// Wraps `weight [out, in]` and an optional `bias [out]`; on the CPU with BF16 weights the
    /// bias is kept in F32, the activations' dtype there.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> candle::Result<Self> {
        let dims = weight.dims2()?;
        let weight = weight.contiguous()?;
        if weight.device().is_cpu() && weight.dtype() == DType::BF16 {
            let op = Bf16MatMul {
                isa: CpuIsa::detect(),
            };
            return Ok(Self {
                kernel: Kernel::Bf16 { weight, op },
                bias: bias.map(|b| b.to_dtype(DType::F32)).transpose()?,
                dims,
            });
        }
        Ok(Self {
            kernel: Kernel::Candle(Linear::new(weight, None)),
            bias,
            dims,
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

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        self.dims
    }

    /// The weight `[out, in]` as a tensor, unless it is stored in INT8.
    pub fn weight(&self) -> Option<&Tensor> {
        match &self.kernel {
            Kernel::Candle(l) => Some(l.weight()),
            Kernel::Bf16 { weight, .. } => Some(weight),
            Kernel::Int8(_) => None,
        }
    }

    /// The storage of the weight: `bf16`, `f16`, `f32` or `int8`.
    pub fn weight_format(&self) -> &'static str {
        match &self.kernel {
            Kernel::Int8(_) => "int8",
            Kernel::Bf16 { .. } => "bf16",
            Kernel::Candle(l) => match l.weight().dtype() {
                DType::BF16 => "bf16",
                DType::F16 => "f16",
                DType::F32 => "f32",
                _ => "other",
            },
        }
    }

    /// Bytes of the weight (with its scales) and bias: what one token's projection reads.
    pub fn weight_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let weight = match &self.kernel {
            Kernel::Candle(l) => bytes(l.weight()),
            Kernel::Bf16 { weight, .. } => bytes(weight),
            Kernel::Int8(op) => op.matrix.bytes(),
        };
        weight + self.bias.as_ref().map_or(0, bytes)
    }

    /// Requantizes a BF16 or F32 weight on the CPU to symmetric INT8 with an FP16 scale per
    /// group of 32 columns, multiplied by 8-bit quantized activations; an INT8 weight is
    /// returned as it is. Refused on other devices, which have no INT8 kernel.
    pub fn to_int8(&self) -> candle::Result<Self> {
        if let Kernel::Int8(_) = self.kernel {
            return Ok(self.clone());
        }
        Ok(Self {
            kernel: Kernel::Int8(self.int8_op()?),
            bias: self.f32_bias()?,
            dims: self.dims,
        })
    }

    /// The INT8 kernel of this projection: its own, or its weight requantized (see
    /// [`Self::to_int8`]).
    fn int8_op(&self) -> candle::Result<Int8MatMul> {
        let weight = match &self.kernel {
            Kernel::Int8(op) => return Ok(op.clone()),
            Kernel::Bf16 { weight, .. } => weight,
            Kernel::Candle(l) => l.weight(),
        };
        if !weight.device().is_cpu() {
            return Err(QmoeError::unsupported(
                "dense weights",
                "int8",
                format!(
                    "INT8 non-expert weights run on the CPU only, not on {:?}",
                    weight.device()
                ),
            )
            .into());
        }
        let (rows, cols) = self.dims;
        let values = weight.to_dtype(DType::BF16)?.flatten_all()?.to_vec1()?;
        Ok(Int8MatMul {
            matrix: Arc::new(Int8Matrix::quantize_bf16(&values, rows, cols)),
            isa: CpuIsa::detect(),
        })
    }

    /// The bias in F32 (the INT8 kernel's output dtype).
    fn f32_bias(&self) -> candle::Result<Option<Tensor>> {
        self.bias
            .as_ref()
            .map(|b| b.to_dtype(DType::F32))
            .transpose()
    }

    /// One INT8 projection whose output is `parts`' outputs side by side (`[..., Σ out]`, bit
    /// for bit): their weights requantized ([`Self::to_int8`]) and stacked, their biases (zero
    /// where a part has none) concatenated. One call then quantizes the activations once and
    /// wakes the thread pool once, where the parts would each do both.
    pub fn stack_int8(parts: &[&DenseLinear]) -> candle::Result<Self> {
        let in_dim = parts.first().map_or(0, |p| p.dims.1);
        if parts.is_empty() || parts.iter().any(|p| p.dims.1 != in_dim) {
            candle::bail!("stack_int8: needs one or more projections with the same input size");
        }
        let ops = parts
            .iter()
            .map(|p| p.int8_op())
            .collect::<candle::Result<Vec<_>>>()?;
        let matrices: Vec<&Int8Matrix> = ops.iter().map(|op| op.matrix.as_ref()).collect();
        let matrix = Arc::new(Int8Matrix::stack(&matrices));
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            let biases = parts
                .iter()
                .map(|p| match p.f32_bias()? {
                    Some(b) => Ok(b),
                    None => Tensor::zeros(p.dims.0, DType::F32, &Device::Cpu),
                })
                .collect::<candle::Result<Vec<_>>>()?;
            Some(Tensor::cat(&biases, 0)?)
        } else {
            None
        };
        Ok(Self {
            kernel: Kernel::Int8(Int8MatMul {
                matrix,
                isa: ops[0].isa,
            }),
            bias,
            dims: (parts.iter().map(|p| p.dims.0).sum(), in_dim),
        })
    }

    /// Forces the instruction set of the CPU kernels (e.g. the portable path in tests); an
    /// instruction set this CPU lacks is refused.
    pub fn with_isa(mut self, isa: CpuIsa) -> candle::Result<Self> {
        if !isa.is_available() {
            candle::bail!("{isa:?} is not supported by this CPU");
        }
        match &mut self.kernel {
            Kernel::Bf16 { op, .. } => op.isa = isa,
            Kernel::Int8(op) => op.isa = isa,
            Kernel::Candle(_) => {}
        }
        Ok(self)
    }
}

/// Candle's `Linear` as it is (Candle multiplies it); a weight that is not 2-D gets `dims`
/// `(0, 0)`, which every shape check refuses.
impl From<Linear> for DenseLinear {
    fn from(l: Linear) -> Self {
        let dims = l.weight().dims2().unwrap_or((0, 0));
        Self {
            bias: l.bias().cloned(),
            kernel: Kernel::Candle(Linear::new(l.weight().clone(), None)),
            dims,
        }
    }
}

impl Module for DenseLinear {
    fn forward(&self, xs: &Tensor) -> candle::Result<Tensor> {
        let (out, input) = self.dims;
        if xs.dims().last() != Some(&input) {
            return Err(QmoeError::InvalidArgument {
                argument: "input of a linear layer".into(),
                reason: format!(
                    "has shape {:?}; the layer's weight is [{out}, {input}], so its last \
                     dimension must be {input}",
                    xs.dims()
                ),
            }
            .into());
        }
        let weight_dtype = match &self.kernel {
            Kernel::Candle(l) => Some(l.weight().dtype()),
            // Our kernel takes F32 inputs; Candle's matmul takes BF16 ones.
            Kernel::Bf16 { .. } if xs.dtype() != DType::F32 => Some(DType::BF16),
            Kernel::Bf16 { .. } | Kernel::Int8(_) => None,
        };
        if let Some(weight_dtype) = weight_dtype {
            if xs.dtype() != weight_dtype {
                return Err(QmoeError::InvalidArgument {
                    argument: "input of a linear layer".into(),
                    reason: format!(
                        "is {:?}, but the layer's weight [{out}, {input}] is {weight_dtype:?}: \
                         convert one to the other's dtype",
                        xs.dtype(),
                    ),
                }
                .into());
            }
        }
        let y = match &self.kernel {
            Kernel::Bf16 { weight, op } if xs.dtype() == DType::F32 => {
                xs.contiguous()?.apply_op2_no_bwd(weight, op)?
            }
            Kernel::Bf16 { weight, .. } => Linear::new(weight.clone(), None).forward(xs)?,
            Kernel::Int8(op) => xs
                .to_dtype(DType::F32)?
                .contiguous()?
                .apply_op1_no_bwd(op)?,
            Kernel::Candle(l) => l.forward(xs)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// The contiguous F32 input `x [..., K]` of a CPU kernel and the output shape `[..., n]`.
fn kernel_input<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    k: usize,
    n: usize,
    op: &'static str,
) -> candle::Result<(&'a [f32], Shape)> {
    let dims = l.shape().dims();
    if dims.last() != Some(&k) {
        return Err(QmoeError::ShapeMismatch {
            tensor: format!("{op} input"),
            got: dims.to_vec(),
            expected: [&dims[..dims.len().saturating_sub(1)], &[k]].concat(),
        }
        .into());
    }
    let x = contiguous_slice(s, l, format_args!("{op}: the input"))?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("checked above") = n;
    Ok((x, Shape::from(out)))
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
        let (x, shape) = kernel_input(s1, l1, k, n, self.name())?;
        let w = contiguous_slice::<half::bf16>(s2, l2, "qmoe-bf16-matmul: the weight")?;
        let y = bf16_matmul(self.isa, x, x.len() / k.max(1), k, w, n);
        Ok((CpuStorage::F32(y), shape))
    }
}

/// The Candle op of [`int8_matmul`]: `x [..., K]` F32 by an INT8 `W [N, K]` → `[..., N]` F32.
#[derive(Clone, Debug)]
struct Int8MatMul {
    matrix: Arc<Int8Matrix>,
    isa: CpuIsa,
}

impl CustomOp1 for Int8MatMul {
    fn name(&self) -> &'static str {
        "qmoe-int8-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle::Result<(CpuStorage, Shape)> {
        let (n, k) = (self.matrix.rows(), self.matrix.cols());
        let (x, shape) = kernel_input(s, l, k, n, self.name())?;
        let y = int8_matmul(self.isa, x, x.len() / k.max(1), &self.matrix);
        Ok((CpuStorage::F32(y), shape))
    }
}
