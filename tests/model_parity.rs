//! The OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral and GraniteMoE ports against transformers 5.24 on
//! the tiny fixtures (`tests/fixtures/{olmoe,qwen2moe,qwen3moe,mixtral,granitemoe}-tiny`, BF16 weights, golden
//! computed in float32), plus the ports' handling of bad input. Every check runs on every
//! fixture of `candle_qmoe_suite::testing::FIXTURES`.

use std::collections::HashMap;
use std::sync::Arc;

use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_qmoe::kernels::cpu::{DecodeActivations, W4A8_MIN_TOKENS};
use candle_qmoe::models::{
    self, granitemoe, mixtral, olmoe, qwen2_moe, qwen3_moe, AnyConfig, ExpertTensor,
    ExpertsBackend, ExpertsLoader, FfnSpec, FusedRows, ModelConfig, MoeForCausalLm, MoeNames,
    Multipliers, PackedExperts, QkNorm, QuantizeOptions,
};
use candle_qmoe::parity::{
    compare_prompt, compared_rows, greedy_continuation, logit_agreement, topk_sets, Golden,
    ParityBounds, PromptParity,
};
use candle_qmoe::{GroupSize, QmoeError, ScaleSearch};
use candle_qmoe_suite::testing::{
    fixture_dir, golden_prompt_count, load_golden, max_abs_diff_tensors as max_abs_diff, FIXTURES,
};
use serde_json::json;

/// Dense F32 compute from the BF16 weights must reproduce transformers' float32 logits to this.
/// Both sides are F32 sums of the same products, differing only in summation order (≈ n·2⁻²⁴
/// relative per dot product of length n ≤ 512, compounding over the fixtures' 2 layers): measured
/// 2.5e-6–5.7e-6 on every fixture and prompt. 1e-4 leaves 17× for the summation orders of other
/// CPUs' GEMM kernels; the port defects seen so far (a wrong RoPE base, a norm in the wrong
/// place) move logits by more than 1e-2.
const DENSE_TOL: f64 = 1e-4;

fn config_json(name: &str) -> String {
    std::fs::read_to_string(fixture_dir(name).join("config.json")).unwrap()
}

fn fixture_tensors(name: &str) -> HashMap<String, Tensor> {
    candle::safetensors::load(fixture_dir(name).join("model.safetensors"), &Device::Cpu).unwrap()
}

fn load(name: &str, cfg: &impl ModelConfig, backend: &dyn ExpertsLoader) -> MoeForCausalLm {
    load_in(name, cfg, DType::F32, backend)
}

/// The fixture `name` with its weights in `dtype`.
fn load_in(
    name: &str,
    cfg: &impl ModelConfig,
    dtype: DType,
    backend: &dyn ExpertsLoader,
) -> MoeForCausalLm {
    let vb = unsafe { models::mmap_checkpoint(fixture_dir(name), dtype, &Device::Cpu) }.unwrap();
    MoeForCausalLm::new(cfg, vb, backend).unwrap()
}

fn load_any(name: &str, backend: &dyn ExpertsLoader) -> MoeForCausalLm {
    let cfg = AnyConfig::from_file(fixture_dir(name).join("config.json")).unwrap();
    load(name, &cfg, backend)
}

fn ids_u32(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::U32).unwrap().to_vec1().unwrap()
}

fn row_tensor(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

fn golden_prompts(name: &str) -> Golden {
    Golden::load(fixture_dir(name).join("golden.safetensors")).unwrap()
}

fn dense_parity(name: &str, cfg: &impl ModelConfig) {
    let golden = load_golden(name);
    let spec = cfg.spec().unwrap();
    let mut model = load(name, cfg, &ExpertsBackend::Dense);
    for p in 0..golden_prompt_count(&golden) {
        let g = |k: &str| golden[&format!("prompt{p}.{k}")].clone();
        let prompt = ids_u32(&g("input_ids"));

        // Full forward: every logit, and the router's top-k per MoE layer and token.
        model.clear_kv_cache();
        let (logits, routers) = model
            .forward_all_with_router_logits(&row_tensor(&prompt), 0)
            .unwrap();
        let diff = max_abs_diff(&logits.squeeze(0).unwrap(), &g("logits"));
        eprintln!(
            "{name} prompt{p} ({} tokens): full-forward max |Δlogit| = {diff:.2e}",
            prompt.len()
        );
        assert!(
            diff <= DENSE_TOL,
            "{name} prompt{p}: max |Δlogit| {diff} > {DENSE_TOL}"
        );
        let golden_routers = g("router_logits");
        assert_eq!(routers.len(), golden_routers.dim(0).unwrap());
        for (l, ours) in routers.iter().enumerate() {
            let k = spec.moe_blocks().nth(l).unwrap().1.top_k;
            // transformers records raw logits for some families and softmax probabilities for
            // others; softmax is monotonic, so the top-k sets compare either way.
            let want = topk_sets(&golden_routers.get(l).unwrap(), k).unwrap();
            assert_eq!(
                topk_sets(&ours.squeeze(0).unwrap(), k).unwrap(),
                want,
                "{name} prompt{p}: router top-{k} of MoE layer {l}"
            );
        }

        // Greedy continuation with the KV cache, one token per step after the prompt.
        let want_ids = ids_u32(&g("greedy_ids"));
        let (ids, step_logits) = greedy_continuation(&mut model, &prompt, want_ids.len()).unwrap();
        assert_eq!(ids, want_ids, "{name} prompt{p}: greedy continuation");
        let diff = max_abs_diff(&step_logits, &g("greedy_step_logits"));
        eprintln!("{name} prompt{p}: KV-cached step logits max |Δlogit| = {diff:.2e}");
        assert!(
            diff <= DENSE_TOL,
            "{name} prompt{p}: step max |Δlogit| {diff} > {DENSE_TOL}"
        );
    }
}

/// One test per port, each through the port's own `Config`.
macro_rules! dense_parity_tests {
    ($($test:ident: $port:ident on $fixture:literal;)*) => {$(
        #[test]
        fn $test() {
            let cfg = $port::Config::from_json_str(&config_json($fixture)).unwrap();
            dense_parity($fixture, &cfg);
        }
    )*};
}

dense_parity_tests! {
    olmoe_dense_f32_matches_transformers: olmoe on "olmoe-tiny";
    qwen2moe_dense_f32_matches_transformers: qwen2_moe on "qwen2moe-tiny";
    qwen3moe_dense_f32_matches_transformers: qwen3_moe on "qwen3moe-tiny";
    mixtral_dense_f32_matches_transformers: mixtral on "mixtral-tiny";
    granitemoe_dense_f32_matches_transformers: granitemoe on "granitemoe-tiny";
}

/// Configs that spell the fixtures' settings the ways transformers 5 reads them still match the
/// goldens: Mixtral without `rope_theta` (its default base is 10⁶, the fixture's), a base inside
/// `rope_parameters` or a `default` `rope_scaling` winning over a wrong top-level `rope_theta`,
/// and `tie_word_embeddings: true` beside a stored `lm_head.weight` (which is used, untied).
#[test]
fn config_spellings_match_transformers_on_the_goldens() {
    let mixtral = edit_config("mixtral-tiny", |v| {
        v.as_object_mut().unwrap().remove("rope_theta");
    });
    dense_parity("mixtral-tiny", &AnyConfig::from_json_str(&mixtral).unwrap());
    for name in ["qwen2moe-tiny", "qwen3moe-tiny"] {
        for key in ["rope_parameters", "rope_scaling"] {
            let json = edit_config(name, |v| {
                v["rope_theta"] = 10_000.0.into();
                v[key] = json!({"rope_type": "default", "rope_theta": 1e6});
            });
            dense_parity(name, &AnyConfig::from_json_str(&json).unwrap());
        }
    }
    let json = edit_config("olmoe-tiny", |v| v["tie_word_embeddings"] = true.into());
    dense_parity("olmoe-tiny", &AnyConfig::from_json_str(&json).unwrap());
}

/// Teacher-forced metrics over the prompt and the golden greedy continuation, greedy identity and
/// router agreement (`candle_qmoe::parity`, the metrics of the `parity` example).
fn fidelity(model: &mut MoeForCausalLm, golden: &Golden, p: usize) -> PromptParity {
    compare_prompt(model, &golden.prompts[p]).unwrap()
}

fn describe(f: &PromptParity) -> String {
    format!(
        "top1 {:.4} kl {:.2e} max|Δ| {:.2e} greedy {}/{} router {:.4}",
        f.top1_agreement,
        f.mean_kl,
        f.max_abs_diff,
        f.greedy_prefix_match,
        f.greedy_steps,
        f.router_agreement.unwrap()
    )
}

/// Least top-1 agreement of INT4 g128 experts with the golden (see
/// `int4_experts_track_transformers`): the `parity` example's default bound.
const INT4_MIN_TOP1: f64 = ParityBounds::QUANTIZED.min_top1;
/// Largest mean KL of INT4 g128 experts against the golden, nats (the `parity` default).
const INT4_MAX_MEAN_KL: f64 = ParityBounds::QUANTIZED.max_mean_kl;
/// Largest |Δlogit| of INT4 g128 experts against the golden.
const INT4_MAX_ABS: f64 = 2.5;

/// INT4 routed experts (g128, MSE scales; everything else F32) against the transformers golden,
/// teacher-forced over the prompt and the golden greedy continuation.
///
/// Where the thresholds come from (all measured on these fixtures, see the eprintln output):
/// * The fixtures' experts are Gaussian random matrices; 4-bit g128 MSE quantization leaves a
///   relative RMS weight error of ~11% (the textbook figure for 16 levels). The random 2-layer
///   models lean on their experts, so that moves the logits (RMS ≈ 1) by up to 0.42–0.94
///   (Mixtral, whose top-2 routing leans on fewer experts: 1.7–1.8; GraniteMoE, top-2 and a
///   residual multiplier of 1.6 that scales each expert's error with its output: 1.0–2.0), with
///   mean KL 5.0e-3–1.5e-2 nats (Mixtral 2.1e-2–3.0e-2, GraniteMoE 7.4e-3–2.6e-2); the same numbers come out of the dense oracle run on the
///   dequantized weights (see `int4_kernel_matches_dequantized_oracle_in_model`), so this is
///   quantization error, not kernel error.
/// * Top-1/top-2 logit gaps are small (median 0.06–0.2, minimum 0.006), so that noise flips the
///   argmax at 3–33% of positions (measured top-1 0.67–0.97; granitemoe-tiny's prompt1 0.57,
///   the least headroom of any fixture) and greedy continuations diverge
///   after 0–17 tokens; greedy identity is printed, not asserted. The KV cache is checked
///   instead against our own full forward (`ParityBounds`: a decode fed the golden tokens within
///   2e-2 of the largest logit; INT4 measures ≤ 2.3e-3).
/// * Bounds (`ParityBounds::QUANTIZED`, the `parity` example's default, and [`INT4_MAX_ABS`]):
///   top-1 ≥ 0.5, mean KL ≤ 5e-2, max |Δlogit| ≤ 2.5 — about 1.4–1.8× headroom over the worst prompt. A real
///   defect fails the first two by far: routing every token to the wrong experts (expert
///   `e + 1` for `e`) measured top-1 0.09–0.29 and KL 0.19–0.57 (max |Δlogit| 2.6–5.1). Subtler
///   kernel defects are caught by the tight in-model comparison with the dequantized oracle.
/// * Router agreement (the same bounds): the INT4 noise reaching a layer's input swaps near-tied
///   experts at the edge of the top-k for a few tokens of the second MoE layer (measured
///   0.86–1.0); ≥ 0.8 leaves
///   room while a broken router (random sets) would score near 0.
#[test]
fn int4_experts_track_transformers() {
    let backend = ExpertsBackend::Int4 {
        group_size: GroupSize::new(128).unwrap(),
        search: ScaleSearch::Mse,
    };
    for name in FIXTURES {
        let golden = golden_prompts(name);
        let mut dense = load_any(name, &ExpertsBackend::Dense);
        let mut int4 = load_any(name, &backend);
        for p in 0..golden.prompts.len() {
            let d = fidelity(&mut dense, &golden, p);
            let q = fidelity(&mut int4, &golden, p);
            eprintln!(
                "{name} prompt{p}: dense f32 {} | int4 g128 {}",
                describe(&d),
                describe(&q)
            );
            assert_eq!(d.top1_agreement, 1.0, "{name} prompt{p}: dense top-1");
            assert_eq!(d.greedy_prefix_match, d.greedy_steps, "{name} prompt{p}");
            assert_eq!(d.router_agreement, Some(1.0), "{name} prompt{p}");
            let broken = ParityBounds::QUANTIZED.violations(std::slice::from_ref(&q));
            assert!(broken.is_empty(), "{name} prompt{p}: int4 {broken:?}");
            assert!(
                q.max_abs_diff <= INT4_MAX_ABS,
                "{name} prompt{p}: int4 max |Δlogit| {}",
                q.max_abs_diff
            );
        }
    }
}

/// The MSE scale search ([`ScaleSearch::Mse`], the default) is no worse than plain
/// round-to-nearest (`absmax / 7`) at the same group size: summed over the prompts, its mean KL
/// against the golden is at most RTN's. Measured: see the eprintln output (MSE lowers the
/// weights' squared error by construction, and on every fixture and group size that carries
/// through to the logits).
#[test]
fn int4_mse_scales_are_no_worse_than_round_to_nearest() {
    for name in FIXTURES {
        let golden = golden_prompts(name);
        for g in [32, 128] {
            let kl = |search| {
                let group_size = GroupSize::new(g).unwrap();
                let mut model = load_any(name, &ExpertsBackend::Int4 { group_size, search });
                (0..golden.prompts.len())
                    .map(|p| fidelity(&mut model, &golden, p).mean_kl)
                    .sum::<f64>()
            };
            let (mse, rtn) = (kl(ScaleSearch::Mse), kl(ScaleSearch::Rtn));
            eprintln!("{name} g{g}: summed mean KL mse {mse:.3e} rtn {rtn:.3e}");
            assert!(mse <= rtn, "{name} g{g}: mse {mse} > rtn {rtn}");
        }
    }
}

/// The fixture's experts packed in memory, served as INT4 (the kernels) or dequantized to dense
/// F32 (the exact function the kernels should compute).
fn packed(name: &str, group: GroupSize) -> PackedExperts {
    let opts = QuantizeOptions {
        group_size: group,
        ..Default::default()
    };
    let pack = models::quantize_checkpoint(fixture_dir(name), &opts, &|_, _| {}).unwrap();
    PackedExperts::for_checkpoint(Arc::new(pack), fixture_dir(name)).unwrap()
}

/// In the full model, the INT4 kernel matches the dense oracle on the dequantized weights, so
/// any difference is kernel arithmetic, not weight quantization. Calls of fewer than
/// `W4A8_MIN_TOKENS` tokens (decode-sized; prompt 0 has 7) take the chosen decode activations,
/// longer ones (prompt 1 has 33 tokens) always `i8`; both choices are run.
///
/// With `i16` decode activations, rounded per group to `DECODE_ACT_MAX` (1927) levels, at most
/// 1/3854 of the group's largest value: measured max |Δlogit| 1.5e-3–3.0e-3 and KL 7e-8–2.3e-7
/// on every fixture (at 32767 levels, 17× finer, the max |Δlogit| was 8e-5–3.4e-4); the bounds,
/// 1e-2 and 1e-6, leave 3× and 4×. Top-1 agreement is printed, not asserted there: an argmax can
/// only flip where the oracle's top two logits are closer than 2 × max |Δlogit| (< 2e-2), and
/// the random fixtures have such near-ties.
///
/// `i8` activations (the default at decode, and every longer call) round to 127 levels per
/// group: a relative error of ~1% per projection (tests/routed_experts.rs), through two layers.
/// Measured on 7-token prompts KL 1.6e-5–5.4e-5 (bound 2e-4, 3.7× the largest), max |Δlogit|
/// 2.5e-2–4.5e-2, and 3 of 168 argmaxes flipped at near-ties (a one-position flip is 1/7 of a
/// 7-token prompt, so top-1 is asserted on long prompts only); on 33-token prompts KL
/// 2e-5–8e-4 (max |Δlogit| ≤ 0.6), and 1.9e-3 / 3.2e-3 (max ≈ 1) on mixtral-tiny g128 / g256,
/// whose top-2 routing amplifies small changes: the bound, 4e-3, is an eighth of what INT4
/// weights cost on Mixtral's fixture (~3e-2) and under half of the others' (~1e-2, `int4_*`
/// above), with top-1 agreeing on at least 90% of the positions.
#[test]
fn int4_kernel_matches_dequantized_oracle_in_model() {
    for name in FIXTURES {
        let golden = load_golden(name);
        for g in [32, 128, 256] {
            let group = GroupSize::new(g).unwrap();
            let experts = packed(name, group);
            let mut oracle = load_any(name, &experts.clone().dequantized(DType::F32));
            for acts in [DecodeActivations::I16, DecodeActivations::I8] {
                let mut int4 = load_any(name, &experts.clone().with_decode_activations(acts));
                for p in 0..golden_prompt_count(&golden) {
                    let ids = ids_u32(&golden[&format!("prompt{p}.input_ids")]);
                    let a8 = acts.int8_at(ids.len());
                    let long = ids.len() >= W4A8_MIN_TOKENS;
                    let ids = row_tensor(&ids);
                    int4.clear_kv_cache();
                    oracle.clear_kv_cache();
                    let a = int4.forward_all(&ids, 0).unwrap().squeeze(0).unwrap();
                    let b = oracle.forward_all(&ids, 0).unwrap().squeeze(0).unwrap();
                    let m = logit_agreement(&a, &b).unwrap();
                    let what = if a8 { "i8" } else { "i16" };
                    eprintln!(
                        "{name} g{g} prompt{p} ({what} activations): int4 kernel vs dequantized \
                         oracle max |Δlogit| {:.2e}, KL {:.2e}, top-1 {:.3}",
                        m.max_abs_diff, m.mean_kl, m.top1
                    );
                    if a8 {
                        let bound = if long { 4e-3 } else { 2e-4 };
                        assert!(m.mean_kl < bound, "{name} g{g} prompt{p}: KL {}", m.mean_kl);
                        assert!(
                            !long || m.top1 >= 0.9,
                            "{name} g{g} prompt{p}: top-1 {}",
                            m.top1
                        );
                    } else {
                        assert!(m.max_abs_diff < 1e-2, "{name} g{g} prompt{p}: {m:?}");
                        assert!(m.mean_kl < 1e-6, "{name} g{g} prompt{p}: {m:?}");
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input

/// The message of an error of Candle's own (a missing or truncated tensor).
fn err_string<T, E: std::fmt::Display>(r: Result<T, E>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// The `QmoeError` a model call failed with.
fn model_error<T>(r: candle::Result<T>) -> QmoeError {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => QmoeError::from(e),
    }
}

fn edit_config(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v: serde_json::Value = serde_json::from_str(&config_json(name)).unwrap();
    edit(&mut v);
    v.to_string()
}

fn spec_ok(json: &str) -> models::ModelSpec {
    AnyConfig::from_json_str(json).unwrap().spec().unwrap()
}

fn spec_error(json: &str) -> QmoeError {
    match AnyConfig::from_json_str(json).and_then(|c| c.spec()) {
        Ok(_) => panic!("accepted"),
        Err(e) => e,
    }
}

/// Asserts that `e` refuses `field = value`, and returns its message.
fn refused(e: QmoeError, field: &str, value: &str) -> String {
    assert!(
        matches!(&e, QmoeError::UnsupportedConfig { field: f, value: v, .. } if f == field && v == value),
        "expected {field} = {value} refused: {e}"
    );
    e.to_string()
}

#[test]
fn missing_tensor_is_named() {
    for (name, missing) in [
        ("olmoe-tiny", "model.layers.1.self_attn.k_norm.weight"),
        (
            "qwen2moe-tiny",
            "model.layers.0.mlp.experts.5.up_proj.weight",
        ),
        (
            "qwen2moe-tiny",
            "model.layers.1.mlp.shared_expert_gate.weight",
        ),
        ("qwen3moe-tiny", "model.layers.1.self_attn.q_norm.weight"),
        (
            "mixtral-tiny",
            "model.layers.0.block_sparse_moe.experts.5.w3.weight",
        ),
        (
            "mixtral-tiny",
            "model.layers.1.block_sparse_moe.gate.weight",
        ),
        (
            "granitemoe-tiny",
            "model.layers.1.block_sparse_moe.input_linear.weight",
        ),
        (
            "granitemoe-tiny",
            "model.layers.0.block_sparse_moe.output_linear.weight",
        ),
        (
            "granitemoe-tiny",
            "model.layers.0.block_sparse_moe.router.layer.weight",
        ),
    ] {
        let mut ts = fixture_tensors(name);
        assert!(ts.remove(missing).is_some());
        let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
        let cfg = AnyConfig::from_json_str(&config_json(name)).unwrap();
        let msg = err_string(MoeForCausalLm::new(&cfg, vb, &ExpertsBackend::Dense));
        assert!(msg.contains(missing), "{msg}");
    }
}

/// Each fixture's family is found from `model_type`, or from `architectures` without it; a
/// config handed to another family's port is refused. (Unsupported families: `bad_input.rs`.)
#[test]
fn families_are_chosen_by_model_type_or_architecture() {
    for (name, model_type) in FIXTURES.into_iter().zip(models::SUPPORTED_MODEL_TYPES) {
        assert_eq!(spec_ok(&config_json(name)).model_type, model_type);
        let json = edit_config(name, |v| {
            v.as_object_mut().unwrap().remove("model_type");
        });
        assert_eq!(
            AnyConfig::from_json_str(&json).unwrap().model_type(),
            model_type
        );
    }
    let qwen = olmoe::Config::from_json_str(&config_json("qwen2moe-tiny")).unwrap();
    refused(qwen.spec().unwrap_err(), "model_type", "qwen2_moe");
    let olmoe_as_mixtral = mixtral::Config::from_json_str(&config_json("olmoe-tiny")).unwrap();
    refused(olmoe_as_mixtral.spec().unwrap_err(), "model_type", "olmoe");
    let qwen3_as_qwen2 = qwen2_moe::Config::from_json_str(&config_json("qwen3moe-tiny"));
    // Without `shared_expert_intermediate_size` the Qwen2-MoE port cannot even parse it.
    assert!(
        matches!(&qwen3_as_qwen2, Err(QmoeError::InvalidFile { reason, .. })
            if reason.contains("shared_expert_intermediate_size")),
        "{qwen3_as_qwen2:?}"
    );
}

#[test]
fn inconsistent_configs_are_refused() {
    for name in FIXTURES {
        let e = spec_error(&edit_config(name, |v| {
            v["num_attention_heads"] = 3.into();
            v["head_dim"] = serde_json::Value::Null;
        }));
        let msg = refused(e, "num_attention_heads", "3");
        assert!(msg.contains("does not divide hidden_size"), "{msg}");
        let e = spec_error(&edit_config(name, |v| v["num_experts_per_tok"] = 9.into()));
        refused(e, "num_experts_per_tok", "9");
        let e = spec_error(&edit_config(name, |v| v["num_experts_per_tok"] = 0.into()));
        refused(e, "num_experts_per_tok", "0");
        let e = spec_error(&edit_config(name, |v| v["num_key_value_heads"] = 3.into()));
        refused(e, "num_key_value_heads", "3");
        let e = spec_error(&edit_config(name, |v| {
            v.as_object_mut().unwrap().remove("hidden_size");
        }));
        assert!(
            matches!(&e, QmoeError::InvalidFile { reason, .. } if reason.contains("hidden_size")),
            "{e}"
        );
        // RoPE scaling is not implemented: every family refuses it the same way, naming the type
        // (or `rope_scaling` when it names none); `null` and `default` are plain RoPE.
        for (scaling, field, value) in [
            (
                json!({"rope_type": "yarn", "factor": 4.0}),
                "rope_type",
                "yarn",
            ),
            (
                json!({"type": "linear", "factor": 2.0}),
                "rope_type",
                "linear",
            ),
            (json!({"factor": 2.0}), "rope_scaling", r#"{"factor":2.0}"#),
        ] {
            let e = spec_error(&edit_config(name, |v| v["rope_scaling"] = scaling));
            let msg = refused(e, field, value);
            assert!(msg.contains("only the default RoPE"), "{msg}");
        }
        let e = spec_error(&edit_config(name, |v| {
            v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 5e5})
        }));
        refused(e, "rope_type", "llama3");
        // The older `type` key inside `rope_parameters` too (it was ignored).
        let e = spec_error(&edit_config(name, |v| {
            v["rope_parameters"] = json!({"type": "yarn", "factor": 2.0, "rope_theta": 5.0})
        }));
        refused(e, "rope_type", "yarn");
        // `null` and `{}` are unset, as transformers reads them.
        let plain = spec_ok(&config_json(name));
        for scaling in [json!(null), json!({}), json!({"rope_type": "default"})] {
            let spec = spec_ok(&edit_config(name, |v| v["rope_scaling"] = scaling.clone()));
            assert_eq!(spec, plain, "{name}: rope_scaling {scaling}");
        }
    }
    for name in ["qwen2moe-tiny", "qwen3moe-tiny"] {
        let e = spec_error(&edit_config(name, |v| v["decoder_sparse_step"] = 0.into()));
        refused(e, "decoder_sparse_step", "0");
        // Configs that leave every layer dense are refused when read (so `plan` refuses them
        // as `generate` and `quantize` do), naming what decides it.
        let layers = 2;
        for edit in [
            json!({"num_experts": 0}),
            json!({"decoder_sparse_step": layers + 1}),
            json!({"mlp_only_layers": [0, 1]}),
        ] {
            let e = spec_error(&edit_config(name, |v| {
                v["num_hidden_layers"] = layers.into();
                for (k, x) in edit.as_object().unwrap() {
                    v[k] = x.clone();
                }
            }));
            let msg = refused(
                e,
                "model_type",
                if name.starts_with("qwen2") {
                    "qwen2_moe"
                } else {
                    "qwen3_moe"
                },
            );
            assert!(
                msg.contains("no MoE layer") && msg.contains("num_experts"),
                "{edit}: {msg}"
            );
        }
        let e = spec_error(&edit_config(name, |v| {
            v["use_sliding_window"] = true.into()
        }));
        refused(e, "use_sliding_window", "true");
    }
    // Mixtral has no switch: a sliding window is on whenever it is set, and refused unless it
    // spans max_position_embeddings (512 here), which is full attention.
    let e = spec_error(&edit_config("mixtral-tiny", |v| {
        v["sliding_window"] = 256.into()
    }));
    let msg = refused(e, "sliding_window", "256");
    assert!(msg.contains("only full attention"), "{msg}");
    let full = spec_ok(&config_json("mixtral-tiny"));
    for window in [512, 4096] {
        let json = edit_config("mixtral-tiny", |v| v["sliding_window"] = window.into());
        assert_eq!(spec_ok(&json), full, "sliding_window {window}");
    }
    // `swish` is SiLU's other name in transformers.
    let json = edit_config("mixtral-tiny", |v| v["hidden_act"] = "swish".into());
    assert_eq!(spec_ok(&json), full);
}

#[test]
fn config_spellings_and_defaults() {
    for name in FIXTURES {
        // The newer `rope_parameters.rope_theta` spelling.
        let json = edit_config(name, |v| {
            v.as_object_mut().unwrap().remove("rope_theta");
            v["rope_parameters"] = json!({"rope_theta": 5000.0, "rope_type": "default"});
        });
        assert_eq!(spec_ok(&json).rope_theta, 5000.0);
        // As transformers 5: a base inside `rope_parameters` wins over the top-level one, and
        // a set `rope_scaling` replaces `rope_parameters`.
        let json = edit_config(name, |v| {
            v["rope_theta"] = 1e6.into();
            v["rope_parameters"] = json!({"rope_theta": 100.0, "rope_type": "default"});
        });
        assert_eq!(spec_ok(&json).rope_theta, 100.0, "{name}");
        let json = edit_config(name, |v| {
            v["rope_theta"] = 1e6.into();
            v["rope_parameters"] = json!({"rope_theta": 100.0, "rope_type": "default"});
            v["rope_scaling"] = json!({"rope_type": "default", "rope_theta": 250.0});
        });
        assert_eq!(spec_ok(&json).rope_theta, 250.0, "{name}");
        let json = edit_config(name, |v| {
            v["rope_theta"] = 1e6.into();
            v["rope_scaling"] = json!({"rope_type": "default"});
        });
        assert_eq!(spec_ok(&json).rope_theta, 1e6, "{name}");
        // Absent fields take the family's transformers defaults: the RoPE base (Mixtral 10⁶,
        // the others 10⁴), max_position_embeddings, and num_key_value_heads (OLMoE: the heads;
        // Qwen2-MoE 16, Qwen3-MoE 4, Mixtral 8, refused by name where they do not divide the
        // fixtures' 4 heads).
        let (theta, max_positions, kv) = match name {
            "olmoe-tiny" => (1e4, 4096, 4),
            "qwen2moe-tiny" => (1e4, 32_768, 16),
            "qwen3moe-tiny" => (1e4, 32_768, 4),
            "mixtral-tiny" => (1e6, 131_072, 8),
            "granitemoe-tiny" => (1e4, 2048, 4),
            other => panic!("no defaults listed for {other}"),
        };
        let json = edit_config(name, |v| {
            let o = v.as_object_mut().unwrap();
            o.remove("rope_theta");
            o.remove("max_position_embeddings");
        });
        let spec = spec_ok(&json);
        assert_eq!(
            (spec.rope_theta, spec.max_position_embeddings),
            (theta, max_positions),
            "{name}"
        );
        let json = edit_config(name, |v| {
            v.as_object_mut().unwrap().remove("num_key_value_heads");
        });
        if kv <= 4 {
            assert_eq!(spec_ok(&json).num_kv_heads, kv, "{name}");
        } else {
            let e = refused(spec_error(&json), "num_key_value_heads", &kv.to_string());
            assert!(e.contains("transformers' default"), "{e}");
        }
        let json = edit_config(name, |v| v["num_key_value_heads"] = 2.into());
        assert_eq!(spec_ok(&json).num_kv_heads, 2);
        // The expert count as `num_experts` (hub configs) or `num_local_experts` (Mixtral,
        // transformers 5).
        let spec = spec_ok(&config_json(name));
        for key in ["num_experts", "num_local_experts"] {
            let json = edit_config(name, |v| {
                let o = v.as_object_mut().unwrap();
                let n = o.remove("num_experts").or(o.remove("num_local_experts"));
                o.insert(key.into(), n.unwrap());
            });
            assert_eq!(spec_ok(&json), spec, "{name}: {key}");
        }
    }
    let spec = spec_ok(&config_json("olmoe-tiny"));
    let a = &spec.attention;
    assert!(a.qk_norm == QkNorm::Projection && !a.qkv_bias && a.clip_qkv.is_none());
    assert_eq!(spec.qk_norm_sizes(), Some((256, 256)));
    let json = edit_config("olmoe-tiny", |v| v["clip_qkv"] = 8.0.into());
    let spec = spec_ok(&json);
    assert_eq!(spec.attention.clip_qkv, Some(8.0));
    let spec = spec_ok(&config_json("qwen2moe-tiny"));
    let a = &spec.attention;
    assert!(a.qkv_bias && !a.o_bias && a.qk_norm == QkNorm::None);
    // Qwen2-MoE and Qwen3-MoE: mlp_only_layers and decoder_sparse_step choose the dense layers,
    // by the same rule.
    for (name, dense) in [("qwen2moe-tiny", 512), ("qwen3moe-tiny", 384)] {
        assert_eq!(spec_ok(&config_json(name)).moe_layers(), vec![0, 1]);
        let json = edit_config(name, |v| {
            v["num_hidden_layers"] = 6.into();
            v["decoder_sparse_step"] = 2.into();
            v["mlp_only_layers"] = json!([3]);
        });
        let spec = spec_ok(&json);
        assert_eq!(spec.moe_layers(), vec![1, 5], "{name}");
        let intermediate_size = dense;
        assert_eq!(spec.layers[0], FfnSpec::Dense { intermediate_size });
    }
    // Qwen3-MoE: per-head q/k norm, an explicit head_dim (4 × 96 ≠ hidden 256), no shared
    // expert, `norm_topk_prob` as given, `attention_bias` on all four projections.
    let spec = spec_ok(&config_json("qwen3moe-tiny"));
    assert_eq!(
        (spec.head_dim, spec.attention.qk_norm),
        (96, QkNorm::PerHead)
    );
    assert_eq!(spec.qk_norm_sizes(), Some((96, 96)));
    let moe = spec.uniform_moe().unwrap();
    assert!(moe.norm_topk_prob && moe.shared_intermediate_size.is_none());
    assert_eq!((moe.intermediate_size, moe.names), (128, MoeNames::MLP));
    assert!(!spec.attention.qkv_bias && !spec.attention.o_bias);
    let json = edit_config("qwen3moe-tiny", |v| {
        v["norm_topk_prob"] = false.into();
        v["attention_bias"] = true.into();
    });
    let spec = spec_ok(&json);
    assert!(!spec.uniform_moe().unwrap().norm_topk_prob);
    assert!(spec.attention.qkv_bias && spec.attention.o_bias);
    // Mixtral: `head_dim: null` is hidden / heads, its own tensor names, and the softmax over
    // the chosen experts (renormalised top-k) whatever `norm_topk_prob` says.
    let spec = spec_ok(&config_json("mixtral-tiny"));
    assert_eq!((spec.head_dim, spec.num_kv_heads), (64, 2));
    let moe = spec.uniform_moe().unwrap();
    assert_eq!((moe.top_k, moe.intermediate_size), (2, 192));
    assert!(moe.norm_topk_prob && moe.names == MoeNames::MIXTRAL);
    let json = edit_config("mixtral-tiny", |v| v["norm_topk_prob"] = false.into());
    assert!(spec_ok(&json).uniform_moe().unwrap().norm_topk_prob);
    assert_eq!(
        MoeNames::MIXTRAL.expert_weights(1, 7),
        [
            "model.layers.1.block_sparse_moe.experts.7.w1.weight",
            "model.layers.1.block_sparse_moe.experts.7.w3.weight",
            "model.layers.1.block_sparse_moe.experts.7.w2.weight",
        ]
    );
    // GraniteMoE: Mixtral's routing, its own router and fused expert tensors, the four
    // multipliers; absent, each is 1 (transformers' defaults: `attention_multiplier` too, not
    // 1 / sqrt(head_dim)); a zero one is refused by name.
    let spec = spec_ok(&config_json("granitemoe-tiny"));
    let moe = spec.uniform_moe().unwrap();
    assert!(moe.norm_topk_prob && moe.names == MoeNames::GRANITE && spec.tie_word_embeddings);
    assert_eq!(spec.attention.scale, Some(0.0625));
    assert_eq!(
        spec.multipliers,
        Multipliers {
            embedding: 0.4,
            residual: 1.6,
            logits_divisor: 1.25
        }
    );
    assert_eq!(
        MoeNames::GRANITE.router_weight(1),
        "model.layers.1.block_sparse_moe.router.layer.weight"
    );
    let at = |name: &str, shape, expert, first_row| ExpertTensor {
        name: format!("model.layers.1.block_sparse_moe.{name}.weight"),
        shape,
        fused: Some(FusedRows { expert, first_row }),
    };
    assert_eq!(
        moe.expert_tensors(1, 7, 256),
        [
            at("input_linear", [192, 256], 7, 0),
            at("input_linear", [192, 256], 7, 192),
            at("output_linear", [256, 192], 7, 0)
        ]
    );
    let json = edit_config("granitemoe-tiny", |v| {
        let o = v.as_object_mut().unwrap();
        for key in [
            "embedding_multiplier",
            "residual_multiplier",
            "attention_multiplier",
            "logits_scaling",
        ] {
            o.remove(key);
        }
    });
    let spec = spec_ok(&json);
    assert_eq!(
        (spec.multipliers, spec.attention.scale),
        (Multipliers::NONE, Some(1.0))
    );
    for key in ["logits_scaling", "residual_multiplier"] {
        let e = spec_error(&edit_config("granitemoe-tiny", |v| v[key] = 0.0.into()));
        refused(e, key, "0");
    }
}

/// A Qwen2-MoE or Qwen3-MoE whose layer 1 is dense (`mlp_only_layers`) loads the dense MLP
/// weights there, only one layer's router logits come back, and the MLP's output
/// `down · (silu(gate · x) ⊙ up · x)` is added: with `down = 0` the logits do not depend on gate
/// and up at all (bit for bit), and any other `down`, gate or up moves them.
#[test]
fn qwen_mlp_only_layers_use_dense_mlp() {
    for (name, inter) in [("qwen2moe-tiny", 512), ("qwen3moe-tiny", 384)] {
        let json = edit_config(name, |v| v["mlp_only_layers"] = json!([1]));
        let cfg = AnyConfig::from_json_str(&json).unwrap();
        let mut ts = fixture_tensors(name);
        ts.retain(|k, _| !k.starts_with("model.layers.1.mlp."));
        let vb = VarBuilder::from_tensors(ts.clone(), DType::F32, &Device::Cpu);
        let msg = err_string(MoeForCausalLm::new(&cfg, vb, &ExpertsBackend::Dense));
        assert!(msg.contains("model.layers.1.mlp.gate_proj.weight"), "{msg}");
        let random =
            |shape: (usize, usize)| Tensor::randn(0f32, 0.02, shape, &Device::Cpu).unwrap();
        let logits = |[gate, up, down]: [&Tensor; 3]| {
            let mut ts = ts.clone();
            for (proj, w) in [("gate_proj", gate), ("up_proj", up), ("down_proj", down)] {
                ts.insert(format!("model.layers.1.mlp.{proj}.weight"), w.clone());
            }
            let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
            let mut model = MoeForCausalLm::new(&cfg, vb, &ExpertsBackend::Dense).unwrap();
            let (logits, routers) = model
                .forward_all_with_router_logits(&row_tensor(&[1, 2, 3]), 0)
                .unwrap();
            assert_eq!(logits.dims(), &[1, 3, 512]);
            assert_eq!(routers.len(), 1);
            assert_eq!(routers[0].dims(), &[1, 3, 8]);
            logits
        };
        let (gate, up, down) = (
            random((inter, 256)),
            random((inter, 256)),
            random((256, inter)),
        );
        let (gate2, up2) = (random((inter, 256)), random((inter, 256)));
        let zero = Tensor::zeros((256, inter), DType::F32, &Device::Cpu).unwrap();
        let with_mlp = logits([&gate, &up, &down]);
        let without = logits([&gate, &up, &zero]);
        assert_eq!(max_abs_diff(&without, &logits([&gate2, &up2, &zero])), 0.0);
        // Either change moves the logits by 6e-2–8e-2 (measured); F32 noise alone is ~1e-6.
        for (what, other) in [
            ("down_proj", &without),
            ("gate_proj and up_proj", &logits([&gate2, &up2, &down])),
        ] {
            let d = max_abs_diff(&with_mlp, other);
            assert!(d > 1e-3, "{name}: {what} changes the logits by only {d:e}");
        }
    }
}

/// With `tie_word_embeddings` the head is `embed_tokens` and no `lm_head.weight` is read: the
/// logits are those of the untied model whose `lm_head` is a copy of the embeddings.
#[test]
fn tied_embeddings_share_the_head() {
    for name in FIXTURES {
        let mut ts = fixture_tensors(name);
        let embeddings = ts["model.embed_tokens.weight"].clone();
        ts.insert("lm_head.weight".into(), embeddings);
        let vb = VarBuilder::from_tensors(ts.clone(), DType::F32, &Device::Cpu);
        let untied = AnyConfig::from_json_str(&config_json(name)).unwrap();
        let mut copy = MoeForCausalLm::new(&untied, vb, &ExpertsBackend::Dense).unwrap();
        ts.remove("lm_head.weight");
        let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
        let json = edit_config(name, |v| v["tie_word_embeddings"] = true.into());
        let tied = AnyConfig::from_json_str(&json).unwrap();
        assert!(tied.spec().unwrap().tie_word_embeddings);
        let mut model = MoeForCausalLm::new(&tied, vb, &ExpertsBackend::Dense).unwrap();
        let ids = row_tensor(&[3, 1, 4, 1, 5, 9, 2, 6]);
        let d = max_abs_diff(
            &model.forward_all(&ids, 0).unwrap(),
            &copy.forward_all(&ids, 0).unwrap(),
        );
        assert_eq!(d, 0.0, "{name}");
        // A checkpoint that stores its own, different `lm_head.weight` beside
        // `tie_word_embeddings: true` uses it, as transformers 5 does (it unties them).
        let mut ts = fixture_tensors(name);
        let own_head = (ts["model.embed_tokens.weight"].clone() * 0.5).unwrap();
        ts.insert("lm_head.weight".into(), own_head);
        let vb = VarBuilder::from_tensors(ts.clone(), DType::F32, &Device::Cpu);
        let mut stored = MoeForCausalLm::new(&untied, vb, &ExpertsBackend::Dense).unwrap();
        let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
        let mut tied_but_stored = MoeForCausalLm::new(&tied, vb, &ExpertsBackend::Dense).unwrap();
        assert!(!tied_but_stored.spec().tie_word_embeddings, "{name}");
        // A plan from a folder counts such a head: every fixture stores one but GraniteMoE's,
        // which is tied.
        let mut spec = tied.spec().unwrap();
        let stores_head = models::stores_tensor(fixture_dir(name), "lm_head.weight").unwrap();
        assert_eq!(stores_head, name != "granitemoe-tiny");
        models::untie_if_stored_head(&mut spec, fixture_dir(name)).unwrap();
        assert_eq!(spec.tie_word_embeddings, !stores_head, "{name}");
        let d = max_abs_diff(
            &tied_but_stored.forward_all(&ids, 0).unwrap(),
            &stored.forward_all(&ids, 0).unwrap(),
        );
        assert_eq!(d, 0.0, "{name}");
    }
}

#[test]
fn prompt_longer_than_context_is_refused() {
    for name in FIXTURES {
        let json = edit_config(name, |v| v["max_position_embeddings"] = 16.into());
        let cfg = AnyConfig::from_json_str(&json).unwrap();
        let mut model = load(name, &cfg, &ExpertsBackend::Dense);
        let long: Vec<u32> = (0..17).collect();
        // Token ids that are not integers are refused, not truncated.
        let floats = Tensor::new(&[[1.7f32, 2.9]], &Device::Cpu).unwrap();
        let e = model_error(model.forward(&floats, 0));
        assert!(
            matches!(&e, QmoeError::InvalidArgument { argument, reason }
                if argument == "input_ids" && reason.contains("F32")),
            "{e}"
        );
        let e = model_error(model.forward(&row_tensor(&long), 0));
        assert!(
            matches!(
                e,
                QmoeError::ContextExceeded {
                    cached: 0,
                    new: 17,
                    context: 16
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("max_position_embeddings = 16"),
            "{e}"
        );
        // Filling the context exactly works; one more cached step does not.
        model.forward(&row_tensor(&long[..16]), 0).unwrap();
        let e = model_error(model.forward(&row_tensor(&[5]), 16));
        assert!(
            matches!(
                e,
                QmoeError::ContextExceeded {
                    cached: 16,
                    new: 1,
                    context: 16
                }
            ),
            "{e}"
        );
        // A wrong offset, a token outside the vocabulary and a 1-D input are errors too.
        model.clear_kv_cache();
        let e = model_error(model.forward(&row_tensor(&[5]), 3));
        assert!(
            matches!(&e, QmoeError::InvalidArgument { argument, reason }
                if argument == "seqlen_offset" && reason.contains("KV cache holds 0")),
            "{e}"
        );
        let e = model_error(model.forward(&row_tensor(&[512]), 0));
        assert!(
            matches!(
                e,
                QmoeError::TokenOutOfVocab {
                    token: 512,
                    vocab_size: 512
                }
            ),
            "{e}"
        );
        let one_d = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        let e = model_error(model.forward(&one_d, 0));
        assert!(
            matches!(&e, QmoeError::InvalidArgument { argument, reason }
                if argument == "input_ids" && reason.contains("[batch, seq_len]")),
            "{e}"
        );
    }
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("qmoe-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn truncated_or_missing_checkpoint_is_an_error() {
    let dir = temp_dir("truncated");
    let e = models::checkpoint_files(&dir).unwrap_err();
    assert!(
        matches!(&e, QmoeError::InvalidCheckpoint { dir: d, reason }
            if d == &dir && reason.contains("model.safetensors")),
        "{e}"
    );
    let bytes = std::fs::read(fixture_dir("olmoe-tiny").join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let r = unsafe { models::mmap_checkpoint(&dir, DType::F32, &Device::Cpu) };
    assert!(matches!(&r, Err(QmoeError::Candle(_))));
    let msg = err_string(r);
    assert!(
        msg.contains("model.safetensors") && msg.contains("not fully covered"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint split into shards with `model.safetensors.index.json` loads and computes the
/// same logits as the single file.
#[test]
fn sharded_checkpoint_matches_single_file() {
    let name = "qwen2moe-tiny";
    let dir = temp_dir("sharded");
    let ts = fixture_tensors(name);
    let (mut a, mut b) = (HashMap::new(), HashMap::new());
    let mut weight_map = serde_json::Map::new();
    for (k, t) in ts {
        let shard = if k.contains("layers.1") {
            "model-00002-of-00002.safetensors"
        } else {
            "model-00001-of-00002.safetensors"
        };
        weight_map.insert(k.clone(), shard.into());
        if shard.starts_with("model-00001") {
            a.insert(k, t)
        } else {
            b.insert(k, t)
        };
    }
    candle::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    let index = json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_eq!(models::checkpoint_files(&dir).unwrap().len(), 2);

    let cfg = AnyConfig::from_file(fixture_dir(name).join("config.json")).unwrap();
    let vb = unsafe { models::mmap_checkpoint(&dir, DType::F32, &Device::Cpu) }.unwrap();
    let mut sharded = MoeForCausalLm::new(&cfg, vb, &ExpertsBackend::Dense).unwrap();
    let mut single = load_any(name, &ExpertsBackend::Dense);
    let ids = row_tensor(&[3, 1, 4, 1, 5, 9, 2, 6]);
    let d = max_abs_diff(
        &sharded.forward_all(&ids, 0).unwrap(),
        &single.forward_all(&ids, 0).unwrap(),
    );
    assert_eq!(d, 0.0);

    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let e = models::checkpoint_files(&dir).unwrap_err();
    assert!(
        matches!(&e, QmoeError::InvalidCheckpoint { reason, .. }
            if reason.contains("model-00002-of-00002.safetensors")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Batched prefill and chunked prefill with the KV cache agree with one-sequence full forwards.
#[test]
fn batch_and_chunked_prefill_match() {
    for name in FIXTURES {
        batch_and_chunked_prefill(name);
    }
}

/// All in F32 from the same weights: batching and chunking change only the blocking of the
/// GEMMs and of the attention sums (a few ulps of logits of size ~1, as in `DENSE_TOL`), so
/// `DENSE_TOL` bounds them too. `forward` and `forward_all` run the same ops on the same rows
/// (only the head's GEMM sees one row instead of all): 1e-5, a few ulps of logits of size ~1.
fn batch_and_chunked_prefill(name: &str) {
    let mut model = load_any(name, &ExpertsBackend::Dense);
    let (x, y) = ([7u32, 8, 9, 10, 11, 12], [100u32, 3, 250, 17, 4, 42]);
    let full_x = model.forward_all(&row_tensor(&x), 0).unwrap();
    model.clear_kv_cache();
    let full_y = model.forward_all(&row_tensor(&y), 0).unwrap();
    model.clear_kv_cache();
    let batch = Tensor::new(&[x, y], &Device::Cpu).unwrap();
    let both = model.forward_all(&batch, 0).unwrap();
    assert!(max_abs_diff(&both.get(0).unwrap(), &full_x.squeeze(0).unwrap()) < DENSE_TOL);
    assert!(max_abs_diff(&both.get(1).unwrap(), &full_y.squeeze(0).unwrap()) < DENSE_TOL);
    // Chunked prefill: 4 tokens, then 2 more at offset 4.
    model.clear_kv_cache();
    model.forward_all(&row_tensor(&x[..4]), 0).unwrap();
    let rest = model.forward_all(&row_tensor(&x[4..]), 4).unwrap();
    assert!(max_abs_diff(&rest, &full_x.narrow(1, 4, 2).unwrap()) < DENSE_TOL);
    // `forward` returns the last position only.
    model.clear_kv_cache();
    let last = model.forward(&row_tensor(&x), 0).unwrap();
    assert_eq!(last.dims(), &[1, 512]);
    assert!(max_abs_diff(&last, &full_x.narrow(1, 5, 1).unwrap().squeeze(1).unwrap()) < 1e-5);
}

/// The BF16 compute path (what `generate` uses on real models) runs end to end with both
/// backends and stays close to the float32 golden.
///
/// Measured on prompt1 (BF16 weights, F32 activations on the CPU): dense top-1 0.98–1.0, mean KL
/// 1.1e-5–3.0e-5, max |Δlogit| 0.023–0.033 (BF16 rounding of what transformers computes in F32 from
/// the same BF16 values, at a near-tie or two). INT4 in BF16 measures as INT4 in F32 (top-1
/// 0.68–0.79, KL 8e-3–3.0e-2, max 0.64–1.75), so it shares the INT4 bounds of
/// `int4_experts_track_transformers`. The dense bounds follow the arithmetic: BF16 keeps 8
/// significant bits (up to 2⁻⁸ ≈ 3.9e-3 relative per rounding of an activation between ops),
/// which over the two layers moves logits of RMS ~1 by ~5e-3 typically and by a few 1e-2 at the
/// worst position; the KL of a typical change Δ is ~Δ²/2 ≈ 1e-5, as measured. So KL ≤ 1e-4
/// (3.3–9× the measured), max |Δlogit| ≤ 0.1 (3–4.3×) and top-1 ≥ 0.9 (a near tie may flip a
/// row or two). The max is taken over the positions where every MoE layer routes as the F32
/// model does: a router tie closer than BF16's noise may go either way (see
/// [`max_abs_diff_where_routed_alike`]), and one flipped expert moves that position's logits by
/// ~0.16.
#[test]
fn bf16_compute_tracks_transformers() {
    for name in FIXTURES {
        let golden = golden_prompts(name);
        let cfg = AnyConfig::from_file(fixture_dir(name).join("config.json")).unwrap();
        for (backend, min_top1, max_kl, max_abs) in [
            (ExpertsBackend::Dense, 0.9, 1e-4, 0.1),
            (
                ExpertsBackend::int4(GroupSize::new(128).unwrap()),
                INT4_MIN_TOP1,
                INT4_MAX_MEAN_KL,
                INT4_MAX_ABS,
            ),
        ] {
            let mut model = load_in(name, &cfg, DType::BF16, &backend);
            assert_eq!(model.dtype(), DType::BF16);
            let f = fidelity(&mut model, &golden, 1);
            eprintln!("{name} prompt1 bf16 {backend:?}: {}", describe(&f));
            assert!(
                f.top1_agreement >= min_top1,
                "{name} {backend:?}: top-1 {}",
                f.top1_agreement
            );
            assert!(
                f.mean_kl <= max_kl,
                "{name} {backend:?}: mean KL {}",
                f.mean_kl
            );
            let max_abs_diff = if backend == ExpertsBackend::Dense {
                // The INT4 bound covers flipped experts already.
                let mut exact = load(name, &cfg, &backend);
                let prompt = &golden.prompts[1];
                let (max, flips) = max_abs_diff_where_routed_alike(&mut model, &mut exact, prompt);
                eprintln!("{name}: routing flipped at rows {flips:?}; max |Δ| elsewhere {max:.2e}");
                max
            } else {
                f.max_abs_diff
            };
            assert!(
                max_abs_diff <= max_abs,
                "{name} {backend:?}: max |Δlogit| {max_abs_diff}"
            );
        }
    }
}

/// The widest router gap BF16 arithmetic may close. A BF16 model's router logits lie up to
/// 1.3e-2–1.8e-2 from the same model's in F32 (the fixtures' prompt1, every row and expert:
/// activations are rounded to BF16 between ops, 2⁻⁹ relative, and a rounding that tips moves a
/// value by a whole BF16 step), so the gap between two experts may shrink by up to twice that,
/// 3.6e-2.
const BF16_ROUTER_NOISE: f32 = 0.04;

/// At most this many rows of a prompt may route differently in BF16 than in F32 (one measured).
const MAX_ROUTING_FLIPS: usize = 2;

/// A row whose routing flipped may move its logits by one expert's contribution (0.157
/// measured); bounded too, at about 3× that.
const MAX_ABS_FLIPPED: f64 = 0.5;

/// `model`'s largest |Δlogit| against the golden over the rows `compare_prompt` compares where
/// every MoE layer routes its token to the same top-k set as `exact` (the same model in F32),
/// and those rows' indices. A router tie closer than BF16's noise may go either way, and one
/// flipped expert moves that row's logits by far more than BF16 rounding does elsewhere.
///
/// # Panics
/// When a flip is not at a near tie (`exact`'s k-th and (k+1)-th router logits within
/// [`BF16_ROUTER_NOISE`] of each other), when more than [`MAX_ROUTING_FLIPS`] rows flip, or when
/// a flipped row's |Δlogit| exceeds [`MAX_ABS_FLIPPED`].
fn max_abs_diff_where_routed_alike(
    model: &mut MoeForCausalLm,
    exact: &mut MoeForCausalLm,
    prompt: &candle_qmoe::parity::GoldenPrompt,
) -> (f64, Vec<usize>) {
    let (ids, reference) = compared_rows(prompt).unwrap();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let forward = |m: &mut MoeForCausalLm| {
        m.clear_kv_cache();
        let (logits, routers) = m.forward_all_with_router_logits(&ids, 0).unwrap();
        m.clear_kv_cache();
        let routers = routers
            .into_iter()
            .map(|r| r.squeeze(0).unwrap().to_dtype(DType::F32).unwrap())
            .collect::<Vec<_>>();
        (logits.squeeze(0).unwrap(), routers)
    };
    let ((ours, routers), (_, exact_routers)) = (forward(model), forward(exact));
    let top_k: Vec<usize> = model.spec().moe_blocks().map(|(_, m)| m.top_k).collect();
    assert_eq!(routers.len(), top_k.len());
    assert_eq!(exact_routers.len(), top_k.len());
    let moved = routers
        .iter()
        .zip(&exact_routers)
        .map(|(o, e)| {
            let d = (o - e).unwrap().abs().unwrap().flatten_all().unwrap();
            d.max(0).unwrap().to_scalar::<f32>().unwrap()
        })
        .fold(0f32, f32::max);
    eprintln!("router logits moved by up to {moved:.2e} from the F32 model's");
    let mut flips = Vec::new();
    for ((o, e), &k) in routers.iter().zip(&exact_routers).zip(&top_k) {
        let logits = e.to_vec2::<f32>().unwrap();
        let sets = topk_sets(o, k)
            .unwrap()
            .into_iter()
            .zip(topk_sets(e, k).unwrap());
        for (row, (a, b)) in sets.enumerate() {
            if a != b {
                let mut l = logits[row].clone();
                l.sort_by(|x, y| y.total_cmp(x));
                let gap = l[k - 1] - l[k];
                assert!(
                    gap < BF16_ROUTER_NOISE,
                    "row {row}: routing flipped where the F32 model's gap is {gap}"
                );
                flips.push(row);
            }
        }
    }
    flips.sort_unstable();
    flips.dedup();
    assert!(
        flips.len() <= MAX_ROUTING_FLIPS,
        "routing flipped at rows {flips:?}"
    );
    let row = |t: &Tensor, r| t.narrow(0, r, 1).unwrap();
    let mut max = 0f64;
    for r in 0..reference.dim(0).unwrap() {
        let d = logit_agreement(&row(&ours, r), &row(&reference, r))
            .unwrap()
            .max_abs_diff;
        if flips.contains(&r) {
            assert!(
                d <= MAX_ABS_FLIPPED,
                "row {r} (routing flipped): max |Δlogit| {d}"
            );
        } else {
            max = max.max(d);
        }
    }
    (max, flips)
}

/// `--dense-weights int8`: the non-expert projections requantized to INT8 (groups of 32, 8-bit
/// activations) against the same model in BF16, on every fixture prompt: the KL it adds is
/// reported here and bounded, and the bytes per token shrink.
///
/// Measured (KL(bf16 ‖ int8), nats, prompt0 and prompt1; BF16 KV cache): olmoe-tiny 1.5e-3 and
/// 5.5e-4, qwen2moe-tiny 2.3e-4 and 7.4e-4, max |Δlogit| ≤ 0.41; qwen3moe-tiny 2.3e-3 and
/// 3.0e-3, max |Δlogit| 0.49 and 0.88, where the INT8 noise swaps near-tied experts at the edge
/// of the top-4 (its router agreement with the golden drops to 0.86–0.93); mixtral-tiny 7.0e-3
/// and 2.7e-3, max |Δlogit| 1.16 and 1.36, where its top-2 routing flips on near-ties (with an
/// F32 KV cache the same prompts give 1.5e-4 and 3.2e-4: which tokens sit on a near-tie is
/// chaotic in these random models). All under what INT4 experts add (8e-3 to 3e-2). The random
/// fixtures' near-tied logits flip the argmax at a few positions (top-1 0.86–1.0; one flip in a
/// 7-token prompt is 0.857). Bounds: KL ≤ 1e-2, top-1 ≥ 0.8, max |Δlogit| ≤ 1.5.
#[test]
fn int8_dense_weights_track_bf16() {
    for name in FIXTURES {
        let golden = golden_prompts(name);
        let cfg = AnyConfig::from_file(fixture_dir(name).join("config.json")).unwrap();
        let load = || load_in(name, &cfg, DType::BF16, &ExpertsBackend::Dense);
        let mut bf16 = load();
        let mut int8 = load();
        int8.quantize_dense_int8().unwrap();
        assert_eq!(
            (bf16.dense_weights(), int8.dense_weights()),
            ("bf16", "int8")
        );
        assert!(int8.weight_bytes_per_token() < bf16.weight_bytes_per_token());
        for p in 0..golden.prompts.len() {
            let ids = row_tensor(&golden.prompts[p].input_ids);
            bf16.clear_kv_cache();
            int8.clear_kv_cache();
            let a = bf16.forward_all(&ids, 0).unwrap().squeeze(0).unwrap();
            let b = int8.forward_all(&ids, 0).unwrap().squeeze(0).unwrap();
            let agreement = logit_agreement(&b, &a).unwrap();
            let f = fidelity(&mut int8, &golden, p);
            eprintln!(
                "{name} prompt{p}: int8 vs bf16 {agreement:?} | int8 vs transformers {}",
                describe(&f)
            );
            assert!(agreement.mean_kl <= 1e-2, "{name} prompt{p}: {agreement:?}");
            assert!(agreement.top1 >= 0.8, "{name} prompt{p}: {agreement:?}");
            assert!(
                agreement.max_abs_diff <= 1.5,
                "{name} prompt{p}: {agreement:?}"
            );
        }
    }
}
