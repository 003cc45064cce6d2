//! Criterion benches of one MoE layer's routed experts at OLMoE and Qwen1.5-MoE shapes, decode
//! (T = 1) and prefill (T = 128): the INT4 kernel next to Candle's dense BF16 and Q4_0 paths,
//! each called from rayon's pool as a model calls it.
//!
//! `cargo bench --bench moe_layer` (set `QMOE_BENCH_SHAPES=olmoe` to run one shape).
//!
//! `moe_layer/slab_checksum` times the first-use check of one Qwen3-30B-A3B expert slab read
//! from memory (each call the next slab of a 2 GiB buffer): CRC-32 in one pass on the calling
//! thread against [`candle_qmoe::pack::slab_checksum`], which hashes pieces on the pool.

use candle::quantized::GgmlDType;
use candle::{DType, Device, Tensor};
use candle_qmoe::pack::{
    slab_checksum, DenseExpert, ExpertNames, GroupSize, LayerPack, ScaleSearch,
};
use candle_qmoe::synthetic::SyntheticKind;
use candle_qmoe::{synthetic, DenseExperts, GgmlExperts, Int4Experts, RoutedExperts};
use candle_qmoe_suite::testing::time_on_pool;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// The benched layer shapes: OLMoE-1B-7B and Qwen1.5-MoE-A2.7B.
const SHAPES: [(&str, SyntheticKind); 2] = [
    ("olmoe", SyntheticKind::Olmoe),
    ("qwen", SyntheticKind::Qwen2Moe),
];

fn bench_layer(c: &mut Criterion) {
    let only = std::env::var("QMOE_BENCH_SHAPES").unwrap_or_default();
    for (name, kind) in SHAPES
        .into_iter()
        .filter(|(name, _)| only.is_empty() || only.contains(name))
    {
        let s = kind.moe_shape();
        let dense =
            synthetic::random_experts(7, s.experts, s.hidden, s.intermediate, 0.02).unwrap();
        let layout = s.layout(GroupSize::default());
        let int4 = Int4Experts::new(
            LayerPack::quantize("l", ExpertNames::PROJ, &dense, layout, ScaleSearch::Mse).unwrap(),
        );
        let bf16: Vec<DenseExpert> = dense
            .iter()
            .map(|x| DenseExpert {
                gate: x.gate.to_dtype(DType::BF16).unwrap(),
                up: x.up.to_dtype(DType::BF16).unwrap(),
                down: x.down.to_dtype(DType::BF16).unwrap(),
            })
            .collect();
        let bf16 = DenseExperts::new(bf16).unwrap();
        let q4_0 = GgmlExperts::quantize(&dense, GgmlDType::Q4_0).unwrap();
        drop(dense);
        let backends: [(&str, &dyn RoutedExperts); 3] = [
            ("int4", &int4),
            ("dense_bf16", &bf16),
            ("candle_q4_0", &q4_0),
        ];
        let mut group = c.benchmark_group(format!("moe_layer/{name}"));
        group.sample_size(10);
        for t in [1usize, 128] {
            let xs = Tensor::from_vec(
                synthetic::gaussian(t as u64, t * s.hidden, 1.0),
                (t, s.hidden),
                &Device::Cpu,
            )
            .unwrap();
            let (ids, w) = synthetic::random_routing(t as u64, t, s.top_k, s.experts);
            let ids = Tensor::from_vec(ids, (t, s.top_k), &Device::Cpu).unwrap();
            let w = Tensor::from_vec(w, (t, s.top_k), &Device::Cpu).unwrap();
            group.throughput(Throughput::Elements(t as u64));
            for (name, b) in backends {
                group.bench_with_input(BenchmarkId::new(name, format!("T{t}")), &t, |bench, _| {
                    bench.iter_custom(|iters| {
                        time_on_pool(iters, || b.forward(&xs, &ids, &w).unwrap())
                    })
                });
            }
        }
        group.finish();
    }
}

fn bench_slab_checksum(c: &mut Criterion) {
    let slab = SyntheticKind::Qwen3Moe
        .moe_shape()
        .layout(GroupSize::default())
        .slab_bytes();
    let slabs = (2usize << 30) / slab;
    // Filled on first use, so that a run filtered to other benches does not build 2 GiB.
    let bytes = std::sync::OnceLock::new();
    let bytes = || -> &Vec<u8> {
        bytes.get_or_init(|| (0..slabs * slab).map(|i| (i ^ (i >> 11)) as u8).collect())
    };
    let mut group = c.benchmark_group("moe_layer/slab_checksum");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(slab as u64));
    type Checksum = fn(&[u8]) -> u32;
    let passes: [(&str, Checksum); 2] = [
        ("one_pass", crc32fast::hash),
        ("pieces_on_pool", slab_checksum),
    ];
    for (name, checksum) in passes {
        group.bench_function(BenchmarkId::new(name, "qwen3_slab"), |bench| {
            let bytes = bytes();
            bench.iter_custom(|iters| {
                let mut next = 0;
                time_on_pool(iters, || {
                    next = (next + 1) % slabs;
                    checksum(&bytes[next * slab..(next + 1) * slab])
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_layer, bench_slab_checksum);
criterion_main!(benches);
