//! `--profile`'s tally (`candle_qmoe::profile`) around a real model's decoding. Alone in its
//! own test binary: the tally is process-wide, and another test's model running beside it would
//! add calls to the counts this test checks.

use candle::{DType, Device};
use candle_qmoe::generation::{argmax, generate};
use candle_qmoe::models::MoeForCausalLm;
use candle_qmoe::pack::GroupSize;
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use candle_qmoe_suite::perf::{mean_decode_context, profile_json};

const PROMPT: [u32; 6] = [50279, 510, 3158, 8516, 30013, 27287];

/// `profile` (`--profile`): off, decoding records nothing; on, every part of the pass is
/// timed once per layer (the output head once) per decoded token, the parts' time fits in the
/// decode time, and the weight bytes by part add up to the model's bytes per token.
#[test]
fn decode_profile_times_every_part_of_the_pass() {
    use candle_qmoe::profile::{self, Part};
    let s = SyntheticModel::new(SyntheticKind::Tiny, 5, GroupSize::default()).unwrap();
    let mut model = s.load(DType::F32, &Device::Cpu, &s.int4_experts()).unwrap();
    let greedy = |m: &mut MoeForCausalLm| generate(m, &PROMPT, 9, &[], argmax, |_| Ok(())).unwrap();
    assert!(greedy(&mut model).decode_profile.is_none());
    profile::enable(true);
    let g = greedy(&mut model);
    profile::enable(false);
    let p = g.decode_profile.expect("profiled");
    let (decoded, layers) = (g.tokens.len() as u64 - 1, s.spec().num_layers() as u64);
    let timed: Vec<Part> = p.parts().map(|(part, ..)| part).collect();
    assert_eq!(
        timed,
        [
            Part::QkvProjection,
            Part::Attention,
            Part::OutputProjection,
            Part::NormsAndResiduals,
            Part::Router,
            Part::RoutedExperts,
            Part::LmHead
        ]
    );
    for (part, _, calls) in p.parts() {
        let per_token = match part {
            Part::LmHead => 1,
            // The input norm, the residual + post-attention norm, the last residual.
            Part::NormsAndResiduals => 3 * layers,
            _ => layers,
        };
        assert_eq!(calls, per_token * decoded, "{part:?}");
    }
    assert!(
        p.total() <= g.decode_time,
        "{:?} > {:?}",
        p.total(),
        g.decode_time
    );
    let by_part = model.weight_bytes_by_part();
    let embedding_row = s.spec().hidden_size * 4;
    assert_eq!(
        by_part.iter().map(|(_, b)| b).sum::<usize>() + embedding_row,
        model.weight_bytes_per_token()
    );
    let bytes = |part| by_part.iter().find(|(p, _)| *p == part).unwrap().1;
    for part in [
        Part::QkvProjection,
        Part::OutputProjection,
        Part::RoutedExperts,
        Part::LmHead,
    ] {
        assert!(bytes(part) > 0, "{part:?}");
    }
    // The tiny model has neither shared experts nor dense layers.
    assert_eq!(bytes(Part::SharedExpert) + bytes(Part::DenseMlp), 0);

    // The report: the attention's bytes are the KV cache it reads (F32 here) at the mean
    // context of the decoding steps: 6 + 1 … 6 + 8 positions, 10.5 on average.
    let spec = s.spec();
    let per_position = spec.num_layers() * 2 * spec.num_kv_heads * spec.head_dim * 4;
    assert_eq!(model.kv_bytes_per_position(), per_position);
    let context = mean_decode_context(PROMPT.len(), g.tokens.len());
    assert_eq!(context, 10.5);
    let report = profile_json(
        &model,
        &p,
        decoded as usize,
        g.decode_time.as_secs_f64(),
        context,
    );
    let part = |name: &str| {
        let parts = report["parts"].as_array().unwrap();
        parts.iter().find(|x| x["part"] == name).unwrap().clone()
    };
    let attention = part("attention");
    assert_eq!(
        attention["kv_bytes_per_token"].as_f64(),
        Some(per_position as f64 * 10.5)
    );
    assert!(attention["gb_per_s"].as_f64().is_some_and(|g| g > 0.0));
    assert!(part("norms_and_residuals")["gb_per_s"].is_null());
    assert!(part("routed_experts")["kv_bytes_per_token"].is_null());
    let other = report["other_ms_per_token"].as_f64().unwrap();
    assert!(other >= 0.0, "{other}");
}
