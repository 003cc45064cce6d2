//! Facts about the machine and the run that evidence files record: peak and available memory,
//! CPU time and load, the CPU and GPU, the driver, the memory bandwidth, the git commit.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::perf::median;

/// The size field `field` (e.g. `VmHWM`) of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Peak resident set size of this process (`VmHWM`), in bytes; `None` where /proc is missing.
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM")
}

/// The resident set of this process now, split into anonymous memory (`RssAnon`: heap, the
/// weights built in memory) and mapped file pages (`RssFile`: e.g. the pages of a memory-mapped
/// pack read so far, which the kernel can drop and read again), in bytes.
pub fn rss_anon_file_bytes() -> Option<(u64, u64)> {
    Some((status_bytes("RssAnon")?, status_bytes("RssFile")?))
}

/// User and system CPU time of this process so far, in seconds (`/proc/self/stat`, in the
/// kernel's fixed 100 ticks per second); `None` where /proc is missing.
pub fn cpu_time_s() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let mut ticks = || fields.next()?.parse::<f64>().ok();
    Some((ticks()? / 100.0, ticks()? / 100.0))
}

/// The 1-, 5- and 15-minute load averages (`/proc/loadavg`): how busy the machine was, next to
/// a timing measured on shared cores.
pub fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut v = text.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some([v.next()??, v.next()??, v.next()??])
}

/// Resets the peak resident set size (`VmHWM`) to the current RSS, so that
/// [`peak_rss_bytes`] measures from now on; `false` where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Memory the kernel reports as available (`MemAvailable`), in bytes.
pub fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The size of the CPU's last-level cache in bytes (the highest `level` under
/// `/sys/devices/system/cpu/cpu0/cache`), or `null` when unknown: what a benchmark's working
/// set must exceed to be read from memory.
pub fn last_level_cache_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let read = |path: std::path::PathBuf| std::fs::read_to_string(path).ok();
    dir.filter_map(|entry| {
        let path = entry.ok()?.path();
        let level: u32 = read(path.join("level"))?.trim().parse().ok()?;
        let size = read(path.join("size"))?;
        let size = size.trim();
        let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
        let scale = match unit {
            "K" => 1 << 10,
            "M" => 1 << 20,
            "G" => 1 << 30,
            _ => return None,
        };
        Some((level, digits.parse::<u64>().ok()? * scale))
    })
    .max()
    .map(|(_, bytes)| bytes)
}

/// The CPU model name, or `null` when unknown.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split(':').nth(1)?.trim().to_string())
}

/// The NVIDIA kernel driver version (from `/proc/driver/nvidia/version`), or `null`.
pub fn nvidia_driver_version() -> Option<String> {
    let info = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = info.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
        .map(str::to_string)
}

/// The host memory bandwidth measured by [`memory_bandwidth`], in GB/s (10⁹ bytes per second).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct MemoryBandwidth {
    /// A parallel read (an XOR fold) of a 512 MiB buffer.
    pub read_gb_per_s: f64,
    /// A parallel copy of a 512 MiB buffer (bytes copied, not read + written).
    pub copy_gb_per_s: f64,
    /// The rayon threads that ran it (`RAYON_NUM_THREADS`, else one per core).
    pub threads: usize,
}

/// Measures the read and copy bandwidth over buffers far larger than the caches (1 GiB in all),
/// median of five runs each, on rayon's global pool.
pub fn memory_bandwidth() -> MemoryBandwidth {
    let n = 64 << 20; // 512 MiB of u64
    let src: Vec<u64> = (0..n as u64).collect();
    let mut dst = vec![0u64; n];
    let (mut read, mut copy) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = src
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a ^ b))
            .sum();
        read.push(t.elapsed().as_secs_f64());
        std::hint::black_box(s);
        let t = Instant::now();
        dst.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s));
        copy.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    let bytes = (n * 8) as f64;
    MemoryBandwidth {
        read_gb_per_s: bytes / median(&mut read) / 1e9,
        copy_gb_per_s: bytes / median(&mut copy) / 1e9,
        threads: rayon::current_num_threads(),
    }
}

/// The commit: `$QMOE_COMMIT` when set (binaries carried to a machine without the repository, as
/// the GPU check does), else `git describe` of the working tree (with `-dirty` when it has
/// changes), else `None`.
pub fn git_commit() -> Option<String> {
    if let Ok(c) = std::env::var("QMOE_COMMIT") {
        return Some(c);
    }
    let out = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The GPU's name (CUDA builds only).
#[cfg(feature = "cuda")]
fn gpu_name(device: &candle::Device) -> Option<String> {
    device
        .as_cuda_device()
        .ok()?
        .cuda_stream()
        .context()
        .name()
        .ok()
}

/// The GPU's name (CUDA builds only).
#[cfg(not(feature = "cuda"))]
fn gpu_name(_: &candle::Device) -> Option<String> {
    None
}

/// The device a run used, for evidence files: kind, name, driver (`null` on the CPU), threads,
/// and on the CPU the instruction set of our kernels (`QMOE_CPU_ISA` may force one).
pub fn device_json(device: &candle::Device) -> serde_json::Value {
    let threads = std::thread::available_parallelism().ok().map(|n| n.get());
    if device.is_cuda() {
        serde_json::json!({
            "kind": "cuda",
            "name": gpu_name(device),
            "driver": nvidia_driver_version(),
            "host_cpu": cpu_model(),
            "host_threads": threads,
        })
    } else {
        serde_json::json!({
            "kind": "cpu",
            "name": cpu_model(),
            "driver": null,
            "threads": threads,
            "cpu_isa": candle_qmoe::kernels::cpu::CpuIsa::detect().name(),
        })
    }
}
