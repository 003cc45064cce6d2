//! Synthetic models written as Hugging Face checkpoint folders, and the streaming quantizer.
//!
//! A folder written by `SyntheticCheckpoint` loads back through the `--model-dir` path of the
//! examples (config, memory-mapped BF16 shards, quantize → `.qmoe` → model) to exactly the
//! weights of the in-memory `SyntheticModel` — every synthetic weight is a BF16 value, so BF16
//! storage rounds nothing and the logits must be equal, not close. And the streaming quantizer
//! writes, bit for bit, the pack of the in-memory quantizer, of load-time quantization, and of
//! the quantizer before it (commit f1469d1, whose slab checksums are recorded here).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle::{DType, Device, Tensor};
use candle_qmoe::models::{
    self, AnyConfig, ExpertsBackend, ModelConfig, MoeForCausalLm, QuantizeOptions,
};
use candle_qmoe::pack::{ExpertLayout, GroupSize, LayerPack, PackFile, ScaleSearch};
use candle_qmoe::synthetic::checkpoint::SyntheticCheckpoint;
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use candle_qmoe::{QmoeError, SparseMoe};
use candle_qmoe_suite::model::ModelArgs;
use candle_qmoe_suite::testing::fixture_dir;
use candle_qmoe_suite::tokenizer::bundled_tokenizer_files;
use clap::Parser;

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qmoe-ckpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Logits of a fixed prompt at every position, as a flat vector.
fn logits(model: &mut MoeForCausalLm, ids: &[u32]) -> Vec<f32> {
    model.clear_kv_cache();
    let ids = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let out = model.forward_all(&ids, 0).unwrap();
    out.flatten_all().unwrap().to_vec1().unwrap()
}

/// The examples' model flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    model: ModelArgs,
}

impl Cli {
    /// `--cpu --model-dir DIR --pack PACK`.
    fn for_folder(dir: &Path, pack: &Path) -> Self {
        Self::parse_from([
            "test",
            "--cpu",
            "--model-dir",
            dir.to_str().unwrap(),
            "--pack",
            pack.to_str().unwrap(),
        ])
    }
}

#[test]
fn a_synthetic_checkpoint_folder_loads_back_to_the_same_model() {
    let tmp = temp_dir("tiny");
    let dir = tmp.join("tiny-synthetic");
    let seed = 7;
    let tokenizer = bundled_tokenizer_files("olmoe").unwrap();
    let files: Vec<(&str, &[u8])> = tokenizer.iter().map(|(n, b)| (*n, &b[..])).collect();
    let mut writer = SyntheticCheckpoint::new(SyntheticKind::Tiny, seed);
    // Shards of 20 MB: the 53 MiB model takes several, with an index.
    writer.max_shard_bytes = 20_000_000;
    let last = AtomicU64::new(0);
    let written = writer
        .write(&dir, &files, &|done, total| {
            assert!(done > last.swap(done, Ordering::Relaxed) && done <= total);
        })
        .unwrap();
    assert_eq!(last.into_inner(), written.tensor_bytes);
    assert!(written.shards.len() >= 3, "{:?}", written.shards);

    // The index names every tensor of every shard once, and the total size.
    let index = json(&dir.join("model.safetensors.index.json"));
    assert_eq!(index["metadata"]["total_size"], written.tensor_bytes);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), written.tensors);
    let mut bytes = 0;
    for shard in &written.shards {
        let name = shard.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("model-0000") && name.ends_with(".safetensors"));
        let data = std::fs::read(shard).unwrap();
        let st = safetensors::SafeTensors::deserialize(&data).unwrap();
        for (tensor, view) in st.tensors() {
            assert_eq!(map[&tensor], name, "{tensor}");
            assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{tensor}");
            bytes += view.data().len() as u64;
        }
        let (_, header) = safetensors::SafeTensors::read_metadata(&data).unwrap();
        assert_eq!(header.metadata().as_ref().unwrap()["format"], "pt");
    }
    assert_eq!(bytes, written.tensor_bytes);
    assert!(map.contains_key("model.layers.1.mlp.experts.7.down_proj.weight"));
    let config = json(&dir.join("config.json"));
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert_eq!(config["architectures"][0], "OlmoeForCausalLM");
    assert_eq!(
        json(&dir.join("generation_config.json"))["eos_token_id"],
        50279
    );
    assert_eq!(
        json(&dir.join("tokenizer_config.json"))["tokenizer_class"],
        "GPTNeoXTokenizer"
    );
    // A failed write (here: an extra file in a folder that does not exist) leaves nothing.
    let failed = tmp.join("failed");
    let bad = [("no-such-folder/x.json", &b"{}"[..])];
    let e = writer.write(&failed, &bad, &|_, _| {}).unwrap_err();
    assert!(
        matches!(&e, QmoeError::Write { path, .. } if path.ends_with("no-such-folder/x.json")),
        "{e}"
    );
    assert_eq!(std::fs::read_dir(&failed).unwrap().count(), 0);
    // A folder that is not empty is never written into.
    let again = writer.write(&dir, &files, &|_, _| {}).unwrap_err();
    assert!(
        matches!(&again, QmoeError::InvalidArgument { reason, .. } if reason.contains("not empty")),
        "{again}"
    );

    // The `--model-dir` path of the examples: the pack is created from the folder (streaming),
    // then the model is built from the mapped shards and the pack, with the folder's tokenizer.
    let pack_path = tmp.join("tiny.qmoe");
    let cli = Cli::for_folder(&dir, &pack_path);
    let mut loaded = cli.model.load(DType::F32, &Device::Cpu).unwrap();
    let ids = loaded
        .encode("Mixture of experts, one layer at a time.", None)
        .unwrap();
    assert!(ids.len() > 5);

    // The folder's experts are the synthetic pack's slabs dequantized, so quantizing them again
    // at the same group size gives that pack back; and the non-expert weights are equal.
    let synth = SyntheticModel::new(SyntheticKind::Tiny, seed, GroupSize::default()).unwrap();
    let pack = PackFile::open(&pack_path).unwrap();
    for i in synth.pack().layer_indices() {
        assert_eq!(
            pack.layer(i).unwrap().bytes(),
            synth.pack().layer(i).unwrap().bytes(),
            "layer {i}"
        );
    }
    let mut reference = synth
        .load(DType::F32, &Device::Cpu, &synth.int4_experts())
        .unwrap();
    assert_eq!(
        logits(&mut loaded.model, &ids),
        logits(&mut reference, &ids)
    );

    // Dense experts read from the BF16 shards equal the dequantized synthetic experts.
    let cfg = AnyConfig::from_file(dir.join("config.json")).unwrap();
    // SAFETY: the folder is not modified while the model is alive.
    let vb = unsafe { models::mmap_checkpoint(&dir, DType::F32, &Device::Cpu).unwrap() };
    let mut dense = MoeForCausalLm::new(&cfg, vb, &ExpertsBackend::Dense).unwrap();
    let mut dense_ref = synth
        .load(DType::F32, &Device::Cpu, &synth.dense_experts(DType::F32))
        .unwrap();
    assert_eq!(logits(&mut dense, &ids), logits(&mut dense_ref, &ids));

    // The EOS ids come from config.json and generation_config.json; a generation config that is
    // not JSON, or an id that is not a token id of the model's vocabulary, is refused naming the
    // file (ignored, replies would run to --sample-len), before the experts are quantized.
    let eos = json(&dir.join("generation_config.json"))["eos_token_id"].as_u64();
    assert_eq!(loaded.eos.first().map(|&id| id as u64), eos);
    let generation_config = dir.join("generation_config.json");
    for (text, says) in [
        (r#"{"eos_token_id": 1,"#, "is not valid JSON"),
        (
            r#"{"eos_token_id": "</s>"}"#,
            r#"eos_token_id "</s>" is not a token id"#,
        ),
        (
            r#"{"eos_token_id": [1, -2]}"#,
            "eos_token_id -2 is not a token id",
        ),
        (
            r#"{"eos_token_id": [1, 4000000]}"#,
            "eos_token_id 4000000 is beyond the model's vocabulary (vocab_size",
        ),
    ] {
        std::fs::write(&generation_config, text).unwrap();
        // Refused before the experts are quantized: no new pack is written.
        let new_pack = tmp.join("not-written.qmoe");
        let cli = Cli::for_folder(&dir, &new_pack);
        let e = cli.model.load(DType::F32, &Device::Cpu).err().unwrap();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("generation_config.json") && msg.contains(says),
            "{text}: {msg}"
        );
        assert!(!new_pack.exists(), "{text}: the pack was written first");
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// The slab checksums of the fixtures' packs as the quantizer of commit f1469d1 wrote them
/// (`quantize --model-dir tests/fixtures/<fixture> --group-size G --scale-search S`), layer by
/// layer.
const PREVIOUS_QUANTIZER: [(&str, usize, ScaleSearch, [[u32; 8]; 2]); 3] = [
    (
        "olmoe-tiny",
        128,
        ScaleSearch::Mse,
        [
            [
                0x794adc8c, 0xf719e43a, 0xdfaa3f58, 0xea3bf21d, 0x8440d2ea, 0xaaf04462, 0xb7b77414,
                0x6cbad20f,
            ],
            [
                0x8d4a4e2f, 0x571b3d03, 0x261a57ce, 0x8e6d1932, 0x2dc1e28c, 0xc82b8dbb, 0x1fdb48c4,
                0xcd2d1c92,
            ],
        ],
    ),
    (
        "qwen2moe-tiny",
        32,
        ScaleSearch::Mse,
        [
            [
                0xc019de8b, 0x2b5ef308, 0x2d87e7c4, 0xd3da7eb5, 0x7c4c8d5d, 0xd53e3907, 0x5585f37c,
                0x84b080b0,
            ],
            [
                0xe24c9433, 0xe5326c9d, 0x391a0871, 0x113f294b, 0xb353a416, 0xa5f01293, 0x9c10fce3,
                0x637fc4d3,
            ],
        ],
    ),
    (
        "olmoe-tiny",
        32,
        ScaleSearch::Rtn,
        [
            [
                0x30f0d886, 0x4a53ff76, 0x8adad317, 0x1e28f853, 0x16130ff6, 0xa5acba0e, 0xa60a356b,
                0xa9789233,
            ],
            [
                0x4632c2b8, 0x3a3d2296, 0x3464fb47, 0x408c3196, 0x0023ce5f, 0x4b6bbc76, 0x14dd0ba1,
                0x33019c64,
            ],
        ],
    ),
];

#[test]
fn the_streaming_quantizer_writes_the_packs_of_the_other_quantizers() {
    let tmp = temp_dir("stream");
    for (fixture, group, search, previous) in PREVIOUS_QUANTIZER {
        let dir = fixture_dir(fixture);
        let opts = QuantizeOptions {
            group_size: GroupSize::new(group).unwrap(),
            search,
            source_model: "test/fixture".into(),
            source_revision: "r1".into(),
        };
        let path = tmp.join(format!("{fixture}-{group}.qmoe"));
        let meta = models::quantize_checkpoint_to_file(&dir, &path, &opts, &|_, _| {}).unwrap();
        let streamed = PackFile::open(&path).unwrap();
        streamed.verify().unwrap();
        let in_memory = models::quantize_checkpoint(&dir, &opts, &|_, _| {}).unwrap();
        assert_eq!((streamed.meta(), in_memory.meta()), (&meta, &meta));
        let spec = AnyConfig::from_file(dir.join("config.json"))
            .unwrap()
            .spec()
            .unwrap();
        let moe = spec.uniform_moe().unwrap();
        let layout = ExpertLayout {
            hidden: spec.hidden_size,
            intermediate: moe.intermediate_size,
            group_size: opts.group_size,
        };
        // SAFETY: the fixture is not modified while mapped.
        let vb = unsafe { models::mmap_checkpoint(&dir, DType::F32, &Device::Cpu).unwrap() };
        for (k, i) in spec.moe_layers().into_iter().enumerate() {
            let layer = streamed.layer(i).unwrap();
            assert_eq!(layer.bytes(), in_memory.layer(i).unwrap().bytes());
            // Load-time quantization reads the experts through Candle instead.
            let vb = vb.pp(moe.names.block_prefix(i));
            let (h, n, names) = (layout.hidden, moe.num_experts, moe.names.experts);
            let dense =
                SparseMoe::load_dense_experts(h, layout.intermediate, n, names, vb).unwrap();
            let at_load = LayerPack::quantize("l", names, &dense, layout, search).unwrap();
            assert_eq!(layer.bytes(), at_load.bytes());
            assert_eq!(
                layer.checksums(),
                previous[k],
                "{fixture} g{group} {search:?} layer {i}"
            );
        }
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}
