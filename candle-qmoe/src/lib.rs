//! candle-qmoe: run Mixture-of-Experts LLMs in a fraction of the memory with Candle.
//!
//! * [`pack`] — the INT4 expert pack (4-bit weights, FP16 group scales, one slab per expert).
//! * [`kernels`] — fused top-k W4A16 compute straight from the pack.
//! * [`experts`] — the [`RoutedExperts`] trait with the dense oracle and the INT4 backend.
//! * [`moe`] — [`SparseMoe`]: router → softmax → top-k → routed experts (+ shared expert).
//! * [`mlp`] — the gated SiLU MLP used by dense layers and shared experts.
//! * [`synthetic`] — deterministic random weights and routings with realistic scales.

pub mod error;
pub mod experts;
pub mod kernels;
pub mod mlp;
pub mod models;
pub mod moe;
pub mod pack;
pub mod synthetic;

pub use error::QmoeError;
pub use experts::{DenseExperts, GgmlExperts, Int4Experts, RoutedExperts};
pub use moe::{Routing, SparseMoe};
pub use pack::{ExpertLayout, GroupSize, ScaleSearch};
