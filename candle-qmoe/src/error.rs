//! Errors raised by candle-qmoe: one [`QmoeError`] variant per kind of problem, so a caller can
//! `match` on what went wrong.
//!
//! Loading, configuration and pack APIs return [`Result`] (`Result<T, QmoeError>`). Compute
//! paths that implement Candle traits (`Module`, custom ops, [`crate::RoutedExperts`], the model
//! and generation) return `candle::Result` as Candle does; a `QmoeError` raised there travels
//! inside the [`candle::Error`] and [`QmoeError::find`] gets it back:
//!
//! ```
//! use candle_qmoe::residency::Resident;
//! use candle_qmoe::QmoeError;
//!
//! let err: candle::Error = "lots".parse::<Resident>().unwrap_err().into();
//! assert!(matches!(
//!     QmoeError::find(&err),
//!     Some(QmoeError::UnsupportedConfig { field, .. }) if field == "residency"
//! ));
//! ```

use std::path::PathBuf;

/// `Result<T, QmoeError>`, what the loading, configuration and pack APIs return.
pub type Result<T> = std::result::Result<T, QmoeError>;

/// Every problem candle-qmoe reports by name: bad shapes, bad configs, corrupt packs, memory
/// that does not suffice.
#[derive(Debug, thiserror::Error)]
pub enum QmoeError {
    /// An error of Candle itself (tensor ops, safetensors, CUDA), passed through unchanged.
    #[error(transparent)]
    Candle(candle::Error),
    /// A file could not be read.
    #[error("cannot read `{path}`: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why (in the message, not a separate source: a report prints it once).
        error: std::io::Error,
    },
    /// A file could not be written.
    #[error("cannot write `{path}`: {error}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why (in the message, not a separate source: a report prints it once).
        error: std::io::Error,
    },
    /// A file is not what it should be (malformed JSON, missing fields, inconsistent contents).
    #[error("invalid {file}: {reason}")]
    InvalidFile {
        /// The file, e.g. `olmoe config.json` or a path.
        file: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint folder lacks a file or tensor it needs.
    #[error("checkpoint `{dir}`: {reason}")]
    InvalidCheckpoint {
        /// The checkpoint folder.
        dir: PathBuf,
        /// What is missing or wrong.
        reason: String,
    },
    /// A configuration value that is not supported, or inconsistent with another one.
    #[error("unsupported configuration: {field} = {value} {reason}")]
    UnsupportedConfig {
        /// The setting, e.g. `num_key_value_heads` or `group size`.
        field: String,
        /// Its value as given.
        value: String,
        /// Why it is refused, e.g. `does not divide num_attention_heads = 16`.
        reason: String,
    },
    /// A tensor has a shape other than the one required.
    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Tensor name, e.g. `model.layers.3.mlp.experts.7.up_proj.weight`.
        tensor: String,
        /// The shape found.
        got: Vec<usize>,
        /// The shape required.
        expected: Vec<usize>,
    },
    /// A tensor holds NaN or infinite values.
    #[error("tensor `{tensor}` (shape {shape:?}) holds a non-finite value at flat index {index}")]
    NonFinite {
        /// Tensor name.
        tensor: String,
        /// Tensor shape.
        shape: Vec<usize>,
        /// First offending flat index.
        index: usize,
    },
    /// A weight too large for an FP16 group scale.
    #[error("tensor `{tensor}` has a weight of magnitude {magnitude}, beyond FP16 scale range")]
    WeightOutOfRange {
        /// Tensor name.
        tensor: String,
        /// The largest magnitude found.
        magnitude: f32,
    },
    /// An argument outside what the function accepts (empty prompt, zero experts, a 1-D
    /// `input_ids`, …).
    #[error("invalid {argument}: {reason}")]
    InvalidArgument {
        /// The argument, e.g. `input_ids` or `prompt`.
        argument: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A backend asked to run on a device it does not support.
    #[error("{backend} cannot run on {device}")]
    UnsupportedDevice {
        /// The backend, e.g. `int4 routed experts`.
        backend: String,
        /// The device, as Candle prints it.
        device: String,
    },
    /// A routing names an expert the layer does not have.
    #[error("expert id {expert} at token {token} is out of range for {num_experts} experts")]
    ExpertOutOfRange {
        /// The token whose routing is wrong.
        token: usize,
        /// The expert id.
        expert: usize,
        /// The layer's experts.
        num_experts: usize,
    },
    /// A routing picks the same expert twice for one token.
    #[error("token {token} routes to expert {expert} twice")]
    DuplicateExpert {
        /// The token whose routing is wrong.
        token: usize,
        /// The repeated expert.
        expert: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary (vocab_size = {vocab_size})")]
    TokenOutOfVocab {
        /// The token id.
        token: i64,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A sequence longer than the model's context.
    #[error(
        "sequence too long: {cached} cached + {new} new tokens exceed the model's context \
         (max_position_embeddings = {context})"
    )]
    ContextExceeded {
        /// Tokens already in the KV cache.
        cached: usize,
        /// Tokens added.
        new: usize,
        /// `max_position_embeddings`.
        context: usize,
    },
    /// The model computed a logit that is NaN or infinite: its weights or inputs hold such
    /// values, or the arithmetic overflowed.
    #[error(
        "the logits of position {position} are not finite ({value} for token id {token}): \
         check the checkpoint's weights for NaN or Inf, or compute in a wider dtype"
    )]
    NonFiniteLogits {
        /// The sequence position whose logits these are.
        position: usize,
        /// The first token id with a non-finite logit.
        token: usize,
        /// Its logit.
        value: f32,
    },
    /// A `.qmoe` file that is corrupt, truncated, of another format version, or not a pack.
    #[error("invalid expert pack `{path}`: {reason}")]
    CorruptPack {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// An expert pack assembled in memory whose layers are inconsistent.
    #[error("invalid expert pack: {reason}")]
    InvalidPack {
        /// What is wrong with it.
        reason: String,
    },
    /// A pack made from another checkpoint, or whose shapes or layers differ from the model's.
    #[error(
        "the expert pack made from {source_model} (revision {source_revision}) does not fit \
         this model: {reason}; re-run quantize"
    )]
    PackMismatch {
        /// The model the pack was made from.
        source_model: String,
        /// Its revision.
        source_revision: String,
        /// What differs.
        reason: String,
    },
    /// A memory plan cannot be made or does not fit its budget (see [`crate::plan`]).
    #[error("memory plan: {0}")]
    Plan(String),
    /// An allocation cannot be had: device memory, pinned host memory, or host memory (a
    /// host-memory expert cache, a layer being packed); the reason says which.
    #[error("out of memory: {what} needs {needed} bytes, but {reason}")]
    OutOfMemory {
        /// The allocation, e.g. `an expert cache of 8 slots × 1184 bytes`.
        what: String,
        /// Its bytes.
        needed: usize,
        /// Why it failed, e.g. `only 4096 of the device's 8192 bytes are free`.
        reason: String,
    },
    /// A host → device copy of an expert failed; the previously published cache stays valid.
    #[error("expert copy failed: {bytes} bytes into slot {slot}: {reason}")]
    CopyFailed {
        /// The cache slot written.
        slot: usize,
        /// Bytes copied.
        bytes: usize,
        /// Why it failed.
        reason: String,
    },
    /// A residency profile that cannot work (capacity below top-k, staging below one expert).
    #[error("residency profile refused: {0}")]
    Residency(String),
    /// A component of the memory plan does not fit the budget.
    #[error(
        "{component} needs {} but only {} is available ({} missing): {breakdown}",
        crate::plan::format_bytes(*needed),
        crate::plan::format_bytes(*available),
        crate::plan::format_bytes(needed.saturating_sub(*available))
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

impl QmoeError {
    /// A [`QmoeError::UnsupportedConfig`]: `field = value` followed by `reason`.
    pub(crate) fn unsupported(
        field: &str,
        value: impl ToString,
        reason: impl Into<String>,
    ) -> Self {
        Self::UnsupportedConfig {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// The `QmoeError` inside a [`candle::Error`] from a compute path, looking through Candle's
    /// context, path and backtrace wrappers; `None` for Candle's own errors.
    pub fn find(err: &candle::Error) -> Option<&QmoeError> {
        let found = match err {
            candle::Error::Io(io) => io.get_ref()?.downcast_ref::<QmoeError>(),
            // What Candle's `Context` trait makes of a `Result<_, QmoeError>` or of a
            // `candle::Result`.
            candle::Error::WrappedContext { wrapped, .. } => {
                match wrapped.downcast_ref::<QmoeError>() {
                    Some(found) => Some(found),
                    None => return wrapped.downcast_ref::<candle::Error>().and_then(Self::find),
                }
            }
            candle::Error::Context { inner, .. }
            | candle::Error::WithPath { inner, .. }
            | candle::Error::WithBacktrace { inner, .. } => Self::find(inner),
            _ => None,
        }?;
        match found {
            QmoeError::Candle(inner) => Self::find(inner),
            other => Some(other),
        }
    }
}

/// `err`'s message without the backtraces Candle attaches when `RUST_BACKTRACE` is set: for
/// messages that travel on (an HTTP response, the reason of another error), where a backtrace
/// would be noise or would leak the host's paths. A context or path comes before the message it
/// wraps, on the same line (`"step: boom"`).
pub fn message_without_backtrace(err: &candle::Error) -> String {
    match err {
        candle::Error::WithBacktrace { inner, .. } => message_without_backtrace(inner),
        candle::Error::Context { inner, context } => {
            format!("{context}: {}", message_without_backtrace(inner))
        }
        candle::Error::WithPath { inner, path } => {
            format!("{}: {}", path.display(), message_without_backtrace(inner))
        }
        candle::Error::WrappedContext { wrapped, context } => {
            let inner = match wrapped.downcast_ref::<candle::Error>() {
                Some(e) => message_without_backtrace(e),
                None => wrapped.to_string(),
            };
            format!("{context}: {inner}")
        }
        e => e.to_string(),
    }
}

/// `candle::Error::Wrapped` holds a `dyn Display`, which cannot be downcast, so a `QmoeError`
/// travels as `candle::Error::Io` over [`std::io::Error::other`]: its message is the
/// `QmoeError`'s unchanged, and [`QmoeError::find`] recovers it. `QmoeError::Candle(e)` gives
/// back `e` itself.
impl From<QmoeError> for candle::Error {
    fn from(e: QmoeError) -> Self {
        match e {
            QmoeError::Candle(e) => e,
            e => candle::Error::Io(std::io::Error::other(e)).bt(),
        }
    }
}

/// A `candle::Error` that carries a `QmoeError` (see `From<QmoeError> for candle::Error`) gives
/// that `QmoeError` back; any other is [`QmoeError::Candle`].
impl From<candle::Error> for QmoeError {
    fn from(e: candle::Error) -> Self {
        carried(e).unwrap_or_else(QmoeError::Candle)
    }
}

/// The `QmoeError` a `candle::Error` carries (under at most a backtrace), or the error unchanged.
fn carried(err: candle::Error) -> std::result::Result<QmoeError, candle::Error> {
    match err {
        candle::Error::WithBacktrace { inner, backtrace } => {
            carried(*inner).map_err(|inner| candle::Error::WithBacktrace {
                inner: Box::new(inner),
                backtrace,
            })
        }
        candle::Error::Io(io) if io.get_ref().is_some_and(|e| e.is::<QmoeError>()) => {
            let kind = io.kind();
            match io.into_inner().map(|e| e.downcast::<QmoeError>()) {
                Some(Ok(e)) => Ok(*e),
                Some(Err(other)) => Err(candle::Error::Io(std::io::Error::new(kind, other))),
                None => Err(candle::Error::Io(kind.into())),
            }
        }
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> QmoeError {
        QmoeError::ShapeMismatch {
            tensor: "router".into(),
            got: vec![2, 3],
            expected: vec![2, 4],
        }
    }

    #[test]
    fn round_trips_through_candle_errors() {
        let e: candle::Error = shape().into();
        assert_eq!(
            e.to_string().lines().next(),
            Some(shape().to_string().as_str())
        );
        assert!(matches!(
            QmoeError::find(&e),
            Some(QmoeError::ShapeMismatch { tensor, .. }) if tensor == "router"
        ));
        // Candle's wrappers are looked through, and the error comes back out whole.
        let wrapped = e.context("layer 3").with_path("model.safetensors");
        assert!(matches!(
            QmoeError::find(&wrapped),
            Some(QmoeError::ShapeMismatch { .. })
        ));
        let back = QmoeError::from(candle::Error::from(shape()));
        assert!(matches!(back, QmoeError::ShapeMismatch { .. }));
        // Candle's own errors stay Candle's, without a second wrapping.
        let own = candle::Error::Msg("boom".into());
        assert!(QmoeError::find(&own).is_none());
        let q = QmoeError::from(own);
        assert!(matches!(&q, QmoeError::Candle(candle::Error::Msg(m)) if m == "boom"));
        assert!(matches!(candle::Error::from(q), candle::Error::Msg(m) if m == "boom"));
        let io = candle::Error::Io(std::io::Error::other("disk"));
        assert!(QmoeError::find(&io).is_none());
        assert!(matches!(
            QmoeError::from(io),
            QmoeError::Candle(candle::Error::Io(_))
        ));
        // `candle::Context` on a `Result<_, QmoeError>` is found too.
        use candle::Context;
        let r: std::result::Result<(), QmoeError> = Err(shape());
        let e = r.context("loading").unwrap_err();
        assert!(matches!(
            QmoeError::find(&e),
            Some(QmoeError::ShapeMismatch { .. })
        ));
        // … and on a `candle::Result` that carries one.
        let r: candle::Result<()> = Err(shape().into());
        let e = r.context("step").unwrap_err();
        assert!(matches!(
            QmoeError::find(&e),
            Some(QmoeError::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn messages_without_backtrace_keep_every_context() {
        use candle::Context;
        let boom = || candle::Error::Msg("boom".into());
        let e = candle::Error::WithBacktrace {
            inner: Box::new(boom().context("step")),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        };
        assert_eq!(message_without_backtrace(&e), "step: boom");
        let e = boom().bt().with_path("model.safetensors");
        assert_eq!(message_without_backtrace(&e), "model.safetensors: boom");
        let r: candle::Result<()> = Err(candle::Error::WithBacktrace {
            inner: Box::new(boom()),
            backtrace: Box::new(std::backtrace::Backtrace::force_capture()),
        });
        let e = r.context("loading").unwrap_err();
        assert_eq!(message_without_backtrace(&e), "loading: boom");
        let r: std::result::Result<(), QmoeError> = Err(shape());
        let e = r.context("reading").unwrap_err();
        assert_eq!(
            message_without_backtrace(&e),
            format!("reading: {}", shape())
        );
    }
}
