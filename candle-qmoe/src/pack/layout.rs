//! Byte layout of INT4 matrices and expert slabs.
//!
//! # Matrix layout
//! A quantized matrix `W [rows, cols]` (PyTorch `Linear` orientation: `y = W x`, K = `cols`) is
//! stored row-major. Each row is padded with zero weights to a multiple of 32 columns, so a row is
//! a sequence of 16-byte *chunks* of 32 weights; a 16-byte load always covers whole chunks.
//!
//! Inside a chunk, each little-endian `u32` word holds 8 consecutive weights `e0..e7` as unsigned
//! nibbles `q + 8` (`q ∈ [-8, 7]`) in the interleaved order `[e0, e2, e4, e6, e1, e3, e5, e7]`
//! (nibble `p` at bits `4p..4p+4`). With that order `(w >> 4i) & 0x000f000f` yields the pair
//! `(e_{2i}, e_{2i+1})` in the two 16-bit halves, which a GPU turns into a `half2` with one
//! `lop3` and one FMA (the "magic number" conversion).
//!
//! Scales are FP16, one per row and group of `group_size` consecutive columns, stored row-major
//! `[rows, groups]`; the last group of a row may be partial when `cols` is not a multiple of the
//! group size (e.g. K = 1408 with groups of 256). A weight dequantizes to `scale · (nibble − 8)`.
//!
//! # Expert slab
//! One routed expert is one contiguous slab, so a single host→device copy moves it:
//! `[gate_up weights | down weights | gate_up scales | down scales]`, each region starting at a
//! multiple of 16 bytes. `gate_up` stacks the gate projection (rows `0..I`) over the up projection
//! (rows `I..2I`), both `[·, H]`; `down` is `[H, I]`.

use super::GroupSize;
use crate::QmoeError;

/// Rounds `x` up to a multiple of `m`.
pub(crate) const fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// Weights per 16-byte chunk.
pub const CHUNK_WEIGHTS: usize = 32;
/// Bytes per chunk.
pub const CHUNK_BYTES: usize = 16;

/// Shape and byte sizes of one INT4 matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QMatrixLayout {
    /// Output features (N).
    pub rows: usize,
    /// Input features (K).
    pub cols: usize,
    /// Columns sharing one FP16 scale.
    pub group_size: GroupSize,
}

impl QMatrixLayout {
    /// Columns after padding to whole chunks.
    pub fn padded_cols(&self) -> usize {
        round_up(self.cols, CHUNK_WEIGHTS)
    }
    /// Bytes of packed weights per row.
    pub fn row_bytes(&self) -> usize {
        self.padded_cols() / 2
    }
    /// Scale groups per row (the last one may be partial).
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(self.group_size.get())
    }
    /// Bytes of packed weights.
    pub fn weight_bytes(&self) -> usize {
        self.rows * self.row_bytes()
    }
    /// Number of FP16 scales.
    pub fn scale_count(&self) -> usize {
        self.rows * self.groups()
    }
}

/// Byte layout of one expert slab (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Model hidden size (H).
    pub hidden: usize,
    /// Expert intermediate size (I).
    pub intermediate: usize,
    /// Columns per scale group.
    pub group_size: GroupSize,
}

/// Byte offsets of the four regions of a slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabOffsets {
    /// Start of the gate/up weights.
    pub gate_up_weights: usize,
    /// Start of the down weights.
    pub down_weights: usize,
    /// Start of the gate/up FP16 scales.
    pub gate_up_scales: usize,
    /// Start of the down FP16 scales.
    pub down_scales: usize,
    /// Total slab bytes (a multiple of 16).
    pub total: usize,
}

impl ExpertLayout {
    /// Layout of the stacked gate/up projection `[2I, H]`.
    pub fn gate_up(&self) -> QMatrixLayout {
        QMatrixLayout {
            rows: 2 * self.intermediate,
            cols: self.hidden,
            group_size: self.group_size,
        }
    }
    /// Layout of the down projection `[H, I]`.
    pub fn down(&self) -> QMatrixLayout {
        QMatrixLayout {
            rows: self.hidden,
            cols: self.intermediate,
            group_size: self.group_size,
        }
    }
    /// Region offsets inside a slab.
    pub fn offsets(&self) -> SlabOffsets {
        let (gu, dn) = (self.gate_up(), self.down());
        let down_weights = round_up(gu.weight_bytes(), 16);
        let gate_up_scales = round_up(down_weights + dn.weight_bytes(), 16);
        let down_scales = round_up(gate_up_scales + 2 * gu.scale_count(), 16);
        let total = round_up(down_scales + 2 * dn.scale_count(), 16);
        SlabOffsets {
            gate_up_weights: 0,
            down_weights,
            gate_up_scales,
            down_scales,
            total,
        }
    }
    /// Bytes of one expert slab.
    pub fn slab_bytes(&self) -> usize {
        self.offsets().total
    }

    /// Bytes of one expert slab, computed with checked arithmetic: an error when a dimension is
    /// zero or a size overflows (e.g. dimensions read from a damaged pack header), so that no
    /// size derived from this layout is trusted before it is known to be sane.
    pub fn checked_slab_bytes(&self) -> crate::Result<usize> {
        let (h, i) = (self.hidden, self.intermediate);
        let matrix = |rows: usize, cols: usize| -> Option<(usize, usize)> {
            let m = QMatrixLayout {
                rows,
                cols,
                group_size: self.group_size,
            };
            let weights = rows.checked_mul(cols.checked_next_multiple_of(CHUNK_WEIGHTS)? / 2)?;
            Some((weights, rows.checked_mul(m.groups())?.checked_mul(2)?))
        };
        let total = (|| {
            let (gu_weights, gu_scales) = matrix(i.checked_mul(2)?, h)?;
            let (dn_weights, dn_scales) = matrix(h, i)?;
            [gu_weights, dn_weights, gu_scales, dn_scales]
                .into_iter()
                .try_fold(0usize, |end, region| {
                    end.checked_add(region)?.checked_next_multiple_of(16)
                })
        })();
        match total {
            Some(total) if h > 0 && i > 0 => Ok(total),
            _ => Err(QmoeError::InvalidPack {
                reason: format!(
                    "expert layout hidden {h} × intermediate {i} (group size {}) has no valid \
                     slab size",
                    self.group_size.get()
                ),
            }),
        }
    }
}

/// Byte index within a row and nibble half (0 = low) of column `col`.
#[inline]
pub fn nibble_position(col: usize) -> (usize, u32) {
    let chunk = col / CHUNK_WEIGHTS;
    let j = col % CHUNK_WEIGHTS;
    let (word, e) = (j / 8, j % 8);
    // Element e sits at nibble position p = (e % 2) * 4 + e / 2 of its word.
    let p = (e % 2) * 4 + e / 2;
    (chunk * CHUNK_BYTES + word * 4 + p / 2, (p % 2) as u32)
}

/// Column within a chunk of the weight in lane `lane` of the CPU kernels' activation order:
/// lanes `0..16` pair with the low nibbles of chunk bytes `0..16`, lanes `16..32` with the high
/// nibbles.
pub const CPU_LANE_COLUMN: [usize; CHUNK_WEIGHTS] = {
    let mut out = [0usize; CHUNK_WEIGHTS];
    // Elements at nibble positions p = 0..8 of a word are [0, 2, 4, 6, 1, 3, 5, 7].
    let order = [0usize, 2, 4, 6, 1, 3, 5, 7];
    let mut b = 0;
    while b < 16 {
        let word = b / 4;
        let p_lo = 2 * (b % 4);
        out[b] = 8 * word + order[p_lo];
        out[16 + b] = 8 * word + order[p_lo + 1];
        b += 1;
    }
    out
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_columns_are_a_permutation_consistent_with_nibble_positions() {
        let mut seen = [false; CHUNK_WEIGHTS];
        for (lane, &col) in CPU_LANE_COLUMN.iter().enumerate() {
            assert!(!seen[col]);
            seen[col] = true;
            let (byte, half) = nibble_position(col);
            assert_eq!(byte, lane % 16);
            assert_eq!(half as usize, lane / 16);
        }
    }

    #[test]
    fn slab_regions_are_aligned_and_disjoint() {
        let l = ExpertLayout {
            hidden: 2048,
            intermediate: 1408,
            group_size: GroupSize::new(256).unwrap(),
        };
        let o = l.offsets();
        assert_eq!(l.down().groups(), 6);
        for off in [o.down_weights, o.gate_up_scales, o.down_scales, o.total] {
            assert_eq!(off % 16, 0);
        }
        assert!(o.down_weights >= l.gate_up().weight_bytes());
        assert!(o.total >= o.down_scales + 2 * l.down().scale_count());
        assert_eq!(l.checked_slab_bytes().unwrap(), o.total);
    }

    #[test]
    fn checked_slab_bytes_refuses_zero_and_overflowing_dimensions() {
        let g = GroupSize::new(32).unwrap();
        for (hidden, intermediate) in [(0, 64), (64, 0), (usize::MAX, 8), (8, usize::MAX / 2 + 1)] {
            let l = ExpertLayout {
                hidden,
                intermediate,
                group_size: g,
            };
            let e = l.checked_slab_bytes().unwrap_err().to_string();
            assert!(e.contains(&format!("hidden {hidden} ")), "{e}");
        }
        let l = ExpertLayout {
            hidden: 100,
            intermediate: 33,
            group_size: g,
        };
        assert_eq!(l.checked_slab_bytes().unwrap(), l.slab_bytes());
    }
}
