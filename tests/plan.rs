//! Memory plan and fit: every component of the tiny fixture configs against byte counts worked
//! out by hand, the fit's choice and refusals, budget parsing, and the real models' configs.

use candle::DType;
use candle_qmoe::models::{AnyConfig, ModelConfig, ModelSpec};
use candle_qmoe::pack::{ExpertLayout, GroupSize};
use candle_qmoe::plan::{
    format_bytes, parse_bytes, ByteRange, Component, ExpertStorage, FitOptions, Plan, PlanOptions,
    Target,
};
use candle_qmoe::residency::Resident;
use candle_qmoe::synthetic::SyntheticKind;
use candle_qmoe::QmoeError;
use candle_qmoe_suite::testing::{fixture_dir, FIXTURES};

const MIB: u64 = 1 << 20;

fn spec(fixture: &str) -> ModelSpec {
    AnyConfig::from_file(fixture_dir(fixture).join("config.json"))
        .unwrap()
        .spec()
        .unwrap()
}

fn bytes(plan: &Plan, component: Component) -> ByteRange {
    plan.component(component)
        .unwrap_or_else(|| panic!("no component {component}"))
}

fn host(plan: &Plan, component: Component) -> ByteRange {
    plan.host()
        .iter()
        .find(|c| c.component == component)
        .unwrap()
        .bytes
}

/// The component, the bytes it needs and the bytes left for it of a refusal.
fn does_not_fit(err: &QmoeError) -> Option<(Component, u64, u64)> {
    match *err {
        QmoeError::DoesNotFit {
            component,
            needed,
            available,
            ..
        } => Some((component, needed, available)),
        _ => None,
    }
}

fn r(min: u64, max: u64) -> ByteRange {
    ByteRange::new(min, max)
}

fn x(b: u64) -> ByteRange {
    ByteRange::exact(b)
}

/// OLMoE tiny: vocab 512, H 256, 4 heads × 64 (q/k norm, no bias), 2 layers of 8 experts top-4
/// with I 128, max positions 512.
fn olmoe_cuda_options() -> PlanOptions {
    PlanOptions {
        ctx: Some(256),
        prefill_chunk: 64,
        residency: Resident::Uniform(6),
        ..PlanOptions::new(Target::Cuda)
    }
}

/// INT4 slab of OLMoE tiny, g128: gate/up [256, 256] → 256·256/2 = 32768 B, down [256, 128] →
/// 256·128/2 = 16384 B, FP16 scales (256·2 + 256·1)·2 = 1536 B.
const OLMOE_SLAB: u64 = 32768 + 16384 + 1536;

#[test]
fn olmoe_tiny_components_by_hand() {
    let plan = Plan::new(&spec("olmoe-tiny"), &olmoe_cuda_options()).unwrap();
    let layout = ExpertLayout {
        hidden: 256,
        intermediate: 128,
        group_size: GroupSize::default(),
    };
    assert_eq!(layout.slab_bytes() as u64, OLMOE_SLAB);
    let names: Vec<_> = plan.components().iter().map(|c| c.component).collect();
    assert_eq!(
        names,
        [
            Component::NonExpertWeights,
            Component::ExpertCache,
            Component::KvCache,
            Component::Staging,
            Component::Workspace,
            Component::RuntimeOverhead
        ]
    );
    // embed + lm_head 2·512·256 = 262144; final norm 256; per layer q,k,v 256·768 = 196608,
    // o 65536, q/k norm 512, two norms 512, router 8·256 = 2048 → 265216, ×2 = 530432; RoPE
    // cos+sin 512·64 = 32768. 825600 elements × 2 bytes (BF16).
    assert_eq!(bytes(&plan, Component::NonExpertWeights), x(825_600 * 2));
    // 2 layers × 6 slots.
    assert_eq!(bytes(&plan, Component::ExpertCache), x(2 * 6 * OLMOE_SLAB));
    // 2 layers × K,V × 4 heads × 64 × ctx 256 × batch 1 × 2 bytes.
    assert_eq!(
        bytes(&plan, Component::KvCache),
        x(2 * 2 * 4 * 64 * 256 * 2)
    );
    assert_eq!(bytes(&plan, Component::Staging), x(2 * OLMOE_SLAB));
    // 64 tokens: residual 2..4 × 64·256·2 = 65536..131072. Attention: q,k,v 64·12·64·2 = 98304
    // (×2 at most), the previous KV of a layer 2·4·64·256·2 = 262144, mask 64·256·4 = 65536,
    // scores 4·64·256 = 65536 elements × 6..16 bytes → 819200..1572864. It dominates the MoE
    // block (router 5120 + experts 98304..458752) and the logits (3072..196608).
    assert_eq!(
        bytes(&plan, Component::Workspace),
        r(65_536 + 819_200, 131_072 + 1_572_864)
    );
    assert_eq!(
        bytes(&plan, Component::RuntimeOverhead),
        r(300 * MIB, 768 * MIB)
    );
    let total = plan.total();
    let sum: u64 = 1_651_200 + 608_256 + 524_288 + 101_376;
    assert_eq!(
        total,
        r(sum + 884_736 + 300 * MIB, sum + 1_703_936 + 768 * MIB)
    );
    // Host: all 16 experts' slabs, plus the pinned staging ring and the CUDA host baseline.
    assert_eq!(host(&plan, Component::PackSource), x(16 * OLMOE_SLAB));
    assert_eq!(
        host(&plan, Component::ProcessRss),
        r(
            16 * OLMOE_SLAB + 2 * OLMOE_SLAB + 150 * MIB,
            16 * OLMOE_SLAB + 2 * OLMOE_SLAB + 1024 * MIB
        )
    );
    assert_eq!(plan.resident_per_layer(), [6, 6]);
    assert_eq!(plan.ctx(), 256);
}

#[test]
fn component_names_are_those_of_the_evidence_files() {
    let plan = Plan::new(&spec("qwen2moe-tiny"), &PlanOptions::new(Target::Cpu)).unwrap();
    let json = serde_json::to_value(plan.components()).unwrap();
    let names: Vec<_> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "non_expert_weights",
            "pack_source",
            "expert_cache",
            "kv_cache",
            "staging",
            "workspace",
            "runtime_overhead"
        ]
    );
    assert_eq!(
        json[3]["max_bytes"].as_u64(),
        Some(bytes(&plan, Component::KvCache).max)
    );
    let host = serde_json::to_value(plan.host()).unwrap();
    assert_eq!(host[1]["name"], "process_rss");
    // Display gives the same name and honours the table's alignment.
    assert_eq!(format!("{:<10}|", Component::KvCache), "kv_cache  |");
}

/// Qwen2-MoE tiny: vocab 512, H 256, 4 heads × 64 with q/k/v bias, 2 layers of 8 experts top-4
/// with I 192 and a shared expert of 384, max positions 512.
#[test]
fn qwen2moe_tiny_components_by_hand_on_cpu() {
    let opts = PlanOptions {
        batch: 2,
        prefill_chunk: 128,
        ..PlanOptions::new(Target::Cpu)
    };
    let plan = Plan::new(&spec("qwen2moe-tiny"), &opts).unwrap();
    // g128 with K = 192: two groups per down row, the second partial. gate/up [384, 256] →
    // 49152 B, down [256, 192] → 24576 B, scales (384·2 + 256·2)·2 = 2560 B.
    let slab: u64 = 49152 + 24576 + 2560;
    let names: Vec<_> = plan.components().iter().map(|c| c.component).collect();
    assert_eq!(
        names,
        [
            Component::NonExpertWeights,
            Component::PackSource,
            Component::ExpertCache,
            Component::KvCache,
            Component::Staging,
            Component::Workspace,
            Component::RuntimeOverhead
        ]
    );
    // embed + lm_head 262144; final norm 256; per layer q,k,v 196608 + bias 768, o 65536,
    // norms 512, router 2048, shared expert 3·256·384 = 294912 + its gate 256 → 560640, ×2;
    // RoPE 512·64 = 32768. 1416448 elements × 2 bytes (BF16, the default).
    assert_eq!(bytes(&plan, Component::NonExpertWeights), x(1_416_448 * 2));
    // INT8 dense weights: the projections (q,k,v,o 262144, shared expert 294912, ×2 layers, and
    // lm_head 131072: 1245184) at 1 byte plus an FP16 scale per 32 (38912 scales); the rest
    // (171264: embeddings, biases, norms, routers, gates, RoPE) in BF16.
    let int8 = Plan::new(
        &spec("qwen2moe-tiny"),
        &PlanOptions {
            dense_int8: true,
            ..opts.clone()
        },
    )
    .unwrap();
    assert_eq!(
        bytes(&int8, Component::NonExpertWeights),
        x(1_245_184 + 38_912 * 2 + 171_264 * 2)
    );
    // There is no INT8 kernel on a GPU: refused by the planner too.
    let err = Plan::new(
        &spec("qwen2moe-tiny"),
        &PlanOptions {
            dense_int8: true,
            ..PlanOptions::new(Target::Cuda)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("INT8 dense weights run on the CPU only"),
        "{err}"
    );
    // On the CPU the pack is host memory too; fully resident experts are read from it in place.
    assert_eq!(bytes(&plan, Component::PackSource), x(16 * slab));
    assert_eq!(bytes(&plan, Component::ExpertCache), x(0));
    // ctx defaults to max_position_embeddings = 512; batch 2; BF16, the weights' dtype (the fused
    // CPU kernel stores keys and values so; F32 weights keep them in F32).
    assert_eq!(
        bytes(&plan, Component::KvCache),
        x(2 * 2 * 4 * 64 * 512 * 2 * 2)
    );
    assert_eq!(
        bytes(&plan, Component::Staging),
        x(0),
        "no staging at full residency"
    );
    // 2 × 128 tokens in F32 activations: residual 2..4 × 256·256·4; attention q,k,v
    // 256·12·64·4 = 786432 (×2 at most), the BF16 KV cache of a layer while it grows
    // 2·2·4·64·512·2 = 1048576, fused scores: a row per sequence and head, 2·4·512 = 4096
    // elements × 8..20 bytes; no mask (the fused kernel implies it).
    let attention = r(
        786_432 + 1_048_576 + 4096 * 8,
        2 * 786_432 + 1_048_576 + 4096 * 20,
    );
    // The MoE stage: router 256·8·(4+8) = 24576; routed experts 1024 (token, expert) pairs ×
    // 192·4 + 262144 = 1048576 at least, 1024·(192+256)·4 + 256·256·4 = 2097152 at most; shared
    // expert 3..4 × 256·384·4 (+ 262144 at most).
    let moe = r(
        24_576 + 1_048_576 + 3 * 393_216,
        24_576 + 2_097_152 + 4 * 393_216 + 262_144,
    );
    // Each end is the largest stage's: the MoE block's at both ends here.
    assert!(moe.min > attention.min && moe.max > attention.max);
    assert_eq!(
        bytes(&plan, Component::Workspace),
        r(524_288 + moe.min, 1_048_576 + moe.max)
    );
    assert_eq!(
        bytes(&plan, Component::RuntimeOverhead),
        r(2 * MIB, 200 * MIB)
    );
    // Everything sums into the process RSS.
    assert_eq!(host(&plan, Component::ProcessRss), plan.total());
    assert_eq!(host(&plan, Component::PackSource), x(16 * slab));
    assert_eq!(plan.resident_per_layer(), [8, 8]);
    // With a cache the slot arena and the staging ring come on top of the pack: with partial
    // residency, and with an explicit count of every expert (a runtime residency of `all`).
    for slots in [5, 8] {
        let cached = PlanOptions {
            residency: Resident::Uniform(slots),
            ..opts
        };
        let plan = Plan::new(&spec("qwen2moe-tiny"), &cached).unwrap();
        assert_eq!(bytes(&plan, Component::PackSource), x(16 * slab));
        assert_eq!(
            bytes(&plan, Component::ExpertCache),
            x(2 * slots as u64 * slab)
        );
        assert_eq!(bytes(&plan, Component::Staging), x(2 * slab));
        assert_eq!(host(&plan, Component::ProcessRss), plan.total());
        assert_eq!(plan.resident_per_layer(), [slots, slots]);
    }
}

#[test]
fn dense_experts_use_dense_bytes() {
    let opts = PlanOptions {
        experts: ExpertStorage::Dense(DType::BF16),
        ctx: Some(256),
        ..PlanOptions::new(Target::Cuda)
    };
    let plan = Plan::new(&spec("olmoe-tiny"), &opts).unwrap();
    // 2 layers × 8 experts × 3 · 256 · 128 × 2 bytes; no pack.
    assert_eq!(
        bytes(&plan, Component::ExpertCache),
        x(2 * 8 * 3 * 256 * 128 * 2)
    );
    assert_eq!(host(&plan, Component::PackSource), x(0));
    let partial = PlanOptions {
        residency: Resident::Uniform(6),
        ..opts
    };
    let err = Plan::new(&spec("olmoe-tiny"), &partial).unwrap_err();
    assert!(err.to_string().contains("INT4"), "{err}");
}

#[test]
fn real_model_configs_match_synthetic_shapes() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs");
    for (file, kind) in [
        ("olmoe-1b-7b-0924.json", SyntheticKind::Olmoe),
        ("qwen1.5-moe-a2.7b.json", SyntheticKind::Qwen2Moe),
        ("qwen3-30b-a3b.json", SyntheticKind::Qwen3Moe),
        ("mixtral-8x7b-instruct-v0.1.json", SyntheticKind::Mixtral),
    ] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value, kind.config_json(), "{file}");
    }
}

/// For every family the predicted non-expert weights are the checkpoint's tensors other than
/// the routed experts (whatever the family calls them: per-head q/k norms, Mixtral's
/// `block_sparse_moe`, GraniteMoE's fused `input_linear`/`output_linear`, shared experts),
/// counted from the safetensors header, plus the two RoPE tables
/// `[max_position_embeddings, head_dim / 2]`, all in BF16.
#[test]
fn non_expert_weights_are_the_checkpoints_tensors() {
    for fixture in FIXTURES {
        let s = spec(fixture);
        let file = std::fs::read(fixture_dir(fixture).join("model.safetensors")).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        // The experts' tensors as the spec names them (one per expert, or fused per layer).
        let h = s.hidden_size;
        let experts: std::collections::HashSet<String> = s
            .moe_blocks()
            .flat_map(|(l, m)| (0..m.num_experts).flat_map(move |e| m.expert_tensors(l, e, h)))
            .map(|t| t.name)
            .collect();
        let stored: usize = header
            .tensors()
            .iter()
            .filter(|(name, _)| !experts.contains(name.as_str()))
            .map(|(_, t)| t.shape.iter().product::<usize>())
            .sum();
        let rope = s.max_position_embeddings * s.head_dim;
        let plan = Plan::new(&s, &PlanOptions::new(Target::Cpu)).unwrap();
        assert_eq!(
            bytes(&plan, Component::NonExpertWeights),
            x(2 * (stored + rope) as u64),
            "{fixture}"
        );
    }
}

#[test]
fn real_models_non_expert_weights_and_slabs() {
    let opts = PlanOptions {
        ctx: Some(4096),
        ..PlanOptions::new(Target::Cuda)
    };
    let real = |kind: SyntheticKind| {
        let cfg = AnyConfig::from_json_str(&kind.config_json().to_string()).unwrap();
        Plan::new(&cfg.spec().unwrap(), &opts).unwrap()
    };
    let olmoe = real(SyntheticKind::Olmoe);
    // 2·50304·2048 + 2048 + 16·(2048·6144 + 2048² + 4096 + 4096 + 64·2048) + 4096·128.
    assert_eq!(
        bytes(&olmoe, Component::NonExpertWeights),
        x(477_235_200 * 2)
    );
    assert_eq!(bytes(&olmoe, Component::KvCache), x(512 * MIB));
    // gate/up 2048·2048/2, down 2048·1024/2, scales (2048·16 + 2048·8)·2.
    let slab = 2_097_152 + 1_048_576 + 98_304;
    assert_eq!(bytes(&olmoe, Component::ExpertCache), x(16 * 64 * slab));
    let qwen = real(SyntheticKind::Qwen2Moe);
    // 2·151936·2048 + 2048 + 24·(2048·6144 + 6144 + 2048² + 4096 + 60·2048 + 3·2048·5632 +
    // 2048) + 8192·128.
    assert_eq!(
        bytes(&qwen, Component::NonExpertWeights),
        x(1_859_749_888 * 2)
    );
    // gate/up 2816·2048/2, down 2048·1408/2, scales (2816·16 + 2048·11)·2.
    let slab = 2_883_584 + 1_441_792 + 135_168;
    assert_eq!(host(&qwen, Component::PackSource), x(24 * 60 * slab));
}

#[test]
fn residency_is_checked() {
    let s = spec("olmoe-tiny");
    let with = |residency| PlanOptions {
        residency,
        ..olmoe_cuda_options()
    };
    for (bad, text) in [
        (Resident::Uniform(3), "top-k"),
        (Resident::Uniform(9), "top-k"),
        (Resident::PerLayer(vec![4]), "lists 1 layers"),
    ] {
        let err = Plan::new(&s, &with(bad)).unwrap_err().to_string();
        assert!(err.contains(text), "{err}");
    }
    let plan = Plan::new(&s, &with(Resident::PerLayer(vec![4, 8]))).unwrap();
    assert_eq!(plan.resident_per_layer(), [4, 8]);
    assert_eq!(bytes(&plan, Component::ExpertCache), x(12 * OLMOE_SLAB));
    let too_long = PlanOptions {
        ctx: Some(513),
        ..olmoe_cuda_options()
    };
    let err = Plan::new(&s, &too_long).unwrap_err().to_string();
    assert!(err.contains("max_position_embeddings"), "{err}");
    let no_staging = PlanOptions {
        staging_buffers: 0,
        ..olmoe_cuda_options()
    };
    let err = Plan::new(&s, &no_staging).unwrap_err().to_string();
    assert!(err.contains("staging buffer"), "{err}");
    // A batch whose KV cache is beyond 2^64 bytes is refused instead of printed saturated.
    let huge_batch = PlanOptions {
        batch: usize::MAX,
        ..olmoe_cuda_options()
    };
    let err = Plan::new(&s, &huge_batch).unwrap_err().to_string();
    assert!(
        err.contains("kv_cache needs 2^64 bytes or more (batch 18446744073709551615"),
        "{err}"
    );
}

#[test]
fn budgets_parse() {
    for (s, want) in [
        ("6GiB", 6u64 << 30),
        ("6gib", 6 << 30),
        ("6000MB", 6_000_000_000),
        ("6GB", 6_000_000_000),
        ("512MiB", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("7B", 7),
        ("6442450944", 6 << 30),
        (" 4GiB ", 4 << 30),
    ] {
        assert_eq!(parse_bytes(s).unwrap(), want, "{s}");
    }
    for (s, why) in [
        ("6 GB", "space"),
        ("-1", "negative"),
        ("lots", "number"),
        ("", "empty"),
        ("0", "greater than zero"),
        ("0GiB", "greater than zero"),
        ("6G", "unknown unit"),
        ("1e9", "unknown unit"),
        ("1.5", "whole"),
        ("1.5B", "whole"),
        (".5GiB", "number"),
        ("6.GiB", "number"),
        ("+5GiB", "number"),
        ("99999999999TiB", "too large"),
    ] {
        let err = parse_bytes(s).unwrap_err().to_string();
        assert!(
            err.contains("invalid memory size") && err.contains(why),
            "{s}: {err}"
        );
    }
}

/// The OLMoE tiny plan's maximum without the expert cache and staging, at ctx 256.
fn olmoe_fixed_max() -> u64 {
    1_651_200 + 524_288 + 1_703_936 + 768 * MIB
}

fn exact_fit() -> FitOptions {
    FitOptions {
        margin: 0.0,
        ..Default::default()
    }
}

fn reducing_ctx() -> FitOptions {
    FitOptions {
        allow_ctx_reduction: true,
        ..exact_fit()
    }
}

#[test]
fn fit_picks_the_largest_capacity_that_fits() {
    let plan = Plan::new(&spec("olmoe-tiny"), &olmoe_cuda_options()).unwrap();
    let staged = olmoe_fixed_max() + 2 * OLMOE_SLAB;
    // Top-k (4 per layer) plus 3 spare slots, one byte short of a fourth: round-robin.
    let budget = staged + 11 * OLMOE_SLAB + OLMOE_SLAB - 1;
    let fit = plan.fit(budget, &exact_fit()).unwrap();
    assert_eq!(fit.plan.resident_per_layer(), [6, 5]);
    assert!(fit.plan.total().max <= budget);
    assert_eq!(fit.headroom(), OLMOE_SLAB - 1);
    assert!(!fit.ctx_reduced());
    // No layer can take one more slot.
    for layer in 0..2 {
        let mut more = fit.plan.resident_per_layer().to_vec();
        more[layer] += 1;
        let opts = PlanOptions {
            residency: Resident::PerLayer(more),
            ..olmoe_cuda_options()
        };
        let bigger = Plan::new(&spec("olmoe-tiny"), &opts).unwrap();
        assert!(bigger.total().max > budget);
    }
    // Full residency needs no staging: it fits exactly at fixed + 16 slabs.
    let full = plan
        .fit(olmoe_fixed_max() + 16 * OLMOE_SLAB, &exact_fit())
        .unwrap();
    assert_eq!(full.plan.resident_per_layer(), [8, 8]);
    assert_eq!(bytes(&full.plan, Component::Staging), x(0));
    // One byte less: partial residency with the staging ring, 15 − 2 = 13 slots in all.
    let partial = plan
        .fit(olmoe_fixed_max() + 16 * OLMOE_SLAB - 1, &exact_fit())
        .unwrap();
    assert_eq!(partial.plan.resident_per_layer(), [7, 6]);
    // The default margin holds 2% of the budget back.
    let budget = 800 * MIB;
    let fit = plan.fit(budget, &FitOptions::default()).unwrap();
    assert_eq!(fit.margin_bytes, (budget as f64 * 0.02).ceil() as u64);
    assert!(fit.plan.total().max + fit.margin_bytes <= budget);
}

#[test]
fn fit_weights_layers() {
    let plan = Plan::new(&spec("olmoe-tiny"), &olmoe_cuda_options()).unwrap();
    let budget = olmoe_fixed_max() + 2 * OLMOE_SLAB + 10 * OLMOE_SLAB;
    let with = |weights: Option<Vec<f64>>| {
        let opts = FitOptions {
            weights,
            ..exact_fit()
        };
        plan.fit(budget, &opts)
            .map(|f| f.plan.resident_per_layer().to_vec())
    };
    assert_eq!(with(None).unwrap(), [5, 5]);
    assert_eq!(with(Some(vec![1.0, 1.0])).unwrap(), [5, 5]);
    assert_eq!(with(Some(vec![3.0, 1.0])).unwrap(), [6, 4]);
    assert_eq!(with(Some(vec![0.0, 5.0])).unwrap(), [4, 6]);
    // A layer is never given more slots than it has experts.
    let budget = olmoe_fixed_max() + 2 * OLMOE_SLAB + 13 * OLMOE_SLAB;
    let opts = FitOptions {
        weights: Some(vec![100.0, 1.0]),
        ..exact_fit()
    };
    let fit = plan.fit(budget, &opts).unwrap();
    assert_eq!(fit.plan.resident_per_layer(), [8, 5]);
    for (bad, says) in [
        (vec![1.0], "1 layer weights given for 2 MoE layers"),
        (vec![1.0, -1.0], "finite and non-negative"),
        (vec![f64::NAN, 1.0], "finite and non-negative"),
    ] {
        let err = with(Some(bad)).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
}

#[test]
fn fit_refuses_naming_the_component() {
    let plan = Plan::new(&spec("olmoe-tiny"), &olmoe_cuda_options()).unwrap();
    let minimal = olmoe_fixed_max() + 2 * OLMOE_SLAB + 8 * OLMOE_SLAB;
    let fit = plan.fit(minimal, &exact_fit()).unwrap();
    assert_eq!(fit.plan.resident_per_layer(), [4, 4]);
    let refuse = |budget: u64| plan.fit(budget, &exact_fit()).unwrap_err();
    // Everything else fits; the top-k slots (8 slabs) find one byte less than they need.
    let err = refuse(minimal - 1);
    assert_eq!(
        does_not_fit(&err),
        Some((Component::ExpertCache, 8 * OLMOE_SLAB, 8 * OLMOE_SLAB - 1)),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("breakdown") && text.contains("what would fit"),
        "{text}"
    );
    assert!(
        text.contains("kv_cache") && text.contains("runtime_overhead"),
        "{text}"
    );
    assert!(text.contains("--allow-ctx-reduction"), "{text}");
    // Runtime and weights fit, the KV cache does not, even at ctx 1 (2 KiB there), which is
    // what the refusal shows when no context fits.
    let err = refuse(768 * MIB + 1_651_200 + 1000);
    assert_eq!(
        does_not_fit(&err),
        Some((Component::KvCache, 2048, 1000)),
        "{err}"
    );
    // At ctx 256 the KV cache (512 KiB) would cross this budget first, but shortening the
    // context cannot save it: at ctx 1 the top-k expert slots still do not fit, and they are
    // named.
    let err = refuse(768 * MIB + 1_651_200 + 200_000);
    assert!(
        matches!(does_not_fit(&err), Some((Component::ExpertCache, needed, _)) if needed == 8 * OLMOE_SLAB),
        "{err}"
    );
    assert!(err.to_string().contains("at ctx 1"), "{err}");
    // Not even the weights fit: the message names them and what is missing.
    let err = refuse(768 * MIB + 1000);
    assert_eq!(
        does_not_fit(&err),
        Some((Component::NonExpertWeights, 1_651_200, 1000)),
        "{err}"
    );
    assert!(
        err.to_string().starts_with(&format!(
            "non_expert_weights needs 1.57 MiB but only 1000 B is available ({} missing)",
            format_bytes(1_650_200)
        )),
        "{err}"
    );
    assert!(err.to_string().contains("no context length fits"), "{err}");
    // Admission of a given residency (6 slots per layer) names the component too.
    let err = plan.admit(minimal, 0.0).unwrap_err();
    assert_eq!(
        does_not_fit(&err),
        Some((Component::ExpertCache, 12 * OLMOE_SLAB, 8 * OLMOE_SLAB)),
        "{err}"
    );
    assert!(plan.admit(plan.total().max, 0.0).is_ok());
    let no_margin_left = FitOptions {
        margin: 1.0,
        ..exact_fit()
    };
    assert!(matches!(
        plan.fit(minimal, &no_margin_left),
        Err(QmoeError::Plan(m)) if m.contains("margin 1 must be a fraction of the budget in [0, 1)")
    ));
}

#[test]
fn fit_reduces_the_context_only_when_allowed() {
    let plan = Plan::new(&spec("olmoe-tiny"), &olmoe_cuda_options()).unwrap();
    let minimal = olmoe_fixed_max() + 2 * OLMOE_SLAB + 8 * OLMOE_SLAB;
    let budget = minimal - 200_000;
    let err = plan.fit(budget, &exact_fit()).unwrap_err();
    assert!(
        matches!(
            err,
            QmoeError::DoesNotFit {
                component: Component::ExpertCache,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("ctx ≤"), "{err}");
    let allow = reducing_ctx();
    let fit = plan.fit(budget, &allow).unwrap();
    assert!(fit.ctx_reduced());
    assert_eq!(fit.requested_ctx, 256);
    let ctx = fit.plan.ctx();
    assert!(ctx < 256 && fit.plan.total().max <= budget, "ctx {ctx}");
    assert_eq!(fit.plan.resident_per_layer(), [4, 4]);
    // The largest such context: one more token does not fit.
    let next = PlanOptions {
        ctx: Some(ctx + 1),
        residency: Resident::Uniform(4),
        ..olmoe_cuda_options()
    };
    assert!(Plan::new(&spec("olmoe-tiny"), &next).unwrap().total().max > budget);
    // A budget that fits at the requested context keeps it even when reduction is allowed.
    assert!(!plan.fit(minimal, &allow).unwrap().ctx_reduced());
}

#[test]
fn bad_configs_are_clear_errors() {
    let mut cfg = SyntheticKind::Tiny.config_json();
    cfg["model_type"] = "deepseek_v3".into();
    let err = AnyConfig::from_json_str(&cfg.to_string()).unwrap_err();
    assert!(err.to_string().contains("not supported"), "{err}");
    let mut cfg = SyntheticKind::Tiny.config_json();
    cfg["num_key_value_heads"] = 3.into();
    let err = AnyConfig::from_json_str(&cfg.to_string())
        .and_then(|c| c.spec())
        .unwrap_err();
    assert!(err.to_string().contains("num_key_value_heads"), "{err}");
}

#[test]
fn group_size_changes_the_slab() {
    let s = spec("olmoe-tiny");
    let g32 = PlanOptions {
        experts: ExpertStorage::Int4(GroupSize::new(32).unwrap()),
        ..olmoe_cuda_options()
    };
    let plan = Plan::new(&s, &g32).unwrap();
    // Scales (256·8 + 256·4)·2 = 6144 bytes.
    assert_eq!(
        bytes(&plan, Component::ExpertCache),
        x(2 * 6 * (32768 + 16384 + 6144))
    );
}

#[test]
fn cpu_fit_is_full_residency_or_nothing() {
    // On the CPU the pack is in memory anyway: a slot arena would only add to it.
    let plan = Plan::new(&spec("qwen2moe-tiny"), &PlanOptions::new(Target::Cpu)).unwrap();
    let full = plan.total().max;
    let fit = plan.fit(full, &exact_fit()).unwrap();
    assert_eq!(fit.plan.resident_per_layer(), [8, 8]);
    // No cache and no staging: the workspace, the last component with bytes, is one byte short.
    let err = plan.fit(full - 1, &exact_fit()).unwrap_err();
    let workspace = bytes(&plan, Component::Workspace).max;
    assert_eq!(
        does_not_fit(&err),
        Some((Component::Workspace, workspace, workspace - 1)),
        "{err}"
    );
    assert!(err.to_string().contains("8 of 8 (all)"), "{err}");
    let allow = reducing_ctx();
    let fit = plan.fit(full - 1, &allow).unwrap();
    assert_eq!(fit.plan.resident_per_layer(), [8, 8]);
    assert_eq!(fit.plan.ctx(), 511);
}
