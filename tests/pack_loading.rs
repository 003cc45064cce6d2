//! `.qmoe` packs made from a checkpoint: quantize → write → open → load gives the same model as
//! quantizing at load time, and a pack is refused by any other checkpoint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle::{DType, Device, Tensor};
use candle_qmoe::models::{
    self, AnyConfig, ExpertsBackend, ExpertsLoader, MoeForCausalLm, PackedExperts, QuantizeOptions,
};
use candle_qmoe::pack::{GroupSize, LayerPack, PackFile, PackMeta};
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use candle_qmoe::QmoeError;
use candle_qmoe_suite::testing::{fixture_dir, FIXTURES};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qmoe-pack-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn load(dir: &Path, experts: &dyn ExpertsLoader) -> candle::Result<MoeForCausalLm> {
    let cfg = AnyConfig::from_file(dir.join("config.json"))?;
    let vb = unsafe { models::mmap_checkpoint(dir, DType::F32, &Device::Cpu)? };
    MoeForCausalLm::new(&cfg, vb, experts)
}

fn logits(model: &mut MoeForCausalLm) -> Vec<f32> {
    model.clear_kv_cache();
    let ids = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3]], &Device::Cpu).unwrap();
    model
        .forward_all(&ids, 0)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn quantize(dir: &Path, group: usize) -> PackFile {
    let opts = QuantizeOptions {
        group_size: GroupSize::new(group).unwrap(),
        source_model: "test/fixture".into(),
        source_revision: "r1".into(),
        ..Default::default()
    };
    models::quantize_checkpoint(dir, &opts, &|_, _| {}).unwrap()
}

/// The error of `r`, which must fail, as a `QmoeError` (Candle carries ours unchanged).
fn error<T>(r: candle::Result<T>) -> QmoeError {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => QmoeError::from(e),
    }
}

#[test]
fn written_pack_loads_the_same_model_as_in_process_int4() {
    let tmp = temp_dir("roundtrip");
    for name in FIXTURES {
        let dir = fixture_dir(name);
        let calls = AtomicUsize::new(0);
        let last = AtomicUsize::new(0);
        let opts = QuantizeOptions {
            group_size: GroupSize::new(64).unwrap(),
            ..Default::default()
        };
        let pack = models::quantize_checkpoint(&dir, &opts, &|done, total| {
            calls.fetch_add(1, Ordering::Relaxed);
            last.fetch_max(done, Ordering::Relaxed);
            assert_eq!(total, 2 * 8);
        })
        .unwrap();
        assert_eq!(calls.into_inner(), 16);
        assert_eq!(last.into_inner(), 16);
        let meta = pack.meta().clone();
        assert_eq!(meta.fingerprint, models::fingerprint(&dir).unwrap());
        assert_eq!(meta.source_model, dir.display().to_string());
        assert_eq!(meta.source_revision, "local");
        assert_eq!(pack.layer_indices().collect::<Vec<_>>(), vec![0, 1]);

        let path = tmp.join(format!("{name}.qmoe"));
        pack.save(&path).unwrap();
        let opened = PackFile::open(&path).unwrap();
        assert_eq!(opened.meta(), &meta);
        assert_eq!(opened.total_bytes(), pack.total_bytes());
        for i in [0, 1] {
            assert_eq!(
                opened.layer(i).unwrap().bytes(),
                pack.layer(i).unwrap().bytes()
            );
        }

        // Read into this process's memory at open: the same bytes.
        let read = PackFile::open_in_memory(&path).unwrap();
        assert_eq!(read.meta(), &meta);
        for i in [0, 1] {
            assert_eq!(
                read.layer(i).unwrap().bytes(),
                pack.layer(i).unwrap().bytes()
            );
        }

        let mut in_process =
            load(&dir, &ExpertsBackend::int4(GroupSize::new(64).unwrap())).unwrap();
        let want = logits(&mut in_process);
        for (how, file) in [("mapped", opened), ("read into memory", read)] {
            let experts = PackedExperts::for_checkpoint(Arc::new(file), &dir).unwrap();
            let mut from_file = load(&dir, &experts).unwrap();
            assert_eq!(
                logits(&mut from_file),
                want,
                "{name}: logits with the pack file ({how}) differ from in-process INT4"
            );
        }
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A copy of `name` whose `model.layers.1.mlp.gate.weight` is nudged (or whose config.json is
/// edited): the same architecture, another checkpoint.
fn modified_copy(name: &str, tag: &str, edit_router: bool) -> PathBuf {
    let src = fixture_dir(name);
    let dir = temp_dir(tag);
    let mut config = std::fs::read_to_string(src.join("config.json")).unwrap();
    if edit_router {
        let mut ts: HashMap<String, Tensor> =
            candle::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
        let key = "model.layers.1.mlp.gate.weight";
        let w = &ts[key];
        let nudged = (w.to_dtype(DType::F32).unwrap() * 1.01)
            .unwrap()
            .to_dtype(w.dtype())
            .unwrap();
        ts.insert(key.to_string(), nudged);
        candle::safetensors::save(&ts, dir.join("model.safetensors")).unwrap();
    } else {
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        config = config.replace("\"rope_theta\": 10000.0", "\"rope_theta\": 20000.0");
    }
    std::fs::write(dir.join("config.json"), config).unwrap();
    dir
}

#[test]
fn pack_from_another_checkpoint_is_refused() {
    let tmp = temp_dir("foreign");
    let path = tmp.join("olmoe-tiny.qmoe");
    quantize(&fixture_dir("olmoe-tiny"), 128)
        .save(&path)
        .unwrap();
    let pack = Arc::new(PackFile::open(&path).unwrap());

    // The checkpoint it came from accepts it.
    let own = PackedExperts::for_checkpoint(pack.clone(), fixture_dir("olmoe-tiny")).unwrap();
    load(&fixture_dir("olmoe-tiny"), &own).unwrap();

    // Same architecture, other router weights; same weights, other config.json; another family.
    let router_dir = modified_copy("olmoe-tiny", "router", true);
    let config_dir = modified_copy("olmoe-tiny", "config", false);
    for dir in [&router_dir, &config_dir, &fixture_dir("qwen2moe-tiny")] {
        assert_ne!(
            models::fingerprint(dir).unwrap(),
            pack.meta().fingerprint,
            "{}",
            dir.display()
        );
        let experts = PackedExperts::for_checkpoint(pack.clone(), dir).unwrap();
        let e = error(load(dir, &experts));
        assert!(
            matches!(&e, QmoeError::PackMismatch { source_model, source_revision, reason }
                if source_model == "test/fixture"
                    && source_revision == "r1"
                    && reason.contains("not this checkpoint's")),
            "{}: {e}",
            dir.display()
        );
        assert!(e.to_string().contains("re-run quantize"), "{e}");
    }

    // A synthetic model's pack is refused by a real checkpoint, and a pack whose shapes differ is
    // refused even under the right fingerprint.
    let synth = SyntheticModel::new(SyntheticKind::Tiny, 1, GroupSize::default()).unwrap();
    let experts =
        PackedExperts::for_checkpoint(synth.pack().clone(), fixture_dir("olmoe-tiny")).unwrap();
    let e = error(load(&fixture_dir("olmoe-tiny"), &experts));
    assert!(
        matches!(&e, QmoeError::PackMismatch { source_model, .. } if source_model == "synthetic:tiny"),
        "{e}"
    );
    let experts = PackedExperts::new(synth.pack().clone(), synth.fingerprint());
    let e = error(load(&fixture_dir("qwen2moe-tiny"), &experts));
    assert!(
        matches!(&e, QmoeError::PackMismatch { reason, .. }
            if reason == "pack holds H 256 I 128 × 8 experts; the model has H 256 I 192 × 8"),
        "{e}"
    );

    for d in [tmp, router_dir, config_dir] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn fingerprint_and_in_memory_packs_report_bad_input() {
    // A checkpoint without one MoE router names the tensor.
    let dir = temp_dir("norouter");
    let src = fixture_dir("qwen2moe-tiny");
    let mut ts: HashMap<String, Tensor> =
        candle::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    ts.remove("model.layers.1.mlp.gate.weight").unwrap();
    candle::safetensors::save(&ts, dir.join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let e = models::fingerprint(&dir).unwrap_err();
    assert!(
        matches!(&e, QmoeError::InvalidCheckpoint { dir: d, reason }
            if d == &dir && reason.contains("model.layers.1.mlp.gate.weight")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // PackFile::from_layers checks each layer against the header.
    let pack = quantize(&fixture_dir("olmoe-tiny"), 128);
    let meta: PackMeta = pack.meta().clone();
    let layer: LayerPack = pack.layer(0).unwrap();
    let invalid = |r: candle_qmoe::Result<PackFile>, what: &str| match r {
        Err(QmoeError::InvalidPack { reason }) => assert!(reason.contains(what), "{reason}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    };
    let dup = PackFile::from_layers(meta.clone(), [(0, layer.clone()), (0, layer.clone())]);
    invalid(dup, "layer 0 is given twice");
    let mut other = meta.clone();
    other.num_experts = 4;
    invalid(PackFile::from_layers(other, [(0, layer)]), "header says");
    invalid(PackFile::from_layers(meta, []), "at least one layer");
}

/// What `PackFile::open` would refuse is refused when written, before any byte: no layer, a
/// layer given twice, a fingerprint of another form; a `PackWriter` refuses layers out of the
/// header's order and a finish before every layer. A layer's experts out of range are errors.
#[test]
fn packs_that_could_not_be_opened_are_not_written() {
    let dir = temp_dir("write-refusals");
    let pack = quantize(&fixture_dir("olmoe-tiny"), 128);
    let meta: PackMeta = pack.meta().clone();
    let layer: LayerPack = pack.layer(0).unwrap();
    let path = dir.join("p.qmoe");
    let refused = |r: candle_qmoe::Result<()>, what: &str| {
        match r {
            Err(QmoeError::InvalidPack { reason }) => assert!(reason.contains(what), "{reason}"),
            Err(e) => panic!("{e}"),
            Ok(()) => panic!("accepted"),
        }
        assert!(!path.exists(), "nothing written");
    };
    refused(PackFile::write(&path, &meta, &[]), "at least one layer");
    let twice = [(0, layer.clone()), (0, layer.clone())];
    refused(
        PackFile::write(&path, &meta, &twice),
        "layer 0 is given twice",
    );
    let handmade = PackMeta {
        fingerprint: "my-model-v1".into(),
        ..meta.clone()
    };
    refused(
        PackFile::write(&path, &handmade, &[(0, layer.clone())]),
        "my-model-v1",
    );
    // Nor is such a pack made in memory, whose `save` would then be refused.
    match PackFile::from_layers(handmade.clone(), [(0, layer.clone())]) {
        Err(QmoeError::InvalidPack { reason }) => {
            assert!(reason.contains("my-model-v1"), "{reason}")
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    let mut out = candle_qmoe::pack::PackWriter::create(&path, &meta, [0, 1]).unwrap();
    refused(
        out.write_layer(1, &layer),
        "layer 1 written where layer 0 comes next",
    );
    out.write_layer(0, &layer).unwrap();
    refused(out.finish(), "finished after 1 of the header's 2 layers");
    // The same layer twice in a row, and one past the header's list.
    let mut out = candle_qmoe::pack::PackWriter::create(&path, &meta, [0]).unwrap();
    out.write_layer(0, &layer).unwrap();
    refused(
        out.write_layer(0, &layer),
        "after every layer of the header",
    );
    out.finish().unwrap();
    assert!(PackFile::open(&path).is_ok());

    let n = layer.num_experts();
    for e in [n, n + 91] {
        let out_of_range = |r: candle_qmoe::Result<()>| match r {
            Err(QmoeError::InvalidArgument { reason, .. }) => {
                assert!(
                    reason.contains(&format!("expert {e} is out of range")),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        };
        out_of_range(layer.verified_slab(e).map(|_| ()));
        out_of_range(layer.verify_experts([0, e]));
        assert!(!layer.is_verified(e));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Expert weights that are not floating point are refused by tensor name when quantized.
#[test]
fn integer_expert_weights_are_not_quantized() {
    use candle_qmoe::pack::{DenseExpert, ExpertLayout, ExpertNames, ScaleSearch};
    let dev = Device::Cpu;
    let (h, i) = (64, 32);
    let expert = |dtype| DenseExpert {
        gate: Tensor::ones((i, h), dtype, &dev).unwrap(),
        up: Tensor::ones((i, h), dtype, &dev).unwrap(),
        down: Tensor::ones((h, i), dtype, &dev).unwrap(),
    };
    let layout = ExpertLayout {
        hidden: h,
        intermediate: i,
        group_size: GroupSize::new(32).unwrap(),
    };
    let r = LayerPack::quantize(
        "block",
        ExpertNames::PROJ,
        &[expert(DType::F32), expert(DType::U32)],
        layout,
        ScaleSearch::Mse,
    );
    match r {
        Err(QmoeError::InvalidArgument { argument, reason }) => {
            assert!(
                argument.contains("block.experts.1.gate_proj.weight"),
                "{argument}"
            );
            assert!(reason.contains("U32"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}
