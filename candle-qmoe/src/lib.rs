//! candle-qmoe: run Mixture-of-Experts LLMs in a fraction of the memory with Candle.
//!
//! * [`pack`] — the INT4 expert pack (4-bit weights, FP16 group scales, one slab per expert).
//! * [`kernels`] — fused top-k W4A16 compute straight from the pack.
//! * [`experts`] — the [`RoutedExperts`] trait with the dense oracle and the INT4 backend.
//! * [`moe`] — [`SparseMoe`]: router → softmax → top-k → routed experts (+ shared expert).
//! * [`linear`] — [`DenseLinear`]: the non-expert projections, BF16 weights with F32
//!   activations on the CPU through our own kernel.
//! * [`mlp`] — the gated SiLU MLP used by dense layers and shared experts.
//! * [`residency`] — a bounded per-layer cache of experts in device memory over the immutable
//!   host pack: slots, staging, safe publication, eviction policies, prefetch, hybrid compute.
//! * [`models`] — Candle-style OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral and GraniteMoE ports on
//!   [`SparseMoe`], checkpoint loading, fingerprints and `.qmoe` packs of a checkpoint's experts.
//! * [`generation`] — the generation loop with prefill/decode timings.
//! * [`pool`] — rayon's pool, where the CPU kernels run: driving a model from it, and its
//!   workers kept awake through a model step.
//! * [`profile`] — an opt-in tally of wall time per part of the forward pass (`--profile`).
//! * [`parity`] — fidelity metrics against a transformers golden file.
//! * [`plan`] — memory prediction per component and the fit of the expert cache to a budget.
//! * [`synthetic`] — deterministic random weights and routings with realistic scales, and whole
//!   synthetic models with the real shapes, in memory or written as Hugging Face checkpoints.
//! * [`safetensors_writer`] — safetensors files written tensor by tensor (checkpoints, packs).
//! * [`error`] — [`QmoeError`], one variant per kind of problem: loading, configuration and pack
//!   APIs return [`Result`]; compute paths return `candle::Result`, from whose errors
//!   [`QmoeError::find`] recovers ours.
//!
//! # From a model folder to a model with INT4 experts
//!
//! The routed experts come from a `.qmoe` pack (quantized once, memory-mapped afterwards; a pack
//! made from another checkpoint is refused), everything else from the memory-mapped checkpoint.
//! The example runs offline on the synthetic tiny model, which has OLMoE's layout and
//! vocabulary but random weights (so its tokens are nonsense).
//!
//! ```
//! use std::path::Path;
//! use std::sync::Arc;
//!
//! use candle::{DType, Device};
//! use candle_qmoe::generation::{argmax, generate};
//! use candle_qmoe::models::{self, AnyConfig, MoeForCausalLm, PackedExperts, QuantizeOptions};
//! use candle_qmoe::pack::{GroupSize, PackFile};
//! use candle_qmoe::synthetic::{SyntheticKind, SyntheticModel};
//!
//! /// A Hugging Face checkpoint folder (OLMoE, Qwen1.5-MoE, Qwen3-MoE, Mixtral or GraniteMoE)
//! /// with its experts from the pack at `pack_path`, which is created on first use.
//! /// (The loading steps fail with a `QmoeError`, which `?` turns into a `candle::Error`.)
//! fn from_folder(dir: &Path, pack_path: &Path, device: &Device) -> candle::Result<MoeForCausalLm> {
//!     if !pack_path.exists() {
//!         let opts = QuantizeOptions { group_size: GroupSize::new(128)?, ..Default::default() };
//!         models::quantize_checkpoint(dir, &opts, &|_done, _total| {})?.save(pack_path)?;
//!     }
//!     let pack = Arc::new(PackFile::open(pack_path)?);
//!     let experts = PackedExperts::for_checkpoint(pack, dir)?;
//!     let config = AnyConfig::from_file(dir.join("config.json"))?;
//!     // SAFETY: the checkpoint files are not modified while the model is alive.
//!     let vb = unsafe { models::mmap_checkpoint(dir, DType::BF16, device)? };
//!     MoeForCausalLm::new(&config, vb, &experts)
//! }
//!
//! # fn main() -> candle::Result<()> {
//! # let _ = from_folder;
//! // Offline: a synthetic model whose experts are generated directly as INT4 slabs.
//! let synth = SyntheticModel::new(SyntheticKind::Tiny, 42, GroupSize::default())?;
//! let mut model = synth.load(DType::F32, &Device::Cpu, &synth.int4_experts())?;
//!
//! // A few greedy tokens with the KV cache.
//! let prompt = [50279u32, 510, 3158, 8516];
//! let out = generate(&mut model, &prompt, 5, &[], argmax, |_token| Ok(()))?;
//! assert_eq!(out.tokens.len(), 5);
//! println!("{:?}, {:.1} tok/s", out.tokens, out.decode_tokens_per_s().unwrap());
//! # Ok(()) }
//! ```
//!
//! # Memory-mapped files
//!
//! Checkpoints and packs are read through memory maps, which are sound only while no one
//! modifies or truncates the file underneath. Where the map outlives the call, the caller holds
//! that promise, and the function is `unsafe`: [`models::mmap_checkpoint`] and
//! [`models::CheckpointTensors::open`]. [`models::fingerprint`] and
//! [`models::quantize_checkpoint`] map the checkpoint only for the length of the call (the same
//! promise, for that long); [`models::stored_decoder_layers`] reads the headers without mapping.
//! [`pack::PackFile::open`] is safe to call: a pack is never modified in place, since this
//! crate's writers write a hidden `.NAME.partial` file and rename it over the old one, which
//! leaves an open map on the old file's bytes; a pack rewritten in place by another program is
//! outside that promise.

#![warn(missing_docs)]

pub mod error;
pub mod experts;
pub mod generation;
pub mod kernels;
pub mod linear;
pub mod mlp;
pub mod models;
pub mod moe;
pub mod pack;
pub mod parity;
pub mod plan;
pub mod pool;
pub mod profile;
pub mod residency;
pub mod safetensors_writer;
pub mod synthetic;

/// The `half` crate of [`f16`](half::f16) scales and [`bf16`](half::bf16) weights in our
/// signatures.
pub use half;
/// The `safetensors` crate of the [`Dtype`](safetensors::Dtype) in our signatures.
pub use safetensors;
/// The `serde_json` crate of the config values in our signatures.
pub use serde_json;

pub use error::{QmoeError, Result};
pub use experts::{DenseExperts, GgmlExperts, Int4Experts, RoutedExperts};
pub use linear::DenseLinear;
pub use models::{MoeForCausalLm, SequenceCache, SequenceInput};
pub use moe::{ExpertTraffic, Routing, SparseMoe};
pub use pack::{ExpertLayout, GroupSize, ScaleSearch};
