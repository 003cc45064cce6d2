//! PERF-REAL (docs/architecture.md §6): the fixed benchmark campaign on any model, backend and
//! residency, recorded in a JSON evidence file.
//!
//! ```text
//! # The full contract (12 prompts × 3 blocks × 128 tokens after a 64-token warm-up).
//! cargo run --release --example bench -- --model-id allenai/OLMoE-1B-7B-0924-Instruct \
//!     --pack olmoe-0924-instruct-g128.qmoe
//! # Offline, shrunk for a small CPU: a residency sweep with its plot and the dense BF16 baseline.
//! cargo run --release --example bench -- --synthetic olmoe --cpu --sweep 8,16,32,64 \
//!     --prompts 2 --blocks 2 -n 32 --warmup 16 --baseline
//! ```
//!
//! Every response is greedy with end-of-sequence and the chat template's stop tokens
//! suppressed, so each one has exactly `--sample-len` tokens; one request at a time. The decode
//! rate is Σ(generated − 1) / Σ(decode time after the first token) over all measured responses.
//!
//! The JSON (`--json`, default under `bench/results/`) holds the model id and revision, backend,
//! group size, residency, device, driver, commit, date, command line, the contract used, and
//! per run the decode rate, per-block rates and their spread, TTFT and response-time means,
//! prefill rate, peak RSS and device memory, the expert-cache counters of the measured responses
//! (H2D bytes, hits, misses, …) and whether the tokens were identical across blocks. Unknown
//! figures are `null`.
//!
//! `--sweep 8,16,32,all` runs the contract once per residency (the model rebuilt each time) and
//! plots decode tokens/s and H2D GB against resident experts per layer (an SVG next to the
//! JSON). `--baseline` also runs the contract with dense BF16 experts and reports the ratios.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle::{DType, Device};
use candle_qmoe::residency::Resident;
use candle_qmoe_suite::model::{output_path, parse_arg, Experts, ModelArgs};
use candle_qmoe_suite::perf::{
    run_campaign, Contract, Metrics, SweepPoint, PROMPTS, WARMUP_PROMPT,
};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "PERF-REAL: decode rate, TTFT and memory of a MoE model over a fixed campaign"
)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Measured prompts: the first N of the 12 fixed prompts.
    #[arg(long, default_value_t = Contract::FULL.prompts)]
    prompts: usize,
    /// Repetitions of the prompt set.
    #[arg(long, default_value_t = Contract::FULL.blocks)]
    blocks: usize,
    /// New tokens per measured response (end-of-sequence is suppressed).
    #[arg(short = 'n', long, default_value_t = Contract::FULL.sample_len)]
    sample_len: usize,
    /// New tokens of the unmeasured warm-up response (0: none).
    #[arg(long, default_value_t = Contract::FULL.warmup)]
    warmup: usize,
    /// Cut or repeat every templated prompt to exactly N tokens (as `llama-bench -p N`).
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// Run the contract once per residency (comma-separated: numbers of experts per layer or
    /// `all`), rebuilding the model each time, and plot the sweep.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_arg::<Resident>,
        conflicts_with_all = ["resident", "vram_budget"]
    )]
    sweep: Vec<Resident>,
    /// Also run the contract with dense BF16 experts and report int4/baseline ratios.
    #[arg(long)]
    baseline: bool,
    /// The JSON evidence file (default: under bench/results/, named after model, backend and
    /// device); a sweep's plot is written next to it (.svg).
    #[arg(long, value_parser = output_path)]
    json: Option<PathBuf>,
}

/// What the summary table and the ratios need from one run, plus its JSON.
struct Run {
    label: String,
    resident_per_layer: Option<Vec<usize>>,
    metrics: Metrics,
    h2d_bytes: Option<u64>,
    hit_rate: Option<f64>,
    peak_rss: Option<u64>,
    tokens: Vec<Vec<u32>>,
    json: Value,
}

fn lower(v: impl std::fmt::Debug) -> String {
    format!("{v:?}").to_lowercase()
}

/// Builds the model of `args`, runs `contract` on it and gathers the run's figures.
/// `rss_valid`: whether the process peak RSS can be attributed to this run.
fn run_one(
    label: &str,
    args: &ModelArgs,
    contract: &Contract,
    device: &Device,
    dtype: DType,
    rss_valid: bool,
) -> Result<Run> {
    println!("== {label}");
    let start = Instant::now();
    let mut loaded = args
        .load(dtype, device)
        .with_context(|| format!("cannot build the model of run `{label}`"))?;
    let load_s = start.elapsed().as_secs_f64();
    let bar = ProgressBar::new(contract.total_tokens()).with_style(ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} tokens ({per_sec}, {eta} left)",
    )?);
    bar.set_message(label.to_string());
    let campaign = run_campaign(&mut loaded, contract, || bar.inc(1))
        .with_context(|| format!("run `{label}`"))?;
    bar.finish();
    let metrics = Metrics::new(&campaign.responses);
    let peak_rss = candle_qmoe_suite::system::peak_rss_bytes().filter(|_| rss_valid);

    let mut residency = candle_qmoe_suite::model::residency_json(loaded.residency.as_ref());
    if let (Some(r), Some(delta)) = (&loaded.residency, &campaign.residency) {
        if let Value::Object(counters) = serde_json::to_value(delta)? {
            for (k, v) in counters {
                residency[k] = v;
            }
        }
        residency["hit_rate"] = json!(delta.hit_rate());
        // The start-up fill happens before the measured responses: reported whole.
        residency["preload_bytes"] = json!(r.stats().preload_bytes);
        residency["counters_cover"] = json!("measured responses only (warm-up excluded)");
    }
    let resident_per_layer = loaded.residency.as_ref().map(|r| r.capacities());
    let peak_device = loaded.residency.as_ref().map(|r| r.peak_device_bytes());
    let tokens: Vec<Vec<u32>> = campaign
        .responses
        .iter()
        .map(|r| r.tokens.clone())
        .collect();
    let mut run = serde_json::to_value(&metrics)?;
    let fields = json!({
        "label": label,
        "model_id": loaded.model_id,
        "revision": loaded.revision,
        "backend": {
            "experts": lower(args.experts),
            "dtype": lower(dtype),
            "device": if device.is_cuda() { "cuda" } else { "cpu" },
        },
        "group_size": loaded.group_size,
        "resident_per_layer": resident_per_layer,
        "residency": residency,
        "chat_template": campaign.template,
        "suppressed_token_ids": campaign.suppressed,
        "load_time_s": load_s,
        "identical_across_blocks_all": metrics.all_identical(),
        "peak_rss_bytes": peak_rss,
        "peak_device_bytes": peak_device,
        "peak_device_bytes_covers": peak_device.map(|_| {
            if device.is_cuda() {
                "expert caches and staging"
            } else {
                "expert caches and staging (host memory standing in for device memory)"
            }
        }),
        "h2d_bytes": residency["h2d_bytes"],
        "hit_rate": residency["hit_rate"],
        "responses_detail": campaign.responses,
        "token_ids_block0": campaign.responses.iter().filter(|r| r.block == 0)
            .map(|r| &r.tokens).collect::<Vec<_>>(),
    });
    let mut traffic =
        candle_qmoe_suite::perf::traffic_json(&loaded.model, metrics.decode_tokens_per_s);
    let profile = campaign.decode_profile_json(&loaded.model);
    traffic["decode_profile"] = profile.clone().unwrap_or(Value::Null);
    for fields in [fields, traffic.clone()] {
        if let (Value::Object(run), Value::Object(fields)) = (&mut run, fields) {
            run.extend(fields);
        }
    }
    let d = &metrics;
    println!(
        "{label}: decode {} ({} weights/token, {}) | block spread {} | TTFT {} | prefill {} | \
         peak RSS {}{}",
        fmt_opt(d.decode_tokens_per_s, |v| format!("{v:.2} tok/s")),
        candle_qmoe::plan::format_bytes(loaded.model.weight_bytes_per_token() as u64),
        fmt_opt(traffic["gb_per_s"].as_f64(), |v| format!("{v:.1} GB/s")),
        fmt_opt(d.block_spread, |v| format!("{:.1}%", 100.0 * v)),
        fmt_opt(d.ttft_mean_s, |v| format!("{v:.3} s")),
        fmt_opt(d.prefill_tokens_per_s, |v| format!("{v:.1} tok/s")),
        fmt_opt(peak_rss, candle_qmoe::plan::format_bytes),
        loaded.residency.as_ref().map_or(String::new(), |r| format!(
            "\n  residency: {}",
            candle_qmoe_suite::model::residency_line(
                campaign.residency.as_ref().unwrap_or(&r.stats()),
                &r.capacities()
            )
        )),
    );
    if let Some(p) = &profile {
        println!("{}", candle_qmoe_suite::perf::profile_table(p));
    }
    Ok(Run {
        label: label.to_string(),
        resident_per_layer: loaded.residency.as_ref().map(|r| r.capacities()),
        h2d_bytes: campaign.residency.as_ref().map(|s| s.h2d_bytes),
        hit_rate: campaign.residency.as_ref().and_then(|s| s.hit_rate()),
        metrics,
        peak_rss,
        tokens,
        json: run,
    })
}

fn fmt_opt<T>(v: Option<T>, f: impl FnOnce(T) -> String) -> String {
    v.map_or_else(|| "n/a".to_string(), f)
}

/// `a / b` when both are known and `b > 0`.
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.zip(b).filter(|(_, b)| *b > 0.0).map(|(a, b)| a / b)
}

/// A lower-case file-name part: runs of other characters become one `-`.
fn slug(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_string()
}

/// `bench/results/bench-<model>-<experts>-<device>[-r<resident>|-sweep][-baseline].json`.
fn default_json_path(args: &Args, device: &Device) -> PathBuf {
    let m = &args.model;
    let model = match (&m.synthetic, &m.model_dir) {
        (Some(kind), _) => format!("synthetic-{kind}"),
        (None, Some(dir)) => dir
            .file_name()
            .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into()),
        (None, None) => m.model_id.clone(),
    };
    let mut name = format!(
        "bench-{}-{}-{}",
        slug(&model),
        lower(m.experts),
        if device.is_cuda() { "cuda" } else { "cpu" }
    );
    if !args.sweep.is_empty() {
        name.push_str("-sweep");
    } else if let Some(r) = &m.resident {
        name.push_str(&format!("-r{}", slug(&resident_label(r))));
    } else if let Some(b) = m.vram_budget {
        name.push_str(&format!(
            "-budget{}",
            slug(&candle_qmoe::plan::format_bytes(b))
        ));
    }
    if args.baseline {
        name.push_str("-baseline");
    }
    Path::new("bench/results").join(name + ".json")
}

fn resident_label(r: &Resident) -> String {
    match r {
        Resident::All => "all".into(),
        Resident::Uniform(n) => n.to_string(),
        Resident::PerLayer(v) => v
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// `min..max` of per-layer capacities, or `-` without a cache.
fn capacity_label(caps: Option<&[usize]>) -> String {
    match caps.and_then(|c| c.iter().min().zip(c.iter().max())) {
        Some((lo, hi)) if lo == hi => lo.to_string(),
        Some((lo, hi)) => format!("{lo}..{hi}"),
        None => "-".into(),
    }
}

fn print_table(runs: &[&Run]) {
    println!();
    println!(
        "{:<26} {:>9} {:>12} {:>7} {:>8} {:>8} {:>8} {:>11}",
        "run", "resident", "decode tok/s", "spread", "TTFT s", "H2D GB", "hit rate", "peak RSS"
    );
    for r in runs {
        let m = &r.metrics;
        println!(
            "{:<26} {:>9} {:>12} {:>7} {:>8} {:>8} {:>8} {:>11}",
            r.label,
            capacity_label(r.resident_per_layer.as_deref()),
            fmt_opt(m.decode_tokens_per_s, |v| format!("{v:.2}")),
            fmt_opt(m.block_spread, |v| format!("{:.1}%", 100.0 * v)),
            fmt_opt(m.ttft_mean_s, |v| format!("{v:.3}")),
            fmt_opt(r.h2d_bytes, |v| format!("{:.3}", v as f64 / 1e9)),
            fmt_opt(r.hit_rate, |v| format!("{:.1}%", 100.0 * v)),
            fmt_opt(r.peak_rss, candle_qmoe::plan::format_bytes),
        );
    }
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    // The whole run on a thread of rayon's pool (see `on_rayon_pool`).
    candle_qmoe::pool::on_rayon_pool(move || run(args))
}

fn run(args: Args) -> Result<()> {
    let contract = Contract {
        prompts: args.prompts,
        blocks: args.blocks,
        sample_len: args.sample_len,
        warmup: args.warmup,
        prompt_tokens: args.prompt_tokens,
    };
    contract.check()?;
    let device = args.model.device()?;
    let dtype = args.model.compute_dtype(&device);
    let json_path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path(&args, &device));
    let date = candle_qmoe_suite::perf::now_rfc3339()?;

    // The INT4 runs: one per sweep residency, or the model as given.
    let mut plans: Vec<(String, ModelArgs)> = Vec::new();
    for r in &args.sweep {
        let mut m = args.model.clone();
        m.resident = Some(r.clone());
        plans.push((format!("{} r{}", lower(m.experts), resident_label(r)), m));
    }
    if plans.is_empty() {
        let label = match &args.model.resident {
            Some(r) => format!("{} r{}", lower(args.model.experts), resident_label(r)),
            None => lower(args.model.experts),
        };
        plans.push((label, args.model.clone()));
    }
    let mut runs = Vec::new();
    for (i, (label, m)) in plans.iter().enumerate() {
        let reset = candle_qmoe_suite::system::reset_peak_rss();
        runs.push(run_one(
            label,
            m,
            &contract,
            &device,
            dtype,
            reset || i == 0,
        )?);
    }
    let mut baseline = if args.baseline {
        let mut m = args.model.clone();
        m.experts = Experts::Bf16;
        m.group_size = None;
        m.resident = None;
        m.prefetch = false;
        m.pack = None;
        let reset = candle_qmoe_suite::system::reset_peak_rss();
        Some(run_one(
            "baseline bf16",
            &m,
            &contract,
            &device,
            dtype,
            reset,
        )?)
    } else {
        None
    };

    // Token identity against the first run (the residency must not change the output).
    let first_tokens = runs[0].tokens.clone();
    for r in runs.iter_mut().skip(1).chain(baseline.as_mut()) {
        r.json["same_tokens_as_first_run"] = json!(r.tokens == first_tokens);
    }
    let ratios = baseline.as_ref().map(|b| {
        runs.iter()
            .map(|r| {
                json!({
                    "run": r.label,
                    "decode_tokens_per_s": ratio(r.metrics.decode_tokens_per_s, b.metrics.decode_tokens_per_s),
                    "ttft_mean_s": ratio(r.metrics.ttft_mean_s, b.metrics.ttft_mean_s),
                    "peak_rss_bytes": ratio(r.peak_rss.map(|v| v as f64), b.peak_rss.map(|v| v as f64)),
                })
            })
            .collect::<Vec<_>>()
    });
    let mut notes = vec![
        "decode rate = sum(generated - 1) / sum(decode time after the first token) over the \
         measured responses; per-block rates likewise; spread = (max - min) / mean of the block \
         rates"
            .to_string(),
        "residency counters, H2D bytes and hit rate cover the measured responses only; \
         preload_bytes is the start-up fill"
            .to_string(),
    ];
    if !contract.is_full() {
        notes.push(format!(
            "shrunk campaign: {} prompts x {} blocks x {} tokens after a {}-token warm-up, not \
             the full 12 x 3 x 128 after 64",
            contract.prompts, contract.blocks, contract.sample_len, contract.warmup
        ));
    }
    if let Some(n) = contract.prompt_tokens {
        notes.push(format!(
            "every templated prompt cut or repeated to exactly {n} tokens (--prompt-tokens)"
        ));
    }
    if args.baseline {
        notes.push(
            "Candle's own fused MoE is not one of this project's backends: no second baseline \
             (null)"
                .to_string(),
        );
    }
    let doc = json!({
        "schema": "candle-qmoe/perf-real/1",
        "date": date,
        "commit": candle_qmoe_suite::system::git_commit(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "device": candle_qmoe_suite::system::device_json(&device),
        "model_id": runs[0].json["model_id"],
        "revision": runs[0].json["revision"],
        "backend": runs[0].json["backend"],
        "group_size": runs[0].json["group_size"],
        "contract": {
            "prompts": contract.prompts,
            "blocks": contract.blocks,
            "sample_len": contract.sample_len,
            "warmup": contract.warmup,
            "prompt_tokens": contract.prompt_tokens,
            "measured_responses": contract.responses(),
            "greedy": true,
            "eos_suppressed": true,
            "concurrency": 1,
        },
        "full_contract": contract.is_full(),
        "prompts": &PROMPTS[..contract.prompts],
        "warmup_prompt": WARMUP_PROMPT,
        "sweep": (!args.sweep.is_empty())
            .then(|| args.sweep.iter().map(resident_label).collect::<Vec<_>>()),
        "runs": runs.iter().map(|r| &r.json).collect::<Vec<_>>(),
        "baseline": baseline.as_ref().map(|b| &b.json),
        "ratios_vs_baseline": ratios,
        "candle_fused_moe_baseline": null,
        "notes": notes,
    });
    if let Some(dir) = json_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create `{}`", dir.display()))?;
    }
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("cannot write `{}`", json_path.display()))?;

    let mut table: Vec<&Run> = runs.iter().collect();
    table.extend(baseline.as_ref());
    print_table(&table);
    println!("\nwrote {}", json_path.display());
    if !args.sweep.is_empty() {
        let points: Vec<SweepPoint> = runs
            .iter()
            .filter_map(|r| {
                let caps = r.resident_per_layer.as_ref().filter(|c| !c.is_empty())?;
                Some(SweepPoint {
                    resident: caps.iter().sum::<usize>() as f64 / caps.len() as f64,
                    decode_tokens_per_s: r.metrics.decode_tokens_per_s?,
                    h2d_gb: r.h2d_bytes? as f64 / 1e9,
                })
            })
            .collect();
        let svg = json_path.with_extension("svg");
        let title = format!(
            "{} — {} experts, {}",
            runs[0].json["model_id"].as_str().unwrap_or("?"),
            lower(args.model.experts),
            if device.is_cuda() { "CUDA" } else { "CPU" }
        );
        let base = baseline.as_ref().and_then(|b| {
            b.metrics
                .decode_tokens_per_s
                .map(|v| ("dense BF16 baseline", v))
        });
        candle_qmoe_suite::perf::plot_sweep(&svg, &title, &points, base)?;
        println!("wrote {}", svg.display());
    }
    Ok(())
}
