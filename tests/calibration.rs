//! The memory plan against the measured peak RSS on the CPU: the synthetic tiny model at two
//! configurations, each run in a fresh process (this test binary re-executed with
//! `QMOE_CALIBRATION_CHILD` set), so that the peak RSS (`VmHWM`) covers that run alone. The
//! runs and predictions are those of the `calibrate` example
//! ([`candle_qmoe_suite::calibration`]).
//!
//! The plan's CPU runtime overhead (2–200 MiB: the binary, a tokenizer, allocator slack, a copy
//! probe) is wider than the tiny model's own ~52 MiB, so the whole range alone would let a
//! plan miss most of the model. The child therefore also reports its peak before the run (the
//! test binary alone), and what the run adds must lie inside the plan without the overhead: the
//! model, with the little the run adds beyond it (allocator slack; no tokenizer here) inside the
//! workspace's upper estimate. Measured at tiny/none/64/4: 57.1 MiB added, predicted
//! 52.0–75.2 MiB; a plan that forgot the 25 MB `lm_head` would fail.

use std::process::Command;

use candle_qmoe::plan::{ByteRange, Target};
use candle_qmoe::synthetic::SyntheticKind;
use candle_qmoe_suite::calibration::{self, Cache, Config};

/// Set in a child process to the configuration it runs ([`Config`]'s text form).
const CHILD_ENV: &str = "QMOE_CALIBRATION_CHILD";
/// Marks the child's output line with the measured peak RSS in bytes.
const MARK: &str = "QMOE_CALIBRATION_PEAK_RSS_BYTES=";
/// Marks the child's output line with its peak RSS before the run, in bytes.
const BASELINE_MARK: &str = "QMOE_CALIBRATION_BASELINE_RSS_BYTES=";
/// The test that runs in the child.
const CHILD_TEST: &str = "calibration_child";

/// The child: runs the configuration of [`CHILD_ENV`] and prints its peak RSS on a marked line.
/// Ignored in a normal run: [`measured_in_child`] runs it alone, with `--ignored`, in a fresh
/// process.
#[test]
#[ignore = "runs in a child process of cpu_peak_rss_is_inside_the_plan"]
fn calibration_child() {
    let config = std::env::var(CHILD_ENV).unwrap_or_else(|_| {
        panic!("{CHILD_TEST} measures one configuration given in {CHILD_ENV}; it is run by cpu_peak_rss_is_inside_the_plan")
    });
    let config: Config = config.parse().unwrap();
    let baseline = candle_qmoe_suite::system::peak_rss_bytes().unwrap();
    let measured = config.run().unwrap();
    println!("{config}: {measured}");
    println!("{BASELINE_MARK}{baseline}");
    println!("{MARK}{}", measured.peak_rss_bytes);
}

/// The peak RSS of `config` run by [`calibration_child`] in a fresh process, and that process's
/// peak before the run.
fn measured_in_child(config: &Config) -> (u64, u64) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .env(CHILD_ENV, config.to_string())
        .args([
            "--exact",
            CHILD_TEST,
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child run of {config} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let marked = |mark: &str| -> u64 {
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix(mark))
            .unwrap_or_else(|| panic!("no `{mark}` line in the child's output:\n{stdout}"));
        line.trim().parse().unwrap()
    };
    (marked(MARK), marked(BASELINE_MARK))
}

#[test]
fn cpu_peak_rss_is_inside_the_plan() {
    for (cache, ctx) in [(Cache::None, 64), (Cache::Slots(2), 256)] {
        let config = Config::new(SyntheticKind::Tiny, cache, ctx, 4).unwrap();
        let rss = calibration::process_rss(&config.plan().unwrap()).unwrap();
        let (peak, baseline) = measured_in_child(&config);
        assert!(
            calibration::inside(rss, peak),
            "{config}: measured peak RSS {peak} bytes outside the predicted [{}, {}]",
            rss.min,
            rss.max
        );
        let overhead = Target::Cpu.runtime_overhead();
        let model = ByteRange::new(rss.min - overhead.min, rss.max - overhead.max);
        let added = peak - baseline;
        assert!(
            calibration::inside(model, added),
            "{config}: the run added {added} bytes to the peak RSS, outside the model's \
             predicted [{}, {}] (the plan without its runtime overhead)",
            model.min,
            model.max
        );
    }
}
