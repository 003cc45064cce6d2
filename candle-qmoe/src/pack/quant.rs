//! Symmetric INT4 quantization with FP16 group scales.
//!
//! Each group of `group_size` consecutive weights of a row gets one FP16 scale `s`; a weight `w`
//! becomes `q = clamp(round(w / s), -8, 7)` and dequantizes to `s · q`. Every candidate scale must
//! keep every weight of its group within half a step (`|w − s·q| ≤ s/2`), so no weight is ever
//! clipped by more than rounding would.
//!
//! [`ScaleSearch::Rtn`] is the baseline `s = absmax / 7`. [`ScaleSearch::Mse`] (the default) also
//! tries a small grid of larger divisors (using the `-8` level when the extreme weight is
//! negative) and a least-squares refit of each, keeping the admissible scale with the smallest
//! squared error; since the baseline is among the candidates it is never worse.

use half::f16;
use rayon::prelude::*;

use super::layout::{nibble_position, QMatrixLayout};
use crate::QmoeError;

/// How group scales are chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScaleSearch {
    /// Round-to-nearest with `absmax / 7`.
    Rtn,
    /// Minimum squared error over a small grid of scales and their least-squares refits.
    #[default]
    Mse,
}

/// Extremes of one group, used to check a scale's admissibility in O(1).
#[derive(Clone, Copy)]
struct GroupStats {
    min: f32,
    max: f32,
}

impl GroupStats {
    /// The least and largest of `values` and 0, in [`LANES`] running extremes (so the loop
    /// vectorizes; minimum and maximum are exact, so the order does not matter).
    #[inline(always)]
    fn of(values: &[f32]) -> Self {
        let (mut lo, mut hi) = ([0f32; LANES], [0f32; LANES]);
        let chunks = values.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            let c: &[f32; LANES] = c.try_into().expect("chunks of LANES values");
            for lane in 0..LANES {
                lo[lane] = lo[lane].min(c[lane]);
                hi[lane] = hi[lane].max(c[lane]);
            }
        }
        let fold = |init: Self, w: f32| Self {
            min: init.min.min(w),
            max: init.max.max(w),
        };
        let stats = lo
            .iter()
            .zip(&hi)
            .fold(Self { min: 0.0, max: 0.0 }, |s, (&l, &h)| {
                fold(fold(s, l), h)
            });
        tail.iter().fold(stats, |s, &w| fold(s, w))
    }
    /// A scale is admissible when no weight lies beyond half a step outside `[-8, 7]`.
    #[inline(always)]
    fn admits(&self, s: f32) -> bool {
        s > 0.0 && s.is_finite() && self.max / s <= 7.5 && self.min / s >= -8.5
    }
}

/// The largest group size.
const MAX_GROUP: usize = 256;

/// Partial sums kept side by side, so the loops over a group vectorize (8 `f32` = one AVX2
/// register).
const LANES: usize = 8;

/// The level of `w`: `w / s` clamped to `[-8, 7]` and rounded to nearest, ties to even.
#[inline(always)]
fn level(w: f32, inv_scale: f32) -> f32 {
    // Adding and removing 1.5·2²³ rounds to an integer with plain arithmetic (no libm call), so
    // the loops vectorize; exact for |x| < 2²², and x is within [-8, 7].
    ((w * inv_scale).clamp(-8.0, 7.0) + MAGIC) - MAGIC
}

/// See [`level`].
const MAGIC: f32 = 12_582_912.0;

/// [`level`] as an integer: the bits of `x + MAGIC` are those of `MAGIC` (low byte 0) plus `x`,
/// so their low byte is `x` exactly (and this vectorizes, unlike a float-to-int cast).
#[inline(always)]
fn level_i8(w: f32, inv_scale: f32) -> i8 {
    ((w * inv_scale).clamp(-8.0, 7.0) + MAGIC).to_bits() as i8
}

/// What one pass over a group at scale `s` sums, for the levels `q` that `s` gives: the squared
/// error `Σ (w − s·q)²` and the least-squares terms `Σ w·q` and `Σ q²`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Sums {
    err: f32,
    wq: f32,
    qq: f32,
}

impl Sums {
    /// Adds the terms of weight `w` at scale `s` (`inv = 1 / s`).
    #[inline(always)]
    fn add(&mut self, w: f32, s: f32, inv: f32) {
        let q = level(w, inv);
        self.err += (w - s * q) * (w - s * q);
        self.wq += w * q;
        self.qq += q * q;
    }

    /// The least-squares scale for these levels (`s` when every level is 0).
    fn refit(&self, s: f32) -> f16 {
        f16::from_f32(if self.qq == 0.0 { s } else { self.wq / self.qq })
    }

    /// The sums of [`LANES`] partial sums each (lanes added in order) and the tail's terms.
    #[inline(always)]
    fn finish(lanes: [[f32; LANES]; 3], tail: &[f32], s: f32, inv: f32) -> Self {
        let [err, wq, qq] = lanes.map(|l| l.iter().sum::<f32>());
        let mut sums = Self { err, wq, qq };
        for &w in tail {
            sums.add(w, s, inv);
        }
        sums
    }
}

/// The [`Sums`] of `values` at each scale of `scales`, into `out`: every sum in [`LANES`]
/// partial sums (lane `l` adds the terms of weights `l`, `l + 8`, … in order), the lanes added
/// in order, then the tail. This portable version runs one scale at a time.
#[inline(always)]
fn passes(values: &[f32], scales: &[f32], out: &mut [Sums]) {
    for (&s, out) in scales.iter().zip(out) {
        let inv = 1.0 / s;
        let mut acc = [[0f32; LANES]; 3];
        let chunks = values.chunks_exact(LANES);
        let tail = chunks.remainder();
        let mut q = [0f32; LANES];
        for c in chunks {
            let c: &[f32; LANES] = c.try_into().expect("chunks of LANES values");
            for lane in 0..LANES {
                q[lane] = level(c[lane], inv);
            }
            for lane in 0..LANES {
                acc[0][lane] += (c[lane] - s * q[lane]) * (c[lane] - s * q[lane]);
            }
            for lane in 0..LANES {
                acc[1][lane] += c[lane] * q[lane];
            }
            for lane in 0..LANES {
                acc[2][lane] += q[lane] * q[lane];
            }
        }
        *out = Sums::finish(acc, tail, s, inv);
    }
}

/// [`passes`] on AVX2 registers, two scales per sweep over the group (six independent chains
/// of additions instead of three): the same IEEE operations on the same lanes in the same
/// order (Rust never fuses a multiply and an add; `max`/`min` clamp finite values exactly as
/// `f32::clamp`), so the same sums to the bit.
///
/// With `LSQ = false` only the squared errors are summed (the `wq`, `qq` of the result then
/// hold only the tail's terms): what judging a refit needs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn passes_avx2<const LSQ: bool>(values: &[f32], scales: &[f32], out: &mut [Sums]) {
    use std::arch::x86_64::*;
    let chunks = values.len() / LANES;
    let tail = &values[chunks * LANES..];
    for (pair, out) in scales.chunks(2).zip(out.chunks_mut(2)) {
        // A lone last scale is swept twice; only its first copy is kept.
        let [s0, s1] = [pair[0], pair[pair.len() - 1]];
        let (inv0, inv1) = (1.0 / s0, 1.0 / s1);
        let (lo, hi, magic) = (
            _mm256_set1_ps(-8.0),
            _mm256_set1_ps(7.0),
            _mm256_set1_ps(MAGIC),
        );
        let (vs0, vs1) = (_mm256_set1_ps(s0), _mm256_set1_ps(s1));
        let (vi0, vi1) = (_mm256_set1_ps(inv0), _mm256_set1_ps(inv1));
        let zero = _mm256_setzero_ps();
        let (mut e0, mut wq0, mut qq0) = (zero, zero, zero);
        let (mut e1, mut wq1, mut qq1) = (zero, zero, zero);
        for c in 0..chunks {
            // SAFETY: `c * LANES + LANES <= values.len()`; an unaligned load.
            let w = unsafe { _mm256_loadu_ps(values.as_ptr().add(c * LANES)) };
            let q0 = _mm256_mul_ps(w, vi0);
            let q1 = _mm256_mul_ps(w, vi1);
            let q0 = _mm256_min_ps(_mm256_max_ps(q0, lo), hi);
            let q1 = _mm256_min_ps(_mm256_max_ps(q1, lo), hi);
            let q0 = _mm256_sub_ps(_mm256_add_ps(q0, magic), magic);
            let q1 = _mm256_sub_ps(_mm256_add_ps(q1, magic), magic);
            let d0 = _mm256_sub_ps(w, _mm256_mul_ps(vs0, q0));
            let d1 = _mm256_sub_ps(w, _mm256_mul_ps(vs1, q1));
            e0 = _mm256_add_ps(e0, _mm256_mul_ps(d0, d0));
            e1 = _mm256_add_ps(e1, _mm256_mul_ps(d1, d1));
            if LSQ {
                wq0 = _mm256_add_ps(wq0, _mm256_mul_ps(w, q0));
                wq1 = _mm256_add_ps(wq1, _mm256_mul_ps(w, q1));
                qq0 = _mm256_add_ps(qq0, _mm256_mul_ps(q0, q0));
                qq1 = _mm256_add_ps(qq1, _mm256_mul_ps(q1, q1));
            }
        }
        let lanes = |v: __m256| {
            let mut a = [0f32; LANES];
            // SAFETY: `a` holds 8 floats; an unaligned store.
            unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
            a
        };
        out[0] = Sums::finish([lanes(e0), lanes(wq0), lanes(qq0)], tail, s0, inv0);
        if let Some(o) = out.get_mut(1) {
            *o = Sums::finish([lanes(e1), lanes(wq1), lanes(qq1)], tail, s1, inv1);
        }
    }
}

/// Scales seen by the MSE search in one group: a scale seen before cannot beat the best (whose
/// error only decreases), so it is not evaluated twice.
#[derive(Default)]
struct Seen {
    bits: [u16; 2 * CANDIDATES + 1],
    len: usize,
    /// Bit `b % 64` is set for every recorded scale `b`: most new scales are told apart
    /// without a search.
    filter: u64,
}

impl Seen {
    /// Records `s`; whether it was new.
    #[inline(always)]
    fn insert(&mut self, s: f16) -> bool {
        let b = s.to_bits();
        let bit = 1u64 << (b % 64);
        if self.filter & bit != 0 && self.bits[..self.len].contains(&b) {
            return false;
        }
        self.filter |= bit;
        self.bits[self.len] = b;
        self.len += 1;
        true
    }
}

/// Larger divisors of the extreme weight the MSE search tries besides `absmax / 7`.
const CANDIDATES: usize = 13;

/// Chooses the FP16 scale of one group and writes its signed levels; `passes(values, scales,
/// out, lsq)` computes the [`Sums`] of the group at given scales ([`passes`] or
/// [`passes_avx2`]; the least-squares sums only when `lsq`).
///
/// The MSE search keeps, among `absmax / 7` (the baseline), [`CANDIDATES`] larger divisors of
/// the extreme weight and the least-squares refit of each, the admissible scale with the
/// smallest squared error (the first one on ties, in that order). A candidate's error and refit
/// come from one pass, the passes are batched (their order does not change any sum), and a scale
/// seen before is not evaluated again: the same choice as evaluating every scale in turn.
#[inline(always)]
fn quantize_group(
    values: &[f32],
    search: ScaleSearch,
    levels: &mut [i8],
    passes: impl Fn(&[f32], &[f32], &mut [Sums], bool),
) -> f16 {
    let stats = GroupStats::of(values);
    let amax = stats.max.max(-stats.min);
    let mut best = f16::from_f32(amax / 7.0);
    if amax == 0.0 || best.to_f32() == 0.0 {
        // All zero, or below FP16's smallest scale: the group is zero.
        levels.fill(0);
        return f16::ZERO;
    }
    if !stats.admits(best.to_f32()) {
        // FP16 rounding of absmax/7 pushed the extreme past 7.5: take the next scale up.
        best = f16::from_bits(best.to_bits() + 1);
    }
    if search == ScaleSearch::Mse {
        // The baseline and the candidates, in one batch.
        // The -8 level is only reachable by the negative extreme.
        let top = if -stats.min > stats.max { 8.0 } else { 7.0 };
        let mut scales = [f16::ZERO; CANDIDATES + 1];
        scales[0] = best;
        for (i, c) in scales[1..].iter_mut().enumerate() {
            *c = f16::from_f32(amax / (top - 0.125 * i as f32));
        }
        let values32 = scales.map(f16::to_f32);
        let mut sums = [Sums::default(); CANDIDATES + 1];
        passes(values, &values32, &mut sums, true);
        // The order the scales are judged in: baseline, then each candidate and its refit; the
        // refits that are admissible and new need a pass of their own.
        let mut seen = Seen::default();
        seen.insert(best);
        let mut order = [(f16::ZERO, None::<usize>); 2 * CANDIDATES];
        let mut refits = [0f32; CANDIDATES];
        let mut n_refits = 0;
        for i in 1..=CANDIDATES {
            let (c, refit) = (scales[i], sums[i].refit(values32[i]));
            if stats.admits(values32[i]) && seen.insert(c) {
                order[2 * i - 2] = (c, Some(i));
            }
            if stats.admits(refit.to_f32()) && seen.insert(refit) {
                refits[n_refits] = refit.to_f32();
                order[2 * i - 1] = (refit, Some(CANDIDATES + 1 + n_refits));
                n_refits += 1;
            }
        }
        let mut refit_sums = [Sums::default(); CANDIDATES];
        passes(
            values,
            &refits[..n_refits],
            &mut refit_sums[..n_refits],
            false,
        );
        let err = |k: usize| match k.checked_sub(CANDIDATES + 1) {
            Some(r) => refit_sums[r].err,
            None => sums[k].err,
        };
        let mut best_err = sums[0].err;
        for (scale, k) in order {
            if let Some(k) = k.filter(|&k| err(k) < best_err) {
                (best, best_err) = (scale, err(k));
            }
        }
    }
    let (s, inv) = (best.to_f32(), 1.0 / best.to_f32());
    for (l, &w) in levels.iter_mut().zip(values) {
        *l = level_i8(w, inv);
        debug_assert_eq!(*l as f32, level(w, inv));
        debug_assert!((w - s * *l as f32).abs() <= s * 0.5 * (1.0 + 1e-6));
    }
    best
}

/// Writes the signed levels of columns `start..start + levels.len()` of a packed row as
/// nibbles; `start` is a multiple of 8 (groups start on 32-column chunks).
#[inline(always)]
fn pack_levels(levels: &[i8], start: usize, row: &mut [u8]) {
    debug_assert_eq!(start % 8, 0);
    let words = levels.chunks_exact(8);
    let tail = words.remainder();
    for (k, e) in words.enumerate() {
        // Eight columns fill one little-endian u32 at byte col / 2, in the nibble order
        // [e0, e2, e4, e6, e1, e3, e5, e7] (docs/architecture.md §2).
        let nib = |j: usize| ((e[j] + 8) as u32) & 0xf;
        let word = nib(0)
            | nib(2) << 4
            | nib(4) << 8
            | nib(6) << 12
            | nib(1) << 16
            | nib(3) << 20
            | nib(5) << 24
            | nib(7) << 28;
        let at = (start + 8 * k) / 2;
        row[at..at + 4].copy_from_slice(&word.to_le_bytes());
    }
    let tail_start = start + levels.len() - tail.len();
    for (i, &q) in tail.iter().enumerate() {
        let (byte, half) = nibble_position(tail_start + i);
        let nib = (q + 8) as u8;
        row[byte] = (row[byte] & !(0xf << (4 * half))) | (nib << (4 * half));
    }
}

/// Quantizes one row: its groups' scales into `row_s` (little-endian FP16) and levels into
/// `row_q`, whose padding nibbles must already be 8; `passes` as in [`quantize_group`].
#[inline(always)]
fn quantize_row(
    row_w: &[f32],
    g: usize,
    search: ScaleSearch,
    row_q: &mut [u8],
    row_s: &mut [u8],
    passes: impl Fn(&[f32], &[f32], &mut [Sums], bool) + Copy,
) {
    let mut levels = [0i8; MAX_GROUP];
    for (gi, scale) in row_s.chunks_exact_mut(2).enumerate() {
        let start = gi * g;
        let group = &row_w[start..(start + g).min(row_w.len())];
        let levels = &mut levels[..group.len()];
        let s = quantize_group(group, search, levels, passes);
        scale.copy_from_slice(&s.to_le_bytes());
        pack_levels(levels, start, row_q);
    }
}

/// [`quantize_row`] compiled for AVX2, with [`passes_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_row_avx2(
    row_w: &[f32],
    g: usize,
    search: ScaleSearch,
    row_q: &mut [u8],
    row_s: &mut [u8],
) {
    // Safe to call: this function has the same target features (closures inherit them).
    let passes = |v: &[f32], s: &[f32], o: &mut [Sums], lsq: bool| match lsq {
        true => passes_avx2::<true>(v, s, o),
        false => passes_avx2::<false>(v, s, o),
    };
    quantize_row(row_w, g, search, row_q, row_s, passes)
}

/// [`quantize_row`] on the widest registers the CPU has.
fn quantize_row_best(
    row_w: &[f32],
    g: usize,
    search: ScaleSearch,
    row_q: &mut [u8],
    row_s: &mut [u8],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { quantize_row_avx2(row_w, g, search, row_q, row_s) };
    }
    quantize_row(row_w, g, search, row_q, row_s, |v, s, o, _| passes(v, s, o))
}

/// A quantized matrix: packed nibbles and FP16 scales in the layout of [`super::layout`].
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedMatrix {
    /// Shape and sizes.
    pub layout: QMatrixLayout,
    /// `layout.weight_bytes()` packed bytes.
    pub weights: Vec<u8>,
    /// `layout.scale_count()` scales, row-major `[rows, groups]`.
    pub scales: Vec<f16>,
}

/// Quantizes a row-major `[rows, cols]` F32 matrix. `name` labels errors.
pub fn quantize_matrix(
    name: &str,
    values: &[f32],
    layout: QMatrixLayout,
    search: ScaleSearch,
) -> Result<QuantizedMatrix, QmoeError> {
    let mut weights = vec![0u8; layout.weight_bytes()];
    let mut scale_bytes = vec![0u8; 2 * layout.scale_count()];
    quantize_matrix_into(name, values, layout, search, &mut weights, &mut scale_bytes)?;
    Ok(QuantizedMatrix {
        layout,
        weights,
        scales: super::read_scales(&scale_bytes, layout.scale_count()),
    })
}

/// [`quantize_matrix`] into caller-provided bytes: `weights` (`layout.weight_bytes()`) and the
/// little-endian FP16 `scales` (`2 · layout.scale_count()` bytes), e.g. regions of a slab.
pub fn quantize_matrix_into(
    name: &str,
    values: &[f32],
    layout: QMatrixLayout,
    search: ScaleSearch,
    weights: &mut [u8],
    scales: &mut [u8],
) -> Result<(), QmoeError> {
    let (rows, cols) = (layout.rows, layout.cols);
    if values.len() != rows * cols || rows == 0 || cols == 0 {
        return Err(QmoeError::ShapeMismatch {
            tensor: name.to_string(),
            got: vec![values.len()],
            expected: vec![rows, cols],
        });
    }
    if weights.len() != layout.weight_bytes() || scales.len() != 2 * layout.scale_count() {
        return Err(QmoeError::InvalidArgument {
            argument: format!("output of `{name}`"),
            reason: format!(
                "{} weight and {} scale bytes for a {rows}x{cols} matrix that needs {} and {}",
                weights.len(),
                scales.len(),
                layout.weight_bytes(),
                2 * layout.scale_count()
            ),
        });
    }
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(QmoeError::NonFinite {
            tensor: name.to_string(),
            shape: vec![rows, cols],
            index,
        });
    }
    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax / 7.0 > f16::MAX.to_f32() {
        return Err(QmoeError::WeightOutOfRange {
            tensor: name.to_string(),
            magnitude: amax,
        });
    }
    let (g, groups, row_bytes) = (layout.group_size.get(), layout.groups(), layout.row_bytes());
    // Padding columns hold level 0 (nibble 8).
    weights.fill(0x88);
    weights
        .par_chunks_mut(row_bytes)
        .zip(scales.par_chunks_mut(2 * groups))
        .zip(values.par_chunks(cols))
        .for_each(|((row_q, row_s), row_w)| quantize_row_best(row_w, g, search, row_q, row_s));
    Ok(())
}

/// The signed level (`nibble − 8`) of column `col` of a packed row.
#[inline]
pub fn level_at(row: &[u8], col: usize) -> i8 {
    let (byte, half) = nibble_position(col);
    ((row[byte] >> (4 * half)) & 0xf) as i8 - 8
}

/// Expands packed weights and scales back to a row-major `[rows, cols]` F32 matrix.
pub fn dequantize_matrix(layout: QMatrixLayout, weights: &[u8], scales: &[f16]) -> Vec<f32> {
    let (cols, g, groups) = (layout.cols, layout.group_size.get(), layout.groups());
    let mut out = vec![0f32; layout.rows * cols];
    out.par_chunks_mut(cols)
        .zip(weights.par_chunks(layout.row_bytes()))
        .zip(scales.par_chunks(groups))
        .for_each(|((row_out, row_q), row_s)| {
            for (c, o) in row_out.iter_mut().enumerate() {
                *o = row_s[c / g].to_f32() * level_at(row_q, c) as f32;
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::GroupSize;

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        // xorshift, uniform in (-1, 1) with a few larger outliers.
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0;
                if i % 97 == 0 {
                    u * 6.0
                } else {
                    u * 0.05
                }
            })
            .collect()
    }

    fn check(rows: usize, cols: usize, g: usize, search: ScaleSearch) {
        let layout = QMatrixLayout {
            rows,
            cols,
            group_size: GroupSize::new(g).unwrap(),
        };
        let w = pseudo_random(rows * cols, (rows * 131 + cols * 7 + g) as u64);
        let q = quantize_matrix("w", &w, layout, search).unwrap();
        let d = dequantize_matrix(layout, &q.weights, &q.scales);
        for r in 0..rows {
            for c in 0..cols {
                let s = q.scales[r * layout.groups() + c / g].to_f32();
                let err = (w[r * cols + c] - d[r * cols + c]).abs();
                assert!(
                    err <= s * 0.5 * (1.0 + 1e-6),
                    "{rows}x{cols} g{g} ({r},{c}): err {err} > half step {}",
                    s / 2.0
                );
            }
        }
    }

    /// Values exactly on a group's grid: `s · q` with one level at `extreme`.
    fn on_grid(rows: usize, cols: usize, g: usize, extreme: f32, seed: u64) -> Vec<f32> {
        let noise = pseudo_random(rows * cols, seed);
        let mut w = vec![0f32; rows * cols];
        for r in 0..rows {
            for gi in 0..cols.div_ceil(g) {
                let s = f16::from_f32(0.001 + noise[r * cols + gi].abs() * 0.01).to_f32();
                for c in gi * g..((gi + 1) * g).min(cols) {
                    let q = (noise[(r * cols + c + 1) % noise.len()] * 140.0)
                        .round()
                        .clamp(-7.0, 7.0);
                    w[r * cols + c] = s * if c == gi * g { extreme } else { q };
                }
            }
        }
        w
    }

    #[test]
    fn on_grid_values_round_trip_exactly() {
        for g in [32, 64, 128, 256] {
            for (rows, cols) in [(3, 1), (2, g + 1), (4, 1408)] {
                let layout = QMatrixLayout {
                    rows,
                    cols,
                    group_size: GroupSize::new(g).unwrap(),
                };
                // ±7 extremes are on the grid of both searches; −8 only the MSE search reaches.
                let cases = [
                    (7.0, ScaleSearch::Rtn),
                    (-7.0, ScaleSearch::Rtn),
                    (7.0, ScaleSearch::Mse),
                    (-8.0, ScaleSearch::Mse),
                ];
                for (extreme, search) in cases {
                    let w = on_grid(rows, cols, g, extreme, (g + cols) as u64);
                    let q = quantize_matrix("w", &w, layout, search).unwrap();
                    let d = dequantize_matrix(layout, &q.weights, &q.scales);
                    assert!(d == w, "{rows}x{cols} g{g} extreme {extreme} {search:?}");
                }
            }
        }
    }

    #[test]
    fn half_step_bound_on_edge_shapes() {
        for g in [32, 64, 128, 256] {
            for (rows, cols) in [
                (3, 1),
                (1, g - 1),
                (2, g),
                (2, g + 1),
                (1, 3 * g + 17),
                (5, 1408),
            ] {
                for search in [ScaleSearch::Rtn, ScaleSearch::Mse] {
                    check(rows, cols, g, search);
                }
            }
        }
    }

    /// The scale search as first written — every scale judged in turn, each sum in a pass of
    /// its own, levels by a float-to-int cast — the oracle for the batched, deduplicated and
    /// vectorized search (which must choose the same scale and levels, bit for bit, so packs
    /// made before it stay reproducible).
    fn reference_group(values: &[f32], search: ScaleSearch) -> (f16, Vec<i8>) {
        let sum = |f: &dyn Fn(f32) -> f32| {
            let mut acc = [0f32; LANES];
            let chunks = values.chunks_exact(LANES);
            let tail = chunks.remainder();
            for c in chunks {
                for (a, &w) in acc.iter_mut().zip(c) {
                    *a += f(w);
                }
            }
            tail.iter().fold(acc.iter().sum::<f32>(), |s, &w| s + f(w))
        };
        let err = |s: f32| sum(&|w| (w - s * level(w, 1.0 / s)).powi(2));
        let refit = |s: f32| {
            let (wq, qq) = (
                sum(&|w| w * level(w, 1.0 / s)),
                sum(&|w| level(w, 1.0 / s).powi(2)),
            );
            f16::from_f32(if qq == 0.0 { s } else { wq / qq })
        };
        let (min, max) = values
            .iter()
            .fold((0f32, 0f32), |(lo, hi), &w| (lo.min(w), hi.max(w)));
        let admits = |s: f32| s > 0.0 && s.is_finite() && max / s <= 7.5 && min / s >= -8.5;
        let amax = max.max(-min);
        let mut best = f16::from_f32(amax / 7.0);
        if amax == 0.0 || best.to_f32() == 0.0 {
            return (f16::ZERO, vec![0; values.len()]);
        }
        if !admits(best.to_f32()) {
            best = f16::from_bits(best.to_bits() + 1);
        }
        if search == ScaleSearch::Mse {
            let mut best_err = err(best.to_f32());
            let top = if -min > max { 8.0 } else { 7.0 };
            for i in 0..=12 {
                let candidate = f16::from_f32(amax / (top - 0.125 * i as f32));
                for scale in [candidate, refit(candidate.to_f32())] {
                    if admits(scale.to_f32()) && err(scale.to_f32()) < best_err {
                        (best, best_err) = (scale, err(scale.to_f32()));
                    }
                }
            }
        }
        let inv = 1.0 / best.to_f32();
        (best, values.iter().map(|&w| level(w, inv) as i8).collect())
    }

    #[test]
    fn fast_search_chooses_what_the_reference_search_chooses() {
        #[cfg(target_arch = "x86_64")]
        let avx2 = std::arch::is_x86_feature_detected!("avx2");
        let mut groups = 0;
        for seed in 0..300u64 {
            let len = [256, 128, 64, 32, 5, 1, 17, 100, 131][seed as usize % 9];
            let mut w = pseudo_random(len, seed + 1);
            match seed % 5 {
                // Scaled down: small and subnormal scales.
                0 => w.iter_mut().for_each(|x| *x *= 1e-5),
                // A negative extreme (the -8 level).
                1 => w[len / 2] = -w.iter().fold(0f32, |m, x| m.max(x.abs())) * 1.05,
                // On a grid: many scales tie or coincide.
                2 => w.iter_mut().for_each(|x| *x = (*x * 40.0).round() / 40.0),
                _ => {}
            }
            for search in [ScaleSearch::Mse, ScaleSearch::Rtn] {
                let (scale, levels) = reference_group(&w, search);
                let mut got = vec![0i8; len];
                let s = quantize_group(&w, search, &mut got, |v, s, o, _| passes(v, s, o));
                assert_eq!(
                    (s.to_bits(), &got),
                    (scale.to_bits(), &levels),
                    "seed {seed}"
                );
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: the CPU has AVX2.
                    let simd = |v: &[f32], s: &[f32], o: &mut [Sums], lsq: bool| unsafe {
                        match lsq {
                            true => passes_avx2::<true>(v, s, o),
                            false => passes_avx2::<false>(v, s, o),
                        }
                    };
                    let s = quantize_group(&w, search, &mut got, simd);
                    assert_eq!(
                        (s.to_bits(), &got),
                        (scale.to_bits(), &levels),
                        "seed {seed}"
                    );
                }
                groups += 1;
            }
        }
        assert_eq!(groups, 600);
    }

    #[test]
    fn mse_search_never_loses_to_rtn() {
        let layout = QMatrixLayout {
            rows: 64,
            cols: 512,
            group_size: GroupSize::new(128).unwrap(),
        };
        let w = pseudo_random(64 * 512, 5);
        let err = |s| {
            let q = quantize_matrix("w", &w, layout, s).unwrap();
            let d = dequantize_matrix(layout, &q.weights, &q.scales);
            w.iter()
                .zip(&d)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
        };
        let (rtn, mse) = (err(ScaleSearch::Rtn), err(ScaleSearch::Mse));
        assert!(mse < rtn * 0.97, "mse {mse} rtn {rtn}");
    }

    #[test]
    fn non_finite_and_bad_shapes_are_named_errors() {
        let layout = QMatrixLayout {
            rows: 2,
            cols: 4,
            group_size: GroupSize::new(32).unwrap(),
        };
        let mut w = vec![0.5f32; 8];
        w[5] = f32::NAN;
        let e = quantize_matrix("experts.3.up", &w, layout, ScaleSearch::Mse).unwrap_err();
        assert!(
            matches!(&e, QmoeError::NonFinite { tensor, shape, index: 5 }
                if tensor == "experts.3.up" && shape == &[2, 4]),
            "{e}"
        );
        let e = quantize_matrix("x", &w[..7], layout, ScaleSearch::Mse).unwrap_err();
        assert!(
            matches!(&e, QmoeError::ShapeMismatch { tensor, got, expected }
                if tensor == "x" && got == &[7] && expected == &[2, 4]),
            "{e}"
        );
    }
}
