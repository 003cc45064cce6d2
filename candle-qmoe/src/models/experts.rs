//! Where a model's routed experts come from: [`ExpertsLoader`] and the built-in
//! [`ExpertsBackend`] choices.

use std::sync::Arc;

use candle_nn::VarBuilder;

use crate::pack::{ExpertLayout, GroupSize, LayerPack, ScaleSearch};
use crate::{DenseExperts, Int4Experts, RoutedExperts, SparseMoe};

/// The shape of one layer's routed experts, handed to an [`ExpertsLoader`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertDims {
    /// Decoder layer index.
    pub layer: usize,
    /// Model hidden size.
    pub hidden: usize,
    /// Intermediate size of one routed expert.
    pub intermediate: usize,
    /// Routed experts in the layer.
    pub num_experts: usize,
}

/// Builds the routed-experts backend of one MoE layer.
///
/// `vb` is the MoE block's VarBuilder (prefix `model.layers.{layer}.mlp`), holding
/// `experts.{e}.{gate,up,down}_proj.weight` in a Hugging Face checkpoint. A loader may ignore it
/// and take the experts from elsewhere (e.g. a pre-built pack file), as long as it checks that
/// what it returns has the shape in `dims`.
pub trait ExpertsLoader {
    /// The backend for the layer `dims.layer`.
    fn load(&self, dims: ExpertDims, vb: VarBuilder) -> candle::Result<Arc<dyn RoutedExperts>>;
}

/// The built-in routed-experts backends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertsBackend {
    /// Dense experts ([`DenseExperts`], the oracle) in the VarBuilder's dtype.
    #[default]
    Dense,
    /// Experts quantized to INT4 at load time ([`Int4Experts`]).
    Int4 {
        /// Columns per FP16 scale.
        group_size: GroupSize,
        /// How scales are chosen.
        search: ScaleSearch,
    },
}

impl ExpertsBackend {
    /// INT4 experts with the given group size and the default (MSE) scale search.
    pub fn int4(group_size: GroupSize) -> Self {
        Self::Int4 {
            group_size,
            search: ScaleSearch::default(),
        }
    }
}

impl ExpertsLoader for ExpertsBackend {
    fn load(&self, dims: ExpertDims, vb: VarBuilder) -> candle::Result<Arc<dyn RoutedExperts>> {
        let dense = SparseMoe::load_dense_experts(
            dims.hidden,
            dims.intermediate,
            dims.num_experts,
            vb.clone(),
        )?;
        Ok(match *self {
            Self::Dense => Arc::new(DenseExperts::new(dense)?),
            Self::Int4 { group_size, search } => {
                let layout = ExpertLayout {
                    hidden: dims.hidden,
                    intermediate: dims.intermediate,
                    group_size,
                };
                let pack = LayerPack::quantize(&vb.prefix(), &dense, layout, search)?;
                Arc::new(Int4Experts::new(pack))
            }
        })
    }
}
