//! The CPU matmul of the non-expert weights: `y [M, N] = x [M, K] · Wᵀ` with `W [N, K]` in BF16
//! (the checkpoint's own bytes) and `x`, `y` in F32, accumulated in F32.
//!
//! At decode (`M = 1`) the product is a matrix–vector product bounded by reading `W` once: 2
//! bytes per weight. Each BF16 weight is widened exactly to F32 by a 16-bit shift, so the only
//! rounding is the F32 accumulation (`|error| ≲ K · 2⁻²⁴ · Σ|x·w|`, far below BF16's own 2⁻⁹).
//!
//! A tile of `R` weight rows × `T` activation rows is accumulated in registers: on AVX2 + FMA
//! (`R`, `T`) = (8, 1) at decode, so that eight independent FMA chains hide the latency, and
//! (4, 3) for several tokens, so that every widened weight vector feeds three FMAs. Rayon splits
//! the output rows into blocks; every output element is one dot product in a fixed order, so the
//! result does not depend on the thread count.

use half::bf16;
use rayon::prelude::*;

use super::cpu::CpuIsa;

/// Output rows per rayon task: a block of `W` is 64 rows × 2K bytes (256 KiB at K = 2048).
const ROW_BLOCK: usize = 64;

/// `y [m, n] = x [m, k] · wᵀ` for row-major `x`, `w [n, k]` (BF16) and `y`, on `isa`.
///
/// # Panics
/// When the slice lengths do not match `m`, `k`, `n`, or `isa` is not available on this CPU
/// (callers pick it with [`CpuIsa::detect`]).
pub fn bf16_matmul(isa: CpuIsa, x: &[f32], m: usize, k: usize, w: &[bf16], n: usize) -> Vec<f32> {
    assert!(isa.is_available(), "{isa:?} is not supported by this CPU");
    assert_eq!(x.len(), m * k, "x must be [m, k]");
    assert_eq!(w.len(), n * k, "w must be [n, k]");
    // SAFETY: `bf16` is a transparent `u16`.
    let bits: &[u16] = unsafe { std::slice::from_raw_parts(w.as_ptr().cast::<u16>(), w.len()) };
    // Output transposed ([n, m]) so that each task owns a contiguous run; for m = 1 the two
    // layouts coincide.
    let mut yt = vec![0f32; n * m];
    yt.par_chunks_mut(ROW_BLOCK * m)
        .enumerate()
        .for_each(|(b, out)| {
            let r0 = b * ROW_BLOCK;
            let rows = out.len() / m;
            rows_block(isa, x, m, k, &bits[r0 * k..(r0 + rows) * k], out);
        });
    if m == 1 {
        return yt;
    }
    let mut y = vec![0f32; m * n];
    for (r, col) in yt.chunks_exact(m).enumerate() {
        for (t, &v) in col.iter().enumerate() {
            y[t * n + r] = v;
        }
    }
    y
}

/// `out [rows, m]` for a block of weight rows `w [rows, k]`.
fn rows_block(isa: CpuIsa, x: &[f32], m: usize, k: usize, w: &[u16], out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `bf16_matmul` checked that the CPU supports `isa` (AVX2 + FMA at least).
        CpuIsa::Avx2 | CpuIsa::Avx512Vnni => unsafe { x86::rows_block(x, m, k, w, out) },
        _ => rows_block_portable(x, m, k, w, out),
    }
}

/// A BF16 bit pattern widened exactly to F32.
#[inline]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Portable Rust: eight partial sums per dot product (which the compiler can vectorise).
fn rows_block_portable(x: &[f32], m: usize, k: usize, w: &[u16], out: &mut [f32]) {
    for (row, o) in w.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
        for (t, y) in o.iter_mut().enumerate() {
            let xr = &x[t * k..(t + 1) * k];
            let mut acc = [0f32; 8];
            let (wc, xc) = (row.chunks_exact(8), xr.chunks_exact(8));
            let (wt, xt) = (wc.remainder(), xc.remainder());
            for (wv, xv) in wc.zip(xc) {
                for i in 0..8 {
                    acc[i] += widen(wv[i]) * xv[i];
                }
            }
            let tail: f32 = wt.iter().zip(xt).map(|(&a, &b)| widen(a) * b).sum();
            *y = acc.iter().sum::<f32>() + tail;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::widen;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Eight BF16 weights at `p` widened to F32.
    ///
    /// # Safety
    /// `p .. p + 8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load_bf16x8(p: *const u16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    /// `out[r · m + t] = w_r · x_t` for `R` weight rows starting at `w` and `T` activation rows
    /// starting at `x` (row strides `k`).
    ///
    /// # Safety
    /// `R` rows of `k` elements at `w` and `T` rows at `x` must be readable; the CPU must
    /// support AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const T: usize>(
        w: *const u16,
        x: *const f32,
        k: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let body = k - k % 8;
        let mut c = 0;
        while c < body {
            let xv: [__m256; T] = std::array::from_fn(|t| _mm256_loadu_ps(x.add(t * k + c)));
            for (r, a) in acc.iter_mut().enumerate() {
                let wv = load_bf16x8(w.add(r * k + c));
                for (t, at) in a.iter_mut().enumerate() {
                    *at = _mm256_fmadd_ps(wv, xv[t], *at);
                }
            }
            c += 8;
        }
        std::array::from_fn(|r| {
            std::array::from_fn(|t| {
                let tail: f32 = (body..k)
                    .map(|c| widen(*w.add(r * k + c)) * *x.add(t * k + c))
                    .sum();
                hsum256(acc[r][t]) + tail
            })
        })
    }

    /// Rows `r0 .. r0 + R` of the block against every activation row, in tiles of `T` tokens
    /// (then 2, then 1 for the remainder).
    ///
    /// # Safety
    /// As [`tile`], for rows `r0 .. r0 + R` of `w` and all `m` rows of `x`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_group<const R: usize, const T: usize>(
        x: &[f32],
        m: usize,
        k: usize,
        w: &[u16],
        r0: usize,
        out: &mut [f32],
    ) {
        let wp = w.as_ptr().add(r0 * k);
        let mut t0 = 0;
        let mut put = |t0: usize, vals: &[f32], r: usize| {
            out[(r0 + r) * m + t0..(r0 + r) * m + t0 + vals.len()].copy_from_slice(vals);
        };
        while t0 + T <= m {
            for (r, v) in tile::<R, T>(wp, x.as_ptr().add(t0 * k), k)
                .iter()
                .enumerate()
            {
                put(t0, v, r);
            }
            t0 += T;
        }
        while t0 < m {
            for (r, v) in tile::<R, 1>(wp, x.as_ptr().add(t0 * k), k)
                .iter()
                .enumerate()
            {
                put(t0, v, r);
            }
            t0 += 1;
        }
    }

    /// AVX2 + FMA version of `rows_block_portable`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `x` is `[m, k]`, `w` `[rows, k]`, `out` `[rows, m]`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_block(x: &[f32], m: usize, k: usize, w: &[u16], out: &mut [f32]) {
        assert!(x.len() >= m * k && out.len() * k == w.len() * m);
        let rows = out.len() / m;
        let mut r = 0;
        if m == 1 {
            while r + 8 <= rows {
                row_group::<8, 1>(x, m, k, w, r, out);
                r += 8;
            }
        } else {
            while r + 4 <= rows {
                row_group::<4, 3>(x, m, k, w, r, out);
                r += 4;
            }
        }
        while r < rows {
            row_group::<1, 3>(x, m, k, w, r, out);
            r += 1;
        }
    }
}
