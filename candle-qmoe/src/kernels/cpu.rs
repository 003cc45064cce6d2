//! The CPU W4A16 kernel: fused top-k routed experts computed straight from INT4 slabs.
//!
//! Activations are quantized on the fly to `i16` per K-group (scale = group absmax / 32767, an
//! error of at most 2⁻¹⁶ of the group's largest value — below FP16's own rounding for the values
//! that dominate the dot product). Inside a group, nibble × activation products are summed
//! exactly in `i32` (`vpmaddwd` on AVX2, `vpdpwssd` on AVX-512 VNNI); each group's sum is scaled
//! by `weight_scale · activation_scale` and accumulated in F32. The `−8` nibble offset is folded
//! in exactly as `−8 · Σ q_x` per group, precomputed once per activation row.
//!
//! Work is split with rayon: first over (expert, block of intermediate rows) for gate/up and
//! SiLU·up, then over blocks of hidden rows for the down projection and the weighted combine,
//! each block walking the experts in ascending order. Every expert's bytes are read once per call
//! and the summation order does not depend on the thread count or on residency, so results are
//! reproducible bit for bit.

use std::ops::Range;

use half::f16;
use rayon::prelude::*;

use super::RoutePlan;
use crate::pack::layout::{CHUNK_BYTES, CHUNK_WEIGHTS, CPU_LANE_COLUMN};
use crate::pack::{ExpertLayout, QMatrixLayout};

/// Instruction set used by the CPU kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuIsa {
    /// Portable Rust, any target.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 BW/VL + VNNI (+ F16C).
    Avx512Vnni,
}

impl CpuIsa {
    /// The best instruction set this CPU supports (checked at run time, once).
    pub fn detect() -> Self {
        static ISA: std::sync::OnceLock<CpuIsa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            [CpuIsa::Avx512Vnni, CpuIsa::Avx2]
                .into_iter()
                .find(|isa| isa.is_available())
                .unwrap_or(CpuIsa::Scalar)
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
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("f16c")
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

/// Rows of activations quantized to `i16` per K-group, in the kernels' lane order.
#[derive(Clone, Debug)]
pub struct QuantActs {
    padded_cols: usize,
    groups: usize,
    q: Vec<i16>,
    scale: Vec<f32>,
    corr: Vec<i32>,
}

/// One quantized activation row.
#[derive(Clone, Copy)]
struct ActRow<'a> {
    q: &'a [i16],
    scale: &'a [f32],
    corr: &'a [i32],
}

impl QuantActs {
    /// Quantizes row-major `x [rows, cols]` with groups of `group_size` columns.
    pub fn new(x: &[f32], rows: usize, cols: usize, group_size: usize) -> Self {
        let padded_cols = cols.div_ceil(CHUNK_WEIGHTS) * CHUNK_WEIGHTS;
        let groups = cols.div_ceil(group_size);
        let mut q = vec![0i16; rows * padded_cols];
        let mut scale = vec![0f32; rows * groups];
        let mut corr = vec![0i32; rows * groups];
        q.par_chunks_mut(padded_cols)
            .zip(scale.par_chunks_mut(groups))
            .zip(corr.par_chunks_mut(groups))
            .zip(x.par_chunks(cols))
            .for_each(|(((q, scale), corr), x)| {
                for gi in 0..groups {
                    let (c0, c1) = (gi * group_size, ((gi + 1) * group_size).min(cols));
                    let amax = x[c0..c1].iter().fold(0f32, |m, v| m.max(v.abs()));
                    if amax == 0.0 {
                        continue;
                    }
                    let s = amax / 32767.0;
                    let mut sum = 0i32;
                    for (c, &v) in (c0..c1).zip(&x[c0..c1]) {
                        let lane =
                            (c / CHUNK_WEIGHTS) * CHUNK_WEIGHTS + LANE_OF_COLUMN[c % CHUNK_WEIGHTS];
                        let v = (v / s).round() as i16;
                        q[lane] = v;
                        sum += v as i32;
                    }
                    scale[gi] = s;
                    corr[gi] = -8 * sum;
                }
            });
        Self {
            padded_cols,
            groups,
            q,
            scale,
            corr,
        }
    }

    fn row(&self, r: usize) -> ActRow<'_> {
        ActRow {
            q: &self.q[r * self.padded_cols..(r + 1) * self.padded_cols],
            scale: &self.scale[r * self.groups..(r + 1) * self.groups],
            corr: &self.corr[r * self.groups..(r + 1) * self.groups],
        }
    }
}

/// One packed matrix of a slab: weights and raw little-endian FP16 scales.
#[derive(Clone, Copy)]
struct PackedMatrix<'a> {
    layout: QMatrixLayout,
    weights: &'a [u8],
    scales: &'a [u8],
}

impl<'a> PackedMatrix<'a> {
    fn row(&self, n: usize) -> (&'a [u8], &'a [u8]) {
        let (rb, g) = (self.layout.row_bytes(), self.layout.groups());
        (
            &self.weights[n * rb..(n + 1) * rb],
            &self.scales[2 * n * g..2 * (n + 1) * g],
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
    /// Checks every slice covers the geometry, so the SIMD loops stay in bounds.
    fn check<const TB: usize>(&self, w: &[u8], s: &[u8], acts: &[ActRow; TB]) {
        assert!(w.len() >= self.chunks * CHUNK_BYTES && s.len() >= 2 * self.groups);
        for a in acts {
            assert!(a.q.len() >= self.chunks * CHUNK_WEIGHTS);
            assert!(a.scale.len() >= self.groups && a.corr.len() >= self.groups);
        }
    }
}

#[inline]
fn scale_at(s: &[u8], g: usize) -> f32 {
    f16::from_le_bytes([s[2 * g], s[2 * g + 1]]).to_f32()
}

fn dot_scalar<const TB: usize>(
    shape: DotShape,
    w: &[u8],
    s: &[u8],
    acts: &[ActRow; TB],
) -> [f32; TB] {
    let mut out = [0f32; TB];
    for gi in 0..shape.groups {
        let c0 = gi * shape.chunks_per_group;
        let c1 = (c0 + shape.chunks_per_group).min(shape.chunks);
        let mut acc: [i32; TB] = std::array::from_fn(|t| acts[t].corr[gi]);
        for c in c0..c1 {
            for b in 0..CHUNK_BYTES {
                let byte = w[c * CHUNK_BYTES + b];
                let (lo, hi) = ((byte & 0xf) as i32, (byte >> 4) as i32);
                for (a, x) in acc.iter_mut().zip(acts) {
                    let xq = &x.q[c * CHUNK_WEIGHTS..];
                    *a += lo * xq[b] as i32 + hi * xq[16 + b] as i32;
                }
            }
        }
        let sw = scale_at(s, gi);
        for t in 0..TB {
            out[t] += acc[t] as f32 * (sw * acts[t].scale[gi]);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::kernels::x86_simd::hsum256;
    use std::arch::x86_64::*;

    /// How far ahead of the current chunk weights are prefetched.
    const PREFETCH_BYTES: usize = 4096;

    /// FP16 scale `g` of a row, converted with one F16C instruction.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn scale_f16c(s: &[u8], g: usize) -> f32 {
        let bits = u16::from_le_bytes([s[2 * g], s[2 * g + 1]]) as i32;
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    }

    /// Low and high nibbles of chunk `c` widened to 16 × i16 each.
    ///
    /// # Safety
    /// Chunk `c` must lie inside the row `w` points to.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn decode_avx2(w: *const u8, c: usize) -> (__m256i, __m256i) {
        let mask = _mm_set1_epi8(0x0f);
        let b = _mm_loadu_si128(w.add(c * CHUNK_BYTES) as *const __m128i);
        (
            _mm256_cvtepu8_epi16(_mm_and_si128(b, mask)),
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), mask)),
        )
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

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; the slices must cover `shape` (checked).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row_avx2<const TB: usize>(
        shape: DotShape,
        w: &[u8],
        s: &[u8],
        acts: &[ActRow; TB],
    ) -> [f32; TB] {
        shape.check(w, s, acts);
        let (wp, x): (*const u8, [*const i16; TB]) =
            (w.as_ptr(), std::array::from_fn(|t| acts[t].q.as_ptr()));
        let mut facc = [_mm256_setzero_ps(); TB];
        for gi in 0..shape.groups {
            let c0 = gi * shape.chunks_per_group;
            let c1 = (c0 + shape.chunks_per_group).min(shape.chunks);
            let mut acc: [__m256i; TB] =
                std::array::from_fn(|t| _mm256_setr_epi32(acts[t].corr[gi], 0, 0, 0, 0, 0, 0, 0));
            for c in c0..c1 {
                if c % 4 == 0 {
                    // Rows of a block are contiguous: fetch ahead across row ends (never faults).
                    _mm_prefetch::<_MM_HINT_T0>(
                        wp.wrapping_add(c * CHUNK_BYTES + PREFETCH_BYTES) as *const i8
                    );
                }
                // SAFETY: `shape.check` proved chunk `c` lies inside `w` and every `q`.
                let wq = decode_avx2(wp, c);
                for t in 0..TB {
                    acc[t] = _mm256_add_epi32(acc[t], madd_avx2(wq, x[t], c));
                }
            }
            let sw = scale_f16c(s, gi);
            for t in 0..TB {
                let f = _mm256_set1_ps(sw * acts[t].scale[gi]);
                facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), f, facc[t]);
            }
        }
        std::array::from_fn(|t| hsum256(facc[t]))
    }

    /// Chunk `c` as 32 × i16: `[low nibbles of bytes 0..16 | high nibbles of bytes 0..16]`, the
    /// lane order of the activations.
    ///
    /// # Safety
    /// Chunk `c` must lie inside the row `w` points to.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn decode_avx512(w: *const u8, c: usize) -> __m512i {
        let b = _mm_loadu_si128(w.add(c * CHUNK_BYTES) as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
        _mm512_cvtepu8_epi16(_mm256_and_si256(both, _mm256_set1_epi8(0x0f)))
    }

    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VNNI and F16C; the slices must cover `shape`
    /// (checked).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn row_avx512<const TB: usize>(
        shape: DotShape,
        w: &[u8],
        s: &[u8],
        acts: &[ActRow; TB],
    ) -> [f32; TB] {
        shape.check(w, s, acts);
        let (wp, x): (*const u8, [*const i16; TB]) =
            (w.as_ptr(), std::array::from_fn(|t| acts[t].q.as_ptr()));
        let xload =
            |t: usize, c: usize| _mm512_loadu_si512(x[t].add(c * CHUNK_WEIGHTS) as *const _);
        let mut facc = [_mm512_setzero_ps(); TB];
        for gi in 0..shape.groups {
            let c0 = gi * shape.chunks_per_group;
            let c1 = (c0 + shape.chunks_per_group).min(shape.chunks);
            // Two accumulator chains (even and odd chunks) hide `vpdpwssd`'s latency.
            let mut even: [__m512i; TB] = std::array::from_fn(|t| {
                _mm512_zextsi128_si512(_mm_cvtsi32_si128(acts[t].corr[gi]))
            });
            let mut odd = [_mm512_setzero_si512(); TB];
            let mut c = c0;
            // SAFETY (both loops): `shape.check` proved chunks `c0..c1` lie inside `w` and every `q`.
            while c + 1 < c1 {
                // Rows of a block are contiguous: fetch ahead across row ends (never faults).
                _mm_prefetch::<_MM_HINT_T0>(
                    wp.wrapping_add(c * CHUNK_BYTES + PREFETCH_BYTES) as *const i8
                );
                let (w0, w1) = (decode_avx512(wp, c), decode_avx512(wp, c + 1));
                for t in 0..TB {
                    even[t] = _mm512_dpwssd_epi32(even[t], w0, xload(t, c));
                    odd[t] = _mm512_dpwssd_epi32(odd[t], w1, xload(t, c + 1));
                }
                c += 2;
            }
            if c < c1 {
                let w0 = decode_avx512(wp, c);
                for (t, e) in even.iter_mut().enumerate() {
                    *e = _mm512_dpwssd_epi32(*e, w0, xload(t, c));
                }
            }
            let sw = scale_f16c(s, gi);
            for t in 0..TB {
                let sum = _mm512_cvtepi32_ps(_mm512_add_epi32(even[t], odd[t]));
                facc[t] = _mm512_fmadd_ps(sum, _mm512_set1_ps(sw * acts[t].scale[gi]), facc[t]);
            }
        }
        std::array::from_fn(|t| _mm512_reduce_add_ps(facc[t]))
    }

    /// Defines `$name`: [`block`] over rows computed by `$row`, compiled for `$features` so
    /// that the row function inlines into the loop.
    macro_rules! row_block {
        ($name:ident, $row:ident, $features:literal) => {
            /// [`block`] for one instruction set.
            ///
            /// # Safety
            /// The CPU must support the target features this function is compiled for.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const TB: usize>(
                shape: DotShape,
                m: &PackedMatrix,
                rows: Range<usize>,
                acts: &[ActRow; TB],
                out: &mut [f32],
            ) {
                for (n, o) in rows.zip(out.chunks_exact_mut(TB)) {
                    let (w, s) = m.row(n);
                    // SAFETY: the caller guarantees the CPU features; the row function checks
                    // the slices against `shape`.
                    o.copy_from_slice(&unsafe { $row(shape, w, s, acts) });
                }
            }
        };
    }
    row_block!(block_avx2, row_avx2, "avx2,fma,f16c");
    row_block!(
        block_avx512,
        row_avx512,
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
    );
}

/// `out[r · TB + t] = row_{rows.start + r} · acts[t]` for a block of rows of `m`.
#[inline]
fn block<const TB: usize>(
    isa: CpuIsa,
    shape: DotShape,
    m: &PackedMatrix,
    rows: Range<usize>,
    acts: &[ActRow; TB],
    out: &mut [f32],
) {
    match isa {
        // SAFETY: `routed_forward` checked that `isa` is available on this CPU.
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx2 => unsafe { x86::block_avx2(shape, m, rows, acts, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        CpuIsa::Avx512Vnni => unsafe { x86::block_avx512(shape, m, rows, acts, out) },
        _ => {
            for (n, o) in rows.zip(out.chunks_exact_mut(TB)) {
                let (w, s) = m.row(n);
                o.copy_from_slice(&dot_scalar(shape, w, s, acts));
            }
        }
    }
}

/// Most activation rows sharing one pass over a weight row: as many as keep every
/// accumulator in registers (32 vector registers on AVX-512, 16 otherwise).
fn token_block(isa: CpuIsa) -> usize {
    match isa {
        CpuIsa::Avx512Vnni => 8,
        _ => 4,
    }
}

/// `out[r · acts.len() + i] = row_{rows.start + r} · acts[i]` for any number of activation
/// rows, taken in blocks of [`token_block`].
fn block_rows(
    isa: CpuIsa,
    shape: DotShape,
    m: &PackedMatrix,
    rows: Range<usize>,
    acts: &[ActRow],
    out: &mut [f32],
) {
    let (n_rows, n_acts, tbmax) = (rows.len(), acts.len(), token_block(isa));
    let mut tmp = vec![0f32; n_rows * tbmax];
    for (ci, a) in acts.chunks(tbmax).enumerate() {
        let tb = a.len();
        let tmp = &mut tmp[..n_rows * tb];
        let r = rows.clone();
        match tb {
            8 => block::<8>(isa, shape, m, r, a.try_into().unwrap(), tmp),
            7 => block::<7>(isa, shape, m, r, a.try_into().unwrap(), tmp),
            6 => block::<6>(isa, shape, m, r, a.try_into().unwrap(), tmp),
            5 => block::<5>(isa, shape, m, r, a.try_into().unwrap(), tmp),
            4 => block::<4>(isa, shape, m, r, a.try_into().unwrap(), tmp),
            3 => block::<3>(isa, shape, m, r, a.try_into().unwrap(), tmp),
            2 => block::<2>(isa, shape, m, r, a.try_into().unwrap(), tmp),
            _ => block::<1>(isa, shape, m, r, a.try_into().unwrap(), tmp),
        }
        for (r, vals) in tmp.chunks_exact(tb).enumerate() {
            let start = r * n_acts + ci * tbmax;
            out[start..start + tb].copy_from_slice(vals);
        }
    }
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Rows of the intermediate (stage 1) or hidden (stage 2) dimension per rayon task.
const ROW_BLOCK: usize = 64;

/// Fused routed experts on the CPU.
///
/// `xs [tokens, H]` and `weights [tokens, top_k]` are row-major F32; `plan` groups the routed
/// slots by expert; `slab_of(e)` returns expert `e`'s slab bytes. Returns
/// `Σ_j weights[t, j] · down(silu(gate(x_t)) · up(x_t))` as row-major `[tokens, H]`.
pub fn routed_forward<'a>(
    isa: CpuIsa,
    layout: ExpertLayout,
    slab_of: &(dyn Fn(usize) -> &'a [u8] + Sync),
    plan: &RoutePlan,
    xs: &[f32],
    weights: &[f32],
) -> Vec<f32> {
    let mut out = vec![0f32; xs.len()];
    routed_forward_into(isa, layout, slab_of, plan, xs, weights, &mut out);
    out
}

/// [`routed_forward`] adding onto `out [tokens, H]`: each output element continues its sum
/// over the plan's experts in ascending order from the value already there. Running the
/// experts of a routing in ascending chunks (e.g. as many as a bounded cache holds at once)
/// therefore gives exactly the bits of one call over all of them.
pub fn routed_forward_into<'a>(
    isa: CpuIsa,
    layout: ExpertLayout,
    slab_of: &(dyn Fn(usize) -> &'a [u8] + Sync),
    plan: &RoutePlan,
    xs: &[f32],
    weights: &[f32],
    out: &mut [f32],
) {
    assert!(isa.is_available(), "{isa:?} is not supported by this CPU");
    let (h, inter, g) = (layout.hidden, layout.intermediate, layout.group_size.get());
    let (tokens, k) = (plan.tokens, plan.top_k);
    assert_eq!(xs.len(), tokens * h);
    assert_eq!(out.len(), tokens * h);
    assert_eq!(weights.len(), tokens * k);
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
        PackedMatrix {
            layout: l,
            weights: &slab[w..w + l.weight_bytes()],
            scales: &slab[s..s + 2 * l.scale_count()],
        }
    };

    // Stage 1: h[slot] = silu(gate · x) * (up · x), per (expert, block of intermediate rows).
    let acts = QuantActs::new(xs, tokens, h, g);
    let shape_gu = DotShape::of(layout.gate_up());
    let blocks = inter.div_ceil(ROW_BLOCK);
    let tasks: Vec<(usize, usize)> = (0..plan.groups.len())
        .flat_map(|gi| (0..blocks).map(move |b| (gi, b)))
        .collect();
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(gi, b)| {
            let (e, slots) = (&plan.groups[gi].0, &plan.groups[gi].1);
            let m = matrix(*e, false);
            let rows = b * ROW_BLOCK..((b + 1) * ROW_BLOCK).min(inter);
            let a: Vec<ActRow> = slots.iter().map(|&s| acts.row(s / k)).collect();
            let mut gate = vec![0f32; rows.len() * slots.len()];
            let mut up = vec![0f32; rows.len() * slots.len()];
            block_rows(isa, shape_gu, &m, rows.clone(), &a, &mut gate);
            block_rows(
                isa,
                shape_gu,
                &m,
                inter + rows.start..inter + rows.end,
                &a,
                &mut up,
            );
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = silu(*g) * u;
            }
            gate
        })
        .collect();
    let mut hidden = vec![0f32; tokens * k * inter];
    for (&(gi, b), part) in tasks.iter().zip(&parts) {
        let slots = &plan.groups[gi].1;
        for (r, vals) in part.chunks(slots.len()).enumerate() {
            for (&slot, &v) in slots.iter().zip(vals) {
                hidden[slot * inter + b * ROW_BLOCK + r] = v;
            }
        }
    }
    drop(parts);

    // Stage 2: out[t] += w[slot] * (down · h[slot]), per block of hidden rows, experts ascending.
    let hq = QuantActs::new(&hidden, tokens * k, inter, g);
    drop(hidden);
    let shape_dn = DotShape::of(layout.down());
    let blocks = h.div_ceil(ROW_BLOCK);
    let parts: Vec<Vec<f32>> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let rows = b * ROW_BLOCK..((b + 1) * ROW_BLOCK).min(h);
            let width = rows.len();
            let mut local = vec![0f32; tokens * width];
            for (t, l) in local.chunks_exact_mut(width).enumerate() {
                l.copy_from_slice(&out[t * h + rows.start..t * h + rows.end]);
            }
            let mut y = Vec::new();
            for (e, slots) in &plan.groups {
                let m = matrix(*e, true);
                let a: Vec<ActRow> = slots.iter().map(|&s| hq.row(s)).collect();
                y.resize(width * slots.len(), 0f32);
                block_rows(isa, shape_dn, &m, rows.clone(), &a, &mut y);
                for (r, ys) in y.chunks_exact(slots.len()).enumerate() {
                    for (&slot, &v) in slots.iter().zip(ys) {
                        local[(slot / k) * width + r] += weights[slot] * v;
                    }
                }
            }
            local
        })
        .collect();
    for (b, local) in parts.iter().enumerate() {
        let width = local.len() / tokens.max(1);
        for t in 0..tokens {
            out[t * h + b * ROW_BLOCK..t * h + b * ROW_BLOCK + width]
                .copy_from_slice(&local[t * width..(t + 1) * width]);
        }
    }
}
