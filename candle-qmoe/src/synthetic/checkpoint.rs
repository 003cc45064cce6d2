//! A synthetic model written as a Hugging Face checkpoint folder: `config.json`,
//! `generation_config.json`, BF16 safetensors (one `model.safetensors`, or shards
//! `model-0000N-of-0000M.safetensors` with the index `model.safetensors.index.json`) and the
//! tokenizer files the caller provides, with the tensor names transformers, llama.cpp's
//! converter and this crate's loaders read (for the routed experts the family's
//! [`MoeNames`], e.g. `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`).
//!
//! The weights are exactly those of [`SyntheticModel`] of the same kind and seed (every one of
//! them is a BF16 value): the non-expert tensors, and the experts of its INT4 pack at the default
//! group size (128) dequantized. Quantizing the folder at group size 128 gives back that pack
//! (up to the rare group, p ≈ 10⁻⁸, that holds no ±7 level).
//!
//! Tensors are generated a batch (about 128 MB) at a time in parallel while a writer thread
//! streams the previous batch into the shards ([`SafetensorsWriter`]), so writing a model of any
//! size holds under 1 GiB (909 MiB at OLMoE-1B-7B; docs/architecture.md §10).
//!
//! [`SyntheticModel`]: super::SyntheticModel

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::Dtype;

use super::{
    experts_seed, level_pair_table, non_expert_tensors, random_expert_slab, NonExpert,
    SyntheticKind,
};
use crate::models::checkpoint::{decoder_layer_of, INDEX_FILE, SINGLE_FILE};
use crate::models::MoeNames;
use crate::pack::{ExpertLayout, GroupSize, SlabView};
use crate::safetensors_writer::{SafetensorsWriter, TensorSpec};
use crate::QmoeError;

/// Hugging Face's default largest shard (`max_shard_size="5GB"`).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The token embeddings, stored first.
const EMBEDDINGS: &str = "model.embed_tokens.weight";

/// Bytes of tensors generated at once (in parallel) before they are written.
const BATCH_BYTES: u64 = 128 << 20;

/// What [`SyntheticCheckpoint::write`] wrote.
#[derive(Clone, Debug)]
pub struct WrittenCheckpoint {
    /// The safetensors files, in order.
    pub shards: Vec<PathBuf>,
    /// Bytes of tensor data (the index's `total_size`).
    pub tensor_bytes: u64,
    /// Number of tensors.
    pub tensors: usize,
}

/// A synthetic model to write as a checkpoint folder (see the module docs).
#[derive(Clone, Debug)]
pub struct SyntheticCheckpoint {
    /// The shape.
    pub kind: SyntheticKind,
    /// The seed of the weights (as in [`super::SyntheticModel::new`]).
    pub seed: u64,
    /// Largest shard: tensors go to the next shard rather than make one larger (a single
    /// tensor larger than this gets a shard of its own).
    pub max_shard_bytes: u64,
}

/// One unit of generation: a non-expert tensor, or a routed expert's three tensors.
enum Piece {
    Tensor(NonExpert),
    Expert { layer: usize, expert: usize },
}

/// Everything the writer needs to know about the model.
struct Plan {
    layout: ExpertLayout,
    names: MoeNames,
    pieces: Vec<Piece>,
}

impl Plan {
    fn new(kind: SyntheticKind) -> crate::Result<Self> {
        let spec = kind.spec()?;
        let moe = spec.uniform_moe()?.clone();
        let layout = ExpertLayout {
            hidden: spec.hidden_size,
            intermediate: moe.intermediate_size,
            group_size: GroupSize::default(),
        };
        let mut pieces: Vec<Piece> = non_expert_tensors(&spec)
            .into_iter()
            .map(Piece::Tensor)
            .collect();
        for layer in spec.moe_layers() {
            pieces.extend((0..moe.num_experts).map(|expert| Piece::Expert { layer, expert }));
        }
        // As a checkpoint stores them: the embeddings, each decoder layer's tensors followed by
        // its experts, then the final norm and the head (the sort is stable).
        pieces.sort_by_key(|p| match p {
            Piece::Tensor(t) => match decoder_layer_of(&t.name) {
                Some(layer) => layer + 1,
                None if t.name == EMBEDDINGS => 0,
                None => usize::MAX,
            },
            Piece::Expert { layer, .. } => layer + 1,
        });
        Ok(Self {
            layout,
            names: moe.names,
            pieces,
        })
    }

    /// The tensors of `piece`: name, shape.
    fn tensors(&self, piece: &Piece) -> Vec<TensorSpec> {
        let bf16 = |name: String, shape: Vec<usize>| TensorSpec::new(name, Dtype::BF16, shape);
        match piece {
            Piece::Tensor(t) => vec![bf16(t.name.clone(), t.shape.clone())],
            Piece::Expert { layer, expert } => {
                let (h, i) = (self.layout.hidden, self.layout.intermediate);
                let [gate, up, down] = self.names.expert_weights(*layer, *expert);
                vec![
                    bf16(gate, vec![i, h]),
                    bf16(up, vec![i, h]),
                    bf16(down, vec![h, i]),
                ]
            }
        }
    }

    fn bytes(&self, piece: &Piece) -> u64 {
        self.tensors(piece)
            .iter()
            .map(|t| t.byte_len() as u64)
            .sum()
    }

    /// The BF16 bytes of `piece`'s tensors for `seed`, in [`Self::tensors`]' order (the values
    /// are BF16 values already, so the conversion is exact).
    fn bf16_bytes(&self, piece: &Piece, seed: u64, pairs: &[u8]) -> Vec<Vec<u8>> {
        self.values(piece, seed, pairs)
            .into_iter()
            .map(|v| {
                let mut bytes = vec![0u8; 2 * v.len()];
                bytes
                    .par_chunks_mut(2)
                    .zip(&v)
                    .for_each(|(b, x)| b.copy_from_slice(&half::bf16::from_f32(*x).to_le_bytes()));
                bytes
            })
            .collect()
    }

    /// The values of `piece`'s tensors for `seed`, in [`Self::tensors`]' order.
    fn values(&self, piece: &Piece, seed: u64, pairs: &[u8]) -> Vec<Vec<f32>> {
        match piece {
            Piece::Tensor(t) => vec![t.values(seed)],
            Piece::Expert { layer, expert } => {
                let mut slab = vec![0u8; self.layout.slab_bytes()];
                let s = experts_seed(seed, *layer);
                random_expert_slab(s, self.layout, *expert, pairs, &mut slab);
                let view = SlabView {
                    layout: self.layout,
                    bytes: &slab,
                };
                let (gate, up, down) = view.dequantize();
                vec![gate, up, down]
            }
        }
    }
}

/// Maps an I/O error while writing `path` to [`QmoeError::Write`] naming it.
fn write_error(path: &Path) -> impl FnOnce(std::io::Error) -> QmoeError {
    let path = path.to_path_buf();
    move |error| QmoeError::Write { path, error }
}

impl SyntheticCheckpoint {
    /// `kind` with weights from `seed`, in shards of at most [`DEFAULT_MAX_SHARD_BYTES`].
    pub fn new(kind: SyntheticKind, seed: u64) -> Self {
        Self {
            kind,
            seed,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        }
    }

    /// Writes the folder `dir` (created if needed; it must not hold files already), with
    /// `extra_files` (name, contents) such as `tokenizer.json` next to the weights.
    /// `on_progress(written, total)` is called with the tensor bytes written so far. On an
    /// error (e.g. a full disk) the files written so far are removed.
    pub fn write(
        &self,
        dir: &Path,
        extra_files: &[(&str, &[u8])],
        on_progress: &(dyn Fn(u64, u64) + Sync),
    ) -> crate::Result<WrittenCheckpoint> {
        std::fs::create_dir_all(dir).map_err(write_error(dir))?;
        let mut entries = std::fs::read_dir(dir).map_err(|error| QmoeError::Io {
            path: dir.to_path_buf(),
            error,
        })?;
        if entries.next().is_some() {
            return Err(QmoeError::InvalidArgument {
                argument: "checkpoint folder".into(),
                reason: format!("`{}` is not empty", dir.display()),
            });
        }
        let plan = Plan::new(self.kind)?;
        let shards = self.shards(&plan);
        let names: Vec<String> = match shards.len() {
            1 => vec![SINGLE_FILE.to_string()],
            n => (1..=n)
                .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
                .collect(),
        };
        let written = self.write_files(dir, &plan, &shards, &names, extra_files, on_progress);
        if written.is_err() {
            // The folder was empty: remove what was written, so no partial checkpoint is left
            // (an unfinished shard never appears under its name).
            let ours = [INDEX_FILE, "config.json", "generation_config.json"];
            let ours = names.iter().map(String::as_str).chain(ours);
            for name in ours.chain(extra_files.iter().map(|(n, _)| *n)) {
                let _ = std::fs::remove_file(dir.join(name));
            }
        }
        written
    }

    /// The body of [`Self::write`], into the empty folder `dir`.
    fn write_files(
        &self,
        dir: &Path,
        plan: &Plan,
        shards: &[Vec<&Piece>],
        names: &[String],
        extra_files: &[(&str, &[u8])],
        on_progress: &(dyn Fn(u64, u64) + Sync),
    ) -> crate::Result<WrittenCheckpoint> {
        let total: u64 = plan.pieces.iter().map(|p| plan.bytes(p)).sum();
        let mut weight_map = serde_json::Map::new();
        for (pieces, name) in shards.iter().zip(names) {
            for t in pieces.iter().flat_map(|p| plan.tensors(p)) {
                weight_map.insert(t.name, name.as_str().into());
            }
        }
        let count = weight_map.len();
        // Batches are generated in parallel on this thread while a writer thread streams the
        // previous one into the shards (one batch in flight between them).
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Vec<Vec<u8>>>>(1);
        let pairs = level_pair_table();
        let batch_bytes = |p: &Piece| plan.bytes(p);
        let paths = std::thread::scope(|scope| {
            let writer = scope.spawn(move || -> crate::Result<Vec<PathBuf>> {
                let mut written = 0;
                let mut paths = Vec::new();
                for (pieces, name) in shards.iter().zip(names) {
                    let specs = pieces.iter().flat_map(|p| plan.tensors(p)).collect();
                    let metadata = [("format".to_string(), "pt".to_string())].into();
                    let mut out =
                        SafetensorsWriter::create(&dir.join(name), Some(metadata), specs)?;
                    for batch in batches(pieces, batch_bytes) {
                        let bytes = rx
                            .recv()
                            .expect("the generator sends every batch while this thread runs");
                        for (piece, tensors) in batch.iter().zip(bytes) {
                            for (t, b) in plan.tensors(piece).iter().zip(tensors) {
                                out.write(&t.name, &b)?;
                            }
                            written += plan.bytes(piece);
                            on_progress(written, total);
                        }
                    }
                    paths.push(out.finish()?);
                }
                Ok(paths)
            });
            for batch in shards
                .iter()
                .flat_map(|pieces| batches(pieces, batch_bytes))
            {
                let bytes = batch
                    .par_iter()
                    .map(|p| plan.bf16_bytes(p, self.seed, &pairs))
                    .collect();
                if tx.send(bytes).is_err() {
                    break; // The writer failed: its error is returned below.
                }
            }
            writer.join().expect("the writer thread does not panic")
        })?;
        let json = |path: PathBuf, value: serde_json::Value| {
            let text = serde_json::to_string_pretty(&value).expect("JSON values serialize");
            std::fs::write(&path, text + "\n").map_err(write_error(&path))
        };
        if paths.len() > 1 {
            let index = serde_json::json!({
                "metadata": { "total_size": total },
                "weight_map": weight_map,
            });
            json(dir.join(INDEX_FILE), index)?;
        }
        let mut config = self.kind.config_json();
        config["torch_dtype"] = "bfloat16".into();
        json(dir.join("config.json"), config.clone())?;
        json(
            dir.join("generation_config.json"),
            generation_config(&config),
        )?;
        for (name, bytes) in extra_files {
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(write_error(&path))?;
        }
        Ok(WrittenCheckpoint {
            shards: paths,
            tensor_bytes: total,
            tensors: count,
        })
    }

    /// The pieces of each shard, in order.
    fn shards<'a>(&self, plan: &'a Plan) -> Vec<Vec<&'a Piece>> {
        let mut shards: Vec<Vec<&Piece>> = vec![Vec::new()];
        let mut bytes = 0;
        for piece in &plan.pieces {
            let n = plan.bytes(piece);
            let last = shards.last_mut().expect("at least one shard");
            if !last.is_empty() && bytes + n > self.max_shard_bytes {
                shards.push(vec![piece]);
                bytes = n;
            } else {
                last.push(piece);
                bytes += n;
            }
        }
        shards
    }
}

/// Consecutive runs of `pieces` of about [`BATCH_BYTES`] each (at least one piece per run).
fn batches<'a>(pieces: &'a [&'a Piece], bytes: impl Fn(&Piece) -> u64) -> Vec<&'a [&'a Piece]> {
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0);
    for (k, p) in pieces.iter().enumerate() {
        sum += bytes(p);
        if sum >= BATCH_BYTES {
            out.push(&pieces[start..=k]);
            (start, sum) = (k + 1, 0);
        }
    }
    if start < pieces.len() {
        out.push(&pieces[start..]);
    }
    out
}

/// `generation_config.json` of a model config: its special token ids.
fn generation_config(config: &serde_json::Value) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = config.get(key).filter(|v| !v.is_null()) {
            out.insert(key.into(), v.clone());
        }
    }
    out.into()
}
