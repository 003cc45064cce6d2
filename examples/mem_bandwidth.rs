//! Measures the host memory bandwidth (parallel read and copy of 512 MiB buffers, median of
//! five) and prints one JSON line, for evidence files that state the bandwidth next to a speed
//! (docs/architecture.md §6). Threads: `RAYON_NUM_THREADS`, else one per core.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo run --release --example mem_bandwidth
//! ```

use candle_qmoe_suite::system::{cpu_model, memory_bandwidth};
use clap::Parser;
use serde_json::json;

/// No flags: `--help` says what it does, and anything else is refused.
#[derive(Parser, Debug)]
#[command(
    about = "The host's parallel read and copy bandwidth (512 MiB buffers, median of five; \
                   threads: RAYON_NUM_THREADS, else one per core), as one JSON line"
)]
struct Args {}

fn main() -> anyhow::Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    Args::parse();
    let bw = memory_bandwidth();
    let mut line = serde_json::to_value(bw)?;
    line["cpu"] = json!(cpu_model());
    println!("{line}");
    Ok(())
}
