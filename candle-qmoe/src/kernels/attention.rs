//! CPU attention over a KV cache that is appended to in place: no per-token concatenation, no
//! repeated key/value heads for GQA, and one fused pass per (sequence, head, query) — scores,
//! softmax in F32, weighted sum of the values — with the causal mask implied by positions.
//!
//! Keys and values are kept as `[batch, kv_heads, capacity, head_dim]`, so that one head's keys
//! are contiguous, in F32 or in BF16 ([`KvDtype`]: the checkpoint's precision, as transformers
//! keeps them for a BF16 model, and half the bytes to read per decoded token; widened exactly to
//! F32 as they are read); query head `h` reads kv head `h / (heads / kv_heads)` as
//! `repeat_interleave` would. The capacity grows in chunks of at least [`KV_CHUNK`] positions
//! (and by half again when it grows), so a long generation copies the cache a few times in all
//! instead of once per token.

use crate::kernels::cpu::CpuIsa;
use candle::DType;
use half::bf16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod x86;

/// The smallest growth of the cache, in positions.
pub const KV_CHUNK: usize = 256;

/// Query rows (tokens × the query heads of one kv head) per rayon task, at least one token.
const QUERIES_PER_TASK: usize = 16;

/// How a [`KvCache`] stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// F32: exactly the activations (the F32 reference path).
    F32,
    /// BF16: keys and values rounded to nearest-even once, when appended.
    Bf16,
}

impl KvDtype {
    /// The storage for a model whose weights are `weights`: F32 for F32 weights (the reference
    /// path), BF16 (the checkpoint's precision) otherwise.
    pub fn for_weights(weights: DType) -> Self {
        if weights == DType::F32 {
            Self::F32
        } else {
            Self::Bf16
        }
    }

    /// The Candle dtype of a stored value.
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
        }
    }

    /// Bytes per stored value.
    pub fn size_in_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// A stored key or value: converted from F32 once when appended, widened to F32 when read.
trait KvElem: Copy + Default + Send + Sync {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Which element of a chunk of `2·n` lane `l` of [`KvElem::load_chunk`] holds, for `n`
    /// lanes per vector.
    #[cfg(target_arch = "x86_64")]
    fn lane_element(l: usize, n: usize) -> usize;
    /// The `2·V::N` elements at `p` widened to F32 as two vectors, in the storage's own lane
    /// order ([`KvElem::lane_element`]).
    ///
    /// # Safety
    /// The CPU must support `V`'s width; `2·V::N` elements must be readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_chunk<V: x86::Lanes>(p: *const Self) -> (V, V);
}

impl KvElem for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    fn lane_element(l: usize, _: usize) -> usize {
        l
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_chunk<V: x86::Lanes>(p: *const Self) -> (V, V) {
        // SAFETY: the caller's contract.
        unsafe { (V::load(p), V::load(p.add(V::N))) }
    }
}

impl KvElem for bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    /// Exact widening (a shift), written out so that it vectorises.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    /// One load of 32-bit words holds two BF16 each: the even elements fill the first
    /// vector, the odd ones the second.
    #[cfg(target_arch = "x86_64")]
    fn lane_element(l: usize, n: usize) -> usize {
        if l < n {
            2 * l
        } else {
            2 * (l - n) + 1
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load_chunk<V: x86::Lanes>(p: *const Self) -> (V, V) {
        // SAFETY: the caller's contract.
        unsafe { V::widen_bf16(p as *const u16) }
    }
}

/// Keys or values in their storage type.
#[derive(Clone, Debug)]
enum KvBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl KvBuf {
    fn new(dtype: KvDtype) -> Self {
        match dtype {
            KvDtype::F32 => Self::F32(Vec::new()),
            KvDtype::Bf16 => Self::Bf16(Vec::new()),
        }
    }
}

/// The keys and values of one attention layer, on the CPU.
#[derive(Clone, Debug)]
pub struct KvCache {
    batch: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: KvDtype,
    len: usize,
    capacity: usize,
    k: KvBuf,
    v: KvBuf,
}

impl KvCache {
    /// An empty cache for `batch` sequences of `kv_heads` heads of `head_dim`, stored as `dtype`.
    pub fn new(batch: usize, kv_heads: usize, head_dim: usize, dtype: KvDtype) -> Self {
        Self {
            batch,
            kv_heads,
            head_dim,
            dtype,
            len: 0,
            capacity: 0,
            k: KvBuf::new(dtype),
            v: KvBuf::new(dtype),
        }
    }

    /// How keys and values are stored.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the current allocation holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Bytes allocated for keys and values.
    pub fn allocated_bytes(&self) -> usize {
        let values = match (&self.k, &self.v) {
            (KvBuf::F32(k), KvBuf::F32(v)) => k.capacity() + v.capacity(),
            (KvBuf::Bf16(k), KvBuf::Bf16(v)) => k.capacity() + v.capacity(),
            _ => unreachable!("keys and values share one dtype"),
        };
        values * self.dtype.size_in_bytes()
    }

    /// Bytes of keys and values per cached position: what each decoded token reads per position
    /// of its context.
    pub fn bytes_per_position(&self) -> usize {
        self.batch * 2 * self.kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    fn grow_to(&mut self, needed: usize) {
        if needed <= self.capacity {
            return;
        }
        let cap = needed
            .max(self.capacity + self.capacity / 2)
            .next_multiple_of(KV_CHUNK);
        let (d, old, len) = (self.head_dim, self.capacity, self.len);
        let rows = self.batch * self.kv_heads;
        fn regrow<E: KvElem>(
            buf: &mut Vec<E>,
            rows: usize,
            old: usize,
            cap: usize,
            len: usize,
            d: usize,
        ) {
            // Zeroed memory is mapped lazily: only the positions written are touched.
            let mut next = vec![E::default(); rows * cap * d];
            for r in 0..rows {
                next[r * cap * d..(r * cap + len) * d]
                    .copy_from_slice(&buf[r * old * d..(r * old + len) * d]);
            }
            *buf = next;
        }
        for buf in [&mut self.k, &mut self.v] {
            match buf {
                KvBuf::F32(b) => regrow(b, rows, old, cap, len, d),
                KvBuf::Bf16(b) => regrow(b, rows, old, cap, len, d),
            }
        }
        self.capacity = cap;
    }

    /// Appends `s` positions of keys and values given token-major, `[batch, s, kv_heads,
    /// head_dim]` (the projections' layout).
    ///
    /// # Panics
    /// When the slices do not hold `batch · s · kv_heads · head_dim` values.
    pub fn append(&mut self, k: &[f32], v: &[f32], s: usize) {
        let (hk, d) = (self.kv_heads, self.head_dim);
        assert_eq!(
            k.len(),
            self.batch * s * hk * d,
            "keys must be [b, s, kv_heads, d]"
        );
        assert_eq!(v.len(), k.len(), "values must be [b, s, kv_heads, d]");
        self.grow_to(self.len + s);
        let (cap, len, batch) = (self.capacity, self.len, self.batch);
        let store = |buf: &mut KvBuf, x: &[f32]| {
            fn put<E: KvElem>(buf: &mut [E], src: &[f32]) {
                buf.iter_mut()
                    .zip(src)
                    .for_each(|(o, &x)| *o = E::from_f32(x));
            }
            for b in 0..batch {
                for t in 0..s {
                    for h in 0..hk {
                        let src = &x[((b * s + t) * hk + h) * d..][..d];
                        let dst = ((b * hk + h) * cap + len + t) * d;
                        match buf {
                            KvBuf::F32(buf) => put(&mut buf[dst..dst + d], src),
                            KvBuf::Bf16(buf) => put(&mut buf[dst..dst + d], src),
                        }
                    }
                }
            }
        };
        store(&mut self.k, k);
        store(&mut self.v, v);
        self.len += s;
    }

    /// Drops the positions from `len` on (keeps the allocation): undoes appends, e.g. of a
    /// step that failed in a later layer. Does nothing when `len` is not below [`Self::len`].
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// The element range of sequence `b`, kv head `h`'s `[len, head_dim]` keys (and values).
    fn head_range(&self, b: usize, h: usize) -> std::ops::Range<usize> {
        let start = (b * self.kv_heads + h) * self.capacity * self.head_dim;
        start..start + self.len * self.head_dim
    }
}

/// Causal attention of the last `s` positions of `cache` (just appended) to every position up
/// to their own: `q [batch, s, heads, head_dim]` token-major, scores scaled by `scale`; returns
/// `[batch, s, heads, head_dim]`. Runs the best path for this CPU ([`CpuIsa::detect`]).
///
/// # Panics
/// When `q` does not match the cache's batch and head dim, `heads` is not a multiple of the
/// cache's kv heads, or the cache holds fewer than `s` positions.
pub fn attend(q: &[f32], cache: &KvCache, s: usize, heads: usize, scale: f32) -> Vec<f32> {
    attend_with_isa(q, cache, s, heads, scale, CpuIsa::detect())
}

/// [`attend`] on the instruction set `isa`: the AVX-512 kernel for head dims that are a
/// multiple of 32, the AVX2 + FMA kernel for multiples of 16, the portable path otherwise.
///
/// # Panics
/// As [`attend`], and when this CPU lacks `isa`.
pub fn attend_with_isa(
    q: &[f32],
    cache: &KvCache,
    s: usize,
    heads: usize,
    scale: f32,
    isa: CpuIsa,
) -> Vec<f32> {
    assert!(isa.is_available(), "this CPU lacks {isa:?}");
    match (&cache.k, &cache.v) {
        (KvBuf::F32(k), KvBuf::F32(v)) => attend_over(q, cache, k, v, s, heads, scale, isa),
        (KvBuf::Bf16(k), KvBuf::Bf16(v)) => attend_over(q, cache, k, v, s, heads, scale, isa),
        _ => unreachable!("keys and values share one dtype"),
    }
}

/// [`attend`] over the cache's keys `k` and values `v` in their storage type. One task per
/// (sequence, kv head, block of query tokens) serves every query head that reads the kv head,
/// so that its keys and values are streamed once for all of them (split when there would be
/// fewer tasks than threads).
#[allow(clippy::too_many_arguments)]
fn attend_over<E: KvElem>(
    q: &[f32],
    cache: &KvCache,
    k: &[E],
    v: &[E],
    s: usize,
    heads: usize,
    scale: f32,
    isa: CpuIsa,
) -> Vec<f32> {
    let (batch, d, hk) = (cache.batch, cache.head_dim, cache.kv_heads);
    assert_eq!(q.len(), batch * s * heads * d, "q must be [b, s, heads, d]");
    assert!(
        hk > 0 && heads.is_multiple_of(hk),
        "{heads} heads over {hk} kv heads"
    );
    assert!(
        s <= cache.len,
        "{s} queries but {} cached positions",
        cache.len
    );
    let n_rep = heads / hk;
    let first = cache.len - s;
    // Query heads per task: all of a kv head's, unless that leaves threads idle (e.g. one
    // decoded token over 4 kv heads on 16 threads); then the fewest splits that do not.
    let tokens_per_task = |heads_per_task: usize| (QUERIES_PER_TASK / heads_per_task).max(1);
    let tasks = |split: usize| batch * hk * split * s.div_ceil(tokens_per_task(n_rep / split));
    let split = (1..=n_rep)
        .filter(|k| n_rep.is_multiple_of(*k))
        .find(|&k| tasks(k) >= rayon::current_num_threads())
        .unwrap_or(n_rep);
    let heads_per_task = n_rep / split;
    let tokens_per_task = tokens_per_task(heads_per_task);
    let blocks = s.div_ceil(tokens_per_task);
    let groups = hk * split;
    // Each task writes its queries' rows, token by token and head by head within the group.
    let parts: Vec<Vec<f32>> = (0..batch * groups * blocks)
        .into_par_iter()
        .map(|task| {
            let (bg, blk) = (task / blocks, task % blocks);
            let (b, g) = (bg / groups, bg % groups);
            let range = cache.head_range(b, g / split);
            let tokens = blk * tokens_per_task..((blk + 1) * tokens_per_task).min(s);
            let mut group = GroupQueries {
                q: Vec::with_capacity(tokens.len() * n_rep),
                visible: Vec::with_capacity(tokens.len() * n_rep),
                keys: &k[range.clone()],
                values: &v[range],
                d,
                scale,
            };
            for t in tokens {
                for h in g * heads_per_task..(g + 1) * heads_per_task {
                    let qi = ((b * s + t) * heads + h) * d;
                    group.q.push(&q[qi..qi + d]);
                    group.visible.push(first + t + 1);
                }
            }
            let mut out = vec![0f32; group.q.len() * d];
            // SAFETY: `isa` is available (asserted above), and each kernel's head dims checked.
            #[cfg(target_arch = "x86_64")]
            match isa {
                CpuIsa::Avx512Vnni if x86::avx512_fits(d) => {
                    unsafe { x86::attend_group_avx512(&group, &mut out) };
                    return out;
                }
                CpuIsa::Avx512Vnni | CpuIsa::Avx2 if x86::avx2_fits(d) => {
                    unsafe { x86::attend_group_avx2(&group, &mut out) };
                    return out;
                }
                _ => {}
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = isa;
            let mut scores = Vec::with_capacity(cache.len);
            for (i, o) in out.chunks_exact_mut(d).enumerate() {
                let query = HeadQuery {
                    q: group.q[i],
                    keys: group.keys,
                    values: group.values,
                    visible: group.visible[i],
                    scale,
                };
                head_query_portable(&query, &mut scores, o);
            }
            out
        })
        .collect();
    let mut out = vec![0f32; q.len()];
    for (task, part) in parts.iter().enumerate() {
        let (bg, blk) = (task / blocks, task % blocks);
        let (b, g) = (bg / groups, bg % groups);
        for (r, row) in part.chunks_exact(d).enumerate() {
            let t = blk * tokens_per_task + r / heads_per_task;
            let h = g * heads_per_task + r % heads_per_task;
            let dst = ((b * s + t) * heads + h) * d;
            out[dst..dst + d].copy_from_slice(row);
        }
    }
    out
}

/// The queries of one task: every query row, of one or more tokens, that reads one kv head of
/// one sequence.
struct GroupQueries<'a, E> {
    /// Each query's `d` values.
    q: Vec<&'a [f32]>,
    /// How many leading positions each query sees (its own included).
    visible: Vec<usize>,
    /// The kv head's `[len, d]` keys.
    keys: &'a [E],
    /// The kv head's `[len, d]` values.
    values: &'a [E],
    /// The head dimension (read by the x86 kernels).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    d: usize,
    /// The score scale, `1 / √d` (read by the x86 kernels).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    scale: f32,
}

/// One query of one head against the first `visible` keys and values of its kv head.
struct HeadQuery<'a, E> {
    q: &'a [f32],
    keys: &'a [E],
    values: &'a [E],
    visible: usize,
    scale: f32,
}

/// Scores `q · k_j · scale`, softmax (max-subtracted, F32), `out = Σ_j p_j v_j`: the portable
/// path, one query at a time.
fn head_query_portable<E: KvElem>(h: &HeadQuery<E>, scores: &mut Vec<f32>, out: &mut [f32]) {
    let d = h.q.len();
    scores.clear();
    for k in h.keys.chunks_exact(d).take(h.visible) {
        prefetch_rows(k);
        scores.push(dot(h.q, k) * h.scale);
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut sum = 0f32;
    for x in scores.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    out.fill(0.0);
    for (&p, v) in scores.iter().zip(h.values.chunks_exact(d)) {
        prefetch_rows(v);
        for (o, &x) in out.iter_mut().zip(v) {
            *o += p * x.to_f32();
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

/// Prefetches into L2 the lines `STREAM_AHEAD_BYTES` past the key or value rows `r`, one per
/// 64 bytes (never faults past the end): a head's keys, then its values, are one sequential
/// stream each. After 4000 tokens of context (OLMoE's 16 layers × 16 heads, BF16, 2 threads
/// of a Xeon) the attention took 25.4 ms per token against 34.4 without (20.6 against
/// 15.2 GB/s).
#[inline(always)]
fn prefetch_rows<E>(r: &[E]) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::x86_simd::{prefetch_l2, STREAM_AHEAD_BYTES};
        let p = r.as_ptr() as *const u8;
        for off in (0..std::mem::size_of_val(r)).step_by(64) {
            prefetch_l2(p.wrapping_add(STREAM_AHEAD_BYTES + off));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}

/// A dot product in eight independent lanes (so that it vectorises), then summed.
#[inline(always)]
fn dot<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y.to_f32())
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].to_f32();
        }
    }
    acc.iter().sum::<f32>() + tail
}
