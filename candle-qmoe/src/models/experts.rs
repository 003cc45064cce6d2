//! Where a model's routed experts come from: [`ExpertsLoader`], the built-in
//! [`ExpertsBackend`] choices, and [`PackedExperts`] (a pre-built `.qmoe` pack).

use std::path::Path;
use std::sync::Arc;

use candle::{DType, Tensor};
use candle_nn::VarBuilder;

use super::config::{ExpertStorage, ExpertTensor};

use crate::kernels::cpu::DecodeActivations;
use crate::pack::{
    DenseExpert, ExpertLayout, ExpertNames, ExpertWeights, GroupSize, LayerPack, PackFile,
    ScaleSearch,
};
use crate::residency::{Residency, ResidencyOptions};
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
    /// Experts each token is routed to.
    pub top_k: usize,
    /// What the checkpoint calls the experts' projections.
    pub names: ExpertNames,
    /// How the checkpoint stores them (one tensor per expert, or fused 3-D tensors).
    pub storage: ExpertStorage,
}

/// The dense experts of one MoE block as a checkpoint stores them, read through the block's
/// VarBuilder: one expert at a time ([`ExpertStorage::PerExpert`]), or the block's two fused
/// 3-D tensors read once and cut per expert ([`ExpertStorage::Fused`]; each expert is a view
/// of them, no copy).
pub struct BlockExperts<'a> {
    dims: ExpertDims,
    block: String,
    tensors: BlockTensors<'a>,
}

/// How [`BlockExperts`] reaches the weights.
enum BlockTensors<'a> {
    /// `experts.{e}.{gate,up,down}.weight`, through the block's VarBuilder.
    PerExpert(VarBuilder<'a>),
    /// Every expert's gate rows then up rows `[E, 2I, H]`, and every expert's down projection
    /// `[E, H, I]`.
    Fused { gate_up: Tensor, down: Tensor },
}

impl<'a> BlockExperts<'a> {
    /// The experts of the block `vb` (the MoE block's VarBuilder) with the shape and storage in
    /// `dims`; fused tensors are read (and converted to `vb`'s dtype) here, once.
    pub fn open(dims: ExpertDims, vb: VarBuilder<'a>) -> candle::Result<Self> {
        let (h, i, n) = (dims.hidden, dims.intermediate, dims.num_experts);
        let block = vb.prefix();
        let tensors = match dims.storage {
            ExpertStorage::PerExpert => BlockTensors::PerExpert(vb),
            ExpertStorage::Fused { gate_up, down } => BlockTensors::Fused {
                gate_up: vb.pp(gate_up).get((n, 2 * i, h), "weight")?,
                down: vb.pp(down).get((n, h, i), "weight")?,
            },
        };
        Ok(Self {
            dims,
            block,
            tensors,
        })
    }

    /// Where expert `e`'s gate, up and down weights lie in the checkpoint, as messages name
    /// them (e.g. `model.layers.3.mlp.experts.7.up_proj.weight`, or for fused experts
    /// `model.layers.3.block_sparse_moe.input_linear.weight[7, 512..1024]`).
    pub fn tensor_names(&self, e: usize) -> [String; 3] {
        let d = &self.dims;
        d.storage
            .expert_tensors(&self.block, d.names, e, d.hidden, d.intermediate)
            .each_ref()
            .map(ExpertTensor::to_string)
    }

    /// Expert `e`'s gate `[I, H]`, up `[I, H]` and down `[H, I]`.
    pub fn expert(&self, e: usize) -> candle::Result<DenseExpert> {
        let d = &self.dims;
        match &self.tensors {
            BlockTensors::PerExpert(vb) => {
                SparseMoe::load_dense_expert(d.hidden, d.intermediate, e, d.names, vb.clone())
            }
            BlockTensors::Fused { gate_up, down } => {
                let i = d.intermediate;
                let gu = gate_up.get(e)?;
                Ok(DenseExpert {
                    gate: gu.narrow(0, 0, i)?,
                    up: gu.narrow(0, i, i)?,
                    down: down.get(e)?,
                })
            }
        }
    }

    /// Every expert, in order.
    pub fn all(&self) -> candle::Result<Vec<DenseExpert>> {
        (0..self.dims.num_experts).map(|e| self.expert(e)).collect()
    }
}

/// Builds the routed-experts backend of one MoE layer.
///
/// `vb` is the MoE block's VarBuilder (prefix `model.layers.{layer}.mlp`, or the family's block
/// name, see [`super::MoeNames`]), holding `experts.{e}.{gate,up,down}.weight` in a Hugging Face
/// checkpoint, with the projection names `dims.names`. A loader may ignore it and take the
/// experts from elsewhere (e.g. a pre-built pack file), as long as it checks that what it
/// returns has the shape in `dims`.
pub trait ExpertsLoader {
    /// The backend for the layer `dims.layer`.
    fn load(&self, dims: ExpertDims, vb: VarBuilder) -> candle::Result<Arc<dyn RoutedExperts>>;
}

/// The built-in routed-experts backends that read the experts from the checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertsBackend {
    /// Dense experts ([`DenseExperts`], the oracle) in the VarBuilder's dtype.
    #[default]
    Dense,
    /// Dense experts converted to the given dtype whatever the model's compute dtype (e.g. BF16
    /// experts next to F32 attention).
    DenseAs(DType),
    /// Experts quantized to INT4 at load time ([`Int4Experts`]), from the checkpoint's weights
    /// read in F32: the same bytes [`super::quantize_checkpoint`] writes to a pack.
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
        let (h, i, n) = (dims.hidden, dims.intermediate, dims.num_experts);
        let dense = |vb| -> candle::Result<Arc<dyn RoutedExperts>> {
            let experts = BlockExperts::open(dims, vb)?.all()?;
            Ok(Arc::new(DenseExperts::new(experts)?))
        };
        match *self {
            Self::Dense => dense(vb),
            Self::DenseAs(dtype) => dense(vb.to_dtype(dtype)),
            Self::Int4 { group_size, search } => {
                let layout = ExpertLayout {
                    hidden: h,
                    intermediate: i,
                    group_size,
                };
                let block = vb.prefix();
                let experts = BlockExperts::open(dims, vb.to_dtype(DType::F32))?;
                let tensors = |e| experts.tensor_names(e);
                let read = |e, w: &mut ExpertWeights| {
                    w.read_dense(&tensors(e), &experts.expert(e)?, layout)
                };
                let pack =
                    LayerPack::quantize_with(&block, n, layout, search, &tensors, read, &|| {})?;
                Ok(Arc::new(Int4Experts::new(pack)))
            }
        }
    }
}

/// Routed experts served from a [`PackFile`] (a memory-mapped `.qmoe`, or a pack built in
/// memory) instead of the checkpoint's expert tensors.
///
/// Every layer is checked with [`PackFile::check_source`] against the fingerprint of the
/// checkpoint the rest of the model comes from, so a pack made from another checkpoint, another
/// revision or with other shapes is refused with a clear error.
#[derive(Clone, Debug)]
pub struct PackedExperts {
    pack: Arc<PackFile>,
    fingerprint: String,
    dense: Option<DType>,
    residency: Option<Arc<Residency>>,
    decode_acts: Option<DecodeActivations>,
}

impl PackedExperts {
    /// INT4 experts from `pack`, for a model whose checkpoint has this `fingerprint` (see
    /// [`super::checkpoint::fingerprint`]).
    pub fn new(pack: Arc<PackFile>, fingerprint: impl Into<String>) -> Self {
        Self {
            pack,
            fingerprint: fingerprint.into(),
            dense: None,
            residency: None,
            decode_acts: None,
        }
    }

    /// INT4 experts from `pack` for the checkpoint in `dir` (computes its fingerprint).
    pub fn for_checkpoint(pack: Arc<PackFile>, dir: impl AsRef<Path>) -> crate::Result<Self> {
        Ok(Self::new(pack, super::checkpoint::fingerprint(dir)?))
    }

    /// Serves the pack's experts dequantized to dense `dtype` tensors instead ([`DenseExperts`]
    /// on exactly the INT4 weights): the oracle for the INT4 kernels, or dense experts for a
    /// synthetic model.
    pub fn dequantized(mut self, dtype: DType) -> Self {
        self.dense = Some(dtype);
        self
    }

    /// Computes the INT4 experts' decode-sized calls on the CPU with these activations, whatever
    /// the process-wide [`DecodeActivations::current`]. Not with
    /// [`PackedExperts::with_residency`]: the residency cache always computes with `current`.
    pub fn with_decode_activations(mut self, acts: DecodeActivations) -> Self {
        self.decode_acts = Some(acts);
        self
    }

    /// Serves the INT4 experts through a bounded expert cache per layer with this profile
    /// ([`crate::residency`]; on the CPU the cache lives in host memory, on a GPU in device
    /// memory). The counters of the
    /// layers built are read from [`PackedExperts::residency`].
    pub fn with_residency(mut self, options: ResidencyOptions) -> Self {
        self.residency = Some(Arc::new(Residency::new(options)));
        self
    }

    /// The residency of the layers built, when [`PackedExperts::with_residency`] was used.
    pub fn residency(&self) -> Option<&Arc<Residency>> {
        self.residency.as_ref()
    }

    /// The pack.
    pub fn pack(&self) -> &Arc<PackFile> {
        &self.pack
    }

    /// The fingerprint the pack must have been made from.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

impl ExpertsLoader for PackedExperts {
    fn load(&self, dims: ExpertDims, vb: VarBuilder) -> candle::Result<Arc<dyn RoutedExperts>> {
        self.pack.check_source(
            &self.fingerprint,
            dims.hidden,
            dims.intermediate,
            dims.num_experts,
        )?;
        let layer = self.pack.layer(dims.layer)?;
        Ok(match (self.dense, &self.residency) {
            (None, Some(residency)) => {
                residency.layer(dims.layer, dims.top_k, layer, vb.device())?
            }
            (None, None) => {
                let experts = Int4Experts::new(layer);
                Arc::new(match self.decode_acts {
                    Some(acts) => experts.with_decode_activations(acts),
                    None => experts,
                })
            }
            (Some(dtype), _) => Arc::new(DenseExperts::new(
                layer.dequantize_experts(dtype, vb.device())?,
            )?),
        })
    }
}
