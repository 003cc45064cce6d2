//! The CPU W4A16 / W4A8 kernel: fused top-k routed experts computed straight from INT4 slabs.
//!
//! Activations are quantized on the fly per K-group, to `i16` for calls of fewer than
//! [`W4A8_MIN_TOKENS`] tokens (decode: scale = group absmax / [`DECODE_ACT_MAX`], an error of at
//! most 1/3854 of the group's largest value — FP16's own rounding for the values that dominate
//! the dot product) and to `i8` for longer calls (prefill: absmax / 127, as llama.cpp's Q8_K
//! activations; an error of at most 1/254 of the group's largest value, a tenth of what the INT4
//! weights already lose). Inside a group, nibble × activation products are summed exactly in
//! integers: `vpmaddwd` on AVX2 and `vpdpwssd` on AVX-512 VNNI for `i16`; `vpmaddubsw`
//! (unsigned nibble × signed byte, at most 2 · 15 · 127 per pair) summed in `i16` over the
//! group's at most 8 chunks (≤ 30 480, no saturation) and widened once per group for `i8`. Each
//! group's sum is scaled by `weight_scale · activation_scale` and accumulated in F32. The `−8`
//! nibble offset is folded in exactly as `−8 · Σ q_x` per group, precomputed once per
//! activation row. On AVX-512 VNNI, matrices that several tokens share (prefill) take the weight
//! rows in vector lanes instead (`row_lanes`): 16 rows transposed once per call, no horizontal
//! sums, the same bits.
//!
//! Work is split with rayon: first over (expert, block of intermediate rows) for gate/up and
//! SiLU·up, then over blocks of hidden rows for the down projection and the weighted combine,
//! each block walking the experts in ascending order. Every expert's bytes are read once per call
//! and the summation order does not depend on the thread count or on residency, so results are
//! reproducible bit for bit.

use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use half::f16;
use rayon::prelude::*;

use super::{round_to_i32, RoutePlan};
use crate::pack::layout::{CHUNK_BYTES, CHUNK_WEIGHTS, CPU_LANE_COLUMN};
use crate::pack::{ExpertLayout, QMatrixLayout};

/// Calls with at least this many tokens (prefill chunks) quantize activations to `i8` and use
/// the byte dot products; shorter ones (decode) keep `i16` activations.
pub const W4A8_MIN_TOKENS: usize = 16;

/// The largest `i16` activation level (decode): `absmax / DECODE_ACT_MAX` is a group's scale.
/// 1927 is the most that keeps `b − 16 · a` inside `i16` for any two levels (17 · 1927 ≤
/// 32767): the kernels store each byte's high-nibble activation `b` folded that way and
/// multiply the low-nibble activation `a` by the whole byte,
/// `(lo + 16 · hi) · a + hi · (b − 16 · a) = lo · a + hi · b`, which saves the AVX2 loop a mask
/// per chunk (one vector instruction in seven). The rounding error, at most 1/3854 of the
/// group's largest value, is that of FP16 (the CUDA kernels' activations) for the values that
/// dominate the dot product.
pub const DECODE_ACT_MAX: i16 = 1927;

/// The activations of the INT4 kernel in calls of fewer than [`W4A8_MIN_TOKENS`] tokens
/// (decode). Calls of more always quantize to `i8`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeActivations {
    /// `i16` at [`DECODE_ACT_MAX`] levels: FP16's rounding, for an error of up to 1/3854 of
    /// each group's largest value, at twice `I8`'s instructions per weight.
    I16,
    /// `i8` at 127 levels, as prefill and llama.cpp's Q8 activations (the default): half the
    /// instructions per weight (one OLMoE layer at T = 1, from L3 on one thread of a Granite
    /// Rapids-class Xeon: 0.29–0.30 ms against 0.36–0.39), for an error of up to 1/254 of each
    /// group's largest value, which moves the next-token distribution by a KL of 2–5e-5
    /// against the 1e-2 of the INT4 weights themselves.
    #[default]
    I8,
}

impl std::str::FromStr for DecodeActivations {
    type Err = crate::QmoeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_name(&s.to_ascii_lowercase()).ok_or_else(|| {
            crate::QmoeError::unsupported(
                "decode activations",
                s,
                "are not supported (expected i16 or i8)",
            )
        })
    }
}

/// The process-wide [`DecodeActivations`]: 0 until set, then 1 + its index.
static DECODE_ACTIVATIONS: AtomicU8 = AtomicU8::new(0);

impl DecodeActivations {
    /// The environment variable that chooses the process-wide activations when nothing has
    /// set them ([`DecodeActivations::current`]).
    pub const ENV: &'static str = "QMOE_DECODE_ACTS";

    /// The name `--decode-acts` and `QMOE_DECODE_ACTS` take: `i16` or `i8`.
    pub fn name(self) -> &'static str {
        match self {
            Self::I16 => "i16",
            Self::I8 => "i8",
        }
    }

    /// The activations named `name` (`i16` or `i8`).
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::I16, Self::I8].into_iter().find(|a| a.name() == name)
    }

    /// The process-wide choice, which [`crate::Int4Experts`] without its own and the
    /// residency cache compute with: the last [`DecodeActivations::set_current`], else the
    /// environment variable `QMOE_DECODE_ACTS` (`i16`, `i8`; read once), else the default
    /// `I8`.
    pub fn current() -> Self {
        match DECODE_ACTIVATIONS.load(Ordering::Relaxed) {
            1 => Self::I16,
            2 => Self::I8,
            _ => {
                static FROM_ENV: OnceLock<DecodeActivations> = OnceLock::new();
                *FROM_ENV.get_or_init(|| match std::env::var(Self::ENV) {
                    Err(_) => Self::default(),
                    Ok(name) => Self::from_name(&name).unwrap_or_else(|| {
                        let default = Self::default().name();
                        eprintln!("QMOE_DECODE_ACTS={name} is not one of i16, i8; using {default}");
                        Self::default()
                    }),
                })
            }
        }
    }

    /// Sets the process-wide choice (`--decode-acts`).
    pub fn set_current(self) {
        let v = match self {
            Self::I16 => 1,
            Self::I8 => 2,
        };
        DECODE_ACTIVATIONS.store(v, Ordering::Relaxed);
    }

    /// Whether a call of `tokens` tokens quantizes its activations to `i8`.
    pub fn int8_at(self, tokens: usize) -> bool {
        self == Self::I8 || tokens >= W4A8_MIN_TOKENS
    }
}

/// Instruction set used by the CPU kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuIsa {
    /// Portable Rust, any target.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL + VNNI (+ AVX2, FMA, F16C).
    Avx512Vnni,
}

impl CpuIsa {
    /// Every instruction set, best first.
    pub const ALL: [CpuIsa; 3] = [CpuIsa::Avx512Vnni, CpuIsa::Avx2, CpuIsa::Scalar];

    /// The name `QMOE_CPU_ISA` takes: `avx512`, `avx2` or `portable`.
    pub fn name(self) -> &'static str {
        match self {
            CpuIsa::Avx512Vnni => "avx512",
            CpuIsa::Avx2 => "avx2",
            CpuIsa::Scalar => "portable",
        }
    }

    /// The instruction set named `name` (see [`CpuIsa::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|isa| isa.name() == name)
    }

    /// The best instruction set this CPU supports (checked at run time, once), or the one the
    /// environment variable `QMOE_CPU_ISA` names (`avx512`, `avx2`, `portable`) when this CPU
    /// can run it — to compare paths on one machine; an unknown or unsupported name is reported
    /// on stderr and ignored.
    pub fn detect() -> Self {
        static ISA: std::sync::OnceLock<CpuIsa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Self::ALL
                .into_iter()
                .find(|isa| isa.is_available())
                .unwrap_or(CpuIsa::Scalar);
            let Ok(wanted) = std::env::var("QMOE_CPU_ISA") else {
                return best;
            };
            match Self::from_name(&wanted) {
                Some(isa) if isa.is_available() => isa,
                Some(_) => {
                    eprintln!(
                        "QMOE_CPU_ISA={wanted}: this CPU lacks it; using {}",
                        best.name()
                    );
                    best
                }
                None => {
                    eprintln!(
                        "QMOE_CPU_ISA={wanted} is not one of avx512, avx2, portable; using {}",
                        best.name()
                    );
                    best
                }
            }
        })
    }

    /// Whether this CPU can run `self`.
    pub fn is_available(self) -> bool {
        match self {
            CpuIsa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx512Vnni => {
                // Its kernels also use AVX2 and FMA (every AVX-512 CPU has them; checked anyway).
                CpuIsa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// Lane of each column within a chunk (inverse of [`CPU_LANE_COLUMN`]).
const LANE_OF_COLUMN: [usize; CHUNK_WEIGHTS] = {
    let mut out = [0usize; CHUNK_WEIGHTS];
    let mut lane = 0;
    while lane < CHUNK_WEIGHTS {
        out[CPU_LANE_COLUMN[lane]] = lane;
        lane += 1;
    }
    out
};

/// An integer type activations are quantized to: `i16` (decode) or `i8` (prefill).
trait ActInt: Copy + Default + Send + Sync + Into<i32> {
    /// The largest magnitude a quantized activation takes.
    const MAX: f32;
    /// The level `v`, clamped to `±MAX`.
    fn from_level(v: i32) -> Self;
    /// Whether a chunk's high-nibble activations are stored folded (see [`DECODE_ACT_MAX`]):
    /// lane `16 + j` holds `b_j − 16 · a_j`, and lane `j`'s activation `a_j` multiplies the
    /// whole byte `j`, not only its low nibble.
    const FOLDED: bool;
    /// Whether a decode tile's weight rows come from separate runs of the rows a task
    /// computes (`tile_block!`): a sequential stream per row, which the hardware prefetcher
    /// follows, instead of adjacent rows, whose 64-byte blocks alternate within a page. One
    /// OLMoE layer at T = 1 on 2 threads of a Zen 4 EPYC (`layer_bench`, binaries
    /// alternating, 5 pairs): 0.83–0.89 ms against 0.97–1.12 with `i8` activations; with
    /// `i16`'s about 2% slower than adjacent rows (scratch build), so those stay adjacent.
    /// Read by the x86 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const SPLIT_DECODE_TILES: bool;
    /// Folds one chunk of quantized activations in place if [`ActInt::FOLDED`].
    fn fold(chunk: &mut [Self]);
    /// Most activation rows sharing one pass over a weight row on `isa`: as many as keep the
    /// accumulators in registers.
    fn token_block(isa: CpuIsa) -> usize;
    /// The instruction set whose kernel computes groups of `chunks_per_group` chunks when
    /// `isa` is chosen (the same bits either way): the AVX-512 kernels read whole word blocks
    /// of a group, so groups of 32 and 64 weights take the AVX2 kernel.
    fn kernel_isa(isa: CpuIsa, chunks_per_group: usize) -> CpuIsa {
        match isa {
            CpuIsa::Avx512Vnni if chunks_per_group < WORD_BLOCK_CHUNKS => CpuIsa::Avx2,
            isa => isa,
        }
    }
    /// Whether `isa`'s kernel for blocks of `tb` activation rows takes them in word blocks
    /// ([`WORD_BLOCK_CHUNKS`]).
    fn word_blocks(isa: CpuIsa, tb: usize) -> bool;
    /// Places chunk `l` of a word block, `src` in the plain lane order (low nibbles' levels,
    /// then high nibbles'), into the block's `WORD_BLOCK_WEIGHTS` levels of one row.
    fn place_in_word_block(block: &mut [Self], l: usize, src: &[Self]);
    /// Computes the first rows of [`block_rows`] with a kernel that takes every block of
    /// activation rows at once, where `isa` has one for `T` and these blocks; returns how many
    /// rows it computed (none by default).
    fn block_rows_at_once(
        _isa: CpuIsa,
        _shape: DotShape,
        _m: &PackedMatrix,
        _rows: Range<usize>,
        _blocks: &[ActBlock<Self>],
        _out: &mut [f32],
    ) -> usize {
        0
    }
    /// `out[r · TB + t] = row_{rows.start + r} · acts[t]` for a block of rows of `m`.
    fn block<const TB: usize>(
        isa: CpuIsa,
        shape: DotShape,
        m: &PackedMatrix,
        rows: Range<usize>,
        acts: &ActBlock<Self>,
        out: &mut [f32],
    );
}

/// Rows of activations quantized to `T` per K-group, in the kernels' lane order.
#[derive(Clone, Debug)]
struct QuantActs<T> {
    padded_cols: usize,
    groups: usize,
    chunks_per_group: usize,
    q: Vec<T>,
    scale: Vec<f32>,
    corr: Vec<i32>,
}

/// Most activation rows in one [`ActBlock`].
const MAX_TOKEN_BLOCK: usize = 8;

/// Chunks in one word block: the AVX-512 decode kernel reads a row 64 bytes at a time as 32
/// little-endian 16-bit words, word `k` of 128-bit lane `l` holding bytes `2k` and `2k + 1` of
/// the block's chunk `l`, and splits them into four vectors: even bytes whole, odd bytes whole,
/// even bytes' high nibbles, odd bytes' high nibbles. Its activations come in the matching
/// order: per block and activation row, [`WORD_BLOCK_WEIGHTS`] levels, 32 per vector, lane
/// `8l + k` of each taking chunk `l`'s activation of byte `2k` (low lane, folded), `2k + 1`
/// (low), `2k` (high) and `2k + 1` (high). Groups of at least this many chunks (128 and 256
/// weights) start on a block; a group's short tail ends in a block padded with zeros.
const WORD_BLOCK_CHUNKS: usize = 4;

/// Activation levels per row of one word block ([`WORD_BLOCK_CHUNKS`]).
const WORD_BLOCK_WEIGHTS: usize = WORD_BLOCK_CHUNKS * CHUNK_WEIGHTS;

/// Up to [`MAX_TOKEN_BLOCK`] activation rows interleaved for one pass over a weight row:
/// chunk `c` of row `t` at `q[(c · tb + t) · 32..]`, so that the kernels address every row from
/// one pointer (with `words`, word block `p` of row `t` at `q[(p · tb + t) · 128..]` in the
/// order of [`WORD_BLOCK_CHUNKS`]), and group `g`'s scale and `−8` correction of row `t` at
/// `[g · MAX_TOKEN_BLOCK + t]` (zero beyond `tb`), so that one vector load takes a group's for
/// every row; the same row by row at `row_scale[t · groups + g]` and `row_corr[..]`, so that
/// one load takes a row's for 8 consecutive groups.
struct ActBlock<T> {
    tb: usize,
    words: bool,
    q: Vec<T>,
    scale: Vec<f32>,
    row_scale: Vec<f32>,
    corr: Vec<i32>,
    row_corr: Vec<i32>,
}

impl<T: ActInt> QuantActs<T> {
    /// Quantizes row-major `x [rows, cols]` with groups of `group_size` columns.
    fn new(x: &[f32], rows: usize, cols: usize, group_size: usize) -> Self {
        let padded_cols = cols.div_ceil(CHUNK_WEIGHTS) * CHUNK_WEIGHTS;
        let groups = cols.div_ceil(group_size);
        let mut q = vec![T::default(); rows * padded_cols];
        let mut scale = vec![0f32; rows * groups];
        let mut corr = vec![0i32; rows * groups];
        if rows == 1 {
            // One row (decode's input): a parallel op would cost more than the row.
            quantize_row(x, &mut q, &mut scale, &mut corr, group_size);
        } else {
            q.par_chunks_mut(padded_cols)
                .zip(scale.par_chunks_mut(groups))
                .zip(corr.par_chunks_mut(groups))
                .zip(x.par_chunks(cols))
                .for_each(|(((q, scale), corr), x)| quantize_row(x, q, scale, corr, group_size));
        }
        Self {
            padded_cols,
            groups,
            chunks_per_group: group_size / CHUNK_WEIGHTS,
            q,
            scale,
            corr,
        }
    }

    /// Rows `rows` in interleaved blocks of at most [`ActInt::token_block`] rows, as few as
    /// that allows and of sizes differing by at most one (9 rows: 5 and 4, not 8 and 1, whose
    /// lone row would take a pass over the weights of its own), in word blocks where `isa`'s
    /// kernel for the block reads them ([`ActInt::word_blocks`]) and the groups hold whole
    /// word blocks.
    fn blocks(&self, rows: &[usize], isa: CpuIsa) -> Vec<ActBlock<T>> {
        let (chunks, groups) = (self.padded_cols / CHUNK_WEIGHTS, self.groups);
        let parts = rows.len().div_ceil(T::token_block(isa));
        let mut rest = rows;
        (0..parts)
            .map(|i| {
                let len = rows.len() / parts + usize::from(i < rows.len() % parts);
                let (rs, tail) = rest.split_at(len);
                rest = tail;
                rs
            })
            .map(|rs| {
                let tb = rs.len();
                let words = T::word_blocks(isa, tb) && self.chunks_per_group >= WORD_BLOCK_CHUNKS;
                let unit = if words { WORD_BLOCK_CHUNKS } else { 1 };
                let mut blk = ActBlock {
                    tb,
                    words,
                    q: vec![T::default(); chunks.div_ceil(unit) * unit * tb * CHUNK_WEIGHTS],
                    scale: vec![0f32; groups * MAX_TOKEN_BLOCK],
                    row_scale: Vec::with_capacity(tb * groups),
                    corr: vec![0i32; groups * MAX_TOKEN_BLOCK],
                    row_corr: Vec::with_capacity(tb * groups),
                };
                for (t, &r) in rs.iter().enumerate() {
                    let q = &self.q[r * self.padded_cols..(r + 1) * self.padded_cols];
                    for (c, src) in q.chunks_exact(CHUNK_WEIGHTS).enumerate() {
                        if words {
                            let (p, l) = (c / WORD_BLOCK_CHUNKS, c % WORD_BLOCK_CHUNKS);
                            let at = (p * tb + t) * WORD_BLOCK_WEIGHTS;
                            T::place_in_word_block(&mut blk.q[at..at + WORD_BLOCK_WEIGHTS], l, src);
                        } else {
                            let at = (c * tb + t) * CHUNK_WEIGHTS;
                            blk.q[at..at + CHUNK_WEIGHTS].copy_from_slice(src);
                        }
                    }
                    let row_scale = &self.scale[r * groups..(r + 1) * groups];
                    blk.row_scale.extend_from_slice(row_scale);
                    let row_corr = &self.corr[r * groups..(r + 1) * groups];
                    blk.row_corr.extend_from_slice(row_corr);
                    for (g, (&s, &c)) in row_scale.iter().zip(row_corr).enumerate() {
                        blk.scale[g * MAX_TOKEN_BLOCK + t] = s;
                        blk.corr[g * MAX_TOKEN_BLOCK + t] = c;
                    }
                }
                blk
            })
            .collect()
    }
}

/// One activation row `x` quantized per group of `group_size` into `q` (lanes in the chunk
/// order, folded if [`ActInt::FOLDED`]), its groups' scales and `−8 ·` level sums. Compiled for
/// AVX2 where the CPU has it: the division and rounding then run 8 lanes at a time (the same
/// IEEE operations, so the same levels).
fn quantize_row<T: ActInt>(
    x: &[f32],
    q: &mut [T],
    scale: &mut [f32],
    corr: &mut [i32],
    group_size: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { quantize_row_avx2(x, q, scale, corr, group_size) };
    }
    quantize_row_body(x, q, scale, corr, group_size)
}

/// [`quantize_row`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2<T: ActInt>(
    x: &[f32],
    q: &mut [T],
    scale: &mut [f32],
    corr: &mut [i32],
    group_size: usize,
) {
    quantize_row_body(x, q, scale, corr, group_size)
}

/// The body of [`quantize_row`]: the levels of a group and their sum in one loop without
/// stores to scattered lanes, so that it vectorizes; then placed in their lanes.
#[inline(always)]
fn quantize_row_body<T: ActInt>(
    x: &[f32],
    q: &mut [T],
    scale: &mut [f32],
    corr: &mut [i32],
    group_size: usize,
) {
    let mut levels = vec![0i32; group_size];
    for (gi, (scale, corr)) in scale.iter_mut().zip(corr.iter_mut()).enumerate() {
        let c0 = gi * group_size;
        let xs = &x[c0..(c0 + group_size).min(x.len())];
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            continue;
        }
        let s = amax / T::MAX;
        let levels = &mut levels[..xs.len()];
        let mut sum = 0i32;
        for (l, &v) in levels.iter_mut().zip(xs) {
            *l = T::from_level(round_to_i32(v / s)).into();
            sum += *l;
        }
        // Whole chunks lane by lane (a load from the chunk's column, a store in order), the
        // short tail of a row column by column (its missing lanes stay 0).
        let whole = levels.len() / CHUNK_WEIGHTS * CHUNK_WEIGHTS;
        let (head, tail) = levels.split_at(whole);
        for (dst, src) in q[c0..c0 + whole]
            .chunks_exact_mut(CHUNK_WEIGHTS)
            .zip(head.chunks_exact(CHUNK_WEIGHTS))
        {
            for (d, &col) in dst.iter_mut().zip(&CPU_LANE_COLUMN) {
                *d = T::from_level(src[col]);
            }
        }
        for (c, &l) in (c0 + whole..).zip(tail) {
            let lane = (c / CHUNK_WEIGHTS) * CHUNK_WEIGHTS + LANE_OF_COLUMN[c % CHUNK_WEIGHTS];
            q[lane] = T::from_level(l);
        }
        *scale = s;
        *corr = -8 * sum;
    }
    q.chunks_exact_mut(CHUNK_WEIGHTS).for_each(T::fold);
}

/// One packed matrix of a slab: weights and raw little-endian FP16 scales.
#[derive(Clone, Copy)]
struct PackedMatrix<'a> {
    weights: &'a [u8],
    scales: &'a [u8],
    /// Bytes of one row's weights.
    row_bytes: usize,
    /// Bytes of one row's scales.
    row_scale_bytes: usize,
}

impl<'a> PackedMatrix<'a> {
    fn new(layout: QMatrixLayout, weights: &'a [u8], scales: &'a [u8]) -> Self {
        Self {
            weights,
            scales,
            row_bytes: layout.row_bytes(),
            row_scale_bytes: 2 * layout.groups(),
        }
    }

    #[inline]
    fn row(&self, n: usize) -> (&'a [u8], &'a [u8]) {
        let (rb, sb) = (self.row_bytes, self.row_scale_bytes);
        (
            &self.weights[n * rb..(n + 1) * rb],
            &self.scales[n * sb..(n + 1) * sb],
        )
    }
}

/// Group geometry shared by a row and its activations.
#[derive(Clone, Copy)]
struct DotShape {
    chunks: usize,
    groups: usize,
    chunks_per_group: usize,
}

impl DotShape {
    fn of(layout: QMatrixLayout) -> Self {
        Self {
            chunks: layout.padded_cols() / CHUNK_WEIGHTS,
            groups: layout.groups(),
            chunks_per_group: layout.group_size.get() / CHUNK_WEIGHTS,
        }
    }
    /// Checks a row's weights and scales and the activations cover the geometry, so the
    /// SIMD loops stay in bounds.
    fn check<T, const TB: usize>(&self, w: &[u8], s: &[u8], acts: &ActBlock<T>) {
        assert!(w.len() >= self.chunks * CHUNK_BYTES && s.len() >= 2 * self.groups);
        self.check_acts::<T, TB>(acts);
    }
    /// [`check`](Self::check) for every row of `m` at once.
    #[cfg(target_arch = "x86_64")]
    fn check_matrix<T, const TB: usize>(&self, m: &PackedMatrix, acts: &ActBlock<T>) {
        assert!(m.row_bytes >= self.chunks * CHUNK_BYTES && m.row_scale_bytes >= 2 * self.groups);
        self.check_acts::<T, TB>(acts);
    }
    /// Checks the activations cover the geometry.
    fn check_acts<T, const TB: usize>(&self, acts: &ActBlock<T>) {
        let unit = if acts.words { WORD_BLOCK_CHUNKS } else { 1 };
        let padded_chunks = self.chunks.div_ceil(unit) * unit;
        assert!(acts.tb == TB && acts.q.len() >= padded_chunks * TB * CHUNK_WEIGHTS);
        assert!(!acts.words || self.chunks_per_group >= WORD_BLOCK_CHUNKS);
        let lanes = self.groups * MAX_TOKEN_BLOCK;
        assert!(TB <= MAX_TOKEN_BLOCK && acts.scale.len() >= lanes && acts.corr.len() >= lanes);
        assert!(
            acts.row_scale.len() >= TB * self.groups && acts.row_corr.len() >= TB * self.groups
        );
    }
}

#[inline]
fn scale_at(s: &[u8], g: usize) -> f32 {
    f16::from_le_bytes([s[2 * g], s[2 * g + 1]]).to_f32()
}

fn dot_portable<T: ActInt, const TB: usize>(
    shape: DotShape,
    w: &[u8],
    s: &[u8],
    acts: &ActBlock<T>,
) -> [f32; TB] {
    shape.check::<T, TB>(w, s, acts);
    assert!(!acts.words, "the portable kernel reads the plain layout");
    let mut out = [0f32; TB];
    for gi in 0..shape.groups {
        let chunks =
            gi * shape.chunks_per_group..((gi + 1) * shape.chunks_per_group).min(shape.chunks);
        let sw = scale_at(s, gi);
        for (t, o) in out.iter_mut().enumerate() {
            let mut lanes = [0i32; CHUNK_BYTES];
            for c in chunks.clone() {
                let wc = &w[c * CHUNK_BYTES..][..CHUNK_BYTES];
                let xq = &acts.q[(c * TB + t) * CHUNK_WEIGHTS..][..CHUNK_WEIGHTS];
                chunk_lanes(wc, xq, &mut lanes);
            }
            let total = acts.row_corr[t * shape.groups + gi] + lanes.iter().sum::<i32>();
            *o += total as f32 * (sw * acts.scale[gi * MAX_TOKEN_BLOCK + t]);
        }
    }
    out
}

/// Adds one chunk's products to `lanes`, lane `b` taking byte `b`'s two nibbles times their
/// activations (`xq[b]` and `xq[16 + b]`; folded activations take the whole byte in the low
/// lane). Fixed-length slices and one independent sum per lane, so that the compiler turns the
/// loop into vector instructions on any target: 16-bit multiply-adds into 32-bit lanes
/// (`pmaddwd` with SSE2, `smlal` on NEON). The lanes hold exact integers, so the group's total,
/// and the result, are the bits of any other order.
#[inline(always)]
fn chunk_lanes<T: ActInt>(wc: &[u8], xq: &[T], lanes: &mut [i32; CHUNK_BYTES]) {
    let (wc, (xlo, xhi)) = (&wc[..CHUNK_BYTES], xq.split_at(CHUNK_BYTES));
    for b in 0..CHUNK_BYTES {
        let byte = wc[b];
        let lo = if T::FOLDED { byte } else { byte & 0xf } as i32;
        let hi = (byte >> 4) as i32;
        lanes[b] += lo * xlo[b].into() + hi * xhi[b].into();
    }
}

#[cfg(target_arch = "x86_64")]
mod row_lanes;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::kernels::x86_simd::{f16_bits_to_f32, hsum256, hsum_lanes, prefetch_stream};
    use std::arch::x86_64::*;

    /// FP16 scale `g` of a row, converted with one F16C instruction.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn scale_f16c(s: &[u8], g: usize) -> f32 {
        f16_bits_to_f32(u16::from_le_bytes([s[2 * g], s[2 * g + 1]]))
    }

    /// A group's exact partial sums as one instruction set's group-sum function leaves them
    /// (integer lanes whose total is the group's sum): what `row_tile!` and `token_lanes!`
    /// reduce to one total per group before scaling.
    ///
    /// # Safety
    /// Both methods require a CPU with the instruction set of the implementing type (AVX2 for
    /// `__m256i`, AVX-512 F and BW for `__m512i`).
    trait GroupSums: Copy {
        /// No partial sums.
        unsafe fn zero() -> Self;
        /// Lane `j` of the result: the total of every lane of `v[j]`.
        unsafe fn totals8(v: [Self; 8]) -> __m256i;
    }

    impl GroupSums for __m256i {
        #[inline(always)]
        unsafe fn zero() -> Self {
            _mm256_setzero_si256()
        }
        #[inline(always)]
        unsafe fn totals8(v: [Self; 8]) -> __m256i {
            hsum_lanes(v)
        }
    }

    impl GroupSums for __m512i {
        #[inline(always)]
        unsafe fn zero() -> Self {
            _mm512_setzero_si512()
        }
        /// A transposing tree on 512-bit registers: 24 instructions (16 of them shuffles) for
        /// 8 groups, where folding each group to 256 bits (extract, add) and `hsum_lanes`'s
        /// `vphaddd` tree take 37 (22 shuffles), which on an Intel core share ports 0 and 5
        /// with the group sums' own AND, shift and `vpdpwssd`. Integer adds in another order:
        /// the same exact totals.
        #[inline(always)]
        unsafe fn totals8(v: [Self; 8]) -> __m256i {
            // Per 128-bit lane, `u[p]` = [a₀+a₂, b₀+b₂, a₁+a₃, b₁+b₃] of groups a = 2p,
            // b = 2p + 1 (loops and plain calls: a closure would lose the target features).
            let mut u = [_mm512_setzero_si512(); 4];
            for p in 0..4 {
                let (a, b) = (v[2 * p], v[2 * p + 1]);
                u[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
            }
            // Per 128-bit lane, groups 0..4 (`lo`) and 4..8 (`hi`) in its four elements.
            let lo = _mm512_add_epi32(
                _mm512_unpacklo_epi64(u[0], u[1]),
                _mm512_unpackhi_epi64(u[0], u[1]),
            );
            let hi = _mm512_add_epi32(
                _mm512_unpacklo_epi64(u[2], u[3]),
                _mm512_unpackhi_epi64(u[2], u[3]),
            );
            // [lo₀+lo₂, lo₁+lo₃, hi₀+hi₂, hi₁+hi₃], then the pairs of 128-bit lanes added.
            let s = _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0x44>(lo, hi),
                _mm512_shuffle_i64x2::<0xEE>(lo, hi),
            );
            let s = _mm512_shuffle_i64x2::<0xD8>(s, s);
            _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s))
        }
    }

    /// The `vpshufb` pattern that zero-extends bytes 0..8 of a 128-bit lane into the low
    /// half's 16-bit lanes and bytes 8..16 into the high half's (both decoders use it).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn spread_bytes_to_words() -> __m256i {
        _mm256_setr_epi8(
            0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1, //
            8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1,
        )
    }

    /// The bytes of chunk `c` and their high nibbles, widened to 16 × i16 each (the folded
    /// activations take the whole byte where the low nibble's activation sits; see
    /// [`DECODE_ACT_MAX`]).
    ///
    /// # Safety
    /// Chunk `c` must lie inside the row `w` points to.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn decode_avx2(w: *const u8, c: usize) -> (__m256i, __m256i) {
        // The 16 bytes in both 128-bit halves (a load, no shuffle), then one in-lane `vpshufb`
        // zero-extends bytes 0..8 into the low half's 16-bit lanes and 8..16 into the high
        // half's: each lane holds `lo + 16 · hi`, and one shift gives `hi`. (Two `vpmovzxbw`,
        // cross-lane, cost 3 cycles per chunk on Zen 3; this costs ~1.)
        let b =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(w.add(c * CHUNK_BYTES) as *const __m128i));
        let spread = spread_bytes_to_words();
        let v = _mm256_shuffle_epi8(b, spread);
        (v, _mm256_srli_epi16(v, 4))
    }

    /// `vpmaddwd` of a decoded chunk with activation chunk `c` of `x`, summed to 8 × i32.
    ///
    /// # Safety
    /// Chunk `c` must lie inside the activation row `x` points to.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn madd_avx2(w: (__m256i, __m256i), x: *const i16, c: usize) -> __m256i {
        let x = x.add(c * CHUNK_WEIGHTS);
        let lo = _mm256_madd_epi16(w.0, _mm256_loadu_si256(x as *const __m256i));
        let hi = _mm256_madd_epi16(w.1, _mm256_loadu_si256(x.add(16) as *const __m256i));
        _mm256_add_epi32(lo, hi)
    }

    /// The exact sums of one group of `n` chunks of each of `R` rows for every token of the
    /// block (8 partial `i32` lanes each; the caller adds the `−8` correction). Called with
    /// a constant `n` (a full group), the loop unrolls into straight-line code with no
    /// per-chunk bookkeeping; the rows share each chunk's activation loads.
    ///
    /// # Safety
    /// The CPU must support AVX2; every `wp[r]` must point at its row's `n` group chunks and
    /// `xp` at the group's `n · TB` activation chunks.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn group_sums_avx2<const R: usize, const TB: usize>(
        wp: [*const u8; R],
        xp: *const i16,
        n: usize,
    ) -> [[__m256i; TB]; R] {
        let mut acc = [[_mm256_setzero_si256(); TB]; R];
        for c in 0..n {
            for (row, &w) in acc.iter_mut().zip(&wp) {
                if (c * CHUNK_BYTES).is_multiple_of(64) {
                    // Rows are contiguous: fetch ahead across row ends (never faults).
                    prefetch_stream(w.wrapping_add(c * CHUNK_BYTES));
                }
                let wq = decode_avx2(w, c);
                for (t, a) in row.iter_mut().enumerate() {
                    *a = _mm256_add_epi32(*a, madd_avx2(wq, xp, c * TB + t));
                }
            }
        }
        acc
    }

    /// `$f::<.., CPG>(args)` with `CPG = shape.chunks_per_group` as a constant (1, 2, 4 or 8:
    /// group sizes are 32 to 256 weights), so that a group's chunk loop unrolls.
    macro_rules! by_chunks_per_group {
        ($shape:expr, $f:ident::<$($c:ident),*>($($arg:expr),*)) => {
            match $shape.chunks_per_group {
                1 => $f::<$($c,)* 1>($($arg),*),
                2 => $f::<$($c,)* 2>($($arg),*),
                4 => $f::<$($c,)* 4>($($arg),*),
                8 => $f::<$($c,)* 8>($($arg),*),
                n => unreachable!("{n} chunks per group: group sizes are 32 to 256 weights"),
            }
        };
    }

    /// Defines `$tile`, `R` rows times a block of `$act` activation rows, and `$groups`, its
    /// body for groups of `CPG` chunks, compiled for `$features` around the group sums `$sums`.
    /// Whole runs of 8 groups are scaled together: each group's exact sums are folded per row
    /// and token into one vector (`vphaddd` pairs, lane `j` = group `j`), then one conversion
    /// and one multiply-add per row and token cover the 8 groups, with a row's 8 weight scales
    /// from one F16C conversion. A last run of fewer groups (or ending in a short group) is
    /// scaled the same way with its missing groups' lanes zero, so group `g` always lands in
    /// lane `g mod 8` (a Qwen3-30B-A3B down row holds 6 groups of 128; scaled one by one they
    /// each took their own fold, conversion and multiply-add). The
    /// arithmetic of a (row, token) pair does not depend on the other rows or tokens of the
    /// tile, so its output is the same alone or batched; and as every `$sums` returns 8 integer
    /// lanes with the same exact total per group, every instruction set gives the same bits.
    /// `$words`: whether `$sums` takes its activations in word blocks ([`WORD_BLOCK_CHUNKS`]).
    macro_rules! row_tile {
        (
            $tile:ident,
            $groups:ident,
            $sums:ident,
            $act:ty,
            $features:literal,
            words: $words:literal
        ) => {
            /// `R` rows times a block of activation rows (see `row_tile!`).
            ///
            /// # Safety
            /// The CPU must support the target features; the rows' matrix and the activations
            /// must have passed `shape.check_matrix` (once per block of rows: checking every
            /// tile's rows cost 5% of a decode call from L2).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tile<const R: usize, const TB: usize>(
                shape: DotShape,
                rows: [(&[u8], &[u8]); R],
                acts: &ActBlock<$act>,
            ) -> [[f32; TB]; R] {
                assert_eq!(acts.words, $words, "activations in the wrong layout");
                by_chunks_per_group!(shape, $groups::<R, TB>(shape, rows, acts))
            }

            /// The tile function for groups of `CPG` chunks.
            ///
            /// # Safety
            /// As the tile function, with `CPG = shape.chunks_per_group`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $groups<const R: usize, const TB: usize, const CPG: usize>(
                shape: DotShape,
                rows: [(&[u8], &[u8]); R],
                acts: &ActBlock<$act>,
            ) -> [[f32; TB]; R] {
                let x = acts.q.as_ptr();
                // Group `g`'s weights (per row) and activations.
                let group = |g: usize| {
                    (
                        rows.map(|(w, _)| w.as_ptr().add(g * CPG * CHUNK_BYTES)),
                        x.add(g * CPG * TB * CHUNK_WEIGHTS),
                    )
                };
                let mut facc = [[_mm256_setzero_ps(); TB]; R];
                // Runs whose 8 groups all hold `CPG` chunks (only the last group can be short).
                let full_groups = (shape.chunks / CPG).min(shape.groups);
                let runs = full_groups / 8;
                for run in 0..runs {
                    let g0 = run * 8;
                    // SAFETY (the whole run): `shape.check_matrix` proved that the run's chunks lie
                    // inside every row and `q`, every `s` holds its 8 scales and `row_scale`
                    // 8 per token from `g0`.
                    let mut sums = [[[GroupSums::zero(); 8]; TB]; R];
                    // `sums` is group-minor, the loop group-major: the index transposes. The
                    // trip count is opaque so that the loop stays rolled: unrolled, the 8
                    // groups' loads are hoisted and their registers spilled (measured 2–3%
                    // slower at T = 1 on AVX2).
                    #[allow(clippy::needless_range_loop)]
                    for j in 0..std::hint::black_box(8) {
                        let (wg, xg) = group(g0 + j);
                        let acc = $sums::<R, TB>(wg, xg, CPG);
                        for r in 0..R {
                            for t in 0..TB {
                                sums[r][t][j] = acc[r][t];
                            }
                        }
                    }
                    for r in 0..R {
                        let s = rows[r].1.as_ptr().add(2 * g0);
                        let ws = _mm256_cvtph_ps(_mm_loadu_si128(s as *const __m128i));
                        for t in 0..TB {
                            let at = t * shape.groups + g0;
                            let corr = acts.row_corr.as_ptr().add(at) as *const __m256i;
                            let totals = _mm256_add_epi32(
                                GroupSums::totals8(sums[r][t]),
                                _mm256_loadu_si256(corr),
                            );
                            let xs = acts.row_scale.as_ptr().add(at);
                            let totals = _mm256_cvtepi32_ps(totals);
                            let f = _mm256_mul_ps(ws, _mm256_loadu_ps(xs));
                            facc[r][t] = _mm256_fmadd_ps(totals, f, facc[r][t]);
                        }
                    }
                }
                // The last run, of fewer than 8 groups or ending in a short group: as a whole
                // run, its missing groups' lanes zero (sums, corrections and scales: each adds
                // `0 · 0` to its place, which leaves it as it was).
                let g0 = runs * 8;
                if g0 < shape.groups {
                    let n = shape.groups - g0;
                    let mut sums = [[[GroupSums::zero(); 8]; TB]; R];
                    for j in 0..n {
                        let gi = g0 + j;
                        let (wg, xg) = group(gi);
                        // SAFETY: as above; only the last group can be short.
                        let acc = if (gi + 1) * CPG <= shape.chunks {
                            $sums::<R, TB>(wg, xg, CPG)
                        } else {
                            $sums::<R, TB>(wg, xg, shape.chunks - gi * CPG)
                        };
                        for r in 0..R {
                            for t in 0..TB {
                                sums[r][t][j] = acc[r][t];
                            }
                        }
                    }
                    // Lanes `0..n`: masked loads (no variable-length copies, which became
                    // `memcpy` calls) that read nothing past the run.
                    let mask = _mm256_cmpgt_epi32(
                        _mm256_set1_epi32(n as i32),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    );
                    for r in 0..R {
                        let mut bits = [0u16; 8];
                        for (j, b) in bits.iter_mut().enumerate().take(n) {
                            let at = 2 * (g0 + j);
                            *b = u16::from_le_bytes([rows[r].1[at], rows[r].1[at + 1]]);
                        }
                        let ws = _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i));
                        for t in 0..TB {
                            let at = t * shape.groups + g0;
                            let corr = acts.row_corr.as_ptr().add(at);
                            let xs = acts.row_scale.as_ptr().add(at);
                            let totals = _mm256_add_epi32(
                                GroupSums::totals8(sums[r][t]),
                                _mm256_maskload_epi32(corr, mask),
                            );
                            let totals = _mm256_cvtepi32_ps(totals);
                            let f = _mm256_mul_ps(ws, _mm256_maskload_ps(xs, mask));
                            facc[r][t] = _mm256_fmadd_ps(totals, f, facc[r][t]);
                        }
                    }
                }
                let mut out = [[0f32; TB]; R];
                for (out, facc) in out.iter_mut().zip(&facc) {
                    for (o, &v) in out.iter_mut().zip(facc) {
                        *o = hsum256(v);
                    }
                }
                out
            }
        };
    }

    /// Defines `$tokens`, one row times a block of `$act` activation rows with the tokens in
    /// lanes, and `$tokens_groups`, its body for groups of `CPG` chunks, compiled for
    /// `$features` around the group sums `$sums` (see `row_tile!`).
    macro_rules! token_lanes {
        (
            $tokens:ident,
            $tokens_groups:ident,
            $sums:ident,
            $act:ty,
            $features:literal,
            words: $words:literal
        ) => {
            /// One row times a block of `TB` activation rows with the tokens in lanes: per
            /// group one horizontal sum gives every token's exact total (lane `t`), scaled and
            /// accumulated into the F32 vector of the group's place in its run of 8 (the
            /// tile's lane `g mod 8`). Each (group, token) element
            /// takes the tile's F32 operations in the tile's order, and the final sum over the
            /// 8 places follows `hsum256`'s tree, so the bits are the tile's: a token's output
            /// is the same in a block of 1 or 8. Fewer reductions per group than the tile when
            /// several tokens share a row (prefill).
            ///
            /// # Safety
            /// As the tile function.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tokens<const TB: usize>(
                shape: DotShape,
                w: &[u8],
                s: &[u8],
                acts: &ActBlock<$act>,
            ) -> [f32; TB] {
                assert_eq!(acts.words, $words, "activations in the wrong layout");
                by_chunks_per_group!(shape, $tokens_groups::<TB>(shape, w, s, acts))
            }

            /// The token-lane function for groups of `CPG` chunks.
            ///
            /// # Safety
            /// As the token-lane function, with `CPG = shape.chunks_per_group`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $tokens_groups<const TB: usize, const CPG: usize>(
                shape: DotShape,
                w: &[u8],
                s: &[u8],
                acts: &ActBlock<$act>,
            ) -> [f32; TB] {
                let (wp, x) = (w.as_ptr(), acts.q.as_ptr());
                // `facc[j]`, lane `t`: the tile's `facc[t]`, lane `j`.
                let mut facc = [_mm256_setzero_ps(); 8];
                for gi in 0..shape.groups {
                    let n = if (gi + 1) * CPG <= shape.chunks {
                        CPG
                    } else {
                        shape.chunks - gi * CPG
                    };
                    // SAFETY: `shape.check_matrix` proved that the group's chunks lie inside `w` and
                    // `q`, and that `scale` and `corr` hold 8 lanes per group.
                    let acc = $sums::<1, TB>(
                        [wp.add(gi * CPG * CHUNK_BYTES)],
                        x.add(gi * CPG * TB * CHUNK_WEIGHTS),
                        n,
                    );
                    let at = gi * MAX_TOKEN_BLOCK;
                    let mut lanes = [GroupSums::zero(); 8];
                    lanes[..TB].copy_from_slice(&acc[0]);
                    let totals = GroupSums::totals8(lanes);
                    let corr = _mm256_loadu_si256(acts.corr.as_ptr().add(at) as *const __m256i);
                    let totals = _mm256_cvtepi32_ps(_mm256_add_epi32(totals, corr));
                    let f = _mm256_mul_ps(
                        _mm256_set1_ps(scale_f16c(s, gi)),
                        _mm256_loadu_ps(acts.scale.as_ptr().add(at)),
                    );
                    facc[gi % 8] = _mm256_fmadd_ps(totals, f, facc[gi % 8]);
                }
                // `hsum256`'s tree over the places: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
                let pair = |a: usize, b: usize| _mm256_add_ps(facc[a], facc[b]);
                let even = _mm256_add_ps(pair(0, 4), pair(2, 6));
                let odd = _mm256_add_ps(pair(1, 5), pair(3, 7));
                let mut out = [0f32; MAX_TOKEN_BLOCK];
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(even, odd));
                std::array::from_fn(|t| out[t])
            }
        };
    }
    row_tile!(
        tile_avx2,
        tile_avx2_groups,
        group_sums_avx2,
        i16,
        "avx2,fma,f16c",
        words: false
    );
    token_lanes!(
        tokens_avx2,
        tokens_avx2_groups,
        group_sums_avx2,
        i16,
        "avx2,fma,f16c",
        words: false
    );
    row_tile!(
        tile_avx512,
        tile_avx512_groups,
        group_sums_avx512,
        i16,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        words: true
    );
    token_lanes!(
        tokens_avx512,
        tokens_avx512_groups,
        group_sums_avx512,
        i16,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        words: true
    );
    row_tile!(
        tile_a8_avx2,
        tile_a8_avx2_groups,
        group_sums_a8_avx2,
        i8,
        "avx2,fma,f16c",
        words: false
    );
    token_lanes!(
        tokens_a8_avx2,
        tokens_a8_avx2_groups,
        group_sums_a8_avx2,
        i8,
        "avx2,fma,f16c",
        words: false
    );
    row_tile!(
        tile_a8_words_avx2,
        tile_a8_words_avx2_groups,
        group_sums_a8_words_avx2,
        i8,
        "avx2,fma,f16c",
        words: true
    );
    row_tile!(
        tile_a8_avx512,
        tile_a8_avx512_groups,
        group_sums_a8_avx512,
        i8,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        words: true
    );
    token_lanes!(
        tokens_a8_vnni,
        tokens_a8_vnni_groups,
        group_sums_a8_vnni,
        i8,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        words: false
    );

    /// Chunk `c`'s 32 nibbles as bytes, `[low nibbles | high nibbles]` (the activations' lane
    /// order): the 16 bytes in both 128-bit halves (a load), the high half's 64-bit lanes
    /// shifted right by 4 (`vpsrlvq`, which moves each byte's high nibble down) and one AND.
    ///
    /// # Safety
    /// Chunk `c` must lie inside the row `w` points to.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibble_bytes_avx2(w: *const u8, c: usize) -> __m256i {
        let b =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(w.add(c * CHUNK_BYTES) as *const __m128i));
        let v = _mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4));
        _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
    }

    /// AVX2: nibble × `i8` activation pairs with `vpmaddubsw` (at most 2 · 15 · 127), summed in
    /// `i16` over the group (at most 8 chunks: ≤ 30 480, no saturation).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn a8_madd_avx2(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
    }

    /// AVX2: a group's `i16` pair sums widened to 8 × `i32`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn a8_widen_avx2(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }

    /// AVX-512 VNNI: nibble × `i8` activation quadruples summed straight into `i32` by one
    /// 256-bit `vpdpbusd` (the same products and lanes as [`a8_madd_avx2`] then
    /// [`a8_widen_avx2`]).
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl")]
    fn a8_madd_vnni(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, w, x)
    }

    /// AVX-512 VNNI: the sums are already `i32`.
    #[inline]
    fn a8_widen_vnni(acc: __m256i) -> __m256i {
        acc
    }

    /// Defines `$name`, [`group_sums_avx2`] for `i8` activations in the plain layout, compiled
    /// for `$features`: chunk `c`'s nibbles as bytes ([`nibble_bytes_avx2`]) times the
    /// activations, accumulated per row and token by `$madd` and widened to 8 × `i32` once per
    /// group by `$widen`. Every instruction set, and the word-block kernels
    /// ([`group_sums_a8_words_avx2`], [`group_sums_a8_avx512`]), sums the same integers per
    /// group: the same bits.
    macro_rules! group_sums_a8 {
        ($name:ident, $madd:ident, $widen:ident, $features:literal) => {
            /// The `i8` group sums of one instruction set (see `group_sums_a8!`).
            ///
            /// # Safety
            /// As [`group_sums_avx2`], with `n ≤ 8`, on a CPU with the target features.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize, const TB: usize>(
                wp: [*const u8; R],
                xp: *const i8,
                n: usize,
            ) -> [[__m256i; TB]; R] {
                debug_assert!(n <= 8, "i16 sums hold at most 8 chunks");
                let mut acc = [[_mm256_setzero_si256(); TB]; R];
                for c in 0..n {
                    for (row, &w) in acc.iter_mut().zip(&wp) {
                        if (c * CHUNK_BYTES).is_multiple_of(64) {
                            // Rows are contiguous: fetch ahead across row ends (never faults).
                            prefetch_stream(w.wrapping_add(c * CHUNK_BYTES));
                        }
                        let wq = nibble_bytes_avx2(w, c);
                        for (t, a) in row.iter_mut().enumerate() {
                            let x = xp.add((c * TB + t) * CHUNK_WEIGHTS);
                            *a = $madd(*a, wq, _mm256_loadu_si256(x as *const _));
                        }
                    }
                }
                let mut sums = [[_mm256_setzero_si256(); TB]; R];
                for r in 0..R {
                    for t in 0..TB {
                        sums[r][t] = $widen(acc[r][t]);
                    }
                }
                sums
            }
        };
    }
    group_sums_a8!(group_sums_a8_avx2, a8_madd_avx2, a8_widen_avx2, "avx2");
    // Several tokens (prefill) share each chunk's decode, so the per-chunk spread costs little,
    // and the 256-bit lanes need no 512-bit fold per token and group: on a Granite Rapids-class
    // Xeon one OLMoE layer at T = 128 took 0.94–1.0× the time of the word-block kernel
    // (`group_sums_a8_avx512`, the single-token kernel).
    group_sums_a8!(
        group_sums_a8_vnni,
        a8_madd_vnni,
        a8_widen_vnni,
        "avx512vnni,avx512vl,avx2"
    );

    /// The 64 bytes of a row's word block at `w` as two 256-bit halves; `chunks < 4` (a
    /// group's short tail) copies only its bytes, zero-padded, so the read never passes the
    /// row's end.
    ///
    /// # Safety
    /// The block's first `chunks` chunks must lie inside the row `w` points to.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load_block_avx2(w: *const u8, chunks: usize) -> [__m256i; 2] {
        let mut tail = [0u8; WORD_BLOCK_CHUNKS * CHUNK_BYTES];
        let w = if chunks >= WORD_BLOCK_CHUNKS {
            w
        } else {
            std::ptr::copy_nonoverlapping(w, tail.as_mut_ptr(), chunks * CHUNK_BYTES);
            tail.as_ptr()
        };
        [
            _mm256_loadu_si256(w as *const __m256i),
            _mm256_loadu_si256(w.add(32) as *const __m256i),
        ]
    }

    /// [`group_sums_a8_avx2`] with the activations in word blocks ([`WORD_BLOCK_CHUNKS`]), as
    /// [`group_sums_a8_avx512`] reads them: per 32-byte half of a 64-byte block the low
    /// nibbles (`& 0xf`) and the high nibbles (`>> 4 & 0xf`) as 32 unsigned bytes each, one
    /// shift per two chunks where the plain layout takes a `vpsrlvq` per chunk (on a Zen 4
    /// core shifts and `vpmaddubsw` share two pipes); `vpmaddubsw`, summed in `i16` over the
    /// group (at most 4 products of ≤ 2 · 15 · 127 per lane and block, 2 blocks: ≤ 30 480) and
    /// widened once. The same exact group totals: the same bits. On a Zen 4 EPYC held to AVX2
    /// (`layer_bench`, binaries alternating, `layer-ab-epyc-zen4-a8-words-avx2.jsonl`): OLMoE's
    /// matrices from L3 on 2 threads, fastest bursts 0.134–0.155 ms against 0.144–0.163; from
    /// DRAM on one thread 1.19–1.21 ms against 1.20–1.33; on two, memory-bound, no change.
    ///
    /// # Safety
    /// As [`group_sums_a8_avx512`], on a CPU with AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn group_sums_a8_words_avx2<const R: usize, const TB: usize>(
        wp: [*const u8; R],
        xp: *const i8,
        n: usize,
    ) -> [[__m256i; TB]; R] {
        debug_assert!(n <= 8, "i16 sums hold at most 8 chunks");
        let mut acc = [[_mm256_setzero_si256(); TB]; R];
        let nibble = _mm256_set1_epi8(0x0f);
        for j in 0..n.div_ceil(WORD_BLOCK_CHUNKS) {
            let chunks = (n - j * WORD_BLOCK_CHUNKS).min(WORD_BLOCK_CHUNKS);
            for r in 0..R {
                let w = wp[r].add(j * WORD_BLOCK_CHUNKS * CHUNK_BYTES);
                // Rows are contiguous: fetch ahead across row ends (never faults).
                prefetch_stream(w);
                for (h, v) in load_block_avx2(w, chunks).into_iter().enumerate() {
                    let lo = _mm256_and_si256(v, nibble);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
                    for (t, a) in acc[r].iter_mut().enumerate() {
                        let x = xp.add((j * TB + t) * WORD_BLOCK_WEIGHTS + 32 * h);
                        let load = |k: usize| _mm256_loadu_si256(x.add(k * 64) as *const _);
                        let sum = a8_madd_avx2(*a, lo, load(0));
                        *a = a8_madd_avx2(sum, hi, load(1));
                    }
                }
            }
        }
        let mut sums = [[_mm256_setzero_si256(); TB]; R];
        for r in 0..R {
            for t in 0..TB {
                sums[r][t] = a8_widen_avx2(acc[r][t]);
            }
        }
        sums
    }

    /// The 64 bytes of a row's word block at `w`; `chunks < 4` (a group's short tail) loads
    /// only its bytes, so the read never passes the row's end.
    ///
    /// # Safety
    /// The block's first `chunks` chunks must lie inside the row `w` points to.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load_block_avx512(w: *const u8, chunks: usize) -> __m512i {
        if chunks >= WORD_BLOCK_CHUNKS {
            _mm512_loadu_si512(w as *const _)
        } else {
            let bytes = chunks * CHUNK_BYTES;
            _mm512_maskz_loadu_epi8((1u64 << bytes) - 1, w as *const i8)
        }
    }

    /// One 64-byte block of a row (chunks `4j..4j + 4` of the group at `w`) as the four word
    /// vectors [`WORD_BLOCK_CHUNKS`]'s activation layout pairs with: the 32 little-endian
    /// 16-bit words of the block, each holding bytes `2k` and `2k + 1` of its chunk, give the
    /// even byte whole (`& 0xff`), the odd byte whole (`>> 8`), the even byte's high nibble
    /// (`>> 4 & 0xf`) and the odd byte's (`>> 12`). One load, no shuffle: AND and shift run on
    /// every vector pipe, where the per-chunk broadcast and `vpshufb` of a byte-to-word spread
    /// queue on the shuffle pipes. `chunks` as in [`load_block_avx512`].
    ///
    /// # Safety
    /// The block's first `chunks` chunks must lie inside the row `w` points to.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn word_block_avx512(w: *const u8, chunks: usize) -> [__m512i; 4] {
        let v = load_block_avx512(w, chunks);
        let (byte, nibble) = (_mm512_set1_epi16(0xff), _mm512_set1_epi16(0x0f));
        [
            _mm512_and_si512(v, byte),
            _mm512_srli_epi16::<8>(v),
            _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble),
            _mm512_srli_epi16::<12>(v),
        ]
    }

    /// [`group_sums_avx2`] on AVX-512 VNNI with the activations in word blocks
    /// ([`WORD_BLOCK_CHUNKS`]): per 64-byte block, row and token four `vpdpwssd` of the word
    /// vectors of [`word_block_avx512`] (two chains of two, summed), then the two 256-bit
    /// halves added. The lanes hold other partial sums than [`group_sums_avx2`]'s, but every
    /// group's total over its 8 lanes is the same exact integer, and the callers only use the
    /// totals: the same bits.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VNNI; every `wp[r]` must point at its row's `n` group
    /// chunks and `xp` at the group's word blocks of `TB` activation rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn group_sums_avx512<const R: usize, const TB: usize>(
        wp: [*const u8; R],
        xp: *const i16,
        n: usize,
    ) -> [[__m512i; TB]; R] {
        let mut acc = [[_mm512_setzero_si512(); TB]; R];
        let mut high = [[_mm512_setzero_si512(); TB]; R];
        for j in 0..n.div_ceil(WORD_BLOCK_CHUNKS) {
            let chunks = (n - j * WORD_BLOCK_CHUNKS).min(WORD_BLOCK_CHUNKS);
            for r in 0..R {
                let w = wp[r].add(j * WORD_BLOCK_CHUNKS * CHUNK_BYTES);
                // Rows are contiguous: fetch ahead across row ends (never faults).
                prefetch_stream(w);
                let [even, odd, even_hi, odd_hi] = word_block_avx512(w, chunks);
                for t in 0..TB {
                    let x = xp.add((j * TB + t) * WORD_BLOCK_WEIGHTS);
                    let load = |k: usize| _mm512_loadu_si512(x.add(k * 32) as *const _);
                    let a = _mm512_dpwssd_epi32(acc[r][t], even, load(0));
                    acc[r][t] = _mm512_dpwssd_epi32(a, odd, load(1));
                    let h = _mm512_dpwssd_epi32(high[r][t], even_hi, load(2));
                    high[r][t] = _mm512_dpwssd_epi32(h, odd_hi, load(3));
                }
            }
        }
        // Loops, not `map`: a closure calling intrinsics is not inlined into `map`.
        for r in 0..R {
            for t in 0..TB {
                acc[r][t] = _mm512_add_epi32(acc[r][t], high[r][t]);
            }
        }
        acc
    }

    /// [`group_sums_avx512`] for `i8` activations in word blocks ([`WORD_BLOCK_CHUNKS`]): per
    /// 64-byte block the low nibbles (`& 0xf`) and the high nibbles (`>> 4 & 0xf`) as 64
    /// unsigned bytes each, and per row and token two `vpdpbusd` (one chain), each summing
    /// four nibble × activation products straight into an `i32` lane: half the instructions
    /// per weight of the `i16` kernel, and no shuffle. The same exact group totals as
    /// [`group_sums_a8_avx2`]'s: the same bits.
    ///
    /// # Safety
    /// As [`group_sums_avx512`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2")]
    unsafe fn group_sums_a8_avx512<const R: usize, const TB: usize>(
        wp: [*const u8; R],
        xp: *const i8,
        n: usize,
    ) -> [[__m512i; TB]; R] {
        let mut acc = [[_mm512_setzero_si512(); TB]; R];
        let nibble = _mm512_set1_epi8(0x0f);
        for j in 0..n.div_ceil(WORD_BLOCK_CHUNKS) {
            let chunks = (n - j * WORD_BLOCK_CHUNKS).min(WORD_BLOCK_CHUNKS);
            for r in 0..R {
                let w = wp[r].add(j * WORD_BLOCK_CHUNKS * CHUNK_BYTES);
                // Rows are contiguous: fetch ahead across row ends (never faults).
                prefetch_stream(w);
                let v = load_block_avx512(w, chunks);
                let lo = _mm512_and_si512(v, nibble);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                for (t, a) in acc[r].iter_mut().enumerate() {
                    let x = xp.add((j * TB + t) * WORD_BLOCK_WEIGHTS);
                    let load = |k: usize| _mm512_loadu_si512(x.add(k * 64) as *const _);
                    let sum = _mm512_dpbusd_epi32(*a, lo, load(0));
                    *a = _mm512_dpbusd_epi32(sum, hi, load(1));
                }
            }
        }
        acc
    }

    /// Weight rows per tile at decode (one activation row): they share each chunk's
    /// activation loads and their reductions overlap. One OLMoE layer at T = 1 on one thread
    /// of an Emerald Rapids Xeon: 3.4–3.7 ms against 3.9–4.1 for one row per tile
    /// (`layer_bench`), and 1.3× the one-row speed on experts that fit in L2; 4 rows were as
    /// fast from L2 but slower from DRAM on 2 threads (four interleaved row streams per page).
    const DECODE_TILE_ROWS: usize = 2;

    /// Defines `$name`: [`ActInt::block`] for `$act` activations over tiles computed by
    /// `$tile`, compiled for `$features` so that the tile function inlines into the loop. A
    /// single activation row takes [`DECODE_TILE_ROWS`] weight rows per tile (the rest one by
    /// one); a block of several takes one weight row per tile, the tokens sharing its decode.
    /// With [`ActInt::SPLIT_DECODE_TILES`] a decode tile's rows come from separate runs of the
    /// block (rows `i`, `i + n/R`, …), each a sequential stream the hardware prefetcher
    /// follows; otherwise they are adjacent, their blocks interleaved within a page. Every
    /// row's output is the same either way.
    macro_rules! tile_block {
        ($name:ident, $tile:ident, $tokens:ident, $act:ty, $features:literal) => {
            /// [`ActInt::block`] for one instruction set.
            ///
            /// # Safety
            /// The CPU must support the target features this function is compiled for.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const TB: usize>(
                shape: DotShape,
                m: &PackedMatrix,
                rows: Range<usize>,
                acts: &ActBlock<$act>,
                out: &mut [f32],
            ) {
                shape.check_matrix::<$act, TB>(m, acts);
                let mut done = 0;
                if TB == 1 {
                    const R: usize = DECODE_TILE_ROWS;
                    let tiles = rows.len() / R;
                    // Tile `i` holds rows `first(i) + r · stride` of the block, r < R.
                    let (step, stride) = if <$act as ActInt>::SPLIT_DECODE_TILES {
                        (1, tiles)
                    } else {
                        (R, 1)
                    };
                    for i in 0..tiles {
                        let first = i * step;
                        let tile: [_; R] =
                            std::array::from_fn(|r| m.row(rows.start + first + r * stride));
                        // SAFETY: the caller guarantees the CPU features; `check_matrix`
                        // checked the rows and activations against `shape` above.
                        let v = unsafe { $tile::<R, TB>(shape, tile, acts) };
                        for (r, v) in v.iter().enumerate() {
                            out[first + r * stride] = v[0];
                        }
                    }
                    done = tiles * R;
                }
                let rest = rows.start + done..rows.end;
                for (n, o) in rest.zip(out[done * TB..].chunks_exact_mut(TB)) {
                    // SAFETY: as above.
                    if TB == 1 {
                        o.copy_from_slice(&unsafe { $tile::<1, TB>(shape, [m.row(n)], acts) }[0]);
                    } else {
                        let (w, s) = m.row(n);
                        o.copy_from_slice(&unsafe { $tokens::<TB>(shape, w, s, acts) });
                    }
                }
            }
        };
    }
    tile_block!(block_avx2, tile_avx2, tokens_avx2, i16, "avx2,fma,f16c");
    tile_block!(
        block_avx512,
        tile_avx512,
        tokens_avx512,
        i16,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
    );
    tile_block!(
        block_a8_avx2,
        tile_a8_avx2,
        tokens_a8_avx2,
        i8,
        "avx2,fma,f16c"
    );
    tile_block!(
        block_a8_words_avx2,
        tile_a8_words_avx2,
        tokens_a8_avx2,
        i8,
        "avx2,fma,f16c"
    );
    tile_block!(
        block_a8_avx512,
        tile_a8_avx512,
        tokens_a8_vnni,
        i8,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
    );
}

/// `out[r · TB + t]` by the portable dot product, for every instruction set's fallback.
fn block_portable<T: ActInt, const TB: usize>(
    shape: DotShape,
    m: &PackedMatrix,
    rows: Range<usize>,
    acts: &ActBlock<T>,
    out: &mut [f32],
) {
    for (n, o) in rows.zip(out.chunks_exact_mut(TB)) {
        let (w, s) = m.row(n);
        o.copy_from_slice(&dot_portable::<T, TB>(shape, w, s, acts));
    }
}

impl ActInt for i16 {
    const MAX: f32 = DECODE_ACT_MAX as f32;
    fn from_level(v: i32) -> Self {
        let max = DECODE_ACT_MAX as i32;
        v.clamp(-max, max) as i16
    }
    const FOLDED: bool = true;
    const SPLIT_DECODE_TILES: bool = false;
    fn fold(chunk: &mut [Self]) {
        let (lo, hi) = chunk.split_at_mut(CHUNK_WEIGHTS / 2);
        for (h, &l) in hi.iter_mut().zip(lo.iter()) {
            // |b − 16 · a| ≤ 17 · DECODE_ACT_MAX ≤ 32767.
            *h -= 16 * l;
        }
    }
    fn token_block(isa: CpuIsa) -> usize {
        // 32 vector registers on AVX-512, 16 otherwise.
        match isa {
            CpuIsa::Avx512Vnni => 8,
            _ => 4,
        }
    }
    /// Lane `8l + k` of each of the block's four 32-level vectors: chunk `l`'s byte `2k` (low
    /// nibble, folded), `2k + 1` (low), `2k` (high) and `2k + 1` (high).
    /// Every block on AVX-512.
    fn word_blocks(isa: CpuIsa, _tb: usize) -> bool {
        isa == CpuIsa::Avx512Vnni
    }
    fn place_in_word_block(block: &mut [Self], l: usize, src: &[Self]) {
        let half = CHUNK_WEIGHTS / 2;
        for k in 0..8 {
            block[8 * l + k] = src[2 * k];
            block[32 + 8 * l + k] = src[2 * k + 1];
            block[64 + 8 * l + k] = src[half + 2 * k];
            block[96 + 8 * l + k] = src[half + 2 * k + 1];
        }
    }
    #[inline]
    fn block<const TB: usize>(
        isa: CpuIsa,
        shape: DotShape,
        m: &PackedMatrix,
        rows: Range<usize>,
        acts: &ActBlock<i16>,
        out: &mut [f32],
    ) {
        match isa {
            // SAFETY: `routed_forward_into` checked that `isa` is available on this CPU (and
            // `kernel_isa` only ever lowers it to AVX2).
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 => unsafe { x86::block_avx2::<TB>(shape, m, rows, acts, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx512Vnni => unsafe { x86::block_avx512::<TB>(shape, m, rows, acts, out) },
            _ => block_portable::<_, TB>(shape, m, rows, acts, out),
        }
    }
}

impl ActInt for i8 {
    const MAX: f32 = 127.0;
    fn from_level(v: i32) -> Self {
        v.clamp(-127, 127) as i8
    }
    const FOLDED: bool = false;
    const SPLIT_DECODE_TILES: bool = true;
    fn fold(_chunk: &mut [Self]) {}
    /// Byte `16l + b` of each of the block's two 64-level vectors: chunk `l`'s byte `b`, low
    /// nibble then high nibble.
    /// A single row on AVX-512 and AVX2 (their word-block kernels); several rows sharing a
    /// weight row take the 256-bit kernels, which read the plain layout.
    fn word_blocks(isa: CpuIsa, tb: usize) -> bool {
        isa != CpuIsa::Scalar && tb == 1
    }
    fn place_in_word_block(block: &mut [Self], l: usize, src: &[Self]) {
        let half = CHUNK_WEIGHTS / 2;
        block[half * l..half * (l + 1)].copy_from_slice(&src[..half]);
        block[64 + half * l..64 + half * (l + 1)].copy_from_slice(&src[half..]);
    }
    fn token_block(isa: CpuIsa) -> usize {
        match isa {
            CpuIsa::Scalar => 4,
            _ => 8,
        }
    }
    /// The rows-in-lanes kernel (`row_lanes`) on AVX-512 VNNI once the blocks hold at least
    /// `row_lanes::MIN_TOKENS` rows.
    fn block_rows_at_once(
        isa: CpuIsa,
        shape: DotShape,
        m: &PackedMatrix,
        rows: Range<usize>,
        blocks: &[ActBlock<i8>],
        out: &mut [f32],
    ) -> usize {
        #[cfg(target_arch = "x86_64")]
        if row_lanes::takes(isa, shape, blocks) {
            // SAFETY: `routed_forward_into` checked that `isa` is available on this CPU, and
            // `takes` that it is AVX-512 VNNI and the blocks fit the kernel.
            return unsafe { row_lanes::block_rows(shape, m, rows, blocks, out) };
        }
        let _ = (isa, shape, m, rows, blocks, out);
        0
    }
    #[inline]
    fn block<const TB: usize>(
        isa: CpuIsa,
        shape: DotShape,
        m: &PackedMatrix,
        rows: Range<usize>,
        acts: &ActBlock<i8>,
        out: &mut [f32],
    ) {
        match isa {
            // SAFETY: `routed_forward_into` checked that `isa` is available on this CPU (and
            // `kernel_isa` only ever lowers it to AVX2).
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 if acts.words => unsafe {
                x86::block_a8_words_avx2::<TB>(shape, m, rows, acts, out)
            },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx2 => unsafe { x86::block_a8_avx2::<TB>(shape, m, rows, acts, out) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            CpuIsa::Avx512Vnni => unsafe { x86::block_a8_avx512::<TB>(shape, m, rows, acts, out) },
            _ => block_portable::<_, TB>(shape, m, rows, acts, out),
        }
    }
}

/// `out[r · n + i] = row_{rows.start + r} · act_i` for the `n` activation rows of `blocks`.
fn block_rows<T: ActInt>(
    isa: CpuIsa,
    shape: DotShape,
    m: &PackedMatrix,
    rows: Range<usize>,
    blocks: &[ActBlock<T>],
    out: &mut [f32],
) {
    let n_acts: usize = blocks.iter().map(|b| b.tb).sum();
    let done = T::block_rows_at_once(isa, shape, m, rows.clone(), blocks, out);
    let (rows, out) = (rows.start + done..rows.end, &mut out[done * n_acts..]);
    if rows.is_empty() {
        return;
    }
    if let [block] = blocks {
        // One block (every expert at decode): its layout is the output's.
        return one_block(isa, shape, m, rows, block, out);
    }
    let n_rows = rows.len();
    let mut tmp = vec![0f32; n_rows * blocks.first().map_or(0, |b| b.tb)];
    let mut first = 0;
    for a in blocks {
        let tb = a.tb;
        let tmp = &mut tmp[..n_rows * tb];
        one_block(isa, shape, m, rows.clone(), a, tmp);
        for (r, vals) in tmp.chunks_exact(tb).enumerate() {
            let start = r * n_acts + first;
            out[start..start + tb].copy_from_slice(vals);
        }
        first += tb;
    }
}

/// `out[r · tb + t] = row_{rows.start + r} · act_t` for the `tb` activation rows of `a`.
fn one_block<T: ActInt>(
    isa: CpuIsa,
    shape: DotShape,
    m: &PackedMatrix,
    rows: Range<usize>,
    a: &ActBlock<T>,
    out: &mut [f32],
) {
    match a.tb {
        8 => T::block::<8>(isa, shape, m, rows, a, out),
        7 => T::block::<7>(isa, shape, m, rows, a, out),
        6 => T::block::<6>(isa, shape, m, rows, a, out),
        5 => T::block::<5>(isa, shape, m, rows, a, out),
        4 => T::block::<4>(isa, shape, m, rows, a, out),
        3 => T::block::<3>(isa, shape, m, rows, a, out),
        2 => T::block::<2>(isa, shape, m, rows, a, out),
        1 => T::block::<1>(isa, shape, m, rows, a, out),
        _ => unreachable!("token blocks hold 1 to 8 rows"),
    }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Rows of the intermediate (stage 1) or hidden (stage 2) dimension per rayon task: the longest
/// of 256, 128 and 64 rows that still gives every thread of the pool 4 tasks, where `rows` is
/// the dimension and `matrices` how many matrices share the stage. Long blocks read longer
/// contiguous runs of a slab and cost fewer tasks (one OLMoE layer at T = 1 on 2 threads: 256
/// rows 4–5% faster than 64); short ones keep many-core pools busy. Any size gives the same bits.
fn row_block(rows: usize, matrices: usize) -> usize {
    let tasks = 4 * rayon::current_num_threads();
    [256, 128]
        .into_iter()
        .find(|&b| rows.div_ceil(b) * matrices >= tasks)
        .unwrap_or(64)
}

/// Fused routed experts on the CPU.
///
/// `xs [tokens, H]` and `weights [tokens, top_k]` are row-major F32; `plan` groups the routed
/// slots by expert; `slab_of(e)` returns expert `e`'s slab bytes; `acts` chooses the
/// activations of calls of fewer than [`W4A8_MIN_TOKENS`] tokens. Returns
/// `Σ_j weights[t, j] · down(silu(gate(x_t)) · up(x_t))` as row-major `[tokens, H]`.
pub fn routed_forward<'a>(
    isa: CpuIsa,
    acts: DecodeActivations,
    layout: ExpertLayout,
    slab_of: &(dyn Fn(usize) -> &'a [u8] + Sync),
    plan: &RoutePlan,
    xs: &[f32],
    weights: &[f32],
) -> Vec<f32> {
    let mut out = vec![0f32; xs.len()];
    routed_forward_into(isa, acts, layout, slab_of, plan, xs, weights, &mut out);
    out
}

/// [`routed_forward`] adding onto `out [tokens, H]`: each output element continues its sum
/// over the plan's experts in ascending order from the value already there. Running the
/// experts of a routing in ascending chunks (e.g. as many as a bounded cache holds at once)
/// therefore gives exactly the bits of one call over all of them.
#[allow(clippy::too_many_arguments)]
pub fn routed_forward_into<'a>(
    isa: CpuIsa,
    acts: DecodeActivations,
    layout: ExpertLayout,
    slab_of: &(dyn Fn(usize) -> &'a [u8] + Sync),
    plan: &RoutePlan,
    xs: &[f32],
    weights: &[f32],
    out: &mut [f32],
) {
    assert!(isa.is_available(), "{isa:?} is not supported by this CPU");
    let (h, tokens, k) = (layout.hidden, plan.tokens, plan.top_k);
    assert_eq!(xs.len(), tokens * h);
    assert_eq!(out.len(), tokens * h);
    assert_eq!(weights.len(), tokens * k);
    if acts.int8_at(tokens) {
        routed_forward_as::<i8>(isa, layout, slab_of, plan, xs, weights, out)
    } else {
        routed_forward_as::<i16>(isa, layout, slab_of, plan, xs, weights, out)
    }
}

/// [`routed_forward_into`] with activations quantized to `T`. Around the two parallel stages
/// the work is serial (the input's and the hidden rows' quantization and blocks, the hidden
/// rows' assembly): one OLMoE layer's decode on 2 threads spent 56 µs of its 1.06 ms there,
/// 36 µs since each distinct set of token rows gets one block, the hidden rows are copied as
/// runs and one row is quantized without a parallel op.
fn routed_forward_as<'a, T: ActInt>(
    isa: CpuIsa,
    layout: ExpertLayout,
    slab_of: &(dyn Fn(usize) -> &'a [u8] + Sync),
    plan: &RoutePlan,
    xs: &[f32],
    weights: &[f32],
    out: &mut [f32],
) {
    let (h, inter, g) = (layout.hidden, layout.intermediate, layout.group_size.get());
    let (tokens, k) = (plan.tokens, plan.top_k);
    let offsets = layout.offsets();
    let matrix = |e: usize, down: bool| {
        let slab = slab_of(e);
        let (l, w, s) = if down {
            (layout.down(), offsets.down_weights, offsets.down_scales)
        } else {
            (
                layout.gate_up(),
                offsets.gate_up_weights,
                offsets.gate_up_scales,
            )
        };
        PackedMatrix::new(
            l,
            &slab[w..w + l.weight_bytes()],
            &slab[s..s + 2 * l.scale_count()],
        )
    };

    let rb = row_block(inter, plan.groups.len());
    // Stage 1: h[slot] = silu(gate · x) * (up · x), per (expert, block of intermediate rows).
    let isa = T::kernel_isa(isa, g / CHUNK_WEIGHTS);
    let acts = QuantActs::<T>::new(xs, tokens, h, g);
    // Each expert's token rows in blocks, built once per distinct set of rows: at decode every
    // expert reads the one token's (8 copies of it took 7 µs of an OLMoE layer's 1.06 ms).
    let mut distinct: Vec<(Vec<usize>, Vec<ActBlock<T>>)> = Vec::new();
    let blocks_of: Vec<usize> = plan
        .groups
        .iter()
        .map(|(_, slots)| {
            let rows: Vec<usize> = slots.iter().map(|&s| s / k).collect();
            distinct
                .iter()
                .position(|(r, _)| *r == rows)
                .unwrap_or_else(|| {
                    let blocks = acts.blocks(&rows, isa);
                    distinct.push((rows, blocks));
                    distinct.len() - 1
                })
        })
        .collect();
    drop(acts);
    let shape_gu = DotShape::of(layout.gate_up());
    let blocks = inter.div_ceil(rb);
    let tasks: Vec<(usize, usize)> = (0..plan.groups.len())
        .flat_map(|gi| (0..blocks).map(move |b| (gi, b)))
        .collect();
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(gi, b)| {
            let (e, slots) = (&plan.groups[gi].0, &plan.groups[gi].1);
            let m = matrix(*e, false);
            let rows = b * rb..((b + 1) * rb).min(inter);
            let a = &distinct[blocks_of[gi]].1;
            let mut gate = vec![0f32; rows.len() * slots.len()];
            let mut up = vec![0f32; rows.len() * slots.len()];
            block_rows(isa, shape_gu, &m, rows.clone(), a, &mut gate);
            let up_rows = inter + rows.start..inter + rows.end;
            block_rows(isa, shape_gu, &m, up_rows, a, &mut up);
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = silu(*g) * u;
            }
            gate
        })
        .collect();
    let mut hidden = vec![0f32; tokens * k * inter];
    for (&(gi, b), part) in tasks.iter().zip(&parts) {
        // `part` is row-major [rows, slots]: each slot's column is a run of its hidden row
        // (at decode, one slot: a plain copy).
        let slots = &plan.groups[gi].1;
        let rows = part.len() / slots.len();
        for (j, &slot) in slots.iter().enumerate() {
            let dst = &mut hidden[slot * inter + b * rb..][..rows];
            for (d, &v) in dst.iter_mut().zip(part[j..].iter().step_by(slots.len())) {
                *d = v;
            }
        }
    }
    drop((parts, distinct));

    let rb = row_block(h, 1);
    // Stage 2: out[t] += w[slot] * (down · h[slot]), per block of hidden rows, experts ascending.
    let hq = QuantActs::<T>::new(&hidden, tokens * k, inter, g);
    drop(hidden);
    let hidden_blocks: Vec<Vec<ActBlock<T>>> = plan
        .groups
        .iter()
        .map(|(_, slots)| hq.blocks(slots, isa))
        .collect();
    drop(hq);
    let shape_dn = DotShape::of(layout.down());
    let blocks = h.div_ceil(rb);
    let parts: Vec<Vec<f32>> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let rows = b * rb..((b + 1) * rb).min(h);
            let width = rows.len();
            let mut local = vec![0f32; tokens * width];
            for (t, l) in local.chunks_exact_mut(width).enumerate() {
                l.copy_from_slice(&out[t * h + rows.start..t * h + rows.end]);
            }
            let mut y = Vec::new();
            for ((e, slots), a) in plan.groups.iter().zip(&hidden_blocks) {
                let m = matrix(*e, true);
                y.resize(width * slots.len(), 0f32);
                block_rows(isa, shape_dn, &m, rows.clone(), a, &mut y);
                // Slot by slot, one division per slot rather than per element; each output
                // element still takes its slots in the same order (the same bits).
                let n = slots.len();
                for (j, &slot) in slots.iter().enumerate() {
                    let (t, w) = (slot / k, weights[slot]);
                    let dst = &mut local[t * width..(t + 1) * width];
                    for (d, ys) in dst.iter_mut().zip(y.chunks_exact(n)) {
                        *d += w * ys[j];
                    }
                }
            }
            local
        })
        .collect();
    for (b, local) in parts.iter().enumerate() {
        let width = local.len() / tokens.max(1);
        for t in 0..tokens {
            out[t * h + b * rb..t * h + b * rb + width]
                .copy_from_slice(&local[t * width..(t + 1) * width]);
        }
    }
}
