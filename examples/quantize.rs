//! Packs a checkpoint's routed experts into a `.qmoe` file (INT4 weights, FP16 group scales);
//! everything else stays in the checkpoint. `generate --pack FILE` loads it.
//!
//! The checkpoint is read layer by layer from its memory-mapped safetensors and each layer is
//! written to the file as soon as it is packed, so the memory used stays at about one layer
//! whatever the model's size. `--synthetic KIND --save-checkpoint DIR` first writes a synthetic
//! model as a Hugging Face folder (BF16 safetensors shards, config, tokenizer), which is then
//! quantized like any `--model-dir` (and which other tools, e.g. llama.cpp's converter, read too).
//!
//! ```text
//! cargo run --release --example quantize -- --model-id allenai/OLMoE-1B-7B-0924-Instruct \
//!     --out olmoe-0924-instruct-g128.qmoe
//! cargo run --release --example quantize -- --model-dir tests/fixtures/olmoe-tiny --out tiny.qmoe
//! cargo run --release --example quantize -- --synthetic olmoe --save-checkpoint /data/olmoe-synthetic \
//!     --out olmoe-synthetic-g128.qmoe
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_qmoe::models::{AnyConfig, ModelConfig, QuantizeOptions};
use candle_qmoe::pack::{GroupSize, PackFile};
use candle_qmoe::plan::format_bytes;
use candle_qmoe::synthetic::SyntheticKind;
use candle_qmoe_suite::checkpoint::{
    quantize_to_file_with_progress, resolve_checkpoint, write_synthetic_checkpoint,
};
use candle_qmoe_suite::model::{output_path, parse_arg, ScaleSearchArg};
use candle_qmoe_suite::system::{self, peak_rss_bytes};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Quantize a MoE checkpoint's routed experts into a .qmoe pack"
)]
struct Args {
    /// Hugging Face model id (downloaded with hf-hub) when --model-dir is not given.
    #[arg(long, default_value = "allenai/OLMoE-1B-7B-0924-Instruct")]
    model_id: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    revision: Option<String>,
    /// Local checkpoint folder (config.json + safetensors) instead of the hub.
    #[arg(long, conflicts_with_all = ["synthetic", "model_id", "revision"])]
    model_dir: Option<PathBuf>,
    /// Synthetic model (tiny, olmoe, qwen2moe, qwen3moe or mixtral: real shapes, random BF16
    /// weights) to write as a checkpoint folder with --save-checkpoint, instead of reading one.
    #[arg(long, value_parser = parse_arg::<SyntheticKind>, requires = "save_checkpoint",
          conflicts_with_all = ["model_id", "revision"])]
    synthetic: Option<SyntheticKind>,
    /// Seed of the synthetic model's weights (the same as `generate --synthetic-seed`).
    #[arg(long, default_value_t = 42, requires = "synthetic")]
    synthetic_seed: u64,
    /// New folder to write the --synthetic model into: config.json, generation_config.json,
    /// BF16 safetensors shards with their index, tokenizer.json and tokenizer_config.json. With
    /// --out the folder is then quantized like any --model-dir.
    #[arg(long, requires = "synthetic")]
    save_checkpoint: Option<PathBuf>,
    /// Columns per FP16 scale: 32, 64, 128 or 256.
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// How group scales are chosen.
    #[arg(long, value_enum, default_value = "mse")]
    scale_search: ScaleSearchArg,
    /// Output .qmoe file (optional with --save-checkpoint, which alone only writes the folder;
    /// it may lie inside that folder).
    #[arg(long, required_unless_present = "save_checkpoint")]
    out: Option<PathBuf>,
    /// Overwrite an existing output file.
    #[arg(long)]
    force: bool,
    /// Append a JSON line with the run's evidence (device, load, commit, command, times, CPU
    /// time, peak RSS, sizes) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// `peak RSS X` for the end-of-run lines (empty where /proc is missing).
fn peak_rss() -> String {
    peak_rss_bytes().map_or(String::new(), |b| format!(", peak RSS {}", format_bytes(b)))
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    // clap does not enforce `requires` between these two (each requires the other).
    if args.save_checkpoint.is_some() && args.synthetic.is_none() {
        bail!("--save-checkpoint writes a --synthetic model: add --synthetic KIND (tiny, olmoe, qwen2moe, qwen3moe or mixtral)");
    }
    // Output files are checked before the work (`output_path`), except that their folder may be
    // the --save-checkpoint folder, which is made first.
    for path in [&args.out, &args.json].into_iter().flatten() {
        let in_new_folder = args
            .save_checkpoint
            .as_deref()
            .is_some_and(|dir| path.parent() == Some(dir) && !dir.exists());
        if !in_new_folder {
            output_path(&path.to_string_lossy()).map_err(anyhow::Error::msg)?;
        }
    }
    let group_size = GroupSize::new(args.group_size)?;
    if let Some(out) = args.out.as_ref().filter(|o| o.exists() && !args.force) {
        bail!("`{}` exists; pass --force to overwrite it", out.display());
    }
    let load_average = system::load_average();
    let mut evidence = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": system::git_commit(),
        "date": candle_qmoe_suite::perf::now_rfc3339()?,
        "device": system::device_json(&candle::Device::Cpu),
        "load_average_at_start": load_average,
        "group_size": group_size.get(),
        "scale_search": format!("{:?}", args.scale_search).to_lowercase(),
    });
    let mut model_dir = args.model_dir.clone();
    if let (Some(kind), Some(dir)) = (args.synthetic, &args.save_checkpoint) {
        if dir.exists() && !dir.is_dir() {
            bail!("`{}` is a file; name a new or empty folder", dir.display());
        }
        if std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some()) {
            bail!(
                "`{}` is not empty; remove it or choose another folder",
                dir.display()
            );
        }
        let start = Instant::now();
        let written = write_synthetic_checkpoint(kind, args.synthetic_seed, dir)?;
        println!(
            "wrote the synthetic {kind} model (seed {}) to `{}`: {} tensors, {} of BF16 weights \
             in {} shard(s), in {:.1} s{}",
            args.synthetic_seed,
            dir.display(),
            written.tensors,
            format_bytes(written.tensor_bytes),
            written.shards.len(),
            start.elapsed().as_secs_f64(),
            peak_rss()
        );
        evidence["checkpoint_write"] = json!({
            "synthetic": kind.name(),
            "seed": args.synthetic_seed,
            "dir": dir,
            "tensors": written.tensors,
            "tensor_bytes": written.tensor_bytes,
            "shards": written.shards.len(),
            "time_s": start.elapsed().as_secs_f64(),
            "peak_rss_bytes": system::peak_rss_bytes(),
        });
        model_dir = Some(dir.clone());
    }
    let Some(out) = &args.out else {
        return write_evidence(args.json.as_deref(), evidence);
    };
    let ckpt = resolve_checkpoint(
        model_dir.as_deref(),
        &args.model_id,
        args.revision.as_deref(),
    )?;
    let spec = AnyConfig::from_file(ckpt.dir.join("config.json"))?.spec()?;
    let moe = spec.uniform_moe()?;
    println!(
        "{} ({}, revision {}): {} MoE layers × {} experts, H {} I {}, group size {}",
        ckpt.model_id,
        spec.model_type,
        ckpt.revision,
        spec.moe_layers().len(),
        moe.num_experts,
        spec.hidden_size,
        moe.intermediate_size,
        group_size.get()
    );
    let opts = QuantizeOptions {
        group_size,
        search: args.scale_search.into(),
        source_model: ckpt.model_id.clone(),
        source_revision: ckpt.revision.clone(),
    };
    let start = Instant::now();
    quantize_to_file_with_progress(&ckpt.dir, out, &opts)?;
    let quantized = start.elapsed();
    // Read it back, every slab checked against its checksum: what `generate --pack` will see.
    // Each layer's pages are handed back once verified, so the read-back holds one layer too.
    let pack = PackFile::open(out)?;
    let verify = Instant::now();
    for i in pack.layer_indices() {
        let layer = pack.layer(i)?;
        layer.verify()?;
        layer.release_pages();
    }
    let verified = verify.elapsed();
    let l = pack.meta().layout;
    let experts = pack.layer_indices().count() * pack.meta().num_experts;
    let bf16_bytes = (experts * 3 * l.hidden * l.intermediate * 2) as u64;
    let file_bytes = std::fs::metadata(out)?.len();
    let (user, sys) = system::cpu_time_s().unzip();
    evidence["quantize"] = json!({
        "checkpoint": ckpt.model_id,
        "moe_layers": pack.layer_indices().count(),
        "experts_per_layer": pack.meta().num_experts,
        "out": out,
        "file_bytes": file_bytes,
        "quantize_s": quantized.as_secs_f64(),
        "verify_s": verified.as_secs_f64(),
        "process_cpu_user_s": user,
        "process_cpu_system_s": sys,
        "peak_rss_bytes": system::peak_rss_bytes(),
    });
    println!(
        "wrote {}: {} ({} of packed experts) for {} of BF16 experts ({:.2}×), \
         quantized and written in {:.1} s, verified in {:.2} s, total {:.1} s{}",
        out.display(),
        format_bytes(file_bytes),
        format_bytes(pack.total_bytes() as u64),
        format_bytes(bf16_bytes),
        bf16_bytes as f64 / file_bytes as f64,
        quantized.as_secs_f64(),
        verified.as_secs_f64(),
        start.elapsed().as_secs_f64(),
        peak_rss()
    );
    write_evidence(args.json.as_deref(), evidence)
}

/// Appends `evidence` as one JSON line to `path`, if given.
fn write_evidence(path: Option<&Path>, evidence: serde_json::Value) -> Result<()> {
    let Some(path) = path else {
        return Ok(());
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open `{}`", path.display()))?;
    writeln!(file, "{evidence}").with_context(|| format!("cannot write `{}`", path.display()))
}
