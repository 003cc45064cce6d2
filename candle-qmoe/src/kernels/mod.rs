//! Our compute kernels: fused top-k W4A16 for routed experts straight from the INT4 pack, and the
//! CPU paths around them.
//!
//! [`cpu`] holds the SIMD + multithreaded CPU W4A16 kernel, `cuda` (feature `cuda`) the launcher
//! of the GPU kernels of `candle-qmoe-kernels`. [`RoutePlan`] groups the routed (token, slot)
//! pairs by expert so that each expert's bytes are read once per call. On the CPU, [`dense`]
//! multiplies by the BF16 non-expert weights and [`attention`] attends over an in-place KV cache.

pub mod attention;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dense;
mod feature_blocks;

pub(crate) use feature_blocks::{par_feature_blocks, FeatureBlock};

use crate::QmoeError;

/// Whether the calling thread's stream of `device` is being captured into a CUDA graph (never on
/// the CPU). A captured call must not free memory allocated before the capture: the driver
/// refuses that free, and cudarc reports the refusal at the next call.
pub fn stream_is_capturing(device: &candle::Device) -> candle::Result<bool> {
    match device {
        #[cfg(feature = "cuda")]
        candle::Device::Cuda(d) => cuda::stream_is_capturing(&d.cuda_stream()),
        _ => Ok(false),
    }
}

/// Small SIMD helpers shared by the x86-64 kernels.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_simd {
    use std::arch::x86_64::*;

    /// How far ahead of the current position the INT4 kernels prefetch their weight stream
    /// (one sequential stream per task; the INT8 kernel's tiles prefetch one tile ahead
    /// instead).
    pub(crate) const STREAM_AHEAD_BYTES: usize = 4096;

    /// How far ahead the INT4 decode kernels then fetch the stream from L2 into L1.
    pub(crate) const STREAM_L1_BYTES: usize = 512;

    /// Prefetches the 64-byte line at `p` of a weight stream read from DRAM into L2
    /// (`prefetcht2`), whose miss queue carries the stream. A prefetch straight into L1 holds
    /// one of L1's few miss buffers per line for a whole DRAM latency; on a Zen 4 EPYC, whose
    /// cores compute the kernels slower than they read DRAM, that left the core waiting on
    /// memory instead of computing under it. Never faults, so `p` may lie past the end of the
    /// weights.
    #[inline(always)]
    pub(crate) fn prefetch_l2(p: *const u8) {
        // SAFETY: a prefetch reads nothing architecturally; SSE is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T2>(p as *const i8) };
    }

    /// Prefetches the weight stream that continues at `p` for the INT4 decode kernels (call
    /// once per 64-byte line): the line [`STREAM_AHEAD_BYTES`] ahead into L2
    /// ([`prefetch_l2`]), the one [`STREAM_L1_BYTES`] ahead from there into L1 (one OLMoE layer
    /// at T = 1 on 2 threads of a Zen 4 EPYC: 0.99 ms against 1.59 ms for one `prefetcht0`
    /// 4 KiB ahead). Never faults, so it may run past the end of the weights.
    #[inline(always)]
    pub(crate) fn prefetch_stream(p: *const u8) {
        prefetch_l2(p.wrapping_add(STREAM_AHEAD_BYTES));
        // SAFETY: as in `prefetch_l2`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(STREAM_L1_BYTES) as *const i8) };
    }

    /// The sum of the eight lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The FP16 value with bits `bits` as F32, converted by one F16C instruction (`half`'s
    /// `to_f32` is not inlined into the kernels).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) fn f16_bits_to_f32(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// Lane `t` of the result is the sum of the eight lanes of `v[t]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) fn hsum_lanes(v: [__m256i; 8]) -> __m256i {
        let ab = _mm256_hadd_epi32(v[0], v[1]);
        let cd = _mm256_hadd_epi32(v[2], v[3]);
        let ef = _mm256_hadd_epi32(v[4], v[5]);
        let gh = _mm256_hadd_epi32(v[6], v[7]);
        // [a b c d | a b c d] partial sums of the low and high 128-bit halves.
        let abcd = _mm256_hadd_epi32(ab, cd);
        let efgh = _mm256_hadd_epi32(ef, gh);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(abcd, efgh, 0x20),
            _mm256_permute2x128_si256(abcd, efgh, 0x31),
        )
    }
}

/// `x.round() as i32` (halves away from zero, saturating) without a libm call: the base x86-64
/// target has no rounding instruction, so `f32::round` is a call to `roundf` per element, which
/// showed in decode profiles of the activation quantizers. Bit for bit the same levels.
#[inline]
pub(crate) fn round_to_i32(x: f32) -> i32 {
    // `x - t` is exact: `t` is `x` truncated, within 1 of it and of the same sign.
    let t = x as i32;
    let frac = x - t as f32;
    t.saturating_add((frac >= 0.5) as i32)
        .saturating_sub((frac <= -0.5) as i32)
}

/// The contiguous elements of a CPU storage, or an error saying that `what` must be contiguous.
pub(crate) fn contiguous_slice<'a, T: candle::WithDType>(
    s: &'a candle::CpuStorage,
    l: &candle::Layout,
    what: impl std::fmt::Display,
) -> candle::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle::bail!("{what} must be contiguous"),
    }
}

/// The routed rows of one call, grouped by expert in ascending expert order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoutePlan {
    /// Top-k per token.
    pub top_k: usize,
    /// Tokens in the call.
    pub tokens: usize,
    /// `(expert, slots)`: each slot is `token * top_k + j` for the j-th choice of that token.
    pub groups: Vec<(usize, Vec<usize>)>,
}

impl RoutePlan {
    /// Groups `expert_ids [tokens, top_k]` (row-major) by expert, checking every id is below
    /// `num_experts` and that no token picks the same expert twice.
    pub fn new(expert_ids: &[u32], top_k: usize, num_experts: usize) -> Result<Self, QmoeError> {
        if top_k == 0 || !expert_ids.len().is_multiple_of(top_k) {
            return Err(QmoeError::InvalidArgument {
                argument: "expert_ids".into(),
                reason: format!(
                    "{} expert ids do not form rows of top-k = {top_k}",
                    expert_ids.len()
                ),
            });
        }
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); num_experts];
        for (slot, &e) in expert_ids.iter().enumerate() {
            let e = e as usize;
            if e >= num_experts {
                return Err(QmoeError::ExpertOutOfRange {
                    token: slot / top_k,
                    expert: e,
                    num_experts,
                });
            }
            if let Some(&prev) = by_expert[e].last() {
                if prev / top_k == slot / top_k {
                    return Err(QmoeError::DuplicateExpert {
                        token: slot / top_k,
                        expert: e,
                    });
                }
            }
            by_expert[e].push(slot);
        }
        let groups = by_expert
            .into_iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .collect();
        Ok(Self {
            top_k,
            tokens: expert_ids.len() / top_k,
            groups,
        })
    }

    /// The distinct experts used, ascending.
    pub fn experts(&self) -> impl Iterator<Item = usize> + '_ {
        self.groups.iter().map(|(e, _)| *e)
    }
}

#[cfg(test)]
mod tests {
    use super::round_to_i32;

    #[test]
    fn round_to_i32_matches_f32_round() {
        let mut xs = vec![
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -2.5,
            0.49999997,
            -0.49999997,
            32766.5,
            -32766.5,
            126.5,
            8388607.5,
            16777216.0,
            f32::MIN_POSITIVE,
        ];
        // Random values at every scale the quantizers see, and each one's neighbours.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..100_000 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let x = unit * [2.0, 300.0, 70_000.0][(state % 3) as usize];
            xs.extend([
                x,
                f32::from_bits(x.to_bits().wrapping_add(1)),
                f32::from_bits(x.to_bits().wrapping_sub(1)),
            ]);
        }
        for x in xs {
            assert_eq!(round_to_i32(x), x.round() as i32, "{x:e}");
        }
        assert_eq!(round_to_i32(f32::INFINITY), i32::MAX);
        assert_eq!(round_to_i32(f32::NEG_INFINITY), i32::MIN);
        assert_eq!(round_to_i32(f32::NAN), 0);
    }
}
