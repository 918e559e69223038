//! Errors of the dense crate.
//!
//! Constructors that take user data (`Tensor::from_vec`) return them. Backend ops and layers
//! treat a shape mismatch as a programming error and panic with the same message, so the
//! panic names the op and the shapes.

/// What went wrong, naming the op or layer and the shapes involved.
#[derive(Debug, thiserror::Error)]
pub enum DenseError {
    /// A buffer's length does not match the shape it was given: returned by
    /// [`Tensor::from_vec`](crate::Tensor::from_vec) when `len != rows * cols`.
    #[error("{op}: data of length {len} does not fit shape [{rows}, {cols}]")]
    DataLength {
        /// The constructor that refused the data, e.g. `"Tensor::from_vec"`.
        op: &'static str,
        /// Rows of the requested shape.
        rows: usize,
        /// Columns of the requested shape.
        cols: usize,
        /// Length of the data given.
        len: usize,
    },
    /// Operands whose shapes do not agree. Backend ops and layers panic with this message
    /// (a programming error), they do not return it.
    #[error("{op}: shape mismatch: {detail}")]
    ShapeMismatch {
        /// The op or layer that checked, e.g. `"Mlp::forward"`.
        op: &'static str,
        /// The shapes involved and what was expected, as text.
        detail: String,
    },
    /// An optimizer was stepped with parameters other than those its state was created for
    /// (another list, order or length): [`DenseOptimizer::step`](crate::DenseOptimizer::step)
    /// panics with this message.
    #[error(
        "dense optimizer: parameter #{index} is `{got}` ({got_len} values) but the state was \
         created for `{expected}` ({expected_len} values)"
    )]
    ParamMismatch {
        /// Position in the parameter list of the first parameter that differs.
        index: usize,
        /// Name (and gradient length) of the parameter passed there; `<none>` when the list
        /// is shorter than the state.
        got: String,
        /// Number of values of the parameter passed there (0 when none).
        got_len: usize,
        /// Name the state has for that position; `<none>` when the list is longer.
        expected: String,
        /// Number of values the state has for that position (0 when none).
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
