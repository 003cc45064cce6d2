//! The `.qmoe` file: a safetensors file holding, per MoE layer `i`, one `U8 [experts, slab_bytes]`
//! tensor (`layers.{i}.experts`) and the CRC-32 checksum of every slab, `U32 [experts]`
//! (`layers.{i}.checksums`, see [`super::integrity`]), with a metadata header naming the format
//! version, the slab layout, the group size and the source checkpoint (model id, revision,
//! fingerprint).
//!
//! Loading is memory-mapped; the header, every tensor's shape and the file size are validated
//! before anything is sized from them, slabs are verified against their checksums on first use
//! (or all at once with [`PackFile::verify`]), and [`PackFile::check_source`] refuses a pack made
//! from another checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use safetensors::Dtype;
use sha2::{Digest, Sha256};

use super::{ExpertLayout, GroupSize, LayerPack, ScaleSearch, SlabOrigin};
use crate::safetensors_writer::{SafetensorsWriter, TensorSpec};
use crate::QmoeError;

/// Format marker stored under `format`.
pub const FORMAT: &str = "candle-qmoe";
/// Version of the file layout this build writes (2: per-slab checksums; 3: the fingerprint may
/// carry a sample of the expert weights, see [`PackMeta::fingerprint`]). It reads 2 and 3; a
/// build that reads only 2 refuses a version 3 pack by its version.
pub const FORMAT_VERSION: u32 = 3;

/// The oldest version this build reads.
const OLDEST_READ_VERSION: u32 = 2;

/// What a `.qmoe` header records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackMeta {
    /// Slab layout (hidden, intermediate, group size).
    pub layout: ExpertLayout,
    /// Routed experts per layer.
    pub num_experts: usize,
    /// How scales were chosen.
    pub scale_search: ScaleSearch,
    /// Source model id or path.
    pub source_model: String,
    /// Source revision (hub revision or `local`).
    pub source_revision: String,
    /// Fingerprint of the source checkpoint: a [`checkpoint_fingerprint`] (64 hexadecimal
    /// digits), then for a checkpoint folder `+` and the digest of a sample of its expert
    /// weights (64 more; see [`crate::models::fingerprint`]). Packs of another form are refused
    /// when written and when opened.
    pub fingerprint: String,
}

/// SHA-256 over `config.json` and the router weights' raw bytes, in layer order: two different
/// checkpoints of the same architecture (e.g. OLMoE 0924 and 0125) get different fingerprints.
pub fn checkpoint_fingerprint<'a>(
    config_json: &[u8],
    routers: impl IntoIterator<Item = &'a [u8]>,
) -> String {
    let mut h = Sha256::new();
    h.update(config_json);
    for r in routers {
        h.update((r.len() as u64).to_le_bytes());
        h.update(r);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A fingerprint's parts: the digest of config and routers, and the expert sample's after `+`
/// when it has one (packs written before the sample existed record only the first).
fn fingerprint_parts(fingerprint: &str) -> (&str, Option<&str>) {
    match fingerprint.split_once('+') {
        Some((source, sample)) => (source, Some(sample)),
        None => (fingerprint, None),
    }
}

/// Why a pack that recorded the fingerprint `recorded` cannot serve a checkpoint whose
/// fingerprint is `checkpoint`; `None` when both describe the same source: equal first parts,
/// and equal expert samples when both have one.
fn source_mismatch(recorded: &str, checkpoint: &str) -> Option<String> {
    let ((source, sample), (now, now_sample)) =
        (fingerprint_parts(recorded), fingerprint_parts(checkpoint));
    if source != now {
        let short = |f: &str| f.chars().take(12).collect::<String>();
        return Some(format!(
            "its fingerprint {}… is not this checkpoint's {}…",
            short(recorded),
            short(checkpoint)
        ));
    }
    match (sample, now_sample) {
        (Some(a), Some(b)) if a != b => Some(
            "the checkpoint's expert weights changed since this pack was made (same \
             config.json and routers, other sampled expert bytes)"
                .into(),
        ),
        _ => None,
    }
}

/// A memory-mapped `.qmoe` file.
#[derive(Debug)]
pub struct PackFile {
    meta: PackMeta,
    layers: BTreeMap<usize, LayerPack>,
}

fn tensor_name(layer: usize) -> String {
    format!("layers.{layer}.experts")
}

fn checksums_name(layer: usize) -> String {
    format!("layers.{layer}.checksums")
}

fn bad(path: &Path, reason: impl std::fmt::Display) -> QmoeError {
    QmoeError::CorruptPack {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// A [`QmoeError::InvalidPack`] about the contents of the file at `path` as a
/// [`QmoeError::CorruptPack`] naming it; other errors unchanged.
fn in_file(path: &Path, e: QmoeError) -> QmoeError {
    match e {
        QmoeError::InvalidPack { reason } => bad(path, reason),
        e => e,
    }
}

/// Checks that layer `i`'s pack has the layout and expert count the header announces.
fn check_layer(meta: &PackMeta, i: usize, p: &LayerPack) -> crate::Result<()> {
    if p.layout() != meta.layout || p.num_experts() != meta.num_experts {
        return Err(QmoeError::InvalidPack {
            reason: format!(
                "layer {i} has layout {:?} × {} experts, the header says {:?} × {}",
                p.layout(),
                p.num_experts(),
                meta.layout,
                meta.num_experts
            ),
        });
    }
    Ok(())
}

/// Writes a `.qmoe` file one layer at a time, so a pack of any size is written while holding
/// one layer: the header (shapes are known from the metadata) comes first, then each layer's
/// slabs as it is given, then the checksums of every slab (data section order:
/// `layers.{i}.experts` for each layer in order, then `layers.{i}.checksums`).
pub struct PackWriter {
    out: SafetensorsWriter,
    meta: PackMeta,
    layers: Vec<usize>,
    /// How many of `layers` have been written.
    written: usize,
    checksums: Vec<u32>,
}

/// Refuses a header a pack cannot record: zero experts, or a fingerprint not of
/// [`PackMeta::fingerprint`]'s form.
fn check_meta(meta: &PackMeta) -> crate::Result<()> {
    let refuse = |reason: String| Err(QmoeError::InvalidPack { reason });
    if meta.num_experts == 0 {
        return refuse("`num_experts` is 0".into());
    }
    if !is_valid_fingerprint(&meta.fingerprint) {
        return refuse(format!(
            "fingerprint `{}` is not 64 hexadecimal digits (or two such, joined by `+`): use \
             checkpoint_fingerprint() or models::fingerprint()",
            meta.fingerprint
        ));
    }
    Ok(())
}

/// Whether `fingerprint` has the form a pack records: 64 hexadecimal digits, or two such joined
/// by `+` (see [`PackMeta::fingerprint`]).
fn is_valid_fingerprint(fingerprint: &str) -> bool {
    let is_hex = |f: &str| f.len() == 64 && f.bytes().all(|b| b.is_ascii_hexdigit());
    let (source, sample) = fingerprint_parts(fingerprint);
    is_hex(source) && sample.is_none_or(is_hex)
}

impl PackWriter {
    /// Starts the file at `path` for the MoE layers `layers` (in the order they will be
    /// written) with the header `meta`. Refuses, before anything is written, what
    /// [`PackFile::open`] would refuse to read: no layer, a layer index given twice, zero
    /// experts, a fingerprint not of [`PackMeta::fingerprint`]'s form.
    pub fn create(
        path: &Path,
        meta: &PackMeta,
        layers: impl IntoIterator<Item = usize>,
    ) -> crate::Result<Self> {
        let layers: Vec<usize> = layers.into_iter().collect();
        let refuse = |reason: String| QmoeError::InvalidPack { reason };
        if layers.is_empty() {
            return Err(refuse("a pack needs at least one layer".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(i) = layers.iter().find(|&&i| !seen.insert(i)) {
            return Err(refuse(format!("layer {i} is given twice")));
        }
        check_meta(meta)?;
        let l = meta.layout;
        let info: HashMap<String, String> = [
            ("format", FORMAT.to_string()),
            ("format_version", FORMAT_VERSION.to_string()),
            ("hidden", l.hidden.to_string()),
            ("intermediate", l.intermediate.to_string()),
            ("group_size", l.group_size.get().to_string()),
            ("num_experts", meta.num_experts.to_string()),
            (
                "scale_search",
                format!("{:?}", meta.scale_search).to_lowercase(),
            ),
            ("source_model", meta.source_model.clone()),
            ("source_revision", meta.source_revision.clone()),
            ("fingerprint", meta.fingerprint.clone()),
            ("layers", serde_json::json!(layers).to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let slabs = layers.iter().map(|&i| {
            TensorSpec::new(
                tensor_name(i),
                Dtype::U8,
                vec![meta.num_experts, l.slab_bytes()],
            )
        });
        let sums = layers
            .iter()
            .map(|&i| TensorSpec::new(checksums_name(i), Dtype::U32, vec![meta.num_experts]));
        let out = SafetensorsWriter::create(path, Some(info), slabs.chain(sums).collect())?;
        Ok(Self {
            out,
            meta: meta.clone(),
            layers,
            written: 0,
            checksums: Vec::new(),
        })
    }

    /// Appends layer `i`'s slabs; layers must come in the order given to [`Self::create`] and
    /// match the header's layout.
    pub fn write_layer(&mut self, i: usize, pack: &LayerPack) -> crate::Result<()> {
        match self.layers.get(self.written) {
            Some(&next) if next == i => {}
            next => {
                return Err(QmoeError::InvalidPack {
                    reason: match next {
                        Some(next) => format!("layer {i} written where layer {next} comes next"),
                        None => format!("layer {i} written after every layer of the header"),
                    },
                })
            }
        }
        check_layer(&self.meta, i, pack)?;
        self.out.write(&tensor_name(i), pack.bytes())?;
        self.checksums.extend_from_slice(pack.checksums());
        self.written += 1;
        Ok(())
    }

    /// Writes the pack of the MoE layers `layers` (in this order) with the header `meta` to
    /// `path`, one layer at a time: `layer(i)` makes layer `i`'s slabs, which are written and
    /// dropped before the next layer is made, so only one layer is ever held in memory.
    pub fn write_streamed(
        path: &Path,
        meta: &PackMeta,
        layers: &[usize],
        mut layer: impl FnMut(usize) -> crate::Result<LayerPack>,
    ) -> crate::Result<()> {
        let mut out = Self::create(path, meta, layers.iter().copied())?;
        for &i in layers {
            out.write_layer(i, &layer(i)?)?;
        }
        out.finish()
    }

    /// Appends the checksums and puts the file in place (see [`SafetensorsWriter::finish`]).
    pub fn finish(mut self) -> crate::Result<()> {
        if self.written != self.layers.len() {
            return Err(QmoeError::InvalidPack {
                reason: format!(
                    "finished after {} of the header's {} layers",
                    self.written,
                    self.layers.len()
                ),
            });
        }
        let experts = self.meta.num_experts;
        for (i, sums) in self.layers.iter().zip(self.checksums.chunks(experts)) {
            let bytes: Vec<u8> = sums.iter().flat_map(|c| c.to_le_bytes()).collect();
            self.out.write(&checksums_name(*i), &bytes)?;
        }
        self.out.finish().map(|_| ())
    }
}

impl PackFile {
    /// A pack held in memory (e.g. just quantized, or synthetic), with the same checks as
    /// [`PackFile::open`]: `meta` is one a pack can record (experts, fingerprint), every layer
    /// matches it, no layer index appears twice, and there is at least one layer.
    pub fn from_layers(
        meta: PackMeta,
        layers: impl IntoIterator<Item = (usize, LayerPack)>,
    ) -> crate::Result<Self> {
        check_meta(&meta)?;
        let mut map = BTreeMap::new();
        for (i, p) in layers {
            check_layer(&meta, i, &p)?;
            if map.insert(i, p).is_some() {
                return Err(QmoeError::InvalidPack {
                    reason: format!("layer {i} is given twice"),
                });
            }
        }
        if map.is_empty() {
            return Err(QmoeError::InvalidPack {
                reason: "a pack needs at least one layer".into(),
            });
        }
        Ok(Self { meta, layers: map })
    }

    /// Writes this pack to `path` (see [`PackFile::write`]).
    pub fn save(&self, path: &Path) -> crate::Result<()> {
        let indices: Vec<usize> = self.layers.keys().copied().collect();
        PackWriter::write_streamed(path, &self.meta, &indices, |i| self.layer(i))
    }

    /// Bytes of packed experts over all layers.
    pub fn total_bytes(&self) -> usize {
        self.layers.values().map(|p| p.bytes().len()).sum()
    }

    /// Writes `layers` (MoE layer index → pack) with `meta` to `path`.
    pub fn write(path: &Path, meta: &PackMeta, layers: &[(usize, LayerPack)]) -> crate::Result<()> {
        let indices: Vec<usize> = layers.iter().map(|(i, _)| *i).collect();
        let mut packs = layers.iter().map(|(_, p)| p.clone());
        PackWriter::write_streamed(path, meta, &indices, |_| {
            Ok(packs.next().expect("one pack per index"))
        })
    }

    /// Memory-maps and validates a `.qmoe` file.
    pub fn open(path: &Path) -> crate::Result<Self> {
        Self::open_as(path, false)
    }

    /// [`PackFile::open`], then every layer's slabs read into anonymous memory of this process
    /// (one read per layer; afterwards no page of the file is mapped). Decoding then streams
    /// the process's own memory: OLMoE-1B-7B on a 2-vCPU Xeon decoded 1.05–1.08× faster than
    /// from the mapped file, for a load that reads the whole pack first (docs/architecture.md
    /// §2). Resident memory is that of a mapped pack whose every expert has been used.
    pub fn open_in_memory(path: &Path) -> crate::Result<Self> {
        Self::open_as(path, true)
    }

    fn open_as(path: &Path, in_memory: bool) -> crate::Result<Self> {
        let io = |error| QmoeError::Io {
            path: path.to_path_buf(),
            error,
        };
        if path.is_dir() {
            return Err(bad(path, "a folder, not a .qmoe file: name a file"));
        }
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the file is opened read-only and the map is never written; packs are replaced
        // by rename, never modified in place (the crate docs, "Memory-mapped files").
        let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(path, e))?);
        let (n, header) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
            bad(
                path,
                format!("not a readable .qmoe (safetensors) file: {e}"),
            )
        })?;
        let info = header
            .metadata()
            .clone()
            .ok_or_else(|| bad(path, "no metadata header"))?;
        let get = |k: &str| {
            info.get(k)
                .cloned()
                .ok_or_else(|| bad(path, format!("metadata lacks `{k}`")))
        };
        let num = |k: &str| -> crate::Result<usize> {
            get(k)?
                .parse::<usize>()
                .map_err(|_| bad(path, format!("metadata `{k}` is not a number")))
        };
        if get("format")? != FORMAT {
            return Err(bad(path, "not a candle-qmoe pack"));
        }
        let version = num("format_version")?;
        if version == 1 {
            return Err(bad(
                path,
                "format version 1 has no expert checksums, which this build requires \
                 (version 2 or later); re-run quantize to re-create the pack",
            ));
        }
        if !(OLDEST_READ_VERSION as usize..=FORMAT_VERSION as usize).contains(&version) {
            return Err(bad(
                path,
                format!("format version {version}, this build reads versions {OLDEST_READ_VERSION} to {FORMAT_VERSION}; re-run quantize"),
            ));
        }
        let layout = ExpertLayout {
            hidden: num("hidden")?,
            intermediate: num("intermediate")?,
            group_size: GroupSize::new(num("group_size")?).map_err(|e| bad(path, e))?,
        };
        let scale_search = match get("scale_search")?.as_str() {
            "mse" => ScaleSearch::Mse,
            "rtn" => ScaleSearch::Rtn,
            other => return Err(bad(path, format!("unknown scale_search `{other}`"))),
        };
        let meta = PackMeta {
            layout,
            num_experts: num("num_experts")?,
            scale_search,
            source_model: get("source_model")?,
            source_revision: get("source_revision")?,
            fingerprint: get("fingerprint")?,
        };
        if !is_valid_fingerprint(&meta.fingerprint) {
            return Err(bad(
                path,
                "metadata `fingerprint` is not 64 hexadecimal digits (or two such, joined by `+`)",
            ));
        }
        let slab_bytes = layout.checked_slab_bytes().map_err(|e| in_file(path, e))?;
        let indices: Vec<usize> = serde_json::from_str(&get("layers")?)
            .map_err(|_| bad(path, "metadata `layers` is not a list of layer indices"))?;
        // `read_metadata` checked that the tensors tile the data section exactly up to the end
        // of the file, each with as many bytes as its shape and dtype need (with checked
        // arithmetic), so a range taken from a tensor whose shape is checked here lies inside
        // the file.
        let data_start = 8 + n;
        let tensor = |name: &str, dtype, want: &[usize]| {
            let t = header
                .info(name)
                .ok_or_else(|| bad(path, format!("missing tensor `{name}`")))?;
            if t.dtype != dtype || t.shape != want {
                return Err(bad(
                    path,
                    format!(
                        "tensor `{name}` is {:?} {:?}, expected {dtype:?} {want:?}",
                        t.dtype, t.shape
                    ),
                ));
            }
            Ok(data_start + t.data_offsets.0..data_start + t.data_offsets.1)
        };
        let mut layers = BTreeMap::new();
        for i in indices {
            let experts = meta.num_experts;
            let range = tensor(
                &tensor_name(i),
                safetensors::Dtype::U8,
                &[experts, slab_bytes],
            )?;
            let sums = tensor(&checksums_name(i), safetensors::Dtype::U32, &[experts])?;
            let sums = map[sums]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("chunks of 4 bytes")))
                .collect();
            let origin = SlabOrigin::File {
                path: path.to_path_buf(),
                layer: i,
            };
            let mut pack = LayerPack::from_mmap(layout, experts, map.clone(), range, sums, origin)
                .map_err(|e| in_file(path, e))?;
            if in_memory {
                pack = pack.read_into_memory(&file).map_err(io)?;
            }
            if layers.insert(i, pack).is_some() {
                return Err(bad(
                    path,
                    format!("metadata `layers` lists layer {i} twice"),
                ));
            }
        }
        if layers.is_empty() {
            return Err(bad(path, "metadata `layers` lists no layer"));
        }
        Ok(Self { meta, layers })
    }

    /// Verifies every slab of every layer against its checksum now (slabs are otherwise verified
    /// on first use); a corrupt slab is a [`QmoeError::CorruptPack`] naming the file, the layer
    /// and the expert.
    pub fn verify(&self) -> crate::Result<()> {
        self.layers.values().try_for_each(LayerPack::verify)
    }

    /// The header.
    pub fn meta(&self) -> &PackMeta {
        &self.meta
    }

    /// The MoE layer indices the pack holds.
    pub fn layer_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.keys().copied()
    }

    /// The pack of MoE layer `i`.
    pub fn layer(&self, i: usize) -> crate::Result<LayerPack> {
        self.layers
            .get(&i)
            .cloned()
            .ok_or_else(|| self.mismatch(format!("the pack has no experts for layer {i}")))
    }

    /// A [`QmoeError::PackMismatch`] naming this pack's source.
    fn mismatch(&self, reason: String) -> QmoeError {
        QmoeError::PackMismatch {
            source_model: self.meta.source_model.clone(),
            source_revision: self.meta.source_revision.clone(),
            reason,
        }
    }

    /// Refuses a pack made from another checkpoint or with other shapes.
    pub fn check_source(
        &self,
        fingerprint: &str,
        layout_hidden: usize,
        layout_intermediate: usize,
        num_experts: usize,
    ) -> crate::Result<()> {
        let m = &self.meta;
        if let Some(reason) = source_mismatch(&m.fingerprint, fingerprint) {
            return Err(self.mismatch(reason));
        }
        if (m.layout.hidden, m.layout.intermediate, m.num_experts)
            != (layout_hidden, layout_intermediate, num_experts)
        {
            return Err(self.mismatch(format!(
                "pack holds H {} I {} × {} experts; the model has H {layout_hidden} I \
                 {layout_intermediate} × {num_experts}",
                m.layout.hidden, m.layout.intermediate, m.num_experts
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{DenseExpert, ExpertNames};
    use candle::{Device, Tensor};

    fn sample() -> (PackMeta, Vec<(usize, LayerPack)>) {
        let layout = ExpertLayout {
            hidden: 64,
            intermediate: 40,
            group_size: GroupSize::new(32).unwrap(),
        };
        let experts: Vec<DenseExpert> = (0..3)
            .map(|e| {
                let t = |r: usize, c: usize| {
                    let v: Vec<f32> = (0..r * c)
                        .map(|i| ((i * 31 + e * 7) % 17) as f32 - 8.0)
                        .collect();
                    Tensor::from_vec(v, (r, c), &Device::Cpu).unwrap()
                };
                DenseExpert {
                    gate: t(40, 64),
                    up: t(40, 64),
                    down: t(64, 40),
                }
            })
            .collect();
        let layers = [1, 3]
            .iter()
            .map(|&i| {
                (
                    i,
                    LayerPack::quantize("l", ExpertNames::PROJ, &experts, layout, ScaleSearch::Mse)
                        .unwrap(),
                )
            })
            .collect();
        let meta = PackMeta {
            layout,
            num_experts: 3,
            scale_search: ScaleSearch::Mse,
            source_model: "test/model".into(),
            source_revision: "main".into(),
            fingerprint: checkpoint_fingerprint(b"{}", [&b"router"[..]]),
        };
        (meta, layers)
    }

    /// A fingerprint with an expert sample matches only the same sample; one without (a pack
    /// written before the sample existed) matches on its first part alone.
    #[test]
    fn expert_samples_decide_only_when_both_sides_have_one() {
        let (a, b, c) = ("a".repeat(64), "b".repeat(64), "c".repeat(64));
        let same_source = |recorded: &str, now: &str| source_mismatch(recorded, now).is_none();
        assert!(same_source(&format!("{a}+{b}"), &format!("{a}+{b}")));
        assert!(!same_source(&format!("{a}+{b}"), &format!("{a}+{c}")));
        assert!(!same_source(&format!("{a}+{b}"), &format!("{c}+{b}")));
        assert!(same_source(&a, &format!("{a}+{c}")));
        assert!(!same_source(&a, &format!("{c}+{b}")));
    }

    #[test]
    fn round_trip_and_source_checks() {
        let dir = std::env::temp_dir().join(format!("qmoe-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ok.qmoe");
        let (meta, layers) = sample();
        PackFile::write(&path, &meta, &layers).unwrap();
        let f = PackFile::open(&path).unwrap();
        assert_eq!(f.meta(), &meta);
        assert_eq!(f.layer_indices().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(f.layer(3).unwrap().bytes(), layers[1].1.bytes());
        let e = f.layer(0).unwrap_err();
        assert!(
            matches!(&e, QmoeError::PackMismatch { reason, .. } if reason.contains("layer 0")),
            "{e}"
        );
        f.check_source(&meta.fingerprint, 64, 40, 3).unwrap();
        let other = checkpoint_fingerprint(b"{}", [&b"other router"[..]]);
        let e = f.check_source(&other, 64, 40, 3).unwrap_err();
        assert!(
            matches!(&e, QmoeError::PackMismatch { source_model, .. } if source_model == "test/model"),
            "{e}"
        );
        assert!(e.to_string().contains("re-run quantize"), "{e}");
        assert!(matches!(
            f.check_source(&meta.fingerprint, 64, 48, 3),
            Err(QmoeError::PackMismatch { reason, .. })
                if reason.contains("pack holds H 64 I 40 × 3 experts; the model has H 64 I 48 × 3")
        ));

        // Truncation, a foreign version and a non-safetensors file are clear errors.
        let corrupt = |p: &Path| match PackFile::open(p).unwrap_err() {
            QmoeError::CorruptPack { path, reason } => {
                assert_eq!(path, p);
                reason
            }
            e => panic!("{}: {e}", p.display()),
        };
        let bytes = std::fs::read(&path).unwrap();
        let cut = dir.join("cut.qmoe");
        std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
        let e = PackFile::open(&cut).unwrap_err().to_string();
        assert!(e.contains("cut.qmoe"), "{e}");
        corrupt(&cut);
        let needle = b"\"format_version\":\"3\"";
        let at = bytes
            .windows(needle.len())
            .position(|w| w == needle)
            .unwrap();
        let mut v7 = bytes.clone();
        v7[at + needle.len() - 2] = b'7';
        let v7_path = dir.join("v7.qmoe");
        std::fs::write(&v7_path, &v7).unwrap();
        let e = corrupt(&v7_path);
        assert!(e.contains("format version 7"), "{e}");
        // A version 2 pack (written before the expert sample) still reads.
        let mut v2 = bytes.clone();
        v2[at + needle.len() - 2] = b'2';
        let v2_path = dir.join("v2.qmoe");
        std::fs::write(&v2_path, &v2).unwrap();
        assert_eq!(PackFile::open(&v2_path).unwrap().meta(), &meta);
        let junk = dir.join("junk.qmoe");
        std::fs::write(&junk, b"not a pack at all").unwrap();
        corrupt(&junk);
        assert!(matches!(
            PackFile::open(&dir.join("absent.qmoe")),
            Err(QmoeError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
