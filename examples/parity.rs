//! Compares a model folder with a golden file made by Hugging Face transformers (the fixture
//! format of docs/architecture.md §7): per prompt, teacher-forced max |Δlogit|, mean KL and
//! top-1 agreement over the prompt and the golden greedy continuation, how many greedy tokens (with the KV cache)
//! match before the first divergence, the router's top-k agreement, and how far decoding with the
//! KV cache (fed the golden tokens) strays from the full forward. Then a verdict against
//! bounds (`ParityBounds`: tight for a dense F32 port, looser for INT4 experts or BF16 compute,
//! each overridable): it exits with status 1 naming every bound broken. For people porting a
//! model: see docs/porting.md.
//!
//! ```text
//! cargo run --release --example parity -- --model-dir tests/fixtures/olmoe-tiny \
//!     --golden tests/fixtures/olmoe-tiny/golden.safetensors --experts int4 --json parity.json
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result};
use candle::{DType, Device};
use candle_qmoe::models::{self, AnyConfig, ExpertsBackend, MoeForCausalLm};
use candle_qmoe::pack::GroupSize;
use candle_qmoe::parity::{compare, Golden, ParityBounds};
use candle_qmoe_suite::model::{output_path, ScaleSearchArg};
use clap::{Parser, ValueEnum};
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Experts {
    /// Dense F32 experts (with F32 compute: the port's parity with transformers).
    F32,
    /// Dense BF16 experts.
    Bf16,
    /// INT4 experts with FP16 group scales.
    Int4,
}

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Fidelity of a MoE model folder against a transformers golden file"
)]
struct Args {
    /// Checkpoint folder (config.json + safetensors).
    #[arg(long)]
    model_dir: PathBuf,
    /// Golden safetensors file (`promptN.input_ids`, `.logits`, `.greedy_ids`,
    /// `.greedy_step_logits`, `.router_logits`).
    #[arg(long)]
    golden: PathBuf,
    /// Routed experts backend.
    #[arg(long, value_enum, default_value = "f32")]
    experts: Experts,
    /// INT4 group size.
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// INT4 scale search.
    #[arg(long, value_enum, default_value = "mse")]
    scale_search: ScaleSearchArg,
    /// Compute dtype of everything but the experts (default: f32, as the goldens).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// Fail above this mean KL per prompt, nats (default: 1e-6 for dense F32 experts with F32
    /// compute, else 5e-2).
    #[arg(long, value_parser = non_negative)]
    max_mean_kl: Option<f64>,
    /// Fail below this top-1 agreement per prompt (default: 0.99 dense F32, else 0.5).
    #[arg(long, value_parser = fraction)]
    min_top1: Option<f64>,
    /// Fail below this router top-k agreement per prompt (default: 0.99 dense F32, else 0.8).
    #[arg(long, value_parser = fraction)]
    min_router: Option<f64>,
    /// Fail where decoding with the KV cache differs from the full forward by more than this
    /// fraction of the largest logit (default: 1e-4 dense F32, else 2e-2).
    #[arg(long, value_parser = non_negative)]
    max_cache_diff: Option<f64>,
    /// Write the results as JSON (also when the verdict fails).
    #[arg(long, value_parser = output_path)]
    json: Option<PathBuf>,
}

impl Args {
    /// The defaults of the backend and dtype, with any bound given on the command line.
    fn bounds(&self) -> ParityBounds {
        let base = if self.experts == Experts::F32 && self.dtype == "f32" {
            ParityBounds::DENSE_F32
        } else {
            ParityBounds::QUANTIZED
        };
        ParityBounds {
            max_mean_kl: self.max_mean_kl.unwrap_or(base.max_mean_kl),
            min_top1: self.min_top1.unwrap_or(base.min_top1),
            min_router: self.min_router.unwrap_or(base.min_router),
            max_cache_relative_diff: self.max_cache_diff.unwrap_or(base.max_cache_relative_diff),
        }
    }
}

/// A bound that is a number ≥ 0 (NaN would turn its check off).
fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number ≥ 0")),
    }
}

/// A bound that is a fraction in [0, 1].
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a fraction in [0, 1]")),
    }
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    let dtype = if args.dtype == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let group_size = GroupSize::new(args.group_size)?;
    let backend = match args.experts {
        Experts::F32 => ExpertsBackend::DenseAs(DType::F32),
        Experts::Bf16 => ExpertsBackend::DenseAs(DType::BF16),
        Experts::Int4 => ExpertsBackend::Int4 {
            group_size,
            search: args.scale_search.into(),
        },
    };
    let bounds = args.bounds();
    let golden = Golden::load(&args.golden)?;
    let config = AnyConfig::from_file(args.model_dir.join("config.json"))?;
    // SAFETY: the checkpoint is not modified while the model is alive.
    let vb = unsafe { models::mmap_checkpoint(&args.model_dir, dtype, &Device::Cpu)? };
    let mut model = MoeForCausalLm::new(&config, vb, &backend)
        .with_context(|| format!("cannot load `{}`", args.model_dir.display()))?;
    let results = compare(&mut model, &golden)?;

    let label = match args.experts {
        Experts::Int4 => format!("int4 g{}", group_size.get()),
        other => format!("{other:?}").to_lowercase(),
    };
    println!(
        "{} ({}), experts {label}, compute {dtype:?}, golden {}",
        args.model_dir.display(),
        config.model_type(),
        args.golden.display()
    );
    println!(
        "{:<8} {:>6} {:>12} {:>11} {:>8} {:>8} {:>8} {:>10}",
        "prompt", "tokens", "max|Δlogit|", "mean KL", "top-1", "greedy", "router", "cache"
    );
    for (i, r) in results.iter().enumerate() {
        println!(
            "{:<8} {:>6} {:>12.3e} {:>11.3e} {:>8.4} {:>8} {:>8} {:>10.2e}",
            format!("prompt{i}"),
            r.prompt_tokens,
            r.max_abs_diff,
            r.mean_kl,
            r.top1_agreement,
            format!("{}/{}", r.greedy_prefix_match, r.greedy_steps),
            r.router_agreement
                .map_or("n/a".to_string(), |a| format!("{a:.4}")),
            r.cache_relative_diff
        );
    }
    let violations = bounds.violations(&results);
    if let Some(path) = &args.json {
        let out = json!({
            "model_dir": args.model_dir,
            "model_type": config.model_type(),
            "golden": args.golden,
            "experts": format!("{:?}", args.experts).to_lowercase(),
            "group_size": (args.experts == Experts::Int4).then_some(group_size.get()),
            "dtype": args.dtype,
            "prompts": results,
            "bounds": bounds,
            "pass": violations.is_empty(),
            "violations": violations,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)? + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    let bounds_line = format!(
        "mean KL ≤ {:.1e}, top-1 ≥ {}, router ≥ {}, KV-cache decode within {:.1e} of the \
         largest logit",
        bounds.max_mean_kl, bounds.min_top1, bounds.min_router, bounds.max_cache_relative_diff
    );
    if violations.is_empty() {
        println!("parity: pass ({bounds_line})");
        Ok(())
    } else {
        anyhow::bail!(
            "parity: FAIL ({bounds_line})\n  {}",
            violations.join("\n  ")
        )
    }
}
