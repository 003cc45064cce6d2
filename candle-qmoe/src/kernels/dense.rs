//! The CPU matmul of the non-expert weights: `y [M, N] = x [M, K] · Wᵀ` with `W [N, K]` in BF16
//! (the checkpoint's own bytes) and `x`, `y` in F32, accumulated in F32.
//!
//! At decode (`M = 1`) the product is a matrix–vector product bounded by reading `W` once: 2
//! bytes per weight. Each BF16 weight is widened exactly to F32 (a 16-bit shift or a mask of the
//! 32-bit word holding it), so the only rounding is the F32 accumulation (`|error| ≲ K · 2⁻²⁴ · Σ|x·w|`, far below BF16's own 2⁻⁹).
//!
//! A tile of `R` weight rows × `T` activation rows is accumulated in registers: on AVX2 + FMA
//! (`R`, `T`) = (8, 1) at decode, so that eight independent FMA chains hide the latency, and
//! (3, 3) for several tokens, so that every widened weight vector feeds three FMAs; on AVX-512F
//! (8, 1) and (4, 6) with twice the lanes. The SIMD kernels load `2L` weights (`L` lanes) as `L`
//! 32-bit words and widen the even columns with one shift and the odd ones with one mask, so
//! each widened vector costs one instruction (a zero-extension and a shift before); the
//! activations are arranged to match once per call (each `2L`-column chunk: its even columns,
//! then its odd ones). Rayon splits the output rows into blocks; every output element is one dot
//! product in a fixed order, so the result does not depend on the thread count, nor on the other
//! tokens of the call.
//!
//! Several tokens (prefill chunks, batched decode) go through in chunks of about 256 KiB of
//! activations, which stay in L2 while every row group of a block passes over them, and each
//! tile's tokens are interleaved once per call so that a tile reads one stream of activations
//! instead of one per token. The INT8 kernel blocks tokens the same way.

use half::bf16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::cpu::CpuIsa;
use super::{par_feature_blocks, round_to_i32, FeatureBlock};

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
    if m == 0 {
        return Vec::new();
    }
    if k == 0 {
        return vec![0.0; m * n];
    }
    let bits: &[u16] = w.reinterpret_cast();
    // The activations in the SIMD kernels' order (whole tiles of several tokens interleaved),
    // arranged once for every task to read.
    #[cfg(target_arch = "x86_64")]
    let arranged = match isa {
        CpuIsa::Avx2 => arrange_tiles(x, m, k, x86::LANES, x86::TILE_TOKENS),
        CpuIsa::Avx512Vnni => arrange_tiles(x, m, k, x86_512::LANES, x86_512::TILE_TOKENS),
        CpuIsa::Scalar => CacheAligned::zeroed(0),
    };
    par_feature_blocks(m, n, ROW_BLOCK, |r0, out| {
        let w = &bits[r0 * k..(r0 + out.features()) * k];
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above that the CPU supports `isa` (AVX2 + FMA at least);
            // `arranged` holds `x` arranged for this width.
            CpuIsa::Avx2 => unsafe { x86::rows_block(arranged.as_slice(), m, k, w, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above (AVX-512F and BW at least).
            CpuIsa::Avx512Vnni => unsafe { x86_512::rows_block(arranged.as_slice(), m, k, w, out) },
            _ => rows_block_portable(x, m, k, w, out),
        }
    })
}

/// `x [m, k]`, from a cache line's start, in the order the SIMD kernels of `lanes` lanes read:
/// the first `m − m % tile` rows in tiles of `tile` tokens, the rest in tiles of one; a tile of
/// `T` tokens starting at token `t0` lies at `t0 · k`. Within a tile, the first `k − k % 2·lanes`
/// columns go in chunks of `2 · lanes`: chunk `q`'s even columns of token `t` (`x[t][2q·lanes +
/// 2i]`, `i < lanes`) at `(2q · T + t) · lanes`, then its odd columns at `((2q + 1) · T + t) ·
/// lanes`, so that a tile
/// reads one stream in the order the widened weights come; the columns past the last whole chunk
/// follow in order, token by token. (Rows 8 KiB apart in plain layout — K = 2048 — fall into the
/// same L1 sets.)
#[cfg(target_arch = "x86_64")]
fn arrange_tiles(x: &[f32], m: usize, k: usize, lanes: usize, tile: usize) -> CacheAligned {
    let pair = 2 * lanes;
    let body = k - k % pair;
    let whole = m - m % tile;
    let mut arranged = CacheAligned::zeroed(m * k);
    let out = arranged.as_mut_slice();
    let arrange = |dst: &mut [f32], rows: &[f32]| {
        let tokens = rows.len() / k;
        let (dst_body, dst_tail) = dst.split_at_mut(body * tokens);
        for (t, row) in rows.chunks_exact(k).enumerate() {
            for (q, chunk) in row[..body].chunks_exact(pair).enumerate() {
                for h in 0..2 {
                    let at = ((2 * q + h) * tokens + t) * lanes;
                    for (i, v) in dst_body[at..at + lanes].iter_mut().enumerate() {
                        *v = chunk[2 * i + h];
                    }
                }
            }
            dst_tail[t * (k - body)..][..k - body].copy_from_slice(&row[body..]);
        }
    };
    let (tiled, single) = out.split_at_mut(whole * k);
    tiled
        .par_chunks_mut(tile * k)
        .zip(x[..whole * k].par_chunks(tile * k))
        .for_each(|(dst, rows)| arrange(dst, rows));
    single
        .par_chunks_mut(k)
        .zip(x[whole * k..].par_chunks(k))
        .for_each(|(dst, row)| arrange(dst, row));
    arranged
}

/// F32 values starting at a 64-byte boundary, so that 512-bit loads of them never straddle two
/// cache lines (a `Vec<f32>` from the allocator starts 16 bytes past one: at M = 512 the BF16
/// kernel took 1.04–1.13× as long with its activations there).
#[cfg(target_arch = "x86_64")]
struct CacheAligned {
    /// The values, 16 to a line (the last line's tail unused).
    lines: Vec<CacheLine>,
    /// How many values.
    len: usize,
}

/// One 64-byte cache line of F32 values.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct CacheLine([f32; 16]);

#[cfg(target_arch = "x86_64")]
impl CacheAligned {
    /// `len` zeros.
    fn zeroed(len: usize) -> Self {
        Self {
            lines: vec![CacheLine([0.0; 16]); len.div_ceil(16)],
            len,
        }
    }

    /// The values.
    fn as_slice(&self) -> &[f32] {
        // SAFETY: `lines` holds at least `len` contiguous, initialized F32 values (each line is
        // 16 of them, with no padding).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }

    /// The values, to write.
    fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_slice`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

/// Bytes of F32 activations per token chunk of a several-token call: with the block's weights
/// (64 rows, 256 KiB of BF16 at K = 2048) they stay in L2 while each row group of the block
/// passes over them. Without chunks every row group streamed all `M` tokens from L3 (16 MB at
/// `M` = 2048, `K` = 2048).
const TOKEN_CHUNK_BYTES: usize = 256 << 10;

/// Tokens per chunk of a several-token call whose activations take `bytes_per_token`: about
/// [`TOKEN_CHUNK_BYTES`], a whole number of `tile` tiles, at least one tile.
fn token_chunk(bytes_per_token: usize, tile: usize) -> usize {
    (TOKEN_CHUNK_BYTES / bytes_per_token.max(1) / tile).max(1) * tile
}

/// A BF16 bit pattern widened exactly to F32.
#[inline]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Portable Rust: eight partial sums per dot product (which the compiler can vectorise).
fn rows_block_portable(x: &[f32], m: usize, k: usize, w: &[u16], out: &mut FeatureBlock) {
    for (r, row) in w.chunks_exact(k).enumerate() {
        for (t, xr) in x.chunks_exact(k).take(m).enumerate() {
            let mut acc = [0f32; 8];
            let (wc, xc) = (row.chunks_exact(8), xr.chunks_exact(8));
            let (wt, xt) = (wc.remainder(), xc.remainder());
            for (wv, xv) in wc.zip(xc) {
                for i in 0..8 {
                    acc[i] += widen(wv[i]) * xv[i];
                }
            }
            let tail: f32 = wt.iter().zip(xt).map(|(&a, &b)| widen(a) * b).sum();
            out.set(t, r, acc.iter().sum::<f32>() + tail);
        }
    }
}

/// Defines module `$m`: `rows_block` for one x86 vector width, compiled for `$features`, from
/// the vector operations `$ops` defines on the F32 vector `$V` of `$L` lanes: `zero`, `load_x`
/// (F32), `widen_even` / `widen_odd` (of the `2 · $L` BF16 weights at a pointer, the even or the
/// odd ones widened exactly to F32: a 16-bit shift or a mask of each 32-bit word), `fma` and
/// `hsum`.
/// Decode tiles are `$R1` rows × 1 token, several-token tiles `$RM` rows × `$TM` tokens (as many
/// accumulators as the registers hold).
macro_rules! dense_simd {
    ($m:ident, $features:literal, $V:ty, $L:literal, ($R1:literal, 1), ($RM:literal, $TM:literal),
     { $($ops:item)* }) => {
        #[cfg(target_arch = "x86_64")]
        mod $m {
            use std::arch::x86_64::*;

            use super::{widen, FeatureBlock};

            $($ops)*

            /// Lanes per vector.
            pub(super) const LANES: usize = $L;
            /// Tokens per tile of a several-token call.
            pub(super) const TILE_TOKENS: usize = $TM;

            /// `out[r][t] = w_r · x_t` for `R` weight rows starting at `w` (row stride `k`) and
            /// one tile of `T` activation rows at `x`, arranged as [`super::arrange_tiles`]
            /// writes them.
            ///
            /// # Safety
            /// `R` rows of `k` elements at `w` and `T · k` elements at `x` must be readable; the
            /// CPU must support the target features.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile<const R: usize, const T: usize>(
                w: *const u16,
                x: *const f32,
                k: usize,
            ) -> [[f32; T]; R] {
                let mut acc: [[$V; T]; R] = [[zero(); T]; R];
                let body = k - k % (2 * $L);
                let mut c = 0;
                while c < body {
                    if T == 1 {
                        // Decode: each row's chunk widened both ways in turn (on AVX2 the
                        // compiler loads its words once; 16 `ymm` registers do not hold two
                        // passes' worth there).
                        let (even, odd) = (load_x(x.add(c)), load_x(x.add(c + $L)));
                        for (r, a) in acc.iter_mut().enumerate() {
                            if c % 32 == 0 {
                                // This row's place in the next row group, into L2, once per
                                // 64-byte line (never faults, past the end of `w` too). Tiles of
                                // several tokens read each row group once per tile from cache.
                                let ahead = w.wrapping_add((r + R) * k + c);
                                crate::kernels::x86_simd::prefetch_l2(ahead as *const u8);
                            }
                            let p = w.add(r * k + c);
                            a[0] = fma(widen_even(p), even, a[0]);
                            a[0] = fma(widen_odd(p), odd, a[0]);
                        }
                        c += 2 * $L;
                        continue;
                    }
                    // The tile's `T` chunks of even columns at column `c` lie next to each
                    // other, then its `T` chunks of odd columns: every accumulator takes its
                    // even then its odd product, as at decode.
                    let xv: [$V; T] = std::array::from_fn(|t| load_x(x.add(c * T + t * $L)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let wv = widen_even(w.add(r * k + c));
                        for (t, at) in a.iter_mut().enumerate() {
                            *at = fma(wv, xv[t], *at);
                        }
                    }
                    let xv: [$V; T] =
                        std::array::from_fn(|t| load_x(x.add(c * T + (T + t) * $L)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let wv = widen_odd(w.add(r * k + c));
                        for (t, at) in a.iter_mut().enumerate() {
                            *at = fma(wv, xv[t], *at);
                        }
                    }
                    c += 2 * $L;
                }
                let tail = x.add(body * T);
                std::array::from_fn(|r| {
                    std::array::from_fn(|t| {
                        let tail: f32 = (body..k)
                            .map(|c| widen(*w.add(r * k + c)) * *tail.add(t * (k - body) + c - body))
                            .sum();
                        hsum(acc[r][t]) + tail
                    })
                })
            }

            /// Rows `r0 .. r0 + R` of the block against the activation rows `tokens` (a whole
            /// number of tiles of `T`; tile `j` at `x + j · T · k`).
            ///
            /// # Safety
            /// As [`tile`], for rows `r0 .. r0 + R` of `w` and every tile of `tokens` at `x`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn row_group<const R: usize, const T: usize>(
                x: *const f32,
                tokens: std::ops::Range<usize>,
                k: usize,
                w: &[u16],
                r0: usize,
                out: &mut FeatureBlock,
            ) {
                let wp = w.as_ptr().add(r0 * k);
                for t0 in tokens.step_by(T) {
                    for (r, v) in tile::<R, T>(wp, x.add(t0 * k), k).iter().enumerate() {
                        for (t, &y) in v.iter().enumerate() {
                            out.set(t0 + t, r0 + r, y);
                        }
                    }
                }
            }

            /// Every row group of the block (`R` rows, then single rows) against the tiles of
            /// `tokens`.
            ///
            /// # Safety
            /// As [`row_group`], for every row of `w`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn row_groups<const R: usize, const T: usize>(
                x: *const f32,
                tokens: std::ops::Range<usize>,
                k: usize,
                w: &[u16],
                out: &mut FeatureBlock,
            ) {
                let rows = out.features();
                let mut r = 0;
                while r + R <= rows {
                    row_group::<R, T>(x, tokens.clone(), k, w, r, out);
                    r += R;
                }
                while r < rows {
                    row_group::<1, T>(x, tokens.clone(), k, w, r, out);
                    r += 1;
                }
            }

            /// `rows_block_portable` on this vector width, with `x` arranged by
            /// [`super::arrange_tiles`] for [`LANES`] and [`TILE_TOKENS`].
            ///
            /// # Safety
            /// The CPU must support the target features; `x` holds `m · k` arranged values, `w`
            /// is `[rows, k]` for the `rows` features of `out`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn rows_block(
                x: &[f32],
                m: usize,
                k: usize,
                w: &[u16],
                out: &mut FeatureBlock,
            ) {
                assert!(x.len() >= m * k && out.features() * k == w.len());
                if m == 1 {
                    return row_groups::<$R1, 1>(x.as_ptr(), 0..1, k, w, out);
                }
                let whole = m - m % $TM;
                // Chunks of tokens whose activations stay in L2 while every row group of the
                // block passes over them (each row group's weights stay in L1 for the chunk).
                let chunk = super::token_chunk(4 * k, $TM);
                for t0 in (0..whole).step_by(chunk) {
                    let tokens = t0..(t0 + chunk).min(whole);
                    row_groups::<$RM, $TM>(x.as_ptr(), tokens, k, w, out);
                }
                row_groups::<$RM, 1>(x.as_ptr(), whole..m, k, w, out);
            }
        }
    };
}

// AVX2 + FMA: (8, 1) at decode, so that eight independent FMA chains hide the latency, and
// (3, 3) for several tokens, so that every widened weight vector feeds three FMAs (13 of the 16
// registers: (4, 3) on interleaved tiles kept two accumulators on the stack and took 1.45× the
// time of (4, 3) on plain rows; (3, 3) takes about the same: docs/cpu-results.md).
dense_simd!(x86, "avx2,fma", __m256, 8, (8, 1), (3, 3), {
    /// The high 16 bits of a 32-bit word: the odd column of a BF16 pair, in place as F32.
    const HIGH_HALF: i32 = 0xFFFF_0000_u32 as i32;
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    /// # Safety
    /// `p .. p + 8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_x(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    /// # Safety
    /// `p .. p + 16` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen_even(p: *const u16) -> __m256 {
        let words = _mm256_loadu_si256(p.cast());
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(words))
    }
    /// # Safety
    /// `p .. p + 16` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen_odd(p: *const u16) -> __m256 {
        let words = _mm256_loadu_si256(p.cast());
        _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(HIGH_HALF)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        crate::kernels::x86_simd::hsum256(v)
    }
});
// AVX-512F: twice the lanes and registers: (8, 1) at decode and (4, 6) for several tokens
// (24 accumulators), so that every widened weight vector feeds six FMAs.
dense_simd!(
    x86_512,
    "avx512f,avx512bw,avx2,fma",
    __m512,
    16,
    (8, 1),
    (4, 6),
    {
        /// The odd 16-bit elements of 32.
        const ODD_HALVES: __mmask32 = 0xAAAA_AAAA;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        /// # Safety
        /// `p .. p + 16` must be readable.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn load_x(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        /// # Safety
        /// `p .. p + 32` must be readable.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn widen_even(p: *const u16) -> __m512 {
            let words = _mm512_loadu_si512(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words))
        }
        /// # Safety
        /// `p .. p + 32` must be readable.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn widen_odd(p: *const u16) -> __m512 {
            // A masked load (the odd 16-bit elements, zeros between): no ALU operation at all.
            _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(ODD_HALVES, p.cast()))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        fn hsum(v: __m512) -> f32 {
            _mm512_reduce_add_ps(v)
        }
    }
);

/// Columns per INT8 scale (as GGML's Q8_0): 8.5 bits per weight with the FP16 scale.
pub const INT8_GROUP: usize = 32;

/// A matrix `[rows, cols]` in symmetric INT8 with one FP16 scale per row and group of
/// [`INT8_GROUP`] columns (`w ≈ q · scale`, `q ∈ [-127, 127]`); rows are padded with zeros to a
/// whole number of groups.
#[derive(Clone, Debug)]
pub struct Int8Matrix {
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    scales: Vec<half::f16>,
}

/// Quantizes one group to `q`: `round(v / s)` in `[-127, 127]` with `s = stored(max|v| / 127)`,
/// the scale as it will be stored (e.g. rounded to FP16), which the kernel multiplies by;
/// returns `s` (0 for an all-zero group, whose levels are 0).
fn quantize_group_i8(
    v: impl Iterator<Item = f32> + Clone,
    q: &mut [i8],
    stored: impl Fn(f32) -> f32,
) -> f32 {
    let amax = v.clone().fold(0f32, |m, x| m.max(x.abs()));
    let s = stored(amax / 127.0);
    if s == 0.0 {
        q.fill(0);
        return 0.0;
    }
    for (qi, x) in q.iter_mut().zip(v) {
        *qi = round_to_i32(x / s).clamp(-127, 127) as i8;
    }
    s
}

impl Int8Matrix {
    /// Quantizes row-major `w [rows, cols]` (BF16, as the checkpoint holds it).
    pub fn quantize_bf16(w: &[bf16], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "w must be [rows, cols]");
        let padded = cols.next_multiple_of(INT8_GROUP);
        let groups = padded / INT8_GROUP;
        let mut q = vec![0i8; rows * padded];
        let mut scales = vec![half::f16::ZERO; rows * groups];
        // (`max(1)`: with no columns every slice is empty and no row is visited.)
        q.par_chunks_mut(padded.max(1))
            .zip(scales.par_chunks_mut(groups.max(1)))
            .zip(w.par_chunks(cols.max(1)))
            .for_each(|((q, scales), row)| {
                for (g, (qg, s)) in q.chunks_exact_mut(INT8_GROUP).zip(scales).enumerate() {
                    let vals = &row[(g * INT8_GROUP).min(cols)..((g + 1) * INT8_GROUP).min(cols)];
                    let n = vals.len();
                    let vals = vals.iter().map(|v| v.to_f32());
                    let f16_scale = |x: f32| half::f16::from_f32(x).to_f32();
                    let scale = quantize_group_i8(vals, &mut qg[..n], f16_scale);
                    *s = half::f16::from_f32(scale);
                }
            });
        Self {
            rows,
            cols,
            q,
            scales,
        }
    }

    /// The rows of `parts` one after the other (all with the same columns): one matrix whose
    /// product is the parts' products side by side, bit for bit.
    ///
    /// # Panics
    /// When `parts` is empty or their columns differ.
    pub fn stack(parts: &[&Int8Matrix]) -> Self {
        let cols = parts.first().expect("at least one matrix").cols;
        assert!(
            parts.iter().all(|m| m.cols == cols),
            "stacked matrices need equal columns"
        );
        Self {
            rows: parts.iter().map(|m| m.rows).sum(),
            cols,
            q: parts.iter().flat_map(|m| m.q.iter().copied()).collect(),
            scales: parts
                .iter()
                .flat_map(|m| m.scales.iter().copied())
                .collect(),
        }
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of the quantized weights and scales.
    pub fn bytes(&self) -> usize {
        self.q.len() + 2 * self.scales.len()
    }

    /// The weights as F32 (`q · scale`), row-major `[rows, cols]`: the exact values the kernel
    /// multiplies by.
    pub fn dequantize(&self) -> Vec<f32> {
        let padded = self.q.len() / self.rows.max(1);
        let groups = padded / INT8_GROUP;
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            out.extend((0..self.cols).map(|c| {
                self.q[r * padded + c] as f32 * self.scales[r * groups + c / INT8_GROUP].to_f32()
            }));
        }
        out
    }
}

/// Activation rows quantized to INT8 per group of [`INT8_GROUP`], as the INT8 kernel reads
/// them.
struct Int8Acts {
    padded: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
    /// Per run of 4 levels, `-128 ×` their sum: the VNNI path multiplies weights offset to
    /// unsigned bytes (`w + 128`) and starts each lane's sum here, which cancels the offset.
    /// Empty for the other instruction sets, which do not read it.
    offsets: Vec<i32>,
}

impl Int8Acts {
    /// `x [m, k]` quantized for the INT8 kernel on `isa` (`k ≥ 1`).
    fn new(isa: CpuIsa, x: &[f32], m: usize, k: usize) -> Self {
        let padded = k.next_multiple_of(INT8_GROUP);
        let groups = padded / INT8_GROUP;
        let mut q = vec![0i8; m * padded];
        let mut scales = vec![0f32; m * groups];
        let quantize_row = |((q, s), row): ((&mut [i8], &mut [f32]), &[f32])| {
            for (g, (qg, sg)) in q.chunks_exact_mut(INT8_GROUP).zip(s).enumerate() {
                let vals = &row[(g * INT8_GROUP).min(k)..((g + 1) * INT8_GROUP).min(k)];
                *sg = quantize_group_i8(vals.iter().copied(), &mut qg[..vals.len()], |x| x);
            }
        };
        let offsets_of = |(o, l): (&mut i32, &[i8])| {
            *o = -128 * l.iter().map(|&v| v as i32).sum::<i32>();
        };
        let vnni = isa == CpuIsa::Avx512Vnni;
        let mut offsets = vec![0i32; if vnni { m * padded / 4 } else { 0 }];
        if m == 1 {
            // One row (decode's input): a parallel op would cost more than the row.
            quantize_row(((&mut q, &mut scales), x));
            offsets
                .iter_mut()
                .zip(q.chunks_exact(4))
                .for_each(offsets_of);
        } else {
            // Row by row in parallel (512 rows of 2048 columns: ~5% of the projection's time
            // on one thread).
            q.par_chunks_mut(padded)
                .zip(scales.par_chunks_mut(groups))
                .zip(x.par_chunks(k))
                .for_each(quantize_row);
            offsets
                .par_chunks_mut(padded / 4)
                .zip(q.par_chunks(padded))
                .for_each(|(o, q)| o.iter_mut().zip(q.chunks_exact(4)).for_each(offsets_of));
        }
        Self {
            padded,
            q,
            scales,
            offsets,
        }
    }

    /// Bytes of one token's levels, scales and offsets (as [`Self::row`] slices them).
    fn bytes_per_token(&self) -> usize {
        let groups = self.padded / INT8_GROUP;
        let offsets = if self.offsets.is_empty() {
            0
        } else {
            self.padded / 4
        };
        self.padded + 4 * (groups + offsets)
    }

    /// Token `t`'s row.
    fn row(&self, t: usize) -> ActRow<'_> {
        let groups = self.padded / INT8_GROUP;
        let lanes = self.padded / 4;
        ActRow {
            q: &self.q[t * self.padded..(t + 1) * self.padded],
            scales: &self.scales[t * groups..(t + 1) * groups],
            offsets: self.offsets.get(t * lanes..(t + 1) * lanes).unwrap_or(&[]),
        }
    }
}

/// One activation row of [`Int8Acts`].
#[derive(Clone, Copy, Default)]
struct ActRow<'a> {
    /// Levels, whole groups.
    q: &'a [i8],
    /// One scale per group.
    scales: &'a [f32],
    /// `-128 ×` the sum of each run of 4 levels (VNNI only, else empty).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    offsets: &'a [i32],
}

/// `y [m, n] = x [m, k] · wᵀ` with `w` in INT8 and `x` quantized to INT8 per group on the fly
/// (W8A8: integer dot products per group of 32, scaled by both scales and summed in F32).
///
/// # Panics
/// When `x` is not `[m, w.cols()]` or `isa` is not available on this CPU.
pub fn int8_matmul(isa: CpuIsa, x: &[f32], m: usize, w: &Int8Matrix) -> Vec<f32> {
    assert!(isa.is_available(), "{isa:?} is not supported by this CPU");
    assert_eq!(x.len(), m * w.cols, "x must be [m, {}]", w.cols);
    if m == 0 {
        return Vec::new();
    }
    if w.cols == 0 {
        // Every dot product is empty.
        return vec![0.0; m * w.rows];
    }
    let acts = Int8Acts::new(isa, x, m, w.cols);
    let (n, padded) = (w.rows, acts.padded);
    let groups = padded / INT8_GROUP;
    // A tile is DECODE_TILE_ROWS weight rows sharing each activation load at decode (m = 1),
    // otherwise up to PREFILL_TILE_ROWS weight rows (one on AVX2) by up to INT8_TOKENS tokens.
    let tile_rows = match isa {
        CpuIsa::Avx512Vnni => PREFILL_TILE_ROWS,
        _ => 1,
    };
    par_feature_blocks(m, n, ROW_BLOCK, |r0, out| {
        let nr = out.features();
        // `rows` rows `spacing` apart from row `first` of the block.
        let rows_at = |first: usize, rows: usize, spacing: usize| Int8Rows {
            q: &w.q[(r0 + first) * padded..(r0 + nr) * padded],
            scales: &w.scales[(r0 + first) * groups..(r0 + nr) * groups],
            groups,
            rows,
            spacing,
        };
        let place = |t0, row, spacing| OutPlace { t0, row, spacing };
        if m == 1 {
            // Tile `i` takes rows `i + j · tiles` of the block: sequential streams.
            let tiles = nr / DECODE_TILE_ROWS;
            let x = [acts.row(0)];
            for i in 0..tiles {
                let w = rows_at(i, DECODE_TILE_ROWS, tiles);
                int8_dots(isa, &w, &x, out, place(0, i, tiles));
            }
            for r in tiles * DECODE_TILE_ROWS..nr {
                int8_dots(isa, &rows_at(r, 1, 1), &x, out, place(0, r, 1));
            }
            return;
        }
        // Chunks of tokens whose activations stay in L2 while every row of the block passes
        // over them.
        let chunk = token_chunk(acts.bytes_per_token(), INT8_TOKENS);
        for first in (0..m).step_by(chunk) {
            let end = (first + chunk).min(m);
            for r in (0..nr).step_by(tile_rows) {
                let w = rows_at(r, tile_rows.min(nr - r), 1);
                for t0 in (first..end).step_by(INT8_TOKENS) {
                    let mut rows = [ActRow::default(); INT8_TOKENS];
                    let nt = (end - t0).min(INT8_TOKENS);
                    for (j, row) in rows.iter_mut().take(nt).enumerate() {
                        *row = acts.row(t0 + j);
                    }
                    int8_dots(isa, &w, &rows[..nt], out, place(t0, r, 1));
                }
            }
        }
    })
}

/// Activation rows sharing one pass over INT8 weight rows.
const INT8_TOKENS: usize = 4;

/// Weight rows per several-token tile on AVX-512 VNNI, which share each activation load (32
/// `zmm` registers hold 4 × 4 accumulators; on AVX2, 16 `ymm` registers hold one row's). 2048 ×
/// 2048 at M = 128 on 2 threads of a Xeon (Emerald Rapids), alternating with one-row tiles
/// without token chunks: 12.9–13.7 ms against 16.7–17.6.
const PREFILL_TILE_ROWS: usize = 4;

/// Weight rows per decode tile of [`int8_matmul`].
const DECODE_TILE_ROWS: usize = 4;

/// How many rows ahead a decode tile's row prefetches its stream. A decode tile's rows lie a
/// quarter of the task's block apart, so that each is a sequential stream; adjacent rows
/// interleave their 64-byte lines within a page, which the hardware prefetcher follows worse.
/// 16 layers of OLMoE's INT8 attention projections and its INT8 head at M = 1 on 2 threads of
/// a Zen 4 EPYC (3 runs of a scratch A/B alternating in one process): 9.5–9.7 ms per token
/// against 10.6–11.1 for adjacent rows (the head alone 44–45 GB/s against 37–42); 1 and 4
/// rows ahead 9.8–10.0 ms.
#[cfg(target_arch = "x86_64")]
const SPLIT_PREFETCH_ROWS: usize = 2;

/// Rows of an [`Int8Matrix`] that one tile reads: `rows` rows, `spacing` matrix rows apart,
/// from the start of `q` and `scales`.
struct Int8Rows<'a> {
    q: &'a [i8],
    scales: &'a [half::f16],
    groups: usize,
    rows: usize,
    spacing: usize,
}

impl Int8Rows<'_> {
    fn len(&self) -> usize {
        self.rows
    }
    /// The index in `q` of group `g` of tile row `r`.
    fn q_at(&self, r: usize, g: usize) -> usize {
        (r * self.spacing * self.groups + g) * INT8_GROUP
    }
    /// The index in `scales` of group `g` of tile row `r`.
    fn scale_at(&self, r: usize, g: usize) -> usize {
        r * self.spacing * self.groups + g
    }
}

/// Where [`int8_dots`] puts its outputs: token `t0 + j` and feature `row + r · spacing` of the
/// block for tile token `j` and weight row `r`.
#[derive(Clone, Copy)]
struct OutPlace {
    /// The tile's first token.
    t0: usize,
    /// The block's feature (row of the weights) of the tile's first weight row.
    row: usize,
    /// Features between the tile's weight rows.
    spacing: usize,
}

impl OutPlace {
    /// Puts the output of tile row `r` and token `j` in its place.
    #[inline]
    fn put(self, out: &mut FeatureBlock, r: usize, j: usize, v: f32) {
        out.set(self.t0 + j, self.row + r * self.spacing, v);
    }
}

/// `Σ_g ws_r[g] · xs_j[g] · Σ_{i ∈ g} wq_r[i] · xq_j[i]` over whole groups, for the weight rows
/// `r` of `w` and up to [`INT8_TOKENS`] activation rows `j`, put in `out` at `at`.
#[inline]
fn int8_dots(isa: CpuIsa, w: &Int8Rows, rows: &[ActRow], out: &mut FeatureBlock, at: OutPlace) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `int8_matmul` checked that the CPU supports `isa` (AVX2 + FMA + F16C at least).
        CpuIsa::Avx2 => unsafe { x86_int8::dots_avx2(w, rows, out, at) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (AVX-512 VNNI).
        CpuIsa::Avx512Vnni => unsafe { x86_int8::dots_vnni(w, rows, out, at) },
        _ => {
            let padded = w.groups * INT8_GROUP;
            for r in 0..w.len() {
                let wq = &w.q[w.q_at(r, 0)..][..padded];
                let ws = &w.scales[w.scale_at(r, 0)..][..w.groups];
                for (j, row) in rows.iter().enumerate() {
                    let y = wq
                        .chunks_exact(INT8_GROUP)
                        .zip(row.q.chunks_exact(INT8_GROUP))
                        .zip(ws.iter().zip(row.scales))
                        .map(|((w, x), (sw, sx))| {
                            let d: i32 = w.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum();
                            d as f32 * (sw.to_f32() * sx)
                        })
                        .sum();
                    at.put(out, r, j, y);
                }
            }
        }
    }
}

/// The x86-64 INT8 dot products. Both instruction sets compute, per lane of 4 columns, the
/// exact integer sum `Σ w · x`, convert it to F32 and accumulate it times its group's
/// `ws · xs` with one FMA into one of 16 F32 lanes — lanes 0..8 take the even groups, 8..16
/// the odd ones (one 512-bit vector on AVX-512, two 256-bit vectors on AVX2) — and finally add
/// the two halves lane by lane and sum the 8 lanes in one fixed order. The same integers meet
/// the same F32 operations in the same order: both give the same bits, and an output does not
/// depend on the tile it was computed in. Scales are handled 8 groups at a time (one F16C
/// conversion per weight row, one multiply per weight row and token), then moved to the lanes
/// of each group by one permute (AVX-512) or broadcast from memory (AVX2). Decode tiles take 4
/// weight rows (with the weights streamed from DRAM on a 2-core Xeon, 1- or 2-row tiles and no
/// prefetch were slower, 8 rows no faster), each a quarter of its task's block apart and
/// prefetching its own stream [`SPLIT_PREFETCH_ROWS`] ahead.
#[cfg(target_arch = "x86_64")]
mod x86_int8 {
    use std::arch::x86_64::*;

    use crate::kernels::x86_simd::hsum256;

    use super::{ActRow, FeatureBlock, Int8Rows, OutPlace, INT8_GROUP, SPLIT_PREFETCH_ROWS};

    /// Checks that the weight rows and `rows` hold whole groups (and their offsets when
    /// `offsets`); the output checks its own places.
    fn check(w: &Int8Rows, rows: &[ActRow], offsets: bool) {
        let (groups, n) = (w.groups, w.len());
        assert!(n >= 1 && w.q.len() >= w.q_at(n - 1, groups));
        assert!(w.scales.len() >= w.scale_at(n - 1, groups));
        assert!(!rows.is_empty());
        for r in rows {
            let ok = r.q.len() >= groups * INT8_GROUP
                && r.scales.len() >= groups
                && (!offsets || r.offsets.len() >= groups * INT8_GROUP / 4);
            assert!(ok, "activation row shorter than the weight rows");
        }
    }

    /// Prefetches the line of `w`'s stream that the kernel reads later at the place of byte
    /// `at`: [`SPLIT_PREFETCH_ROWS`] rows ahead in a decode tile's rows (spaced apart), else
    /// `R` rows ahead, the same place in the same row of the next tile of `R` adjacent rows,
    /// which the kernel reads one tile's time later. (A fixed
    /// distance ahead of each row, such as 4 KiB, lands in a row of the current tile — already
    /// loaded — for all but the last rows, and the next tile's other rows then arrive late:
    /// 200 MB of 2048 × 2048 INT8 matrices at M = 1 read 11–13 GB/s on AVX2 that way against
    /// 17–18 now, as fast as the BF16 kernel reads its twice as many bytes.) Into L2
    /// ([`prefetch_l2`](crate::kernels::x86_simd::prefetch_l2); Zen 4 EPYC, `bench
    /// --dense-weights int8`, 5 pairs alternating with `prefetcht0`: 1.17× tok/s median).
    /// Never faults, past the end of the matrix too.
    #[inline(always)]
    fn prefetch_next_tile<const R: usize>(w: &Int8Rows, at: usize) {
        let rows_ahead = if w.spacing == 1 {
            R
        } else {
            SPLIT_PREFETCH_ROWS
        };
        let ahead =
            w.q.as_ptr()
                .wrapping_add(at + rows_ahead * w.groups * INT8_GROUP);
        crate::kernels::x86_simd::prefetch_l2(ahead as *const u8);
    }

    /// The scales of groups `g0..g0 + 8` (zero past the row's end): `ws_r · xs_t` in F32 for
    /// weight row `r` and token `t`.
    ///
    /// # Safety
    /// AVX2 + F16C; `check` holds and `g0 < w.groups`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn run_scales<const R: usize, const T: usize>(
        w: &Int8Rows,
        rows: &[ActRow],
        g0: usize,
    ) -> [[__m256; T]; R] {
        let n = (w.groups - g0).min(8);
        let mut s = [[_mm256_setzero_ps(); T]; R];
        let mut xs = [_mm256_setzero_ps(); T];
        for (x, row) in xs.iter_mut().zip(rows) {
            *x = if n == 8 {
                _mm256_loadu_ps(row.scales.as_ptr().add(g0))
            } else {
                let mut v = [0f32; 8];
                v[..n].copy_from_slice(&row.scales[g0..g0 + n]);
                _mm256_loadu_ps(v.as_ptr())
            };
        }
        for (r, s) in s.iter_mut().enumerate() {
            let first = w.scales.as_ptr().add(w.scale_at(r, g0));
            let sw = if n == 8 {
                _mm256_cvtph_ps(_mm_loadu_si128(first as *const __m128i))
            } else {
                let mut bits = [0u16; 8];
                for (i, b) in bits.iter_mut().take(n).enumerate() {
                    *b = (*first.add(i)).to_bits();
                }
                _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i))
            };
            for (s, x) in s.iter_mut().zip(xs) {
                *s = _mm256_mul_ps(sw, x);
            }
        }
        s
    }

    /// Group `g` (index `i` in its run of 8, scales `s`) on AVX2: the exact pair sums of `w · x`
    /// by `vpmaddubsw` of one operand's magnitudes and the other with its signs (products of two
    /// values in `[-127, 127]` pair-summed stay within i16), then `vpmaddwd` by ones to the lane
    /// sums; times the scale `s[r][t][i]` broadcast from memory, into `acc[r][t]` (the
    /// accumulators of group `i`'s parity). The magnitudes are taken of the operand the tile
    /// shares: `|x|` once per token when there are more weight rows than tokens (decode), `|w|`
    /// once per row otherwise — one `vpsignb` per row and token instead of two, and the same
    /// integers.
    ///
    /// # Safety
    /// AVX2 + FMA; `check` holds and `g < w.groups`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group_avx2<const R: usize, const T: usize>(
        w: &Int8Rows,
        rows: &[ActRow],
        s: &[[[f32; 8]; T]; R],
        (g, i): (usize, usize),
        acc: &mut [[__m256; T]; R],
    ) {
        let shared_x = R > T;
        let x: [__m256i; T] = std::array::from_fn(|t| {
            _mm256_loadu_si256(rows[t].q.as_ptr().add(g * INT8_GROUP) as *const __m256i)
        });
        let abs_x: [__m256i; T] = std::array::from_fn(|t| {
            if shared_x {
                _mm256_sign_epi8(x[t], x[t])
            } else {
                x[t]
            }
        });
        for r in 0..R {
            let at = w.q_at(r, g);
            if i % 2 == 0 {
                // One prefetch per 64-byte line, as on AVX-512.
                prefetch_next_tile::<R>(w, at);
            }
            let wv = _mm256_loadu_si256(w.q.as_ptr().add(at) as *const __m256i);
            let abs_w = if shared_x {
                wv
            } else {
                _mm256_sign_epi8(wv, wv)
            };
            for t in 0..T {
                let prod = if shared_x {
                    _mm256_maddubs_epi16(abs_x[t], _mm256_sign_epi8(wv, x[t]))
                } else {
                    _mm256_maddubs_epi16(abs_w, _mm256_sign_epi8(x[t], wv))
                };
                let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
                let scale = _mm256_broadcast_ss(&s[r][t][i]);
                acc[r][t] = _mm256_fmadd_ps(sums, scale, acc[r][t]);
            }
        }
    }

    /// `int8_dots` on AVX2 for `R` weight rows × `T` tokens.
    ///
    /// # Safety
    /// AVX2 + FMA + F16C; `check` holds.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots_avx2_t<const R: usize, const T: usize>(
        w: &Int8Rows,
        rows: &[ActRow],
        out: &mut FeatureBlock,
        at: OutPlace,
    ) {
        let groups = w.groups;
        // The even and odd groups' accumulators: two arrays, each indexed by constants only, so
        // that they stay in registers, and the scales in memory, broadcast by the loads
        // themselves: 16 registers hold the 4-row decode tile without spilling an accumulator.
        // (Accumulators in memory, as with one array indexed by the group's parity or with the
        // scales in registers, make every FMA wait on the store of the one before.)
        let mut even = [[_mm256_setzero_ps(); T]; R];
        let mut odd = [[_mm256_setzero_ps(); T]; R];
        let mut s = [[[0f32; 8]; T]; R];
        for g0 in (0..groups).step_by(8) {
            for (s, v) in s.iter_mut().zip(run_scales::<R, T>(w, rows, g0)) {
                for (s, v) in s.iter_mut().zip(v) {
                    _mm256_storeu_ps(s.as_mut_ptr(), v);
                }
            }
            // Opaque to the compiler, which would otherwise keep the scales in registers.
            let s = std::hint::black_box(&s);
            if g0 + 8 <= groups {
                for i in (0..8).step_by(2) {
                    group_avx2(w, rows, s, (g0 + i, i), &mut even);
                    group_avx2(w, rows, s, (g0 + i + 1, i + 1), &mut odd);
                }
            } else {
                let n = groups - g0;
                for i in (0..n).step_by(2) {
                    group_avx2(w, rows, s, (g0 + i, i), &mut even);
                    if i + 1 < n {
                        group_avx2(w, rows, s, (g0 + i + 1, i + 1), &mut odd);
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                at.put(out, r, t, hsum256(_mm256_add_ps(even[r][t], odd[r][t])));
            }
        }
    }

    /// Lanes 0..8 of a 512-bit vector of F32 plus lanes 8..16, summed in `hsum256`'s order.
    ///
    /// # Safety
    /// AVX-512F + AVX2.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn fold_hsum(a: __m512) -> f32 {
        let even = _mm512_castps512_ps256(a);
        let odd = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        hsum256(_mm256_add_ps(even, odd))
    }

    /// Groups `g, g + 1` (chunk `j` of their run, scales `s`) on AVX-512 VNNI: the weights
    /// offset to unsigned bytes (`w + 128`, one XOR) so that one `vpdpbusd` starting from the
    /// row's offsets gives the lane sums of both groups; into `acc[r][t]`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VNNI; `check` holds and `g + 1 < w.groups`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn pair_vnni<const R: usize, const T: usize>(
        w: &Int8Rows,
        rows: &[ActRow],
        s: &[[__m256; T]; R],
        (g, j): (usize, i32),
        acc: &mut [[__m512; T]; R],
    ) {
        // Lanes 0..8 take group 2j's scale, lanes 8..16 group 2j + 1's.
        let (a, b) = (2 * j, 2 * j + 1);
        let idx = _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
        let x: [__m512i; T] = std::array::from_fn(|t| {
            _mm512_loadu_si512(rows[t].q.as_ptr().add(g * INT8_GROUP) as *const _)
        });
        for r in 0..R {
            let at = w.q_at(r, g);
            prefetch_next_tile::<R>(w, at);
            let wv = _mm512_loadu_si512(w.q.as_ptr().add(at) as *const _);
            let wv = _mm512_xor_si512(wv, _mm512_set1_epi8(i8::MIN));
            for t in 0..T {
                let init = _mm512_loadu_si512(rows[t].offsets.as_ptr().add(g * 8) as *const _);
                let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, wv, x[t]));
                let scale = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(s[r][t]));
                acc[r][t] = _mm512_fmadd_ps(sums, scale, acc[r][t]);
            }
        }
    }

    /// Group `g` alone (index `i` in its run, scales `s`), the last of an odd count: as
    /// [`pair_vnni`] on 256 bits, into lanes 0..8 of `acc[r][t]`.
    ///
    /// # Safety
    /// AVX-512 F/VL/VNNI + AVX2; `check` holds and `g < w.groups`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma")]
    unsafe fn single_vnni<const R: usize, const T: usize>(
        w: &Int8Rows,
        rows: &[ActRow],
        s: &[[__m256; T]; R],
        (g, i): (usize, usize),
        acc: &mut [[__m512; T]; R],
    ) {
        let lane = _mm256_set1_epi32(i as i32);
        for r in 0..R {
            let at = w.q_at(r, g);
            let wv = _mm256_loadu_si256(w.q.as_ptr().add(at) as *const __m256i);
            let wv = _mm256_xor_si256(wv, _mm256_set1_epi8(i8::MIN));
            for t in 0..T {
                let row = &rows[t];
                let init = _mm256_loadu_si256(row.offsets.as_ptr().add(g * 8) as *const _);
                let x = _mm256_loadu_si256(row.q.as_ptr().add(g * INT8_GROUP) as *const _);
                let sums = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(init, wv, x));
                let scale = _mm256_permutevar8x32_ps(s[r][t], lane);
                acc[r][t] = _mm512_mask3_fmadd_ps(
                    _mm512_castps256_ps512(sums),
                    _mm512_castps256_ps512(scale),
                    acc[r][t],
                    0x00ff,
                );
            }
        }
    }

    /// `int8_dots` on AVX-512 VNNI for `R` weight rows × `T` tokens.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI + AVX2 + FMA + F16C; `check` holds.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dots_vnni_t<const R: usize, const T: usize>(
        w: &Int8Rows,
        rows: &[ActRow],
        out: &mut FeatureBlock,
        at: OutPlace,
    ) {
        let groups = w.groups;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for g0 in (0..groups).step_by(8) {
            let s = run_scales::<R, T>(w, rows, g0);
            if g0 + 8 <= groups {
                for j in 0..4 {
                    pair_vnni(w, rows, &s, (g0 + 2 * j, j as i32), &mut acc);
                }
            } else {
                let n = groups - g0;
                for j in 0..n / 2 {
                    pair_vnni(w, rows, &s, (g0 + 2 * j, j as i32), &mut acc);
                }
                if n % 2 == 1 {
                    single_vnni(w, rows, &s, (groups - 1, n - 1), &mut acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (t, a) in acc.iter().enumerate() {
                at.put(out, r, t, fold_hsum(*a));
            }
        }
    }

    /// Defines `$name`, `int8_dots` on one instruction set, by dispatching the tiles (weight
    /// rows, tokens) it takes to the const-generic body `$body`.
    macro_rules! dispatch_tile {
        ($name:ident, $body:ident, $features:literal, offsets: $offsets:literal,
         tiles: [$(($r:literal, $t:literal)),*]) => {
            /// `int8_dots` on one instruction set (see the module).
            ///
            /// # Safety
            /// The CPU must support the target features.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                w: &Int8Rows,
                rows: &[ActRow],
                out: &mut FeatureBlock,
                at: OutPlace,
            ) {
                check(w, rows, $offsets);
                match (w.len(), rows.len()) {
                    $(($r, $t) => $body::<$r, $t>(w, rows, out, at),)*
                    (r, t) => panic!("{r} weight rows × {t} tokens: not a tile of int8_matmul"),
                }
            }
        };
    }
    // Decode tiles of 1 to 4 rows; one row by up to 4 tokens for several tokens (16 `ymm`
    // registers hold no more accumulators).
    dispatch_tile!(dots_avx2, dots_avx2_t, "avx2,fma,f16c", offsets: false,
        tiles: [(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (1, 3), (1, 4)]);
    // As AVX2, and up to 4 rows by up to 4 tokens for several tokens
    // ([`super::PREFILL_TILE_ROWS`]).
    dispatch_tile!(
        dots_vnni,
        dots_vnni_t,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        offsets: true,
        tiles: [(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (1, 3), (1, 4), (2, 2), (2, 3),
            (2, 4), (3, 2), (3, 3), (3, 4), (4, 2), (4, 3), (4, 4)]
    );
}
