//! Fidelity of a model against a golden file (docs/architecture.md §7, with the fixture
//! format), shared by the tests and the `parity` example.
//!
//! A golden file is a safetensors file with, per prompt `N`: `promptN.input_ids` (i64 `[len]`),
//! `promptN.logits` (f32 `[len, vocab]`, full forward), `promptN.greedy_ids` (i64 `[steps]`,
//! greedy continuation with the KV cache), `promptN.greedy_step_logits` (f32 `[steps, vocab]`,
//! the logits that chose each greedy token) and optionally `promptN.router_logits` (f32
//! `[moe_layers, len, experts]`; logits or probabilities, only their top-k is compared).

use std::collections::HashMap;
use std::path::Path;

use candle::{DType, Device, Tensor};

use crate::generation::{argmax, generate};
use crate::models::MoeForCausalLm;
use crate::QmoeError;

/// One prompt of a golden file.
#[derive(Clone, Debug)]
pub struct GoldenPrompt {
    /// The prompt ids.
    pub input_ids: Vec<u32>,
    /// Full-forward logits `[len, vocab]`.
    pub logits: Tensor,
    /// Greedy continuation with the KV cache.
    pub greedy_ids: Vec<u32>,
    /// Logits `[steps, vocab]` that chose each greedy token (row 0 = last prompt position).
    pub greedy_step_logits: Tensor,
    /// Router logits (or probabilities) `[moe_layers, len, experts]` of the full forward.
    pub router_logits: Option<Tensor>,
}

/// The prompts of a golden file, in order.
#[derive(Clone, Debug)]
pub struct Golden {
    /// `prompt0`, `prompt1`, …
    pub prompts: Vec<GoldenPrompt>,
}

fn golden_err(reason: String) -> QmoeError {
    QmoeError::InvalidFile {
        file: "golden file".into(),
        reason,
    }
}

impl Golden {
    /// Reads a golden safetensors file onto the CPU.
    pub fn load(path: impl AsRef<Path>) -> crate::Result<Self> {
        let path = path.as_ref();
        let tensors =
            candle::safetensors::load(path, &Device::Cpu).map_err(|e| QmoeError::InvalidFile {
                file: format!("golden file `{}`", path.display()),
                reason: e.to_string(),
            })?;
        Self::from_tensors(tensors)
    }

    /// Collects `prompt0.*`, `prompt1.*`, … from loaded tensors, checking names and shapes.
    pub fn from_tensors(mut t: HashMap<String, Tensor>) -> crate::Result<Self> {
        let mut prompts = Vec::new();
        while t.contains_key(&format!("prompt{}.input_ids", prompts.len())) {
            let p = prompts.len();
            let mut take = |k: &str| {
                let name = format!("prompt{p}.{k}");
                t.remove(&name)
                    .ok_or_else(|| golden_err(format!("missing `{name}`")))
            };
            let ids = |t: Tensor| -> crate::Result<Vec<u32>> {
                t.to_dtype(DType::I64)?
                    .flatten_all()?
                    .to_vec1::<i64>()?
                    .into_iter()
                    .map(|v| u32::try_from(v).map_err(|_| golden_err(format!("bad token id {v}"))))
                    .collect()
            };
            let input_ids = ids(take("input_ids")?)?;
            let logits = take("logits")?.to_dtype(DType::F32)?;
            let greedy_ids = ids(take("greedy_ids")?)?;
            let greedy_step_logits = take("greedy_step_logits")?.to_dtype(DType::F32)?;
            let router_logits = take("router_logits")
                .ok()
                .map(|r| r.to_dtype(DType::F32))
                .transpose()?;
            let (len, vocab) = logits.dims2()?;
            if len != input_ids.len()
                || greedy_ids.is_empty()
                || greedy_step_logits.dims() != [greedy_ids.len(), vocab]
            {
                return Err(golden_err(format!(
                    "prompt{p}: input_ids [{}], logits {:?}, greedy_ids [{}], \
                     greedy_step_logits {:?} do not fit together",
                    input_ids.len(),
                    logits.dims(),
                    greedy_ids.len(),
                    greedy_step_logits.dims()
                )));
            }
            prompts.push(GoldenPrompt {
                input_ids,
                logits,
                greedy_ids,
                greedy_step_logits,
                router_logits,
            });
        }
        if prompts.is_empty() {
            return Err(golden_err("no `prompt0.input_ids`".into()));
        }
        Ok(Self { prompts })
    }
}

/// Teacher-forced agreement of two logit matrices.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct LogitAgreement {
    /// Fraction of rows whose argmax agrees.
    pub top1: f64,
    /// Mean over rows of KL(reference ‖ ours), in nats.
    pub mean_kl: f64,
    /// Largest |ours − reference| over all logits; infinite where either is not finite.
    pub max_abs_diff: f64,
}

/// Compares logits `ours` with `reference`, both `[rows, vocab]` (computed in f64).
pub fn logit_agreement(ours: &Tensor, reference: &Tensor) -> candle::Result<LogitAgreement> {
    if ours.dims() != reference.dims() || ours.rank() != 2 {
        return Err(QmoeError::ShapeMismatch {
            tensor: "logits".into(),
            got: ours.dims().to_vec(),
            expected: reference.dims().to_vec(),
        }
        .into());
    }
    let a = ours.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let b = reference.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |m, (i, &v)| if v > m.1 { (i, v) } else { m },
            )
            .0
    };
    let log_softmax = |r: &[f32]| -> Vec<f64> {
        let m = r.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let lse = m + r.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        r.iter().map(|&v| v as f64 - lse).collect()
    };
    let (mut agree, mut kl, mut max_abs) = (0usize, 0f64, 0f64);
    for (o, r) in a.iter().zip(&b) {
        agree += (argmax(o) == argmax(r)) as usize;
        let (lo, lr) = (log_softmax(o), log_softmax(r));
        kl += lr
            .iter()
            .zip(&lo)
            .map(|(p, q)| p.exp() * (p - q))
            .sum::<f64>();
        for (x, y) in o.iter().zip(r) {
            let d = (x - y).abs() as f64;
            max_abs = if d.is_finite() {
                max_abs.max(d)
            } else {
                f64::INFINITY
            };
        }
    }
    let rows = a.len().max(1) as f64;
    Ok(LogitAgreement {
        top1: agree as f64 / rows,
        mean_kl: kl / rows,
        max_abs_diff: max_abs,
    })
}

/// The top-`k` expert set (sorted) of each row of router logits `[tokens, experts]`.
pub fn topk_sets(router: &Tensor, k: usize) -> candle::Result<Vec<Vec<u32>>> {
    let idx = router
        .to_dtype(DType::F32)?
        .arg_sort_last_dim(false)?
        .to_vec2::<u32>()?;
    Ok(idx
        .into_iter()
        .map(|row| {
            let mut s = row[..k.min(row.len())].to_vec();
            s.sort_unstable();
            s
        })
        .collect())
}

/// Fraction of (MoE layer, token) pairs whose top-k expert set equals the golden's. `ours` holds
/// one `[tokens, experts]` tensor per MoE layer, `golden` is `[layers, tokens, experts]`, `top_k`
/// gives k per MoE layer.
pub fn router_agreement(ours: &[Tensor], golden: &Tensor, top_k: &[usize]) -> candle::Result<f64> {
    let layers = golden.dim(0)?;
    if ours.len() != layers || top_k.len() != layers {
        return Err(golden_err(format!(
            "router_logits has {layers} MoE layers, the model {} (top-k given for {})",
            ours.len(),
            top_k.len()
        ))
        .into());
    }
    let (mut same, mut total) = (0usize, 0usize);
    for (l, (o, &k)) in ours.iter().zip(top_k).enumerate() {
        let g = golden.get(l)?;
        if o.dims() != g.dims() {
            return Err(QmoeError::ShapeMismatch {
                tensor: format!("golden router_logits of MoE layer {l}"),
                got: g.dims().to_vec(),
                expected: o.dims().to_vec(),
            }
            .into());
        }
        let (a, b) = (topk_sets(o, k)?, topk_sets(&g, k)?);
        same += a.iter().zip(&b).filter(|(x, y)| x == y).count();
        total += a.len();
    }
    Ok(same as f64 / total.max(1) as f64)
}

/// The greedy continuation of `prompt` with the KV cache (EOS ignored) and the logits
/// `[steps, vocab]` that chose each token.
pub fn greedy_continuation(
    model: &mut MoeForCausalLm,
    prompt: &[u32],
    steps: usize,
) -> candle::Result<(Vec<u32>, Tensor)> {
    let mut rows = Vec::with_capacity(steps);
    let g = generate(
        model,
        prompt,
        steps,
        &[],
        |logits, ctx| {
            rows.push(logits.unsqueeze(0)?);
            argmax(logits, ctx)
        },
        |_| Ok(()),
    )?;
    Ok((g.tokens, Tensor::cat(&rows, 0)?))
}

/// Decodes `forced` after `prompt` with the KV cache, one token a step as in generation but
/// feeding the given tokens instead of sampling, and returns the logits `[forced.len(), vocab]`
/// of each step (row `i` saw the prompt and `forced[..i]`): the rows a full forward over the
/// prompt and `forced` gives from position `prompt.len() − 1` on.
pub fn forced_decode(
    model: &mut MoeForCausalLm,
    prompt: &[u32],
    forced: &[u32],
) -> candle::Result<Tensor> {
    let mut rows = Vec::with_capacity(forced.len());
    let g = generate(
        model,
        prompt,
        forced.len(),
        &[],
        |logits, _| {
            let token = forced[rows.len()];
            rows.push(logits.unsqueeze(0)?);
            Ok(token)
        },
        |_| Ok(()),
    )?;
    if g.tokens.len() != forced.len() {
        return Err(golden_err(format!(
            "its {}-token prompt and {} greedy tokens make {}, more than the model's context of \
             {} tokens (max_position_embeddings, which counts the last generated token) holds: \
             decoding stopped after {} of them",
            prompt.len(),
            forced.len(),
            prompt.len() + forced.len(),
            model.spec().max_position_embeddings,
            g.tokens.len(),
        ))
        .into());
    }
    Tensor::cat(&rows, 0)
}

/// Fidelity of one prompt against its golden (see the JSON of the `parity` example).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PromptParity {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Largest |Δlogit| over the prompt and the golden greedy continuation, teacher-forced.
    pub max_abs_diff: f64,
    /// Mean KL(golden ‖ ours) per position over the same rows, in nats.
    pub mean_kl: f64,
    /// Fraction of those positions whose argmax agrees with the golden's.
    pub top1_agreement: f64,
    /// Greedy tokens (with the KV cache) matching the golden before the first divergence.
    pub greedy_prefix_match: usize,
    /// Greedy tokens in the golden.
    pub greedy_steps: usize,
    /// Where the greedy tokens diverge, how far the golden preferred its token over ours at that
    /// step (its logit of its token minus its logit of ours, ≥ 0); `None` when all match.
    pub greedy_divergence_margin: Option<f64>,
    /// Largest |Δlogit| between our decode with the KV cache, fed the golden greedy tokens, and
    /// our own full forward over the same tokens ([`forced_decode`]): the KV cache, the RoPE
    /// offsets and the decode kernels against the prefill path, free of the golden's error.
    pub cache_max_abs_diff: f64,
    /// `cache_max_abs_diff` over the largest |logit| of those rows: a scale-free figure, as a
    /// real checkpoint's logits are an order of magnitude larger than the tiny fixtures'.
    pub cache_relative_diff: f64,
    /// Fraction of (MoE layer, prompt token) whose router top-k set equals the golden's; `None`
    /// when the golden has no router logits.
    pub router_agreement: Option<f64>,
}

/// The rows [`compare_prompt`] compares: the ids it runs through a model in one forward (the
/// prompt, then every greedy token but the last) and the golden logits of those rows (the
/// prompt's full forward, then each greedy step's).
pub fn compared_rows(golden: &GoldenPrompt) -> candle::Result<(Vec<u32>, Tensor)> {
    let steps = golden.greedy_ids.len();
    if steps == 0 || golden.input_ids.is_empty() {
        return Err(golden_err("a prompt needs input ids and greedy ids".into()).into());
    }
    let mut seq = golden.input_ids.clone();
    seq.extend(&golden.greedy_ids[..steps - 1]);
    let reference = Tensor::cat(
        &[
            golden.logits.clone(),
            golden.greedy_step_logits.narrow(0, 1, steps - 1)?,
        ],
        0,
    )?;
    Ok((seq, reference))
}

/// Measures `model` against one golden prompt.
///
/// Teacher-forced: the prompt followed by the golden greedy tokens (all but the last) goes
/// through the model in one full forward; its rows are compared with the golden `logits` and
/// `greedy_step_logits[1..]` (position `len − 1 + i` chose greedy token `i`). The router top-k
/// of the prompt positions comes from the same forward. Then a greedy continuation with the KV
/// cache gives `greedy_prefix_match`. A golden whose logits span another vocabulary than the
/// model's (a golden file of another model) is refused before any forward.
pub fn compare_prompt(
    model: &mut MoeForCausalLm,
    golden: &GoldenPrompt,
) -> candle::Result<PromptParity> {
    let (seq, reference) = compared_rows(golden)?;
    let (steps, len) = (golden.greedy_ids.len(), golden.input_ids.len());
    let (golden_vocab, vocab) = (golden.logits.dim(1)?, model.spec().vocab_size);
    if golden_vocab != vocab {
        return Err(golden_err(format!(
            "the golden logits are over {golden_vocab} tokens, the model's vocab_size is \
             {vocab}: the golden file is of another model"
        ))
        .into());
    }
    model.clear_kv_cache();
    let ids = Tensor::new(seq.as_slice(), model.device())?.unsqueeze(0)?;
    let (logits, routers) = model.forward_all_with_router_logits(&ids, 0)?;
    model.clear_kv_cache();
    let router_agreement = match &golden.router_logits {
        None => None,
        Some(g) => {
            let top_k: Vec<usize> = model.spec().moe_blocks().map(|(_, m)| m.top_k).collect();
            let ours = routers
                .iter()
                .map(|r| r.squeeze(0)?.narrow(0, 0, len)?.to_device(&Device::Cpu))
                .collect::<candle::Result<Vec<_>>>()?;
            Some(router_agreement(&ours, g, &top_k)?)
        }
    };
    let ours = logits.squeeze(0)?.to_device(&Device::Cpu)?;
    let agreement = logit_agreement(&ours, &reference)?;
    let forced = forced_decode(model, &golden.input_ids, &golden.greedy_ids)?;
    let full = ours.narrow(0, len - 1, steps)?;
    let cache_max_abs_diff = logit_agreement(&forced.to_device(&Device::Cpu)?, &full)?.max_abs_diff;
    let largest_logit = full
        .abs()?
        .max_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    let cache_relative_diff = cache_max_abs_diff / largest_logit.max(f64::MIN_POSITIVE);
    let (greedy, _) = greedy_continuation(model, &golden.input_ids, steps)?;
    let greedy_prefix_match = greedy
        .iter()
        .zip(&golden.greedy_ids)
        .take_while(|(a, b)| a == b)
        .count();
    // `greedy` has the golden's length (`forced_decode` proved the context holds it), so a
    // token at the first mismatch means a divergence.
    let greedy_divergence_margin = match greedy.get(greedy_prefix_match) {
        Some(&token) => {
            let row = golden.greedy_step_logits.get(greedy_prefix_match)?;
            let logit = |t: u32| -> candle::Result<f64> {
                Ok(row.get(t as usize)?.to_scalar::<f32>()? as f64)
            };
            Some(logit(golden.greedy_ids[greedy_prefix_match])? - logit(token)?)
        }
        None => None,
    };
    Ok(PromptParity {
        prompt_tokens: len,
        max_abs_diff: agreement.max_abs_diff,
        mean_kl: agreement.mean_kl,
        top1_agreement: agreement.top1,
        greedy_prefix_match,
        greedy_steps: steps,
        greedy_divergence_margin,
        cache_max_abs_diff,
        cache_relative_diff,
        router_agreement,
    })
}

/// Measures `model` against every prompt of `golden`.
pub fn compare(model: &mut MoeForCausalLm, golden: &Golden) -> candle::Result<Vec<PromptParity>> {
    golden
        .prompts
        .iter()
        .map(|p| compare_prompt(model, p))
        .collect()
}

/// Pass/fail bounds on [`PromptParity`], the verdict of the `parity` example.
///
/// The cache bound compares our decode with the KV cache, fed the golden's tokens, with our own
/// full forward over the same tokens ([`PromptParity::cache_relative_diff`]): free of the
/// golden's error, so it holds as tightly under INT4 experts as in F32, and a KV-cache or RoPE
/// offset defect breaks it whatever the backend. (A greedy divergence alone proves nothing: with
/// INT4 experts the golden's margin where greedy decoding parts from it is within the
/// teacher-forced error.)
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct ParityBounds {
    /// Largest mean KL(golden ‖ ours) of any prompt, nats.
    pub max_mean_kl: f64,
    /// Least top-1 agreement of any prompt.
    pub min_top1: f64,
    /// Least router top-k agreement of any prompt that has router logits.
    pub min_router: f64,
    /// Largest [`PromptParity::cache_relative_diff`] of any prompt.
    pub max_cache_relative_diff: f64,
}

impl ParityBounds {
    /// A dense port computed in F32 against an F32 golden: the shipped ports measure mean KL
    /// ≈ 1e-12 with every argmax and router set equal, and a cached decode within 1.4e-6 of the
    /// largest logit; 1e-6, 0.99 and 1e-4 leave room for a real checkpoint's summation-order
    /// noise and near-ties, while a wrong norm, bias, RoPE or routing rule gives KL ≫ 1e-3.
    pub const DENSE_F32: Self = Self {
        max_mean_kl: 1e-6,
        min_top1: 0.99,
        min_router: 0.99,
        max_cache_relative_diff: 1e-4,
    };

    /// Quantized experts (INT4 g128) or BF16 compute. On the random tiny fixtures, whose logit
    /// gaps are small, INT4 g128 measures top-1 0.67–0.97, mean KL 5e-3–3.0e-2 and router
    /// agreement 0.86–1.0; routing every token to the wrong experts measured top-1 0.09–0.29 and
    /// KL 0.19–0.57. The cached decode stays within 3.2e-3 of the largest logit (BF16 experts;
    /// INT4 1e-6–2.3e-3), a RoPE offset off by one position in decode gives 0.1 and more. Real
    /// checkpoints, with larger gaps, do better than these bounds.
    pub const QUANTIZED: Self = Self {
        max_mean_kl: 5e-2,
        min_top1: 0.5,
        min_router: 0.8,
        max_cache_relative_diff: 2e-2,
    };

    /// Every bound `results` break, one line each naming the prompt; empty when all pass.
    pub fn violations(&self, results: &[PromptParity]) -> Vec<String> {
        let mut out = Vec::new();
        for (p, r) in results.iter().enumerate() {
            if r.mean_kl.is_nan() || r.mean_kl > self.max_mean_kl {
                out.push(format!(
                    "prompt{p}: mean KL {:.3e} above {:.3e}",
                    r.mean_kl, self.max_mean_kl
                ));
            }
            if r.top1_agreement.is_nan() || r.top1_agreement < self.min_top1 {
                out.push(format!(
                    "prompt{p}: top-1 agreement {:.4} below {:.4}",
                    r.top1_agreement, self.min_top1
                ));
            }
            if let Some(a) = r.router_agreement {
                if a.is_nan() || a < self.min_router {
                    out.push(format!(
                        "prompt{p}: router agreement {a:.4} below {:.4}",
                        self.min_router
                    ));
                }
            }
            let cache = r.cache_relative_diff;
            if cache.is_nan() || cache > self.max_cache_relative_diff {
                out.push(format!(
                    "prompt{p}: decoding with the KV cache differs from the full forward by \
                     {cache:.3e} of the largest logit, above {:.3e}: the KV cache, the RoPE \
                     offsets or a decode kernel",
                    self.max_cache_relative_diff
                ));
            }
        }
        out
    }
}
