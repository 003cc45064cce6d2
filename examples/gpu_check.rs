//! One-call GPU check of the CUDA W4A16 routed-experts kernels (needs `--features cuda`).
//!
//! 1. Device facts and the measured device-to-device copy bandwidth (bytes read + written).
//! 2. Correctness of both kernel paths against F32 matmuls on the dequantized slabs (the dense
//!    oracle; the CPU INT4 kernel rounds activations) on fresh random slabs, activations and
//!    routings: OLMoE (H2048, I1024, E64, k8) and Qwen1.5-MoE (H2048, I1408, E60,
//!    k4) shapes, T ∈ {1, 4, 16, 128, 1024}, groups {64, 128, 256}, BF16 activations (F16 and F32
//!    at group 128), every output and scratch buffer NaN-poisoned before the launch, a second run
//!    compared bit for bit.
//! 3. Timings with CUDA events (warm-up, then the median of many runs, L2 flushed before each):
//!    our decode and prefill paths against Candle's `moe_gemm` (BF16 WMMA) and `moe_gemm_gguf`
//!    (Q4K) on the same routed problem, with the bytes each must move and the achieved GB/s;
//!    without `--quick`, a decode scan over the number of experts read (fixed cost and cost per
//!    expert).
//!
//! Prints a table last and writes the JSON (device, driver, commit, every figure) to each
//! `--json` path, after every section so a crash keeps what was measured.
//!
//! ```text
//! cargo run --release --features cuda --example gpu_check -- --json out.json --commit $(git rev-parse HEAD)
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use candle::cuda_backend::cudarc::driver::{self, sys, CudaSlice, CudaStream, DevicePtr};
use candle::quantized::{GgmlDType, QStorage, QTensor};
use candle::{DType, Device, Tensor, D};
use candle_qmoe::kernels::cuda::{CudaPath, DeviceExperts};
use candle_qmoe::pack::{ExpertLayout, GroupSize, LayerPack};
use candle_qmoe::synthetic::{gaussian, random_layer_pack, random_routing};
use candle_qmoe::{DenseExperts, Int4Experts, RoutedExperts};
use clap::Parser;
use half::bf16;
use rayon::prelude::*;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(
    allow_negative_numbers = true,
    about = "Correctness and timings of the CUDA W4A16 routed-experts kernels"
)]
struct Args {
    /// Where to write the JSON results (repeatable).
    #[arg(long = "json")]
    json: Vec<PathBuf>,
    /// Commit the binaries were built from (default: $QMOE_COMMIT, else "unknown").
    #[arg(long)]
    commit: Option<String>,
    /// Fewer cases and iterations (a smoke run).
    #[arg(long)]
    quick: bool,
    /// Timed iterations per decode measurement (prefill uses a third, at least 10).
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Skip the Candle baselines.
    #[arg(long)]
    no_baselines: bool,
}

#[derive(Clone, Copy, Debug)]
struct Model {
    name: &'static str,
    hidden: usize,
    inter: usize,
    experts: usize,
    k: usize,
}

const OLMOE: Model = Model {
    name: "olmoe",
    hidden: 2048,
    inter: 1024,
    experts: 64,
    k: 8,
};
const QWEN: Model = Model {
    name: "qwen1.5-moe",
    hidden: 2048,
    inter: 1408,
    experts: 60,
    k: 4,
};

/// Results so far, rewritten to every `--json` path after each section.
struct Report {
    paths: Vec<PathBuf>,
    doc: Value,
}

impl Report {
    fn save(&self) {
        let text = serde_json::to_string_pretty(&self.doc).expect("json");
        for p in &self.paths {
            if let Some(dir) = p.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            if let Err(e) = std::fs::write(p, &text) {
                eprintln!("cannot write {}: {e}", p.display());
            }
        }
    }
}

fn driver_version() -> Option<String> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: cuDriverGetVersion writes one int through the valid pointer it is given.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    (r == sys::CUresult::CUDA_SUCCESS).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

fn nvidia_smi_driver() -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=driver_version", "--format=csv,noheader"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// CUDA-event timing on the device's stream: each run is preceded by a 2 GiB memset that
/// flushes the L2 and keeps the GPU busy while the host enqueues the timed work, so the events
/// measure device time, not launch overhead — as long as enqueueing takes less than the flush
/// (`flush_us`, measured once); a row where it does not is marked `host_bound`.
struct Timer {
    stream: Arc<CudaStream>,
    flush: CudaSlice<u8>,
    flush_us: f64,
}

#[derive(Clone, Debug)]
struct Stats {
    median_us: f64,
    p10_us: f64,
    p90_us: f64,
    host_enqueue_us: f64,
    runs: usize,
}

impl Timer {
    fn new(dev: &candle::CudaDevice) -> Result<Self> {
        let stream = dev.cuda_stream();
        let flush = dev.alloc_zeros::<u8>(2 << 30)?;
        let mut t = Self {
            stream,
            flush,
            flush_us: 0.0,
        };
        // One flush, timed like any work (`time` warms the clocks first).
        let flush_us = t.time(2, 10, |i| t.flush_l2(i as u8))?.median_us;
        t.flush_us = flush_us;
        Ok(t)
    }

    /// Keeps the GPU busy with flushes for `ms` milliseconds, so that an idle GPU's low clocks
    /// have ramped up before a measurement (clock settings are left alone).
    fn warm_clocks(&self, ms: u64) -> Result<()> {
        let t0 = Instant::now();
        while t0.elapsed().as_millis() < ms as u128 {
            for i in 0..8 {
                self.flush_l2(i)?;
            }
            self.stream.synchronize()?;
        }
        Ok(())
    }

    fn flush_l2(&self, byte: u8) -> Result<()> {
        let (p, _g) = self.flush.device_ptr(&self.stream);
        // SAFETY: `p` is the device address of `self.flush`, 2 GiB long, on this stream.
        unsafe {
            driver::result::memset_d8_async(p, byte, self.flush.len(), self.stream.cu_stream())
        }?;
        Ok(())
    }

    /// Median (and spread) of `runs` timed calls of `f(i)` after `warmup` untimed ones.
    fn time(
        &self,
        warmup: usize,
        runs: usize,
        mut f: impl FnMut(usize) -> Result<()>,
    ) -> Result<Stats> {
        self.warm_clocks(200)?;
        for i in 0..warmup {
            f(i)?;
        }
        self.stream.synchronize()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (mut times, mut host) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
        for i in 0..runs {
            self.flush_l2(i as u8)?;
            let start = self.stream.record_event(flags)?;
            let t0 = Instant::now();
            f(warmup + i)?;
            host.push(t0.elapsed().as_secs_f64() * 1e6);
            let end = self.stream.record_event(flags)?;
            times.push(start.elapsed_ms(&end)? as f64 * 1e3);
        }
        let q = |v: &mut Vec<f64>, f: f64| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[((v.len() - 1) as f64 * f).round() as usize]
        };
        Ok(Stats {
            median_us: q(&mut times, 0.5),
            p10_us: q(&mut times, 0.1),
            p90_us: q(&mut times, 0.9),
            host_enqueue_us: q(&mut host, 0.5),
            runs,
        })
    }
}

/// Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of 20.
fn copy_bandwidth(dev: &candle::CudaDevice, timer: &Timer) -> Result<(f64, Stats)> {
    let bytes = 1usize << 30;
    let src = dev.alloc_zeros::<u8>(bytes)?;
    let mut dst = dev.alloc_zeros::<u8>(bytes)?;
    let stream = dev.cuda_stream();
    {
        let (p, _g) = src.device_ptr(&stream);
        // SAFETY: `p` addresses the `bytes` bytes of `src` on this stream.
        unsafe { driver::result::memset_d8_async(p, 0x5a, bytes, stream.cu_stream()) }?;
    }
    let st = timer.time(3, 20, |_| {
        dev.memcpy_dtod(&src, &mut dst)?;
        Ok(())
    })?;
    Ok((2.0 * bytes as f64 / (st.median_us * 1e-6) / 1e9, st))
}

fn layout(m: Model, group: usize) -> Result<ExpertLayout> {
    Ok(ExpertLayout {
        hidden: m.hidden,
        intermediate: m.inter,
        group_size: GroupSize::new(group)?,
    })
}

fn activations(seed: u64, tokens: usize, hidden: usize) -> Vec<f32> {
    let mut xs = gaussian(seed, tokens * hidden, 1.0);
    for v in xs.iter_mut().step_by(61) {
        *v *= 8.0;
    }
    xs
}

fn rel_err(got: &[f32], want: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (&a, &b) in got.iter().zip(want) {
        let d = (a as f64 - b as f64).abs();
        num += d * d;
        den += (b as f64) * (b as f64);
        max = max.max(d);
    }
    ((num / den.max(f64::MIN_POSITIVE)).sqrt(), max)
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        _ => 1e-4,
    }
}

/// One correctness case: both paths (decode only for T ≤ 16) against the dense F32 oracle.
#[allow(clippy::too_many_arguments)]
fn check_case(
    dev: &Device,
    m: Model,
    group: usize,
    oracle: &DenseExperts,
    experts: &Arc<DeviceExperts>,
    tokens: usize,
    dtype: DType,
    seed: u64,
) -> Vec<Value> {
    let mut out = Vec::new();
    let prep = || -> Result<(Tensor, Tensor, Tensor, Vec<f32>)> {
        let cpu = Device::Cpu;
        let x = Tensor::from_vec(
            activations(seed, tokens, m.hidden),
            (tokens, m.hidden),
            &cpu,
        )?
        .to_dtype(dtype)?
        .to_dtype(DType::F32)?;
        let (ids, w) = random_routing(seed ^ 0xabc, tokens, m.k, m.experts);
        let ids = Tensor::from_vec(ids, (tokens, m.k), &cpu)?;
        let w = Tensor::from_vec(w, (tokens, m.k), &cpu)?;
        let want = oracle
            .forward(&x, &ids, &w)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok((
            x.to_dtype(dtype)?.to_device(dev)?,
            ids.to_device(dev)?,
            w.to_device(dev)?,
            want,
        ))
    };
    let base = json!({"model": m.name, "group": group, "tokens": tokens, "dtype": format!("{dtype:?}").to_lowercase()});
    let (x, ids, w, want) = match prep() {
        Ok(v) => v,
        Err(e) => {
            let mut r = base.clone();
            r["error"] = json!(format!("{e:#}"));
            r["pass"] = json!(false);
            out.push(r);
            return out;
        }
    };
    let paths: &[CudaPath] = if tokens <= 16 {
        &[CudaPath::Decode, CudaPath::Prefill]
    } else {
        &[CudaPath::Prefill]
    };
    for &path in paths {
        let mut r = base.clone();
        r["path"] = json!(format!("{path:?}").to_lowercase());
        let run = || -> Result<Vec<f32>> {
            let y = experts.forward_tensors(&x, &ids, &w, path, true)?;
            Ok(y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        match run().and_then(|a| Ok((a, run()?))) {
            Ok((got, again)) => {
                let nonfinite = got.iter().filter(|v| !v.is_finite()).count();
                let (err, max_abs) = rel_err(&got, &want);
                let same = got
                    .iter()
                    .zip(&again)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                let pass = nonfinite == 0 && err <= tolerance(dtype) && same;
                r["rel_l2_err"] = json!(err);
                r["max_abs_err"] = json!(max_abs);
                r["nonfinite"] = json!(nonfinite);
                r["deterministic"] = json!(same);
                r["tolerance"] = json!(tolerance(dtype));
                r["pass"] = json!(pass);
            }
            Err(e) => {
                r["error"] = json!(format!("{e:#}"));
                r["pass"] = json!(false);
            }
        }
        out.push(r);
    }
    out
}

/// Candle's fused-MoE baselines on the same experts (dequantized from the pack).
struct Baselines {
    gate_up: Tensor, // [E, 2I, H] bf16
    down: Tensor,    // [E, H, I] bf16
    q4k: Option<[Arc<QTensor>; 3]>,
    q4k_bytes_per_expert: usize,
}

fn build_baselines(pack: &LayerPack, dev: &Device, want_q4k: bool) -> Result<Baselines> {
    let l = pack.layout();
    let (h, i, e) = (l.hidden, l.intermediate, pack.num_experts());
    // Per expert: [gate [I, H], up [I, H], down [H, I]] in F32.
    let deq: Vec<[Vec<f32>; 3]> = (0..e)
        .into_par_iter()
        .map(|x| {
            let (g, u, d) = pack.slab(x).dequantize();
            [g, u, d]
        })
        .collect();
    let to_bf16 = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let mut gu = Vec::with_capacity(e * 2 * i * h);
    let mut dn = Vec::with_capacity(e * h * i);
    for [g, u, d] in &deq {
        gu.extend(to_bf16(g));
        gu.extend(to_bf16(u));
        dn.extend(to_bf16(d));
    }
    let gate_up = Tensor::from_vec(gu, (e, 2 * i, h), dev)?;
    let down = Tensor::from_vec(dn, (e, h, i), dev)?;
    let mut q4k = None;
    let mut q4k_bytes_per_expert = 0;
    if want_q4k {
        // Each expert quantized on its own (in parallel), the blocks concatenated: the same bytes
        // as quantizing the stacked [E, rows, cols] tensor, since Q4K blocks run along rows.
        let quant = |rows: usize, cols: usize, which: usize| -> Result<Arc<QTensor>> {
            let parts: Vec<Vec<u8>> = deq
                .par_iter()
                .map(|x| -> Result<Vec<u8>> {
                    let t = Tensor::from_slice(x[which].as_slice(), (rows, cols), &Device::Cpu)?;
                    Ok(QTensor::quantize(&t, GgmlDType::Q4K)?.data()?.into_owned())
                })
                .collect::<Result<_>>()?;
            let bytes = parts.concat();
            let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), dev, GgmlDType::Q4K)?;
            Ok(Arc::new(QTensor::new(storage, (e, rows, cols))?))
        };
        let gate = quant(i, h, 0)?;
        let up = quant(i, h, 1)?;
        let down_q = quant(h, i, 2)?;
        q4k_bytes_per_expert = 3 * h * i / 256 * GgmlDType::Q4K.type_size();
        q4k = Some([gate, up, down_q]);
    }
    Ok(Baselines {
        gate_up,
        down,
        q4k,
        q4k_bytes_per_expert,
    })
}

/// Candle's `FusedMoe` routed part: sort, `moe_gemm` gate/up, SiLU·up, `moe_gemm` down with the
/// routing weights, sum over k.
fn candle_bf16(
    b: &Baselines,
    x: &Tensor,
    ids: &Tensor,
    w: &Tensor,
    prefill: bool,
) -> Result<Tensor> {
    let (t, h) = x.dims2()?;
    let k = ids.dim(1)?;
    let i = b.down.dim(2)?;
    let (sorted_e, sorted_tok) = ids.flatten_all()?.sort_last_dim(true)?;
    let gu = candle_nn::moe::moe_gemm(x, &b.gate_up, &None, &sorted_tok, &sorted_e, k, prefill)?;
    let gate = gu.narrow(D::Minus1, 0, i)?.contiguous()?;
    let up = gu.narrow(D::Minus1, i, i)?.contiguous()?;
    let down_in = (up * candle_nn::ops::silu(&gate)?)?;
    let y = candle_nn::moe::moe_gemm(
        &down_in,
        &b.down,
        &Some(w.clone()),
        &sorted_tok,
        &sorted_e,
        k,
        prefill,
    )?;
    Ok(y.reshape((t, k, h))?.sum(D::Minus2)?)
}

/// Candle's `FusedMoeGGUF` routed part on Q4K experts (F32 activations in and out).
fn candle_q4k(
    b: &Baselines,
    x: &Tensor,
    ids: &Tensor,
    w: &Tensor,
    prefill: bool,
) -> Result<Tensor> {
    let Some([gq, uq, dq]) = &b.q4k else {
        bail!("no Q4K experts")
    };
    let (t, h) = x.dims2()?;
    let k = ids.dim(1)?;
    let (sorted_e, sorted_tok) = ids.flatten_all()?.sort_last_dim(true)?;
    let f = |inp: &Tensor, q: &QTensor, tw: &Option<Tensor>| {
        candle_nn::moe::moe_gemm_gguf(inp, q, tw, &sorted_tok, &sorted_e, k, prefill, DType::BF16)
    };
    let gate = f(x, gq, &None)?;
    let up = f(x, uq, &None)?;
    let down_in = (up * candle_nn::ops::silu(&gate)?)?;
    let y = f(&down_in, dq, &Some(w.clone()))?;
    Ok(y.reshape((t, k, h))?.sum(D::Minus2)?)
}

/// The routings of one timing: `n` fresh draws, rotated across runs.
struct Routings {
    x_bf16: Vec<Tensor>,
    x_f32: Vec<Tensor>,
    ids: Vec<Tensor>,
    w: Vec<Tensor>,
    distinct: f64,
}

fn routings(dev: &Device, m: Model, tokens: usize, n: usize, seed: u64) -> Result<Routings> {
    let mut r = Routings {
        x_bf16: vec![],
        x_f32: vec![],
        ids: vec![],
        w: vec![],
        distinct: 0.0,
    };
    for s in 0..n as u64 {
        let x = Tensor::from_vec(
            activations(seed + s, tokens, m.hidden),
            (tokens, m.hidden),
            dev,
        )?;
        let (ids, w) = random_routing(seed + 100 + s, tokens, m.k, m.experts);
        let mut seen = vec![false; m.experts];
        ids.iter().for_each(|&e| seen[e as usize] = true);
        r.distinct += seen.iter().filter(|&&b| b).count() as f64 / n as f64;
        r.x_bf16.push(x.to_dtype(DType::BF16)?);
        r.x_f32.push(x);
        r.ids.push(Tensor::from_vec(ids, (tokens, m.k), dev)?);
        r.w.push(Tensor::from_vec(w, (tokens, m.k), dev)?);
    }
    Ok(r)
}

/// A decode call's time against the number of experts it reads.
struct DecodeScan {
    /// (experts routed, timing) per point.
    points: Vec<(usize, Stats)>,
    /// The points and the least-squares line through them.
    json: Value,
}

/// Times a single-token decode call routed to 1, 2, 4 … k distinct experts (the same slabs,
/// fresh routings) and fits `time = fixed + per_expert · experts`: a large fixed part means the
/// call is bound by launches and pipeline latency, not by the bytes it reads.
fn decode_scan(
    dev: &Device,
    m: Model,
    experts: &DeviceExperts,
    timer: &Timer,
    runs: usize,
    slab: usize,
    copy_gbps: f64,
) -> Result<DecodeScan> {
    let mut points = Vec::new();
    for k in [1, 2, 4, 8].into_iter().filter(|&k| k <= m.k) {
        let rk = routings(dev, Model { k, ..m }, 1, 8, 91 + k as u64)?;
        let n = rk.ids.len();
        let st = timer.time(10, runs, |i| {
            let j = i % n;
            experts.forward_tensors(
                &rk.x_bf16[j],
                &rk.ids[j],
                &rk.w[j],
                CudaPath::Decode,
                false,
            )?;
            Ok(())
        })?;
        points.push((k, st));
    }
    let n = points.len() as f64;
    let mean_x = points.iter().map(|(k, _)| *k as f64).sum::<f64>() / n;
    let mean_y = points.iter().map(|(_, s)| s.median_us).sum::<f64>() / n;
    let sxy: f64 = points
        .iter()
        .map(|(k, s)| (*k as f64 - mean_x) * (s.median_us - mean_y))
        .sum();
    let sxx: f64 = points
        .iter()
        .map(|(k, _)| (*k as f64 - mean_x).powi(2))
        .sum();
    let per_expert = sxy / sxx;
    let fixed = mean_y - per_expert * mean_x;
    let marginal_gbps = slab as f64 / (per_expert * 1e-6) / 1e9;
    eprintln!(
        "{} decode scan: {fixed:.1} us fixed + {per_expert:.2} us per expert ({marginal_gbps:.0} GB/s marginal, {:.0}% of copy)",
        m.name,
        100.0 * marginal_gbps / copy_gbps
    );
    let json = json!({
        "model": m.name,
        "tokens": 1,
        "slab_bytes": slab,
        "points": points.iter().map(|(k, s)| json!({"experts": k, "median_us": s.median_us, "p10_us": s.p10_us, "p90_us": s.p90_us})).collect::<Vec<_>>(),
        "fixed_us": fixed,
        "us_per_expert": per_expert,
        "marginal_gb_per_s": marginal_gbps,
    });
    Ok(DecodeScan { points, json })
}

struct Row {
    model: &'static str,
    tokens: usize,
    name: String,
    us: Option<f64>,
    gbps: Option<f64>,
    pct_bw: Option<f64>,
    note: String,
    /// False for a baseline whose output does not match ours (a failed launch, say): it is
    /// kept in the table but left out of the summary.
    valid: bool,
}

/// The note of a baseline row and whether it is valid: its output must match ours within `tol`
/// (relative L2), else it did not compute the routed experts (a failed launch leaves garbage).
fn baseline_note(sanity: &Result<f64>, prefill: bool, tol: f64, what: &str) -> (String, bool) {
    match sanity {
        Ok(e) if e.is_finite() && *e <= tol => (
            format!("rel diff vs ours {e:.1e}{what}; is_prefill={prefill}"),
            true,
        ),
        Ok(e) => (
            format!("INVALID: rel diff vs ours {e:.1e} > {tol:.0e}{what}; is_prefill={prefill}"),
            false,
        ),
        Err(e) => (format!("INVALID: sanity failed: {e:#}"), false),
    }
}

fn main() -> Result<()> {
    candle_qmoe_suite::model::end_quietly_on_broken_pipe();
    let args = Args::parse();
    let commit = args
        .commit
        .clone()
        .or_else(|| std::env::var("QMOE_COMMIT").ok())
        .unwrap_or_else(|| "unknown".into());
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let mut report = Report {
        paths: args.json.clone(),
        doc: json!({
            "schema": "candle-qmoe/gpu-check/1",
            "commit": commit,
            "started_unix": started,
            "args": format!("{args:?}"),
        }),
    };

    // 1. Device.
    let dev = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            report.doc["error"] = json!(format!("no CUDA device: {e}"));
            report.save();
            bail!("no CUDA device: {e}");
        }
    };
    let cdev = dev.as_cuda_device()?.clone();
    let stream = cdev.cuda_stream();
    let ctx = stream.context().clone();
    let attr = |a| ctx.attribute(a).ok();
    let (cc_major, cc_minor) = ctx.compute_capability()?;
    report.doc["device"] = json!({
        "name": ctx.name().ok(),
        "compute_capability": format!("{cc_major}.{cc_minor}"),
        "multiprocessors": attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        "l2_bytes": attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        "memory_bytes": ctx.total_mem().ok(),
        "cuda_driver_api": driver_version(),
        "driver": nvidia_smi_driver(),
    });
    eprintln!("device: {}", report.doc["device"]);
    let timer = Timer::new(&cdev)?;
    let (copy_gbps, copy_stats) = copy_bandwidth(&cdev, &timer)?;
    report.doc["copy_bandwidth"] = json!({
        "bytes": 1u64 << 30,
        "gbps_read_plus_write": copy_gbps,
        "median_us": copy_stats.median_us,
    });
    report.doc["timer"] = json!({
        "l2_flush_bytes": timer.flush.len(),
        "flush_us": timer.flush_us,
        "note": "each timed run follows an L2 flush; host_bound marks rows whose enqueue time reaches the flush time",
    });
    eprintln!("device-to-device copy: {copy_gbps:.0} GB/s (read + write)");
    report.save();

    // 2. Correctness.
    let token_set: &[usize] = if args.quick {
        &[1, 16, 128]
    } else {
        &[1, 4, 16, 128, 1024]
    };
    let group_set: &[usize] = if args.quick { &[128] } else { &[64, 128, 256] };
    let mut correctness = Vec::new();
    let mut seed = 1u64;
    for m in [OLMOE, QWEN] {
        for &group in group_set {
            let t0 = Instant::now();
            let pack = random_layer_pack(seed * 7919, layout(m, group)?, m.experts)?;
            let oracle = DenseExperts::new(pack.dequantize_experts(DType::F32, &Device::Cpu)?)?;
            let experts = Int4Experts::new(pack).device_experts(&cdev)?;
            for &tokens in token_set {
                let dtypes: &[DType] = if group == 128 {
                    &[DType::BF16, DType::F16, DType::F32]
                } else {
                    &[DType::BF16]
                };
                for &dtype in dtypes {
                    seed += 1;
                    for r in check_case(&dev, m, group, &oracle, &experts, tokens, dtype, seed) {
                        let ok = r["pass"].as_bool() == Some(true);
                        eprintln!("{} {}", if ok { "PASS" } else { "FAIL" }, r);
                        correctness.push(r);
                    }
                }
            }
            eprintln!("{} g{group}: {:.1} s", m.name, t0.elapsed().as_secs_f64());
            report.doc["correctness"] = json!(correctness);
            report.save();
        }
    }
    let failed = correctness
        .iter()
        .filter(|r| r["pass"].as_bool() != Some(true))
        .count();
    report.doc["correctness_summary"] = json!({"cases": correctness.len(), "failed": failed});
    report.save();

    // 3. Timings.
    let mut rows: Vec<Row> = Vec::new();
    let mut timings = Vec::new();
    let mut decode_scans = Vec::new();
    let tset: &[usize] = if args.quick {
        &[1, 512]
    } else {
        &[1, 4, 16, 128, 512, 1024]
    };
    for m in [OLMOE, QWEN] {
        let group = 128;
        let pack = random_layer_pack(4242 + m.experts as u64, layout(m, group)?, m.experts)?;
        let slab = pack.layout().slab_bytes();
        let int4 = Int4Experts::new(pack.clone());
        let experts = int4.device_experts(&cdev)?;
        let want_q4k = m.inter % 256 == 0 && m.hidden % 256 == 0;
        let base = if args.no_baselines {
            None
        } else {
            let t0 = Instant::now();
            match build_baselines(&pack, &dev, want_q4k) {
                Ok(b) => {
                    eprintln!(
                        "{} baselines ready in {:.1} s",
                        m.name,
                        t0.elapsed().as_secs_f64()
                    );
                    Some(b)
                }
                Err(e) => {
                    eprintln!("{} baselines failed: {e:#}", m.name);
                    timings.push(json!({"model": m.name, "error": format!("baselines: {e:#}")}));
                    None
                }
            }
        };
        // A failure is recorded and the timings go on.
        if !args.quick {
            match decode_scan(&dev, m, &experts, &timer, args.iters, slab, copy_gbps) {
                Ok(scan) => {
                    for (k, st) in &scan.points {
                        let gbps = *k as f64 * slab as f64 / (st.median_us * 1e-6) / 1e9;
                        rows.push(Row {
                            model: m.name,
                            tokens: 1,
                            name: format!("qmoe_int4_decode_{k}of{}", m.k),
                            us: Some(st.median_us),
                            gbps: Some(gbps),
                            pct_bw: Some(100.0 * gbps / copy_gbps),
                            note: "top-k scan".into(),
                            valid: true,
                        });
                    }
                    decode_scans.push(scan.json);
                }
                Err(e) => {
                    eprintln!("{} decode scan failed: {e:#}", m.name);
                    decode_scans.push(json!({"model": m.name, "error": format!("{e:#}")}));
                }
            }
            report.doc["decode_scans"] = json!(decode_scans);
            report.save();
        }
        for &tokens in tset {
            let rt = routings(&dev, m, tokens, 8, 77 + tokens as u64)?;
            let runs = if tokens <= 16 {
                args.iters
            } else {
                (args.iters / 3).max(10)
            };
            let act_bytes = 2.0 * (tokens * m.hidden * 2) as f64;
            let moved = |per_expert: usize| rt.distinct * per_expert as f64 + act_bytes;
            let mut record =
                |name: &str, bytes: f64, res: Result<Stats>, note: &str, valid: bool| {
                    let mut j = json!({
                        "model": m.name, "group": group, "tokens": tokens, "impl": name,
                        "bytes_moved": bytes, "distinct_experts": rt.distinct, "note": note,
                        "valid": valid,
                    });
                    let (us, gbps, pct) = match res {
                        Ok(s) => {
                            let gbps = bytes / (s.median_us * 1e-6) / 1e9;
                            j["median_us"] = json!(s.median_us);
                            j["p10_us"] = json!(s.p10_us);
                            j["p90_us"] = json!(s.p90_us);
                            j["host_enqueue_us"] = json!(s.host_enqueue_us);
                            j["host_bound"] = json!(s.host_enqueue_us >= 0.9 * timer.flush_us);
                            j["runs"] = json!(s.runs);
                            j["gbps"] = json!(gbps);
                            j["pct_of_copy_bw"] = json!(100.0 * gbps / copy_gbps);
                            (
                                Some(s.median_us),
                                Some(gbps),
                                Some(100.0 * gbps / copy_gbps),
                            )
                        }
                        Err(e) => {
                            j["error"] = json!(format!("{e:#}"));
                            (None, None, None)
                        }
                    };
                    eprintln!("timing {j}");
                    timings.push(j);
                    rows.push(Row {
                        model: m.name,
                        tokens,
                        name: name.to_string(),
                        us,
                        gbps,
                        pct_bw: pct,
                        note: note.to_string(),
                        valid,
                    });
                };
            let n = rt.ids.len();
            // Our kernels on one path, cycling through the routings.
            let time_path = |warmup: usize, path: CudaPath| {
                timer.time(warmup, runs, |i| {
                    let j = i % n;
                    experts.forward_tensors(&rt.x_bf16[j], &rt.ids[j], &rt.w[j], path, false)?;
                    Ok(())
                })
            };
            if tokens <= 16 {
                let st = time_path(10, CudaPath::Decode);
                record("qmoe_int4_decode", moved(slab), st, "bf16 act, g128", true);
            }
            let st = time_path(5, CudaPath::Prefill);
            record("qmoe_int4_prefill", moved(slab), st, "bf16 act, g128", true);
            if let Some(b) = &base {
                // Candle's fused MoE has a decode path and a prefill path (`is_prefill`); the
                // latter runs a thrust scan that synchronises with the host inside the timed
                // region. Above 16 tokens both are timed and the summary takes the faster one.
                let modes: &[bool] = if tokens > 16 {
                    &[true, false]
                } else {
                    &[false]
                };
                for &prefill in modes {
                    let ours = |x: &Tensor| -> Result<Vec<f32>> {
                        Ok(experts
                            .forward_tensors(x, &rt.ids[0], &rt.w[0], CudaPath::Auto, false)?
                            .to_dtype(DType::F32)?
                            .flatten_all()?
                            .to_vec1::<f32>()?)
                    };
                    // Sanity: the baseline computes the same function (same weights,
                    // dequantized; Q4K requantized), else its row is not valid.
                    let sanity = (|| -> Result<f64> {
                        let a = candle_bf16(b, &rt.x_bf16[0], &rt.ids[0], &rt.w[0], prefill)?
                            .to_dtype(DType::F32)?
                            .flatten_all()?
                            .to_vec1::<f32>()?;
                        Ok(rel_err(&a, &ours(&rt.x_bf16[0])?).0)
                    })();
                    let (note, valid) = baseline_note(&sanity, prefill, 5e-2, "");
                    let st = timer.time(5, runs, |i| {
                        let j = i % n;
                        candle_bf16(b, &rt.x_bf16[j], &rt.ids[j], &rt.w[j], prefill)?;
                        Ok(())
                    });
                    let bytes = moved(3 * m.hidden * m.inter * 2);
                    record("candle_moe_gemm_bf16", bytes, st, &note, valid);
                    if b.q4k.is_some() {
                        let sanity = (|| -> Result<f64> {
                            let a = candle_q4k(b, &rt.x_f32[0], &rt.ids[0], &rt.w[0], prefill)?
                                .flatten_all()?
                                .to_vec1::<f32>()?;
                            Ok(rel_err(&a, &ours(&rt.x_f32[0])?).0)
                        })();
                        let (note, valid) =
                            baseline_note(&sanity, prefill, 0.3, " (Q4K requantized)");
                        let st = timer.time(5, runs, |i| {
                            let j = i % n;
                            candle_q4k(b, &rt.x_f32[j], &rt.ids[j], &rt.w[j], prefill)?;
                            Ok(())
                        });
                        let bytes = moved(b.q4k_bytes_per_expert);
                        record("candle_moe_gemm_gguf_q4k", bytes, st, &note, valid);
                    } else if !prefill {
                        record(
                            "candle_moe_gemm_gguf_q4k",
                            0.0,
                            Err(anyhow::anyhow!("Q4K needs K % 256 == 0 (I = {})", m.inter)),
                            "not applicable",
                            false,
                        );
                    }
                }
            }
            report.doc["timings"] = json!(timings);
            report.save();
        }
        drop(base);
    }

    // 4. Summary against the issue's targets.
    // The fastest valid row of an implementation (Candle's baselines may have two paths).
    let find = |model: &str, t: usize, name: &str| {
        rows.iter()
            .filter(|r| r.model == model && r.tokens == t && r.name == name && r.valid)
            .filter_map(|r| r.us)
            .min_by(f64::total_cmp)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| b / a);
    let dec = find("olmoe", 1, "qmoe_int4_decode");
    let olmoe_scan = decode_scans.iter().find(|s| s["model"] == "olmoe");
    let summary = json!({
        "olmoe_t1_decode_fixed_us": olmoe_scan.map(|s| s["fixed_us"].clone()),
        "olmoe_t1_decode_us_per_expert": olmoe_scan.map(|s| s["us_per_expert"].clone()),
        "copy_gbps": copy_gbps,
        "olmoe_t1_decode_us": dec,
        "olmoe_t1_decode_pct_copy_bw": rows.iter().find(|r| r.model == "olmoe" && r.tokens == 1 && r.name == "qmoe_int4_decode").and_then(|r| r.pct_bw),
        "olmoe_t1_speedup_vs_bf16_wmma": ratio(dec, find("olmoe", 1, "candle_moe_gemm_bf16")),
        "olmoe_t1_speedup_vs_q4k": ratio(dec, find("olmoe", 1, "candle_moe_gemm_gguf_q4k")),
        "olmoe_t512_prefill_speedup_vs_bf16_wmma": ratio(find("olmoe", 512, "qmoe_int4_prefill"), find("olmoe", 512, "candle_moe_gemm_bf16")),
        "qwen_t512_prefill_speedup_vs_bf16_wmma": ratio(find("qwen1.5-moe", 512, "qmoe_int4_prefill"), find("qwen1.5-moe", 512, "candle_moe_gemm_bf16")),
        "targets": "decode T=1 OLMoE: >= 60% of copy BW, >= 2x bf16 moe_gemm, >= 1.3x Q4K; prefill T=512: >= 1x bf16 moe_gemm",
        "correctness_failed": failed,
    });
    report.doc["summary"] = summary.clone();
    report.doc["finished_unix"] = json!(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs());
    report.save();

    // 5. The table, last.
    println!();
    println!(
        "{:<12} {:>5}  {:<26} {:>10} {:>9} {:>7}  note",
        "model", "T", "impl", "median us", "GB/s", "%copy"
    );
    for r in &rows {
        let f = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
        println!(
            "{:<12} {:>5}  {:<26} {:>10} {:>9} {:>7}  {}",
            r.model,
            r.tokens,
            r.name,
            f(r.us, 1),
            f(r.gbps, 0),
            f(r.pct_bw, 1),
            r.note
        );
    }
    println!(
        "copy bandwidth {copy_gbps:.0} GB/s; correctness: {} cases, {failed} failed; commit {commit}",
        correctness.len()
    );
    println!("summary: {summary}");
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
