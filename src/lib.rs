//! The library behind candle-qmoe's examples, integration tests and benches, as Candle keeps
//! `candle-examples`: what a command-line program around [`candle_qmoe`] needs and the library
//! itself should not carry.
//!
//! * [`checkpoint`] — a local Hugging Face folder or a hub download, and quantizing its experts.
//! * [`tokenizer`] — the checkpoint's tokenizer or the bundled offline ones.
//! * [`chat`] — the checkpoint's chat template rendered with minijinja, or a built-in one.
//! * [`model`] — the model flags shared by the examples ([`model::ModelArgs`]) and loading.
//! * [`perf`] — the benchmark contract: prompt set, campaign, decode-rate metrics, sweep plot.
//! * [`calibration`] — one measured run of the memory plan on the CPU.
//! * [`system`] — memory, CPU/GPU, driver and commit facts recorded in evidence files.
//! * [`testing`] — deterministic random data and f64 references for the tests and benches.

#![warn(missing_docs)]

pub mod calibration;
pub mod chat;
pub mod checkpoint;
pub mod model;
pub mod perf;
pub mod system;
pub mod testing;
pub mod tokenizer;
