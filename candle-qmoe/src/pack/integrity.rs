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
///
/// Slabs longer than [`CHECKSUM_PIECE_BYTES`] are hashed in pieces on rayon's pool and the
/// pieces' CRCs combined in order (the same value as one pass): a decode step that reads an
/// expert for the first time verifies it with every core instead of one.
pub fn slab_checksum(bytes: &[u8]) -> u32 {
    if bytes.len() <= CHECKSUM_PIECE_BYTES {
        return crc32fast::hash(bytes);
    }
    let pieces: Vec<crc32fast::Hasher> = bytes
        .par_chunks(CHECKSUM_PIECE_BYTES)
        .map(|piece| {
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(piece);
            hasher
        })
        .collect();
    let mut pieces = pieces.into_iter();
    let mut whole = pieces.next().unwrap_or_default();
    for piece in pieces {
        whole.combine(&piece);
    }
    whole.finalize()
}

/// The length of the pieces [`slab_checksum`] hashes in parallel: 256 KiB, a tenth of a
/// Qwen3-30B-A3B slab (2.3 MiB) and far above the cost of combining two CRCs.
pub const CHECKSUM_PIECE_BYTES: usize = 256 << 10;

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces' combined CRC is the CRC of the whole, at lengths around the piece size.
    #[test]
    fn checksum_in_pieces_equals_one_pass() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let bytes: Vec<u8> = (0..3 * CHECKSUM_PIECE_BYTES + 17)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        let p = CHECKSUM_PIECE_BYTES;
        for len in [0, 1, p - 1, p, p + 1, 2 * p, 3 * p + 17] {
            let part = &bytes[..len];
            assert_eq!(slab_checksum(part), crc32fast::hash(part), "length {len}");
        }
    }
}
