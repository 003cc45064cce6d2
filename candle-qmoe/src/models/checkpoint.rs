//! Hugging Face checkpoint folders: finding the weight files (single file or sharded), the
//! checkpoint's fingerprint, and packing its routed experts into a [`PackFile`].

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::config::ModelConfig;
use super::AnyConfig;
use crate::pack::file::checkpoint_fingerprint;
use crate::pack::{ExpertLayout, GroupSize, LayerPack, PackFile, PackMeta, ScaleSearch};
use crate::{QmoeError, SparseMoe};

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors files of the checkpoint in `dir`: `model.safetensors`, or else every shard
/// named in `model.safetensors.index.json`'s `weight_map` (sorted, each once). A missing file is an
/// error that names it.
pub fn checkpoint_files(dir: impl AsRef<Path>) -> crate::Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let invalid = |reason: String| QmoeError::InvalidCheckpoint {
        dir: dir.to_path_buf(),
        reason,
    };
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join(INDEX_FILE);
    if !index.is_file() {
        return Err(invalid(format!("no {SINGLE_FILE} or {INDEX_FILE}")));
    }
    let bad_index = |reason: String| QmoeError::InvalidFile {
        file: format!("`{}`", index.display()),
        reason,
    };
    let text = std::fs::read_to_string(&index).map_err(|source| QmoeError::Io {
        path: index.clone(),
        source,
    })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad_index(format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad_index("no `weight_map` object".into()))?;
    let shards: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
    if shards.is_empty() {
        return Err(bad_index("it names no shard files".into()));
    }
    shards
        .into_iter()
        .map(|name| {
            let p = dir.join(name);
            if p.is_file() {
                Ok(p)
            } else {
                Err(invalid(format!(
                    "shard `{}` listed in {INDEX_FILE} is missing",
                    p.display()
                )))
            }
        })
        .collect()
}

/// A VarBuilder over the memory-mapped checkpoint in `dir` (see [`checkpoint_files`]) that
/// converts tensors to `dtype` on `device` as they are read. A damaged safetensors header is an
/// error naming its file; a tensor missing or of another shape or dtype than the model expects
/// is a [`QmoeError::InvalidCheckpoint`] naming the checkpoint folder.
///
/// # Safety
/// The files are memory-mapped: they must not be modified while the VarBuilder or tensors
/// borrowed from it are alive (the same contract as
/// [`VarBuilder::from_mmaped_safetensors`]).
pub unsafe fn mmap_checkpoint(
    dir: impl AsRef<Path>,
    dtype: DType,
    device: &Device,
) -> crate::Result<VarBuilder<'static>> {
    let dir = dir.as_ref();
    let files = checkpoint_files(dir)?;
    let tensors = candle::safetensors::MmapedSafetensors::multi(&files)?;
    let named = NamedCheckpoint {
        tensors,
        dir: dir.to_path_buf(),
    };
    Ok(VarBuilder::from_backend(
        Box::new(named),
        dtype,
        device.clone(),
    ))
}

/// A checkpoint's tensors whose read errors name the checkpoint folder.
struct NamedCheckpoint {
    tensors: candle::safetensors::MmapedSafetensors,
    dir: PathBuf,
}

impl NamedCheckpoint {
    /// A read error as a [`QmoeError::InvalidCheckpoint`] whose reason is Candle's message
    /// (without a backtrace: the new error captures its own).
    fn named<T>(&self, read: candle::Result<T>) -> candle::Result<T> {
        read.map_err(|e| {
            let reason = match e {
                candle::Error::WithBacktrace { inner, .. } => inner.to_string(),
                e => e.to_string(),
            };
            QmoeError::InvalidCheckpoint {
                dir: self.dir.clone(),
                reason,
            }
            .into()
        })
    }
}

impl SimpleBackend for NamedCheckpoint {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle::Result<Tensor> {
        self.named(SimpleBackend::get(
            &self.tensors,
            shape,
            name,
            init,
            dtype,
            device,
        ))
    }

    fn get_unchecked(&self, name: &str, dtype: DType, device: &Device) -> candle::Result<Tensor> {
        self.named(self.tensors.get_unchecked(name, dtype, device))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_tensor(name)
    }
}

/// The name of the router weight of decoder layer `layer`.
pub fn router_weight_name(layer: usize) -> String {
    format!("model.layers.{layer}.mlp.gate.weight")
}

/// The fingerprint a `.qmoe` pack records of its source (see
/// [`crate::pack::file::checkpoint_fingerprint`]): `config.json`'s bytes and the raw stored bytes of
/// every MoE layer's router weight, so a pack is tied to this checkpoint and no other.
pub fn fingerprint(dir: impl AsRef<Path>) -> crate::Result<String> {
    let dir = dir.as_ref();
    let config_path = dir.join("config.json");
    let config = super::read_config_text(&config_path)?;
    let spec = AnyConfig::from_json_str(&config)?.spec()?;
    let files = checkpoint_files(dir)?;
    // SAFETY: read-only maps, dropped before returning; the same contract as `mmap_checkpoint`.
    let st = unsafe { candle::safetensors::MmapedSafetensors::multi(&files)? };
    let routers = spec
        .moe_layers()
        .into_iter()
        .map(|i| {
            let name = router_weight_name(i);
            st.get(&name).map_err(|_| QmoeError::InvalidCheckpoint {
                dir: dir.to_path_buf(),
                reason: format!("no tensor `{name}`"),
            })
        })
        .collect::<crate::Result<Vec<_>>>()?;
    Ok(checkpoint_fingerprint(
        config.as_bytes(),
        routers.iter().map(|v| v.data()),
    ))
}

/// How [`quantize_checkpoint`] packs the experts, and the source it records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizeOptions {
    /// Columns per FP16 scale.
    pub group_size: GroupSize,
    /// How scales are chosen.
    pub search: ScaleSearch,
    /// Source model id recorded in the pack (empty: the folder's path).
    pub source_model: String,
    /// Source revision recorded in the pack (hub commit, or `local`).
    pub source_revision: String,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        Self {
            group_size: GroupSize::default(),
            search: ScaleSearch::default(),
            source_model: String::new(),
            source_revision: "local".into(),
        }
    }
}

/// Quantizes every MoE layer's routed experts of the checkpoint in `dir` to INT4 and returns the
/// pack in memory (write it with [`PackFile::save`]).
///
/// Experts are read one at a time from the memory-mapped checkpoint (in F32, whatever the stored
/// dtype) and quantized in parallel, so only the packed bytes and the experts being quantized are
/// held in memory. `on_progress(done, total)` is called after each (layer, expert).
pub fn quantize_checkpoint(
    dir: impl AsRef<Path>,
    opts: &QuantizeOptions,
    on_progress: &(dyn Fn(usize, usize) + Sync),
) -> crate::Result<PackFile> {
    let dir = dir.as_ref();
    let spec = AnyConfig::from_file(dir.join("config.json"))?.spec()?;
    let moe = spec.uniform_moe()?.clone();
    let fingerprint = fingerprint(dir)?;
    let layout = ExpertLayout {
        hidden: spec.hidden_size,
        intermediate: moe.intermediate_size,
        group_size: opts.group_size,
    };
    // SAFETY: see `mmap_checkpoint`; the maps live only during quantization.
    let vb = unsafe { mmap_checkpoint(dir, DType::F32, &Device::Cpu)? };
    let layers = spec.moe_layers();
    let total = layers.len() * moe.num_experts;
    let done = AtomicUsize::new(0);
    let tick = || on_progress(done.fetch_add(1, Ordering::Relaxed) + 1, total);
    let packs = layers
        .into_iter()
        .map(|i| {
            let vb = vb.pp(format!("model.layers.{i}.mlp"));
            let load =
                |e| SparseMoe::load_dense_expert(layout.hidden, layout.intermediate, e, vb.clone());
            let pack = LayerPack::quantize_with(
                &vb.prefix(),
                moe.num_experts,
                layout,
                opts.search,
                load,
                &tick,
            )?;
            Ok((i, pack))
        })
        .collect::<crate::Result<Vec<_>>>()?;
    let source_model = if opts.source_model.is_empty() {
        dir.display().to_string()
    } else {
        opts.source_model.clone()
    };
    let meta = PackMeta {
        layout,
        num_experts: moe.num_experts,
        scale_search: opts.search,
        source_model,
        source_revision: opts.source_revision.clone(),
        fingerprint,
    };
    PackFile::from_layers(meta, packs)
}
