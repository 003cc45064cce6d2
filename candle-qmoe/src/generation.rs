//! A plain generation loop over any [`CausalLm`] (our [`MoeForCausalLm`], or a model of your
//! own) with the timings of docs/architecture.md §6.
//!
//! The prompt goes through the model in chunks of at most [`PREFILL_CHUNK`] tokens (prefill, so
//! the activations of a long prompt stay bounded, as [`crate::plan`] assumes), then one token per
//! call with the KV cache. Sampling is the caller's (e.g. `candle_transformers::generation::LogitsProcessor`), so
//! the loop serves greedy parity checks and sampled chat alike.

use std::time::{Duration, Instant};

use candle::{DType, Device, Tensor};

use crate::models::MoeForCausalLm;
use crate::profile::{self, Profile};
use crate::QmoeError;

/// Most prompt tokens per forward pass during prefill.
pub const PREFILL_CHUNK: usize = 512;

/// A causal language model with a KV cache of its own, as [`prefill`] and [`generate`] drive
/// it. [`MoeForCausalLm`] implements it; so can a model ported outside this crate (with
/// [`crate::SparseMoe`] as its MoE layers, say) to get the same loop, checks and timings.
pub trait CausalLm {
    /// Logits `[1, vocab]` (F32) of the last position of `input_ids [1, S]`, whose first token
    /// sits at position `seqlen_offset` (= [`Self::cached_len`]); the tokens join the KV cache.
    fn forward(&mut self, input_ids: &Tensor, seqlen_offset: usize) -> candle::Result<Tensor>;
    /// Tokens held in the KV cache.
    fn cached_len(&self) -> usize;
    /// Empties the KV cache: the next call starts at position 0.
    fn clear_kv_cache(&mut self);
    /// The device the model's inputs live on.
    fn device(&self) -> &Device;
    /// Most positions a sequence may hold, prompt and generated tokens together (a
    /// Hugging Face config's `max_position_embeddings`).
    fn max_context(&self) -> usize;
}

impl CausalLm for MoeForCausalLm {
    fn forward(&mut self, input_ids: &Tensor, seqlen_offset: usize) -> candle::Result<Tensor> {
        MoeForCausalLm::forward(self, input_ids, seqlen_offset)
    }
    fn cached_len(&self) -> usize {
        MoeForCausalLm::cached_len(self)
    }
    fn clear_kv_cache(&mut self) {
        MoeForCausalLm::clear_kv_cache(self)
    }
    fn device(&self) -> &Device {
        MoeForCausalLm::device(self)
    }
    fn max_context(&self) -> usize {
        self.spec().max_position_embeddings
    }
}

/// Runs `prompt` through the model in chunks of at most `chunk` tokens after the tokens already
/// in its KV cache, and returns the last position's logits (`[vocab]`, F32).
pub fn prefill<M: CausalLm + ?Sized>(
    model: &mut M,
    prompt: &[u32],
    chunk: usize,
) -> candle::Result<Tensor> {
    let invalid = |argument: &str, reason: &str| -> candle::Error {
        QmoeError::InvalidArgument {
            argument: argument.into(),
            reason: reason.into(),
        }
        .into()
    };
    if prompt.is_empty() {
        return Err(invalid("prompt", "it is empty (prefill needs a token)"));
    }
    if chunk == 0 {
        return Err(invalid("prefill chunk", "0 (it must be at least 1 token)"));
    }
    let device = model.device().clone();
    let mut logits = None;
    for part in prompt.chunks(chunk) {
        let input = Tensor::new(part, &device)?.unsqueeze(0)?;
        logits = Some(model.forward(&input, model.cached_len())?.squeeze(0)?);
    }
    Ok(logits.expect("a prompt that is not empty has a chunk"))
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An end-of-sequence token was generated.
    Eos,
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The context is full: the model's [`CausalLm::max_context`], or a shorter limit of the
    /// caller's (which then asks [`generate`] for only the tokens that fit).
    ContextFull,
}

/// One finished generation and its timings.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// The generated ids, including the end-of-sequence token when one stopped generation.
    pub tokens: Vec<u32>,
    /// Why generation stopped.
    pub stop: StopReason,
    /// From the start of the prefill until the first token was sampled.
    pub time_to_first_token: Duration,
    /// From the first token until the last one was sampled.
    pub decode_time: Duration,
    /// Wall time per part of the forward passes in `decode_time`, when [`crate::profile`] was
    /// on as decoding began.
    pub decode_profile: Option<Profile>,
}

impl Generation {
    /// Prompt tokens per second of the prefill (prompt tokens / time to first token); `None`
    /// when no token was generated (no prefill ran).
    pub fn prompt_tokens_per_s(&self) -> Option<f64> {
        let t = self.time_to_first_token.as_secs_f64();
        (!self.tokens.is_empty() && t > 0.0).then(|| self.prompt_tokens as f64 / t)
    }

    /// Decode rate as docs/architecture.md §6 defines it: (generated − 1) / decode time after
    /// the first token; `None` with fewer than two generated tokens.
    pub fn decode_tokens_per_s(&self) -> Option<f64> {
        let n = self.tokens.len().checked_sub(1).filter(|&n| n > 0)?;
        Some(n as f64 / self.decode_time.as_secs_f64())
    }
}

/// Generates up to `max_new_tokens` after `prompt`, stopping early at any of `eos` or when the
/// context is full.
///
/// The KV cache is cleared first. `sample(logits, context)` picks the next token from the last
/// position's logits (`[vocab]`, F32) given every token so far (prompt and generated);
/// `on_token` sees each generated token as soon as it exists (for streaming output).
pub fn generate<M: CausalLm + ?Sized>(
    model: &mut M,
    prompt: &[u32],
    max_new_tokens: usize,
    eos: &[u32],
    mut sample: impl FnMut(&Tensor, &[u32]) -> candle::Result<u32>,
    mut on_token: impl FnMut(u32) -> candle::Result<()>,
) -> candle::Result<Generation> {
    let context = model.max_context();
    if prompt.is_empty() {
        return Err(QmoeError::InvalidArgument {
            argument: "prompt".into(),
            reason: "it is empty".into(),
        }
        .into());
    }
    if prompt.len() > context {
        return Err(QmoeError::ContextExceeded {
            cached: 0,
            new: prompt.len(),
            context,
        }
        .into());
    }
    model.clear_kv_cache();
    let device = model.device().clone();
    let mut all = prompt.to_vec();
    let start = Instant::now();
    let mut first_token_at = None;
    if max_new_tokens == 0 {
        return Ok(Generation {
            prompt_tokens: prompt.len(),
            tokens: Vec::new(),
            stop: StopReason::MaxTokens,
            time_to_first_token: Duration::ZERO,
            decode_time: Duration::ZERO,
            decode_profile: None,
        });
    }
    let mut logits = prefill(model, prompt, PREFILL_CHUNK)?;
    let mut decode_start = None;
    let stop = loop {
        check_logits(&logits, all.len() - 1)?;
        let next = sample(&logits, &all)?;
        first_token_at.get_or_insert_with(Instant::now);
        if profile::enabled() {
            decode_start.get_or_insert_with(profile::snapshot);
        }
        all.push(next);
        on_token(next)?;
        if eos.contains(&next) {
            break StopReason::Eos;
        }
        if all.len() >= context {
            break StopReason::ContextFull;
        }
        if all.len() - prompt.len() == max_new_tokens {
            break StopReason::MaxTokens;
        }
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        logits = model.forward(&input, model.cached_len())?.squeeze(0)?;
    };
    let end = Instant::now();
    let first = first_token_at.unwrap_or(end);
    let decode_profile = decode_start.map(|start| profile::snapshot().since(&start));
    Ok(Generation {
        prompt_tokens: prompt.len(),
        tokens: all.split_off(prompt.len()),
        stop,
        time_to_first_token: first - start,
        decode_time: end - first,
        decode_profile,
    })
}

/// Refuses logits (`[vocab]`, F32) of sequence position `position` that hold a NaN or an
/// infinity, which no sampler can rank: [`QmoeError::NonFiniteLogits`] names the first. One sum
/// over the vocabulary per token (a few µs); the scan for the culprit runs only on failure.
pub fn check_logits(logits: &Tensor, position: usize) -> candle::Result<()> {
    let sum = logits.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    if sum.is_finite() {
        return Ok(());
    }
    let values = logits
        .flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    let Some((token, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) else {
        return Ok(()); // finite logits whose sum overflowed
    };
    Err(QmoeError::NonFiniteLogits {
        position,
        token,
        value,
    }
    .into())
}

/// Greedy (argmax) sampling, for [`generate`].
pub fn argmax(logits: &Tensor, _context: &[u32]) -> candle::Result<u32> {
    logits.argmax(candle::D::Minus1)?.to_scalar::<u32>()
}
