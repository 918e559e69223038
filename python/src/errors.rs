//! Ember's errors as Python exceptions, with Ember's messages: bad input is
//! a `ValueError`, a file an `OSError`, memory a `MemoryError`.

use ember_sparse::SparseError;
use pyo3::exceptions::{PyMemoryError, PyOSError, PyValueError};
use pyo3::PyErr;

/// The exception for a sparse error.
pub fn sparse(error: SparseError) -> PyErr {
    match error {
        SparseError::Disk { .. } => PyOSError::new_err(error.to_string()),
        SparseError::Allocation { .. } => PyMemoryError::new_err(error.to_string()),
        _ => PyValueError::new_err(error.to_string()),
    }
}

/// A `ValueError` for JSON the Python layer sent that does not parse
/// (`what` names it: the table configs, the optimizer).
pub fn json(what: &str, error: serde_json::Error) -> PyErr {
    PyValueError::new_err(format!("{what}: {error}"))
}
