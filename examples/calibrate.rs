//! Calibrates the memory plan on the CPU: runs one synthetic configuration in this process and
//! compares its peak RSS (`VmHWM`) with the plan's predicted process RSS `[min, max]`.
//!
//! ```text
//! cargo run --release --example calibrate -- --synthetic tiny --resident 2 --ctx 256 \
//!     --jsonl bench/results/calibration-cpu.jsonl
//! cargo run --release --example calibrate -- --table bench/results/calibration-cpu.jsonl
//! ```
//!
//! One configuration per process, so that the peak covers nothing else: `bench/calibrate-cpu.sh`
//! runs the set recorded in `bench/results/calibration-cpu.jsonl`. The prompt (`ctx + 1 − new`
//! tokens) is prefilled in one forward pass and the plan is made with that prefill chunk; the
//! last generated token brings the KV cache to `ctx` positions. `--resident none` serves the
//! INT4 experts from the pack without a cache; `N` or `all` runs an expert cache of that many
//! slots per layer in host memory. `--jsonl` appends one JSON line: the configuration, the
//! predicted components, total and process RSS, the measured peak, whether it lies inside the
//! prediction, and the device, commit, command and date. With `--table FILE` it only prints the
//! table of such a file.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_qmoe::plan::{format_bytes, ExpertStorage, Plan};
use candle_qmoe::synthetic::SyntheticKind;
use candle_qmoe_suite::calibration::{self, Cache, Config, Measurement};
use clap::{ArgGroup, Parser};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Measure the peak RSS of one synthetic configuration against the memory plan"
)]
#[command(group(ArgGroup::new("mode").required(true).args(["synthetic", "table"])))]
struct Args {
    /// The synthetic model: tiny, olmoe or qwen2moe (its pack is built in memory).
    #[arg(long, value_parser = parse_arg::<SyntheticKind>)]
    synthetic: Option<SyntheticKind>,
    /// Expert cache: none (the pack in place), all, or a number of slots per MoE layer.
    #[arg(long, default_value = "none", value_parser = parse_arg::<Cache>)]
    resident: Cache,
    /// Positions in the KV cache at the end of the run.
    #[arg(long, default_value_t = 256)]
    ctx: usize,
    /// Tokens generated after the prompt (the prompt is `ctx + 1 − new` tokens).
    #[arg(long = "new", default_value_t = 4)]
    new_tokens: usize,
    /// Append the record as one JSON line to this file.
    #[arg(long, value_parser = candle_qmoe_suite::model::output_path)]
    jsonl: Option<PathBuf>,
    /// Print the table of the records in this JSON-lines file and exit.
    #[arg(long, conflicts_with_all = ["synthetic", "jsonl"])]
    table: Option<PathBuf>,
}

fn parse_arg<T: std::str::FromStr>(s: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    s.parse().map_err(|e: T::Err| e.to_string())
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    if let Some(path) = &args.table {
        return print_table(path);
    }
    let kind = args.synthetic.context("--synthetic is required")?;
    let config = Config::new(kind, args.resident, args.ctx, args.new_tokens)?;
    // Predict first: a configuration the plan refuses is not run.
    let plan = config.plan()?;
    let measured = config.run()?;
    let record = record(&config, &plan, &measured)?;
    println!("{config}: {measured}");
    println!("{}", row(&record)?);
    if let Some(path) = &args.jsonl {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open `{}`", path.display()))?;
        writeln!(file, "{}", serde_json::to_string(&record)?)?;
    }
    Ok(())
}

/// The JSON record of one run.
fn record(config: &Config, plan: &Plan, measured: &Measurement) -> Result<Value> {
    let rss = calibration::process_rss(plan)?;
    let spec = plan.spec();
    let resident: Vec<usize> = spec
        .moe_layers()
        .iter()
        .map(|&l| plan.resident_per_layer()[l])
        .collect();
    let o = plan.options();
    let group_size = match o.experts {
        ExpertStorage::Int4(g) => Some(g.get()),
        ExpertStorage::Dense(_) => None,
    };
    Ok(json!({
        "config": {
            "label": config.to_string(),
            "model_id": format!("synthetic:{}", config.kind),
            "seed": calibration::SEED,
            "resident": config.cache.to_string(),
            "resident_per_layer": resident,
            "ctx": config.ctx,
            "prompt_tokens": config.prompt_len(),
            "new_tokens": config.new_tokens,
            "prefill_chunk": o.prefill_chunk,
            "batch": o.batch,
            "dtype": format!("{:?}", o.dtype).to_lowercase(),
            "experts": "int4",
            "group_size": group_size,
            "staging_buffers": o.staging_buffers,
            "target": o.target.name(),
        },
        "predicted": {
            "summary": plan.summary(),
            "components": plan.components(),
            "total": plan.total(),
            "process_rss": rss,
            "host": plan.host(),
        },
        "measured": {
            "peak_rss_bytes": measured.peak_rss_bytes,
            "load_s": measured.load_s,
            "time_to_first_token_s": measured.time_to_first_token_s,
            "decode_s": measured.decode_s,
        },
        "inside": calibration::inside(rss, measured.peak_rss_bytes),
        "device": { "kind": "cpu", "name": candle_qmoe_suite::system::cpu_model() },
        "commit": candle_qmoe_suite::system::git_commit(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "date": candle_qmoe_suite::perf::now_rfc3339()?,
    }))
}

/// One table row of a record: configuration, predicted process RSS, measured peak, inside.
fn row(record: &Value) -> Result<String> {
    let bytes = |v: &Value| -> Result<u64> { v.as_u64().context("a byte count is missing") };
    let rss = &record["predicted"]["process_rss"];
    let (min, max) = (bytes(&rss["min_bytes"])?, bytes(&rss["max_bytes"])?);
    let peak = bytes(&record["measured"]["peak_rss_bytes"])?;
    let inside = record["inside"].as_bool().context("`inside` is missing")?;
    // Where the peak lies within the range (0% at min, 100% at max).
    let position = 100.0 * (peak as f64 - min as f64) / (max - min).max(1) as f64;
    Ok(format!(
        "{:<22} {:>11} – {:<11} {:>11} {:>7.1}%  {}",
        record["config"]["label"]
            .as_str()
            .context("the config label is missing")?,
        format_bytes(min),
        format_bytes(max),
        format_bytes(peak),
        position,
        if inside { "inside" } else { "OUTSIDE" }
    ))
}

/// Prints the table of a JSON-lines file of records.
fn print_table(path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read `{}`", path.display()))?;
    println!(
        "{:<22} {:>25} {:>11} {:>8}  inside?",
        "model/resident/ctx/new", "predicted RSS min – max", "measured", "in range"
    );
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let record: Value = serde_json::from_str(line)
            .with_context(|| format!("`{}` line {}", path.display(), i + 1))?;
        println!("{}", row(&record)?);
    }
    Ok(())
}
