//! Text generation with OLMoE or Qwen1.5-MoE whose routed experts run in INT4.
//!
//! ```text
//! # Offline, no download: a synthetic model with OLMoE-1B-7B's shapes and random weights.
//! cargo run --release --example generate -- --synthetic olmoe --cpu -n 32 --prompt "Hello"
//! # A real model from the Hugging Face hub; the expert pack is created once, then reused.
//! cargo run --release --example generate -- --model-id allenai/OLMoE-1B-7B-0924-Instruct \
//!     --pack olmoe-0924-instruct-g128.qmoe --prompt "What is a mixture of experts?"
//! ```
//!
//! Prints the completion as it is generated, then a stats line: prompt tokens and prefill rate,
//! generated tokens and decode rate ((generated − 1) / time after the first token), time to
//! first token, peak RSS. `--stats-json PATH` writes the same figures plus the generated ids.
//!
//! `--resident N|all` serves the INT4 experts through a bounded cache of N experts per layer
//! (host memory on the CPU) and adds a residency line: hits, misses, evictions, bytes copied,
//! prefetches (`--prefetch`) and misses computed on the CPU (`--hybrid auto|always`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device};
use candle_qmoe::generation::{generate, Generation, StopReason};
use candle_qmoe::pack::GroupSize;
use candle_qmoe_suite::chat::ChatArgs;
use candle_qmoe_suite::model::{output_path, sampler, Loaded, ModelArgs};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Generate text with a MoE model whose routed experts run in INT4"
)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(
        long,
        default_value = "Explain in two sentences what a mixture-of-experts model is."
    )]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    sample_len: usize,
    /// Sampling temperature; absent or 0 = greedy.
    #[arg(long)]
    temperature: Option<f64>,
    /// Nucleus sampling probability cutoff (with --temperature: greedy decoding has no nucleus).
    #[arg(long, requires = "temperature")]
    top_p: Option<f64>,
    /// Sampling seed.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// Penalty for repeating tokens (1 = none).
    #[arg(long, default_value_t = 1.1)]
    repeat_penalty: f32,
    /// Context size the repeat penalty looks back over.
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[command(flatten)]
    chat: ChatArgs,
    /// Write the stats and the generated token ids to this JSON file.
    #[arg(long, value_parser = output_path)]
    stats_json: Option<PathBuf>,
}

fn check_args(args: &Args) -> Result<()> {
    if args.prompt.trim().is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(p) = args.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        bail!("--top-p {p} must be in (0, 1]");
    }
    if let Some(t) = args.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        bail!("--temperature {t} must be a finite number ≥ 0");
    }
    if args.top_p.is_some() && args.temperature == Some(0.0) {
        bail!("--top-p needs a --temperature above 0: --temperature 0 decodes greedily");
    }
    if !(args.repeat_penalty.is_finite() && args.repeat_penalty > 0.0) {
        bail!("--repeat-penalty {} must be > 0", args.repeat_penalty);
    }
    if let Some(g) = args.model.group_size {
        GroupSize::new(g)?;
    }
    Ok(())
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    // The whole run on a thread of rayon's pool (see `on_rayon_pool`).
    candle_qmoe::pool::on_rayon_pool(move || run(args))
}

fn run(args: Args) -> Result<()> {
    check_args(&args)?;
    let device = args.model.device()?;
    let dtype = args.model.compute_dtype(&device);
    let load_average = candle_qmoe_suite::system::load_average();
    let start = Instant::now();
    let mut loaded = args.model.load(dtype, &device)?;
    let load_time = start.elapsed();
    let spec = loaded.model.spec().clone();
    println!(
        "{} ({}, revision {}): experts {:?}{}, other weights {}, dtype {dtype:?}, {:?}, \
         loaded in {:.1} s",
        loaded.model_id,
        spec.model_type,
        loaded.revision,
        args.model.experts,
        loaded
            .group_size
            .map(|g| format!(" g{g}"))
            .unwrap_or_default(),
        loaded.model.dense_weights().to_uppercase(),
        device,
        load_time.as_secs_f64()
    );

    let chat = loaded.chat(&args.chat)?;
    if let Some(chat) = &chat {
        println!("chat template: {}", chat.template.origin());
    }
    let prompt = loaded.encode(&args.prompt, chat.as_ref())?;
    let eos = loaded.stop_ids(chat.map(|c| c.template));
    let context = loaded.context();
    if prompt.len() >= context {
        bail!(
            "the prompt has {} tokens but the model's context is {context} tokens \
             (max_position_embeddings, --ctx, or what --vram-budget fitted): no room to generate",
            prompt.len()
        );
    }
    let max_new = args.sample_len.min(context - prompt.len());
    if max_new < args.sample_len {
        eprintln!("note: the context holds only {max_new} more tokens after the prompt");
    }

    println!("{}", args.prompt);
    let mut logits_processor = sampler(args.seed, args.temperature, args.top_p);
    let mut stream = loaded.tokenizer.decode_stream(true);
    let mut stdout = std::io::stdout();
    let mut generation = generate(
        &mut loaded.model,
        &prompt,
        max_new,
        &eos,
        |logits, ctx| {
            let logits = if args.repeat_penalty == 1.0 {
                logits.clone()
            } else {
                let from = ctx.len().saturating_sub(args.repeat_last_n);
                candle_transformers::utils::apply_repeat_penalty(
                    logits,
                    args.repeat_penalty,
                    &ctx[from..],
                )?
            };
            logits_processor.sample(&logits)
        },
        |token| {
            if let Some(piece) = stream.step(token).map_err(candle::Error::msg)? {
                print!("{piece}");
                stdout.flush()?;
            }
            Ok(())
        },
    )
    // An error after streamed text starts on a line of its own.
    .inspect_err(|_| println!())?;
    println!();
    // `max_new` was cut to what the context holds: reaching it means the context is full.
    if generation.stop == StopReason::MaxTokens && max_new < args.sample_len {
        generation.stop = StopReason::ContextFull;
    }
    report(
        &args,
        &loaded,
        &generation,
        dtype,
        &device,
        (load_time.as_secs_f64(), load_average),
    )
}

/// Prints the stats line and writes `--stats-json`.
fn report(
    args: &Args,
    loaded: &Loaded,
    g: &Generation,
    dtype: DType,
    device: &Device,
    (load_s, load_average): (f64, Option<[f64; 3]>),
) -> Result<()> {
    let rss = candle_qmoe_suite::system::peak_rss_bytes();
    let decode = g.decode_tokens_per_s();
    let traffic = candle_qmoe_suite::perf::traffic_json(&loaded.model, decode);
    println!(
        "stats: {} prompt tokens, {} | {} generated tokens, {} decode ({} weights per \
         token, {}) | time to first token {:.3} s | peak RSS {} | stop: {:?}",
        g.prompt_tokens,
        g.prompt_tokens_per_s()
            .map_or("n/a".to_string(), |p| format!("{p:.2} tok/s")),
        g.tokens.len(),
        decode.map_or("n/a".to_string(), |d| format!("{d:.2} tok/s")),
        candle_qmoe::plan::format_bytes(loaded.model.weight_bytes_per_token() as u64),
        traffic["gb_per_s"]
            .as_f64()
            .map_or("n/a".to_string(), |v| format!("{v:.1} GB/s")),
        g.time_to_first_token.as_secs_f64(),
        rss.map_or("n/a".to_string(), candle_qmoe::plan::format_bytes),
        g.stop
    );
    if let Some(r) = &loaded.residency {
        println!(
            "residency: {}",
            candle_qmoe_suite::model::residency_line(&r.stats(), &r.capacities())
        );
    }
    let profile = candle_qmoe_suite::perf::decode_profile_json(
        &loaded.model,
        [(
            g.decode_profile.as_ref(),
            g.prompt_tokens,
            g.tokens.len(),
            g.decode_time.as_secs_f64(),
        )],
    );
    if let Some(p) = &profile {
        println!("{}", candle_qmoe_suite::perf::profile_table(p));
    }
    if let Some(path) = &args.stats_json {
        let mut stats = json!({
            "cpu": candle_qmoe_suite::system::cpu_model(),
            "commit": candle_qmoe_suite::system::git_commit(),
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "model_id": loaded.model_id,
            "revision": loaded.revision,
            "experts": format!("{:?}", args.model.experts).to_lowercase(),
            "group_size": loaded.group_size,
            "dtype": format!("{dtype:?}").to_lowercase(),
            "device": format!("{device:?}"),
            "load_time_s": load_s,
            "prompt_tokens": g.prompt_tokens,
            "prompt_tokens_per_s": g.prompt_tokens_per_s(),
            "generated_tokens": g.tokens.len(),
            "decode_tokens_per_s": decode,
            "time_to_first_token_s": g.time_to_first_token.as_secs_f64(),
            "decode_time_s": g.decode_time.as_secs_f64(),
            "peak_rss_bytes": rss,
            "rss_anon_file_bytes_at_end": candle_qmoe_suite::system::rss_anon_file_bytes(),
            "load_average_at_start": load_average,
            "load_average_at_end": candle_qmoe_suite::system::load_average(),
            "stop_reason": g.stop,
            "seed": args.seed,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "repeat_penalty": args.repeat_penalty,
            "token_ids": g.tokens,
            "residency": candle_qmoe_suite::model::residency_json(loaded.residency.as_ref()),
        });
        stats["decode_profile"] = profile.unwrap_or(serde_json::Value::Null);
        // bytes_per_token, gb_per_s, dense_weights, activations: as bench records them.
        if let (serde_json::Value::Object(stats), serde_json::Value::Object(traffic)) =
            (&mut stats, traffic)
        {
            stats.extend(traffic);
        }
        std::fs::write(path, serde_json::to_string_pretty(&stats)? + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    Ok(())
}
