//! Residency sweep: how a bounded expert cache behaves at several capacities, on the CPU (host
//! memory standing in for the GPU) or on a GPU.
//!
//! ```text
//! cargo run --release --example residency_sweep -- --cpu --json bench/results/residency-sweep-cpu.json
//! ```
//!
//! 1. **Layer traces** (fast): one MoE layer at the OLMoE-1B-7B and Qwen1.5-MoE-A2.7B shapes fed
//!    a decode routing trace, token after token — uniform (what random weights produce, the
//!    worst case for a cache) and skewed ([`skewed_routing`]: Zipf popularity s = 1 plus 50%
//!    reuse of the previous token's experts) — at the capacities of the issue and with each
//!    eviction policy: hit rate, bytes copied per token, time per token.
//! 2. **Models**: greedy decoding on the synthetic models at each capacity, plain, with
//!    `prefetch` and with `hybrid auto`: decode tokens/s, hits, bytes copied, peak cache memory,
//!    and whether the tokens equal those of full residency. On a GPU each row also puts the
//!    device memory in use next to the memory plan's prediction for that configuration (a GPU
//!    calibration of the planner).
//!
//! Writes every figure to `--json` (device, driver, commit, command) and prints tables.

use std::time::Instant;

use anyhow::{Context, Result};
use candle::{Device, Tensor};
use candle_qmoe::generation::{argmax, generate};
use candle_qmoe::pack::GroupSize;
use candle_qmoe::plan::{Component, Plan, PlanOptions, Target};
use candle_qmoe::residency::{HybridMode, PolicyKind, Residency, ResidencyOptions, Resident};
use candle_qmoe::synthetic::{
    gaussian, random_layer_pack, random_routing, skewed_routing, SyntheticKind, SyntheticModel,
};
use clap::builder::TypedValueParser;
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Expert-cache residency sweep (layer traces and synthetic models)"
)]
struct Args {
    /// Run on the CPU even when a GPU is available.
    #[arg(long)]
    cpu: bool,
    /// Where to write the JSON results (may be repeated).
    #[arg(long = "json", value_parser = candle_qmoe_suite::model::output_path)]
    json: Vec<std::path::PathBuf>,
    /// Decode steps per layer trace.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize))]
    trace_tokens: usize,
    /// Tokens generated per model run.
    #[arg(short = 'n', long, default_value_t = 24)]
    sample_len: usize,
    /// Synthetic models of the model sweep (olmoe, qwen2moe); none skips it.
    #[arg(long, value_delimiter = ',', default_value = "olmoe,qwen2moe",
          value_parser = ["olmoe", "qwen2moe", "none"])]
    models: Vec<String>,
    /// Fewer model runs: capacities at both ends and the middle only.
    #[arg(long)]
    quick: bool,
}

/// A layer shape of the sweep and its capacities (from the residency issue).
struct Shape {
    name: &'static str,
    kind: SyntheticKind,
    capacities: [usize; 5],
}

const SHAPES: [Shape; 2] = [
    Shape {
        name: "olmoe",
        kind: SyntheticKind::Olmoe,
        capacities: [8, 16, 32, 48, 64],
    },
    Shape {
        name: "qwen2moe",
        kind: SyntheticKind::Qwen2Moe,
        capacities: [12, 20, 30, 39, 60],
    },
];

/// Bytes of device memory in use (driver's view), `None` on the CPU.
fn device_used_bytes(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let (free, total) = d.cuda_stream().context().mem_get_info().ok()?;
        return Some((total - free) as u64);
    }
    let _ = device;
    None
}

/// The memory plan's device total for `kind` with `capacity` resident experts per MoE layer, this
/// sweep's context (the prompt plus `sample_len` tokens) and the prompt as one prefill chunk,
/// next to `used`, the device memory in use after the run (`cuMemGetInfo`: the whole device,
/// CUDA context included): `plan_device_bytes` `[min, max]`, `inside_plan` and the residual the
/// plan's `runtime_overhead` has to cover (`used` minus every other component's maximum). No
/// fields off the GPU, where `used` is `None`.
fn plan_vs_used(
    kind: SyntheticKind,
    device: &Device,
    capacity: usize,
    sample_len: usize,
    used: Option<u64>,
) -> Result<Value> {
    let Some(used) = used else {
        return Ok(json!({}));
    };
    let spec = kind.spec()?;
    let options = PlanOptions {
        ctx: Some(PROMPT.len() + sample_len),
        prefill_chunk: PROMPT.len(),
        residency: Resident::Uniform(capacity),
        ..PlanOptions::new(Target::of(device))
    };
    let plan = Plan::new(&spec, &options)?;
    let total = plan.total();
    let others: u64 = plan
        .components()
        .iter()
        .filter(|c| c.component != Component::RuntimeOverhead)
        .map(|c| c.bytes.max)
        .sum();
    Ok(json!({
        "plan_device_bytes": [total.min, total.max],
        "inside_plan": (total.min..=total.max).contains(&used),
        "residual_for_runtime_overhead_bytes": used as i64 - others as i64,
    }))
}

/// `row` with the fields of `extra` (an object) added.
fn with_fields(mut row: Value, extra: Value) -> Value {
    if let (Some(r), Value::Object(e)) = (row.as_object_mut(), extra) {
        r.extend(e);
    }
    row
}

/// " | device 2.02 GiB, plan 1.58–2.04 GiB: inside" for the progress lines (empty off the GPU).
fn plan_note(row: &Value) -> String {
    let gib = |v: &Value| v.as_f64().unwrap_or(0.0) / (1u64 << 30) as f64;
    match row["inside_plan"].as_bool() {
        Some(inside) => format!(
            " | device {:.2} GiB, plan {:.2}–{:.2} GiB: {}",
            gib(&row["device_used_bytes"]),
            gib(&row["plan_device_bytes"][0]),
            gib(&row["plan_device_bytes"][1]),
            if inside { "inside" } else { "OUTSIDE" }
        ),
        None => String::new(),
    }
}

fn synchronize(device: &Device) -> Result<()> {
    device.synchronize()?;
    Ok(())
}

/// One layer fed `ids` (decode, one token per step) through a cache of `capacity` slots.
fn layer_trace(
    device: &Device,
    shape: &Shape,
    pack: &candle_qmoe::pack::LayerPack,
    ids: &[u32],
    capacity: usize,
    policy: PolicyKind,
) -> Result<Value> {
    let moe = shape.kind.moe_shape();
    let res = Residency::new(ResidencyOptions {
        resident: Resident::Uniform(capacity),
        policy,
        ..Default::default()
    });
    let experts = res.layer(0, moe.top_k, pack.clone(), device)?;
    let dtype = Target::of(device).default_dtype();
    let tokens = ids.len() / moe.top_k;
    let x =
        Tensor::from_vec(gaussian(5, moe.hidden, 1.0), (1, moe.hidden), device)?.to_dtype(dtype)?;
    let w = Tensor::from_vec(
        vec![1.0f32 / moe.top_k as f32; moe.top_k],
        (1, moe.top_k),
        device,
    )?;
    let warm = tokens / 8;
    let mut start = Instant::now();
    let mut before = res.stats();
    for t in 0..tokens {
        if t == warm {
            synchronize(device)?;
            start = Instant::now();
            before = res.stats();
        }
        let row = Tensor::new(&ids[t * moe.top_k..(t + 1) * moe.top_k], device)?
            .reshape((1, moe.top_k))?;
        experts.forward(&x, &row, &w)?;
    }
    synchronize(device)?;
    let elapsed = start.elapsed().as_secs_f64();
    let s = res.stats().since(&before);
    let measured = (tokens - warm) as f64;
    Ok(json!({
        "shape": shape.name,
        "capacity": capacity,
        "policy": format!("{policy:?}").to_lowercase(),
        "tokens": tokens - warm,
        "hit_rate": s.hit_rate().unwrap_or(0.0),
        "h2d_bytes_per_token": s.h2d_bytes as f64 / measured,
        "us_per_token": 1e6 * elapsed / measured,
        "stall_s": s.stall_s,
        "peak_cache_bytes": res.peak_device_bytes(),
    }))
}

fn layer_sweep(args: &Args, device: &Device) -> Result<Vec<Value>> {
    let mut rows = Vec::new();
    for shape in &SHAPES {
        let moe = shape.kind.moe_shape();
        let layout = moe.layout(GroupSize::default());
        let pack = random_layer_pack(17, layout, moe.experts)?;
        let (uniform, _) = random_routing(3, args.trace_tokens, moe.top_k, moe.experts);
        let skewed = skewed_routing(3, args.trace_tokens, moe.top_k, moe.experts, 1.0, 0.5);
        for (trace, ids) in [("uniform", &uniform), ("skewed", &skewed)] {
            let policies: &[PolicyKind] = match trace {
                "uniform" => &[PolicyKind::Lru],
                _ => &[PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::Lfru],
            };
            for &capacity in &shape.capacities {
                for &policy in policies {
                    let mut row = layer_trace(device, shape, &pack, ids, capacity, policy)?;
                    row["trace"] = json!(trace);
                    eprintln!(
                        "{:9} {:8} C={:2} {:5} hit {:5.1}%  {:7.2} MB/token  {:8.0} µs/token",
                        shape.name,
                        trace,
                        capacity,
                        row["policy"].as_str().unwrap_or(""),
                        100.0 * row["hit_rate"].as_f64().unwrap_or(0.0),
                        row["h2d_bytes_per_token"].as_f64().unwrap_or(0.0) / 1e6,
                        row["us_per_token"].as_f64().unwrap_or(0.0)
                    );
                    rows.push(row);
                }
            }
        }
    }
    Ok(rows)
}

const PROMPT: [u32; 8] = [510, 3158, 8516, 30013, 27287, 689, 253, 22658];

/// Decodes each synthetic model at full residency, then through bounded caches; every row is
/// appended to `doc["models"]` and saved at once, so a run cut short keeps what it measured.
fn model_sweep(args: &Args, device: &Device, doc: &mut Value) -> Result<()> {
    let dtype = Target::of(device).default_dtype();
    doc["models"] = json!([]);
    let push = |doc: &mut Value, row: Value| -> Result<()> {
        if let Some(rows) = doc["models"].as_array_mut() {
            rows.push(row);
        }
        save(args, doc)
    };
    for name in &args.models {
        let shape = SHAPES
            .iter()
            .find(|s| s.name == name)
            .with_context(|| format!("unknown model `{name}` (olmoe, qwen2moe)"))?;
        let moe = shape.kind.moe_shape();
        let synth = SyntheticModel::new(shape.kind, 42, GroupSize::default())?;
        let mut full = synth.load(dtype, device, &synth.int4_experts())?;
        let reference = generate(&mut full, &PROMPT, args.sample_len, &[], argmax, |_| Ok(()))?;
        let used = device_used_bytes(device);
        let row = json!({
            "model": name, "capacity": moe.experts, "cache": false, "prefetch": false,
            "hybrid": "off", "decode_tokens_per_s": reference.decode_tokens_per_s(),
            "tokens_identical": true, "device_used_bytes": used,
        });
        let row = with_fields(
            row,
            plan_vs_used(shape.kind, device, moe.experts, args.sample_len, used)?,
        );
        eprintln!(
            "{name:9} C={:2} no cache                     {:6.2} tok/s{}",
            moe.experts,
            reference.decode_tokens_per_s().unwrap_or(0.0),
            plan_note(&row)
        );
        push(doc, row)?;
        drop(full);
        let caps: Vec<usize> = match args.quick {
            true => vec![
                shape.capacities[0],
                shape.capacities[2],
                shape.capacities[4],
            ],
            false => shape.capacities.to_vec(),
        };
        for &capacity in &caps {
            let variants: &[(bool, HybridMode)] = match capacity == moe.experts {
                true => &[(false, HybridMode::Off)],
                false => &[
                    (false, HybridMode::Off),
                    (true, HybridMode::Off),
                    (false, HybridMode::Auto),
                ],
            };
            for &(prefetch, hybrid) in variants {
                let experts = synth.int4_experts().with_residency(ResidencyOptions {
                    resident: Resident::Uniform(capacity),
                    prefetch,
                    hybrid,
                    ..Default::default()
                });
                let mut model = synth.load(dtype, device, &experts)?;
                if prefetch {
                    model.enable_prefetch();
                }
                let g = generate(
                    &mut model,
                    &PROMPT,
                    args.sample_len,
                    &[],
                    argmax,
                    |_| Ok(()),
                )?;
                let res = experts.residency().context("residency")?;
                let s = res.stats();
                let row = json!({
                    "model": name, "capacity": capacity, "cache": true, "prefetch": prefetch,
                    "hybrid": format!("{hybrid:?}").to_lowercase(),
                    "decode_tokens_per_s": g.decode_tokens_per_s(),
                    "prompt_tokens_per_s": g.prompt_tokens_per_s(),
                    "tokens_identical": g.tokens == reference.tokens,
                    "hits": s.hits, "misses": s.misses, "hit_rate": s.hit_rate(),
                    "h2d_bytes": s.h2d_bytes, "evictions": s.evictions,
                    "prefetch_issued": s.prefetch_issued, "prefetch_used": s.prefetch_used,
                    "prefetch_wasted": s.prefetch_wasted, "hybrid_cpu_experts": s.hybrid_cpu_experts,
                    "stall_s": s.stall_s, "peak_cache_bytes": res.peak_device_bytes(),
                    "device_used_bytes": device_used_bytes(device),
                });
                let used = row["device_used_bytes"].as_u64();
                let row = with_fields(
                    row,
                    plan_vs_used(shape.kind, device, capacity, args.sample_len, used)?,
                );
                eprintln!(
                    "{name:9} C={capacity:2} prefetch={prefetch:5} hybrid={:5} {:6.2} tok/s  hit {:5.1}%  h2d {:8.1} MB  same tokens: {}{}",
                    row["hybrid"].as_str().unwrap_or(""),
                    g.decode_tokens_per_s().unwrap_or(0.0),
                    100.0 * s.hit_rate().unwrap_or(0.0),
                    s.h2d_bytes as f64 / 1e6,
                    g.tokens == reference.tokens,
                    plan_note(&row)
                );
                push(doc, row)?;
            }
        }
    }
    Ok(())
}

fn save(args: &Args, doc: &Value) -> Result<()> {
    for p in &args.json {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(p, serde_json::to_string_pretty(doc)? + "\n")
            .with_context(|| format!("cannot write `{}`", p.display()))?;
    }
    Ok(())
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    let device = if args.cpu {
        Device::Cpu
    } else {
        Device::cuda_if_available(0)?
    };
    let mut doc = json!({
        "schema": "candle-qmoe/residency-sweep/1",
        "device": candle_qmoe_suite::system::device_json(&device),
        "commit": candle_qmoe_suite::system::git_commit(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "trace_note": "uniform = random_routing (what random weights produce); skewed = \
                       skewed_routing(seed 3, zipf 1.0, reuse 0.5); first 1/8 of each trace \
                       warms the cache and is not measured",
    });
    doc["layer_traces"] = json!(layer_sweep(&args, &device)?);
    save(&args, &doc)?;
    if !args.models.iter().any(|m| m == "none") {
        model_sweep(&args, &device, &mut doc)?;
    }
    Ok(())
}
