//! Per-slab integrity of a layer's experts (docs/architecture.md §2 Pack format).
//!
//! Every expert slab has a CRC-32 checksum, computed when the slab is made (quantized or
//! generated) and written to the `.qmoe` file next to the slabs. A slab read from a file is
//! checked the first time it is read — its checksum recomputed and its FP16 scales required to be
//! finite — and marked verified, so later reads cost one atomic load. A slab that fails is a
//! [`QmoeError::CorruptPack`] naming the pack file, the layer and the expert.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::layout::ExpertLayout;
use crate::QmoeError;

/// The checksum of one slab's bytes: CRC-32 (IEEE), computed with the carry-less multiply
/// instructions `crc32fast` detects at run time (about twice the speed of XXH3 built for plain
/// x86-64, and it detects every burst error of up to 32 bits).
pub fn slab_checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// Where a layer's slabs come from, named in errors.
#[derive(Clone, Debug)]
pub(crate) enum SlabOrigin {
    /// MoE layer `layer` of the `.qmoe` file at `path`.
    File {
        /// The pack file.
        path: PathBuf,
        /// The MoE layer index.
        layer: usize,
    },
    /// Slabs made in this process, with a name for errors (e.g. the layer's tensor prefix).
    Memory(String),
}

impl SlabOrigin {
    /// The error for slab `expert` of this layer: a [`QmoeError::CorruptPack`] naming the file,
    /// the layer and the expert, or a [`QmoeError::InvalidPack`] for slabs made in memory.
    fn corrupt(&self, expert: usize, what: impl std::fmt::Display) -> QmoeError {
        match self {
            Self::File { path, layer } => QmoeError::CorruptPack {
                path: path.clone(),
                reason: format!(
                    "layer {layer}, expert {expert}: corrupt slab: {what}; re-run quantize to \
                     re-create the pack"
                ),
            },
            Self::Memory(name) => QmoeError::InvalidPack {
                reason: format!("{name}, expert {expert}: {what}"),
            },
        }
    }
}

/// The checksums of a layer's slabs, which of them have been verified, and where the layer comes
/// from (named in errors).
#[derive(Debug)]
pub(crate) struct SlabChecks {
    origin: SlabOrigin,
    sums: Vec<u32>,
    verified: Vec<AtomicBool>,
}

impl SlabChecks {
    /// Checksums recorded in a file for slabs not yet verified; `origin` names the file and the
    /// layer in errors.
    pub(crate) fn recorded(origin: SlabOrigin, sums: Vec<u32>) -> Self {
        let verified = sums.iter().map(|_| AtomicBool::new(false)).collect();
        Self {
            origin,
            sums,
            verified,
        }
    }

    /// Checksums computed here from slabs `slab_bytes` bytes long, back to back in `bytes`, whose
    /// scales are checked at once: such slabs count as verified.
    pub(crate) fn computed(
        origin: SlabOrigin,
        layout: ExpertLayout,
        bytes: &[u8],
    ) -> Result<Self, QmoeError> {
        let sums = bytes
            .par_chunks(layout.slab_bytes())
            .enumerate()
            .map(|(e, slab)| {
                check_scales(layout, slab).map_err(|what| origin.corrupt(e, what))?;
                Ok(slab_checksum(slab))
            })
            .collect::<Result<Vec<_>, QmoeError>>()?;
        let verified = sums.iter().map(|_| AtomicBool::new(true)).collect();
        Ok(Self {
            origin,
            sums,
            verified,
        })
    }

    /// The checksum of every slab, in expert order.
    pub fn checksums(&self) -> &[u32] {
        &self.sums
    }

    /// Whether slab `e` has been verified.
    pub fn is_verified(&self, e: usize) -> bool {
        self.verified[e].load(Ordering::Acquire)
    }

    /// Checks slab `e` (its bytes are `slab`) once: later calls return at once.
    pub(crate) fn verify(
        &self,
        e: usize,
        layout: ExpertLayout,
        slab: &[u8],
    ) -> Result<(), QmoeError> {
        if self.is_verified(e) {
            return Ok(());
        }
        let (got, want) = (slab_checksum(slab), self.sums[e]);
        if got != want {
            return Err(self.origin.corrupt(
                e,
                format!(
                    "its bytes hash to {got:08x}, the pack recorded {want:08x} (the file was \
                     damaged after it was written)"
                ),
            ));
        }
        check_scales(layout, slab).map_err(|what| self.origin.corrupt(e, what))?;
        self.verified[e].store(true, Ordering::Release);
        Ok(())
    }
}

/// Every FP16 scale of `slab` is finite (quantization never writes NaN or infinity).
fn check_scales(layout: ExpertLayout, slab: &[u8]) -> Result<(), String> {
    let o = layout.offsets();
    for (what, start, count) in [
        ("gate_up", o.gate_up_scales, layout.gate_up().scale_count()),
        ("down", o.down_scales, layout.down().scale_count()),
    ] {
        let scales = slab[start..start + 2 * count].chunks_exact(2);
        if let Some(i) = scales
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .position(|bits| bits & 0x7c00 == 0x7c00)
        {
            return Err(format!("{what} scale {i} is not finite"));
        }
    }
    Ok(())
}
