//! Hugging Face checkpoint folders: finding the weight files (single file or sharded), reading
//! their tensors (through a Candle `VarBuilder`, or raw with [`CheckpointTensors`]) and the
//! checkpoint's fingerprint.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use safetensors::Dtype;

use super::config::{ExpertTensor, ModelConfig, ModelSpec};
use super::AnyConfig;
use crate::error::message_without_backtrace;
use crate::pack::file::checkpoint_fingerprint;
use crate::QmoeError;

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors files of the checkpoint in `dir`: `model.safetensors`, or else every shard
/// named in `model.safetensors.index.json`'s `weight_map` (sorted, each once). A missing file, or
/// a shard named by a path that leaves the folder, is an error that names it.
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
    let text = std::fs::read_to_string(&index).map_err(|error| QmoeError::Io {
        path: index.clone(),
        error,
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
            if !is_shard_file_name(name) {
                return Err(bad_index(format!(
                    "shard `{name}` is not a file name inside the checkpoint folder"
                )));
            }
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

/// Whether `name`, a shard named in a checkpoint index's `weight_map`, is a plain file name of
/// the checkpoint folder: not absolute, no `..`, no subfolder (a path that could lead out of it).
pub fn is_shard_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(_)), None)
    )
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
    /// Refuses a stored tensor that is not floating point (an integer or boolean tensor would
    /// be converted to the compute dtype as numbers and silently used as weights); a missing
    /// one is left to the read, which names it.
    fn check_float(&self, name: &str) -> candle::Result<()> {
        let Ok(view) = self.tensors.get(name) else {
            return Ok(());
        };
        match view.dtype() {
            Dtype::F64 | Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok(()),
            other => Err(QmoeError::InvalidCheckpoint {
                dir: self.dir.clone(),
                reason: format!(
                    "tensor `{name}` is stored as {other:?}; weights must be F64, F32, BF16 \
                     or F16 (8-bit float and integer checkpoints are not supported)"
                ),
            }
            .into()),
        }
    }

    /// A read error as a [`QmoeError::InvalidCheckpoint`] whose reason is Candle's message
    /// (without a backtrace: the new error captures its own).
    fn named<T>(&self, read: candle::Result<T>) -> candle::Result<T> {
        read.map_err(|e| {
            QmoeError::InvalidCheckpoint {
                dir: self.dir.clone(),
                reason: message_without_backtrace(&e),
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
        self.check_float(name)?;
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
        self.check_float(name)?;
        self.named(self.tensors.get_unchecked(name, dtype, device))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_tensor(name)
    }
}

/// The fingerprint a `.qmoe` pack records of its source (see
/// [`crate::pack::file::checkpoint_fingerprint`]): `config.json`'s bytes and the raw stored bytes of
/// every MoE layer's router weight, then `+` and a digest of a sample of the expert weights
/// ([`EXPERT_SAMPLE_BYTES`] from the middle of the gate, up and down weights of
/// [`SAMPLED_EXPERTS`] experts spread over each MoE layer, the first and the last among them),
/// so a pack is tied to this checkpoint and no other, and a checkpoint whose experts were
/// re-trained or replaced in place (same config, same routers) no longer matches the pack made
/// before. A sample, not every byte:
/// an edit of a few weights can go unseen; `quantize` again after changing experts.
pub fn fingerprint(dir: impl AsRef<Path>) -> crate::Result<String> {
    let dir = dir.as_ref();
    let config_path = dir.join("config.json");
    let config = super::read_config_text(&config_path)?;
    let spec = AnyConfig::from_json_str(&config)?.spec()?;
    // SAFETY: read-only maps, dropped before returning; the caller does not modify the
    // checkpoint meanwhile (the crate docs, "Memory-mapped files").
    let st = unsafe { CheckpointTensors::open(dir)? };
    let routers = spec
        .moe_blocks()
        .map(|(i, m)| Ok(st.get(&m.names.router_weight(i))?.data))
        .collect::<crate::Result<Vec<_>>>()?;
    let mut samples = Vec::new();
    for (layer, m) in spec.moe_blocks() {
        // From the last expert down, so that a config naming more experts than the checkpoint
        // holds is refused by the name that shows the count it claims.
        let last = m.num_experts - 1;
        let experts = (0..SAMPLED_EXPERTS)
            .rev()
            .map(|j| j * last / (SAMPLED_EXPERTS - 1));
        let mut experts: Vec<usize> = experts.collect();
        experts.dedup();
        for e in experts {
            for t in m.expert_tensors(layer, e, spec.hidden_size) {
                let data = st.expert_bytes(&t)?;
                let at = (data.len() / 2).saturating_sub(EXPERT_SAMPLE_BYTES / 2);
                samples.push(&data[at..(at + EXPERT_SAMPLE_BYTES).min(data.len())]);
            }
        }
    }
    Ok(format!(
        "{}+{}",
        checkpoint_fingerprint(config.as_bytes(), routers),
        checkpoint_fingerprint(b"experts", samples)
    ))
}

/// Experts per MoE layer whose weights [`fingerprint`] samples (evenly spread from the first
/// to the last).
pub const SAMPLED_EXPERTS: usize = 4;

/// Bytes [`fingerprint`] takes from the middle of each sampled expert weight (all of a smaller
/// one): one or two pages touched per weight, never the whole tensor.
pub const EXPERT_SAMPLE_BYTES: usize = 256;

/// Whether the checkpoint in `dir` stores a tensor named `name`, from the shards' headers alone
/// (read, not mapped); e.g. an `lm_head.weight` beside `tie_word_embeddings: true`, which then
/// is not tied (see [`untie_if_stored_head`]).
pub fn stores_tensor(dir: impl AsRef<Path>, name: &str) -> crate::Result<bool> {
    let dir = dir.as_ref();
    for path in checkpoint_files(dir)? {
        if header_tensor_names(dir, &path)?.iter().any(|n| n == name) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `spec` as the checkpoint in `dir` runs it: a spec that ties `lm_head` to the embeddings is
/// untied when the checkpoint stores its own `lm_head.weight`, which the model then loads (as
/// transformers 5 does), so that a plan counts that head.
pub fn untie_if_stored_head(spec: &mut ModelSpec, dir: impl AsRef<Path>) -> crate::Result<()> {
    if spec.tie_word_embeddings && stores_tensor(dir, "lm_head.weight")? {
        spec.tie_word_embeddings = false;
    }
    Ok(())
}

/// How many decoder layers the checkpoint in `dir` stores tensors of: the largest `i` of a
/// `model.layers.{i}.…` tensor name plus one (0 for none), from the shards' headers alone (read,
/// not mapped). A config whose `num_hidden_layers` is smaller builds a model from the first
/// layers only. A shard whose header cannot be read is a [`QmoeError::InvalidCheckpoint`]
/// naming the folder and the file.
pub fn stored_decoder_layers(dir: impl AsRef<Path>) -> crate::Result<usize> {
    let dir = dir.as_ref();
    let mut layers = 0;
    for path in checkpoint_files(dir)? {
        let names = header_tensor_names(dir, &path)?;
        let stored = names.iter().filter_map(|name| decoder_layer_of(name));
        layers = stored.map(|i| i + 1).fold(layers, usize::max);
    }
    Ok(layers)
}

/// The largest header a safetensors file may have (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// A damaged shard `path` of the checkpoint in `dir`: the folder, the file and what is wrong.
fn invalid_shard(dir: &Path, path: &Path, reason: String) -> QmoeError {
    QmoeError::InvalidCheckpoint {
        dir: dir.to_path_buf(),
        reason: format!("`{}`: {reason}", path.display()),
    }
}

/// The tensor names in the header of the safetensors shard `path` of the checkpoint in `dir`:
/// its first 8 bytes give the header's length (little-endian), then that many bytes of a JSON
/// object keyed by tensor name (and `__metadata__`).
fn header_tensor_names(dir: &Path, path: &Path) -> crate::Result<Vec<String>> {
    use std::io::Read;
    let invalid = |reason: String| invalid_shard(dir, path, reason);
    let io = |error| QmoeError::Io {
        path: path.to_path_buf(),
        error,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => invalid(
            "not a readable safetensors file: shorter than the 8 bytes of its header length".into(),
        ),
        _ => io(e),
    })?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES {
        return Err(invalid(format!(
            "its header length, {n} bytes, is more than a safetensors header may hold \
             ({MAX_HEADER_BYTES})"
        )));
    }
    let mut header = Vec::new();
    file.take(n).read_to_end(&mut header).map_err(io)?;
    if header.len() as u64 != n {
        return Err(invalid(format!(
            "the file ends inside its {n}-byte header ({} bytes of it present)",
            header.len()
        )));
    }
    let json: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| invalid(format!("not a readable safetensors file: its header: {e}")))?;
    let serde_json::Value::Object(map) = json else {
        return Err(invalid("its header is not a JSON object".into()));
    };
    Ok(map
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| name != "__metadata__")
        .collect())
}

/// The decoder layer a tensor name belongs to (`model.layers.{i}.…`), if any.
pub(crate) fn decoder_layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// One tensor of a checkpoint as stored: element type, shape and raw little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    /// Element type.
    pub dtype: Dtype,
    /// Shape (row-major).
    pub shape: &'a [usize],
    /// The stored bytes.
    pub data: &'a [u8],
}

/// Where one tensor lies: its shard, its byte range in the shard, its dtype and shape.
struct Located {
    shard: usize,
    range: Range<usize>,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// The tensors of a checkpoint folder (see [`checkpoint_files`]), memory-mapped and read as
/// stored: no Candle tensor is made, so a reader converts exactly what it needs, where it needs
/// it, and can hand the pages of what it has read back to the system ([`Self::release`]).
pub struct CheckpointTensors {
    dir: PathBuf,
    shards: Vec<memmap2::Mmap>,
    tensors: HashMap<String, Located>,
}

impl CheckpointTensors {
    /// Memory-maps every shard of the checkpoint in `dir` and reads their headers; a damaged
    /// header is a [`QmoeError::InvalidCheckpoint`] naming the folder and the file.
    ///
    /// # Safety
    /// The files must not be modified while this value or a tensor borrowed from it is alive
    /// (the contract of [`mmap_checkpoint`]).
    pub unsafe fn open(dir: impl AsRef<Path>) -> crate::Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let mut shards = Vec::new();
        let mut tensors = HashMap::new();
        for path in checkpoint_files(&dir)? {
            let invalid = |reason: String| invalid_shard(&dir, &path, reason);
            let file = std::fs::File::open(&path).map_err(|error| QmoeError::Io {
                path: path.clone(),
                error,
            })?;
            // SAFETY: forwarded to the caller (the file is not modified while mapped).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| invalid(e.to_string()))?;
            let (n, header) = safetensors::SafeTensors::read_metadata(&map)
                .map_err(|e| invalid(format!("not a readable safetensors file: {e}")))?;
            // `read_metadata` checked that the tensors tile the data section up to the end of
            // the file, each with the bytes its shape and dtype need.
            let start = 8 + n;
            for (name, info) in header.tensors() {
                let located = Located {
                    shard: shards.len(),
                    range: start + info.data_offsets.0..start + info.data_offsets.1,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                };
                if tensors.insert(name.clone(), located).is_some() {
                    return Err(invalid(format!("tensor `{name}` is stored twice")));
                }
            }
            shards.push(map);
        }
        Ok(Self {
            dir,
            shards,
            tensors,
        })
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn locate(&self, name: &str) -> crate::Result<&Located> {
        self.tensors
            .get(name)
            .ok_or_else(|| QmoeError::InvalidCheckpoint {
                dir: self.dir.clone(),
                reason: format!("no tensor `{name}`"),
            })
    }

    /// The tensor `name` as stored; a missing one is a [`QmoeError::InvalidCheckpoint`].
    pub fn get(&self, name: &str) -> crate::Result<RawTensor<'_>> {
        let t = self.locate(name)?;
        Ok(RawTensor {
            dtype: t.dtype,
            shape: &t.shape,
            data: &self.shards[t.shard][t.range.clone()],
        })
    }

    /// The tensor `name`, which must have `shape`, converted to F32 into `out` (resized to fit)
    /// from F32, BF16 or F16; another shape or dtype is a [`QmoeError::InvalidCheckpoint`].
    pub fn read_f32(&self, name: &str, shape: &[usize], out: &mut Vec<f32>) -> crate::Result<()> {
        let t = self.get(name)?;
        if t.shape != shape {
            return Err(
                self.invalid_tensor(name, format!("has shape {:?}, expected {shape:?}", t.shape))
            );
        }
        self.convert_f32(name, t.dtype, t.data, out)
    }

    fn invalid_tensor(&self, name: impl std::fmt::Display, reason: String) -> QmoeError {
        QmoeError::InvalidCheckpoint {
            dir: self.dir.clone(),
            reason: format!("tensor `{name}` {reason}"),
        }
    }

    /// `data` of `dtype` converted to F32 into `out` (resized to fit); `name` for errors.
    fn convert_f32(
        &self,
        name: impl std::fmt::Display,
        dtype: Dtype,
        data: &[u8],
        out: &mut Vec<f32>,
    ) -> crate::Result<()> {
        match dtype {
            Dtype::F32 => convert(data, out, f32::from_le_bytes),
            Dtype::BF16 => convert(data, out, |b| half::bf16::from_le_bytes(b).to_f32()),
            Dtype::F16 => convert(data, out, |b| half::f16::from_le_bytes(b).to_f32()),
            other => {
                return Err(self.invalid_tensor(name, format!("is {other:?}, not F32, BF16 or F16")))
            }
        }
        Ok(())
    }

    /// Where the `[rows, cols]` matrix of the expert projection `t` (its `shape`) lies in its
    /// stored tensor: the shard, the byte range and the dtype. A whole tensor must be
    /// `[rows, cols]`; a fused one `[E, R, cols]` with the expert below `E` and the rows within
    /// `R`.
    fn expert_range(&self, t: &ExpertTensor) -> crate::Result<(usize, Range<usize>, Dtype)> {
        let [rows, cols] = t.shape;
        let at = self.locate(&t.name)?;
        let Some(f) = t.fused else {
            if at.shape != [rows, cols] {
                return Err(self.invalid_tensor(
                    t,
                    format!("has shape {:?}, expected {:?}", at.shape, [rows, cols]),
                ));
            }
            return Ok((at.shard, at.range.clone(), at.dtype));
        };
        let fits = match at.shape[..] {
            [e, r, c] => f.expert < e && f.first_row + rows <= r && c == cols,
            _ => false,
        };
        if !fits {
            return Err(self.invalid_tensor(
                &t.name,
                format!(
                    "has shape {:?}; expert {} needs rows {}..{} of {cols} columns in an \
                     [experts, rows, {cols}] tensor",
                    at.shape,
                    f.expert,
                    f.first_row,
                    f.first_row + rows
                ),
            ));
        }
        let bytes = |elements: usize| elements * at.dtype.bitsize() / 8;
        let start = at.range.start + bytes((f.expert * at.shape[1] + f.first_row) * cols);
        Ok((at.shard, start..start + bytes(rows * cols), at.dtype))
    }

    /// The expert projection `t` (see [`ExpertTensor`]) converted to F32 into `out`; a tensor
    /// of another shape or dtype is a [`QmoeError::InvalidCheckpoint`].
    pub fn read_expert_f32(&self, t: &ExpertTensor, out: &mut Vec<f32>) -> crate::Result<()> {
        let (shard, range, dtype) = self.expert_range(t)?;
        self.convert_f32(t, dtype, &self.shards[shard][range], out)
    }

    /// The stored bytes of the expert projection `t`: its whole tensor (whose shape is not
    /// checked here), or its rows of a fused tensor (checked as in [`Self::read_expert_f32`]).
    pub fn expert_bytes(&self, t: &ExpertTensor) -> crate::Result<&[u8]> {
        if t.fused.is_none() {
            return Ok(self.get(&t.name)?.data);
        }
        let (shard, range, _) = self.expert_range(t)?;
        Ok(&self.shards[shard][range])
    }

    /// Asks the system to read the tensors `names` from disk now (a hint: it returns at once;
    /// a no-op where the system has no `madvise`, i.e. not Unix).
    pub fn prefetch<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        #[cfg(not(unix))]
        let _ = names;
        #[cfg(unix)]
        for name in names {
            if let Ok(t) = self.locate(name) {
                let advice = memmap2::Advice::WillNeed;
                let _ = self.shards[t.shard].advise_range(advice, t.range.start, t.range.len());
            }
        }
    }

    /// Drops the pages of the expert projection `t` from this process's memory (see
    /// [`Self::release`]); a fused tensor's other experts keep theirs, but for the pages they
    /// share with it.
    pub fn release_expert(&self, t: &ExpertTensor) {
        if let Ok((shard, range, _)) = self.expert_range(t) {
            self.release_range(shard, range);
        }
    }

    #[cfg(not(unix))]
    fn release_range(&self, _shard: usize, _range: Range<usize>) {}

    #[cfg(unix)]
    fn release_range(&self, shard: usize, range: Range<usize>) {
        // SAFETY: as in `release`.
        let _ = unsafe {
            self.shards[shard].unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                range.start,
                range.len(),
            )
        };
    }

    /// Drops the pages of the tensors `names` from this process's memory (they stay in the
    /// system's file cache, and are read again if used again), so reading a checkpoint piece by
    /// piece keeps the resident memory at about one piece. A no-op where the system has no
    /// `madvise` (not Unix).
    pub fn release<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        #[cfg(not(unix))]
        let _ = names;
        #[cfg(unix)]
        for name in names {
            if let Ok(t) = self.locate(name) {
                // SAFETY: the map is a read-only view of a file that is not modified (see
                // `open`): after MADV_DONTNEED a page is read back from the file with the same
                // bytes, so no borrowed slice ever sees different data.
                let _ = unsafe {
                    self.shards[t.shard].unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        t.range.start,
                        t.range.len(),
                    )
                };
            }
        }
    }
}

/// Little-endian values of `N` bytes each, converted by `f`, into `out` (resized to fit; the
/// loop vectorizes).
fn convert<const N: usize>(data: &[u8], out: &mut Vec<f32>, f: impl Fn([u8; N]) -> f32) {
    out.resize(data.len() / N, 0.0);
    for (o, b) in out.iter_mut().zip(data.chunks_exact(N)) {
        *o = f(b.try_into().expect("chunks of N bytes"));
    }
}
