//! Criterion benches of the fused CPU attention over the in-place BF16 KV cache, as a decoded
//! token reads it: one query per head against 16 layers' caches of 4000 positions each, at the
//! OLMoE-1B-7B shape (16 heads, no GQA) and the Qwen3-30B-A3B shape (32 query heads over 4 kv
//! heads). Before each layer's call, untimed, 64 MiB of other memory is read, as a model reads
//! a layer's weights, so that each cache comes from memory as in a model, whatever the size of
//! the last-level cache. Throughput is in KV-cache bytes read, so the figures compare directly
//! with the machine's read bandwidth, and beside them a plain read of as many bytes, after the
//! same other reads, gives the bound in the same run. A last benchmark per shape times a
//! 128-token prefill chunk after 512 cached positions. Every call is made from rayon's pool, as
//! a model makes it.
//!
//! `cargo bench --bench attention`

use candle_qmoe::kernels::attention::{attend, KvCache, KvDtype};
use candle_qmoe::pool::with_workers_awake;
use candle_qmoe_suite::testing::{time_on_pool, Rng};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Layers whose caches one decoded token reads.
const LAYERS: usize = 16;
const HEAD_DIM: usize = 128;

/// Bytes of other memory read before each layer's call (a layer's weights, roughly).
const BETWEEN_LAYERS_BYTES: usize = 64 << 20;

/// `(name, heads, kv_heads)`.
const SHAPES: [(&str, usize, usize); 2] = [("olmoe", 16, 16), ("qwen3_30b", 32, 4)];

/// A cache holding `len` random positions.
fn cache(rng: &mut Rng, kv_heads: usize, len: usize) -> KvCache {
    let mut cache = KvCache::new(1, kv_heads, HEAD_DIM, KvDtype::Bf16);
    let n = len * kv_heads * HEAD_DIM;
    cache.append(&rng.normals(n, 1.0), &rng.normals(n, 1.0), len);
    cache
}

/// Reads `bytes` in parallel (an XOR fold), so that it displaces what the caches held.
fn read_through(bytes: &[u64]) -> u64 {
    bytes
        .par_chunks(1 << 16)
        .map(|c| c.iter().fold(0, |a, &b| a ^ b))
        .reduce(|| 0, |a, b| a ^ b)
}

/// The time of `iters` rounds of `call` on each layer's item, each call after reading that
/// layer's slice of `other` (untimed); made from rayon's pool with its workers awake, as a
/// model's forward pass makes its calls.
fn timed_after_other_reads<T: Sync>(
    iters: u64,
    per_layer: &[T],
    other: &[u64],
    mut call: impl FnMut(&T) + Send,
) -> Duration {
    with_workers_awake(|| {
        let mut timed = Duration::ZERO;
        for _ in 0..iters {
            for (item, between) in per_layer.iter().zip(other.chunks(BETWEEN_LAYERS_BYTES / 8)) {
                std::hint::black_box(read_through(between));
                let start = Instant::now();
                call(item);
                timed += start.elapsed();
            }
        }
        timed
    })
}

fn bench_attention(c: &mut Criterion) {
    // One slice of other memory per layer, so that a layer's cache was last read 1 GiB ago.
    let other: Vec<u64> = (0..(LAYERS * BETWEEN_LAYERS_BYTES / 8) as u64).collect();
    let mut rng = Rng::new(7);
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    for (name, heads, kv_heads) in SHAPES {
        let layers: Vec<KvCache> = (0..LAYERS)
            .map(|_| cache(&mut rng, kv_heads, 4000))
            .collect();
        let q = rng.normals(heads * HEAD_DIM, 1.0);
        let bytes: usize = layers
            .iter()
            .map(|c| c.bytes_per_position() * c.len())
            .sum();
        let mut g = c.benchmark_group(format!("attention/{name}"));
        g.sample_size(10);
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function("decode_ctx4000_16_layers", |b| {
            b.iter_custom(|iters| {
                timed_after_other_reads(iters, &layers, &other, |cache| {
                    std::hint::black_box(attend(&q, cache, 1, heads, scale));
                })
            })
        });
        // The bound: reading as many bytes per layer (an XOR fold), after the same reads.
        let plain: Vec<Vec<u64>> = layers
            .iter()
            .map(|c| vec![1u64; c.bytes_per_position() * c.len() / 8])
            .collect();
        g.bench_function("plain_read_of_the_same_bytes", |b| {
            b.iter_custom(|iters| {
                timed_after_other_reads(iters, &plain, &other, |bytes| {
                    std::hint::black_box(read_through(bytes));
                })
            })
        });
        drop((layers, plain));
        let s = 128;
        let layer = cache(&mut rng, kv_heads, 512 + s);
        let q = rng.normals(s * heads * HEAD_DIM, 1.0);
        g.throughput(Throughput::Elements(s as u64));
        g.bench_function("prefill128_after_512", |b| {
            b.iter_custom(|iters| time_on_pool(iters, || attend(&q, &layer, s, heads, scale)))
        });
        g.finish();
    }
}

criterion_group!(benches, bench_attention);
criterion_main!(benches);
