//! Ember's errors as Python exceptions, with Ember's messages: bad input is
//! a `ValueError`, a file an `OSError`, memory a `MemoryError`, a loss that
//! stopped being finite a `FloatingPointError`.

use ember_dataloader::DataError;
use ember_models::{ModelError, TrainError};
use ember_sharding::ShardingError;
use ember_sparse::SparseError;
use pyo3::exceptions::{PyFloatingPointError, PyMemoryError, PyOSError, PyValueError};
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

/// The exception for a data error: files that cannot be read are an
/// `OSError`, their contents and the options a `ValueError`.
pub fn data(error: DataError) -> PyErr {
    match error {
        DataError::Io { .. }
        | DataError::DiskFull { .. }
        | DataError::NoInput { .. }
        | DataError::InUse { .. } => PyOSError::new_err(error.to_string()),
        DataError::QueuesTooLarge { .. } => PyMemoryError::new_err(error.to_string()),
        DataError::Sparse(error) => sparse(error),
        _ => PyValueError::new_err(error.to_string()),
    }
}

/// The exception for a model error: memory a `MemoryError`, files an
/// `OSError` (through the data or sparse errors), the rest a `ValueError`.
pub fn model(error: ModelError) -> PyErr {
    match error {
        ModelError::Memory(_) => PyMemoryError::new_err(error.to_string()),
        ModelError::Data(error) => data(error),
        ModelError::Sparse(error) | ModelError::Sharding(ShardingError::Sparse(error)) => {
            sparse(error)
        }
        // A file that is not there is an OSError; one that is there but
        // cannot be read or does not fit the model a ValueError.
        ModelError::Checkpoint { ref path, .. } if !path.exists() => {
            PyOSError::new_err(error.to_string())
        }
        _ => PyValueError::new_err(error.to_string()),
    }
}

/// The exception for a failed run: a loss that stopped being finite is a
/// `FloatingPointError`.
pub fn train(error: TrainError) -> PyErr {
    match error {
        TrainError::Model(error) => model(error),
        TrainError::NonFiniteLoss { .. } => PyFloatingPointError::new_err(error.to_string()),
        _ => PyValueError::new_err(error.to_string()),
    }
}
