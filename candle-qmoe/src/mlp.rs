//! The gated SiLU MLP (`down(silu(gate(x)) · up(x))`) of dense layers and shared experts.

use candle::{Module, Tensor};
use candle_nn::VarBuilder;

use crate::DenseLinear;

/// A gated SiLU MLP with bias-free projections named `gate_proj`, `up_proj`, `down_proj`.
#[derive(Clone, Debug)]
pub struct GatedMlp {
    gate_proj: DenseLinear,
    up_proj: DenseLinear,
    down_proj: DenseLinear,
}

impl GatedMlp {
    /// Loads `gate_proj`/`up_proj` `[intermediate, hidden]` and `down_proj` `[hidden, intermediate]`.
    pub fn new(hidden: usize, intermediate: usize, vb: VarBuilder) -> candle::Result<Self> {
        Ok(Self {
            gate_proj: DenseLinear::load_no_bias(hidden, intermediate, vb.pp("gate_proj"))?,
            up_proj: DenseLinear::load_no_bias(hidden, intermediate, vb.pp("up_proj"))?,
            down_proj: DenseLinear::load_no_bias(intermediate, hidden, vb.pp("down_proj"))?,
        })
    }
}

impl GatedMlp {
    /// The same MLP with its projections in INT8 ([`DenseLinear::to_int8`]).
    pub fn to_int8(&self) -> candle::Result<Self> {
        Ok(Self {
            gate_proj: self.gate_proj.to_int8()?,
            up_proj: self.up_proj.to_int8()?,
            down_proj: self.down_proj.to_int8()?,
        })
    }

    /// Bytes of the three projections: what one token reads.
    pub fn weight_bytes(&self) -> usize {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .map(|l| l.weight_bytes())
            .sum()
    }
}

impl Module for GatedMlp {
    fn forward(&self, xs: &Tensor) -> candle::Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(xs)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(xs)?)?)
    }
}
