//! An OpenAI-compatible server with continuous batching (docs/architecture.md §12).
//!
//! ```text
//! cargo run --release --example server -- --synthetic olmoe --cpu --parallel 4
//! curl http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \
//!     -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}'
//! ```
//!
//! `POST /v1/chat/completions` and `/v1/completions` (streamed as server-sent events or not),
//! `GET /v1/models`, `/health` and `/metrics` (OpenMetrics). The model flags are `generate`'s; the
//! model runs on one engine thread that batches the slots' decode tokens with chunks of the
//! prompts being read (`engine`), the HTTP side (`http`) checks and tokenizes requests (`api`).

mod api;
mod engine;
mod http;
mod metrics;
mod queue;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use candle::Device;
use candle_qmoe::models::ModelConfig;
use candle_qmoe::plan::{self, Plan};
use candle_qmoe_suite::model::{Batching, Loaded, ModelArgs};
use clap::Parser;

use crate::api::Frontend;
use crate::engine::{Engine, EngineConfig};
use crate::metrics::Metrics;
use crate::queue::Queue;

/// Default tokens per slot when `--ctx` is not given (or the model's context, if shorter).
const DEFAULT_CTX: usize = 4096;

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "OpenAI-compatible server with continuous batching for MoE models with INT4 experts"
)]
struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: a free one; the `listening on` line names it).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Slots: requests generated at once, each with its own KV cache of --ctx tokens (default
    /// min(model context, 4096)).
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Requests waiting for a slot at most; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Prompt tokens read per engine step (shared by the prompts being read), so that a long
    /// prompt delays the others' next token by one chunk at most.
    #[arg(long, default_value_t = 64)]
    prefill_chunk: usize,
    /// Seconds between SSE keep-alive comments.
    #[arg(long, default_value_t = 15)]
    keep_alive_secs: u64,
    /// Seconds that requests in flight get to finish after SIGINT/SIGTERM before they are
    /// cancelled (a second signal cancels them at once).
    #[arg(long, default_value_t = 5)]
    shutdown_grace_secs: u64,
}

/// On the CPU without `--vram-budget`: refuses a start whose plan (weights, pack, KV cache of
/// every slot, workspace) cannot fit the available memory even at its smallest; prints the plan.
fn check_memory(plan: &Plan, device: &Device) -> Result<()> {
    println!("memory plan: {}", plan.summary());
    let available = candle_qmoe_suite::system::available_memory_bytes();
    if let (true, Some(available)) = (device.is_cpu(), available) {
        let needed = plan.total().min;
        if needed > available {
            bail!(
                "the plan needs at least {} but {} of memory is available: use fewer --parallel \
                 slots or a shorter --ctx\n{}",
                plan::format_bytes(needed),
                plan::format_bytes(available),
                plan.table(Some(available))
            );
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    for (flag, value) in [
        ("--parallel", args.parallel),
        ("--queue", args.queue),
        ("--prefill-chunk", args.prefill_chunk),
    ] {
        if value == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    let device = args.model.device()?;
    let dtype = args.model.compute_dtype(&device);
    let model_ctx = args.model.config()?.spec()?.max_position_embeddings;
    args.model.ctx = Some(args.model.ctx.unwrap_or(model_ctx.min(DEFAULT_CTX)));
    args.model.batching = Batching {
        sequences: args.parallel,
        step_tokens: args.prefill_chunk.saturating_add(args.parallel),
    };
    let plan = args.model.check(dtype, &device)?;
    if args.model.vram_budget.is_none() {
        check_memory(&plan, &device)?;
    }
    let loaded = args.model.load_checked(&plan, dtype, &device)?;
    let stop_ids = loaded.stop_ids(loaded.chat_template.as_ref());
    let ctx = loaded.context();
    let Loaded {
        model,
        tokenizer,
        model_id,
        chat_template,
        residency,
        ..
    } = loaded;
    let vocab_size = model.spec().vocab_size;
    println!(
        "{model_id}: {} slots × {ctx} tokens, {} prompt tokens per step, queue {}, {device:?}",
        args.parallel, args.prefill_chunk, args.queue
    );
    let metrics = Arc::new(Metrics::new(args.parallel, residency));
    let queue = Arc::new(Queue::new(args.queue));
    let config = EngineConfig {
        slots: args.parallel,
        ctx,
        prefill_chunk: args.prefill_chunk,
        stop_ids,
    };
    let engine = {
        let (metrics, queue, tokenizer) = (metrics.clone(), queue.clone(), tokenizer.clone());
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                // However the engine ends, a panic included, the queue closes: waiting clients
                // get an error and new ones a 503, not a wait for an engine that is gone.
                let _closes = queue::ClosesOnDrop(queue.clone());
                // The model's steps on a thread of rayon's pool (see `on_rayon_pool`).
                candle_qmoe::pool::on_rayon_pool(move || {
                    Engine::new(model, &tokenizer, config, queue, metrics).run()
                })
            })?
    };
    let state = Arc::new(http::AppState {
        frontend: Frontend {
            vocab_size,
            model_id,
            tokenizer,
            template: chat_template,
            ctx,
        },
        queue,
        metrics,
        keep_alive: Duration::from_secs(args.keep_alive_secs.max(1)),
        started: api::unix_time(),
        next_id: AtomicU64::new(0),
    });
    // Requests are parsed and tokenized on the blocking pool: as many at once as there are
    // cores, so that a burst of long prompts queues instead of taking hundreds of threads.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(cores)
        .enable_all()
        .build()?;
    runtime.block_on(http::serve(
        state,
        &args.host,
        args.port,
        Duration::from_secs(args.shutdown_grace_secs),
    ))?;
    engine
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    println!("stopped");
    Ok(())
}
