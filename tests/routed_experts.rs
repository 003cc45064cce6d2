//! The INT4 CPU kernel and the dense oracle against an f64 reference on random inputs.
//!
//! The INT4 kernel is checked on every instruction-set path of the CPU kernel: the portable one
//! (forced) and each SIMD path this CPU has. A path the CPU lacks is reported as **ignored**
//! (counted in the summary line, never as passed) with a `SKIPPED` banner saying why.

use candle::quantized::GgmlDType;
use candle::{Device, Tensor};
use candle_qmoe::kernels::cpu::{CpuIsa, DecodeActivations, DECODE_ACT_MAX, W4A8_MIN_TOKENS};
use candle_qmoe::pack::{ExpertLayout, ExpertNames, GroupSize, LayerPack, ScaleSearch};
use candle_qmoe::{DenseExperts, GgmlExperts, Int4Experts, QmoeError, RoutedExperts};
use candle_qmoe_suite::testing::{
    isa_trials, random_experts, random_routing, reference_f64, reference_f64_rounding_acts,
    rel_err, Rng,
};
use libtest_mimic::{Arguments, Failed, Trial};

struct Case {
    hidden: usize,
    inter: usize,
    experts: usize,
    k: usize,
    tokens: usize,
    group: usize,
}

/// Edge shapes: K not a multiple of the group (1408 = 5.5 × 256), K < group, K = group + 1
/// chunk, a single intermediate row; two with enough tokens for the `i8` activations (8 chunks
/// per `i16` sum at g256); and long rows of few tokens at every group size, ending in a short
/// group (K = 1088 = 8.5 × 128 = 17 × 64, K = 600 = 18.75 × 32, K = 2304 = 9 × 256).
const EDGE_CASES: [Case; 12] = [
    Case {
        hidden: 256,
        inter: 176,
        experts: 6,
        k: 2,
        tokens: 5,
        group: 256,
    },
    Case {
        hidden: 64,
        inter: 40,
        experts: 4,
        k: 4,
        tokens: 9,
        group: 128,
    },
    Case {
        hidden: 160,
        inter: 96,
        experts: 5,
        k: 3,
        tokens: 1,
        group: 64,
    },
    Case {
        hidden: 96,
        inter: 33,
        experts: 3,
        k: 1,
        tokens: 7,
        group: 32,
    },
    Case {
        hidden: 32,
        inter: 1,
        experts: 2,
        k: 2,
        tokens: 3,
        group: 32,
    },
    Case {
        hidden: 256,
        inter: 176,
        experts: 6,
        k: 2,
        tokens: 19,
        group: 256,
    },
    Case {
        hidden: 96,
        inter: 33,
        experts: 3,
        k: 1,
        tokens: 17,
        group: 32,
    },
    Case {
        hidden: 1088,
        inter: 72,
        experts: 4,
        k: 2,
        tokens: 1,
        group: 128,
    },
    Case {
        hidden: 1088,
        inter: 40,
        experts: 3,
        k: 2,
        tokens: 1,
        group: 64,
    },
    Case {
        hidden: 64,
        inter: 600,
        experts: 3,
        k: 2,
        tokens: 2,
        group: 32,
    },
    Case {
        hidden: 2304,
        inter: 40,
        experts: 2,
        k: 1,
        tokens: 1,
        group: 256,
    },
    // Prefill on AVX-512's rows-in-lanes kernel: about 20 tokens per expert in three blocks,
    // rows past the last whole slice of 16 (200 = 12 · 16 + 8), a run of 8 groups then a short
    // group whose last 4-chunk block holds one chunk (1040 = 8 · 128 + 16).
    Case {
        hidden: 1040,
        inter: 200,
        experts: 4,
        k: 2,
        tokens: 40,
        group: 128,
    },
];

/// Qwen1.5-MoE's down-projection width (1408) and hidden 512, prefill-sized token count.
const MODEL_LIKE: Case = Case {
    hidden: 512,
    inter: 1408,
    experts: 8,
    k: 4,
    tokens: 24,
    group: 128,
};

/// Which routed-experts implementation a trial checks.
#[derive(Clone, Copy, Debug)]
enum Backend {
    /// The dense oracle in F32 on the dequantized experts.
    Dense,
    /// The INT4 kernel on one instruction-set path, with these decode activations.
    Int4(CpuIsa, DecodeActivations),
}

/// One case's pack, inputs and f64 references.
struct Inputs {
    pack: LayerPack,
    xs: Tensor,
    ids: Tensor,
    w: Tensor,
    /// Exact.
    want: Vec<f64>,
    /// With the activations rounded as the INT4 kernel rounds them for this many tokens.
    want_kernel: Vec<f64>,
}

fn inputs(case: &Case, seed: u64, acts: DecodeActivations) -> Inputs {
    let mut rng = Rng::new(seed);
    let experts = random_experts(&mut rng, case.experts, case.hidden, case.inter);
    let layout = ExpertLayout {
        hidden: case.hidden,
        intermediate: case.inter,
        group_size: GroupSize::new(case.group).unwrap(),
    };
    let pack = LayerPack::quantize(
        "layer",
        ExpertNames::PROJ,
        &experts,
        layout,
        ScaleSearch::Mse,
    )
    .unwrap();
    let deq = pack
        .dequantize_experts(candle::DType::F32, &Device::Cpu)
        .unwrap();
    // Activations of RMSNorm-ed scale (~1) with a few outliers, as hidden states have.
    let mut xs = rng.normals(case.tokens * case.hidden, 1.0);
    for v in xs.iter_mut().step_by(61) {
        *v *= 8.0;
    }
    let (ids, w) = random_routing(&mut rng, case.tokens, case.k, case.experts);
    let want = reference_f64(&deq, &xs, &ids, &w, case.k);
    let qmax = if acts.int8_at(case.tokens) {
        127.0
    } else {
        DECODE_ACT_MAX as f32
    };
    let want_kernel =
        reference_f64_rounding_acts(&deq, &xs, &ids, &w, case.k, Some((case.group, qmax)));
    let dev = Device::Cpu;
    Inputs {
        pack,
        xs: Tensor::from_vec(xs, (case.tokens, case.hidden), &dev).unwrap(),
        ids: Tensor::from_vec(ids, (case.tokens, case.k), &dev).unwrap(),
        w: Tensor::from_vec(w, (case.tokens, case.k), &dev).unwrap(),
        want,
        want_kernel,
    }
}

fn run(case: &Case, seed: u64, backend: Backend) {
    let Inputs {
        pack,
        xs,
        ids,
        w,
        want,
        want_kernel,
    } = inputs(case, seed, acts_of(backend));
    let to_vec = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let shape = format!(
        "H{} I{} g{} T{}",
        case.hidden, case.inter, case.group, case.tokens
    );
    match backend {
        Backend::Dense => {
            // F32: only F32 rounding (~1e-7 per op, √K growth) separates it from f64.
            let deq = pack
                .dequantize_experts(candle::DType::F32, &Device::Cpu)
                .unwrap();
            let dense = DenseExperts::new(deq).unwrap();
            let err = rel_err(&to_vec(dense.forward(&xs, &ids, &w).unwrap()), &want);
            assert!(err < 1e-5, "dense f32 {shape}: rel err {err}");
        }
        Backend::Int4(isa, acts) => {
            // Activations are rounded per group (input and SiLU·up) to DECODE_ACT_MAX levels
            // below W4A8_MIN_TOKENS and to i8 from there on, and the reference `want_kernel`
            // repeats that rounding; what remains is F32 accumulation (~1e-6) and the rare
            // SiLU·up value that F32 rounds across a step (one step of one input: ≤ 1/127 of
            // it, diluted over the row). 2e-4 leaves a 10× margin.
            let int4 = Int4Experts::with_isa(pack, isa).with_decode_activations(acts);
            assert_eq!(int4.isa(), isa, "{isa:?} is not available on this CPU");
            let got = to_vec(int4.forward(&xs, &ids, &w).unwrap());
            let err = rel_err(&got, &want_kernel);
            assert!(err < 2e-4, "{isa:?} {shape}: rel err {err}");
            // The rounding itself: at most half a step of absmax/127 per input (i8), with these
            // inputs' 8× outliers a relative error of ~1e-2 per projection; 5e-2 bounds it. At
            // DECODE_ACT_MAX levels the steps are 15× smaller: 5e-3.
            let exact_err = rel_err(&got, &want);
            eprintln!("{isa:?} {shape}: rel err {err:.2e} (vs exact {exact_err:.2e})");
            let exact_bound = if acts.int8_at(case.tokens) {
                5e-2
            } else {
                5e-3
            };
            assert!(
                exact_err < exact_bound,
                "{isa:?} {shape}: rel err vs exact {exact_err}"
            );
            // Bit-identical on 1 and 16 threads (which also split the rows into the longest and
            // the shortest blocks per task): the summation order is fixed.
            for threads in [1, 16] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let other = pool.install(|| to_vec(int4.forward(&xs, &ids, &w).unwrap()));
                assert_eq!(got, other, "{isa:?} {shape}: differs on {threads} threads");
            }
            // Batch-invariant below W4A8_MIN_TOKENS, with either decode activations: a token's
            // output does not depend on which other tokens share the call (a server batching
            // requests returns the bits each would get alone).
            if case.tokens < W4A8_MIN_TOKENS {
                let h = case.hidden;
                for t in 0..case.tokens {
                    let one = |x: &Tensor| x.narrow(0, t, 1).unwrap();
                    let alone = to_vec(int4.forward(&one(&xs), &one(&ids), &one(&w)).unwrap());
                    assert_eq!(
                        alone,
                        got[t * h..(t + 1) * h],
                        "{isa:?} {shape}: token {t} alone differs from its row in the batch"
                    );
                }
            }
            // Both SIMD paths sum the same exact integers per lane and scale them the same way
            // (`i16` and `i8` activations alike): AVX-512 gives the AVX2 bits.
            if isa == CpuIsa::Avx512Vnni && CpuIsa::Avx2.is_available() {
                let avx2 = Int4Experts::with_isa(int4.pack().clone(), CpuIsa::Avx2)
                    .with_decode_activations(acts);
                let avx2 = to_vec(avx2.forward(&xs, &ids, &w).unwrap());
                assert_eq!(got, avx2, "{shape}: AVX-512 and AVX2 differ");
            }
        }
    }
}

/// The trials of one backend: the edge shapes and the model-like width.
fn trials(name: &str, backend: Backend) -> Vec<Trial> {
    vec![
        Trial::test(
            format!("{name}::matches_f64_reference_on_edge_shapes"),
            move || {
                for (i, c) in EDGE_CASES.iter().enumerate() {
                    run(c, 100 + i as u64, backend);
                }
                Ok(())
            },
        ),
        Trial::test(
            format!("{name}::matches_f64_reference_at_model_like_width"),
            move || {
                run(&MODEL_LIKE, 7, backend);
                Ok(())
            },
        ),
    ]
}

/// The decode activations a backend's trial runs with.
fn acts_of(backend: Backend) -> DecodeActivations {
    match backend {
        Backend::Int4(_, acts) => acts,
        Backend::Dense => DecodeActivations::default(),
    }
}

fn main() {
    let args = Arguments::from_args();
    let mut all = trials("dense_oracle", Backend::Dense);
    all.extend(isa_trials("int4", |name, isa| {
        trials(name, Backend::Int4(isa, DecodeActivations::I16))
    }));
    // `i8` activations at decode too (`--decode-acts i8`): the cases below W4A8_MIN_TOKENS
    // take the single-row kernels with 8-bit activations.
    all.extend(isa_trials("int4_decode_i8", |name, isa| {
        trials(name, Backend::Int4(isa, DecodeActivations::I8))
    }));
    all.push(Trial::test("decode_activations_parse", || {
        assert_eq!(
            "i8".parse::<DecodeActivations>().ok(),
            Some(DecodeActivations::I8)
        );
        assert_eq!(
            "I16".parse::<DecodeActivations>().ok(),
            Some(DecodeActivations::I16)
        );
        let err = "i4".parse::<DecodeActivations>().unwrap_err().to_string();
        assert!(err.contains("i4") && err.contains("i16 or i8"), "{err}");
        Ok(())
    }));
    all.push(Trial::test("ggml_experts_copied_compute_the_same", || {
        ggml_experts_copied_compute_the_same();
        Ok(())
    }));
    all.push(Trial::test("bad_routing_is_a_clear_error", || {
        bad_routing_is_a_clear_error();
        Ok::<(), Failed>(())
    }));
    libtest_mimic::run(&args, all).exit();
}

/// `GgmlExperts::copied` (the layer copies `layer_bench` cycles through) computes what the
/// original does, bit for bit, for Q4K and Q4_0; and both are within Q4K's rounding of the
/// dense F32 experts (random weights and activations).
fn ggml_experts_copied_compute_the_same() {
    let mut rng = Rng::new(11);
    let (experts, hidden, inter, tokens, k) = (4, 256, 256, 3, 2);
    let dense = random_experts(&mut rng, experts, hidden, inter);
    let dev = Device::Cpu;
    let xs = Tensor::from_vec(rng.normals(tokens * hidden, 1.0), (tokens, hidden), &dev).unwrap();
    let (ids, w) = random_routing(&mut rng, tokens, k, experts);
    let ids = Tensor::from_vec(ids, (tokens, k), &dev).unwrap();
    let w = Tensor::from_vec(w, (tokens, k), &dev).unwrap();
    let exact = DenseExperts::new(dense.clone()).unwrap();
    let exact = exact.forward(&xs, &ids, &w).unwrap().flatten_all().unwrap();
    let exact: Vec<f64> = exact
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect();
    for dtype in [GgmlDType::Q4K, GgmlDType::Q4_0] {
        let original = GgmlExperts::quantize(&dense, dtype).unwrap();
        let copy = original.copied().unwrap();
        let out = |e: &GgmlExperts| {
            let y = e.forward(&xs, &ids, &w).unwrap().flatten_all().unwrap();
            y.to_vec1::<f32>().unwrap()
        };
        let (a, b) = (out(&original), out(&copy));
        assert_eq!(a, b, "{dtype:?}: the copy computes other bits");
        // Not two equal wrong answers: 4-bit weights in three matrices (and Candle's 8-bit
        // activations) put the output 13–14% off the dense one here; scrambled blocks would
        // put it ~140% off (uncorrelated outputs of equal norm).
        let got: Vec<f64> = a.iter().map(|&v| f64::from(v)).collect();
        let err = rel_err(&got, &exact);
        assert!(err < 0.25, "{dtype:?}: relative error {err}");
    }
}

fn bad_routing_is_a_clear_error() {
    let mut rng = Rng::new(3);
    let experts = random_experts(&mut rng, 4, 64, 32);
    let layout = ExpertLayout {
        hidden: 64,
        intermediate: 32,
        group_size: GroupSize::default(),
    };
    let int4 = Int4Experts::new(
        LayerPack::quantize("l", ExpertNames::PROJ, &experts, layout, ScaleSearch::Rtn).unwrap(),
    );
    let dev = Device::Cpu;
    let xs = Tensor::ones((2, 64), candle::DType::F32, &dev).unwrap();
    let w = Tensor::ones((2, 2), candle::DType::F32, &dev).unwrap();
    let ids = Tensor::new(&[[0u32, 9], [1, 2]], &dev).unwrap();
    let e = int4.forward(&xs, &ids, &w).unwrap_err();
    assert!(
        matches!(
            QmoeError::find(&e),
            Some(QmoeError::ExpertOutOfRange {
                token: 0,
                expert: 9,
                num_experts: 4
            })
        ),
        "{e}"
    );
    let ids = Tensor::new(&[[0u32, 0], [1, 2]], &dev).unwrap();
    let e = int4.forward(&xs, &ids, &w).unwrap_err();
    assert!(
        matches!(
            QmoeError::find(&e),
            Some(QmoeError::DuplicateExpert {
                token: 0,
                expert: 0
            })
        ),
        "{e}"
    );
    let xs = Tensor::ones((2, 65), candle::DType::F32, &dev).unwrap();
    let e = int4.forward(&xs, &ids, &w).unwrap_err();
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::ShapeMismatch { tensor, got, expected })
            if tensor == "xs" && got == &[2, 65] && expected == &[2, 64]),
        "{e}"
    );
    // Mismatched expert shapes name the tensor.
    let mut bad = random_experts(&mut rng, 2, 64, 32);
    bad[1].up = Tensor::ones((31, 64), candle::DType::F32, &dev).unwrap();
    let e = LayerPack::quantize(
        "model.layers.0.mlp",
        ExpertNames::PROJ,
        &bad,
        layout,
        ScaleSearch::Mse,
    )
    .unwrap_err();
    assert!(
        matches!(&e, QmoeError::ShapeMismatch { tensor, got, .. }
            if tensor == "model.layers.0.mlp.experts.1.up_proj.weight" && got == &[31, 64]),
        "{e}"
    );
    assert!(matches!(
        GroupSize::new(48),
        Err(QmoeError::UnsupportedConfig { field, value, .. }) if field == "group size" && value == "48"
    ));
}
