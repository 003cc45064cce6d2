//! Criterion benches of the non-expert projections on the CPU at OLMoE shapes: one attention
//! projection (2048 × 2048) and `lm_head` (50304 × 2048), decode (M = 1) and prefill chunks (M =
//! 128, and 512, the default chunk), through `DenseLinear` in BF16 (our kernel), INT8 (our W8A8
//! kernel) and F32 (Candle's matmul), called from rayon's pool as a model calls them. Throughput
//! is in weight bytes read, so decode figures compare directly with the machine's read
//! bandwidth. A third shape, 512 × 2048 (2 MiB in BF16), stays in a 2 MiB L2 between calls:
//! at M = 1 it gives the kernels' compute rate, which sets the pace where the cores, not the
//! memory, are the limit.
//!
//! `cargo bench --bench dense_kernels`

use candle::{DType, Device, Module, Tensor};
use candle_qmoe::DenseLinear;
use candle_qmoe_suite::testing::time_on_pool;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// `(name, out, in)`.
const SHAPES: [(&str, usize, usize); 3] = [
    ("attn_2048", 2048, 2048),
    ("lm_head", 50304, 2048),
    ("cached_512", 512, 2048),
];

fn bench_dense(c: &mut Criterion) {
    let dev = Device::Cpu;
    for (name, n, k) in SHAPES {
        let w = (Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap())
            .to_dtype(DType::BF16)
            .unwrap();
        let bf16 = DenseLinear::new(w.clone(), None).unwrap();
        let int8 = bf16.to_int8().unwrap();
        let f32 = DenseLinear::new(w.to_dtype(DType::F32).unwrap(), None).unwrap();
        for m in [1usize, 128, 512] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
            let mut g = c.benchmark_group(format!("dense/{name}/m{m}"));
            g.sample_size(10);
            for (label, lin) in [("bf16", &bf16), ("int8", &int8), ("f32_candle", &f32)] {
                g.throughput(Throughput::Bytes(lin.weight_bytes() as u64));
                g.bench_with_input(BenchmarkId::from_parameter(label), &x, |b, x| {
                    b.iter_custom(|iters| time_on_pool(iters, || lin.forward(x).unwrap()))
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, bench_dense);
criterion_main!(benches);
