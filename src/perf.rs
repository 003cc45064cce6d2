//! The PERF-REAL benchmark contract (docs/architecture.md §6): the fixed prompt set, one
//! campaign of greedy responses with end-of-sequence suppressed, the metrics aggregated over it,
//! and the plot of a residency sweep.
//!
//! The campaign is `blocks` repetitions of the first `prompts` prompts, one request at a time,
//! each answered with exactly `sample_len` new tokens, after one warm-up response that is not
//! measured.

use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use candle::{DType, Tensor, D};
use candle_qmoe::generation::generate;
use candle_qmoe::kernels::cpu::DecodeActivations;
use candle_qmoe::models::MoeForCausalLm;
use candle_qmoe::profile::{Part, Profile};
use candle_qmoe::residency::ResidencyStats;
use serde::Serialize;

use crate::chat::ChatArgs;
use crate::model::Loaded;

/// The fixed prompt set: varied English chat requests.
pub const PROMPTS: [&str; 12] = [
    "What are the main differences between a virus and a bacterium, and why do antibiotics only \
     work against one of them?",
    "I have chicken thighs, rice, spinach and a lemon. Suggest a simple dinner recipe with \
     step-by-step instructions.",
    "Explain how a hash map works and why lookups usually take constant time.",
    "Write a short, polite email to my landlord asking when the broken heating will be repaired.",
    "What caused the fall of the Western Roman Empire? Give the three most important factors.",
    "How should a beginner train for a first 10 km run in eight weeks?",
    "Summarize the plot of Pride and Prejudice in a few sentences without spoiling the ending.",
    "What is the difference between a stock and a bond, and which is riskier for a retiree?",
    "Explain to a ten-year-old why the sky is blue during the day and red at sunset.",
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces and \
     punctuation.",
    "I keep waking up at 3 a.m. and cannot fall back asleep. What habits could help?",
    "Translate \"Where is the nearest train station, and how much is a ticket to the airport?\" \
     into French and Spanish.",
];

/// The prompt of the warm-up response (not one of the measured prompts, so the warm-up does
/// not pre-load the first measured request's experts).
pub const WARMUP_PROMPT: &str = "Give me three tips for writing clear documentation.";

/// The campaign actually run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Contract {
    /// The first `prompts` prompts of [`PROMPTS`].
    pub prompts: usize,
    /// Repetitions of the prompt set.
    pub blocks: usize,
    /// New tokens per measured response.
    pub sample_len: usize,
    /// New tokens of the warm-up response (0: none).
    pub warmup: usize,
    /// Prompt length in tokens: every prompt (warm-up included) is cut or repeated to exactly
    /// this many tokens by [`fit_prompt`] after the chat template; `None`: as written.
    pub prompt_tokens: Option<usize>,
}

impl Contract {
    /// docs/architecture.md §6: 12 prompts × 3 blocks × 128 tokens after a 64-token warm-up.
    pub const FULL: Self = Self {
        prompts: PROMPTS.len(),
        blocks: 3,
        sample_len: 128,
        warmup: 64,
        prompt_tokens: None,
    };

    /// Whether this is the full contract of docs/architecture.md §6.
    pub fn is_full(&self) -> bool {
        *self == Self::FULL
    }

    /// Refuses campaigns that cannot measure a decode rate.
    pub fn check(&self) -> Result<()> {
        if !(1..=PROMPTS.len()).contains(&self.prompts) {
            bail!("--prompts {} must be 1 to {}", self.prompts, PROMPTS.len());
        }
        if self.blocks == 0 {
            bail!("--blocks must be at least 1");
        }
        if self.sample_len < 2 {
            bail!(
                "--sample-len {} must be at least 2 (the decode rate counts the tokens after the \
                 first)",
                self.sample_len
            );
        }
        if self.prompt_tokens == Some(0) {
            bail!("--prompt-tokens must be at least 1");
        }
        Ok(())
    }

    /// Measured responses.
    pub fn responses(&self) -> usize {
        self.prompts * self.blocks
    }

    /// Tokens generated in all, warm-up included (for a progress bar).
    pub fn total_tokens(&self) -> u64 {
        (self.responses() * self.sample_len + self.warmup) as u64
    }
}

/// One measured response.
#[derive(Clone, Debug, Serialize)]
pub struct Response {
    /// Index into [`PROMPTS`].
    pub prompt: usize,
    /// Repetition of the prompt set.
    pub block: usize,
    /// Tokens of the prompt (chat template included).
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Request start to the first token.
    pub ttft_s: f64,
    /// First token to the last one.
    pub decode_s: f64,
    /// The whole request.
    pub response_s: f64,
    /// The generated ids.
    #[serde(skip)]
    pub tokens: Vec<u32>,
    /// Where the decode time went, with `--profile`.
    #[serde(skip)]
    pub decode_profile: Option<Profile>,
}

/// The memory traffic of decode for the evidence files: `bytes_per_token` (the weight bytes
/// one decoded token reads, [`MoeForCausalLm::weight_bytes_per_token`]), the achieved
/// `gb_per_s` at `decode_tokens_per_s`, and the dtypes the non-expert weights
/// (`dense_weights`) and activations ran in, and the INT4 experts' decode activations on the
/// CPU (`decode_acts`, [`DecodeActivations::current`]).
pub fn traffic_json(model: &MoeForCausalLm, decode_tokens_per_s: Option<f64>) -> serde_json::Value {
    let bytes = model.weight_bytes_per_token();
    serde_json::json!({
        "bytes_per_token": bytes,
        "gb_per_s": decode_tokens_per_s.map(|r| r * bytes as f64 / 1e9),
        "dense_weights": model.dense_weights(),
        "activations": format!("{:?}", model.activation_dtype()).to_lowercase(),
        "decode_acts": DecodeActivations::current().name(),
    })
}

/// Where decoding's time went (`--profile`): per part of the forward pass its milliseconds,
/// calls and bytes per decoded token (its weights; for the attention also the KV cache it reads
/// at `mean_context` positions), its share of the decode time and the bandwidth it reached (not
/// for the norms and residuals, whose traffic is activations); `other_ms_per_token` is the
/// decode time outside the parts. `decoded` counts the forward passes of decoding (generated
/// tokens − 1 per response), `decode_s` their time.
pub fn profile_json(
    model: &MoeForCausalLm,
    profile: &Profile,
    decoded: usize,
    decode_s: f64,
    mean_context: f64,
) -> serde_json::Value {
    let n = decoded.max(1) as f64;
    let weights = model.weight_bytes_by_part();
    let kv_bytes = model.kv_bytes_per_position() as f64 * mean_context;
    let parts: Vec<_> = profile
        .parts()
        .map(|(part, time, calls)| {
            let s = time.as_secs_f64() / n;
            let w = weights
                .iter()
                .find(|(p, _)| *p == part)
                .map_or(0, |(_, b)| *b);
            let kv = (part == Part::Attention).then_some(kv_bytes);
            let bytes = w as f64 + kv.unwrap_or(0.0);
            serde_json::json!({
                "part": part.name(),
                "ms_per_token": 1e3 * s,
                "share_of_decode": s * n / decode_s,
                "calls_per_token": calls as f64 / n,
                "weight_bytes_per_token": w,
                "kv_bytes_per_token": kv,
                "gb_per_s": (part != Part::NormsAndResiduals && bytes > 0.0 && s > 0.0)
                    .then(|| bytes / s / 1e9),
            })
        })
        .collect();
    serde_json::json!({
        "decoded_tokens": decoded,
        "mean_context": mean_context,
        "ms_per_token": 1e3 * decode_s / n,
        "other_ms_per_token": 1e3 * (decode_s - profile.total().as_secs_f64()) / n,
        "parts": parts,
    })
}

/// [`profile_json`] over the decoding of several responses, each given as its profile, prompt
/// tokens, generated tokens and decode seconds; `None` when one of them was not profiled.
pub fn decode_profile_json<'a>(
    model: &MoeForCausalLm,
    responses: impl IntoIterator<Item = (Option<&'a Profile>, usize, usize, f64)>,
) -> Option<serde_json::Value> {
    let (mut total, mut decoded, mut decode_s, mut context) = (Profile::default(), 0, 0.0, 0.0);
    for (profile, prompt, generated, secs) in responses {
        let n = generated.saturating_sub(1);
        total = total.plus(profile?);
        decoded += n;
        decode_s += secs;
        context += n as f64 * mean_decode_context(prompt, generated);
    }
    let mean_context = context / decoded.max(1) as f64;
    Some(profile_json(model, &total, decoded, decode_s, mean_context))
}

/// The mean number of positions a decoded token attends over when `generated` tokens follow a
/// prompt of `prompt` tokens: decoding step `t` (1 to `generated − 1`) attends over
/// `prompt + t`.
pub fn mean_decode_context(prompt: usize, generated: usize) -> f64 {
    prompt as f64 + generated as f64 / 2.0
}

/// [`profile_json`] as a table for the terminal.
pub fn profile_table(profile: &serde_json::Value) -> String {
    let mut out = format!(
        "{:<20} {:>9} {:>7} {:>12} {:>8}\n",
        "decode profile", "ms/token", "share", "bytes/tok", "GB/s"
    );
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    for p in profile["parts"].as_array().into_iter().flatten() {
        let bytes = p["weight_bytes_per_token"].as_u64().unwrap_or(0)
            + p["kv_bytes_per_token"].as_f64().unwrap_or(0.0) as u64;
        out += &format!(
            "{:<20} {:>9.3} {:>6.1}% {:>12} {:>8}\n",
            p["part"].as_str().unwrap_or("?"),
            f(p, "ms_per_token"),
            100.0 * f(p, "share_of_decode"),
            candle_qmoe::plan::format_bytes(bytes),
            p["gb_per_s"]
                .as_f64()
                .map_or("-".into(), |g| format!("{g:.1}")),
        );
    }
    out += &format!(
        "{:<20} {:>9.3}\n{:<20} {:>9.3}",
        "other",
        f(profile, "other_ms_per_token"),
        "total",
        f(profile, "ms_per_token")
    );
    out
}

/// `ids` repeated and cut to exactly `n` tokens (a fixed prompt length, as llama.cpp's
/// `llama-bench -p N` uses); empty when `ids` is.
pub fn fit_prompt(ids: &[u32], n: usize) -> Vec<u32> {
    ids.iter().copied().cycle().take(n).collect()
}

/// Decode rate over `responses`: Σ(generated − 1) / Σ(decode time after the first token),
/// time-weighted; `None` when nothing was decoded.
pub fn decode_rate<'a>(responses: impl IntoIterator<Item = &'a Response>) -> Option<f64> {
    let (tokens, secs) = responses.into_iter().fold((0usize, 0.0f64), |(n, t), r| {
        (n + r.generated.saturating_sub(1), t + r.decode_s)
    });
    (tokens > 0 && secs > 0.0).then(|| tokens as f64 / secs)
}

/// (max − min) / mean of `rates`; `None` when empty or the mean is not positive.
pub fn relative_spread(rates: &[f64]) -> Option<f64> {
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    let max = rates.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let min = rates.iter().copied().fold(f64::INFINITY, f64::min);
    (!rates.is_empty() && mean > 0.0).then(|| (max - min) / mean)
}

/// The median of `v` (the upper one of an even count), sorting `v` in place; NaN for an empty
/// slice.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn mean(values: impl ExactSizeIterator<Item = f64>) -> Option<f64> {
    let n = values.len();
    (n > 0).then(|| values.sum::<f64>() / n as f64)
}

/// The figures of one campaign, aggregated over its measured responses.
#[derive(Clone, Debug, Serialize)]
pub struct Metrics {
    /// Measured responses.
    pub responses: usize,
    /// Tokens generated over the measured responses.
    pub generated_tokens: usize,
    /// [`decode_rate`] over every measured response.
    pub decode_tokens_per_s: Option<f64>,
    /// [`decode_rate`] of each block.
    pub block_decode_tokens_per_s: Vec<Option<f64>>,
    /// [`relative_spread`] of the block rates (`None` if one is unknown).
    pub block_spread: Option<f64>,
    /// Mean time to first token.
    pub ttft_mean_s: Option<f64>,
    /// Mean time of a whole request.
    pub response_time_mean_s: Option<f64>,
    /// Σ prompt tokens / Σ time to first token.
    pub prefill_tokens_per_s: Option<f64>,
    /// Per prompt: whether every block generated the same tokens.
    pub identical_across_blocks: Vec<bool>,
}

impl Metrics {
    /// Aggregates `responses` (blocks and prompts are numbered from 0).
    pub fn new(responses: &[Response]) -> Self {
        let blocks = responses.iter().map(|r| r.block + 1).max().unwrap_or(0);
        let prompts = responses.iter().map(|r| r.prompt + 1).max().unwrap_or(0);
        let block_rates: Vec<Option<f64>> = (0..blocks)
            .map(|b| decode_rate(responses.iter().filter(|r| r.block == b)))
            .collect();
        let block_spread = block_rates
            .iter()
            .copied()
            .collect::<Option<Vec<f64>>>()
            .and_then(|rates| relative_spread(&rates));
        let identical_across_blocks = (0..prompts)
            .map(|p| {
                let mut runs = responses.iter().filter(|r| r.prompt == p);
                let first = runs.next().map(|r| &r.tokens);
                runs.all(|r| Some(&r.tokens) == first)
            })
            .collect();
        let prompt_tokens: usize = responses.iter().map(|r| r.prompt_tokens).sum();
        let ttft_total: f64 = responses.iter().map(|r| r.ttft_s).sum();
        Self {
            responses: responses.len(),
            generated_tokens: responses.iter().map(|r| r.generated).sum(),
            decode_tokens_per_s: decode_rate(responses),
            block_decode_tokens_per_s: block_rates,
            block_spread,
            ttft_mean_s: mean(responses.iter().map(|r| r.ttft_s)),
            response_time_mean_s: mean(responses.iter().map(|r| r.response_s)),
            prefill_tokens_per_s: (ttft_total > 0.0).then(|| prompt_tokens as f64 / ttft_total),
            identical_across_blocks,
        }
    }

    /// Whether every prompt generated the same tokens in every block.
    pub fn all_identical(&self) -> bool {
        self.identical_across_blocks.iter().all(|&same| same)
    }
}

/// An additive logits mask over `vocab` ids: `-inf` at `suppressed` ids (those outside the
/// vocabulary are ignored), 0 elsewhere.
pub fn suppression_mask(vocab: usize, suppressed: &[u32]) -> Vec<f32> {
    let mut mask = vec![0.0; vocab];
    for &id in suppressed {
        if let Some(m) = mask.get_mut(id as usize) {
            *m = f32::NEG_INFINITY;
        }
    }
    mask
}

/// What one campaign measured.
pub struct Campaign {
    /// The measured responses, block by block.
    pub responses: Vec<Response>,
    /// Expert-cache counters of the measured responses only (warm-up excluded).
    pub residency: Option<ResidencyStats>,
    /// Where the chat template the prompts went through came from, if any.
    pub template: Option<String>,
    /// Token ids that were never sampled (end-of-sequence and template stop tokens).
    pub suppressed: Vec<u32>,
}

impl Campaign {
    /// [`decode_profile_json`] over the measured responses, with `--profile`.
    pub fn decode_profile_json(&self, model: &MoeForCausalLm) -> Option<serde_json::Value> {
        decode_profile_json(
            model,
            self.responses.iter().map(|r| {
                let p = r.decode_profile.as_ref();
                (p, r.prompt_tokens, r.generated, r.decode_s)
            }),
        )
    }
}

/// Runs `contract` on `loaded`: greedy, end-of-sequence suppressed, one request at a time; the
/// chat template is applied as `generate` applies it (Instruct/Chat and synthetic models).
/// `on_token` is called after every generated token, warm-up included.
pub fn run_campaign(
    loaded: &mut Loaded,
    contract: &Contract,
    mut on_token: impl FnMut(),
) -> Result<Campaign> {
    contract.check()?;
    let spec = loaded.model.spec().clone();
    let chat = loaded.chat(&ChatArgs::default())?;
    let template = chat.as_ref().map(|c| c.template.origin().to_string());
    // End-of-sequence and the template's stop tokens are never sampled, template or not.
    let suppressed = loaded.stop_ids(loaded.chat_template.as_ref());
    let mask = Tensor::from_vec(
        suppression_mask(spec.vocab_size, &suppressed),
        spec.vocab_size,
        loaded.model.device(),
    )?;
    let greedy = |logits: &Tensor, _: &[u32]| {
        (logits.to_dtype(DType::F32)? + &mask)?
            .argmax(D::Minus1)?
            .to_scalar::<u32>()
    };
    let context = loaded.context();
    let encode = |prompt: &str, new_tokens: usize| -> Result<Vec<u32>> {
        let mut ids = loaded.encode(prompt, chat.as_ref())?;
        if let Some(n) = contract.prompt_tokens {
            ids = fit_prompt(&ids, n);
        }
        if ids.len() + new_tokens > context {
            bail!(
                "a prompt of {} tokens plus {new_tokens} new tokens exceeds the model's context \
                 of {context} tokens",
                ids.len()
            );
        }
        Ok(ids)
    };
    let prompts = PROMPTS[..contract.prompts]
        .iter()
        .map(|p| encode(p, contract.sample_len))
        .collect::<Result<Vec<_>>>()?;
    if contract.warmup > 0 {
        let ids = encode(WARMUP_PROMPT, contract.warmup)?;
        generate(
            &mut loaded.model,
            &ids,
            contract.warmup,
            &[],
            greedy,
            |_| {
                on_token();
                Ok(())
            },
        )
        .context("warm-up response")?;
    }
    let before = loaded.residency.as_ref().map(|r| r.stats());
    let mut responses = Vec::with_capacity(contract.responses());
    for block in 0..contract.blocks {
        for (prompt, ids) in prompts.iter().enumerate() {
            let start = Instant::now();
            let g = generate(
                &mut loaded.model,
                ids,
                contract.sample_len,
                &[],
                greedy,
                |_| {
                    on_token();
                    Ok(())
                },
            )
            .with_context(|| format!("prompt {prompt}, block {block}"))?;
            let response_s = start.elapsed().as_secs_f64();
            if g.tokens.len() != contract.sample_len {
                bail!(
                    "prompt {prompt}, block {block}: {} tokens generated instead of {} ({:?})",
                    g.tokens.len(),
                    contract.sample_len,
                    g.stop
                );
            }
            responses.push(Response {
                prompt,
                block,
                prompt_tokens: g.prompt_tokens,
                generated: g.tokens.len(),
                ttft_s: g.time_to_first_token.as_secs_f64(),
                decode_s: g.decode_time.as_secs_f64(),
                response_s,
                tokens: g.tokens,
                decode_profile: g.decode_profile,
            });
        }
    }
    let residency = loaded
        .residency
        .as_ref()
        .zip(before)
        .map(|(r, before)| r.stats().since(&before));
    Ok(Campaign {
        responses,
        residency,
        template,
        suppressed,
    })
}

/// `secs` since the Unix epoch as an RFC 3339 UTC time (`2025-01-31T12:00:00Z`).
pub fn rfc3339_utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The current time as RFC 3339 UTC.
pub fn now_rfc3339() -> Result<String> {
    Ok(rfc3339_utc(
        SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs(),
    ))
}

/// One run of a residency sweep, for [`plot_sweep`].
#[derive(Clone, Copy, Debug)]
pub struct SweepPoint {
    /// Resident experts per MoE layer.
    pub resident: f64,
    /// Decode rate of the run.
    pub decode_tokens_per_s: f64,
    /// Bytes copied host → device over the measured responses, in GB (10⁹).
    pub h2d_gb: f64,
}

/// Axis label of the sweep plot's x axis.
pub const X_LABEL: &str = "resident experts per layer";
/// Axis label of the decode-rate panel.
pub const DECODE_LABEL: &str = "decode tokens/s";
/// Axis label of the H2D panel.
pub const H2D_LABEL: &str = "host-to-device GB (measured responses)";

/// Writes an SVG with two panels against resident experts per layer: decode tokens/s (with the
/// `baseline` rate as a horizontal line when given) and H2D GB. Text is left to the SVG viewer,
/// so no font library is needed.
pub fn plot_sweep(
    path: &Path,
    title: &str,
    points: &[SweepPoint],
    baseline: Option<(&str, f64)>,
) -> Result<()> {
    use plotters::prelude::*;

    if points.is_empty() {
        bail!("no sweep points to plot");
    }
    let top = |v: f64| if v > 0.0 { v * 1.15 } else { 1.0 };
    let x_max = top(points.iter().map(|p| p.resident).fold(0.0, f64::max));
    let decode_max = points
        .iter()
        .map(|p| p.decode_tokens_per_s)
        .chain(baseline.map(|b| b.1))
        .fold(0.0, f64::max);
    let h2d_max = points.iter().map(|p| p.h2d_gb).fold(0.0, f64::max);

    let root = SVGBackend::new(path, (900, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 20))?;
    let (upper, lower) = root.split_vertically(400);
    let panels = [
        (upper, DECODE_LABEL, top(decode_max), BLUE),
        (lower, H2D_LABEL, top(h2d_max), RED),
    ];
    for (i, (area, y_label, y_max, color)) in panels.into_iter().enumerate() {
        let y = |p: &SweepPoint| {
            if i == 0 {
                p.decode_tokens_per_s
            } else {
                p.h2d_gb
            }
        };
        let mut chart = ChartBuilder::on(&area)
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart
            .configure_mesh()
            .x_desc(X_LABEL)
            .x_label_formatter(&|x| {
                let digits = if (x - x.round()).abs() < 1e-9 { 0 } else { 1 };
                format!("{x:.digits$}")
            })
            .y_desc(y_label)
            .axis_desc_style(("sans-serif", 16))
            .draw()?;
        let xy: Vec<(f64, f64)> = points.iter().map(|p| (p.resident, y(p))).collect();
        chart
            .draw_series(LineSeries::new(xy.iter().copied(), color.stroke_width(2)))?
            .label(if i == 0 { "INT4" } else { "H2D" })
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
        chart.draw_series(
            xy.iter()
                .map(|&(px, py)| Circle::new((px, py), 4, color.filled())),
        )?;
        if let Some((label, rate)) = baseline.filter(|_| i == 0) {
            chart
                .draw_series(LineSeries::new(
                    [(0.0, rate), (x_max, rate)],
                    BLACK.stroke_width(1),
                ))?
                .label(label)
                .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
    }
    root.present()
        .with_context(|| format!("cannot write `{}`", path.display()))?;
    Ok(())
}
