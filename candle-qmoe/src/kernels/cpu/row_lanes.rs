//! The AVX-512 VNNI kernel for `i8` activations with the weight rows in vector lanes, for
//! calls where several tokens share an expert (prefill).
//!
//! The other kernels read a weight row along a vector and reduce each group's lanes to one
//! total per (row, token): at a prefill on an Emerald Rapids Xeon they ran `vpdpbusd` at a
//! tenth of its rate, the rest going to nibble decodes, horizontal sums and scaling. Here 16
//! rows of a matrix are first transposed into steps of 64 bytes, lane `r` of a step holding 4
//! bytes (8 nibbles) of row `r`; every token of the call then multiplies a step's low and high
//! nibbles by its activations of those bytes, broadcast from memory 4 at a time
//! (`vpdpbusd zmm, zmm, m32{1to16}`). A group's 16 row totals come out in one vector's lanes:
//! no horizontal sums, and one conversion, one multiply and one multiply-add per token and
//! group scale all 16 rows.
//!
//! The arithmetic is the row tile's (`row_tile!`): each group's exact integer total (with the
//! `−8` correction) is converted and multiplied by `weight_scale · activation_scale` into the
//! F32 sum of its place in its run of 8 groups (group `g` in place `g mod 8`), and the 8 places
//! are added in `hsum256`'s tree. Every output has the bits of the other kernels, so a token's
//! result does not depend on which kernel, block or call computed it.

use super::*;
use crate::kernels::x86_simd::prefetch_l2;
use std::arch::x86_64::*;

/// Weight rows per slice: one per 32-bit lane of a 512-bit vector.
pub(super) const SLICE_ROWS: usize = 16;

/// Fewest activation rows sharing a matrix for which the kernel pays for its transpose: from
/// 2 an OLMoE-shaped matrix pair from L3 computes 1.4–1.9× faster than on the word-block tile;
/// a single row (decode) ran an OLMoE layer 1.5× slower than the tile.
pub(super) const MIN_TOKENS: usize = 2;

/// Bytes of one step: 4 bytes of each of the slice's rows.
const STEP_BYTES: usize = 64;

/// Steps per chunk: its 16 bytes, 4 at a time.
const STEPS_PER_CHUNK: usize = CHUNK_BYTES / 4;

/// Whether the kernel computes these blocks of activation rows on `isa`: AVX-512 VNNI, groups
/// of 4 or 8 chunks (128 or 256 weights; smaller ones take the AVX2 kernels), the plain activation layout, and at
/// least [`MIN_TOKENS`] rows in all, so that transposing the weights costs less than it saves.
pub(super) fn takes(isa: CpuIsa, shape: DotShape, blocks: &[ActBlock<i8>]) -> bool {
    isa == CpuIsa::Avx512Vnni
        && matches!(shape.chunks_per_group, 4 | 8)
        && blocks.iter().all(|b| !b.words)
        && blocks.iter().map(|b| b.tb).sum::<usize>() >= MIN_TOKENS
}

/// `out[r · n + i] = row_{rows.start + r} · act_i` for the first `rows.len() / SLICE_ROWS`
/// whole slices of rows and the `n` activation rows of `blocks`; returns how many rows it
/// computed (the caller computes the rest).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `blocks` must pass [`takes`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn block_rows(
    shape: DotShape,
    m: &PackedMatrix,
    rows: Range<usize>,
    blocks: &[ActBlock<i8>],
    out: &mut [f32],
) -> usize {
    let n_acts: usize = blocks.iter().map(|b| b.tb).sum();
    let slices = rows.len() / SLICE_ROWS;
    let blocks_of_4 = shape.chunks.div_ceil(WORD_BLOCK_CHUNKS);
    let mut steps = vec![0u8; blocks_of_4 * WORD_BLOCK_CHUNKS * STEPS_PER_CHUNK * STEP_BYTES];
    let mut scales = vec![0f32; shape.groups * SLICE_ROWS];
    for s in 0..slices {
        let first = rows.start + s * SLICE_ROWS;
        transpose_slice(shape, m, first, &mut steps, &mut scales);
        // The next slice's weights (contiguous, as many 64-byte lines as a row has steps)
        // stream into L2 while the first block computes, a line per step: read by the
        // transpose alone, they would stall it on DRAM, and fetched all at once they stall
        // on the core's few outstanding misses.
        let mut ahead = if s + 1 < slices {
            m.weights
                .as_ptr()
                .wrapping_add((first + SLICE_ROWS) * m.row_bytes)
        } else {
            std::ptr::null()
        };
        let mut col = 0;
        for a in blocks {
            let done = &mut out[s * SLICE_ROWS * n_acts..];
            macro_rules! run {
                ($tb:literal) => {{
                    let v = if shape.chunks_per_group == 4 {
                        slice_block::<$tb, 4>(shape, &steps, &scales, a, ahead)
                    } else {
                        slice_block::<$tb, 8>(shape, &steps, &scales, a, ahead)
                    };
                    ahead = std::ptr::null();
                    for (t, v) in v.iter().enumerate() {
                        for (r, &x) in v.iter().enumerate() {
                            done[r * n_acts + col + t] = x;
                        }
                    }
                }};
            }
            match a.tb {
                8 => run!(8),
                7 => run!(7),
                6 => run!(6),
                5 => run!(5),
                4 => run!(4),
                3 => run!(3),
                2 => run!(2),
                1 => run!(1),
                _ => unreachable!("token blocks hold 1 to 8 rows"),
            }
            col += a.tb;
        }
    }
    slices * SLICE_ROWS
}

/// Rows `first..first + 16` of `m` into `steps` (step `c · 4 + j`: bytes `4j..4j + 4` of chunk
/// `c` of each row, row `r` in lane `r`; a short last block of 4 chunks padded with zeros)
/// and their scales into `scales` (group `g`'s F32 scale of row `r` at `g · 16 + r`).
///
/// Per 64 bytes of the 16 rows a 16 × 16 transpose of 32-bit words: two rounds of in-lane
/// unpacks (32- then 64-bit) leave each 128-bit lane holding one word of 4 rows, and two
/// rounds of 128-bit lane shuffles gather the 4 row quartets.
///
/// # Safety
/// The CPU must support AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
unsafe fn transpose_slice(
    shape: DotShape,
    m: &PackedMatrix,
    first: usize,
    steps: &mut [u8],
    scales: &mut [f32],
) {
    let blocks = shape.chunks.div_ceil(WORD_BLOCK_CHUNKS);
    assert!(m.row_bytes >= shape.chunks * CHUNK_BYTES && m.row_scale_bytes >= 2 * shape.groups);
    assert!((first + SLICE_ROWS) * m.row_bytes <= m.weights.len());
    assert!((first + SLICE_ROWS) * m.row_scale_bytes <= m.scales.len());
    assert!(steps.len() >= blocks * SLICE_ROWS * STEP_BYTES);
    assert!(scales.len() >= shape.groups * SLICE_ROWS);
    let w = m.weights.as_ptr().add(first * m.row_bytes);
    for p in 0..blocks {
        let bytes = (shape.chunks - p * WORD_BLOCK_CHUNKS).min(WORD_BLOCK_CHUNKS) * CHUNK_BYTES;
        let mask = if bytes == 64 {
            u64::MAX
        } else {
            (1u64 << bytes) - 1
        };
        let mut v = [_mm512_setzero_si512(); SLICE_ROWS];
        for (r, v) in v.iter_mut().enumerate() {
            // SAFETY: the masked load reads only the row's `bytes` from `64 p` (checked above).
            *v = _mm512_maskz_loadu_epi8(mask, w.add(r * m.row_bytes + p * 64) as *const i8);
        }
        // Pairs of rows: per 128-bit lane, [a₀ b₀ a₁ b₁] and [a₂ b₂ a₃ b₃].
        let mut u = [_mm512_setzero_si512(); SLICE_ROWS];
        for i in 0..SLICE_ROWS / 2 {
            u[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
            u[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
        }
        // Quartets of rows: `q[4i + k]` holds word `k` of each 128-bit lane of rows
        // `4i..4i + 4`.
        let mut q = [_mm512_setzero_si512(); SLICE_ROWS];
        for i in 0..SLICE_ROWS / 4 {
            let (a, b, c, d) = (u[4 * i], u[4 * i + 1], u[4 * i + 2], u[4 * i + 3]);
            q[4 * i] = _mm512_unpacklo_epi64(a, c);
            q[4 * i + 1] = _mm512_unpackhi_epi64(a, c);
            q[4 * i + 2] = _mm512_unpacklo_epi64(b, d);
            q[4 * i + 3] = _mm512_unpackhi_epi64(b, d);
        }
        // Word `4l + k` of every row: lane `l` of the four quartets' `k` vectors.
        let out = steps.as_mut_ptr().add(p * SLICE_ROWS * STEP_BYTES);
        for k in 0..4 {
            let (q0, q1, q2, q3) = (q[k], q[4 + k], q[8 + k], q[12 + k]);
            let s01 = _mm512_shuffle_i32x4::<0x44>(q0, q1);
            let s23 = _mm512_shuffle_i32x4::<0x44>(q2, q3);
            let t01 = _mm512_shuffle_i32x4::<0xEE>(q0, q1);
            let t23 = _mm512_shuffle_i32x4::<0xEE>(q2, q3);
            let words = [
                _mm512_shuffle_i32x4::<0x88>(s01, s23),
                _mm512_shuffle_i32x4::<0xDD>(s01, s23),
                _mm512_shuffle_i32x4::<0x88>(t01, t23),
                _mm512_shuffle_i32x4::<0xDD>(t01, t23),
            ];
            for (l, v) in words.iter().enumerate() {
                _mm512_storeu_si512(out.add((4 * l + k) * STEP_BYTES) as *mut _, *v);
            }
        }
    }
    let mut bits = [0u16; SLICE_ROWS];
    let s = m.scales.as_ptr().add(first * m.row_scale_bytes);
    for g in 0..shape.groups {
        for (r, b) in bits.iter_mut().enumerate() {
            let at = s.add(r * m.row_scale_bytes + 2 * g);
            *b = u16::from_le_bytes([*at, *at.add(1)]);
        }
        let v = _mm512_cvtph_ps(_mm256_loadu_si256(bits.as_ptr() as *const __m256i));
        _mm512_storeu_ps(scales.as_mut_ptr().add(g * SLICE_ROWS), v);
    }
}

/// The 16 rows of a transposed slice times the `TB` activation rows of `acts`, for groups of
/// `CPG` chunks: `out[t][r]`. Unless `ahead` is null, prefetches the line at `ahead + 64 i` at
/// step `i` (never faults).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VNNI; `steps` and `scales` must hold a slice of
/// `shape`'s rows ([`transpose_slice`]) and `acts` must be in the plain layout.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
unsafe fn slice_block<const TB: usize, const CPG: usize>(
    shape: DotShape,
    steps: &[u8],
    scales: &[f32],
    acts: &ActBlock<i8>,
    ahead: *const u8,
) -> [[f32; SLICE_ROWS]; TB] {
    shape.check_acts::<i8, TB>(acts);
    assert!(!acts.words && shape.chunks_per_group == CPG);
    assert!(steps.len() >= shape.chunks * STEPS_PER_CHUNK * STEP_BYTES);
    assert!(scales.len() >= shape.groups * SLICE_ROWS);
    let (wp, xp) = (steps.as_ptr(), acts.q.as_ptr());
    // `places[t][j]`: token `t`'s sums of the groups in place `j` of their runs.
    let mut places = [[_mm512_setzero_ps(); 8]; TB];
    for gi in 0..shape.groups {
        let c0 = gi * CPG;
        let n = (shape.chunks - c0).min(CPG);
        let corr = acts.corr.as_ptr().add(gi * MAX_TOKEN_BLOCK);
        // SAFETY: the checks above cover the group's chunks in `steps` and in `acts.q`, and
        // `acts.corr` / `acts.scale` hold `MAX_TOKEN_BLOCK` lanes per group.
        let totals = if n == CPG {
            group_totals::<TB>(wp, xp, c0, CPG, corr, ahead)
        } else {
            group_totals::<TB>(wp, xp, c0, n, corr, ahead)
        };
        let ws = _mm512_loadu_ps(scales.as_ptr().add(gi * SLICE_ROWS));
        let j = gi % 8;
        for (t, total) in totals.iter().enumerate() {
            let f = _mm512_mul_ps(ws, _mm512_set1_ps(acts.scale[gi * MAX_TOKEN_BLOCK + t]));
            places[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*total), f, places[t][j]);
        }
    }
    let mut out = [[0f32; SLICE_ROWS]; TB];
    for (o, p) in out.iter_mut().zip(&places) {
        // `hsum256`'s tree over the places: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
        let even = _mm512_add_ps(_mm512_add_ps(p[0], p[4]), _mm512_add_ps(p[2], p[6]));
        let odd = _mm512_add_ps(_mm512_add_ps(p[1], p[5]), _mm512_add_ps(p[3], p[7]));
        _mm512_storeu_ps(o.as_mut_ptr(), _mm512_add_ps(even, odd));
    }
    out
}

/// The exact totals of chunks `c0..c0 + n` (one group) of the 16 rows for each of the `TB`
/// activation rows, the `−8` corrections at `corr[t]` included: two `vpdpbusd` chains per
/// token (low and high nibbles), which keeps 16 sums in flight at `TB = 8`.
///
/// # Safety
/// As [`slice_block`]; the chunks must lie inside `wp`'s steps and `xp`'s activations.
#[inline(always)]
unsafe fn group_totals<const TB: usize>(
    wp: *const u8,
    xp: *const i8,
    c0: usize,
    n: usize,
    corr: *const i32,
    ahead: *const u8,
) -> [__m512i; TB] {
    let nibble = _mm512_set1_epi8(0x0f);
    let mut lo = [_mm512_setzero_si512(); TB];
    let mut hi = [_mm512_setzero_si512(); TB];
    for (t, l) in lo.iter_mut().enumerate() {
        *l = _mm512_set1_epi32(*corr.add(t));
    }
    for c in c0..c0 + n {
        for j in 0..STEPS_PER_CHUNK {
            let step = c * STEPS_PER_CHUNK + j;
            if !ahead.is_null() {
                prefetch_l2(ahead.wrapping_add(step * STEP_BYTES));
            }
            let v = _mm512_loadu_si512(wp.add(step * STEP_BYTES) as *const _);
            let wl = _mm512_and_si512(v, nibble);
            let wh = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
            for t in 0..TB {
                let x = xp.add((c * TB + t) * CHUNK_WEIGHTS + 4 * j);
                let xl = _mm512_set1_epi32((x as *const i32).read_unaligned());
                let xh = _mm512_set1_epi32((x.add(CHUNK_BYTES) as *const i32).read_unaligned());
                lo[t] = _mm512_dpbusd_epi32(lo[t], wl, xl);
                hi[t] = _mm512_dpbusd_epi32(hi[t], wh, xh);
            }
        }
    }
    let mut totals = [_mm512_setzero_si512(); TB];
    for t in 0..TB {
        totals[t] = _mm512_add_epi32(lo[t], hi[t]);
    }
    totals
}
