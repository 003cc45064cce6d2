//! Bad input, tried systematically: seeded mutations of a valid `.qmoe` pack, `config.json` and
//! safetensors checkpoint — truncations, bit flips, lying lengths and offsets, huge dimensions,
//! wrong dtypes, NaN scales, JSON edits — fed to the loaders. Every outcome must be success or an
//! error that names the file; a panic, or a request for more than [`ALLOCATION_CAP`] bytes (a
//! size taken from the file before it was checked), fails the test. Mutations of a pack's expert
//! data must be refused, naming the layer and the expert.
//!
//! `QMOE_FUZZ_ITERS=N` runs N mutations of each file (default: a few thousand in all, a few
//! seconds in release; the configs of all four fixtures are fuzzed); `QMOE_FUZZ_SEED=S` changes the seed.
//!
//! The cap is a global allocator that refuses requests above 256 MiB (the fixtures are a few
//! MiB, so no honest load comes near it). Unlike a `setrlimit` address-space cap it needs no
//! `libc`, does not count the memory maps, and also catches a lying size that the machine could
//! have served. A refused request either comes back as an error (`try_reserve`) and is reported
//! with its case, or aborts the process with the case printed first.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle::{DType, Device, Tensor};
use candle_qmoe::models::{self, AnyConfig, ExpertsBackend, ModelConfig, MoeForCausalLm};
use candle_qmoe::pack::{slab_checksum, ExpertLayout, GroupSize, PackFile};
use candle_qmoe::residency::{Residency, ResidencyOptions, Resident};
use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
use candle_qmoe::{Int4Experts, QmoeError, RoutedExperts};
use candle_qmoe_suite::testing::{fixture_dir, FIXTURES};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// Largest single allocation a load may request.
const ALLOCATION_CAP: usize = 256 << 20;

/// Largest refused request since the last case started (0: none).
static REFUSED: AtomicUsize = AtomicUsize::new(0);
/// The case in progress, printed if a refused request aborts the process.
static CASE: AtomicU64 = AtomicU64::new(0);
/// The fuzz tests share the two statics above: they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

struct CappedAllocator;

/// Records and refuses a request above the cap. Writes to stderr without allocating.
fn refuse(size: usize) -> bool {
    if size <= ALLOCATION_CAP {
        return false;
    }
    REFUSED.fetch_max(size, Ordering::Relaxed);
    let mut digits = [0u8; 20];
    let mut n = CASE.load(Ordering::Relaxed);
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(b"bad_input: refused an allocation above the cap in case ");
    let _ = err.write_all(&digits[at..]);
    let _ = err.write_all(b"\n");
    true
}

// SAFETY: every call is forwarded to the system allocator, or refused with a null pointer as
// `GlobalAlloc` allows.
unsafe impl GlobalAlloc for CappedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if refuse(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if refuse(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if refuse(new_size) {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// Mutations per file: `QMOE_FUZZ_ITERS`, else `default`.
fn iterations(default: usize) -> usize {
    std::env::var("QMOE_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rng(stream: u64) -> StdRng {
    let seed = std::env::var("QMOE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0x5EED);
    StdRng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("qmoe-bad-input-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One mutated file: what was done, its bytes, whether a loader must refuse it, and what its
/// error must say besides the file's path (e.g. `layer 1, expert 5`).
struct Mutation {
    what: String,
    bytes: Vec<u8>,
    must_fail: bool,
    must_say: Option<String>,
}

impl Mutation {
    fn new(what: impl Into<String>, bytes: Vec<u8>, must_fail: bool) -> Self {
        Self {
            what: what.into(),
            bytes,
            must_fail,
            must_say: None,
        }
    }
}

/// Runs `cases` mutations made by `mutate`, each written to `path` and given to `load`; the
/// error of a refused case must contain `names` (the file's path or folder) and be a variant
/// `expected` accepts. Panics with every failing case (up to 20) at the end, and prints how each
/// kind of mutation fared.
fn fuzz(
    path: &Path,
    names: &str,
    cases: usize,
    mut mutate: impl FnMut(&mut StdRng) -> Mutation,
    rng: &mut StdRng,
    load: impl Fn() -> candle_qmoe::Result<()>,
    expected: impl Fn(&QmoeError) -> bool,
) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let mut failures = Vec::new();
    let mut tally: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
    for case in 0..cases {
        let m = mutate(rng);
        std::fs::write(path, &m.bytes).unwrap();
        CASE.store(case as u64, Ordering::Relaxed);
        REFUSED.store(0, Ordering::Relaxed);
        let outcome = catch_unwind(AssertUnwindSafe(&load));
        let refused = REFUSED.swap(0, Ordering::Relaxed);
        let kind = m.what.split(':').next().unwrap_or_default().to_string();
        let counts = tally.entry(kind).or_default();
        let problem = match outcome {
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                Some(format!("panicked: {msg}"))
            }
            _ if refused > 0 => Some(format!("asked for {refused} bytes at once")),
            Ok(Ok(())) => {
                counts.0 += 1;
                m.must_fail.then(|| "loaded without an error".to_string())
            }
            Ok(Err(e)) => {
                counts.1 += 1;
                let msg = e.to_string();
                let says = m.must_say.as_deref().unwrap_or(names);
                if !msg.contains(names) || !msg.contains(says) {
                    Some(format!("error does not name `{names}` / `{says}`: {msg}"))
                } else {
                    (!expected(&e)).then(|| format!("unexpected variant: {e:?}"))
                }
            }
        };
        if let Some(p) = problem {
            failures.push(format!("case {case} ({}): {p}", m.what));
        }
    }
    std::panic::set_hook(hook);
    println!("{names}: {cases} mutations (kind: loaded / refused): {tally:?}");
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed:\n{}",
        failures.len(),
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A safetensors file: the 8-byte header length, the JSON header, the data section.
struct Safetensors {
    header: serde_json::Map<String, Value>,
    data: Vec<u8>,
}

impl Safetensors {
    fn parse(bytes: &[u8]) -> Self {
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        Self {
            header: serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
            data: bytes[8 + n..].to_vec(),
        }
    }

    fn header_len(bytes: &[u8]) -> usize {
        8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
    }

    fn to_bytes(&self) -> Vec<u8> {
        let header = serde_json::to_vec(&self.header).unwrap();
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend(header);
        out.extend(&self.data);
        out
    }

    fn tensor_names(&self) -> Vec<String> {
        self.header
            .keys()
            .filter(|k| *k != "__metadata__")
            .cloned()
            .collect()
    }

    /// The data range of tensor `name`.
    fn range(&self, name: &str) -> std::ops::Range<usize> {
        let o = &self.header[name]["data_offsets"];
        o[0].as_u64().unwrap() as usize..o[1].as_u64().unwrap() as usize
    }
}

fn pick<'a, T>(rng: &mut StdRng, items: &'a [T]) -> &'a T {
    &items[rng.random_range(0..items.len())]
}

fn flip_bits(rng: &mut StdRng, bytes: &mut [u8], range: std::ops::Range<usize>, bits: usize) {
    for _ in 0..bits {
        let at = rng.random_range(range.clone());
        bytes[at] ^= 1 << rng.random_range(0..8);
    }
}

const HUGE: [u64; 6] = [
    u64::MAX,
    1 << 63,
    1 << 40,
    1 << 32,
    0xFFFF_FFFF,
    123_456_789_012,
];

/// A mutation any safetensors file can get; `data_is_checked` says whether a flipped data bit
/// must be refused (the pack's checksums) or may load (a checkpoint's weights).
fn mutate_safetensors(rng: &mut StdRng, valid: &[u8], data_is_checked: bool) -> Mutation {
    let header_end = Safetensors::header_len(valid);
    let mut bytes = valid.to_vec();
    let mut st = Safetensors::parse(valid);
    let names = st.tensor_names();
    let name = pick(rng, &names).clone();
    match rng.random_range(0..7) {
        0 => {
            let cut = rng.random_range(0..valid.len());
            bytes.truncate(cut);
            Mutation::new(format!("truncate: at {cut}"), bytes, true)
        }
        1 => {
            let bits = rng.random_range(1..=4);
            flip_bits(rng, &mut bytes, 0..header_end, bits);
            Mutation::new(format!("header bit flips: {bits}"), bytes, false)
        }
        2 => {
            let bits = rng.random_range(1..=8);
            flip_bits(rng, &mut bytes, header_end..valid.len(), bits);
            Mutation::new(format!("data bit flips: {bits}"), bytes, data_is_checked)
        }
        3 => {
            let n = (header_end - 8) as u64;
            let delta = rng.random_range(1..64u64);
            let random: u64 = rng.random();
            let lie = *pick(
                rng,
                &[n + delta, n - delta.min(n), 0, valid.len() as u64, random],
            );
            let lie = if lie == n { lie + 1 } else { lie };
            let lie = if rng.random_bool(0.3) {
                *pick(rng, &HUGE)
            } else {
                lie
            };
            bytes[..8].copy_from_slice(&lie.to_le_bytes());
            Mutation::new(format!("lying header length: {lie}"), bytes, true)
        }
        4 => {
            let r = st.range(&name);
            let (s, e) = (r.start as u64, r.end as u64);
            let k = rng.random_range(1..4096u64);
            let huge = *pick(rng, &HUGE);
            let lie = *pick(
                rng,
                &[
                    [s, e + k],
                    [s + k, e],
                    [e, s],
                    [0, huge],
                    [huge, huge.saturating_add(e - s)],
                    [s, e.saturating_sub(k).max(s + 1)],
                ],
            );
            let lie = if lie == [s, e] { [s, e + 1] } else { lie };
            st.header[&name]["data_offsets"] = json!(lie);
            Mutation::new(
                format!("lying data offsets: {name} {lie:?}"),
                st.to_bytes(),
                true,
            )
        }
        5 => {
            let shape = st.header[&name]["shape"].as_array().unwrap().clone();
            let mut shape: Vec<u64> = shape.iter().map(|d| d.as_u64().unwrap()).collect();
            let huge = *pick(rng, &HUGE);
            if shape.is_empty() || rng.random_bool(0.2) {
                shape.push(huge);
            } else {
                let i = rng.random_range(0..shape.len());
                shape[i] = huge;
            }
            st.header[&name]["shape"] = json!(shape);
            Mutation::new(
                format!("huge dimension: {name} {shape:?}"),
                st.to_bytes(),
                true,
            )
        }
        _ => {
            let dtypes = [
                "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8",
                "BOOL", "F8_E4M3", "F8_E5M2", "F4", "X32", "", "f32",
            ];
            let old = st.header[&name]["dtype"].as_str().unwrap().to_string();
            let dtype = *pick(rng, &dtypes);
            let dtype = if dtype == old { "X32" } else { dtype };
            st.header[&name]["dtype"] = json!(dtype);
            // The pack checks every dtype; a checkpoint may hold a same-sized other dtype.
            Mutation::new(
                format!("wrong dtype: {name} {old} -> {dtype}"),
                st.to_bytes(),
                data_is_checked,
            )
        }
    }
}

/// A valid pack of the synthetic tiny model (2 MoE layers × 8 experts, H 256, I 128) with
/// groups of 32 (more scales to damage).
fn tiny_pack(path: &Path) -> (Vec<u8>, ExpertLayout) {
    let synth = SyntheticModel::new(SyntheticKind::Tiny, 7, GroupSize::new(32).unwrap()).unwrap();
    synth.pack().save(path).unwrap();
    (std::fs::read(path).unwrap(), synth.pack().meta().layout)
}

/// A mutation only a pack can get: metadata edits, a NaN/infinite scale under a fixed-up
/// checksum, 200 bytes overwritten inside one expert's slab.
fn mutate_pack_contents(rng: &mut StdRng, valid: &[u8], layout: ExpertLayout) -> Mutation {
    let mut st = Safetensors::parse(valid);
    let layers = [0usize, 1];
    let (layer, e) = (*pick(rng, &layers), rng.random_range(0..8usize));
    let slab_bytes = layout.slab_bytes();
    let slabs = st.range(&format!("layers.{layer}.experts"));
    let slab = slabs.start + e * slab_bytes..slabs.start + (e + 1) * slab_bytes;
    let names_expert = Some(format!("layer {layer}, expert {e}"));
    match rng.random_range(0..3) {
        0 => {
            let meta = st.header["__metadata__"].as_object_mut().unwrap();
            let keys: Vec<String> = meta.keys().cloned().collect();
            let key = pick(rng, &keys).clone();
            let free_text = key == "source_model" || key == "source_revision";
            if rng.random_bool(0.2) {
                meta.remove(&key);
                return Mutation::new(format!("metadata removed: {key}"), st.to_bytes(), true);
            }
            let values = [
                "",
                "0",
                "-1",
                "18446744073709551615",
                "99999999999999999999999",
                "4294967296",
                "1e3",
                "nan",
                "[1,1]",
                "[]",
                "{}",
                "ÿ€ÿ€ÿ€ÿ€ÿ€ÿ€ÿ€",
            ];
            let value = *pick(rng, &values);
            meta.insert(key.clone(), json!(value));
            Mutation::new(
                format!("metadata edit: {key} = {value:?}"),
                st.to_bytes(),
                !free_text,
            )
        }
        1 => {
            let o = layout.offsets();
            let (start, count) = match rng.random_bool(0.5) {
                true => (o.gate_up_scales, layout.gate_up().scale_count()),
                false => (o.down_scales, layout.down().scale_count()),
            };
            let at = slab.start + start + 2 * rng.random_range(0..count);
            let bits: u16 = *pick(rng, &[0x7e00, 0x7c00, 0xfc00, 0x7c01]);
            st.data[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            let sum = slab_checksum(&st.data[slab.clone()]);
            let sums = st.range(&format!("layers.{layer}.checksums"));
            let at = sums.start + 4 * e;
            st.data[at..at + 4].copy_from_slice(&sum.to_le_bytes());
            let mut m = Mutation::new(
                format!("non-finite scale: {bits:#06x} layer {layer} expert {e}"),
                st.to_bytes(),
                true,
            );
            m.must_say = names_expert;
            m
        }
        _ => {
            for _ in 0..200 {
                let at = rng.random_range(slab.clone());
                st.data[at] = st.data[at].wrapping_add(rng.random_range(1..=255));
            }
            let mut m = Mutation::new(
                format!("200 bytes of expert data: layer {layer} expert {e}"),
                st.to_bytes(),
                true,
            );
            m.must_say = names_expert;
            m
        }
    }
}

/// A fresh folder `tag` holding a valid tiny pack: its folder, its path, its parsed bytes and
/// its layout.
fn tiny_pack_in(tag: &str) -> (PathBuf, PathBuf, Safetensors, ExpertLayout) {
    let dir = temp_dir(tag);
    let path = dir.join("tiny.qmoe");
    let (valid, layout) = tiny_pack(&path);
    (dir, path, Safetensors::parse(&valid), layout)
}

#[test]
fn damaged_packs_are_refused_naming_the_file() {
    let dir = temp_dir("pack");
    let path = dir.join("tiny.qmoe");
    let (valid, layout) = tiny_pack(&path);
    let mut rng = rng(1);
    let names = path.display().to_string();
    fuzz(
        &path,
        &names,
        iterations(1500),
        |rng| match rng.random_bool(0.6) {
            true => mutate_safetensors(rng, &valid, true),
            false => mutate_pack_contents(rng, &valid, layout),
        },
        &mut rng,
        || PackFile::open(&path)?.verify(),
        |e| matches!(e, QmoeError::CorruptPack { path: p, .. } if p == &path),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A copy of the `fixture` checkpoint in a fresh folder.
fn checkpoint_copy(fixture: &str, tag: &str) -> PathBuf {
    let dir = temp_dir(&format!("{fixture}-{tag}"));
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir(fixture).join(f), dir.join(f)).unwrap();
    }
    dir
}

/// The decoder layers a checkpoint stores are counted from its headers, so that a config with a
/// smaller `num_hidden_layers` (a model silently cut short) can be named at load.
#[test]
fn stored_decoder_layers_are_counted_from_the_headers() {
    for name in FIXTURES {
        let cfg = AnyConfig::from_file(fixture_dir(name).join("config.json")).unwrap();
        let layers = cfg.spec().unwrap().num_layers();
        assert_eq!(
            models::stored_decoder_layers(fixture_dir(name)).unwrap(),
            layers,
            "{name}"
        );
    }
    let empty = temp_dir("no-checkpoint");
    let e = models::stored_decoder_layers(&empty)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&empty.display().to_string()), "{e}");
    // A shard whose header cannot be read is named, with what is wrong with it.
    let header = |len: u64, rest: &[u8]| [&len.to_le_bytes()[..], rest].concat();
    let broken: [(&str, Vec<u8>, &str); 4] = [
        ("short", b"abc".to_vec(), "not a readable safetensors file"),
        (
            "cut",
            header(1000, b"{\"a\": 1"),
            "the file ends inside its 1000-byte header",
        ),
        (
            "huge",
            header(u64::MAX, b"{}"),
            "more than a safetensors header may hold",
        ),
        ("array", header(2, b"[]"), "not a JSON object"),
    ];
    for (tag, bytes, why) in broken {
        let dir = checkpoint_copy(FIXTURES[0], &format!("header-{tag}"));
        let shard = dir.join("model.safetensors");
        std::fs::write(&shard, bytes).unwrap();
        let e = models::stored_decoder_layers(&dir).unwrap_err();
        assert!(
            matches!(e, QmoeError::InvalidCheckpoint { .. }),
            "{tag}: {e:?}"
        );
        let e = e.to_string();
        assert!(e.contains(why), "{tag}: {e}");
        assert!(e.contains(&shard.display().to_string()), "{tag}: {e}");
    }
}

/// Builds the model of the checkpoint in `dir` with dense experts, as `generate` would.
fn load_checkpoint(dir: &Path) -> candle_qmoe::Result<()> {
    let cfg = AnyConfig::from_file(dir.join("config.json"))?;
    models::fingerprint(dir)?;
    // SAFETY: the files are not modified while the VarBuilder is alive.
    let vb = unsafe { models::mmap_checkpoint(dir, DType::F32, &Device::Cpu)? };
    MoeForCausalLm::new(&cfg, vb, &ExpertsBackend::Dense)?;
    Ok(())
}

/// The variants a damaged checkpoint may be refused with: a config file or value
/// (`InvalidFile`, `UnsupportedConfig`), a tensor (`InvalidCheckpoint`), or a safetensors header
/// Candle cannot read (`Candle`, naming the file).
fn is_checkpoint_error(e: &QmoeError) -> bool {
    matches!(
        e,
        QmoeError::InvalidFile { .. }
            | QmoeError::UnsupportedConfig { .. }
            | QmoeError::InvalidCheckpoint { .. }
            | QmoeError::Candle(_)
    )
}

/// A random edit of a `config.json`: truncation, a flipped byte, or a key removed or given a
/// value of the wrong type or an absurd size.
fn mutate_config(rng: &mut StdRng, valid: &[u8]) -> Mutation {
    let mut bytes = valid.to_vec();
    match rng.random_range(0..5) {
        0 => {
            let end = valid.iter().rposition(|&b| b == b'}').unwrap() + 1;
            let cut = rng.random_range(0..end);
            bytes.truncate(cut);
            Mutation::new(format!("truncate: at {cut}"), bytes, true)
        }
        1 => {
            flip_bits(rng, &mut bytes, 0..valid.len(), 1);
            Mutation::new("byte flip", bytes, false)
        }
        _ => {
            let mut config: serde_json::Map<String, Value> = serde_json::from_slice(valid).unwrap();
            let keys: Vec<String> = config.keys().cloned().collect();
            let key = pick(rng, &keys).clone();
            let values = [
                json!(u64::MAX),
                json!(1u64 << 40),
                json!(1u64 << 32),
                json!(1e300),
                json!(-1),
                json!(0),
                json!(2.5),
                json!(f64::MIN_POSITIVE),
                json!("many"),
                json!([1, 2]),
                json!({"type": "yarn", "factor": 4.0}),
                json!(true),
                Value::Null,
            ];
            let value = pick(rng, &values).clone();
            let what = if rng.random_bool(0.15) {
                config.remove(&key);
                format!("json: {key} removed")
            } else {
                let what = format!("json: {key} = {value}");
                config.insert(key, value);
                what
            };
            Mutation::new(what, serde_json::to_vec_pretty(&config).unwrap(), false)
        }
    }
}

/// Fuzzes `file` of a copy of the `fixture` checkpoint with `cases` mutations from `mutate`,
/// loading the whole checkpoint each time; errors must name the checkpoint's folder.
fn fuzz_checkpoint_file(
    fixture: &str,
    file: &str,
    stream: u64,
    cases: usize,
    mutate: impl Fn(&mut StdRng, &[u8]) -> Mutation,
) {
    let dir = checkpoint_copy(fixture, file);
    let path = dir.join(file);
    let valid = std::fs::read(&path).unwrap();
    fuzz(
        &path,
        &dir.display().to_string(),
        cases,
        |rng| mutate(rng, &valid),
        &mut rng(stream),
        || load_checkpoint(&dir),
        is_checkpoint_error,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every family's config, a quarter of the default mutations each (OLMoE's on the stream it
/// always had).
#[test]
fn damaged_configs_are_refused_naming_the_file() {
    for (stream, fixture) in [2, 10, 11, 12, 13].into_iter().zip(FIXTURES) {
        let cases = iterations(250);
        fuzz_checkpoint_file(fixture, "config.json", stream, cases, mutate_config);
    }
}

#[test]
fn damaged_checkpoints_are_refused_naming_the_file() {
    let cases = iterations(400);
    fuzz_checkpoint_file("olmoe-tiny", "model.safetensors", 3, cases, |rng, valid| {
        mutate_safetensors(rng, valid, false)
    });
}

/// A `config.json` of a family no port implements is refused naming its `model_type` (or, without
/// one, its architecture), the supported model types and the file.
#[test]
fn unsupported_families_are_refused_naming_the_type() {
    let dir = checkpoint_copy("olmoe-tiny", "families");
    let path = dir.join("config.json");
    let valid: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let supported = format!("{:?}", models::SUPPORTED_MODEL_TYPES);
    for (model_type, architecture) in [
        ("deepseek_v3", "DeepseekV3ForCausalLM"),
        ("qwen3_next", "Qwen3NextForCausalLM"),
        ("gpt_oss", "GptOssForCausalLM"),
    ] {
        let mut config = valid.clone();
        config["model_type"] = model_type.into();
        config["architectures"] = json!([architecture]);
        let mut without_type = config.clone();
        without_type.as_object_mut().unwrap().remove("model_type");
        for (config, field, value) in [
            (config, "model_type", model_type),
            (without_type, "architectures", architecture),
        ] {
            std::fs::write(&path, config.to_string()).unwrap();
            let e = AnyConfig::from_file(&path).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(&e, QmoeError::UnsupportedConfig { field: f, value: v, .. }
                    if f == field && v == value),
                "{msg}"
            );
            for needle in [value, &supported, &path.display().to_string()] {
                assert!(msg.contains(needle), "`{needle}` not in: {msg}");
            }
            let e = format!("{:#}", load_checkpoint(&dir).unwrap_err());
            assert!(e.contains(value) && e.contains(field), "{e}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A config.json that is JSON but not an object is refused as such, naming the file and what
/// it holds (not as an unsupported `architectures`).
#[test]
fn a_config_that_is_not_an_object_is_refused_as_such() {
    let dir = temp_dir("config-not-object");
    let path = dir.join("config.json");
    for (text, found) in [
        ("[]", "a list"),
        ("null", "null"),
        ("\"olmoe\"", "a string"),
        ("7", "a number"),
    ] {
        std::fs::write(&path, text).unwrap();
        let msg = AnyConfig::from_file(&path).unwrap_err().to_string();
        for needle in [found, "not a JSON object", &path.display().to_string()] {
            assert!(msg.contains(needle), "{text}: `{needle}` not in: {msg}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A folder given as a pack is refused as a folder, naming it.
#[test]
fn a_folder_given_as_a_pack_is_refused_as_such() {
    let dir = temp_dir("pack-folder");
    for open in [PackFile::open, PackFile::open_in_memory] {
        let e = open(&dir).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(&e, QmoeError::CorruptPack { path, .. } if path == &dir),
            "{msg}"
        );
        assert!(msg.contains("a folder, not a .qmoe file"), "{msg}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pack whose expert 5 of layer 1 has 200 bytes overwritten loads (only the header is read),
/// computes with the other experts, and refuses the damaged one when it is first read — by the
/// CPU kernel, by a residency miss, or by an eager `verify`, mapped or read into memory —
/// naming the file, layer and expert.
#[test]
fn a_corrupt_expert_is_refused_when_first_read() {
    let (dir, path, mut st, layout) = tiny_pack_in("lazy");
    let slabs = st.range("layers.1.experts");
    let slab = slabs.start + 5 * layout.slab_bytes();
    let mut rng = rng(4);
    for _ in 0..200 {
        let at = slab + rng.random_range(0..layout.slab_bytes());
        st.data[at] ^= 0x5a;
    }
    std::fs::write(&path, st.to_bytes()).unwrap();
    let expect = |e: &QmoeError| {
        let msg = e.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("layer 1, expert 5"),
            "{msg}"
        );
        assert!(
            matches!(e, QmoeError::CorruptPack { path: p, reason }
                if p == &path && reason.starts_with("layer 1, expert 5: corrupt slab")),
            "{e:?}"
        );
    };
    let expect_inside = |e: candle::Error| expect(QmoeError::find(&e).expect("a QmoeError"));

    let pack = Arc::new(PackFile::open(&path).unwrap());
    let layer = pack.layer(1).unwrap();
    let h = layout.hidden;
    let xs = Tensor::from_vec(
        candle_qmoe::synthetic::gaussian(5, 2 * h, 1.0),
        (2, h),
        &Device::Cpu,
    )
    .unwrap();
    let w = Tensor::new(&[[0.7f32, 0.3], [0.6, 0.4]], &Device::Cpu).unwrap();
    let good = Tensor::new(&[[0u32, 3], [7, 3]], &Device::Cpu).unwrap();
    let bad = Tensor::new(&[[0u32, 3], [5, 3]], &Device::Cpu).unwrap();

    // The CPU kernel: experts 0, 3, 7 verify and compute; expert 5 is refused.
    let cpu = Int4Experts::new(layer.clone());
    cpu.forward(&xs, &good, &w).unwrap();
    assert!([0, 3, 7].iter().all(|&e| layer.is_verified(e)));
    assert!(!layer.is_verified(5));
    expect_inside(cpu.forward(&xs, &bad, &w).unwrap_err());

    // A residency miss: 4 slots hold experts 0..4, so expert 5 is copied in on demand.
    let opts = ResidencyOptions {
        resident: Resident::Uniform(4),
        ..Default::default()
    };
    let fresh = PackFile::open(&path).unwrap();
    let resident = Residency::new(opts)
        .host_layer(1, 2, fresh.layer(1).unwrap())
        .unwrap();
    resident.forward(&xs, &good, &w).unwrap();
    expect_inside(resident.forward(&xs, &bad, &w).unwrap_err());

    // Eagerly: every slab at once.
    expect(&PackFile::open(&path).unwrap().verify().unwrap_err());

    // Read into memory at open: the same checks, on first use and eagerly.
    let read = PackFile::open_in_memory(&path).unwrap();
    let cpu = Int4Experts::new(read.layer(1).unwrap());
    cpu.forward(&xs, &good, &w).unwrap();
    expect_inside(cpu.forward(&xs, &bad, &w).unwrap_err());
    expect(
        &PackFile::open_in_memory(&path)
            .unwrap()
            .verify()
            .unwrap_err(),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pack of the format before checksums (version 1) is refused with a clear way out.
#[test]
fn a_pack_without_checksums_asks_to_requantize() {
    let (dir, path, mut st, _) = tiny_pack_in("v1");
    st.header["__metadata__"]["format_version"] = json!("1");
    std::fs::write(&path, st.to_bytes()).unwrap();
    let e = PackFile::open(&path).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string())
            && msg.contains("format version 1 has no expert checksums")
            && msg.contains("re-run quantize"),
        "{msg}"
    );
    assert!(
        matches!(&e, QmoeError::CorruptPack { path: p, .. } if p == &path),
        "{e:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `fixture`'s checkpoint copied with tensor `name` stored as I16: the same bytes, read as
/// integers.
fn checkpoint_with_integer_tensor(fixture: &str, name: &str) -> PathBuf {
    let dir = checkpoint_copy(fixture, "integer-tensor");
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::BF16, "the fixtures are BF16");
            let dtype = if n == name {
                safetensors::Dtype::I16
            } else {
                v.dtype()
            };
            let view = safetensors::tensor::TensorView::new(dtype, v.shape().to_vec(), v.data());
            (n, view.unwrap())
        })
        .collect();
    assert!(views.iter().any(|(n, _)| n == name), "no tensor {name}");
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

/// A weight the model reads stored as integers is refused by name, not converted to floats and
/// used.
#[test]
fn an_integer_weight_is_refused_by_name() {
    let name = "model.layers.0.self_attn.q_proj.weight";
    let dir = checkpoint_with_integer_tensor("olmoe-tiny", name);
    let err = load_checkpoint(&dir).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, QmoeError::InvalidCheckpoint { .. })
            && msg.contains(name)
            && msg.contains("I16")
            && msg.contains("weights must be F64, F32, BF16 or F16"),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A shard index whose `weight_map` leads out of the checkpoint folder is refused naming the
/// shard: no file outside the folder is opened.
#[test]
fn shards_outside_the_checkpoint_folder_are_refused() {
    let dir = checkpoint_copy("olmoe-tiny", "shard-paths");
    let single = dir.join(models::checkpoint::SINGLE_FILE);
    std::fs::rename(&single, dir.join("model-00001-of-00001.safetensors")).unwrap();
    let outside = dir.parent().unwrap().join("qmoe-outside.safetensors");
    for shard in [
        "../qmoe-outside.safetensors".to_string(),
        outside.display().to_string(),
        "sub/../model-00001-of-00001.safetensors".to_string(),
    ] {
        let index = json!({ "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00001.safetensors",
            "lm_head.weight": shard,
        }});
        std::fs::write(
            dir.join(models::checkpoint::INDEX_FILE),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
        let err = models::checkpoint::checkpoint_files(&dir).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(&err, QmoeError::InvalidFile { .. })
                && msg.contains(&shard)
                && msg.contains("not a file name inside"),
            "{shard}: {msg}"
        );
        // The same rule guards the hub download of an index's shards.
        assert!(!models::checkpoint::is_shard_file_name(&shard), "{shard}");
    }
    assert!(models::checkpoint::is_shard_file_name(
        "model-00001-of-00001.safetensors"
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Quantizing onto a file the checkpoint is read from is refused, and the file stays as it was.
#[test]
fn a_pack_is_not_written_over_its_own_checkpoint() {
    let dir = checkpoint_copy("olmoe-tiny", "pack-over-source");
    let opts = models::QuantizeOptions::default();
    for victim in ["model.safetensors", "config.json"] {
        let path = dir.join(victim);
        let before = std::fs::read(&path).unwrap();
        let err = models::quantize_checkpoint_to_file(&dir, &path, &opts, &|_, _| {}).unwrap_err();
        assert!(
            matches!(&err, QmoeError::InvalidArgument { reason, .. }
                if reason.contains("a file of the checkpoint being quantized")),
            "{victim}: {err}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            before,
            "{victim} was changed"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A config that claims far more experts than the checkpoint holds is refused naming a missing
/// tensor (the last expert's: the headers are searched from the end), before the (here 50 GB) layer would be allocated.
#[test]
fn more_experts_in_the_config_than_the_checkpoint_are_refused_by_name() {
    let dir = checkpoint_copy("olmoe-tiny", "too-many-experts");
    let config = dir.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    cfg["num_experts"] = json!(1_000_000);
    std::fs::write(&config, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let opts = models::QuantizeOptions::default();
    let out = dir.join("tiny.qmoe");
    let err = models::quantize_checkpoint_to_file(&dir, &out, &opts, &|_, _| {}).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("experts.999999."), "{msg}");
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Logits holding a NaN or an infinity are refused naming the position and the first token
/// id; finite ones pass.
#[test]
fn non_finite_logits_are_refused_by_position_and_token() {
    use candle_qmoe::generation::check_logits;
    let mut values: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin() * 8.0).collect();
    let tensor = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
    check_logits(&tensor(&values), 3).unwrap();
    check_logits(&tensor(&values).to_dtype(DType::BF16).unwrap(), 3).unwrap();
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        values[300] = bad;
        values[301] = f32::NAN;
        let err = check_logits(&tensor(&values), 17).unwrap_err();
        match QmoeError::find(&err) {
            Some(QmoeError::NonFiniteLogits {
                position: 17,
                token: 300,
                value,
            }) if value.to_bits() == bad.to_bits() || (value.is_nan() && bad.is_nan()) => {}
            other => panic!("{bad}: {other:?}"),
        }
        values[301] = 0.5;
    }
}

/// A Mixtral config without its expert count is refused under Mixtral's own name for it.
#[test]
fn a_mixtral_config_without_experts_names_num_local_experts() {
    let path = fixture_dir("mixtral-tiny").join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    assert!(cfg
        .as_object_mut()
        .unwrap()
        .remove("num_local_experts")
        .is_some());
    let err = AnyConfig::from_json_str(&cfg.to_string()).unwrap_err();
    assert!(
        err.to_string()
            .contains("missing field `num_local_experts`"),
        "{err}"
    );
}

/// A pack made before the checkpoint's experts were changed in place (same config.json, same
/// routers) is refused: the fingerprint samples the expert weights. Every expert weight of the
/// OLMoE and GraniteMoE fixtures zeroed, and separately 8 bytes flipped in the middle of one
/// sampled weight (GraniteMoE's: expert 0's down projection, inside the fused `output_linear`).
#[test]
fn a_pack_of_experts_changed_since_is_refused() {
    for (fixture, flip, experts) in [
        (
            "olmoe-tiny",
            "model.layers.1.mlp.experts.0.down_proj.weight",
            1,
        ),
        (
            "granitemoe-tiny",
            "model.layers.1.block_sparse_moe.output_linear.weight",
            8,
        ),
    ] {
        experts_changed_since_the_pack(fixture, flip, experts);
    }
}

/// [`a_pack_of_experts_changed_since_is_refused`] on `fixture`, flipping bytes of `flip` in the
/// middle of its first `1 / experts` (expert 0's matrix in a fused tensor).
fn experts_changed_since_the_pack(fixture: &str, flip: &str, experts: usize) {
    let dir = checkpoint_copy(fixture, "experts-changed");
    let pack = dir.join("tiny.qmoe");
    let opts = models::QuantizeOptions::default();
    models::quantize_checkpoint_to_file(&dir, &pack, &opts, &|_, _| {}).unwrap();
    let file = PackFile::open(&pack).unwrap();
    let meta = file.meta().clone();
    let check = || {
        let now = models::fingerprint(&dir).unwrap();
        let (h, i) = (meta.layout.hidden, meta.layout.intermediate);
        file.check_source(&now, h, i, meta.num_experts)
    };
    check().unwrap();
    let st_path = dir.join("model.safetensors");
    let original = std::fs::read(&st_path).unwrap();
    let changed = |change: &dyn Fn(&mut Safetensors)| {
        let mut st = Safetensors::parse(&original);
        change(&mut st);
        st.to_bytes()
    };
    let is_expert = |n: &str| n.contains(".experts.") || n.ends_with("_linear.weight");
    let zeroed = changed(&|st| {
        let names = st.tensor_names().into_iter().filter(|n| is_expert(n));
        for name in names.collect::<Vec<_>>() {
            let r = st.range(&name);
            st.data[r].fill(0);
        }
    });
    let flipped = changed(&|st| {
        let r = st.range(flip);
        let mid = r.start + r.len() / experts / 2;
        st.data[mid - 4..mid + 4]
            .iter_mut()
            .for_each(|b| *b ^= 0x55);
    });
    for (what, bytes) in [("zeroed experts", zeroed), ("flipped bytes", flipped)] {
        std::fs::write(&st_path, bytes).unwrap();
        let e = check().unwrap_err();
        assert!(
            matches!(&e, QmoeError::PackMismatch { reason, .. }
                if reason.contains("expert weights changed since this pack was made")),
            "{fixture} {what}: {e}"
        );
        assert!(
            e.to_string().contains("re-run quantize"),
            "{fixture} {what}: {e}"
        );
    }
    std::fs::write(&st_path, &original).unwrap();
    check().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A non-finite expert weight is refused naming where it lies — the expert's own tensor, or for
/// fused experts the fused tensor with the expert and its projection's rows — both when a pack
/// is written and when the experts are quantized at load.
#[test]
fn a_non_finite_expert_weight_is_refused_naming_where_it_lies() {
    // Row 3, column 7 of expert 5's up projection (H 256; OLMoE I 128, GraniteMoE I 192, whose
    // `input_linear` holds each expert's 192 gate rows, then its 192 up rows).
    let cases = [
        (
            "olmoe-tiny",
            "model.layers.1.mlp.experts.5.up_proj.weight",
            3 * 256 + 7,
            "`model.layers.1.mlp.experts.5.up_proj.weight` (shape [128, 256])",
        ),
        (
            "granitemoe-tiny",
            "model.layers.1.block_sparse_moe.input_linear.weight",
            (5 * 384 + 192 + 3) * 256 + 7,
            "`model.layers.1.block_sparse_moe.input_linear.weight[5, 192..384]` (shape [192, 256])",
        ),
    ];
    for (fixture, tensor, element, named) in cases {
        let dir = checkpoint_copy(fixture, "non-finite-expert");
        let st_path = dir.join("model.safetensors");
        let mut st = Safetensors::parse(&std::fs::read(&st_path).unwrap());
        let at = st.range(tensor).start + 2 * element;
        st.data[at..at + 2].copy_from_slice(&0x7fc0u16.to_le_bytes()); // a BF16 NaN
        std::fs::write(&st_path, st.to_bytes()).unwrap();
        let expected = format!("{named} holds a non-finite value at flat index 775");

        let opts = models::QuantizeOptions::default();
        let pack = dir.join("tiny.qmoe");
        let err = models::quantize_checkpoint_to_file(&dir, &pack, &opts, &|_, _| {}).unwrap_err();
        assert!(
            matches!(err, QmoeError::NonFinite { .. }) && err.to_string().contains(&expected),
            "{fixture}, written to a pack: {err}"
        );
        assert!(!pack.exists(), "{fixture}: a pack was left behind");

        let cfg = AnyConfig::from_file(dir.join("config.json")).unwrap();
        // SAFETY: the files are not modified while the VarBuilder is alive.
        let vb = unsafe { models::mmap_checkpoint(&dir, DType::F32, &Device::Cpu).unwrap() };
        let int4 = ExpertsBackend::int4(GroupSize::default());
        let err = MoeForCausalLm::new(&cfg, vb, &int4).err().unwrap();
        assert!(
            err.to_string().contains(&expected),
            "{fixture}, quantized at load: {err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
