//! The residency protocol on the host-memory backend: hit/miss/eviction sequences against
//! reference models of the policies, exact copy byte counts, admission errors, fault injection,
//! and bit-identical model outputs whatever the residency.

use std::collections::HashMap;
use std::sync::Arc;

use candle::{DType, Device, Tensor};
use candle_qmoe::generation::{argmax, generate};
use candle_qmoe::models::{MoeForCausalLm, PackedExperts};
use candle_qmoe::pack::{ExpertLayout, GroupSize, LayerPack};
use candle_qmoe::residency::{
    HybridMode, PolicyKind, Residency, ResidencyOptions, Resident, ResidentExperts,
};
use candle_qmoe::synthetic::{random_layer_pack, random_routing, SyntheticKind, SyntheticModel};
use candle_qmoe::{Int4Experts, QmoeError, RoutedExperts};
use candle_qmoe_suite::testing::{bit_identical, max_abs_diff_tensors};
use rand::{Rng, SeedableRng};

const E: usize = 16;
const K: usize = 4;

fn layout() -> ExpertLayout {
    ExpertLayout {
        hidden: 64,
        intermediate: 96,
        group_size: GroupSize::new(32).unwrap(),
    }
}

fn pack() -> LayerPack {
    random_layer_pack(11, layout(), E).unwrap()
}

fn options(resident: Resident, policy: PolicyKind) -> ResidencyOptions {
    ResidencyOptions {
        resident,
        policy,
        ..Default::default()
    }
}

fn layer(opts: ResidencyOptions) -> (Residency, Arc<ResidentExperts>) {
    let res = Residency::new(opts);
    let experts = res.host_layer(0, K, pack()).unwrap();
    (res, experts)
}

/// Random (not zero) activations and a routing of `tokens` tokens.
fn call(seed: u64, tokens: usize) -> (Tensor, Tensor, Tensor) {
    let h = layout().hidden;
    let xs = candle_qmoe::synthetic::gaussian(seed, tokens * h, 1.0);
    let (ids, w) = random_routing(seed + 1, tokens, K, E);
    (
        Tensor::from_vec(xs, (tokens, h), &Device::Cpu).unwrap(),
        Tensor::from_vec(ids, (tokens, K), &Device::Cpu).unwrap(),
        Tensor::from_vec(w, (tokens, K), &Device::Cpu).unwrap(),
    )
}

/// An independent model of the cache: which experts are resident, with LRU or LFU order.
struct Reference {
    capacity: usize,
    lfu: bool,
    resident: Vec<usize>,
    last: HashMap<usize, u64>,
    count: HashMap<usize, u64>,
    tick: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl Reference {
    fn new(capacity: usize, lfu: bool) -> Self {
        let mut r = Self {
            capacity,
            lfu,
            resident: Vec::new(),
            last: HashMap::new(),
            count: HashMap::new(),
            tick: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        };
        // The cache starts filled with experts 0..capacity, used in that order.
        for e in 0..capacity {
            r.tick += 1;
            r.resident.push(e);
            r.last.insert(e, r.tick);
            r.count.insert(e, 1);
        }
        r
    }

    fn step(&mut self, experts: &[usize]) {
        for &e in experts {
            self.tick += 1;
            if self.resident.contains(&e) {
                self.hits += 1;
            } else {
                self.misses += 1;
                if self.resident.len() == self.capacity {
                    let key = |c: &usize| {
                        let lfu = if self.lfu { self.count[c] } else { 0 };
                        (lfu, self.last[c])
                    };
                    let victim = *self
                        .resident
                        .iter()
                        .filter(|c| !experts.contains(c))
                        .min_by_key(|c| key(c))
                        .unwrap();
                    self.resident.retain(|&c| c != victim);
                    self.count.insert(victim, 0);
                    self.evictions += 1;
                }
                self.resident.push(e);
            }
            *self.count.entry(e).or_default() += 1;
            self.last.insert(e, self.tick);
        }
    }
}

#[test]
fn hits_misses_and_evictions_follow_the_reference_policies() {
    for (policy, lfu) in [(PolicyKind::Lru, false), (PolicyKind::Lfu, true)] {
        for capacity in [K, 6, 11, E] {
            let (res, experts) = layer(options(Resident::Uniform(capacity), policy));
            let mut reference = Reference::new(capacity, lfu);
            // Skewed routing: low expert ids are popular, so the policies differ.
            let mut rng = rand::rngs::StdRng::seed_from_u64(capacity as u64);
            for step in 0..60 {
                let mut ids: Vec<u32> = Vec::new();
                while ids.len() < K {
                    let e = (rng.random::<f64>().powi(2) * E as f64) as u32;
                    if !ids.contains(&e) {
                        ids.push(e);
                    }
                }
                let (xs, _, w) = call(step, 1);
                let ids_t = Tensor::from_vec(ids.clone(), (1, K), &Device::Cpu).unwrap();
                experts.forward(&xs, &ids_t, &w).unwrap();
                let mut sorted: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
                sorted.sort();
                reference.step(&sorted);
                let s = experts.stats();
                assert_eq!(
                    (s.hits, s.misses, s.evictions),
                    (reference.hits, reference.misses, reference.evictions),
                    "{policy:?}, capacity {capacity}, step {step}"
                );
                let mut resident: Vec<usize> =
                    (0..E).filter(|&e| experts.store().is_resident(e)).collect();
                resident.sort();
                let mut want = reference.resident.clone();
                want.sort();
                assert_eq!(
                    resident, want,
                    "{policy:?}, capacity {capacity}, step {step}"
                );
            }
            let s = res.stats();
            assert_eq!(s.h2d_bytes, s.misses * layout().slab_bytes() as u64);
            assert_eq!(s.preload_bytes, (capacity * layout().slab_bytes()) as u64);
            if capacity == E {
                assert_eq!((s.misses, s.evictions, s.h2d_bytes), (0, 0, 0));
            }
        }
    }
}

#[test]
fn lfru_keeps_a_steady_expert_through_a_burst() {
    let (_, lfru) = layer(options(Resident::Uniform(K + 1), PolicyKind::Lfru));
    let (_, lru) = layer(options(Resident::Uniform(K + 1), PolicyKind::Lru));
    // Expert 0 is used every step next to three of experts 1..=9 in turn, then a burst of
    // eight fresh experts arrives.
    let mut steps: Vec<[u32; K]> = (0..20)
        .map(|i| [0, 1 + (3 * i) % 9, 2 + (3 * i) % 9, 3 + (3 * i) % 9])
        .collect();
    steps.extend([[10, 11, 12, 13], [12, 13, 14, 15]]);
    for (i, ids) in steps.iter().enumerate() {
        let (xs, _, w) = call(i as u64, 1);
        let ids = Tensor::new(&[*ids], &Device::Cpu).unwrap();
        lfru.forward(&xs, &ids, &w).unwrap();
        lru.forward(&xs, &ids, &w).unwrap();
    }
    assert!(
        lfru.store().is_resident(0),
        "LFRU keeps the frequent expert"
    );
    assert!(!lru.store().is_resident(0), "LRU evicts it");
}

#[test]
fn outputs_are_bit_identical_for_any_capacity_policy_and_hybrid_mode() {
    let reference = Int4Experts::new(pack());
    for tokens in [1, 3, 40] {
        let (xs, ids, w) = call(100 + tokens as u64, tokens);
        let want = reference.forward(&xs, &ids, &w).unwrap();
        let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for capacity in [K, 5, 9, E] {
            for policy in [PolicyKind::Lru, PolicyKind::Lfu, PolicyKind::Lfru] {
                for hybrid in [HybridMode::Off, HybridMode::Auto, HybridMode::Always] {
                    let opts = ResidencyOptions {
                        hybrid,
                        ..options(Resident::Uniform(capacity), policy)
                    };
                    let (_, experts) = layer(opts);
                    // Twice: the second call runs on the cache the first one left.
                    for _ in 0..2 {
                        let got = experts.forward(&xs, &ids, &w).unwrap();
                        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        assert!(
                            bit_identical(&got, &want),
                            "T={tokens} C={capacity} {policy:?} {hybrid:?}"
                        );
                    }
                    let s = experts.stats();
                    if hybrid == HybridMode::Off {
                        assert_eq!(s.hybrid_cpu_experts, 0);
                    } else {
                        // The host backend computes misses on the CPU rather than copying.
                        assert_eq!((s.h2d_bytes, s.hybrid_cpu_experts), (0, s.misses));
                    }
                }
            }
        }
    }
}

/// Whether `e` is the injected copy failure.
fn copy_failed(e: &candle::Error) -> bool {
    matches!(QmoeError::find(e), Some(QmoeError::CopyFailed { reason, .. }) if reason == "injected failure")
}

#[test]
fn a_failed_copy_keeps_the_published_generation_valid() {
    let reference = Int4Experts::new(pack());
    let (res, experts) = layer(options(Resident::Uniform(K), PolicyKind::Lru));
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut failures = 0;
    for step in 0..40u64 {
        let (xs, ids, w) = call(step, 1 + (step % 3) as usize);
        if step % 4 == 1 {
            res.host_memory().fail_copy_after(rng.random_range(0..3));
        }
        if step % 3 == 2 {
            // A prefetch (which may hit the injected failure) before the step.
            let guess: Vec<u32> = (0..K).map(|_| rng.random_range(0..E as u32)).collect();
            if let Err(e) = experts.prefetch(&guess) {
                failures += 1;
                assert!(copy_failed(&e), "{e}");
            }
        }
        match experts.forward(&xs, &ids, &w) {
            Err(e) => {
                failures += 1;
                assert!(copy_failed(&e), "{e}");
            }
            Ok(got) => {
                let want = reference.forward(&xs, &ids, &w).unwrap();
                let (got, want) = (
                    got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert!(
                    bit_identical(&got, &want),
                    "step {step}: output differs after a failed copy"
                );
            }
        }
        // The published table only ever names slots that hold their expert's exact bytes.
        let store = experts.store();
        let arena = store.arena();
        for (e, &slot) in arena.table().iter().enumerate() {
            if slot != u32::MAX {
                assert!(
                    arena.slot(slot as usize) == store.source().slab(e).bytes,
                    "step {step}: expert {e} published in slot {slot} with other bytes"
                );
            }
        }
    }
    assert!(failures >= 5, "only {failures} injected failures fired");
}

#[test]
fn a_prefetch_is_published_with_the_next_step() {
    let (res, experts) = layer(options(Resident::Uniform(K + 2), PolicyKind::Lru));
    // The cache starts with experts 0..6; prefetch 10 and 11.
    experts.prefetch(&[10, 11, 10, 99]).unwrap();
    let store = experts.store();
    assert!(store.is_resident(10) && store.is_resident(11));
    assert_eq!(
        store.arena().table()[10],
        u32::MAX,
        "published before the next step"
    );
    drop(store);
    let s = res.stats();
    assert_eq!(
        (s.prefetch_issued, s.h2d_bytes),
        (2, 2 * layout().slab_bytes() as u64)
    );
    let (xs, _, w) = call(1, 1);
    let ids = Tensor::new(&[[10u32, 11, 12, 13]], &Device::Cpu).unwrap();
    let got = experts.forward(&xs, &ids, &w).unwrap();
    let want = Int4Experts::new(pack()).forward(&xs, &ids, &w).unwrap();
    assert_eq!(max_abs_diff_tensors(&got, &want), 0.0);
    assert_ne!(experts.store().arena().table()[10], u32::MAX);
    let s = res.stats();
    assert_eq!(
        (s.prefetch_used, s.prefetch_wasted, s.hits, s.misses),
        (2, 0, 2, 2)
    );
}

#[test]
fn a_step_served_in_chunks_counts_each_resident_expert_once() {
    // As the CUDA backend serves a call in chunks of tokens whose experts fit the cache.
    let (_res, experts) = layer(options(Resident::Uniform(K), PolicyKind::Lru));
    let mut store = experts.store(); // experts 0..K resident
    store.begin_step(&[0, 1, 2, 9], false);
    store.ensure(&[0, 1, 2]).unwrap();
    store.ensure(&[1, 2, 9]).unwrap(); // 1 and 2 stayed resident: counted already
    let s = store.stats().clone();
    assert_eq!(
        (s.hits, s.misses, s.h2d_bytes),
        (3, 1, layout().slab_bytes() as u64)
    );
    store.begin_step(&[1, 9], false);
    store.ensure(&[1, 9]).unwrap(); // a new step counts again
    assert_eq!((store.stats().hits, store.stats().misses), (5, 1));
}

#[test]
fn admission_refuses_profiles_that_cannot_work() {
    let err = |opts: ResidencyOptions| Residency::new(opts).host_layer(3, K, pack()).unwrap_err();
    // The reason a profile is refused, with its message (which names the layer).
    let refused = |e: candle::Error| match QmoeError::find(&e) {
        Some(QmoeError::Residency(reason)) => (reason.clone(), e.to_string()),
        _ => panic!("not a refused profile: {e}"),
    };
    let slab = layout().slab_bytes();
    let (reason, msg) = refused(err(options(Resident::Uniform(K - 1), PolicyKind::Lru)));
    assert!(
        msg.contains("layer 3") && reason.contains("top-k = 4") && reason.contains("3 experts"),
        "{msg}"
    );
    let (reason, _) = refused(err(ResidencyOptions {
        staging_bytes: Some(slab - 16),
        ..Default::default()
    }));
    assert!(
        reason.contains("cannot hold one expert") && reason.contains(&slab.to_string()),
        "{reason}"
    );
    let (reason, _) = refused(err(ResidencyOptions {
        staging_buffers: 0,
        ..Default::default()
    }));
    assert!(reason.contains("at least one buffer"), "{reason}");
    let e = err(ResidencyOptions {
        resident: Resident::Uniform(8),
        device_memory_limit: Some(6 * slab),
        ..Default::default()
    });
    assert!(
        matches!(QmoeError::find(&e), Some(QmoeError::OutOfMemory { what, needed, .. })
            if what.contains("8 slots") && *needed == 8 * slab),
        "{e}"
    );
    let (reason, _) = refused(err(options(
        Resident::PerLayer(vec![4, 4]),
        PolicyKind::Lru,
    )));
    assert!(
        reason.contains("lists 2 layers") && reason.contains("layer 3"),
        "{reason}"
    );
    for bad in ["", "lots", "-1", "4,x"] {
        assert!(
            matches!(bad.parse::<Resident>(), Err(QmoeError::UnsupportedConfig { field, .. }) if field == "residency"),
            "{bad}"
        );
    }
    assert_eq!("all".parse::<Resident>().unwrap(), Resident::All);
    assert_eq!("12".parse::<Resident>().unwrap(), Resident::Uniform(12));
    assert_eq!(
        "4,8".parse::<Resident>().unwrap(),
        Resident::PerLayer(vec![4, 8])
    );
}

fn tiny() -> SyntheticModel {
    SyntheticModel::new(SyntheticKind::Tiny, 3, GroupSize::default()).unwrap()
}

fn load(s: &SyntheticModel, experts: &PackedExperts) -> MoeForCausalLm {
    s.load(DType::F32, &Device::Cpu, experts).unwrap()
}

const PROMPT: [u32; 9] = [50279, 510, 3158, 8516, 30013, 27287, 689, 253, 22658];

#[test]
fn model_tokens_and_logits_are_identical_at_every_residency() {
    let synth = tiny();
    let mut plain = load(&synth, &synth.int4_experts());
    let want = generate(&mut plain, &PROMPT, 10, &[], argmax, |_| Ok(())).unwrap();
    let input = Tensor::new(&[PROMPT], &Device::Cpu).unwrap();
    plain.clear_kv_cache();
    let want_logits = plain.forward_all(&input, 0).unwrap();
    let e = synth.spec().uniform_moe().unwrap().num_experts;
    let k = synth.spec().uniform_moe().unwrap().top_k;
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let random: Vec<usize> = (0..synth.spec().num_layers())
        .map(|_| rng.random_range(k..=e))
        .collect();
    for (resident, prefetch) in [
        (Resident::All, false),
        (Resident::Uniform(k), false),
        (Resident::Uniform(k), true),
        (Resident::PerLayer(random), true),
    ] {
        let experts = synth.int4_experts().with_residency(ResidencyOptions {
            resident: resident.clone(),
            prefetch,
            ..Default::default()
        });
        let mut model = load(&synth, &experts);
        if prefetch {
            assert_eq!(model.enable_prefetch(), synth.spec().num_layers() - 1);
        }
        let got = generate(&mut model, &PROMPT, 10, &[], argmax, |_| Ok(())).unwrap();
        assert_eq!(got.tokens, want.tokens, "{resident:?}");
        model.clear_kv_cache();
        let logits = model.forward_all(&input, 0).unwrap();
        assert_eq!(
            max_abs_diff_tensors(&logits, &want_logits),
            0.0,
            "{resident:?}"
        );
        let res = experts.residency().unwrap();
        let s = res.stats();
        if resident == Resident::All {
            assert_eq!((s.misses, s.h2d_bytes), (0, 0));
        } else {
            assert!(s.misses > 0 && s.h2d_bytes > 0, "{s:?}");
        }
        if prefetch {
            assert!(s.prefetch_issued > 0, "{s:?}");
            assert!(
                s.prefetch_used + s.prefetch_wasted <= s.prefetch_issued,
                "{s:?}"
            );
        } else {
            assert_eq!(s.prefetch_issued, 0);
        }
        assert_eq!(res.capacities().len(), synth.spec().num_layers());
    }
}
