use std::path::PathBuf;

use thiserror::Error;

use crate::criteo::Reject;

#[derive(Debug, Error)]
pub enum DataError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file that is not Parquet, or is corrupt or truncated.
    #[error("{}: not a readable Parquet file: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
    #[error("{}: column '{column}': {message}", path.display())]
    Column {
        path: PathBuf,
        column: String,
        message: String,
    },
    /// A malformed input line under `--strict`.
    #[error("{}:{line}: {reason}", path.display())]
    Malformed {
        path: PathBuf,
        line: u64,
        reason: Reject,
    },
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Sparse(#[from] ember_sparse::SparseError),
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| DataError::Io { path, source }
    }

    pub(crate) fn parquet(
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(parquet::errors::ParquetError) -> Self {
        let path = path.into();
        move |e| DataError::Parquet {
            path,
            message: e.to_string(),
        }
    }

    pub(crate) fn column(path: &std::path::Path, column: &str, message: String) -> Self {
        DataError::Column {
            path: path.to_path_buf(),
            column: column.to_string(),
            message,
        }
    }
}
