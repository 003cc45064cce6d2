//! The PERF-REAL contract of `examples/bench.rs` ([`candle_qmoe_suite::perf`]): the metric
//! arithmetic, the residency counters of the measured responses, the date, the sweep plot, and
//! one shrunk campaign end to end on the synthetic tiny model.

use candle::DType;
use candle_qmoe::kernels::cpu::DecodeActivations;
use candle_qmoe::models::ModelConfig;
use candle_qmoe::residency::ResidencyStats;
use candle_qmoe_suite::model::ModelArgs;
use candle_qmoe_suite::perf::{
    decode_rate, fit_prompt, plot_sweep, relative_spread, rfc3339_utc, run_campaign,
    suppression_mask, Contract, Metrics, Response, SweepPoint, DECODE_LABEL, H2D_LABEL, X_LABEL,
};
use clap::Parser;

fn response(
    prompt: usize,
    block: usize,
    generated: usize,
    decode_s: f64,
    tokens: &[u32],
) -> Response {
    Response {
        prompt,
        block,
        prompt_tokens: 10,
        generated,
        ttft_s: 0.5,
        decode_s,
        response_s: 0.5 + decode_s,
        tokens: tokens.to_vec(),
        decode_profile: None,
    }
}

#[test]
fn decode_rate_is_time_weighted_over_responses() {
    // 9 tokens in 1 s and 9 tokens in 3 s: 18 / 4 = 4.5 tok/s (the mean of rates would be 6).
    let rs = [response(0, 0, 10, 1.0, &[1]), response(1, 0, 10, 3.0, &[2])];
    assert_eq!(decode_rate(&rs), Some(4.5));
    assert_eq!(decode_rate(&[response(0, 0, 1, 0.0, &[1])]), None);
    assert_eq!(decode_rate(&[]), None);
}

#[test]
fn relative_spread_is_range_over_mean() {
    assert_eq!(relative_spread(&[4.0, 5.0, 6.0]), Some(0.4));
    assert_eq!(relative_spread(&[3.0]), Some(0.0));
    assert_eq!(relative_spread(&[]), None);
    assert_eq!(relative_spread(&[0.0, 0.0]), None);
}

#[test]
fn metrics_aggregate_blocks_prompts_and_token_identity() {
    let rs = [
        response(0, 0, 5, 1.0, &[1, 2]),
        response(1, 0, 5, 1.0, &[3, 4]),
        response(0, 1, 5, 2.0, &[1, 2]),
        response(1, 1, 5, 2.0, &[3, 5]),
    ];
    let m = Metrics::new(&rs);
    assert_eq!((m.responses, m.generated_tokens), (4, 20));
    assert_eq!(m.decode_tokens_per_s, Some(16.0 / 6.0));
    assert_eq!(m.block_decode_tokens_per_s, vec![Some(4.0), Some(2.0)]);
    assert_eq!(m.block_spread, Some(2.0 / 3.0));
    assert_eq!(m.ttft_mean_s, Some(0.5));
    assert_eq!(m.response_time_mean_s, Some(2.0));
    assert_eq!(m.prefill_tokens_per_s, Some(20.0));
    assert_eq!(m.identical_across_blocks, vec![true, false]);
    assert!(!m.all_identical());
}

#[test]
fn stats_delta_counts_what_happened_in_between() {
    let before = ResidencyStats {
        hits: 10,
        misses: 4,
        h2d_bytes: 1000,
        preload_bytes: 500,
        stall_s: 0.25,
        ..Default::default()
    };
    let after = ResidencyStats {
        hits: 30,
        misses: 9,
        h2d_bytes: 3500,
        preload_bytes: 500,
        stall_s: 1.0,
        generations: 7,
        ..Default::default()
    };
    let d = after.since(&before);
    assert_eq!((d.hits, d.misses, d.h2d_bytes), (20, 5, 2500));
    assert_eq!((d.preload_bytes, d.generations, d.stall_s), (0, 7, 0.75));
}

#[test]
fn suppression_mask_blocks_only_the_given_ids() {
    let m = suppression_mask(5, &[1, 3, 99]);
    assert_eq!(m.len(), 5);
    assert!(m[1] == f32::NEG_INFINITY && m[3] == f32::NEG_INFINITY);
    assert_eq!([m[0], m[2], m[4]], [0.0; 3]);
}

#[test]
fn contract_defaults_and_limits() {
    let full = Contract::FULL;
    assert!(full.is_full());
    assert_eq!((full.responses(), full.total_tokens()), (36, 36 * 128 + 64));
    full.check().unwrap();
    let bad = [
        (Contract { prompts: 0, ..full }, "--prompts 0 must be 1 to"),
        (
            Contract {
                prompts: 13,
                ..full
            },
            "--prompts 13 must be 1 to",
        ),
        (
            Contract { blocks: 0, ..full },
            "--blocks must be at least 1",
        ),
        (
            Contract {
                sample_len: 1,
                ..full
            },
            "--sample-len 1 must be at least 2",
        ),
        (
            Contract {
                prompt_tokens: Some(0),
                ..full
            },
            "--prompt-tokens must be at least 1",
        ),
    ];
    for (c, says) in bad {
        let err = c.check().unwrap_err().to_string();
        assert!(err.contains(says), "{c:?}: {err}");
        assert!(!c.is_full());
    }
}

#[test]
fn fit_prompt_cuts_or_repeats() {
    assert_eq!(fit_prompt(&[1, 2, 3], 7), [1, 2, 3, 1, 2, 3, 1]);
    assert_eq!(fit_prompt(&[1, 2, 3], 2), [1, 2]);
    assert!(fit_prompt(&[], 4).is_empty());
}

#[test]
fn rfc3339_dates() {
    assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339_utc(1_735_689_599), "2024-12-31T23:59:59Z");
    assert_eq!(rfc3339_utc(4_107_542_400), "2100-03-01T00:00:00Z");
}

#[test]
fn sweep_plot_is_an_svg_with_axis_labels() {
    let path = std::env::temp_dir().join(format!("qmoe-sweep-{}.svg", std::process::id()));
    let points =
        [(8.0, 3.0, 1.5), (16.0, 4.0, 0.7), (64.0, 4.6, 0.0)].map(|(r, d, h)| SweepPoint {
            resident: r,
            decode_tokens_per_s: d,
            h2d_gb: h,
        });
    plot_sweep(&path, "test sweep", &points, Some(("baseline", 2.0))).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(svg.starts_with("<svg"));
    for label in [X_LABEL, DECODE_LABEL, H2D_LABEL, "test sweep", "baseline"] {
        assert!(svg.contains(label), "no `{label}` in the SVG");
    }
    let err = plot_sweep(&path, "empty", &[], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no sweep points to plot"), "{err}");
}

/// The model flags, parsed as the examples parse them (negative numbers reach the flags).
#[derive(Parser)]
#[command(allow_negative_numbers = true)]
struct Cli {
    #[command(flatten)]
    model: ModelArgs,
}

fn tiny(resident: &str) -> ModelArgs {
    Cli::try_parse_from([
        "bench",
        "--synthetic",
        "tiny",
        "--cpu",
        "--resident",
        resident,
    ])
    .unwrap()
    .model
}

/// Decode activations default to `i8` (as prefill and llama.cpp); `--decode-acts` chooses
/// either, whatever the dense weights, and anything else is refused by name.
#[test]
fn decode_acts_flag_chooses_and_i8_is_the_default() {
    assert_eq!(DecodeActivations::default(), DecodeActivations::I8);
    let acts = |flags: &[&str]| {
        let args = ["bench", "--synthetic", "tiny", "--cpu"];
        Cli::try_parse_from(args.iter().chain(flags)).map(|cli| cli.model.decode_acts)
    };
    assert_eq!(acts(&[]).unwrap(), None);
    for dense in ["bf16", "int8"] {
        for (flag, want) in [
            ("i16", DecodeActivations::I16),
            ("i8", DecodeActivations::I8),
        ] {
            let got = acts(&["--dense-weights", dense, "--decode-acts", flag]).unwrap();
            assert_eq!(got, Some(want));
        }
    }
    let err = acts(&["--decode-acts", "i4"]).unwrap_err().to_string();
    assert!(err.contains("i4") && err.contains("i16 or i8"), "{err}");
}

#[test]
fn shrunk_campaign_on_synthetic_tiny() {
    let contract = Contract {
        prompts: 2,
        blocks: 2,
        sample_len: 8,
        warmup: 4,
        prompt_tokens: None,
    };
    let device = candle::Device::Cpu;
    let mut runs = Vec::new();
    for resident in ["2", "all"] {
        let mut loaded = tiny(resident).load(DType::F32, &device).unwrap();
        let mut seen = 0u64;
        let c = run_campaign(&mut loaded, &contract, || seen += 1).unwrap();
        assert_eq!(seen, contract.total_tokens());
        assert_eq!(c.responses.len(), 4);
        assert!(
            c.template.is_some(),
            "synthetic models take the chat template"
        );
        assert!(!c.suppressed.is_empty());
        for r in &c.responses {
            assert_eq!((r.generated, r.tokens.len()), (8, 8));
            assert!(r.tokens.iter().all(|t| !c.suppressed.contains(t)));
            assert!(r.ttft_s > 0.0 && r.decode_s > 0.0 && r.response_s >= r.ttft_s + r.decode_s);
        }
        let m = Metrics::new(&c.responses);
        assert!(m.all_identical(), "greedy responses differ across blocks");
        assert!(m.decode_tokens_per_s.unwrap() > 0.0 && m.block_spread.is_some());
        // Counters of the measured responses only: less than the totals, which include warm-up.
        let measured = c.residency.clone().unwrap();
        let total = loaded.residency.as_ref().unwrap().stats();
        assert!(measured.hits + measured.misses > 0);
        assert!(measured.hits + measured.misses < total.hits + total.misses);
        assert_eq!(measured.preload_bytes, 0);
        if resident == "all" {
            assert_eq!((measured.misses, measured.h2d_bytes), (0, 0));
        } else {
            assert!(measured.misses > 0 && measured.h2d_bytes > 0);
        }
        runs.push(
            c.responses
                .into_iter()
                .map(|r| r.tokens)
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(runs[0], runs[1], "residency changed the generated tokens");
}

#[test]
fn campaign_with_a_fixed_prompt_length() {
    let contract = Contract {
        prompts: 2,
        blocks: 1,
        sample_len: 3,
        warmup: 2,
        prompt_tokens: Some(37),
    };
    let mut loaded = tiny("all").load(DType::F32, &candle::Device::Cpu).unwrap();
    let c = run_campaign(&mut loaded, &contract, || {}).unwrap();
    assert_eq!(c.responses.len(), 2);
    for r in &c.responses {
        assert_eq!((r.prompt_tokens, r.generated), (37, 3));
    }
}

/// Model flags the model cannot run with are refused by `ModelArgs::check` (which `load` runs
/// first) before any weights are read, naming the flag and both numbers; negative numbers reach
/// the flags' own checks instead of clap's "unexpected argument".
#[test]
fn model_flags_beyond_the_model_are_refused_before_loading() {
    let check = |flags: &[&str]| {
        let args = ["generate", "--synthetic", "tiny", "--cpu"];
        let cli = Cli::try_parse_from(args.iter().chain(flags)).map_err(|e| e.to_string())?;
        cli.model
            .check(DType::F32, &candle::Device::Cpu)
            .map_err(|e| format!("{e:#}"))
    };
    let max = Cli::try_parse_from(["generate", "--synthetic", "tiny"])
        .unwrap()
        .model
        .config()
        .unwrap()
        .spec()
        .unwrap()
        .max_position_embeddings;
    check(&[]).unwrap();
    check(&["--ctx", "2"]).unwrap();
    check(&["--ctx", &max.to_string()]).unwrap();
    for ctx in [0, 1, max + 1, 100 * max] {
        let err = check(&["--ctx", &ctx.to_string()]).unwrap_err();
        assert!(
            err.contains(&format!("--ctx {ctx}")) && err.contains(&format!("2..={max}")),
            "{err}"
        );
    }
    // The tiny model: 2 MoE layers of 8 experts, top-2.
    check(&["--resident", "2"]).unwrap();
    for resident in ["9", "1", "3,4,5"] {
        let err = check(&["--resident", resident]).unwrap_err();
        assert!(err.contains("memory plan"), "--resident {resident}: {err}");
    }
    // A negative number reaches the flag's own parser, not clap's "unexpected argument".
    let err = check(&["--resident", "-3"]).unwrap_err();
    assert!(
        err.contains("residency = -3 is not `all`, a number of experts per layer"),
        "{err}"
    );
}
