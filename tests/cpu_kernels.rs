//! The CPU kernels around the experts against f64 references on random inputs: the BF16
//! matmul of the non-expert weights (on each instruction-set path), `DenseLinear`, and the
//! fused attention over the in-place KV cache at short and 4096-token contexts, and `RmsNorm` on
//! half-precision activations; and empty inputs through the BF16 and INT8 kernels.

use candle::{DType, Device, Module, Tensor};
use candle_qmoe::kernels::attention::{attend_with_isa, KvCache, KvDtype};
use candle_qmoe::kernels::cpu::CpuIsa;
use candle_qmoe::kernels::dense::{bf16_matmul, int8_matmul, Int8Matrix, INT8_GROUP};
use candle_qmoe::models::layers::RmsNorm;
use candle_qmoe::DenseLinear;
use candle_qmoe_suite::testing::{
    bit_identical, isa_trials, max_abs_diff, max_abs_diff_tensors, round_activations, Rng,
};
use half::{bf16, f16};
use libtest_mimic::{Arguments, Trial};

/// `(m, k, n)`: decode and small-M tiles, K with a tail that is not a multiple of 8, N not a
/// multiple of the row tiles, and a model-like width.
/// `(m, k, n)`: decode, several tokens in whole tiles with a remainder (3 and 6 tokens per tile
/// for the BF16 kernels, 4 for INT8), columns past the last whole vector, and more tokens than
/// one chunk of the kernels' token blocking (about 256 KiB of activations: 30 tokens at K = 2048,
/// 60 at K = 1000 for BF16; 60 at K = 2048 for INT8 on AVX-512).
const MATMUL_SHAPES: [(usize, usize, usize); 12] = [
    (1, 8, 1),
    (1, 2048, 200),
    (1, 1411, 67),
    (2, 64, 9),
    (3, 96, 16),
    (4, 72, 13),
    (5, 1408, 130),
    (13, 1411, 37),
    (17, 256, 70),
    (64, 2048, 33),
    (70, 1000, 20),
    // 1424 % 32 = 16: a whole AVX-512 vector's columns past the last even/odd chunk.
    (7, 1424, 70),
];

/// Random BF16 weights (std 0.02) and F32 activations of RMSNorm-ed scale with outliers.
fn matmul_inputs(rng: &mut Rng, m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<bf16>) {
    let mut x = rng.normals(m * k, 1.0);
    for v in x.iter_mut().step_by(37) {
        *v *= 8.0;
    }
    let w = rng
        .normals(n * k, 0.02)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    (x, w)
}

/// Checks `y` against the f64 product of the same (BF16-exact) weights. The kernel widens each
/// weight exactly, so only F32 accumulation separates it from f64: `|err| ≤ k · 2⁻²⁴ · Σ|x·w|`
/// (the worst-case bound of recursive summation, whatever the order).
fn check_matmul(y: &[f32], x: &[f32], w: &[bf16], m: usize, k: usize, n: usize, what: &str) {
    assert_eq!(y.len(), m * n, "{what}: output length");
    for t in 0..m {
        for r in 0..n {
            let (xs, ws) = (&x[t * k..(t + 1) * k], &w[r * k..(r + 1) * k]);
            let exact: f64 = xs
                .iter()
                .zip(ws)
                .map(|(&a, &b)| a as f64 * b.to_f64())
                .sum();
            let mag: f64 = xs
                .iter()
                .zip(ws)
                .map(|(&a, &b)| (a as f64 * b.to_f64()).abs())
                .sum();
            let bound = k as f64 * 2f64.powi(-24) * mag;
            let err = (y[t * n + r] as f64 - exact).abs();
            assert!(
                err <= bound,
                "{what}: y[{t},{r}] off by {err:e} > {bound:e}"
            );
        }
    }
}

/// Each activation row computed alone equals its row of the whole call, bit for bit: a token's
/// output does not depend on the others batched with it (continuous batching relies on it).
fn check_rows_alone(
    y: &[f32],
    m: usize,
    k: usize,
    n: usize,
    x: &[f32],
    what: &str,
    f: impl Fn(&[f32]) -> Vec<f32>,
) {
    if m == 1 {
        return;
    }
    for t in 0..m {
        let alone = f(&x[t * k..(t + 1) * k]);
        assert_eq!(
            alone,
            y[t * n..(t + 1) * n],
            "{what}: row {t} alone differs from the batch"
        );
    }
}

fn bf16_matmul_trials(name: &str, isa: CpuIsa) -> Vec<Trial> {
    vec![Trial::test(
        format!("{name}::bf16_matmul_matches_f64_reference"),
        move || {
            let mut rng = Rng::new(11);
            for (m, k, n) in MATMUL_SHAPES {
                let (x, w) = matmul_inputs(&mut rng, m, k, n);
                let y = bf16_matmul(isa, &x, m, k, &w, n);
                check_matmul(&y, &x, &w, m, k, n, &format!("{isa:?} m{m} k{k} n{n}"));
                // One dot product per element in a fixed order: thread count does not matter.
                let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
                let single = pool.install(|| bf16_matmul(isa, &x, m, k, &w, n));
                assert_eq!(
                    y, single,
                    "{isa:?} m{m} k{k} n{n}: differs between thread counts"
                );
                check_rows_alone(&y, m, k, n, &x, &format!("{isa:?} m{m} k{k} n{n}"), |xr| {
                    bf16_matmul(isa, xr, 1, k, &w, n)
                });
            }
            Ok(())
        },
    )]
}

/// The INT8 kernel against f64 arithmetic on its own roundings. Weights: each within half a
/// step of its group's FP16 scale `stored(max_g|w| / 127)`, computed here from the BF16 values.
/// Activations: rounded per group of 32 to multiples of `max_g|x| / 127` in F32
/// (`testing::round_activations`, as the kernel does); with those, the integer dot products
/// per group are exact, and only the F32 scaling and the sum over groups round:
/// `|err| ≤ 2 · k · 2⁻²⁴ · Σ|x̂·ŵ|` (generous: k / 32 + 3 roundings of partial sums).
/// A truncating or mis-scaled rounding of either side moves outputs by ~`Σ|ŵ| · max|x| / 254`,
/// orders of magnitude above that.
fn int8_trials(name: &str, isa: CpuIsa) -> Vec<Trial> {
    vec![Trial::test(
        format!("{name}::int8_matmul_equals_f64_on_its_roundings"),
        move || {
            let mut rng = Rng::new(13);
            for (m, k, n) in MATMUL_SHAPES {
                let (x, w) = matmul_inputs(&mut rng, m, k, n);
                let q = Int8Matrix::quantize_bf16(&w, n, k);
                assert_eq!(q.bytes(), n * k.next_multiple_of(32) * (32 + 2) / 32);
                let wd = q.dequantize();
                for (r, (wr, dr)) in w.chunks(k).zip(wd.chunks(k)).enumerate() {
                    for (g, (wg, dg)) in
                        wr.chunks(INT8_GROUP).zip(dr.chunks(INT8_GROUP)).enumerate()
                    {
                        let amax = wg.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
                        let scale = f16::from_f32(amax / 127.0).to_f32() as f64;
                        for (a, b) in dg.iter().zip(wg) {
                            let err = (*a as f64 - b.to_f64()).abs();
                            assert!(
                                err <= 0.5 * scale * (1.0 + 1e-6),
                                "row {r} group {g}: {a} for {b}, scale {scale:e}"
                            );
                        }
                    }
                }
                let y = int8_matmul(isa, &x, m, &q);
                // AVX-512 VNNI sums the same integers per lane as AVX2: the same bits.
                if isa == CpuIsa::Avx512Vnni && CpuIsa::Avx2.is_available() {
                    let avx2 = int8_matmul(CpuIsa::Avx2, &x, m, &q);
                    assert_eq!(y, avx2, "m{m} k{k} n{n}: AVX-512 VNNI and AVX2 differ");
                }
                check_rows_alone(&y, m, k, n, &x, &format!("{isa:?} m{m} k{k} n{n}"), |xr| {
                    int8_matmul(isa, xr, 1, &q)
                });
                let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                for t in 0..m {
                    let xr = round_activations(&x64[t * k..(t + 1) * k], INT8_GROUP, 127.0);
                    for r in 0..n {
                        let wr = &wd[r * k..(r + 1) * k];
                        let exact: f64 = xr.iter().zip(wr).map(|(&a, &b)| a * b as f64).sum();
                        let mag: f64 = xr.iter().zip(wr).map(|(&a, &b)| (a * b as f64).abs()).sum();
                        let bound = 2.0 * k as f64 * 2f64.powi(-24) * mag;
                        let err = (y[t * n + r] as f64 - exact).abs();
                        assert!(
                            err <= bound,
                            "{isa:?} m{m} k{k} n{n}: y[{t},{r}] off by {err:e} > {bound:e}"
                        );
                    }
                }
            }
            Ok(())
        },
    )]
}

/// `DenseLinear` on BF16 weights (with a bias, leading batch dims) equals the kernel plus the
/// bias, and is within BF16-free F32 rounding of Candle's F32 `Linear` on the same values.
fn dense_linear_matches_candle_f32() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(5);
    let (m, k, n) = (6, 320, 48);
    let (x, w) = matmul_inputs(&mut rng, m, k, n);
    let bias = rng.normals(n, 0.1);
    let xt = Tensor::from_vec(x.clone(), (2, 3, k), &dev).unwrap();
    let wt = Tensor::from_vec(w.clone(), (n, k), &dev).unwrap();
    let bt = Tensor::from_vec(bias.clone(), n, &dev).unwrap();
    let lin = DenseLinear::new(wt.clone(), Some(bt.to_dtype(DType::BF16).unwrap())).unwrap();
    let got = lin.forward(&xt).unwrap();
    assert_eq!(got.dims(), [2, 3, n]);
    assert_eq!(got.dtype(), DType::F32);
    let f32_lin = candle_nn::Linear::new(
        wt.to_dtype(DType::F32).unwrap(),
        Some(
            bt.to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        ),
    );
    let want = f32_lin.forward(&xt).unwrap();
    let diff = max_abs_diff_tensors(&got, &want);
    // Both are F32 sums of the same exact products: k · 2⁻²⁴ · Σ|x·w| ≤ 320 · 6e-8 · ~20.
    assert!(diff < 5e-4, "DenseLinear vs Candle F32: max diff {diff}");
    // The portable path is selectable and gives the same values within the same bound.
    let portable = lin
        .clone()
        .with_isa(CpuIsa::Scalar)
        .unwrap()
        .forward(&xt)
        .unwrap();
    let y = portable.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let unbiased: Vec<f32> = y
        .iter()
        .enumerate()
        .map(|(i, v)| v - bf16::from_f32(bias[i % n]).to_f32())
        .collect();
    check_matmul(&unbiased, &x, &w, m, k, n, "portable DenseLinear");
}

/// `RmsNorm` on half-precision activations (F16 on the CPU: the path BF16 takes on a GPU)
/// against transformers' arithmetic in f64: normalise, round to the dtype, multiply by the
/// weight, round. The product of two F16 values is exact in F32, so the only source of a
/// difference is the F32 normalisation (a few ulps of 2⁻²⁴) landing across an F16 rounding
/// boundary (spacing 2⁻¹¹): expected in ~1e-4 of the elements, and then by one ulp.
fn rms_norm_half_matches_f64() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(11);
    let (rows, size, eps) = (5, 2048, 1e-6);
    let w: Vec<f16> = rng
        .normals(size, 0.5)
        .into_iter()
        .map(|v| f16::from_f32(1.0 + v))
        .collect();
    let x: Vec<f16> = rng
        .normals(rows * size, 1.0)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let vb = candle_nn::VarBuilder::from_tensors(
        [(
            "weight".to_string(),
            Tensor::from_vec(w.clone(), size, &dev).unwrap(),
        )]
        .into(),
        DType::F16,
        &dev,
    );
    let norm = RmsNorm::new(size, eps, vb).unwrap();
    let xt = Tensor::from_vec(x.clone(), (rows, size), &dev).unwrap();
    let got = norm.forward(&xt).unwrap();
    assert_eq!(got.dtype(), DType::F16);
    let got = got.flatten_all().unwrap().to_vec1::<f16>().unwrap();
    let mut off_by_one = 0;
    for r in 0..rows {
        let row = &x[r * size..(r + 1) * size];
        let ms = row
            .iter()
            .map(|v| f64::from(v.to_f32()).powi(2))
            .sum::<f64>()
            / size as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        for (c, v) in row.iter().enumerate() {
            let normed = f16::from_f64(f64::from(v.to_f32()) * inv);
            let want = f16::from_f64(f64::from(normed.to_f32()) * f64::from(w[c].to_f32()));
            let got = got[r * size + c];
            if got != want {
                let ulps =
                    (i32::from(got.to_bits() as i16) - i32::from(want.to_bits() as i16)).abs();
                assert!(ulps <= 1, "row {r} col {c}: {got} vs {want}");
                off_by_one += 1;
            }
        }
    }
    assert!(
        off_by_one * 1000 <= rows * size,
        "{off_by_one} elements off by one ulp"
    );
}

/// f64 causal attention of the last `s` of `len` positions: `q [s, heads, d]`,
/// `k`, `v [len, kv_heads, d]` token-major.
#[allow(clippy::too_many_arguments)]
fn attention_f64(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: usize,
    len: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; s * heads * d];
    for t in 0..s {
        let visible = len - s + t + 1;
        for h in 0..heads {
            let g = h / (heads / kv_heads);
            let qv = &q[(t * heads + h) * d..][..d];
            let scores: Vec<f64> = (0..visible)
                .map(|j| {
                    let kv = &k[(j * kv_heads + g) * d..][..d];
                    qv.iter()
                        .zip(kv)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let p: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = p.iter().sum();
            let o = &mut out[(t * heads + h) * d..][..d];
            for (j, pj) in p.iter().enumerate() {
                let vv = &v[(j * kv_heads + g) * d..][..d];
                for (oi, &x) in o.iter_mut().zip(vv) {
                    *oi += pj / sum * x as f64;
                }
            }
        }
    }
    out
}

/// Fills a cache stored as `dtype` chunk by chunk (a prefill, then decode steps, crossing the
/// growth boundaries) and checks the attention of the chunks after the first `silent` ones
/// (which are only appended, as a long prompt before the measured steps) against the f64
/// reference over the stored keys and values (rounded to BF16 for a BF16 cache: the rounding
/// is the cache's storage, not the kernel's arithmetic).
fn attention_case(
    isa: CpuIsa,
    dtype: KvDtype,
    chunks: &[usize],
    silent: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
) {
    let mut rng = Rng::new((chunks.len() * 1000 + heads * 10 + d) as u64);
    let total: usize = chunks.iter().sum();
    // Keys of unit-ish scale: scores of a few units, as after q/k norms.
    let k_all = rng.normals(total * kv_heads * d, 1.0);
    let v_all = rng.normals(total * kv_heads * d, 1.0);
    let stored = |x: &[f32]| -> Vec<f32> {
        match dtype {
            KvDtype::F32 => x.to_vec(),
            KvDtype::Bf16 => x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
        }
    };
    let (k_ref, v_ref) = (stored(&k_all), stored(&v_all));
    let mut cache = KvCache::new(1, kv_heads, d, dtype);
    let mut len = 0;
    for (i, &s) in chunks.iter().enumerate() {
        let (a, b) = (len * kv_heads * d, (len + s) * kv_heads * d);
        cache.append(&k_all[a..b], &v_all[a..b], s);
        len += s;
        if i < silent {
            continue;
        }
        let q = rng.normals(s * heads * d, 1.0);
        let got = attend_with_isa(&q, &cache, s, heads, 1.0 / (d as f32).sqrt(), isa);
        let want = attention_f64(&q, &k_ref[..b], &v_ref[..b], s, len, heads, kv_heads, d);
        // Scores carry F32 dot-product rounding (~d · 2⁻²⁴ · Σ|q·k| ≈ 1e-5 absolute), which
        // moves each softmax weight by that relative amount (the SIMD path's exp adds ~2 ulp);
        // outputs are convex combinations of values of size ~1, so 1e-4 absolute is a safe
        // bound.
        let err = max_abs_diff(&got, &want);
        assert!(
            err < 1e-4,
            "{isa:?} {dtype:?} d {d} s {s} at length {len}: max error {err:e}"
        );
    }
    assert_eq!(cache.len(), total);
    assert!(cache.capacity() >= total && cache.capacity() < total + total / 2 + 512);
    let per_position = 2 * kv_heads * d * dtype.size_in_bytes();
    assert_eq!(cache.bytes_per_position(), per_position);
    assert_eq!(cache.allocated_bytes(), cache.capacity() * per_position);
}

/// q/k/v stacked into one INT8 projection give the three INT8 projections' outputs bit for bit
/// (each output row is the same dot product in the same order), biases included, at decode and
/// over several tokens, on every instruction set; a projection with a bias is the INT8 kernel
/// plus the bias.
fn stacked_int8_trials(name: &str, isa: CpuIsa) -> Vec<Trial> {
    vec![Trial::test(
        format!("{name}::stacked_int8_projections_equal_the_parts"),
        move || {
            let dev = Device::Cpu;
            let mut rng = Rng::new(17);
            let k = 320;
            let sizes = [64usize, 32, 37];
            let weights: Vec<(Tensor, Option<Tensor>)> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let w = Tensor::from_vec(rng.normals(n * k, 0.02), (n, k), &dev)?
                        .to_dtype(DType::BF16)?;
                    // The second part without a bias: zeros take its place.
                    let bias = (i != 1)
                        .then(|| Tensor::from_vec(rng.normals(n, 0.1), n, &dev))
                        .transpose()?;
                    Ok((w, bias))
                })
                .collect::<candle::Result<_>>()?;
            let parts: Vec<DenseLinear> = weights
                .iter()
                .map(|(w, bias)| {
                    DenseLinear::new(w.clone(), bias.clone())?
                        .to_int8()?
                        .with_isa(isa)
                })
                .collect::<candle::Result<_>>()?;
            let stacked =
                DenseLinear::stack_int8(&[&parts[0], &parts[1], &parts[2]])?.with_isa(isa)?;
            assert_eq!(stacked.dims(), (sizes.iter().sum(), k));
            // The stacked bias holds F32 zeros for the part without one.
            let bytes: usize = parts.iter().map(DenseLinear::weight_bytes).sum();
            assert_eq!(stacked.weight_bytes(), bytes + 4 * sizes[1]);
            for m in [1usize, 5] {
                let x = Tensor::from_vec(rng.normals(m * k, 1.0), (m, k), &dev)?;
                let got = stacked.forward(&x)?;
                let want = Tensor::cat(
                    &parts
                        .iter()
                        .map(|p| p.forward(&x))
                        .collect::<candle::Result<Vec<_>>>()?,
                    1,
                )?;
                assert_eq!(
                    got.flatten_all()?.to_vec1::<f32>()?,
                    want.flatten_all()?.to_vec1::<f32>()?,
                    "{isa:?} m{m}: stacked and separate INT8 projections differ"
                );
                // A part with a bias is the INT8 kernel (checked against f64 above) plus the
                // bias, one F32 addition per output: the same bits.
                let (w, bias) = (&weights[0].0, weights[0].1.as_ref().unwrap());
                let q =
                    Int8Matrix::quantize_bf16(&w.flatten_all()?.to_vec1::<bf16>()?, sizes[0], k);
                let y = int8_matmul(isa, &x.flatten_all()?.to_vec1::<f32>()?, m, &q);
                let b = bias.to_vec1::<f32>()?;
                let want: Vec<f32> = y
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v + b[i % sizes[0]])
                    .collect();
                let got = parts[0].forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
                assert!(
                    bit_identical(&got, &want),
                    "{isa:?} m{m}: INT8 DenseLinear with a bias is not kernel + bias (max diff \
                     {:e})",
                    max_abs_diff(&got, &want)
                );
            }
            Ok(())
        },
    )]
}

/// The fused attention on `isa` against the f64 reference, at short context (with GQA, head
/// dims that take every slice width of the SIMD value pass, and one that is not a multiple of
/// 16, which runs the portable path) and at 4096 positions.
fn attention_trials(name: &str, isa: CpuIsa) -> Vec<Trial> {
    vec![
        Trial::test(
            format!("{name}::matches_f64_at_short_context_with_gqa"),
            move || {
                for dtype in [KvDtype::F32, KvDtype::Bf16] {
                    // A prefill, decode steps, a second prefill chunk; 8 heads over 2 kv heads
                    // (4 tokens per task: the 7-token chunk spans two tasks).
                    attention_case(isa, dtype, &[7, 1, 1, 1, 3, 1], 0, 8, 2, 64);
                    attention_case(isa, dtype, &[1, 1, 1], 0, 4, 4, 128);
                    // A 300-token prefill crosses the first growth step (256 positions).
                    attention_case(isa, dtype, &[300, 1], 0, 2, 1, 32);
                    // 3, 5 and 6 chunks of 16 dims (1.5, 2.5, 3 of 32); 40 is not a multiple of 16.
                    for d in [48, 80, 96, 40] {
                        attention_case(isa, dtype, &[21, 1, 2], 0, 6, 3, d);
                    }
                }
                Ok(())
            },
        ),
        Trial::test(
            format!("{name}::non_finite_scores_give_non_finite_outputs"),
            move || {
                // A NaN or infinite query element (a broken q_proj or q_norm weight) makes every
                // score of its head non-finite: the head's output must say so, not turn into an
                // average of the values (an exp clamp or a max that drops NaN would).
                for dtype in [KvDtype::F32, KvDtype::Bf16] {
                    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                        for (d, len) in [(64, 37), (40, 5)] {
                            let (heads, mut rng) = (2, Rng::new(5));
                            let mut cache = KvCache::new(1, 1, d, dtype);
                            let kv = rng.normals(len * d, 1.0);
                            cache.append(&kv, &rng.normals(len * d, 1.0), len);
                            let mut q = rng.normals(heads * d, 1.0);
                            q[3] = bad;
                            let out = attend_with_isa(&q, &cache, 1, heads, 0.125, isa);
                            let what = format!("{isa:?} {dtype:?} d {d}, query element {bad}");
                            assert!(
                                out[..d].iter().all(|v| !v.is_finite()),
                                "{what}: {:?}",
                                &out[..4]
                            );
                            assert!(out[d..].iter().all(|v| v.is_finite()), "{what}: other head");
                        }
                    }
                }
                Ok(())
            },
        ),
        Trial::test(format!("{name}::matches_f64_at_4096_context"), move || {
            // 4000 positions cached, then decode steps to 4096 across a growth step.
            let mut chunks = vec![4000];
            chunks.extend(std::iter::repeat_n(1, 6));
            chunks.push(90);
            for dtype in [KvDtype::F32, KvDtype::Bf16] {
                attention_case(isa, dtype, &chunks, 1, 8, 2, 64);
            }
            Ok(())
        }),
    ]
}

/// No rows in, no rows out: a `[0, K]` or `[B, 0, K]` input (an empty batch or chunk) gives an
/// empty `[.., N]` output from the BF16 and INT8 kernels and from `DenseLinear` on both, rather
/// than a panic; and `K = 0` gives zeros from both kernels.
fn empty_input_trials(name: &str, isa: CpuIsa) -> Vec<Trial> {
    vec![Trial::test(
        format!("{name}::empty_inputs_give_empty_outputs"),
        move || {
            let dev = Device::Cpu;
            let (k, n) = (96, 40);
            let (_, w) = matmul_inputs(&mut Rng::new(17), 1, k, n);
            assert!(bf16_matmul(isa, &[], 0, k, &w, n).is_empty());
            // No columns: every dot product is empty, so zero.
            assert_eq!(bf16_matmul(isa, &[], 3, 0, &[], n), vec![0.0; 3 * n]);
            let int8 = Int8Matrix::quantize_bf16(&w, n, k);
            assert!(int8_matmul(isa, &[], 0, &int8).is_empty());
            let no_cols = Int8Matrix::quantize_bf16(&[], n, 0);
            assert_eq!(int8_matmul(isa, &[], 3, &no_cols), vec![0.0; 3 * n]);
            let bf16_lin = DenseLinear::new(Tensor::from_vec(w, (n, k), &dev)?, None)?;
            let int8_lin = bf16_lin.to_int8()?.with_isa(isa)?;
            let bf16_lin = bf16_lin.with_isa(isa)?;
            for (lin, what) in [(bf16_lin, "bf16"), (int8_lin, "int8")] {
                for dims in [vec![0, k], vec![2, 0, k]] {
                    let x = Tensor::zeros(dims.as_slice(), DType::F32, &dev)?;
                    let y = lin.forward(&x)?;
                    let want = [&dims[..dims.len() - 1], &[n]].concat();
                    assert_eq!(y.dims(), want, "{what} DenseLinear on {dims:?}");
                }
            }
            Ok(())
        },
    )]
}

fn main() {
    let args = Arguments::from_args();
    let mut all = isa_trials("dense", bf16_matmul_trials);
    all.extend(isa_trials("dense_int8", int8_trials));
    all.extend(isa_trials("dense_int8", stacked_int8_trials));
    all.extend(isa_trials("dense_empty", empty_input_trials));
    all.push(Trial::test("dense_linear_matches_candle_f32", || {
        dense_linear_matches_candle_f32();
        Ok(())
    }));
    all.push(Trial::test("rms_norm_half_matches_f64", || {
        rms_norm_half_matches_f64();
        Ok(())
    }));
    all.extend(isa_trials("attention", attention_trials));
    libtest_mimic::run(&args, all).exit();
}
