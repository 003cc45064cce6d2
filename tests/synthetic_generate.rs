//! The synthetic models and the generation loop: deterministic weights and tokens for a seed,
//! the stop conditions, and INT4 slabs that the kernels and the dequantizer read alike.

use candle::{DType, Device, Tensor};
use candle_qmoe::generation::{argmax, generate, prefill, CausalLm, Generation, StopReason};
use candle_qmoe::models::{MoeForCausalLm, QkNorm};
use candle_qmoe::pack::GroupSize;
use candle_qmoe::parity::logit_agreement;
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use candle_qmoe::QmoeError;
use candle_qmoe_suite::testing::max_abs_diff;
use candle_transformers::generation::LogitsProcessor;

const PROMPT: [u32; 6] = [50279, 510, 3158, 8516, 30013, 27287];

fn tiny(seed: u64) -> SyntheticModel {
    SyntheticModel::new(SyntheticKind::Tiny, seed, GroupSize::default()).unwrap()
}

fn int4_model(s: &SyntheticModel) -> MoeForCausalLm {
    s.load(DType::F32, &Device::Cpu, &s.int4_experts()).unwrap()
}

fn sampled(model: &mut MoeForCausalLm, seed: u64, n: usize) -> Generation {
    let mut lp = LogitsProcessor::new(seed, Some(0.8), Some(0.95));
    generate(model, &PROMPT, n, &[], |l, _| lp.sample(l), |_| Ok(())).unwrap()
}

#[test]
fn synthetic_tiny_generation_is_deterministic_for_a_seed() {
    let (a, b) = (tiny(7), tiny(7));
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_eq!(
        a.pack().layer(1).unwrap().bytes(),
        b.pack().layer(1).unwrap().bytes()
    );
    assert_ne!(a.fingerprint(), tiny(8).fingerprint());
    let spec = a.spec();
    assert_eq!(
        (spec.vocab_size, spec.hidden_size, spec.num_layers()),
        (50304, 256, 2)
    );

    let (mut ma, mut mb) = (int4_model(&a), int4_model(&b));
    let ga = sampled(&mut ma, 299792458, 12);
    let gb = sampled(&mut mb, 299792458, 12);
    assert_eq!(ga.tokens, gb.tokens);
    assert_eq!(ga.tokens.len(), 12);
    assert_eq!(ga.stop, StopReason::MaxTokens);
    assert_eq!(ga.prompt_tokens, PROMPT.len());
    assert!(ga.tokens.iter().all(|&t| t < 50304));
    assert!(ga.decode_tokens_per_s().unwrap() > 0.0 && ga.prompt_tokens_per_s().unwrap() > 0.0);
    // The same model again (the KV cache is cleared by `generate`) gives the same tokens.
    assert_eq!(sampled(&mut ma, 299792458, 12).tokens, ga.tokens);

    // Greedy too; another sampling seed gives another sequence.
    let greedy = |m: &mut MoeForCausalLm| {
        generate(m, &PROMPT, 8, &[], argmax, |_| Ok(()))
            .unwrap()
            .tokens
    };
    assert_eq!(greedy(&mut ma), greedy(&mut mb));
    assert_ne!(sampled(&mut ma, 1, 12).tokens, ga.tokens);
}

#[test]
fn generation_stops_at_eos_and_at_the_context() {
    let s = tiny(3);
    let mut model = int4_model(&s);
    let first = generate(&mut model, &PROMPT, 4, &[], argmax, |_| Ok(())).unwrap();
    let eos = first.tokens[1];
    let mut streamed = Vec::new();
    let g = generate(&mut model, &PROMPT, 4, &[eos], argmax, |t| {
        streamed.push(t);
        Ok(())
    })
    .unwrap();
    assert_eq!(g.stop, StopReason::Eos);
    assert_eq!(g.tokens, first.tokens[..2].to_vec());
    assert_eq!(streamed, g.tokens);

    // A model with a context of 8 tokens: 6 prompt tokens leave room for 2.
    let mut spec = s.spec().clone();
    spec.max_position_embeddings = 8;
    let mut short = MoeForCausalLm::new(
        &spec,
        s.var_builder(DType::F32, &Device::Cpu),
        &s.int4_experts(),
    )
    .unwrap();
    let g = generate(&mut short, &PROMPT, 10, &[], argmax, |_| Ok(())).unwrap();
    assert_eq!((g.stop, g.tokens.len()), (StopReason::ContextFull, 2));
    let long: Vec<u32> = (0..9).collect();
    let e = generate(&mut short, &long, 1, &[], argmax, |_| Ok(())).unwrap_err();
    assert!(
        matches!(
            QmoeError::find(&e),
            Some(QmoeError::ContextExceeded {
                cached: 0,
                new: 9,
                context: 8
            })
        ),
        "{e}"
    );
    let e = generate(&mut short, &[], 1, &[], argmax, |_| Ok(())).unwrap_err();
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::InvalidArgument { argument, .. }) if argument == "prompt"),
        "{e}"
    );
}

/// The random slabs are valid INT4: the kernel on them matches the dense oracle on their
/// dequantized weights, in the whole model.
#[test]
fn synthetic_int4_matches_its_dequantized_experts() {
    for group in [32, 128] {
        let s =
            SyntheticModel::new(SyntheticKind::Tiny, 5, GroupSize::new(group).unwrap()).unwrap();
        let mut int4 = int4_model(&s);
        let mut dense = s
            .load(DType::F32, &Device::Cpu, &s.dense_experts(DType::F32))
            .unwrap();
        let ids = candle::Tensor::new(&[PROMPT], &Device::Cpu).unwrap();
        let a = int4.forward_all(&ids, 0).unwrap().squeeze(0).unwrap();
        let b = dense.forward_all(&ids, 0).unwrap().squeeze(0).unwrap();
        let m = logit_agreement(&a, &b).unwrap();
        assert_eq!(m.top1, 1.0, "g{group}");
        // The kernel rounds activations to 8 bits per group at this prompt length (the decode
        // default; `QMOE_DECODE_ACTS=i16` gives 16): 2⁻⁸ of the group's absmax per element,
        // measured as 7e-5–1.1e-4 on logits of size ~1 (16-bit: 5e-6–7e-6). 1e-3 leaves 9×.
        assert!(m.max_abs_diff < 1e-3, "g{group}: {}", m.max_abs_diff);
        // Logits of a random model with std-0.02 weights are O(1), not degenerate.
        let std = b.flatten_all().unwrap().sqr().unwrap().mean_all().unwrap();
        let std = std.to_scalar::<f32>().unwrap().sqrt();
        assert!((0.1..10.0).contains(&std), "logit RMS {std}");
    }
}

#[test]
fn chunked_prefill_matches_one_pass() {
    use candle_qmoe::generation::prefill;
    let s = tiny(11);
    let mut model = int4_model(&s);
    let prompt: Vec<u32> = (0..40u32).map(|i| 100 + 37 * i).collect();
    let mut run = |chunk: usize| {
        model.clear_kv_cache();
        let logits = prefill(&mut model, &prompt, chunk).unwrap();
        assert_eq!(model.cached_len(), prompt.len());
        logits.to_vec1::<f32>().unwrap()
    };
    let whole = run(40);
    for chunk in [1, 7, 16] {
        let parts = run(chunk);
        // F32 throughout: only the blocking of the attention and expert sums changes, a few
        // ulps of logits of magnitude ~1.
        let diff = max_abs_diff(&whole, &parts);
        assert!(diff < 1e-4, "chunk {chunk}: max |Δlogit| {diff}");
    }
    let mut m = int4_model(&s);
    for (prompt, chunk, what) in [(&[][..], 4, "prompt"), (&prompt[..], 0, "prefill chunk")] {
        let e = prefill(&mut m, prompt, chunk).unwrap_err();
        assert!(
            matches!(QmoeError::find(&e), Some(QmoeError::InvalidArgument { argument, .. }) if argument == what),
            "{e}"
        );
    }
}

/// BF16 non-expert weights (the default; F32 activations on the CPU through our kernels) against
/// the F32 reference path: logits within BF16 weight rounding, and the weight bytes one decoded
/// token reads counted by hand from the shapes.
#[test]
fn bf16_weights_track_the_f32_path_and_count_their_bytes() {
    let s = tiny(3);
    let mut f32_model = int4_model(&s);
    let mut bf16_model = s
        .load(DType::BF16, &Device::Cpu, &s.int4_experts())
        .unwrap();
    assert_eq!(bf16_model.dtype(), DType::BF16);
    assert_eq!(bf16_model.activation_dtype(), DType::F32);
    let ids = candle::Tensor::new(&PROMPT, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let a = f32_model.forward_all(&ids, 0).unwrap();
    let b = bf16_model.forward_all(&ids, 0).unwrap();
    // The synthetic weights are BF16 values, so both paths multiply the same numbers; only the
    // F32 summation order differs (our kernel vs Candle's gemm): agreement to ~1e-6 relative.
    let agreement = logit_agreement(&b.squeeze(0).unwrap(), &a.squeeze(0).unwrap()).unwrap();
    assert!(agreement.max_abs_diff < 1e-3, "{agreement:?}");
    // Greedy decode with the KV cache gives the same tokens.
    let greedy = |m: &mut MoeForCausalLm| {
        generate(m, &PROMPT, 8, &[], argmax, |_| Ok(()))
            .unwrap()
            .tokens
    };
    assert_eq!(greedy(&mut f32_model), greedy(&mut bf16_model));

    let spec = s.spec();
    let (h, v) = (spec.hidden_size, spec.vocab_size);
    let q = spec.num_heads * spec.head_dim;
    let kv = spec.num_kv_heads * spec.head_dim;
    let slab = s.pack().meta().layout.slab_bytes();
    let per_layer: usize = spec
        .layers
        .iter()
        .map(|l| {
            let candle_qmoe::models::FfnSpec::Moe(m) = l else {
                panic!("the tiny model is all MoE")
            };
            let qk_norm = match spec.attention.qk_norm {
                QkNorm::Projection => q + kv,
                QkNorm::PerHead => 2 * spec.head_dim,
                QkNorm::None => 0,
            };
            // Norm weights are kept in the activations' dtype (F32), projections in BF16.
            4 * (2 * h + qk_norm)
                + 2 * (h * (q + 2 * kv) + q * h + m.num_experts * h)
                + m.top_k * slab
        })
        .sum();
    // Layers, final norm (F32), lm_head (untied) and one embedding row (BF16).
    let want = per_layer + 4 * h + 2 * v * h + 2 * h;
    assert_eq!(bf16_model.weight_bytes_per_token(), want);
}

/// The tokenizers of the 30B-class synthetic kinds: Qwen1.5's for qwen3moe (its ids, ChatML
/// markers included, fit Qwen3's vocabulary and its `eos_token_id` is `<|im_end|>`), and for
/// mixtral the byte stand-in, whose ids are Mistral's byte-fallback ids.
#[test]
fn the_30b_class_synthetic_tokenizers_fit_their_vocabularies() {
    use candle_qmoe_suite::tokenizer::{synthetic_tokenizer, synthetic_tokenizer_family};
    let (qwen, note) = synthetic_tokenizer(SyntheticKind::Qwen3Moe).unwrap();
    assert!(note.unwrap().contains("Qwen1.5"));
    let spec = SyntheticKind::Qwen3Moe.spec().unwrap();
    assert!(qwen.get_vocab_size(true) <= spec.vocab_size);
    let eos = SyntheticKind::Qwen3Moe.config_json()["eos_token_id"].as_u64();
    assert_eq!(qwen.token_to_id("<|im_end|>").map(u64::from), eos);
    assert_eq!(
        synthetic_tokenizer_family(SyntheticKind::Qwen3Moe),
        Some("qwen2_moe")
    );

    let (bytes, note) = synthetic_tokenizer(SyntheticKind::Mixtral).unwrap();
    assert!(note.unwrap().contains("no mixtral tokenizer is bundled"));
    assert_eq!(bytes.get_vocab_size(true), 32000);
    let text = "Héllo [INST]";
    let ids = bytes.encode(text, true).unwrap().get_ids().to_vec();
    let want: Vec<u32> = std::iter::once(1)
        .chain(text.bytes().map(|b| 3 + b as u32))
        .collect();
    assert_eq!(ids, want);
    assert_eq!(bytes.decode(&ids, true).unwrap(), text);
    let mixed = [72 + 3, 31999, 105 + 3, 2];
    assert_eq!(bytes.decode(&mixed, true).unwrap(), "H[31999]i");
    assert_eq!(synthetic_tokenizer_family(SyntheticKind::Mixtral), None);
}

/// A model of the caller's own: its next token is the last one plus one (mod `VOCAB`), and it
/// refuses a call whose offset is not its cache's length.
struct Counter {
    cache: Vec<u32>,
    calls: usize,
    device: Device,
}

impl Counter {
    const VOCAB: u32 = 7;
    const CONTEXT: usize = 600;
}

impl CausalLm for Counter {
    fn forward(&mut self, input_ids: &Tensor, seqlen_offset: usize) -> candle::Result<Tensor> {
        if seqlen_offset != self.cache.len() {
            candle::bail!("offset {seqlen_offset} with {} cached", self.cache.len());
        }
        self.calls += 1;
        self.cache.extend(input_ids.squeeze(0)?.to_vec1::<u32>()?);
        let next = (self.cache.last().unwrap() + 1) % Self::VOCAB;
        let logits: Vec<f32> = (0..Self::VOCAB).map(|v| f32::from(v == next)).collect();
        Tensor::new(logits, &self.device)?.unsqueeze(0)
    }
    fn cached_len(&self) -> usize {
        self.cache.len()
    }
    fn clear_kv_cache(&mut self) {
        self.cache.clear();
    }
    fn device(&self) -> &Device {
        &self.device
    }
    fn max_context(&self) -> usize {
        Self::CONTEXT
    }
}

/// The loop drives any `CausalLm`: a prompt longer than one prefill chunk goes in two chunks at
/// the right offsets, then a token per call until the model's own context is full; the cache is
/// cleared first; `prefill` continues after what is cached.
#[test]
fn the_generation_loop_drives_a_model_of_the_callers_own() {
    let mut model = Counter {
        cache: vec![3; 10],
        calls: 0,
        device: Device::Cpu,
    };
    let prompt: Vec<u32> = (0..520).map(|i| i % Counter::VOCAB).collect();
    let g = generate(&mut model, &prompt, 100, &[], argmax, |_| Ok(())).unwrap();
    assert_eq!(g.stop, StopReason::ContextFull);
    assert_eq!(g.tokens.len(), Counter::CONTEXT - prompt.len());
    let expected: Vec<u32> = (520..Counter::CONTEXT as u32)
        .map(|i| i % Counter::VOCAB)
        .collect();
    assert_eq!(g.tokens, expected);
    // Two prefill chunks (512 + 8), then every generated token but the last.
    assert_eq!(model.calls, 2 + g.tokens.len() - 1);
    assert_eq!(model.cached_len(), Counter::CONTEXT - 1);

    let eos = [5];
    let g = generate(&mut model, &prompt[..3], 100, &eos, argmax, |_| Ok(())).unwrap();
    assert_eq!((g.stop, g.tokens), (StopReason::Eos, vec![3, 4, 5]));

    let logits = prefill(&mut model, &[6], 4).unwrap();
    assert_eq!(argmax(&logits, &[]).unwrap(), 0);
    assert_eq!(model.cached_len(), 3 + 2 + 1);
}
