//! Predicts the memory a MoE model needs, per component, before anything is loaded, and fits the
//! expert cache to a memory budget. Only `config.json` is read: no weights are needed.
//!
//! ```text
//! cargo run --release --example plan -- --config examples/configs/olmoe-1b-7b-0924.json \
//!     --ctx 4096 --vram-budget 6GiB
//! cargo run --release --example plan -- --synthetic qwen2moe --resident 30 --json plan.json
//! cargo run --release --example plan -- --model-id allenai/OLMoE-1B-7B-0924 --device cpu \
//!     --vram-budget 8GiB
//! ```
//!
//! Prints one row per component (min, max, share of the budget), the resident experts per MoE
//! layer and the host figures. With `--vram-budget` and no `--resident`, the largest capacities
//! that fit are chosen; with both, the given residency is checked against the budget. A budget
//! that cannot fit is refused with the component that does not fit and what would fit.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_qmoe::models::{AnyConfig, ModelConfig};
use candle_qmoe::plan::{
    self, FitOptions, Plan, PlanOptions, Target, DEFAULT_MARGIN, DEFAULT_PREFILL_CHUNK,
    DEFAULT_STAGING_BUFFERS,
};
use candle_qmoe::residency::Resident;
use candle_qmoe::synthetic::SyntheticKind;
use candle_qmoe::QmoeError;
use candle_qmoe_suite::model::{output_path, parse_arg, parse_budget, DenseWeights, Experts};
use clap::{ArgGroup, Parser, ValueEnum};
use serde_json::json;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DeviceKind {
    /// A CUDA GPU: the budget is device memory.
    Cuda,
    /// The CPU: the budget is the process memory.
    Cpu,
}

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Predict a MoE model's memory per component and fit the expert cache to a budget"
)]
#[command(group(ArgGroup::new("source").required(true).args(["config", "model_dir", "model_id", "synthetic"])))]
struct Args {
    /// A config.json file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A checkpoint folder: its config.json is read.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// A Hugging Face model id: only its config.json is downloaded.
    #[arg(long)]
    model_id: Option<String>,
    /// Hub revision (branch, tag or commit) for --model-id.
    #[arg(long, requires = "model_id", conflicts_with_all = ["config", "model_dir", "synthetic"])]
    revision: Option<String>,
    /// The config of a synthetic model: tiny, olmoe, qwen2moe, qwen3moe or mixtral.
    #[arg(long, value_parser = parse_arg::<SyntheticKind>)]
    synthetic: Option<SyntheticKind>,
    /// How the routed experts are stored.
    #[arg(long, value_enum, default_value = "int4")]
    experts: Experts,
    /// INT4 group size: 32, 64, 128 or 256.
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// Context length (default: the model's max_position_embeddings).
    #[arg(long)]
    ctx: Option<usize>,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Tokens per prefill forward pass (sizes the workspace).
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// Resident experts per MoE layer: `all`, a number, or one number per layer
    /// (comma-separated). With --vram-budget it is checked against the budget instead of fitted.
    #[arg(long, value_parser = parse_arg::<Resident>)]
    resident: Option<Resident>,
    /// Staging buffers of one expert each.
    #[arg(long, default_value_t = DEFAULT_STAGING_BUFFERS)]
    staging_buffers: usize,
    /// Memory budget, e.g. 6GiB, 6000MB or a number of bytes (on --device cpu: the process
    /// memory).
    #[arg(long, value_parser = parse_budget, allow_hyphen_values = true)]
    vram_budget: Option<u64>,
    /// Fraction of the budget held back on top of every component's maximum.
    #[arg(long, default_value_t = DEFAULT_MARGIN, requires = "vram_budget")]
    margin: f64,
    /// Weights per MoE layer for the fit (e.g. recorded misses), comma-separated: heavier
    /// layers get spare slots first.
    #[arg(
        long,
        value_delimiter = ',',
        requires = "vram_budget",
        conflicts_with = "resident"
    )]
    layer_weights: Option<Vec<f64>>,
    /// Let the fit reduce the context when the budget cannot hold it.
    #[arg(long, requires = "vram_budget", conflicts_with = "resident")]
    allow_ctx_reduction: bool,
    /// Where the model runs.
    #[arg(long, value_enum, default_value = "cuda")]
    device: DeviceKind,
    /// Non-expert weights (default bf16; on the CPU computed with F32 activations, which the
    /// KV cache and workspace then hold; int8 is CPU only).
    #[arg(long, value_enum, alias = "dtype")]
    dense_weights: Option<DenseWeights>,
    /// Write the plan to this JSON file.
    #[arg(long, value_parser = output_path)]
    json: Option<PathBuf>,
}

/// Only `config.json` of a hub model.
fn hub_config(model_id: &str, revision: &str) -> Result<PathBuf> {
    use hf_hub::{api::sync::ApiBuilder, Repo, RepoType};
    let api = ApiBuilder::from_env().with_progress(false).build()?;
    let repo = Repo::with_revision(model_id.to_string(), RepoType::Model, revision.to_string());
    api.repo(repo).get("config.json").with_context(|| {
        format!(
            "cannot download config.json of `{model_id}` (revision {revision}) from the Hugging \
             Face hub; without network use --config FILE, --model-dir DIR or --synthetic"
        )
    })
}

/// The config and where it came from.
fn load_config(args: &Args) -> Result<(AnyConfig, String)> {
    let from_file = |path: &Path| -> Result<(AnyConfig, String)> {
        Ok((AnyConfig::from_file(path)?, path.display().to_string()))
    };
    if let Some(kind) = args.synthetic {
        let config = AnyConfig::from_json_str(&kind.config_json().to_string())?;
        return Ok((config, format!("synthetic:{kind}")));
    }
    if let Some(path) = &args.config {
        return from_file(path);
    }
    if let Some(dir) = &args.model_dir {
        return from_file(&dir.join("config.json"));
    }
    let id = args.model_id.as_deref().context("no model given")?;
    let path = hub_config(id, args.revision.as_deref().unwrap_or("main"))?;
    Ok((AnyConfig::from_file(path)?, id.to_string()))
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    let (config, source) = load_config(&args)?;
    let spec = config.spec()?;
    let target = match args.device {
        DeviceKind::Cuda => Target::Cuda,
        DeviceKind::Cpu => Target::Cpu,
    };
    let options = PlanOptions {
        target,
        dtype: args
            .dense_weights
            .map_or(target.default_dtype(), DenseWeights::dtype),
        dense_int8: args.dense_weights == Some(DenseWeights::Int8),
        experts: args.experts.storage(Some(args.group_size))?,
        ctx: args.ctx,
        batch: args.batch,
        prefill_chunk: args.prefill_chunk,
        residency: args.resident.clone().unwrap_or_default(),
        staging_buffers: args.staging_buffers,
    };
    let requested = Plan::new(&spec, &options)?;
    // What every JSON report starts with: the run and the model.
    let header = json!({
        "source": source,
        "commit": candle_qmoe_suite::system::git_commit(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "model_type": spec.model_type,
        "device": target.name(),
        "dtype": format!("{:?}", options.dtype).to_lowercase(),
        "dense_int8": options.dense_int8,
        "experts": format!("{:?}", args.experts).to_lowercase(),
        "group_size": (args.experts == Experts::Int4).then_some(args.group_size),
        "requested_ctx": args.ctx.unwrap_or(spec.max_position_embeddings),
        "batch": args.batch,
        "budget_bytes": args.vram_budget,
        "margin": args.vram_budget.map(|_| args.margin),
    });
    let refused = |e: QmoeError| refusal(args.json.as_deref(), header.clone(), e);
    let plan = match (args.vram_budget, &args.resident) {
        (Some(budget), None) => {
            let fit = requested
                .fit(
                    budget,
                    &FitOptions {
                        weights: args.layer_weights.clone(),
                        allow_ctx_reduction: args.allow_ctx_reduction,
                        margin: args.margin,
                    },
                )
                .map_err(refused)?;
            if fit.ctx_reduced() {
                println!(
                    "note: context reduced from {} to {} to fit the budget",
                    fit.requested_ctx,
                    fit.plan.ctx()
                );
            }
            fit.plan
        }
        (Some(budget), Some(_)) => {
            requested.admit(budget, args.margin).map_err(refused)?;
            requested
        }
        (None, _) => requested,
    };

    println!("{source}: {}", plan.summary());
    print!("{}", plan.table(args.vram_budget));
    if let Some(budget) = args.vram_budget {
        let margin = (budget as f64 * args.margin).ceil() as u64;
        println!(
            "fits {} (margin {}, headroom {} at the maximum)",
            plan::format_bytes(budget),
            plan::format_bytes(margin),
            plan::format_bytes((budget - margin).saturating_sub(plan.total().max))
        );
    }
    let moe = spec.moe_layers();
    let resident: Vec<usize> = moe.iter().map(|&i| plan.resident_per_layer()[i]).collect();
    println!("resident experts per MoE layer: {resident:?}");
    for c in plan.host() {
        println!(
            "host {:<12} {} .. {}",
            c.component,
            plan::format_bytes(c.bytes.min),
            plan::format_bytes(c.bytes.max)
        );
    }

    if let Some(path) = &args.json {
        let total = plan.total();
        let mut report = header;
        report.as_object_mut().expect("an object").extend(
            json!({
                "ctx": plan.ctx(),
                "prefill_chunk": args.prefill_chunk.min(plan.ctx()),
                "components": plan.components(),
                "total_min_bytes": total.min,
                "total_max_bytes": total.max,
                "moe_layers": moe,
                "resident_per_layer": resident,
                "host": plan.host(),
            })
            .as_object()
            .expect("an object")
            .clone(),
        );
        write_json(path, &report)?;
    }
    Ok(())
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(value)? + "\n")
        .with_context(|| format!("cannot write `{}`", path.display()))
}

/// The error of a plan that does not fit, recorded first in the `--json` file (if any) as
/// `header` plus a `refused` object: the component that does not fit, the bytes it needs, the
/// bytes left for it, what is missing and the whole message.
fn refusal(json_path: Option<&Path>, mut header: serde_json::Value, e: QmoeError) -> anyhow::Error {
    let Some(path) = json_path else {
        return e.into();
    };
    let mut refused = json!({ "message": e.to_string() });
    if let QmoeError::DoesNotFit {
        component,
        needed,
        available,
        ..
    } = &e
    {
        refused["component"] = json!(component.to_string());
        refused["needed_bytes"] = json!(needed);
        refused["available_bytes"] = json!(available);
        refused["missing_bytes"] = json!(needed.saturating_sub(*available));
    }
    header["refused"] = refused;
    match write_json(path, &header) {
        Ok(()) => e.into(),
        Err(w) => w.context(e),
    }
}
