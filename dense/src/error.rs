//! Errors of the dense crate.
//!
//! Constructors that take user data (`Tensor::from_vec`) return them. Backend ops and layers
//! treat a shape mismatch as a programming error and panic with the same message, so the
//! panic names the op and the shapes.

/// What went wrong, naming the op or layer and the shapes involved.
#[derive(Debug, thiserror::Error)]
pub enum DenseError {
    /// A buffer's length does not match the shape it was given.
    #[error("{op}: data of length {len} does not fit shape [{rows}, {cols}]")]
    DataLength {
        op: &'static str,
        rows: usize,
        cols: usize,
        len: usize,
    },
    /// Operands whose shapes do not agree.
    #[error("{op}: shape mismatch: {detail}")]
    ShapeMismatch { op: &'static str, detail: String },
    /// An optimizer was stepped with parameters other than those its state was created for.
    #[error(
        "dense optimizer: parameter #{index} is `{got}` ({got_len} values) but the state was \
         created for `{expected}` ({expected_len} values)"
    )]
    ParamMismatch {
        index: usize,
        got: String,
        got_len: usize,
        expected: String,
        expected_len: usize,
    },
}

/// Panics with a [`DenseError::ShapeMismatch`] message when `ok` is false; `detail` is only
/// built on failure.
#[inline]
#[track_caller]
pub(crate) fn check_shape(ok: bool, op: &'static str, detail: impl FnOnce() -> String) {
    if !ok {
        panic!(
            "{}",
            DenseError::ShapeMismatch {
                op,
                detail: detail()
            }
        );
    }
}
