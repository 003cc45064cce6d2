//! Packs a checkpoint's routed experts into a `.qmoe` file (INT4 weights, FP16 group scales);
//! everything else stays in the checkpoint. `generate --pack FILE` loads it.
//!
//! ```text
//! cargo run --release --example quantize -- --model-id allenai/OLMoE-1B-7B-0924-Instruct \
//!     --out olmoe-0924-instruct-g128.qmoe
//! cargo run --release --example quantize -- --model-dir tests/fixtures/olmoe-tiny --out tiny.qmoe
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_qmoe::models::{AnyConfig, ModelConfig, QuantizeOptions};
use candle_qmoe::pack::{GroupSize, PackFile, ScaleSearch};
use candle_qmoe::plan::format_bytes;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Search {
    /// Minimum squared error over a grid of scales (default).
    Mse,
    /// Round to nearest with absmax / 7.
    Rtn,
}

#[derive(Parser, Debug)]
#[command(about = "Quantize a MoE checkpoint's routed experts into a .qmoe pack")]
struct Args {
    /// Hugging Face model id (downloaded with hf-hub) when --model-dir is not given.
    #[arg(long, default_value = "allenai/OLMoE-1B-7B-0924-Instruct")]
    model_id: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    revision: Option<String>,
    /// Local checkpoint folder (config.json + safetensors) instead of the hub.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// Columns per FP16 scale: 32, 64, 128 or 256.
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// How group scales are chosen.
    #[arg(long, value_enum, default_value = "mse")]
    scale_search: Search,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// Overwrite an existing output file.
    #[arg(long)]
    force: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let group_size = GroupSize::new(args.group_size)?;
    if args.out.exists() && !args.force {
        bail!(
            "`{}` exists; pass --force to overwrite it",
            args.out.display()
        );
    }
    let ckpt = candle_qmoe_suite::checkpoint::resolve_checkpoint(
        args.model_dir.as_deref(),
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
        search: match args.scale_search {
            Search::Mse => ScaleSearch::Mse,
            Search::Rtn => ScaleSearch::Rtn,
        },
        source_model: ckpt.model_id.clone(),
        source_revision: ckpt.revision.clone(),
    };
    let start = Instant::now();
    let pack = candle_qmoe_suite::checkpoint::quantize_with_progress(&ckpt.dir, &opts)?;
    let quantized = start.elapsed();
    pack.save(&args.out)?;
    drop(pack);
    // Read it back, every slab checked against its checksum: what `generate --pack` will see.
    let pack = PackFile::open(&args.out)?;
    let verify = Instant::now();
    pack.verify()?;
    let verified = verify.elapsed();
    let l = pack.meta().layout;
    let experts = pack.layer_indices().count() * pack.meta().num_experts;
    let bf16_bytes = (experts * 3 * l.hidden * l.intermediate * 2) as u64;
    let file_bytes = std::fs::metadata(&args.out)?.len();
    println!(
        "wrote {}: {} ({} of packed experts) for {} of BF16 experts ({:.2}×), \
         quantized in {:.1} s, verified in {:.2} s, total {:.1} s",
        args.out.display(),
        format_bytes(file_bytes),
        format_bytes(pack.total_bytes() as u64),
        format_bytes(bf16_bytes),
        bf16_bytes as f64 / file_bytes as f64,
        quantized.as_secs_f64(),
        verified.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
