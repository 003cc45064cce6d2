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
    fn of(values: &[f32]) -> Self {
        values
            .iter()
            .fold(Self { min: 0.0, max: 0.0 }, |s, &w| Self {
                min: s.min.min(w),
                max: s.max.max(w),
            })
    }
    /// A scale is admissible when no weight lies beyond half a step outside `[-8, 7]`.
    fn admits(&self, s: f32) -> bool {
        s > 0.0 && s.is_finite() && self.max / s <= 7.5 && self.min / s >= -8.5
    }
}

/// The level of `w`: `w / s` clamped to `[-8, 7]` and rounded to nearest, ties to even.
#[inline]
fn level(w: f32, inv_scale: f32) -> f32 {
    // Adding and removing 1.5·2²³ rounds to an integer with plain SSE2 arithmetic (no libm
    // call), so the search loops vectorize; exact for |x| < 2²², and x is within [-8, 7].
    const MAGIC: f32 = 12_582_912.0;
    ((w * inv_scale).clamp(-8.0, 7.0) + MAGIC) - MAGIC
}

/// `Σ f(w)` with eight independent partial sums, so the loop vectorizes.
#[inline]
fn lane_sum<const N: usize>(values: &[f32], f: impl Fn(f32) -> [f32; N]) -> [f32; N] {
    let mut acc = [[0f32; 8]; N];
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (lane, &w) in c.iter().enumerate() {
            let v = f(w);
            for (a, v) in acc.iter_mut().zip(v) {
                a[lane] += v;
            }
        }
    }
    let mut out: [f32; N] = std::array::from_fn(|i| acc[i].iter().sum());
    for &w in tail {
        for (o, v) in out.iter_mut().zip(f(w)) {
            *o += v;
        }
    }
    out
}

/// Squared error of quantizing `values` with scale `s`.
fn squared_error(values: &[f32], s: f32) -> f32 {
    let inv = 1.0 / s;
    lane_sum(values, |w| [(w - s * level(w, inv)).powi(2)])[0]
}

/// Least-squares scale for the levels that `s` produces (`Σ w q / Σ q²`).
fn refit(values: &[f32], s: f32) -> f16 {
    let inv = 1.0 / s;
    let [wq, qq] = lane_sum(values, |w| {
        let q = level(w, inv);
        [w * q, q * q]
    });
    f16::from_f32(if qq == 0.0 { s } else { wq / qq })
}

/// Chooses the FP16 scale of one group and writes its signed levels.
fn quantize_group(values: &[f32], search: ScaleSearch, levels: &mut [i8]) -> f16 {
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
        let mut best_err = squared_error(values, best.to_f32());
        // The -8 level is only reachable by the negative extreme.
        let top = if -stats.min > stats.max { 8.0 } else { 7.0 };
        for i in 0..=12 {
            let candidate = f16::from_f32(amax / (top - 0.125 * i as f32));
            for scale in [candidate, refit(values, candidate.to_f32())] {
                let s = scale.to_f32();
                if stats.admits(s) {
                    let err = squared_error(values, s);
                    if err < best_err {
                        (best, best_err) = (scale, err);
                    }
                }
            }
        }
    }
    let (s, inv) = (best.to_f32(), 1.0 / best.to_f32());
    for (l, &w) in levels.iter_mut().zip(values) {
        *l = level(w, inv) as i8;
        debug_assert!((w - s * *l as f32).abs() <= s * 0.5 * (1.0 + 1e-6));
    }
    best
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
    let (rows, cols) = (layout.rows, layout.cols);
    if values.len() != rows * cols || rows == 0 || cols == 0 {
        return Err(QmoeError::ShapeMismatch {
            tensor: name.to_string(),
            got: vec![values.len()],
            expected: vec![rows, cols],
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
    let mut weights = vec![0x88u8; layout.weight_bytes()];
    let mut scales = vec![f16::ZERO; layout.scale_count()];
    weights
        .par_chunks_mut(row_bytes)
        .zip(scales.par_chunks_mut(groups))
        .zip(values.par_chunks(cols))
        .for_each(|((row_q, row_s), row_w)| {
            let mut levels = vec![0i8; g];
            for (gi, scale) in row_s.iter_mut().enumerate() {
                let start = gi * g;
                let group = &row_w[start..(start + g).min(cols)];
                let levels = &mut levels[..group.len()];
                *scale = quantize_group(group, search, levels);
                for (i, &q) in levels.iter().enumerate() {
                    let (byte, half) = nibble_position(start + i);
                    let nib = (q + 8) as u8;
                    row_q[byte] = (row_q[byte] & !(0xf << (4 * half))) | (nib << (4 * half));
                }
            }
        });
    Ok(QuantizedMatrix {
        layout,
        weights,
        scales,
    })
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
