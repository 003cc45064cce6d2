//! The AVX2 + FMA kernel of [`super::attend`] for one task: every query that reads one kv
//! head, in two streaming passes over that head.
//!
//! 1. **Scores.** Blocks of [`SCORE_BLOCK`] key rows; for each query, one accumulator per row
//!    (eight independent FMA chains), the eight reduced together into one vector of scores.
//!    Each block is read from memory once and then from L1 by the other queries.
//! 2. **Softmax** per query, max-subtracted, with a vectorised `exp`.
//! 3. **Values.** Blocks of [`VALUE_BLOCK`] value rows; for each query and each slice of
//!    [`VALUE_CHUNKS`] × 16 dims, the weighted sum kept in eight registers over the block.
//!
//! Rows are widened to F32 16 elements at a time in the storage's lane order
//! ([`KvElem::load16`]); the queries are permuted into that order once, and the outputs back.

use super::{GroupQueries, KvElem};
use crate::kernels::x86_simd::{prefetch_l2, STREAM_AHEAD_BYTES};
use std::arch::x86_64::*;

/// Key rows per block of the score pass: one accumulator each, reduced together.
const SCORE_BLOCK: usize = 8;

/// Value rows per block of the value pass: they stay in L1 while every query and every slice
/// of the head dim reads them.
const VALUE_BLOCK: usize = 32;

/// 16-element chunks of the head dim per slice of the value pass (eight accumulators).
const VALUE_CHUNKS: usize = 4;

/// The attention of `g`'s queries into `out` (`[queries, d]`).
///
/// # Safety
/// The CPU must support AVX2 and FMA; `g.d` must be a multiple of 16, every query `d` long
/// and every `visible` at most the rows of `g.keys` and `g.values`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend_group<E: KvElem>(g: &GroupQueries<E>, out: &mut [f32]) {
    let (d, n) = (g.d, g.q.len());
    let span = g.visible.iter().copied().max().unwrap_or(0);
    assert!(d.is_multiple_of(16) && span * d <= g.keys.len().min(g.values.len()));
    assert_eq!(out.len(), n * d);
    // The queries in lane order, with the scale folded in.
    let mut queries = vec![0f32; n * d];
    for (q, lanes) in g.q.iter().zip(queries.chunks_exact_mut(d)) {
        for (c, chunk) in lanes.chunks_exact_mut(16).enumerate() {
            for (l, x) in chunk.iter_mut().enumerate() {
                *x = q[c * 16 + E::lane_element(l)] * g.scale;
            }
        }
    }
    let mut scores = vec![0f32; n * span];
    let keys = g.keys.as_ptr();
    for start in (0..span).step_by(SCORE_BLOCK) {
        let end = (start + SCORE_BLOCK).min(span);
        // SAFETY (all below): rows below `span` lie inside the keys (asserted).
        unsafe { prefetch_ahead(keys.add(start * d), (end - start) * d) };
        for (i, &visible) in g.visible.iter().enumerate() {
            let q = queries[i * d..].as_ptr();
            let row = &mut scores[i * span..(i + 1) * span];
            if start + SCORE_BLOCK <= visible {
                let block = unsafe { scores8(q, keys.add(start * d), d) };
                unsafe { _mm256_storeu_ps(row[start..start + SCORE_BLOCK].as_mut_ptr(), block) };
            } else {
                for (j, score) in row.iter_mut().enumerate().take(visible).skip(start) {
                    *score = unsafe { score1(q, keys.add(j * d), d) };
                }
            }
        }
    }
    let sums: Vec<f32> = g
        .visible
        .iter()
        .zip(scores.chunks_exact_mut(span.max(1)))
        .map(|(&visible, row)| softmax_weights(&mut row[..visible]))
        .collect();
    let mut acc = vec![0f32; n * d];
    let values = g.values.as_ptr();
    for start in (0..span).step_by(VALUE_BLOCK) {
        let end = (start + VALUE_BLOCK).min(span);
        unsafe { prefetch_ahead(values.add(start * d), (end - start) * d) };
        for (i, &visible) in g.visible.iter().enumerate() {
            let stop = end.min(visible);
            if start >= stop {
                continue;
            }
            let weights = &scores[i * span + start..i * span + stop];
            let sum = &mut acc[i * d..(i + 1) * d];
            let rows = unsafe { values.add(start * d) };
            let chunks = d / 16;
            for c in (0..chunks).step_by(VALUE_CHUNKS) {
                let (v, a) = (unsafe { rows.add(c * 16) }, &mut sum[c * 16..]);
                unsafe {
                    match chunks - c {
                        1 => weigh::<E, 1>(weights, v, d, a),
                        2 => weigh::<E, 2>(weights, v, d, a),
                        3 => weigh::<E, 3>(weights, v, d, a),
                        _ => weigh::<E, VALUE_CHUNKS>(weights, v, d, a),
                    }
                }
            }
        }
    }
    for ((o, a), sum) in out.chunks_exact_mut(d).zip(acc.chunks_exact(d)).zip(sums) {
        let inv = 1.0 / sum;
        for (c, chunk) in a.chunks_exact(16).enumerate() {
            for (l, &x) in chunk.iter().enumerate() {
                o[c * 16 + E::lane_element(l)] = x * inv;
            }
        }
    }
}

/// Prefetches into L2 the `len` elements that lie [`STREAM_AHEAD_BYTES`] past `p`, one
/// prefetch per 64 bytes (a prefetch never faults, so they may lie past the end).
#[inline(always)]
fn prefetch_ahead<E>(p: *const E, len: usize) {
    let p = p as *const u8;
    for off in (0..len * size_of::<E>()).step_by(64) {
        prefetch_l2(p.wrapping_add(STREAM_AHEAD_BYTES + off));
    }
}

/// The dot products of the `d` lane-ordered query values at `q` with the 8 key rows at `k`.
///
/// # Safety
/// AVX2 + FMA; `d` a multiple of 16; `q` holds `d` values and `k` 8 rows of `d`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores8<E: KvElem>(q: *const f32, k: *const E, d: usize) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); SCORE_BLOCK];
    for c in (0..d).step_by(16) {
        // SAFETY: inside `q` and the rows (the contract).
        let (qa, qb) = unsafe { (_mm256_loadu_ps(q.add(c)), _mm256_loadu_ps(q.add(c + 8))) };
        for (r, a) in acc.iter_mut().enumerate() {
            let (ka, kb) = unsafe { E::load16(k.add(r * d + c)) };
            *a = _mm256_fmadd_ps(qb, kb, _mm256_fmadd_ps(qa, ka, *a));
        }
    }
    sum_each(acc)
}

/// The dot product of the `d` lane-ordered query values at `q` with the key row at `k`.
///
/// # Safety
/// As [`scores8`], for one row.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn score1<E: KvElem>(q: *const f32, k: *const E, d: usize) -> f32 {
    let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in (0..d).step_by(16) {
        // SAFETY: inside `q` and the row (the contract).
        unsafe {
            let (ka, kb) = E::load16(k.add(c));
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c)), ka, a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(c + 8)), kb, b);
        }
    }
    crate::kernels::x86_simd::hsum256(_mm256_add_ps(a, b))
}

/// Lane `r` of the result is the sum of the eight lanes of `v[r]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn sum_each(v: [__m256; 8]) -> __m256 {
    // Pairwise sums within 128-bit halves, twice: lane r of each half then holds half of row
    // r's (r < 4) or row r + 4's total; the halves are then added across.
    let (p0, p1) = (_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let (p2, p3) = (_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    let (q0, q1) = (_mm256_hadd_ps(p0, p1), _mm256_hadd_ps(p2, p3));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(q0, q1),
        _mm256_permute2f128_ps::<0x31>(q0, q1),
    )
}

/// Turns `scores` into `exp(score − max)` in place and returns their sum.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn softmax_weights(scores: &mut [f32]) -> f32 {
    let (body, tail) = scores.split_at_mut(scores.len() / 8 * 8);
    let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
    for x in body.chunks_exact(8) {
        // SAFETY: 8 values.
        max = _mm256_max_ps(max, unsafe { _mm256_loadu_ps(x.as_ptr()) });
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 values.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), max) };
    let max = lanes
        .iter()
        .chain(tail.iter())
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let max_v = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    for x in body.chunks_exact_mut(8) {
        // SAFETY: 8 values.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr()), max_v));
            _mm256_storeu_ps(x.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
    }
    let mut sum = crate::kernels::x86_simd::hsum256(sum);
    if !tail.is_empty() {
        // The tail padded with −∞ (weight 0).
        let mut padded = [f32::NEG_INFINITY; 8];
        padded[..tail.len()].copy_from_slice(tail);
        // SAFETY: 8 values.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(padded.as_ptr()), max_v));
            _mm256_storeu_ps(padded.as_mut_ptr(), e);
        }
        tail.copy_from_slice(&padded[..tail.len()]);
        sum += tail.iter().sum::<f32>();
    }
    sum
}

/// `exp(x)` for `x ≤ 0` to about 2 ulp (below −87 it returns `exp(−87)` ≈ 1.6e−38, nothing
/// beside a softmax's largest weight of 1): `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`, a degree-7
/// polynomial for `exp(r)` (Cephes' `expf` coefficients), and `2ⁿ` built in the exponent bits.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln 2 split in two so that n · the first part is exact.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_2e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let e = _mm256_fmadd_ps(
        _mm256_mul_ps(p, r),
        r,
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(e, _mm256_castsi256_ps(two_n))
}

/// Adds `Σ_r weights[r] · row r` to the `16·C` lane-ordered sums at `acc`, for the `C` chunks
/// that start at `v` in each of `weights.len()` rows of stride `d`.
///
/// # Safety
/// AVX2 + FMA; the rows hold `16·C` elements from `v`, and `acc` as many values.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn weigh<E: KvElem, const C: usize>(
    weights: &[f32],
    v: *const E,
    d: usize,
    acc: &mut [f32],
) {
    let acc = &mut acc[..16 * C];
    let mut a = [[_mm256_setzero_ps(); 2]; C];
    for (c, pair) in a.iter_mut().enumerate() {
        // SAFETY: inside `acc`.
        unsafe {
            pair[0] = _mm256_loadu_ps(acc[c * 16..].as_ptr());
            pair[1] = _mm256_loadu_ps(acc[c * 16 + 8..].as_ptr());
        }
    }
    for (r, &w) in weights.iter().enumerate() {
        let w = _mm256_set1_ps(w);
        for (c, pair) in a.iter_mut().enumerate() {
            // SAFETY: inside row r (the contract).
            let (x, y) = unsafe { E::load16(v.add(r * d + c * 16)) };
            pair[0] = _mm256_fmadd_ps(w, x, pair[0]);
            pair[1] = _mm256_fmadd_ps(w, y, pair[1]);
        }
    }
    for (c, pair) in a.iter().enumerate() {
        // SAFETY: inside `acc`.
        unsafe {
            _mm256_storeu_ps(acc[c * 16..].as_mut_ptr(), pair[0]);
            _mm256_storeu_ps(acc[c * 16 + 8..].as_mut_ptr(), pair[1]);
        }
    }
}
