//! `MoeForCausalLm::forward_sequences` (docs/architecture.md §3, the multi-sequence forward):
//! several sequences decoded and prefilled in one step give each sequence its solo tokens and
//! logits, the expert traffic counters, and the errors that leave every cache unchanged.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_qmoe::generation::argmax;
use candle_qmoe::models::{
    self, AnyConfig, ExpertDims, ExpertsBackend, ExpertsLoader, MoeForCausalLm,
};
use candle_qmoe::moe::distinct_experts;
use candle_qmoe::pack::GroupSize;
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use candle_qmoe::{
    ExpertTraffic, QmoeError, RoutedExperts, ScaleSearch, SequenceCache, SequenceInput,
};
use candle_qmoe_suite::testing::{fixture_dir, max_abs_diff_tensors as max_abs_diff, FIXTURES};

/// Batched and solo logits differ only by the order of F32 sums: the projections' and experts'
/// matmuls block over more rows (an N-token step instead of 1), each term of every dot product
/// being the same. Over the fixtures' two layers of 256-wide sums of O(1) terms that is a few ulp
/// of the O(1)–O(10) logits, ~1e-6; the bound leaves 100× (the bound of the batch and chunked
/// prefill check of tests/model_parity.rs).
const F32_TOL: f64 = 1e-4;

/// F16 activations (the Candle tensor path that GPUs run, here on the CPU) round every
/// intermediate to 11 bits: reassociated sums move a logit by a few F16 ulp of its magnitude.
const F16_TOL: f64 = 0.05;

/// Prompt lengths of the four sequences; longer than the prefill chunk, so that prefill chunks
/// and decode tokens share steps.
const PROMPTS: [usize; 4] = [5, 9, 3, 14];
/// Prompt tokens per prefill chunk: with 3 decoding sequences a step stays below the W4A8
/// threshold of the INT4 kernel (16 tokens), whose activations rounding differs from decode's.
const CHUNK: usize = 4;
/// Greedy tokens per sequence.
const NEW: usize = 6;

fn prompt(i: usize, vocab: usize) -> Vec<u32> {
    (0..PROMPTS[i])
        .map(|j| ((17 + 31 * i + 7 * j * j) % vocab) as u32)
        .collect()
}

fn fixture(name: &str, dtype: DType, experts: &dyn ExpertsLoader) -> MoeForCausalLm {
    fixture_with(name, dtype, |_| {}, experts)
}

fn fixture_with(
    name: &str,
    dtype: DType,
    edit: impl FnOnce(&mut serde_json::Value),
    experts: &dyn ExpertsLoader,
) -> MoeForCausalLm {
    let dir = fixture_dir(name);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut json);
    let cfg = AnyConfig::from_json_str(&json.to_string()).unwrap();
    let vb = unsafe { models::mmap_checkpoint(&dir, dtype, &Device::Cpu) }.unwrap();
    MoeForCausalLm::new(&cfg, vb, experts).unwrap()
}

fn tiny_int4() -> MoeForCausalLm {
    let s = SyntheticModel::new(SyntheticKind::Tiny, 5, GroupSize::default()).unwrap();
    s.load(DType::F32, &Device::Cpu, &s.int4_experts()).unwrap()
}

/// Greedy tokens and the logits each was chosen from, with the single-sequence API.
fn solo(model: &mut MoeForCausalLm, prompt: &[u32]) -> (Vec<u32>, Vec<Tensor>) {
    model.clear_kv_cache();
    let (mut tokens, mut logits) = (Vec::new(), Vec::new());
    let mut input = prompt.to_vec();
    while tokens.len() < NEW {
        let ids = Tensor::new(input.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let l = model
            .forward(&ids, model.cached_len())
            .unwrap()
            .squeeze(0)
            .unwrap();
        let t = argmax(&l, &[]).unwrap();
        tokens.push(t);
        logits.push(l);
        input = vec![t];
    }
    (tokens, logits)
}

/// A sequence served by the batched schedule.
struct Served {
    prompt: Vec<u32>,
    fed: usize,
    cache: SequenceCache,
    tokens: Vec<u32>,
    logits: Vec<Tensor>,
}

/// Serves every prompt as a continuous-batching server would: each step decodes one token of
/// every sequence past its prompt and prefills the next chunk of the first sequence still in
/// its prompt. The tokens fed back are `forced[i]` (the solo run's, so that a near tie decided
/// otherwise cannot send the runs apart). Returns each sequence's greedy tokens and logits, and
/// the steps' sizes.
fn batched(
    model: &mut MoeForCausalLm,
    prompts: &[Vec<u32>],
    forced: &[Vec<u32>],
) -> (Vec<Served>, Vec<usize>) {
    let mut seqs: Vec<Served> = prompts
        .iter()
        .map(|p| Served {
            prompt: p.clone(),
            fed: 0,
            cache: model.new_sequence(),
            tokens: Vec::new(),
            logits: Vec::new(),
        })
        .collect();
    let mut sizes = Vec::new();
    while seqs.iter().any(|s| s.tokens.len() < NEW) {
        let prefilling = seqs.iter().position(|s| s.fed < s.prompt.len());
        let mut inputs: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if Some(i) == prefilling {
                let end = (s.fed + CHUNK).min(s.prompt.len());
                inputs.push((i, s.prompt[s.fed..end].to_vec()));
            } else if s.fed == s.prompt.len() && s.tokens.len() < NEW {
                inputs.push((i, vec![forced[i][s.tokens.len() - 1]]));
            }
        }
        sizes.push(inputs.iter().map(|(_, t)| t.len()).sum());
        let mut caches: Vec<(usize, &mut Served)> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| inputs.iter().any(|(j, _)| j == i))
            .collect();
        let mut batch: Vec<SequenceInput> = caches
            .iter_mut()
            .zip(&inputs)
            .map(|((_, s), (_, tokens))| SequenceInput {
                cache: &mut s.cache,
                tokens,
            })
            .collect();
        let logits = model.forward_sequences(&mut batch).unwrap();
        assert_eq!(logits.len(), inputs.len());
        for ((i, tokens), l) in inputs.iter().zip(logits) {
            let s = &mut seqs[*i];
            assert_eq!(l.dims(), &[model.spec().vocab_size]);
            let decoding = s.fed == s.prompt.len();
            if !decoding {
                s.fed += tokens.len();
            }
            if s.fed == s.prompt.len() {
                s.tokens.push(argmax(&l, &[]).unwrap());
                s.logits.push(l);
            }
            assert_eq!(s.cache.len(), s.fed + s.tokens.len().saturating_sub(1));
        }
    }
    (seqs, sizes)
}

/// Every sequence's batched logits are its solo logits within `tol` and, when `same_tokens`,
/// its batched greedy tokens are its solo ones; returns the largest logit difference.
fn batched_matches_solo(
    model: &mut MoeForCausalLm,
    tol: f64,
    same_tokens: bool,
    what: &str,
) -> f64 {
    let vocab = model.spec().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..PROMPTS.len()).map(|i| prompt(i, vocab)).collect();
    let solos: Vec<(Vec<u32>, Vec<Tensor>)> = prompts.iter().map(|p| solo(model, p)).collect();
    let forced: Vec<Vec<u32>> = solos.iter().map(|(t, _)| t.clone()).collect();
    let (seqs, sizes) = batched(model, &prompts, &forced);
    // The schedule mixed a prefill chunk with decode tokens in one step.
    assert!(sizes.iter().any(|&n| n > CHUNK), "{what}: {sizes:?}");
    let mut worst = 0f64;
    for ((s, p), (tokens, logits)) in seqs.iter().zip(&prompts).zip(&solos) {
        if same_tokens {
            assert_eq!(&s.tokens, tokens, "{what}: prompt {p:?}");
        }
        for (a, b) in s.logits.iter().zip(logits) {
            worst = worst.max(max_abs_diff(a, b));
        }
        assert_eq!(s.cache.len(), p.len() + NEW - 1);
    }
    assert!(worst <= tol, "{what}: max logit diff {worst} > {tol}");
    eprintln!("{what}: max |batched − solo| logit = {worst:e} (steps {sizes:?})");
    worst
}

#[test]
fn batched_sequences_match_solo_on_the_fixtures() {
    for name in FIXTURES {
        // F32 and BF16 weights run the fused CPU attention (F32 and BF16 KV caches), the BF16
        // model as served: our BF16 kernel (one fixed-order dot product per output, whatever
        // the rows) and INT4 experts. F16 runs the Candle tensor path with its per-sequence
        // masks.
        let dense = ExpertsBackend::Dense;
        let int4 = ExpertsBackend::Int4 {
            group_size: GroupSize::default(),
            search: ScaleSearch::Rtn,
        };
        let f32 = &mut fixture(name, DType::F32, &dense);
        batched_matches_solo(f32, F32_TOL, true, &format!("{name} f32"));
        let bf16 = &mut fixture(name, DType::BF16, &int4);
        batched_matches_solo(bf16, F32_TOL, true, &format!("{name} bf16 + int4 experts"));
        let f16 = &mut fixture(name, DType::F16, &dense);
        // (Its greedy tokens may differ at a near tie: F16 rounds logits to 2⁻⁸ at 2–4.)
        batched_matches_solo(f16, F16_TOL, false, &format!("{name} f16"));
    }
}

#[test]
fn batched_sequences_match_solo_with_int4_experts() {
    batched_matches_solo(&mut tiny_int4(), F32_TOL, true, "synthetic tiny int4");
}

fn traffic_delta(model: &MoeForCausalLm, before: ExpertTraffic) -> ExpertTraffic {
    let now = model.expert_traffic();
    ExpertTraffic {
        calls: now.calls - before.calls,
        tokens: now.tokens - before.tokens,
        experts_read: now.experts_read - before.experts_read,
        bytes_read: now.bytes_read - before.bytes_read,
    }
}

#[test]
fn expert_traffic_counts_distinct_experts_per_step() {
    let mut model = tiny_int4();
    let moe = model.moe_blocks().count() as u64;
    let (_, block) = model.moe_blocks().next().unwrap();
    let (num_experts, bytes) = (
        block.experts().num_experts(),
        block.experts().bytes_per_expert(),
    );
    assert_eq!(model.expert_traffic(), ExpertTraffic::default());

    // A step of many tokens: each MoE block is called once and reads each expert at most once.
    let long: Vec<u32> = (0..40u32).map(|i| 100 + 37 * i).collect();
    let mut seq = model.new_sequence();
    let before = model.expert_traffic();
    model
        .forward_sequences(&mut [SequenceInput {
            cache: &mut seq,
            tokens: &long,
        }])
        .unwrap();
    let d = traffic_delta(&model, before);
    assert_eq!((d.calls, d.tokens), (moe, 40 * moe));
    assert!(
        d.experts_read >= moe && d.experts_read <= num_experts as u64 * moe,
        "{d:?}"
    );
    assert_eq!(d.bytes_read, d.experts_read * bytes as u64);

    // Four sequences' decode tokens in one step read fewer expert bytes per token than four
    // solo steps (top-k of 4 tokens overlap among the experts).
    let mut seqs: Vec<SequenceCache> = (0..4).map(|_| model.new_sequence()).collect();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(i, 50304)).collect();
    for (cache, p) in seqs.iter_mut().zip(&prompts) {
        model
            .forward_sequences(&mut [SequenceInput { cache, tokens: p }])
            .unwrap();
    }
    let next = [11u32, 22, 33, 44];
    let before = model.expert_traffic();
    let mut solo_seqs = seqs.clone();
    for (cache, t) in solo_seqs.iter_mut().zip(&next) {
        model
            .forward_sequences(&mut [SequenceInput {
                cache,
                tokens: std::slice::from_ref(t),
            }])
            .unwrap();
    }
    let solo = traffic_delta(&model, before);
    let before = model.expert_traffic();
    let mut batch: Vec<SequenceInput> = seqs
        .iter_mut()
        .zip(&next)
        .map(|(cache, t)| SequenceInput {
            cache,
            tokens: std::slice::from_ref(t),
        })
        .collect();
    model.forward_sequences(&mut batch).unwrap();
    let together = traffic_delta(&model, before);
    assert_eq!((solo.tokens, together.tokens), (4 * moe, 4 * moe));
    assert_eq!((solo.calls, together.calls), (4 * moe, moe));
    assert!(
        together.bytes_read < solo.bytes_read,
        "{together:?} vs {solo:?}"
    );
    eprintln!(
        "expert bytes per token: 4 solo decode steps {} B, one step of 4 {} B",
        solo.bytes_read / solo.tokens,
        together.bytes_read / together.tokens
    );
    // The single-sequence API counts too.
    let before = model.expert_traffic();
    model.clear_kv_cache();
    model
        .forward(&Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).unwrap(), 0)
        .unwrap();
    assert_eq!(traffic_delta(&model, before).tokens, 3 * moe);
}

#[test]
fn distinct_experts_counts_on_the_device() {
    let ids = Tensor::new(&[[3u32, 1], [1, 7], [3, 0]], &Device::Cpu).unwrap();
    let n = distinct_experts(&ids, 8)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap();
    assert_eq!(n, 4);
}

/// The `QmoeError` a model call failed with.
fn model_error<T>(r: candle::Result<T>) -> QmoeError {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => QmoeError::from(e),
    }
}

/// The last-position logits of `tokens` after `cache` (cloned, so `cache` is untouched).
fn next_logits(model: &mut MoeForCausalLm, cache: &SequenceCache, tokens: &[u32]) -> Tensor {
    let mut cache = cache.clone();
    let mut out = model
        .forward_sequences(&mut [SequenceInput {
            cache: &mut cache,
            tokens,
        }])
        .unwrap();
    out.remove(0)
}

#[test]
fn failing_steps_change_no_cache() {
    let name = FIXTURES[0];
    let mut model = fixture_with(
        name,
        DType::F32,
        |v| v["max_position_embeddings"] = 16.into(),
        &ExpertsBackend::Dense,
    );
    let (mut a, mut b) = (model.new_sequence(), model.new_sequence());
    let (pa, pb): (Vec<u32>, Vec<u32>) = ((1..11).collect(), (20..32).collect());
    model
        .forward_sequences(&mut [
            SequenceInput {
                cache: &mut a,
                tokens: &pa,
            },
            SequenceInput {
                cache: &mut b,
                tokens: &pb,
            },
        ])
        .unwrap();
    let (want_a, want_b) = (
        next_logits(&mut model, &a, &[5]),
        next_logits(&mut model, &b, &[6]),
    );
    let unchanged = |model: &mut MoeForCausalLm, a: &SequenceCache, b: &SequenceCache| {
        assert_eq!((a.len(), b.len()), (10, 12));
        assert_eq!(max_abs_diff(&next_logits(model, a, &[5]), &want_a), 0.0);
        assert_eq!(max_abs_diff(&next_logits(model, b, &[6]), &want_b), 0.0);
    };

    let e = model_error(model.forward_sequences(&mut []));
    assert!(
        matches!(&e, QmoeError::InvalidArgument { argument, .. } if argument == "batch"),
        "{e}"
    );
    let mut two = |ta: &[u32], tb: &[u32], model: &mut MoeForCausalLm| {
        model_error(model.forward_sequences(&mut [
            SequenceInput {
                cache: &mut a,
                tokens: ta,
            },
            SequenceInput {
                cache: &mut b,
                tokens: tb,
            },
        ]))
    };
    let e = two(&[5], &[], &mut model);
    assert!(
        matches!(&e, QmoeError::InvalidArgument { argument, .. } if argument == "batch[1].tokens"),
        "{e}"
    );
    // b holds 12 of 16 positions: 5 more exceed the context, 4 would fit.
    let e = two(&[5], &[1, 2, 3, 4, 5], &mut model);
    assert!(
        matches!(
            e,
            QmoeError::ContextExceeded {
                cached: 12,
                new: 5,
                context: 16
            }
        ),
        "{e}"
    );
    let e = two(&[5], &[6, 512], &mut model);
    assert!(
        matches!(
            e,
            QmoeError::TokenOutOfVocab {
                token: 512,
                vocab_size: 512
            }
        ),
        "{e}"
    );
    unchanged(&mut model, &a, &b);

    // A cache of a model with another layer count is refused by name.
    let other = fixture_with(
        name,
        DType::F32,
        |v| v["num_hidden_layers"] = 1.into(),
        &ExpertsBackend::Dense,
    );
    let mut foreign = other.new_sequence();
    let e = model_error(model.forward_sequences(&mut [SequenceInput {
        cache: &mut foreign,
        tokens: &[1],
    }]));
    assert!(
        matches!(&e, QmoeError::InvalidArgument { argument, reason }
            if argument == "batch[0].cache" && reason.contains("1 layers")),
        "{e}"
    );
}

/// Routed experts that fail on demand (after the layers before them appended to the caches).
struct Failing {
    inner: Arc<dyn RoutedExperts>,
    fail: Arc<AtomicBool>,
}

impl RoutedExperts for Failing {
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }
    fn hidden_size(&self) -> usize {
        self.inner.hidden_size()
    }
    fn bytes_per_expert(&self) -> usize {
        self.inner.bytes_per_expert()
    }
    fn forward(&self, xs: &Tensor, ids: &Tensor, w: &Tensor) -> candle::Result<Tensor> {
        if self.fail.load(Ordering::Relaxed) {
            candle::bail!("injected failure");
        }
        self.inner.forward(xs, ids, w)
    }
}

/// Dense experts whose last layer's fail when `fail` is set.
struct FailingLast(Arc<AtomicBool>, usize);

impl ExpertsLoader for FailingLast {
    fn load(&self, dims: ExpertDims, vb: VarBuilder) -> candle::Result<Arc<dyn RoutedExperts>> {
        let last = dims.layer + 1 == self.1;
        let inner = ExpertsBackend::Dense.load(dims, vb)?;
        Ok(match last {
            true => Arc::new(Failing {
                inner,
                fail: self.0.clone(),
            }),
            false => inner,
        })
    }
}

#[test]
fn a_failure_inside_the_pass_rolls_every_cache_back() {
    for dtype in [DType::F32, DType::F16] {
        let fail = Arc::new(AtomicBool::new(false));
        let mut model = fixture_with(FIXTURES[0], dtype, |_| {}, &FailingLast(fail.clone(), 2));
        let (mut a, mut b) = (model.new_sequence(), model.new_sequence());
        let (pa, pb): (Vec<u32>, Vec<u32>) = ((1..8).collect(), (20..23).collect());
        let mut step = |model: &mut MoeForCausalLm, ta: &[u32], tb: &[u32]| {
            model.forward_sequences(&mut [
                SequenceInput {
                    cache: &mut a,
                    tokens: ta,
                },
                SequenceInput {
                    cache: &mut b,
                    tokens: tb,
                },
            ])
        };
        step(&mut model, &pa, &[20]).unwrap();
        fail.store(true, Ordering::Relaxed);
        let e = step(&mut model, &[9], &pb).unwrap_err();
        assert!(e.to_string().contains("injected failure"), "{e}");
        fail.store(false, Ordering::Relaxed);
        let got = step(&mut model, &[9], &pb).unwrap();
        // The same steps without the failure.
        let (mut ra, mut rb) = (model.new_sequence(), model.new_sequence());
        let mut reference = |ta: &[u32], tb: &[u32]| {
            model
                .forward_sequences(&mut [
                    SequenceInput {
                        cache: &mut ra,
                        tokens: ta,
                    },
                    SequenceInput {
                        cache: &mut rb,
                        tokens: tb,
                    },
                ])
                .unwrap()
        };
        reference(&pa, &[20]);
        let want = reference(&[9], &pb);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(max_abs_diff(g, w), 0.0, "{dtype:?}");
        }
        assert_eq!((a.len(), b.len()), (8, 4));
        // The single-sequence API rolls back too.
        model.clear_kv_cache();
        let ids = Tensor::new(&[[3u32, 4, 5]], &Device::Cpu).unwrap();
        model.forward(&ids, 0).unwrap();
        fail.store(true, Ordering::Relaxed);
        let e = model.forward(&ids, 3).unwrap_err();
        assert!(e.to_string().contains("injected failure"), "{e}");
        assert_eq!(model.cached_len(), 3);
        fail.store(false, Ordering::Relaxed);
    }
}
