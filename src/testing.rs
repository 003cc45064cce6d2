//! Helpers shared by the integration tests and benches: deterministic random data, f64
//! references, relative errors, the checked-in fixtures, and timing calls as a model makes them.

use candle::{Device, Tensor};
use candle_qmoe::pack::DenseExpert;

/// Deterministic xorshift generator of uniform and normal-ish values.
pub struct Rng(u64);

impl Rng {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f32 / (1u64 << 53) as f32
    }
    /// Approximately normal (sum of 4 uniforms), scaled by `std`.
    pub fn normal(&mut self, std: f32) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum::<f32>() - 2.0;
        s * std * 1.732
    }
    /// `n` values of [`Rng::normal`].
    pub fn normals(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal(std)).collect()
    }
}

/// Random F32 experts with weight std `0.02` (an LLM's typical init scale).
pub fn random_experts(rng: &mut Rng, n: usize, hidden: usize, inter: usize) -> Vec<DenseExpert> {
    let dev = Device::Cpu;
    (0..n)
        .map(|_| DenseExpert {
            gate: Tensor::from_vec(rng.normals(inter * hidden, 0.02), (inter, hidden), &dev)
                .unwrap(),
            up: Tensor::from_vec(rng.normals(inter * hidden, 0.02), (inter, hidden), &dev).unwrap(),
            down: Tensor::from_vec(rng.normals(hidden * inter, 0.02), (hidden, inter), &dev)
                .unwrap(),
        })
        .collect()
}

/// Random routing: `k` distinct experts per token and positive weights.
pub fn random_routing(
    rng: &mut Rng,
    tokens: usize,
    k: usize,
    experts: usize,
) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::with_capacity(tokens * k);
    let mut w = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < k {
            let e = (rng.uniform() * experts as f32) as u32 % experts as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen);
        w.extend((0..k).map(|_| 0.05 + rng.uniform()));
    }
    (ids, w)
}

/// The values of `t`, flattened, in f64.
pub fn values_f64(t: &Tensor) -> candle::Result<Vec<f64>> {
    t.to_dtype(candle::DType::F64)?.flatten_all()?.to_vec1()
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    values_f64(t).unwrap()
}

/// The routed-experts sum computed in f64 by plain loops.
pub fn reference_f64(
    experts: &[DenseExpert],
    xs: &[f32],
    ids: &[u32],
    w: &[f32],
    k: usize,
) -> Vec<f64> {
    reference_f64_rounding_acts(experts, xs, ids, w, k, None)
}

/// `x` rounded as the CPU kernel rounds activations: per group of `group` values to the
/// nearest multiple of `absmax / qmax`, the scale and quotient computed in F32.
pub fn round_activations(x: &[f64], group: usize, qmax: f32) -> Vec<f64> {
    x.chunks(group)
        .flat_map(|g| {
            let amax = g.iter().fold(0f32, |m, &v| m.max((v as f32).abs()));
            let s = amax / qmax;
            g.iter().map(move |&v| {
                if amax == 0.0 {
                    0.0
                } else {
                    ((v as f32 / s).round() * s) as f64
                }
            })
        })
        .collect()
}

/// [`reference_f64`] with each expert's inputs (`x`, then SiLU·up) first rounded by
/// [`round_activations`] when `acts` gives `(group, qmax)`: the exact result of a kernel that
/// quantizes activations, up to its F32 accumulation.
pub fn reference_f64_rounding_acts(
    experts: &[DenseExpert],
    xs: &[f32],
    ids: &[u32],
    w: &[f32],
    k: usize,
    acts: Option<(usize, f32)>,
) -> Vec<f64> {
    let (inter, hidden) = experts[0].gate.dims2().unwrap();
    let tokens = xs.len() / hidden;
    let round = |v: Vec<f64>| match acts {
        Some((group, qmax)) => round_activations(&v, group, qmax),
        None => v,
    };
    let dense: Vec<_> = experts
        .iter()
        .map(|e| (to_f64(&e.gate), to_f64(&e.up), to_f64(&e.down)))
        .collect();
    let mut out = vec![0f64; tokens * hidden];
    for t in 0..tokens {
        let x = round(
            xs[t * hidden..(t + 1) * hidden]
                .iter()
                .map(|&v| v as f64)
                .collect(),
        );
        for j in 0..k {
            let (g, u, d) = &dense[ids[t * k + j] as usize];
            let h: Vec<f64> = (0..inter)
                .map(|i| {
                    let dot = |m: &[f64]| -> f64 {
                        m[i * hidden..(i + 1) * hidden]
                            .iter()
                            .zip(&x)
                            .map(|(a, b)| a * b)
                            .sum()
                    };
                    let gv = dot(g);
                    gv / (1.0 + (-gv).exp()) * dot(u)
                })
                .collect();
            let h = round(h);
            for n in 0..hidden {
                let y: f64 = d[n * inter..(n + 1) * inter]
                    .iter()
                    .zip(&h)
                    .map(|(a, b)| a * b)
                    .sum();
                out[t * hidden + n] += w[t * k + j] as f64 * y;
            }
        }
    }
    out
}

/// Largest `|a − b|` in f64; infinite when a value is not finite (so a NaN can never pass a
/// `<` bound, as it would through `f64::max`). Panics on slices of different lengths.
pub fn max_abs_diff<A: Copy + Into<f64>, B: Copy + Into<f64>>(a: &[A], b: &[B]) -> f64 {
    assert_eq!(
        a.len(),
        b.len(),
        "max_abs_diff of slices of different lengths"
    );
    a.iter().zip(b).fold(0.0, |m, (&x, &y)| {
        let d = (x.into() - y.into()).abs();
        if d.is_finite() {
            m.max(d)
        } else {
            f64::INFINITY
        }
    })
}

/// [`max_abs_diff`] of two tensors of one shape (any float dtype, any device).
pub fn max_abs_diff_tensors(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(
        a.dims(),
        b.dims(),
        "max_abs_diff of tensors of different shapes"
    );
    max_abs_diff(&to_f64(a), &to_f64(b))
}

/// Whether `a` and `b` hold the same F32 values bit for bit (and as many of them).
pub fn bit_identical(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// `‖a − b‖ / ‖b‖`, accumulated in f64; for `b = 0`, 0 when `a = 0` too and infinite
/// otherwise; NaN when a value is NaN.
pub fn rel_err<A: Copy + Into<f64>, B: Copy + Into<f64>>(a: &[A], b: &[B]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_err of slices of different lengths");
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x.into() - y.into()).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| y.into().powi(2)).sum();
    if den == 0.0 && num == 0.0 {
        return 0.0;
    }
    (num / den).sqrt()
}

/// The checked-in fixtures (`tests/fixtures/{name}`, docs/architecture.md §7), one per supported
/// family, in the order of `candle_qmoe::models::SUPPORTED_MODEL_TYPES`.
pub const FIXTURES: [&str; 5] = [
    "olmoe-tiny",
    "qwen2moe-tiny",
    "qwen3moe-tiny",
    "mixtral-tiny",
    "granitemoe-tiny",
];

/// The folder of a checked-in test fixture (`tests/fixtures/{name}`).
pub fn fixture_dir(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join(name)
}

/// The tensors of a fixture's `golden.safetensors` (docs/architecture.md §7 format), on the CPU.
pub fn load_golden(name: &str) -> std::collections::HashMap<String, Tensor> {
    candle::safetensors::load(fixture_dir(name).join("golden.safetensors"), &Device::Cpu).unwrap()
}

/// Number of prompts (`promptN.input_ids`) in a golden file.
pub fn golden_prompt_count(golden: &std::collections::HashMap<String, Tensor>) -> usize {
    (0..)
        .take_while(|i| golden.contains_key(&format!("prompt{i}.input_ids")))
        .count()
}

/// The trials `make(isa)` builds for each CPU instruction-set path (`CpuIsa::ALL`: the
/// portable one, forced, and every SIMD one), named `{prefix}_{path}::…` after
/// `CpuIsa::name`; a path this CPU lacks is reported as **ignored** (never as passed), with a
/// `SKIPPED` line on stderr saying why.
pub fn isa_trials(
    prefix: &str,
    make: impl Fn(&str, candle_qmoe::kernels::cpu::CpuIsa) -> Vec<libtest_mimic::Trial>,
) -> Vec<libtest_mimic::Trial> {
    let mut all = Vec::new();
    for isa in candle_qmoe::kernels::cpu::CpuIsa::ALL {
        let name = format!("{prefix}_{}", isa.name());
        let available = isa.is_available();
        if !available {
            eprintln!(
                "SKIPPED: this CPU lacks {isa:?}; the {name}::* tests are reported as ignored"
            );
        }
        all.extend(
            make(&name, isa)
                .into_iter()
                .map(|t| t.with_ignored_flag(!available)),
        );
    }
    all
}

/// The wall time of `iters` calls of `call`, made from a thread of rayon's pool with the other
/// workers kept awake ([`candle_qmoe::pool::with_workers_awake`]), as a model's forward pass
/// makes its kernel calls; for criterion's `iter_custom`. Called from the bench's main thread
/// instead, every parallel call would wait for a worker to wake up and then wake the caller: a
/// 512 × 2048 BF16 projection at M = 1 on one thread of a Granite Rapids-class Xeon took
/// 156 µs that way against 68 µs from the pool.
pub fn time_on_pool<R>(iters: u64, mut call: impl FnMut() -> R + Send) -> std::time::Duration {
    candle_qmoe::pool::with_workers_awake(|| {
        let start = std::time::Instant::now();
        for _ in 0..iters {
            std::hint::black_box(call());
        }
        start.elapsed()
    })
}
