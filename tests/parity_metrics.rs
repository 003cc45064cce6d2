//! `candle_qmoe::parity`, the metrics of the `parity` example: golden loading, the metric
//! arithmetic, and perfect numbers for the dense F32 ports on the fixtures. (The INT4 thresholds
//! are asserted with the same metrics in `model_parity.rs`.)

use std::collections::HashMap;

use candle::{DType, Device, Tensor};
use candle_qmoe::models::{self, AnyConfig, ExpertsBackend, MoeForCausalLm};
use candle_qmoe::parity::{compare, logit_agreement, router_agreement, Golden};
use candle_qmoe::QmoeError;
use candle_qmoe_suite::testing::{fixture_dir, FIXTURES};

#[test]
fn logit_agreement_arithmetic() {
    let a = Tensor::new(&[[1f32, 2.0, 3.0], [0.5, 0.1, -1.0]], &Device::Cpu).unwrap();
    let same = logit_agreement(&a, &a).unwrap();
    assert_eq!((same.top1, same.max_abs_diff), (1.0, 0.0));
    assert!(same.mean_kl.abs() < 1e-12);
    // A constant shift changes no probability.
    let shifted = logit_agreement(&(&a + 0.25).unwrap(), &a).unwrap();
    assert_eq!(shifted.top1, 1.0);
    assert!((shifted.max_abs_diff - 0.25).abs() < 1e-6);
    assert!(shifted.mean_kl.abs() < 1e-9);
    // One row's argmax flips: half agree, KL > 0.
    let b = Tensor::new(&[[1f32, 2.0, 3.0], [0.1, 0.5, -1.0]], &Device::Cpu).unwrap();
    let m = logit_agreement(&b, &a).unwrap();
    assert_eq!(m.top1, 0.5);
    assert!(m.mean_kl > 0.0);
    let e = logit_agreement(&a, &a.narrow(1, 0, 2).unwrap()).unwrap_err();
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::ShapeMismatch { got, expected, .. })
            if got == &[2, 3] && expected == &[2, 2]),
        "{e}"
    );

    // Router top-2 sets: the second token's set differs.
    let ours = Tensor::new(&[[0.9f32, 0.5, 0.1], [0.2, 0.3, 0.9]], &Device::Cpu).unwrap();
    let golden = Tensor::new(&[[[3f32, 2.0, 1.0], [3.0, 1.0, 2.0]]], &Device::Cpu).unwrap();
    assert_eq!(
        router_agreement(std::slice::from_ref(&ours), &golden, &[2]).unwrap(),
        0.5
    );
    assert_eq!(router_agreement(&[ours], &golden, &[1]).unwrap(), 0.5);
}

#[test]
fn golden_files_are_checked() {
    let path = fixture_dir("olmoe-tiny").join("golden.safetensors");
    let golden = Golden::load(&path).unwrap();
    assert_eq!(golden.prompts.len(), 2);
    assert_eq!(golden.prompts[0].greedy_ids.len(), 24);
    assert!(golden.prompts[1].router_logits.is_some());

    let tensors: HashMap<String, Tensor> = candle::safetensors::load(&path, &Device::Cpu).unwrap();
    let mut missing = tensors.clone();
    missing.remove("prompt1.greedy_ids");
    let invalid = |r: candle_qmoe::Result<Golden>, what: &str| match r {
        Err(QmoeError::InvalidFile { file, reason }) => {
            assert!(
                file.contains("golden file") && reason.contains(what),
                "{file}: {reason}"
            )
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    };
    invalid(
        Golden::from_tensors(missing),
        "missing `prompt1.greedy_ids`",
    );
    let mut short = tensors;
    let logits = short["prompt0.logits"].narrow(0, 0, 3).unwrap();
    short.insert("prompt0.logits".into(), logits);
    invalid(Golden::from_tensors(short), "do not fit together");
    invalid(
        Golden::from_tensors(HashMap::new()),
        "no `prompt0.input_ids`",
    );
    invalid(
        Golden::load(fixture_dir("olmoe-tiny").join("nope.safetensors")),
        "",
    );
}

/// The dense F32 ports reproduce transformers: within 1e-3 everywhere (measured ≈ 5e-6), every
/// argmax, every greedy token and every router top-k set.
#[test]
fn dense_f32_parity_numbers_are_perfect() {
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let cfg = AnyConfig::from_file(dir.join("config.json")).unwrap();
        let vb = unsafe { models::mmap_checkpoint(&dir, DType::F32, &Device::Cpu) }.unwrap();
        let mut model = MoeForCausalLm::new(&cfg, vb, &ExpertsBackend::Dense).unwrap();
        let golden = Golden::load(dir.join("golden.safetensors")).unwrap();
        for (p, r) in compare(&mut model, &golden).unwrap().iter().enumerate() {
            assert!(r.max_abs_diff <= 1e-3, "{name} prompt{p}: {r:?}");
            assert!(r.mean_kl <= 1e-9, "{name} prompt{p}: {r:?}");
            assert_eq!(r.top1_agreement, 1.0, "{name} prompt{p}");
            assert_eq!(r.greedy_prefix_match, r.greedy_steps, "{name} prompt{p}");
            assert_eq!(r.router_agreement, Some(1.0), "{name} prompt{p}");
            assert_eq!(r.prompt_tokens, golden.prompts[p].input_ids.len());
        }
    }
}
