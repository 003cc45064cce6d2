//! Deterministic random weights, activations and routings with realistic scales, for
//! benchmarks, tests and offline demos (no download needed).

use candle::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::pack::DenseExpert;

/// `n` normal samples with standard deviation `std` from seed `seed` (Box–Muller).
pub fn gaussian(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect()
}

/// `n` experts with `gate`/`up` `[inter, hidden]` and `down` `[hidden, inter]` drawn from
/// N(0, std²) in F32 (0.02 is a typical LLM weight scale), generated in parallel.
pub fn random_experts(
    seed: u64,
    n: usize,
    hidden: usize,
    inter: usize,
    std: f32,
) -> candle::Result<Vec<DenseExpert>> {
    (0..n as u64)
        .into_par_iter()
        .map(|e| {
            let s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (e << 20);
            let t = |i: u64, r: usize, c: usize| {
                Tensor::from_vec(gaussian(s + i, r * c, std), (r, c), &Device::Cpu)
            };
            Ok(DenseExpert {
                gate: t(0, inter, hidden)?,
                up: t(1, inter, hidden)?,
                down: t(2, hidden, inter)?,
            })
        })
        .collect()
}

/// A routing of `tokens` tokens: `k` distinct experts each (`[tokens, k]`, row-major) and
/// softmax-like positive weights.
pub fn random_routing(seed: u64, tokens: usize, k: usize, experts: usize) -> (Vec<u32>, Vec<f32>) {
    assert!(k <= experts, "top-k {k} exceeds {experts} experts");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut ids, mut weights) = (
        Vec::with_capacity(tokens * k),
        Vec::with_capacity(tokens * k),
    );
    for _ in 0..tokens {
        let start = ids.len();
        while ids.len() < start + k {
            let e = rng.random_range(0..experts as u32);
            if !ids[start..].contains(&e) {
                ids.push(e);
            }
        }
        let logits: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        weights.extend(logits.iter().map(|l| l.exp() / z));
    }
    (ids, weights)
}
