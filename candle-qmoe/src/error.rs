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
}

impl From<QmoeError> for candle::Error {
    fn from(e: QmoeError) -> Self {
        candle::Error::wrap(e)
    }
}
