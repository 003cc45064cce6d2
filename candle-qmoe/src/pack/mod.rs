//! The INT4 expert pack: quantization, layout, and per-layer slab storage.
//!
//! Only routed experts are packed. Each (layer, expert) is one contiguous slab holding the
//! stacked gate/up projection, the down projection and their FP16 group scales; see [`layout`]
//! for the exact bytes. [`LayerPack`] owns the slabs of one layer.

pub mod file;
pub mod integrity;
pub mod layout;
pub mod quant;

use std::sync::Arc;

use candle::{DType, Tensor};
use half::f16;
use rayon::prelude::*;

pub use file::{PackFile, PackMeta, PackWriter};
pub use integrity::slab_checksum;
use integrity::{SlabChecks, SlabOrigin};
pub use layout::{ExpertLayout, QMatrixLayout, SlabOffsets};
pub use quant::{
    dequantize_matrix, quantize_matrix, quantize_matrix_into, QuantizedMatrix, ScaleSearch,
};

use crate::QmoeError;

/// Columns sharing one FP16 scale: 32, 64, 128 (default) or 256.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupSize(usize);

impl GroupSize {
    /// The supported sizes.
    pub const SUPPORTED: [usize; 4] = [32, 64, 128, 256];

    /// Validates a group size.
    pub fn new(size: usize) -> Result<Self, QmoeError> {
        if Self::SUPPORTED.contains(&size) {
            Ok(Self(size))
        } else {
            Err(QmoeError::unsupported(
                "group size",
                size,
                format!("is not supported (use one of {:?})", Self::SUPPORTED),
            ))
        }
    }
    /// The size as a number.
    pub fn get(self) -> usize {
        self.0
    }
}

impl Default for GroupSize {
    fn default() -> Self {
        Self(128)
    }
}

/// What a checkpoint calls a routed expert's three projections: its tensors are
/// `{block}.experts.{e}.{projection}.weight` under the MoE block `block`. Loaders read these
/// names and errors name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertNames {
    /// The gate projection `[I, H]` (`gate_proj`; Mixtral `w1`).
    pub gate: &'static str,
    /// The up projection `[I, H]` (`up_proj`; Mixtral `w3`).
    pub up: &'static str,
    /// The down projection `[H, I]` (`down_proj`; Mixtral `w2`).
    pub down: &'static str,
}

impl ExpertNames {
    /// `gate_proj`, `up_proj`, `down_proj` (OLMoE, Qwen2-MoE, Qwen3-MoE).
    pub const PROJ: Self = Self {
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
    /// `w1`, `w3`, `w2` (Mixtral).
    pub const MIXTRAL: Self = Self {
        gate: "w1",
        up: "w3",
        down: "w2",
    };

    /// The prefix of expert `e` in the MoE block `block`: `{block}.experts.{e}`.
    pub fn expert(block: &str, e: usize) -> String {
        format!("{block}.experts.{e}")
    }

    /// The weights of the expert whose prefix is `expert` (see [`Self::expert`]): gate, up,
    /// down, e.g. `{expert}.gate_proj.weight`.
    pub fn weights(&self, expert: &str) -> [String; 3] {
        [self.gate, self.up, self.down].map(|p| format!("{expert}.{p}.weight"))
    }
}

impl Default for ExpertNames {
    fn default() -> Self {
        Self::PROJ
    }
}

/// Host view of one expert's dense weights, in PyTorch orientation.
#[derive(Clone, Debug)]
pub struct DenseExpert {
    /// The gate projection `[I, H]`.
    pub gate: Tensor,
    /// The up projection `[I, H]`.
    pub up: Tensor,
    /// The down projection `[H, I]`.
    pub down: Tensor,
}

fn matrix_f32(
    name: &str,
    t: &Tensor,
    expected: [usize; 2],
    out: &mut Vec<f32>,
) -> crate::Result<()> {
    if t.dims() != expected {
        return Err(QmoeError::ShapeMismatch {
            tensor: name.to_string(),
            got: t.dims().to_vec(),
            expected: expected.to_vec(),
        });
    }
    if !crate::experts::is_compute_float(t.dtype()) {
        return Err(QmoeError::InvalidArgument {
            argument: format!("tensor `{name}`"),
            reason: format!(
                "is {:?}; expert weights must be f16, bf16, f32 or f64",
                t.dtype()
            ),
        });
    }
    *out = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(())
}

/// One expert's weights in F32, row-major: the buffers an expert is read into before
/// quantization, reused from one expert to the next.
#[derive(Clone, Debug, Default)]
pub struct ExpertWeights {
    /// `gate_proj.weight [I, H]`.
    pub gate: Vec<f32>,
    /// `up_proj.weight [I, H]`.
    pub up: Vec<f32>,
    /// `down_proj.weight [H, I]`.
    pub down: Vec<f32>,
}

impl ExpertWeights {
    /// Reads `expert` (checking its shapes against `layout`); errors name its gate, up and
    /// down weights `tensors`.
    pub fn read_dense(
        &mut self,
        tensors: &[String; 3],
        expert: &DenseExpert,
        layout: ExpertLayout,
    ) -> crate::Result<()> {
        let (h, i) = (layout.hidden, layout.intermediate);
        let [gate, up, down] = tensors;
        for (tensor, t, shape, out) in [
            (gate, &expert.gate, [i, h], &mut self.gate),
            (up, &expert.up, [i, h], &mut self.up),
            (down, &expert.down, [h, i], &mut self.down),
        ] {
            matrix_f32(tensor, t, shape, out)?;
        }
        Ok(())
    }
}

/// Quantizes one expert into a slab of `layout.slab_bytes()` bytes. Errors name its tensors
/// `names.weights(name)` (e.g. `name` = `model.layers.3.mlp.experts.7`).
pub fn quantize_expert(
    name: &str,
    names: ExpertNames,
    expert: &DenseExpert,
    layout: ExpertLayout,
    search: ScaleSearch,
) -> crate::Result<Vec<u8>> {
    let tensors = names.weights(name);
    let mut weights = ExpertWeights::default();
    weights.read_dense(&tensors, expert, layout)?;
    let mut slab = vec![0u8; layout.slab_bytes()];
    quantize_expert_into(&tensors, &weights, layout, search, &mut slab)?;
    Ok(slab)
}

/// Quantizes one expert's F32 weights into `slab`, `layout.slab_bytes()` zeroed bytes (the
/// alignment gaps between its regions are left as they are). Errors name its gate, up and
/// down weights `tensors`.
pub fn quantize_expert_into(
    tensors: &[String; 3],
    weights: &ExpertWeights,
    layout: ExpertLayout,
    search: ScaleSearch,
    slab: &mut [u8],
) -> crate::Result<()> {
    let o = layout.offsets();
    if slab.len() != o.total {
        return Err(QmoeError::InvalidArgument {
            argument: format!("slab of the expert of `{}`", tensors[0]),
            reason: format!("{} bytes, the layout needs {}", slab.len(), o.total),
        });
    }
    let (gu, dn) = (layout.gate_up(), layout.down());
    // The regions in slab order: gate/up weights, down weights, gate/up scales, down scales.
    let (head, down_scales) = slab.split_at_mut(o.down_scales);
    let (head, gate_up_scales) = head.split_at_mut(o.gate_up_scales);
    let (head, down_weights) = head.split_at_mut(o.down_weights);
    let gate_up_weights = &mut head[o.gate_up_weights..o.gate_up_weights + gu.weight_bytes()];
    // gate is rows 0..I of the stacked gate/up matrix and up rows I..2I; rows are quantized
    // independently, so each half is quantized as a matrix of its own.
    let half = QMatrixLayout {
        rows: layout.intermediate,
        ..gu
    };
    let (gate_w, up_w) = gate_up_weights.split_at_mut(half.weight_bytes());
    let (gate_s, up_s) =
        gate_up_scales[..2 * gu.scale_count()].split_at_mut(2 * half.scale_count());
    let [gate, up, down] = tensors;
    for (tensor, values, w, s) in [
        (gate, &weights.gate, gate_w, gate_s),
        (up, &weights.up, up_w, up_s),
    ] {
        quantize_matrix_into(tensor, values, half, search, w, s)?;
    }
    quantize_matrix_into(
        down,
        &weights.down,
        dn,
        search,
        &mut down_weights[..dn.weight_bytes()],
        &mut down_scales[..2 * dn.scale_count()],
    )
}

/// Reads FP16 scales from little-endian slab bytes.
pub fn read_scales(src: &[u8], count: usize) -> Vec<f16> {
    src[..2 * count]
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]))
        .collect()
}

/// Borrowed view of one slab, split into its regions.
#[derive(Clone, Copy, Debug)]
pub struct SlabView<'a> {
    /// The slab layout.
    pub layout: ExpertLayout,
    /// The whole slab.
    pub bytes: &'a [u8],
}

impl<'a> SlabView<'a> {
    /// Packed gate/up weights `[2I, H/2 padded]`.
    pub fn gate_up_weights(&self) -> &'a [u8] {
        let o = self.layout.offsets();
        &self.bytes[o.gate_up_weights..o.gate_up_weights + self.layout.gate_up().weight_bytes()]
    }
    /// Packed down weights `[H, I/2 padded]`.
    pub fn down_weights(&self) -> &'a [u8] {
        let o = self.layout.offsets();
        &self.bytes[o.down_weights..o.down_weights + self.layout.down().weight_bytes()]
    }
    /// Raw little-endian FP16 gate/up scales.
    pub fn gate_up_scales(&self) -> &'a [u8] {
        let o = self.layout.offsets();
        &self.bytes[o.gate_up_scales..o.gate_up_scales + 2 * self.layout.gate_up().scale_count()]
    }
    /// Raw little-endian FP16 down scales.
    pub fn down_scales(&self) -> &'a [u8] {
        let o = self.layout.offsets();
        &self.bytes[o.down_scales..o.down_scales + 2 * self.layout.down().scale_count()]
    }
    /// Dequantizes back to dense F32 `(gate [I,H], up [I,H], down [H,I])`, row-major.
    pub fn dequantize(&self) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (gu, dn) = (self.layout.gate_up(), self.layout.down());
        let mut gate = dequantize_matrix(
            gu,
            self.gate_up_weights(),
            &read_scales(self.gate_up_scales(), gu.scale_count()),
        );
        let up = gate.split_off(self.layout.intermediate * self.layout.hidden);
        let down = dequantize_matrix(
            dn,
            self.down_weights(),
            &read_scales(self.down_scales(), dn.scale_count()),
        );
        (gate, up, down)
    }
}

/// Bytes of a layer's slabs: owned, a range of a memory-mapped `.qmoe` file, or read from such
/// a file into anonymous memory of this process ([`LayerPack::read_into_memory`]).
#[derive(Clone, Debug)]
enum PackBytes {
    Owned(Arc<[u8]>),
    Mapped(Arc<memmap2::Mmap>, std::ops::Range<usize>),
    Anonymous(Arc<memmap2::Mmap>),
}

impl PackBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            PackBytes::Owned(b) => b,
            PackBytes::Mapped(m, r) => &m[r.clone()],
            PackBytes::Anonymous(m) => m,
        }
    }
}

/// The packed routed experts of one MoE layer, held in host memory (owned or memory-mapped),
/// with a checksum per slab ([`integrity`]): slabs read from a file are verified on first use
/// ([`LayerPack::verified_slab`], [`LayerPack::verify_experts`]) or all at once
/// ([`LayerPack::verify`]).
#[derive(Clone, Debug)]
pub struct LayerPack {
    layout: ExpertLayout,
    num_experts: usize,
    bytes: PackBytes,
    checks: Arc<SlabChecks>,
}

impl LayerPack {
    /// Quantizes the experts of one layer (in parallel). Errors name expert `e`'s tensors
    /// `names.weights(&ExpertNames::expert(name, e))`, `name` being the MoE block's prefix
    /// (the tensors of experts with weights of their own,
    /// [`ExpertStorage::PerExpert`](crate::models::ExpertStorage::PerExpert)).
    pub fn quantize(
        name: &str,
        names: ExpertNames,
        experts: &[DenseExpert],
        layout: ExpertLayout,
        search: ScaleSearch,
    ) -> crate::Result<Self> {
        let tensors = |e| names.weights(&ExpertNames::expert(name, e));
        Self::quantize_with(
            name,
            experts.len(),
            layout,
            search,
            &tensors,
            |e, w| w.read_dense(&tensors(e), &experts[e], layout),
            &|| {},
        )
    }

    /// Quantizes `num_experts` experts whose F32 weights `read(e, buffers)` puts in `buffers`
    /// (in parallel, each thread reusing its buffers), calling `on_expert` after each: only the
    /// experts being quantized are held in dense form, and the slabs are written in place, so a
    /// layer can be packed straight from a memory-mapped checkpoint. Errors name the layer
    /// `name` (the MoE block's prefix) and expert `e`'s gate, up and down weights
    /// `tensors(e)`.
    pub fn quantize_with(
        name: &str,
        num_experts: usize,
        layout: ExpertLayout,
        search: ScaleSearch,
        tensors: &(dyn Fn(usize) -> [String; 3] + Sync),
        read: impl Fn(usize, &mut ExpertWeights) -> crate::Result<()> + Sync,
        on_expert: &(dyn Fn() + Sync),
    ) -> crate::Result<Self> {
        if num_experts == 0 {
            return Err(QmoeError::InvalidArgument {
                argument: "num_experts".into(),
                reason: format!("`{name}` has zero experts"),
            });
        }
        let n = layout.checked_slab_bytes()?;
        let total = n
            .checked_mul(num_experts)
            .ok_or_else(|| QmoeError::InvalidPack {
                reason: format!("{num_experts} experts × {n} bytes overflow"),
            })?;
        // Zeroed anonymous memory (the zeroed gaps between a slab's regions are what
        // `quantize_expert_into` expects), taken fallibly: more than the system can give is an
        // error, not an abort.
        let mut bytes = memmap2::MmapOptions::new()
            .len(total)
            .map_anon()
            .map_err(|e| QmoeError::OutOfMemory {
                what: format!("the {num_experts} packed experts of `{name}`"),
                needed: total,
                reason: format!("the host refused the allocation ({e})"),
            })?;
        bytes.par_chunks_mut(n).enumerate().try_for_each_init(
            ExpertWeights::default,
            |weights, (e, slab)| {
                read(e, weights)?;
                quantize_expert_into(&tensors(e), weights, layout, search, slab)?;
                on_expert();
                Ok::<_, QmoeError>(())
            },
        )?;
        let bytes = PackBytes::Anonymous(Arc::new(bytes.make_read_only().map_err(|e| {
            QmoeError::InvalidPack {
                reason: format!("cannot make the packed `{name}` read-only: {e}"),
            }
        })?));
        Self::checked(layout, num_experts, bytes, |b| {
            SlabChecks::computed(SlabOrigin::Memory(format!("`{name}`")), layout, b)
        })
    }

    /// Wraps already packed bytes (`num_experts` slabs back to back), checking their size and
    /// that every scale is finite, and computing their checksums.
    pub fn from_bytes(
        layout: ExpertLayout,
        num_experts: usize,
        bytes: Arc<[u8]>,
    ) -> Result<Self, QmoeError> {
        Self::checked(layout, num_experts, PackBytes::Owned(bytes), |b| {
            SlabChecks::computed(SlabOrigin::Memory("in-memory layer".into()), layout, b)
        })
    }

    /// A range of a memory-mapped file with the slab checksums the file records, checking its
    /// size; `origin` names the file and the layer in errors. Slabs are verified on first use.
    pub(crate) fn from_mmap(
        layout: ExpertLayout,
        num_experts: usize,
        map: Arc<memmap2::Mmap>,
        range: std::ops::Range<usize>,
        checksums: Vec<u32>,
        origin: SlabOrigin,
    ) -> Result<Self, QmoeError> {
        if checksums.len() != num_experts {
            return Err(QmoeError::InvalidPack {
                reason: format!(
                    "{} slab checksums for {num_experts} experts",
                    checksums.len()
                ),
            });
        }
        Self::checked(layout, num_experts, PackBytes::Mapped(map, range), |_| {
            Ok(SlabChecks::recorded(origin, checksums))
        })
    }

    fn checked(
        layout: ExpertLayout,
        num_experts: usize,
        bytes: PackBytes,
        checks: impl FnOnce(&[u8]) -> Result<SlabChecks, QmoeError>,
    ) -> Result<Self, QmoeError> {
        let slab = layout.checked_slab_bytes()?;
        let want = num_experts.checked_mul(slab);
        let got = bytes.as_slice().len();
        if num_experts == 0 || want != Some(got) {
            return Err(QmoeError::InvalidPack {
                reason: format!(
                    "layer holds {got} bytes, not {num_experts} experts × {slab} bytes"
                ),
            });
        }
        let checks = Arc::new(checks(bytes.as_slice())?);
        Ok(Self {
            layout,
            num_experts,
            bytes,
            checks,
        })
    }

    /// The slab layout.
    pub fn layout(&self) -> ExpertLayout {
        self.layout
    }
    /// Number of routed experts.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    /// All slabs, back to back.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }
    /// The slab of expert `e`, as stored (not verified: see [`LayerPack::verified_slab`]).
    ///
    /// # Panics
    /// When `e` is not below [`LayerPack::num_experts`], as slice indexing does; the checked
    /// form is [`LayerPack::verified_slab`].
    pub fn slab(&self, e: usize) -> SlabView<'_> {
        let n = self.layout.slab_bytes();
        SlabView {
            layout: self.layout,
            bytes: &self.bytes()[e * n..(e + 1) * n],
        }
    }

    /// The slab of expert `e`, verified against its checksum on first use (see [`integrity`]).
    /// An expert out of range is a [`QmoeError::InvalidArgument`].
    pub fn verified_slab(&self, e: usize) -> crate::Result<SlabView<'_>> {
        self.check_expert(e)?;
        let view = self.slab(e);
        self.checks.verify(e, self.layout, view.bytes)?;
        Ok(view)
    }

    /// Verifies the slabs of `experts` that are not verified yet (in parallel); a corrupt slab
    /// is a [`QmoeError::CorruptPack`] naming the pack file, the layer and the expert.
    /// An expert out of range is a [`QmoeError::InvalidArgument`].
    pub fn verify_experts(&self, experts: impl IntoIterator<Item = usize>) -> crate::Result<()> {
        let mut pending = Vec::new();
        for e in experts {
            self.check_expert(e)?;
            if !self.checks.is_verified(e) {
                pending.push(e);
            }
        }
        pending
            .into_par_iter()
            .try_for_each(|e| self.verified_slab(e).map(|_| ()))
    }

    /// `e` as an expert of this layer, or a [`QmoeError::InvalidArgument`].
    fn check_expert(&self, e: usize) -> crate::Result<()> {
        if e < self.num_experts {
            return Ok(());
        }
        Err(QmoeError::InvalidArgument {
            argument: "expert".into(),
            reason: format!(
                "expert {e} is out of range for a layer of {} experts",
                self.num_experts
            ),
        })
    }

    /// Whether slab `e` has been verified (slabs made in this process always are); `false` for
    /// an expert out of range.
    pub fn is_verified(&self, e: usize) -> bool {
        e < self.num_experts && self.checks.is_verified(e)
    }

    /// Verifies every slab not verified yet.
    pub fn verify(&self) -> crate::Result<()> {
        self.verify_experts(0..self.num_experts)
    }

    /// This layer with its slabs read from `file`, the `.qmoe` file it is mapped from, into
    /// anonymous memory of this process: no page of the file stays mapped, and the kernels
    /// stream the process's own memory, which decoded OLMoE 1.05–1.08× faster than the mapped
    /// file on a 2-vCPU Xeon (docs/architecture.md §2). The checksums are still checked on
    /// first use. Owned or already read layers are returned as they are.
    pub(crate) fn read_into_memory(&self, file: &std::fs::File) -> std::io::Result<Self> {
        let PackBytes::Mapped(map, range) = &self.bytes else {
            return Ok(self.clone());
        };
        // Faulted in by the kernel in one go (MAP_POPULATE on Linux) rather than page by page
        // under the read.
        let mut anon = memmap2::MmapOptions::new()
            .len(range.len())
            .populate()
            .map_anon()?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            let _ = map; // read from the file: no page of the map is touched
            file.read_exact_at(&mut anon, range.start as u64)?;
        }
        #[cfg(not(unix))]
        {
            let _ = file;
            anon.copy_from_slice(&map[range.clone()]);
        }
        Ok(Self {
            bytes: PackBytes::Anonymous(Arc::new(anon.make_read_only()?)),
            ..self.clone()
        })
    }

    /// Hands the pages of a memory-mapped layer back to the system: they leave this process's
    /// resident memory and are read again from the file when next used (e.g. after a one-off
    /// [`Self::verify`] of a whole pack). Owned bytes, and bytes read into memory
    /// ([`PackFile::open_in_memory`]), are kept. A no-op where the system has no `madvise`
    /// (not Unix).
    pub fn release_pages(&self) {
        #[cfg(unix)]
        if let PackBytes::Mapped(map, range) = &self.bytes {
            // SAFETY: the map is a read-only view of a `.qmoe` file that must not be modified
            // while mapped (see `PackFile::open`): after MADV_DONTNEED a page is read back from
            // the file with the same bytes, so no borrowed slab ever sees different data.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.len(),
                )
            };
        }
    }

    /// The checksum of every slab, in expert order, as written to a `.qmoe` file.
    pub fn checksums(&self) -> &[u32] {
        self.checks.checksums()
    }

    /// Every expert dequantized to dense `dtype` tensors on `device`: exactly the weights the
    /// INT4 kernels compute with, for the dense oracle.
    pub fn dequantize_experts(
        &self,
        dtype: DType,
        device: &candle::Device,
    ) -> candle::Result<Vec<DenseExpert>> {
        let (h, i) = (self.layout.hidden, self.layout.intermediate);
        self.verify()?;
        (0..self.num_experts)
            .map(|e| {
                let (gate, up, down) = self.slab(e).dequantize();
                let t = |v: Vec<f32>, shape: (usize, usize)| {
                    Tensor::from_vec(v, shape, &candle::Device::Cpu)?
                        .to_dtype(dtype)?
                        .to_device(device)
                };
                Ok(DenseExpert {
                    gate: t(gate, (i, h))?,
                    up: t(up, (i, h))?,
                    down: t(down, (h, i))?,
                })
            })
            .collect()
    }
}
