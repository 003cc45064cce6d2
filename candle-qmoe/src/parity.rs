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
    /// Largest |ours − reference| over all logits.
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
            max_abs = max_abs.max((x - y).abs() as f64);
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
    /// Fraction of (MoE layer, prompt token) whose router top-k set equals the golden's; `None`
    /// when the golden has no router logits.
    pub router_agreement: Option<f64>,
}

/// Measures `model` against one golden prompt.
///
/// Teacher-forced: the prompt followed by the golden greedy tokens (all but the last) goes
/// through the model in one full forward; its rows are compared with the golden `logits` and
/// `greedy_step_logits[1..]` (position `len − 1 + i` chose greedy token `i`). The router top-k
/// of the prompt positions comes from the same forward. Then a greedy continuation with the KV
/// cache gives `greedy_prefix_match`.
pub fn compare_prompt(
    model: &mut MoeForCausalLm,
    golden: &GoldenPrompt,
) -> candle::Result<PromptParity> {
    let steps = golden.greedy_ids.len();
    let len = golden.input_ids.len();
    if steps == 0 || len == 0 {
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
    model.clear_kv_cache();
    let ids = Tensor::new(seq.as_slice(), model.device())?.unsqueeze(0)?;
    let (logits, routers) = model.forward_all_with_router_logits(&ids, 0)?;
    model.clear_kv_cache();
    let agreement = logit_agreement(&logits.squeeze(0)?.to_device(&Device::Cpu)?, &reference)?;
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
    let (greedy, _) = greedy_continuation(model, &golden.input_ids, steps)?;
    let greedy_prefix_match = greedy
        .iter()
        .zip(&golden.greedy_ids)
        .take_while(|(a, b)| a == b)
        .count();
    Ok(PromptParity {
        prompt_tokens: len,
        max_abs_diff: agreement.max_abs_diff,
        mean_kl: agreement.mean_kl,
        top1_agreement: agreement.top1,
        greedy_prefix_match,
        greedy_steps: steps,
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
