//! Times one MoE layer's routed experts on the CPU, side by side in one run: the INT4 W4A16
//! kernel, dense F32 and BF16 Candle matmuls, and Candle's own quantized `QMatMul` (Q4K, Q4_0).
//! Prints one JSON line (and appends it to `--json PATH` when given).
//!
//! At the model shapes the INT4 backends and Q4K hold `--layers` copies of the layer in memory
//! of their own, and consecutive calls go through them as a decode step goes through a model's
//! layers, with the routing advancing across the whole run: as in a model, a call's experts were
//! last read a whole step (every other layer) before, so a last-level cache larger than one layer
//! holds few of them (the JSON gives `int4_working_set_bytes` next to `llc_bytes`). The order of
//! the backends rotates by one each iteration, so every backend is timed equally often after
//! each of the others. Calls come from a pool thread, and the INT4 backends' bursts run with
//! rayon's workers kept awake, as a model's forward pass runs them. Alongside them,
//! `experts_read` only reads each call's expert slabs (the same bytes, no arithmetic): what this
//! machine's memory delivers in the same minutes, which on a shared host can differ 2× from
//! the read probe taken at the end.
//!
//! ```text
//! cargo run --release --example layer_bench -- --shape olmoe --tokens 1
//! ```

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use candle::quantized::GgmlDType;
use candle::{DType, Device, Tensor};
use candle_qmoe::kernels::cpu::{CpuIsa, DecodeActivations, W4A8_MIN_TOKENS};
use candle_qmoe::pack::{DenseExpert, ExpertNames, GroupSize, LayerPack, ScaleSearch};
use candle_qmoe::synthetic::{MoeShape, SyntheticKind};
use candle_qmoe::{synthetic, DenseExperts, GgmlExperts, Int4Experts, RoutedExperts};
use candle_qmoe_suite::model::output_path;
use candle_qmoe_suite::perf::median;
use candle_qmoe_suite::system::memory_bandwidth;
use candle_qmoe_suite::testing::{rel_err, values_f64};
use clap::builder::TypedValueParser;
use clap::{Parser, ValueEnum};
use serde_json::json;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Shape {
    /// OLMoE-1B-7B: H 2048, I 1024, 64 experts, top-8.
    Olmoe,
    /// Qwen1.5-MoE-A2.7B: H 2048, I 1408, 60 experts, top-4.
    Qwen,
    /// Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8 (the down projection's rows hold 6
    /// groups of 128, fewer than a run of 8).
    Qwen3,
    /// H 1024, I 256, 4 experts, top-4: 1.6 MB of INT4 that every call reads whole, resident
    /// in a 2 MB L2 (in L3 where L2 is smaller): the kernels' compute rate, which sets the
    /// pace on machines whose cores, not their memory, are the limit.
    Cached,
    /// OLMoE's matrices (H 2048, I 1024), 2 experts, top-2: 6.5 MB that every call reads whole,
    /// resident in a 32 MB L3: the compute rate at OLMoE's row lengths (`cached`'s down rows
    /// hold two groups, so its per-row costs weigh more than a real layer's).
    L3,
}

impl Shape {
    /// Copies of the layer the calls go through by default: OLMoE's 16 layers at the model
    /// shapes; one for the shapes that measure the compute rate from cache.
    fn default_layers(self) -> usize {
        match self {
            Self::Olmoe | Self::Qwen | Self::Qwen3 => 16,
            Self::Cached | Self::L3 => 1,
        }
    }

    /// The name in evidence files and the layer shape.
    fn moe(self) -> (&'static str, MoeShape) {
        match self {
            Self::Olmoe => ("olmoe", SyntheticKind::Olmoe.moe_shape()),
            Self::Qwen => ("qwen1.5-moe", SyntheticKind::Qwen2Moe.moe_shape()),
            Self::Qwen3 => ("qwen3-30b-a3b", SyntheticKind::Qwen3Moe.moe_shape()),
            Self::Cached => (
                "cached",
                MoeShape {
                    hidden: 1024,
                    intermediate: 256,
                    experts: 4,
                    top_k: 4,
                },
            ),
            Self::L3 => (
                "l3",
                MoeShape {
                    hidden: 2048,
                    intermediate: 1024,
                    experts: 2,
                    top_k: 2,
                },
            ),
        }
    }
}

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Side-by-side timing of one MoE layer's routed experts on the CPU"
)]
struct Args {
    /// Model shape.
    #[arg(long, value_enum, default_value = "olmoe")]
    shape: Shape,
    /// Tokens per call (1 = decode), at most 4096.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096).map(|v| v as usize))]
    tokens: usize,
    /// INT4 group size.
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// Timed iterations per backend (round-robin across backends).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize))]
    iters: Option<usize>,
    /// Consecutive calls per timed sample (each on the next routing), as the MoE layers of one
    /// decode step follow each other; the time is reported per call. 1 times single calls
    /// after an idle pause, which on small VMs adds the wake-up of an idle core to every call.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..).map(|v| v as usize))]
    burst: usize,
    /// Copies of the layer, each in memory of its own, that consecutive calls go through (the
    /// INT4 backends and Candle's Q4K; the dense baselines and Q4_0, which compute far slower
    /// than memory reads, hold one): default 16 at the model shapes, 1 for `cached` and `l3`.
    #[arg(long)]
    layers: Option<usize>,
    /// Random seed for weights, activations and routing.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Append the JSON line to this file.
    #[arg(long, value_parser = output_path)]
    json: Option<std::path::PathBuf>,
}

/// A backend's copies of the layer, which consecutive calls go through.
type Layers = Vec<Box<dyn RoutedExperts>>;

/// `‖a − b‖ / ‖b‖` of two tensors, in f64.
fn tensor_rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    Ok(rel_err(&values_f64(a)?, &values_f64(b)?))
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    let (name, shape) = args.shape.moe();
    let MoeShape {
        hidden,
        intermediate: inter,
        experts,
        top_k: k,
    } = shape;
    let t = args.tokens;
    if t == 0 {
        bail!("--tokens must be at least 1");
    }
    let iters = args.iters.unwrap_or(if t <= 8 { 30 } else { 6 });
    let layers = args.layers.unwrap_or(args.shape.default_layers());
    if layers == 0 {
        bail!("--layers must be at least 1");
    }
    let layout = shape.layout(GroupSize::new(args.group_size)?);
    let dev = Device::Cpu;
    eprintln!("building {experts} random experts (std 0.02) at H {hidden}, I {inter}…");
    let dense = synthetic::random_experts(args.seed, experts, hidden, inter, 0.02)?;
    let t0 = Instant::now();
    let pack = LayerPack::quantize("layer", ExpertNames::PROJ, &dense, layout, ScaleSearch::Mse)?;
    let quantize_s = t0.elapsed().as_secs_f64();
    let rtn = LayerPack::quantize("layer", ExpertNames::PROJ, &dense, layout, ScaleSearch::Rtn)?;
    eprintln!("quantized in {quantize_s:.1}s; building baselines and {layers} copies…");
    // The pack again in memory of its own for every further layer.
    let packs: Vec<LayerPack> = std::iter::once(Ok(pack.clone()))
        .chain((1..layers).map(|_| LayerPack::from_bytes(layout, experts, Arc::from(pack.bytes()))))
        .collect::<Result<_, _>>()?;
    let int4_layers = |make: &dyn Fn(LayerPack) -> Int4Experts| -> Layers {
        packs
            .iter()
            .map(|p| Box::new(make(p.clone())) as Box<dyn RoutedExperts>)
            .collect()
    };
    let ggml_layers = |first: GgmlExperts| -> Result<Layers> {
        let copies = (1..layers)
            .map(|_| Ok(Box::new(first.copied()?) as Box<dyn RoutedExperts>))
            .collect::<Result<Vec<_>>>()?;
        Ok(std::iter::once(Box::new(first) as Box<dyn RoutedExperts>)
            .chain(copies)
            .collect())
    };
    let int4 = Int4Experts::new(pack.clone());
    // The kernel on every other vector instruction set this CPU has, timed alongside; below
    // W4A8_MIN_TOKENS also every vector path with the other decode activations
    // (`int4_<isa>_<acts>`).
    let acts = int4.decode_activations();
    let other_acts = match acts {
        DecodeActivations::I16 => DecodeActivations::I8,
        DecodeActivations::I8 => DecodeActivations::I16,
    };
    let vector_isas = CpuIsa::ALL
        .into_iter()
        .filter(|&isa| isa != CpuIsa::Scalar && isa.is_available());
    let other_isas: Vec<(String, Layers)> = vector_isas
        .flat_map(|isa| {
            let same = (isa != int4.isa()).then(|| {
                let name = format!("int4_{}", isa.name());
                (name, int4_layers(&|p| Int4Experts::with_isa(p, isa)))
            });
            let other = (t < W4A8_MIN_TOKENS).then(|| {
                let name = format!("int4_{}_{}", isa.name(), other_acts.name());
                let make = |p| Int4Experts::with_isa(p, isa).with_decode_activations(other_acts);
                (name, int4_layers(&make))
            });
            same.into_iter().chain(other)
        })
        .collect();
    let f32_experts = DenseExperts::new(dense.clone())?;
    let bf16_experts = DenseExperts::new(
        dense
            .iter()
            .map(|x| {
                Ok(DenseExpert {
                    gate: x.gate.to_dtype(DType::BF16)?,
                    up: x.up.to_dtype(DType::BF16)?,
                    down: x.down.to_dtype(DType::BF16)?,
                })
            })
            .collect::<Result<_>>()?,
    )?;
    // Q4K needs K to be a multiple of 256 (Qwen's down projection has K = 1408).
    let q4k = if inter % 256 == 0 && hidden % 256 == 0 {
        Some(GgmlExperts::quantize(&dense, GgmlDType::Q4K)?)
    } else {
        None
    };
    let q4_0 = GgmlExperts::quantize(&dense, GgmlDType::Q4_0)?;

    // Distinct routings, cycled, so that repeated calls do not find the experts in cache (but
    // for `--shape cached` and `l3`, whose every call reads all its experts).
    let routings: Vec<(Tensor, Tensor, Tensor)> = (0..8u64)
        .map(|r| {
            let seed = args.seed + 1000 * (r + 1);
            let xs = synthetic::gaussian(seed, t * hidden, 1.0);
            let (ids, w) = synthetic::random_routing(seed, t, k, experts);
            Ok((
                Tensor::from_vec(xs, (t, hidden), &dev)?,
                Tensor::from_vec(ids, (t, k), &dev)?,
                Tensor::from_vec(w, (t, k), &dev)?,
            ))
        })
        .collect::<Result<_>>()?;

    // Accuracy on the first routing.
    let (xs, ids, w) = &routings[0];
    let deq = DenseExperts::new(pack.dequantize_experts(DType::F32, &dev)?)?;
    let deq_out = deq.forward(xs, ids, w)?;
    let exact = f32_experts.forward(xs, ids, w)?;
    let kernel_rel_err = tensor_rel_err(&int4.forward(xs, ids, w)?, &deq_out)?;
    let quant_rel_err = tensor_rel_err(&deq_out, &exact)?;
    let rtn_out =
        DenseExperts::new(rtn.dequantize_experts(DType::F32, &dev)?)?.forward(xs, ids, w)?;
    let rtn_quant_rel_err = tensor_rel_err(&rtn_out, &exact)?;
    drop((deq, rtn));

    let one = |e: Box<dyn RoutedExperts>| -> Layers { vec![e] };
    let reads: Layers = packs
        .iter()
        .map(|p| Box::new(ExpertsRead(p.clone())) as Box<dyn RoutedExperts>)
        .collect();
    let mut backends: Vec<(String, Layers)> = vec![
        ("int4".into(), int4_layers(&Int4Experts::new)),
        (EXPERTS_READ.into(), reads),
        ("dense_f32".into(), one(Box::new(f32_experts))),
        ("dense_bf16".into(), one(Box::new(bf16_experts))),
        ("candle_q4_0".into(), one(Box::new(q4_0))),
    ];
    if let Some(q) = q4k {
        backends.push(("candle_q4k".into(), ggml_layers(q)?));
    }
    let other_names: Vec<String> = other_isas.iter().map(|(n, _)| n.clone()).collect();
    backends.extend(other_isas);
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); backends.len()];
    eprintln!(
        "timing {iters} round-robin iterations of {} calls…",
        args.burst.max(1)
    );
    let burst = args.burst.max(1);
    // Calls are made from a pool thread, as the models make them (`on_rayon_pool`): from
    // outside, every parallel op would wake the caller when it ends, which the examples and the
    // server never pay (and which made long bursts of small calls 2–4× slower on a VM).
    candle_qmoe::pool::on_rayon_pool(|| -> Result<()> {
        // Calls of the whole run, every backend's: call `c` goes to layer `c mod layers` with
        // routing `c / layers` (cycled), so a layer's experts come back only after every
        // other layer's.
        let mut call = 0usize;
        for it in 0..iters + 2 {
            // The order rotates by one each iteration: each backend follows each other one.
            for b in (0..backends.len()).map(|p| (it + p) % backends.len()) {
                let copies = &backends[b].1;
                // Let the previous backend's worker threads park: Candle's CPU thread pool
                // spins for about a millisecond after each op, which would steal a core from
                // the next one.
                std::thread::sleep(std::time::Duration::from_millis(10));
                let run_burst = |call: &mut usize| -> Result<f64> {
                    let start = Instant::now();
                    for _ in 0..burst {
                        let (xs, ids, w) = &routings[(*call / layers) % routings.len()];
                        let layer = &copies[*call % layers % copies.len()];
                        std::hint::black_box(layer.forward(xs, ids, w)?);
                        *call += 1;
                    }
                    Ok(start.elapsed().as_secs_f64() * 1e3 / burst as f64)
                };
                // Our backends run as a model step runs them, with rayon's workers kept
                // awake (`pool::with_workers_awake`); left to fall asleep between calls, a
                // worker's wake-up went into every parallel op (one OLMoE layer on 2 threads:
                // 1.17 ms against 1.07–1.08). Candle's backends use their own pool, which spins
                // between ops by itself: polling rayon workers would only take its cores.
                let ms = if backends[b].0.starts_with("int4") || backends[b].0 == EXPERTS_READ {
                    candle_qmoe::pool::with_workers_awake(|| run_burst(&mut call))?
                } else {
                    run_burst(&mut call)?
                };
                if it >= 2 {
                    times[b].push(ms);
                }
            }
        }
        Ok(())
    })?;
    let ms: Vec<f64> = times.iter_mut().map(|v| median(v)).collect();
    // The fastest sample is the least disturbed (on a shared host, a sibling thread's load can
    // slow a compute-bound sample 1.5×).
    let min_ms: std::collections::BTreeMap<&str, f64> = backends
        .iter()
        .zip(&times)
        .map(|((n, _), v)| {
            (
                n.as_str(),
                v.iter().copied().reduce(f64::min).unwrap_or(f64::NAN),
            )
        })
        .collect();
    let mut distinct = 0usize;
    for (_, ids, _) in &routings {
        let mut e = ids.flatten_all()?.to_vec1::<u32>()?;
        e.sort_unstable();
        e.dedup();
        distinct += e.len();
    }
    let experts_per_call = distinct as f64 / routings.len() as f64;
    let act_bytes = (2 * t * hidden * 4) as f64;
    let bytes_moved = experts_per_call * layout.slab_bytes() as f64 + act_bytes;
    let gb_per_s = bytes_moved / (ms[0] * 1e-3) / 1e9;
    let bw = memory_bandwidth();
    let (read_gb_per_s, copy_gb_per_s) = (bw.read_gb_per_s, bw.copy_gb_per_s);
    let get = |n: &str| backends.iter().position(|(b, _)| b == n).map(|i| ms[i]);
    let mut line = json!({
        "device": candle_qmoe_suite::system::cpu_model(), "commit": candle_qmoe_suite::system::git_commit(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "shape": name, "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": k,
        "tokens": t, "group_size": args.group_size, "cpu_isa": int4.isa().name(),
        "decode_acts": acts.name(),
        "int4_ms_by_isa": other_names.iter().map(|n| (n.trim_start_matches("int4_"), get(n)))
            .chain([(int4.isa().name(), Some(ms[0]))]).collect::<std::collections::BTreeMap<_, _>>(),
        "threads": rayon::current_num_threads(), "iters": iters, "burst": burst,

        "caller": "pool thread, workers awake for int4", "min_ms": min_ms,
        "int4_ms": ms[0], "dense_f32_ms": get("dense_f32"), "dense_bf16_ms": get("dense_bf16"),
        "candle_q4k_ms": get("candle_q4k"), "candle_q4_0_ms": get("candle_q4_0"),
        "speedup_vs_dense_f32": get("dense_f32").map(|d| d / ms[0]),
        "speedup_vs_candle_q4k": get("candle_q4k").map(|d| d / ms[0]),
        "speedup_vs_candle_q4_0": get("candle_q4_0").map(|d| d / ms[0]),
        "kernel_rel_err": kernel_rel_err, "quant_rel_err": quant_rel_err,
        "rtn_quant_rel_err": rtn_quant_rel_err,
        "experts_per_call": experts_per_call, "slab_bytes": layout.slab_bytes(),
        "bytes_moved": bytes_moved, "gb_per_s": gb_per_s,
        "read_gb_per_s": read_gb_per_s, "copy_gb_per_s": copy_gb_per_s,
        "fraction_of_read_bw": gb_per_s / read_gb_per_s,
        "experts_read_ms": get(EXPERTS_READ),
        "experts_read_gb_per_s": get(EXPERTS_READ).map(|r| bytes_moved / (r * 1e-3) / 1e9),
        "fraction_of_experts_read": get(EXPERTS_READ).map(|r| r / ms[0]),
        "quantize_s": quantize_s,
    });
    // The memory each call reads from (outside the `json!` above: its recursion limit).
    line["layers"] = json!(layers);
    let single: Vec<&str> = backends
        .iter()
        .filter(|(_, copies)| copies.len() < layers)
        .map(|(n, _)| n.as_str())
        .collect();
    line["single_layer_backends"] = json!(single);
    line["backend_order"] = json!("rotating");
    line["int4_working_set_bytes"] = json!(layers * experts * layout.slab_bytes());
    line["llc_bytes"] = json!(candle_qmoe_suite::system::last_level_cache_bytes());
    println!("{line}");
    if let Some(path) = args.json {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        writeln!(f, "{line}")?;
    }
    Ok(())
}

/// The backend that only reads the routed experts' slabs.
const EXPERTS_READ: &str = "experts_read";

/// Reads the slabs of a call's distinct experts (an XOR fold of 64 KiB pieces on rayon's pool)
/// and returns zeros: the bytes an INT4 call moves, without its arithmetic.
struct ExpertsRead(LayerPack);

impl RoutedExperts for ExpertsRead {
    fn num_experts(&self) -> usize {
        self.0.num_experts()
    }
    fn hidden_size(&self) -> usize {
        self.0.layout().hidden
    }
    fn bytes_per_expert(&self) -> usize {
        self.0.layout().slab_bytes()
    }
    fn forward(&self, xs: &Tensor, expert_ids: &Tensor, _: &Tensor) -> candle::Result<Tensor> {
        use rayon::prelude::*;
        let mut experts = expert_ids.flatten_all()?.to_vec1::<u32>()?;
        experts.sort_unstable();
        experts.dedup();
        let fold = experts
            .par_iter()
            .flat_map(|&e| self.0.slab(e as usize).bytes.par_chunks(1 << 16))
            .map(|piece| {
                piece.chunks_exact(8).fold(0u64, |a, b| {
                    a ^ u64::from_le_bytes(b.try_into().expect("8 bytes"))
                })
            })
            .reduce(|| 0, |a, b| a ^ b);
        std::hint::black_box(fold);
        xs.zeros_like()
    }
}
