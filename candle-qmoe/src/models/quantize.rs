//! Packing a checkpoint's routed experts into INT4, layer by layer from the memory-mapped
//! safetensors: into a pack held in memory ([`quantize_checkpoint`]) or straight into a `.qmoe`
//! file ([`quantize_checkpoint_to_file`]), which holds one layer at a time whatever the model's
//! size.
//!
//! Each layer's experts are read as stored (BF16, F16 or F32), converted to F32 one expert per
//! thread and quantized in parallel into the layer's slabs; the pages of an expert's tensors are
//! handed back to the system as soon as it is read ([`CheckpointTensors::release`]), so the
//! resident memory stays at about one layer of slabs plus the experts in flight
//! (docs/architecture.md §2).

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::checkpoint::{checkpoint_files, fingerprint, CheckpointTensors, INDEX_FILE};
use super::config::{ExpertTensor, ModelConfig, MoeSpec};
use super::AnyConfig;
use crate::pack::{
    ExpertLayout, ExpertWeights, GroupSize, LayerPack, PackFile, PackMeta, PackWriter, ScaleSearch,
};
use crate::QmoeError;

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

/// A checkpoint opened for quantization: its tensors, the pack's header, the MoE layers.
struct Quantizer {
    tensors: CheckpointTensors,
    meta: PackMeta,
    moe: MoeSpec,
    layers: Vec<usize>,
}

impl Quantizer {
    fn open(dir: &Path, opts: &QuantizeOptions) -> crate::Result<Self> {
        let spec = AnyConfig::from_file(dir.join("config.json"))?.spec()?;
        let moe = spec.uniform_moe()?.clone();
        let layout = ExpertLayout {
            hidden: spec.hidden_size,
            intermediate: moe.intermediate_size,
            group_size: opts.group_size,
        };
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
            fingerprint: fingerprint(dir)?,
        };
        Ok(Self {
            // SAFETY: the maps live only during quantization, and the caller does not modify
            // the checkpoint meanwhile (the crate docs, "Memory-mapped files").
            tensors: unsafe { CheckpointTensors::open(dir)? },
            meta,
            moe,
            layers: spec.moe_layers(),
        })
    }

    /// Experts in all MoE layers.
    fn total_experts(&self) -> usize {
        self.layers.len() * self.moe.num_experts
    }

    /// Quantizes MoE layer `layer`, calling `tick` after each expert; the pages of each expert's
    /// tensors are released as soon as it is read.
    fn layer(&self, layer: usize, tick: &(dyn Fn() + Sync)) -> crate::Result<LayerPack> {
        let l = self.meta.layout;
        let moe_names = self.moe.names;
        let tensors: Vec<[ExpertTensor; 3]> = (0..self.moe.num_experts)
            .map(|e| self.moe.expert_tensors(layer, e, l.hidden))
            .collect();
        // Every expert's tensors exist before the layer's memory is taken (header lookups, no
        // data read): a config naming more experts than the checkpoint holds is refused by name,
        // looked up from the last expert so the name shows the count the config claims.
        for t in tensors.iter().rev().flatten() {
            self.tensors.get(&t.name)?;
        }
        // Fused experts share their tensors: each name once.
        let mut names: Vec<&str> = tensors.iter().flatten().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        self.tensors.prefetch(names);
        let read = |e: usize, w: &mut ExpertWeights| {
            let [gate, up, down] = &tensors[e];
            self.tensors.read_expert_f32(gate, &mut w.gate)?;
            self.tensors.read_expert_f32(up, &mut w.up)?;
            self.tensors.read_expert_f32(down, &mut w.down)?;
            for t in &tensors[e] {
                self.tensors.release_expert(t);
            }
            Ok(())
        };
        let block = moe_names.block_prefix(layer);
        let names = |e: usize| tensors[e].each_ref().map(ExpertTensor::to_string);
        let (num, search) = (self.moe.num_experts, self.meta.scale_search);
        LayerPack::quantize_with(&block, num, l, search, &names, read, tick)
    }
}

/// A progress tick for `on_progress(done, total)` over every (layer, expert).
fn ticker<'a>(
    total: usize,
    done: &'a AtomicUsize,
    on_progress: &'a (dyn Fn(usize, usize) + Sync),
) -> impl Fn() + Sync + 'a {
    move || on_progress(done.fetch_add(1, Ordering::Relaxed) + 1, total)
}

/// Quantizes every MoE layer's routed experts of the checkpoint in `dir` to INT4 and returns the
/// pack in memory (write it with [`PackFile::save`], or use [`quantize_checkpoint_to_file`],
/// which never holds more than one layer). `on_progress(done, total)` is called after each
/// (layer, expert).
pub fn quantize_checkpoint(
    dir: impl AsRef<Path>,
    opts: &QuantizeOptions,
    on_progress: &(dyn Fn(usize, usize) + Sync),
) -> crate::Result<PackFile> {
    let q = Quantizer::open(dir.as_ref(), opts)?;
    let done = AtomicUsize::new(0);
    let tick = ticker(q.total_experts(), &done, on_progress);
    let packs = q
        .layers
        .iter()
        .map(|&i| Ok((i, q.layer(i, &tick)?)))
        .collect::<crate::Result<Vec<_>>>()?;
    PackFile::from_layers(q.meta, packs)
}

/// Quantizes the checkpoint in `dir` like [`quantize_checkpoint`] but writes each layer to the
/// `.qmoe` file at `path` as soon as it is packed (see [`PackWriter`]), so only one layer of
/// slabs is ever held in memory; returns the header written. The file appears under its name
/// only once complete.
pub fn quantize_checkpoint_to_file(
    dir: impl AsRef<Path>,
    path: &Path,
    opts: &QuantizeOptions,
    on_progress: &(dyn Fn(usize, usize) + Sync),
) -> crate::Result<PackMeta> {
    refuse_overwriting_source(dir.as_ref(), path)?;
    let q = Quantizer::open(dir.as_ref(), opts)?;
    let done = AtomicUsize::new(0);
    let tick = ticker(q.total_experts(), &done, on_progress);
    PackWriter::write_streamed(path, &q.meta, &q.layers, |i| q.layer(i, &tick))?;
    Ok(q.meta)
}

/// Refuses a pack `path` that is one of the files the checkpoint in `dir` is read from (a
/// shard, the shard index or `config.json`): the pack would replace it while it is read.
fn refuse_overwriting_source(dir: &Path, path: &Path) -> crate::Result<()> {
    let Ok(out) = path.canonicalize() else {
        return Ok(()); // not there yet: nothing to overwrite
    };
    let mut sources = checkpoint_files(dir)?;
    sources.extend([dir.join("config.json"), dir.join(INDEX_FILE)]);
    if sources
        .iter()
        .any(|s| s.canonicalize().is_ok_and(|s| s == out))
    {
        return Err(QmoeError::InvalidArgument {
            argument: "pack path".into(),
            reason: format!(
                "`{}` is a file of the checkpoint being quantized; write the pack elsewhere",
                path.display()
            ),
        });
    }
    Ok(())
}
