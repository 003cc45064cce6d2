//! `SparseMoe` routing and combine against an f64 re-computation of transformers' math.

use std::collections::HashMap;
use std::sync::Arc;

use candle::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use candle_qmoe::moe::SharedExpert;
use candle_qmoe::{DenseExperts, DenseLinear, QmoeError, SparseMoe};
use candle_qmoe_suite::testing::{random_experts, reference_f64, Rng};

const H: usize = 48;
const I: usize = 24;
const E: usize = 6;

fn tensor(rng: &mut Rng, shape: (usize, usize), std: f32) -> Tensor {
    Tensor::from_vec(rng.normals(shape.0 * shape.1, std), shape, &Device::Cpu).unwrap()
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Router weights, experts and (optionally) a shared expert, plus the block built from them.
fn block(
    k: usize,
    norm: bool,
    shared: bool,
    seed: u64,
) -> (SparseMoe, Tensor, HashMap<String, Tensor>) {
    let mut rng = Rng::new(seed);
    let experts = random_experts(&mut rng, E, H, I);
    let router = tensor(&mut rng, (E, H), 0.3);
    let mut vars = HashMap::new();
    vars.insert("gate.weight".to_string(), router.clone());
    if shared {
        vars.insert(
            "shared_expert.gate_proj.weight".into(),
            tensor(&mut rng, (2 * I, H), 0.05),
        );
        vars.insert(
            "shared_expert.up_proj.weight".into(),
            tensor(&mut rng, (2 * I, H), 0.05),
        );
        vars.insert(
            "shared_expert.down_proj.weight".into(),
            tensor(&mut rng, (H, 2 * I), 0.05),
        );
        vars.insert(
            "shared_expert_gate.weight".into(),
            tensor(&mut rng, (1, H), 0.3),
        );
    }
    let vb = VarBuilder::from_tensors(vars.clone(), DType::F32, &Device::Cpu);
    let shared_expert = shared.then(|| SharedExpert::new(H, 2 * I, vb.clone()).unwrap());
    let moe = SparseMoe::new(
        SparseMoe::load_router(H, E, "gate", vb).unwrap(),
        Arc::new(DenseExperts::new(experts.clone()).unwrap()),
        k,
        norm,
        shared_expert,
    )
    .unwrap();
    let xs = tensor(&mut rng, (5, H), 1.0);
    for (e, x) in experts.iter().enumerate() {
        vars.insert(format!("experts.{e}.gate"), x.gate.clone());
        vars.insert(format!("experts.{e}.up"), x.up.clone());
        vars.insert(format!("experts.{e}.down"), x.down.clone());
    }
    (moe, xs, vars)
}

/// softmax → top-k → optional renormalisation → Σ w·expert (+ sigmoid(g)·shared), in f64.
fn reference(
    xs: &Tensor,
    vars: &HashMap<String, Tensor>,
    k: usize,
    norm: bool,
) -> (Vec<f64>, Vec<Vec<usize>>) {
    let (t, _) = xs.dims2().unwrap();
    let x = to_f64(xs);
    let router = to_f64(&vars["gate.weight"]);
    let experts: Vec<_> = (0..E)
        .map(|e| candle_qmoe::pack::DenseExpert {
            gate: vars[&format!("experts.{e}.gate")].clone(),
            up: vars[&format!("experts.{e}.up")].clone(),
            down: vars[&format!("experts.{e}.down")].clone(),
        })
        .collect();
    let (mut ids, mut ws, mut chosen) = (vec![], vec![], vec![]);
    for ti in 0..t {
        let logits: Vec<f64> = (0..E)
            .map(|e| (0..H).map(|h| router[e * H + h] * x[ti * H + h]).sum())
            .collect();
        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = logits.iter().map(|l| (l - m).exp()).sum();
        let mut p: Vec<(usize, f64)> = logits
            .iter()
            .map(|l| (l - m).exp() / z)
            .enumerate()
            .collect();
        p.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top = &p[..k];
        let s: f64 = if norm {
            top.iter().map(|e| e.1).sum()
        } else {
            1.0
        };
        chosen.push(top.iter().map(|e| e.0).collect());
        ids.extend(top.iter().map(|e| e.0 as u32));
        ws.extend(top.iter().map(|e| (e.1 / s) as f32));
    }
    let xs32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let mut out = reference_f64(&experts, &xs32, &ids, &ws, k);
    if vars.contains_key("shared_expert_gate.weight") {
        let g = to_f64(&vars["shared_expert.gate_proj.weight"]);
        let u = to_f64(&vars["shared_expert.up_proj.weight"]);
        let d = to_f64(&vars["shared_expert.down_proj.weight"]);
        let sg = to_f64(&vars["shared_expert_gate.weight"]);
        for ti in 0..t {
            let xr = &x[ti * H..(ti + 1) * H];
            let dot = |w: &[f64], r: usize, n: usize, v: &[f64]| -> f64 {
                (0..n).map(|c| w[r * n + c] * v[c]).sum()
            };
            let hmid: Vec<f64> = (0..2 * I)
                .map(|r| {
                    let gv = dot(&g, r, H, xr);
                    gv / (1.0 + (-gv).exp()) * dot(&u, r, H, xr)
                })
                .collect();
            let gate = 1.0 / (1.0 + (-dot(&sg, 0, H, xr)).exp());
            for n in 0..H {
                out[ti * H + n] += gate * dot(&d, n, 2 * I, &hmid);
            }
        }
    }
    (out, chosen)
}

#[test]
fn sparse_moe_matches_f64_reference() {
    for (k, norm, shared) in [
        (2, false, false),
        (3, true, false),
        (4, false, true),
        (6, true, true),
    ] {
        let (moe, xs, vars) = block(k, norm, shared, k as u64 + 10 * norm as u64);
        let (out, routing) = moe.forward_with_routing(&xs).unwrap();
        let (want, chosen) = reference(&xs, &vars, k, norm);
        let ids = routing.expert_ids.to_vec2::<u32>().unwrap();
        for (got, want) in ids.iter().zip(&chosen) {
            assert_eq!(
                got.iter().map(|&e| e as usize).collect::<Vec<_>>(),
                *want,
                "top-{k} order"
            );
        }
        let got = to_f64(&out);
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt()
            / want.iter().map(|b| b * b).sum::<f64>().sqrt();
        // F32 arithmetic over K ≤ 2·48 terms: ~1e-7 per op; 1e-5 leaves ample margin.
        assert!(
            err < 1e-5,
            "k {k} norm {norm} shared {shared}: rel err {err}"
        );
        // Module::forward keeps the leading dims of a [B, S, H] input.
        let y = moe.forward(&xs.unsqueeze(0).unwrap()).unwrap();
        assert_eq!(y.dims(), &[1, 5, H]);
    }
}

#[test]
fn bad_block_configs_are_clear_errors() {
    let mut rng = Rng::new(1);
    let experts = Arc::new(DenseExperts::new(random_experts(&mut rng, E, H, I)).unwrap());
    let router = || candle_nn::Linear::new(tensor(&mut Rng::new(2), (E, H), 0.1), None);
    let top_k_refused = |e: &candle::Error, what: &str| {
        matches!(QmoeError::find(e), Some(QmoeError::InvalidArgument { argument, reason })
            if argument == "top_k" && reason.contains(what))
    };
    let e = SparseMoe::new(router(), experts.clone(), E + 1, false, None).unwrap_err();
    assert!(top_k_refused(&e, "top-k = 7 with 6 experts"), "{e}");
    let e = SparseMoe::new(router(), experts.clone(), 0, false, None).unwrap_err();
    assert!(top_k_refused(&e, "top-k = 0"), "{e}");
    let bad_router = candle_nn::Linear::new(tensor(&mut rng, (E, H + 1), 0.1), None);
    let e = SparseMoe::new(bad_router, experts, 2, false, None).unwrap_err();
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::ShapeMismatch { tensor, got, expected })
            if tensor.contains("router") && got == &[E, H + 1] && expected == &[E, H]),
        "{e}"
    );
    let e = DenseExperts::new(vec![]).unwrap_err();
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::InvalidArgument { reason, .. })
            if reason == "zero experts"),
        "{e}"
    );
}

/// `QmoeError::InvalidArgument` naming `argument`, its reason containing `what`.
fn invalid(e: &candle::Error, argument: &str, what: &str) -> bool {
    matches!(QmoeError::find(e), Some(QmoeError::InvalidArgument { argument: a, reason })
        if a == argument && reason.contains(what))
}

/// What a hurried caller gets wrong is refused by name, never computed: integer activations or
/// weights, float expert ids, inputs of the wrong rank, experts of mixed dtypes, a router that is
/// not 2-D, a shared expert of another hidden size, a router of another dtype than the input;
/// a non-contiguous input is computed like its contiguous copy.
#[test]
fn misused_blocks_and_calls_are_refused_by_name() {
    let dev = Device::Cpu;
    let (moe, xs, _) = block(2, true, false, 7);
    let mut rng = Rng::new(3);
    let experts = random_experts(&mut rng, E, H, I);
    let dense = DenseExperts::new(experts.clone()).unwrap();
    let ids = Tensor::new(&[[0u32, 1]; 5], &dev).unwrap();
    let w = Tensor::new(&[[0.5f32, 0.5]; 5], &dev).unwrap();
    use candle_qmoe::RoutedExperts;
    let call = |xs: &Tensor, ids: &Tensor, w: &Tensor| dense.forward(xs, ids, w).unwrap_err();
    let e = call(&xs, &ids.to_dtype(DType::F32).unwrap(), &w);
    assert!(invalid(&e, "expert_ids", "integer"), "{e}");
    let e = call(&xs.to_dtype(DType::U32).unwrap(), &ids, &w);
    assert!(invalid(&e, "xs", "floating point"), "{e}");
    let e = call(&xs, &ids, &w.to_dtype(DType::U8).unwrap());
    assert!(invalid(&e, "weights", "floating point"), "{e}");
    let e = call(&xs.unsqueeze(0).unwrap(), &ids, &w);
    assert!(invalid(&e, "xs", "got shape [1, 5, 48]"), "{e}");
    // A view that is not contiguous gives the contiguous copy's result.
    let wide = Tensor::cat(&[&xs, &xs], 1)
        .unwrap()
        .narrow(1, 0, H)
        .unwrap();
    assert!(!wide.is_contiguous());
    let a = dense.forward(&wide, &ids, &w).unwrap();
    let b = dense.forward(&xs, &ids, &w).unwrap();
    assert_eq!(to_f64(&a), to_f64(&b));
    assert_eq!(
        to_f64(&moe.forward(&wide).unwrap()),
        to_f64(&moe.forward(&xs).unwrap())
    );

    let mut mixed = experts.clone();
    mixed[3].up = mixed[3].up.to_dtype(DType::BF16).unwrap();
    let e = DenseExperts::new(mixed).unwrap_err();
    assert!(invalid(&e, "expert 3 up projection", "one dtype"), "{e}");
    let mut integer = experts.clone();
    integer[0].gate = integer[0].gate.to_dtype(DType::U32).unwrap();
    let e = DenseExperts::new(integer).unwrap_err();
    assert!(invalid(&e, "expert 0 gate projection", "U32"), "{e}");

    let router_3d =
        candle_nn::Linear::new(tensor(&mut rng, (E, H), 0.1).unsqueeze(0).unwrap(), None);
    let e = SparseMoe::new(router_3d, Arc::new(dense.clone()), 2, false, None).unwrap_err();
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::ShapeMismatch { got, .. }) if got == &[1, E, H]),
        "{e}"
    );
    let mut vars = HashMap::new();
    vars.insert(
        "shared_expert.gate_proj.weight".to_string(),
        tensor(&mut rng, (I, H / 2), 0.05),
    );
    vars.insert(
        "shared_expert.up_proj.weight".into(),
        tensor(&mut rng, (I, H / 2), 0.05),
    );
    vars.insert(
        "shared_expert.down_proj.weight".into(),
        tensor(&mut rng, (H / 2, I), 0.05),
    );
    vars.insert(
        "shared_expert_gate.weight".into(),
        tensor(&mut rng, (1, H / 2), 0.3),
    );
    let vb = VarBuilder::from_tensors(vars, DType::F32, &dev);
    let narrow_shared = SharedExpert::new(H / 2, I, vb).unwrap();
    let router = candle_nn::Linear::new(tensor(&mut rng, (E, H), 0.1), None);
    let e = SparseMoe::new(router, Arc::new(dense), 2, false, Some(narrow_shared)).unwrap_err();
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::ShapeMismatch { tensor, got, .. })
            if tensor.contains("shared") && got == &[1, H / 2]),
        "{e}"
    );
    // An F32 router given F16 activations: the router's linear layer names both dtypes.
    let e = moe.forward(&xs.to_dtype(DType::F16).unwrap()).unwrap_err();
    assert!(invalid(&e, "input of a linear layer", "F16"), "{e}");
    let e = moe.forward(&tensor(&mut rng, (5, H + 2), 1.0)).unwrap_err();
    assert!(
        invalid(&e, "input of a linear layer", "last dimension must be 48"),
        "{e}"
    );
    // A BF16 weight on the CPU (our kernel) takes F32 or BF16 inputs; F16 is refused by name.
    let bf16 = DenseLinear::new(
        tensor(&mut rng, (E, H), 0.1).to_dtype(DType::BF16).unwrap(),
        None,
    )
    .unwrap();
    let e = bf16.forward(&xs.to_dtype(DType::F16).unwrap()).unwrap_err();
    assert!(invalid(&e, "input of a linear layer", "F16"), "{e}");
    assert!(bf16.forward(&xs).is_ok() && bf16.forward(&xs.to_dtype(DType::BF16).unwrap()).is_ok());
    // Candle's Q4K needs rows of 256 weights: the refusal names the expert's projection.
    let e = candle_qmoe::GgmlExperts::quantize(&experts, candle::quantized::GgmlDType::Q4K)
        .err()
        .unwrap();
    assert!(invalid(&e, "expert 0 gate projection", "Q4K"), "{e}");
}
