//! Errors raised by candle-qmoe, convertible into [`candle::Error`].

/// Every problem candle-qmoe reports by name: bad shapes, bad configs, corrupt packs.
#[derive(Debug, thiserror::Error)]
pub enum QmoeError {
    /// A tensor has a shape other than the one required.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// Tensor name, e.g. `model.layers.3.mlp.experts.7.up_proj.weight`.
        name: String,
        /// The shape found.
        got: Vec<usize>,
        /// The shape required.
        expected: Vec<usize>,
    },
    /// A tensor holds NaN or infinite values.
    #[error("tensor `{name}` (shape {shape:?}) holds a non-finite value at flat index {index}")]
    NonFinite {
        /// Tensor name.
        name: String,
        /// Tensor shape.
        shape: Vec<usize>,
        /// First offending flat index.
        index: usize,
    },
    /// A configuration value is outside what is supported.
    #[error("unsupported configuration: {0}")]
    Config(String),
    /// A pack is corrupt, truncated, or does not belong to this model.
    #[error("invalid expert pack: {0}")]
    Pack(String),
    /// A memory plan cannot be made or does not fit its budget (see [`crate::plan`]).
    #[error("memory plan: {0}")]
    Plan(String),
    /// The device (or the host memory standing in for it) cannot hold an allocation.
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    /// A host → device copy of an expert failed; the previously published cache stays valid.
    #[error("expert copy failed: {0}")]
    CopyFailed(String),
    /// A residency profile that cannot work (capacity below top-k, staging below one expert).
    #[error("residency profile refused: {0}")]
    Residency(String),
    /// A component of the memory plan does not fit the budget.
    #[error(
        "{component} needs {} but only {} is available: {breakdown}",
        crate::plan::format_bytes(*needed),
        crate::plan::format_bytes(*available)
    )]
    DoesNotFit {
        /// The component that does not fit.
        component: crate::plan::Component,
        /// Bytes it needs.
        needed: u64,
        /// Bytes left for it.
        available: u64,
        /// The budget, the components counted before this one, the plan's table and what would
        /// fit, for people.
        breakdown: String,
    },
}

impl From<QmoeError> for candle::Error {
    fn from(e: QmoeError) -> Self {
        candle::Error::wrap(e)
    }
}
