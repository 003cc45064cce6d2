//! The x86 kernels of [`super::attend`] for one task: every query that reads one kv head, in
//! two streaming passes over that head, written once over the vector width ([`Lanes`]: AVX2 +
//! FMA's 8 lanes, AVX-512's 16) and compiled for each.
//!
//! 1. **Scores.** Blocks of [`SCORE_BLOCK`] key rows; for each query, one accumulator per row
//!    (eight independent FMA chains), the eight reduced together into one vector of scores.
//!    Each block is read from memory once and then from L1 by the other queries.
//! 2. **Softmax** per query, max-subtracted, with a vectorised `exp`.
//! 3. **Values.** Blocks of [`VALUE_BLOCK`] value rows; for each query and each slice of
//!    [`VALUE_CHUNKS`] chunks of the head dim, the weighted sum kept in eight registers over
//!    the block.
//!
//! Rows are widened to F32 one chunk of two vectors at a time, in the storage's lane order
//! ([`KvElem::load_chunk`]); the queries are permuted into that order once, and the outputs
//! back.

use super::{prefetch_rows, GroupQueries, KvElem};
use crate::kernels::x86_simd::{prefetch_l2, STREAM_AHEAD_BYTES};
use std::arch::x86_64::*;

/// Key rows per block of the score pass: one accumulator each, reduced together.
const SCORE_BLOCK: usize = 8;

/// Value rows per block of the value pass: they stay in L1 while every query and every slice
/// of the head dim reads them.
const VALUE_BLOCK: usize = 32;

/// Chunks of the head dim per slice of the value pass (eight accumulators).
const VALUE_CHUNKS: usize = 4;

/// The head dims [`attend_group_avx2`] takes: multiples of its chunk of 16 elements.
pub(super) fn avx2_fits(d: usize) -> bool {
    d.is_multiple_of(2 * <__m256 as Lanes>::N)
}

/// The head dims [`attend_group_avx512`] takes: multiples of its chunk of 32 elements.
pub(super) fn avx512_fits(d: usize) -> bool {
    d.is_multiple_of(2 * <__m512 as Lanes>::N)
}

/// The attention of `g`'s queries into `out` (`[queries, d]`), 8 lanes wide.
///
/// # Safety
/// The CPU must support AVX2 and FMA; [`avx2_fits`]`(g.d)`; every query `g.d` long and every
/// `visible` at most the rows of `g.keys` and `g.values`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend_group_avx2<E: KvElem>(g: &GroupQueries<E>, out: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe { attend_group::<E, __m256>(g, out) }
}

/// [`attend_group_avx2`] 16 lanes wide.
///
/// # Safety
/// The CPU must support AVX-512 F and BW, AVX2 and FMA; [`avx512_fits`]`(g.d)`; as
/// [`attend_group_avx2`] otherwise.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub(super) unsafe fn attend_group_avx512<E: KvElem>(g: &GroupQueries<E>, out: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe { attend_group::<E, __m512>(g, out) }
}

/// An F32 vector of one x86 width and the operations of the kernel on it. Every method is
/// `unsafe` (the CPU must support the width) and inlined into the entry point compiled for it;
/// so is every function that calls one, none of them through a closure (which would be
/// compiled apart, without the entry point's target features).
///
/// # Safety
/// Every method requires a CPU with the width's instruction set (AVX2 + FMA for `__m256`,
/// AVX-512 F for `__m512`); `load` and `store` need `N` F32 values readable or writable at `p`,
/// `widen_bf16` 2·`N` BF16 values readable at `p`, each within one allocation.
pub(super) trait Lanes: Copy {
    /// F32 lanes.
    const N: usize;
    /// Whether the score pass takes queries in pairs ([`scores8_pair`]: registers enough).
    const PAIRS: bool;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn sub(self, b: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    /// The larger per lane, `b` where either is NaN (`vmaxps`).
    unsafe fn max(self, b: Self) -> Self;
    /// `self · b + c`.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    /// `c − self · b`.
    unsafe fn neg_mul_add(self, b: Self, c: Self) -> Self;
    unsafe fn round(self) -> Self;
    /// `2ⁿ` for the integral `n` in `self` (−127 < n < 128).
    unsafe fn pow2(self) -> Self;
    /// The lanes folded to 8 (summed pairwise across halves).
    unsafe fn fold8(self) -> __m256;
    /// The 2·N BF16 values at `p` widened, the even elements first, then the odd.
    unsafe fn widen_bf16(p: *const u16) -> (Self, Self);
}

impl Lanes for __m256 {
    const N: usize = 8;
    const PAIRS: bool = false;
    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm256_storeu_ps(p, self) }
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        unsafe { _mm256_add_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        unsafe { _mm256_sub_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        unsafe { _mm256_mul_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        unsafe { _mm256_max_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        unsafe { _mm256_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn neg_mul_add(self, b: Self, c: Self) -> Self {
        unsafe { _mm256_fnmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn round(self) -> Self {
        unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self) }
    }
    #[inline(always)]
    unsafe fn pow2(self) -> Self {
        unsafe {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(self), _mm256_set1_epi32(127));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased))
        }
    }
    #[inline(always)]
    unsafe fn fold8(self) -> __m256 {
        self
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> (Self, Self) {
        // Eight 32-bit words of two BF16 each: the low halves (even elements) widen by a
        // shift, the high halves (odd ones) by masking off the low bits.
        unsafe {
            let w = _mm256_loadu_si256(p as *const __m256i);
            let even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
            let odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(-65536)));
            (even, odd)
        }
    }
}

impl Lanes for __m512 {
    const N: usize = 16;
    const PAIRS: bool = true;
    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm512_storeu_ps(p, self) }
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        unsafe { _mm512_add_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        unsafe { _mm512_sub_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        unsafe { _mm512_mul_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        unsafe { _mm512_max_ps(self, b) }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        unsafe { _mm512_fmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn neg_mul_add(self, b: Self, c: Self) -> Self {
        unsafe { _mm512_fnmadd_ps(self, b, c) }
    }
    #[inline(always)]
    unsafe fn round(self) -> Self {
        unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(self) }
    }
    #[inline(always)]
    unsafe fn pow2(self) -> Self {
        unsafe {
            let biased = _mm512_add_epi32(_mm512_cvtps_epi32(self), _mm512_set1_epi32(127));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased))
        }
    }
    #[inline(always)]
    unsafe fn fold8(self) -> __m256 {
        unsafe {
            let halves = _mm512_castps_pd(self);
            _mm256_add_ps(
                _mm512_castps512_ps256(self),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(halves)),
            )
        }
    }
    #[inline(always)]
    unsafe fn widen_bf16(p: *const u16) -> (Self, Self) {
        // As for 8 lanes, over sixteen words.
        unsafe {
            let w = _mm512_loadu_si512(p as *const __m512i);
            let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
            let odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536)));
            (even, odd)
        }
    }
}

/// [`attend_group_avx2`] at the width `V`.
///
/// # Safety
/// As the entry points, for the width `V`.
#[inline(always)]
unsafe fn attend_group<E: KvElem, V: Lanes>(g: &GroupQueries<E>, out: &mut [f32]) {
    let (d, n, chunk) = (g.d, g.q.len(), 2 * V::N);
    let span = g.visible.iter().copied().max().unwrap_or(0);
    assert!(d.is_multiple_of(chunk) && span * d <= g.keys.len().min(g.values.len()));
    assert_eq!(out.len(), n * d);
    // The queries in lane order, with the scale folded in.
    let mut queries = vec![0f32; n * d];
    for (q, lanes) in g.q.iter().zip(queries.chunks_exact_mut(d)) {
        for (c, part) in lanes.chunks_exact_mut(chunk).enumerate() {
            for (l, x) in part.iter_mut().enumerate() {
                *x = q[c * chunk + E::lane_element(l, V::N)] * g.scale;
            }
        }
    }
    let mut scores = vec![0f32; n * span];
    let (keys, values) = (g.keys.as_ptr(), g.values.as_ptr());
    prefetch_start(keys, span * d);
    for start in (0..span).step_by(SCORE_BLOCK) {
        let end = (start + SCORE_BLOCK).min(span);
        prefetch_rows(&g.keys[start * d..end * d]);
        // SAFETY (all below): rows below `span` lie inside the keys and values (asserted).
        let rows = unsafe { keys.add(start * d) };
        let full = |i: usize| start + SCORE_BLOCK <= g.visible[i];
        let mut i = 0;
        while i < n {
            let q = queries[i * d..].as_ptr();
            if V::PAIRS && full(i) && i + 1 < n && full(i + 1) {
                unsafe {
                    let [b0, b1] = scores8_pair::<E, V>(q, q.add(d), rows, d);
                    _mm256_storeu_ps(scores[i * span + start..].as_mut_ptr(), b0);
                    _mm256_storeu_ps(scores[(i + 1) * span + start..].as_mut_ptr(), b1);
                }
                i += 2;
                continue;
            }
            let row = &mut scores[i * span..(i + 1) * span];
            if full(i) {
                unsafe {
                    let block = scores8::<E, V>(q, rows, d);
                    _mm256_storeu_ps(row[start..start + SCORE_BLOCK].as_mut_ptr(), block);
                }
            } else {
                for (j, score) in row.iter_mut().enumerate().take(g.visible[i]).skip(start) {
                    *score = unsafe { score1::<E, V>(q, keys.add(j * d), d) };
                }
            }
            i += 1;
        }
    }
    // The values' first lines load while the softmax computes.
    prefetch_start(values, span * d);
    let mut sums = vec![0f32; n];
    for ((sum, &visible), row) in sums
        .iter_mut()
        .zip(&g.visible)
        .zip(scores.chunks_exact_mut(span.max(1)))
    {
        *sum = unsafe { softmax_weights::<V>(&mut row[..visible]) };
    }
    let mut acc = vec![0f32; n * d];
    let chunks = d / chunk;
    for start in (0..span).step_by(VALUE_BLOCK) {
        let end = (start + VALUE_BLOCK).min(span);
        prefetch_rows(&g.values[start * d..end * d]);
        for (i, &visible) in g.visible.iter().enumerate() {
            let stop = end.min(visible);
            if start >= stop {
                continue;
            }
            let weights = &scores[i * span + start..i * span + stop];
            let sum = &mut acc[i * d..(i + 1) * d];
            let rows = unsafe { values.add(start * d) };
            for c in (0..chunks).step_by(VALUE_CHUNKS) {
                let (v, a) = (unsafe { rows.add(c * chunk) }, &mut sum[c * chunk..]);
                unsafe {
                    match chunks - c {
                        1 => weigh::<E, V, 1>(weights, v, d, a),
                        2 => weigh::<E, V, 2>(weights, v, d, a),
                        3 => weigh::<E, V, 3>(weights, v, d, a),
                        _ => weigh::<E, V, VALUE_CHUNKS>(weights, v, d, a),
                    }
                }
            }
        }
    }
    for ((o, a), sum) in out.chunks_exact_mut(d).zip(acc.chunks_exact(d)).zip(sums) {
        let inv = 1.0 / sum;
        for (c, part) in a.chunks_exact(chunk).enumerate() {
            for (l, &x) in part.iter().enumerate() {
                o[c * chunk + E::lane_element(l, V::N)] = x * inv;
            }
        }
    }
}

/// Prefetches into L2 the first [`STREAM_AHEAD_BYTES`] of the `len` elements at `p`: the part
/// of a stream that [`prefetch_rows`] does not cover.
#[inline(always)]
fn prefetch_start<E>(p: *const E, len: usize) {
    let p = p as *const u8;
    for off in (0..(len * size_of::<E>()).min(STREAM_AHEAD_BYTES)).step_by(64) {
        prefetch_l2(p.wrapping_add(off));
    }
}

/// The dot products of the `d` lane-ordered query values at `q` with the 8 key rows at `k`.
///
/// # Safety
/// The width `V`; `d` a multiple of its chunk; `q` holds `d` values and `k` 8 rows of `d`.
#[inline(always)]
unsafe fn scores8<E: KvElem, V: Lanes>(q: *const f32, k: *const E, d: usize) -> __m256 {
    unsafe {
        let mut acc = [V::zero(); SCORE_BLOCK];
        for c in (0..d).step_by(2 * V::N) {
            let (qa, qb) = (V::load(q.add(c)), V::load(q.add(c + V::N)));
            for (r, a) in acc.iter_mut().enumerate() {
                let (ka, kb) = E::load_chunk::<V>(k.add(r * d + c));
                *a = qb.mul_add(kb, qa.mul_add(ka, *a));
            }
        }
        block_scores(acc)
    }
}

/// [`scores8`] for the two queries at `q0` and `q1` at once: each key chunk is widened once
/// for both (16 accumulators: for the 32 registers of AVX-512).
///
/// # Safety
/// As [`scores8`], for both queries.
#[inline(always)]
unsafe fn scores8_pair<E: KvElem, V: Lanes>(
    q0: *const f32,
    q1: *const f32,
    k: *const E,
    d: usize,
) -> [__m256; 2] {
    unsafe {
        let mut acc = [[V::zero(); SCORE_BLOCK]; 2];
        for c in (0..d).step_by(2 * V::N) {
            let (a0, b0) = (V::load(q0.add(c)), V::load(q0.add(c + V::N)));
            let (a1, b1) = (V::load(q1.add(c)), V::load(q1.add(c + V::N)));
            let [acc0, acc1] = &mut acc;
            for (r, (x, y)) in acc0.iter_mut().zip(acc1.iter_mut()).enumerate() {
                let (ka, kb) = E::load_chunk::<V>(k.add(r * d + c));
                *x = b0.mul_add(kb, a0.mul_add(ka, *x));
                *y = b1.mul_add(kb, a1.mul_add(ka, *y));
            }
        }
        [block_scores(acc[0]), block_scores(acc[1])]
    }
}

/// The scores of a block of key rows from their accumulators: lane `r` the total of `acc[r]`.
///
/// # Safety
/// The width `V`.
#[inline(always)]
unsafe fn block_scores<V: Lanes>(acc: [V; SCORE_BLOCK]) -> __m256 {
    // A loop, not `acc.map(…)`: a closure would be compiled without the entry point's target
    // features, and the intrinsics in it called instead of inlined.
    let mut folded = [unsafe { _mm256_setzero_ps() }; SCORE_BLOCK];
    for (f, a) in folded.iter_mut().zip(acc) {
        *f = unsafe { a.fold8() };
    }
    unsafe { sum_each(folded) }
}

/// The dot product of the `d` lane-ordered query values at `q` with the key row at `k`.
///
/// # Safety
/// As [`scores8`], for one row.
#[inline(always)]
unsafe fn score1<E: KvElem, V: Lanes>(q: *const f32, k: *const E, d: usize) -> f32 {
    unsafe {
        let (mut a, mut b) = (V::zero(), V::zero());
        for c in (0..d).step_by(2 * V::N) {
            let (ka, kb) = E::load_chunk::<V>(k.add(c));
            a = V::load(q.add(c)).mul_add(ka, a);
            b = V::load(q.add(c + V::N)).mul_add(kb, b);
        }
        crate::kernels::x86_simd::hsum256(a.add(b).fold8())
    }
}

/// Lane `r` of the result is the sum of the eight lanes of `v[r]`.
///
/// # Safety
/// AVX2.
#[inline(always)]
unsafe fn sum_each(v: [__m256; 8]) -> __m256 {
    // Pairwise sums within 128-bit halves, twice: lane r of each half then holds half of row
    // r's (r < 4) or row r + 4's total; the halves are then added across.
    unsafe {
        let (p0, p1) = (_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        let (p2, p3) = (_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        let (q0, q1) = (_mm256_hadd_ps(p0, p1), _mm256_hadd_ps(p2, p3));
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(q0, q1),
            _mm256_permute2f128_ps::<0x31>(q0, q1),
        )
    }
}

/// Turns `scores` into `exp(score − max)` in place and returns their sum.
///
/// # Safety
/// The width `V`.
#[inline(always)]
unsafe fn softmax_weights<V: Lanes>(scores: &mut [f32]) -> f32 {
    let (body, tail) = scores.split_at_mut(scores.len() / V::N * V::N);
    let mut lanes = [0f32; 16];
    let lanes = &mut lanes[..V::N];
    unsafe {
        let mut max = V::splat(f32::NEG_INFINITY);
        for x in body.chunks_exact(V::N) {
            max = max.max(V::load(x.as_ptr()));
        }
        max.store(lanes.as_mut_ptr());
        let max = lanes
            .iter()
            .chain(tail.iter())
            .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let max_v = V::splat(max);
        let mut sum = V::zero();
        for x in body.chunks_exact_mut(V::N) {
            let e = exp(V::load(x.as_ptr()).sub(max_v));
            e.store(x.as_mut_ptr());
            sum = sum.add(e);
        }
        // The tail padded with −∞ (weight 0).
        lanes.fill(f32::NEG_INFINITY);
        lanes[..tail.len()].copy_from_slice(tail);
        let e = exp(V::load(lanes.as_ptr()).sub(max_v));
        sum = sum.add(e);
        e.store(lanes.as_mut_ptr());
        tail.copy_from_slice(&lanes[..tail.len()]);
        crate::kernels::x86_simd::hsum256(sum.fold8())
    }
}

/// `exp(x)` for `x ≤ 0` to about 2 ulp (below −87 it returns `exp(−87)` ≈ 1.6e−38, nothing
/// beside a softmax's largest weight of 1; NaN stays NaN): `x = n·ln 2 + r` with
/// `|r| ≤ ln 2 / 2`, a degree-7 polynomial for `exp(r)` (Cephes' `expf` coefficients), and
/// `2ⁿ` built in the exponent bits.
///
/// # Safety
/// The width `V`.
#[inline(always)]
unsafe fn exp<V: Lanes>(x: V) -> V {
    unsafe {
        // `max` returns its second operand when either is NaN: a NaN score (a non-finite
        // query or key, or ∞ − ∞ against an infinite maximum) must reach the output.
        let x = V::splat(-87.0).max(x);
        let n = x.mul(V::splat(std::f32::consts::LOG2_E)).round();
        // ln 2 split in two so that n · the first part is exact.
        let r = n.neg_mul_add(V::splat(0.693_359_4), x);
        let r = n.neg_mul_add(V::splat(-2.121_944_4e-4), r);
        let mut p = V::splat(1.987_569_2e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = p.mul_add(r, V::splat(c));
        }
        p.mul(r).mul_add(r, r.add(V::splat(1.0))).mul(n.pow2())
    }
}

/// Adds `Σ_r weights[r] · row r` to the `C` lane-ordered chunks of sums at `acc`, for the `C`
/// chunks that start at `v` in each of `weights.len()` rows of stride `d`.
///
/// # Safety
/// The width `V`; the rows hold `C` chunks from `v`, and `acc` as many values.
#[inline(always)]
unsafe fn weigh<E: KvElem, V: Lanes, const C: usize>(
    weights: &[f32],
    v: *const E,
    d: usize,
    acc: &mut [f32],
) {
    let (n, acc) = (V::N, &mut acc[..2 * V::N * C]);
    unsafe {
        let mut a = [[V::zero(); 2]; C];
        for (c, pair) in a.iter_mut().enumerate() {
            *pair = [
                V::load(acc[2 * c * n..].as_ptr()),
                V::load(acc[(2 * c + 1) * n..].as_ptr()),
            ];
        }
        for (r, &w) in weights.iter().enumerate() {
            let w = V::splat(w);
            for (c, pair) in a.iter_mut().enumerate() {
                let (x, y) = E::load_chunk::<V>(v.add(r * d + 2 * c * n));
                *pair = [w.mul_add(x, pair[0]), w.mul_add(y, pair[1])];
            }
        }
        for (c, pair) in a.iter().enumerate() {
            pair[0].store(acc[2 * c * n..].as_mut_ptr());
            pair[1].store(acc[(2 * c + 1) * n..].as_mut_ptr());
        }
    }
}
