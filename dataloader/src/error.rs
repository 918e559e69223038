use std::path::PathBuf;

use thiserror::Error;

use crate::criteo::Reject;

/// Everything that can go wrong while ingesting, opening or loading data.
/// Each variant names the file (and where known the line, row or column) so
/// the message alone says what to fix.
#[derive(Debug, Error)]
pub enum DataError {
    /// Reading, writing, renaming or fsyncing `path` failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory the operation was on.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A write failed because the disk (or the user's quota) is full.
    #[error("{}: the disk is full (no space left on device)", path.display())]
    DiskFull {
        /// The file being written.
        path: PathBuf,
    },
    /// A file that is not Parquet, or is corrupt or truncated.
    #[error("{}: not a readable Parquet file: {message}", path.display())]
    Parquet {
        /// The Parquet file.
        path: PathBuf,
        /// What the reader or writer reported (with the row group, when known).
        message: String,
    },
    /// A column is missing from a file, has the wrong type, or holds a value
    /// the loader refuses (a null or non-0/1 label; the message names the row
    /// within the row group).
    #[error("{}: column '{column}': {message}", path.display())]
    Column {
        /// The Parquet file.
        path: PathBuf,
        /// The column's name, e.g. `label` or `cat_3`.
        column: String,
        /// What is wrong with it.
        message: String,
    },
    /// A dataset spec that cannot be read or does not hold together.
    #[error("{}: {message}", path.display())]
    Spec {
        /// The spec's JSON file.
        path: PathBuf,
        /// What is wrong (serde's line and column, or the inconsistency).
        message: String,
    },
    /// Another process writes into the directory: it holds its lock.
    #[error("{} is in use by {holder}: one writer per directory (wait for it to finish, or write elsewhere)", path.display())]
    InUse {
        /// The directory.
        path: PathBuf,
        /// Who holds it, as its lock file says (`pid N (started T: what)`).
        holder: String,
    },
    /// A malformed input line under `--strict`.
    #[error("{}:{line}: {reason}", path.display())]
    Malformed {
        /// The input TSV (plain or gzip).
        path: PathBuf,
        /// The 1-based line number.
        line: u64,
        /// Why the line was rejected.
        reason: Reject,
    },
    /// Invalid options or inputs, found before any data is read (a zero batch
    /// size, a rank not below the world size, a directory without `.parquet`
    /// files, two inputs writing the same outputs), or a decoding thread that
    /// stopped without a result.
    #[error("{0}")]
    Config(String),
    /// Assembling a batch's [`KeyedJaggedTensor`](ember_sparse::KeyedJaggedTensor)
    /// failed.
    #[error(transparent)]
    Sparse(#[from] ember_sparse::SparseError),
}

/// ENOSPC or EDQUOT: the write had nowhere to go.
pub(crate) fn is_disk_full(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

impl DataError {
    /// The error of an I/O operation on `path` (a full disk is
    /// [`DataError::DiskFull`]).
    pub fn from_io(path: &std::path::Path, source: std::io::Error) -> Self {
        DataError::io(path)(source)
    }

    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| match is_disk_full(&source) {
            true => DataError::DiskFull { path },
            false => DataError::Io { path, source },
        }
    }

    pub(crate) fn parquet(
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(parquet::errors::ParquetError) -> Self {
        let path = path.into();
        move |e| {
            let full = match &e {
                parquet::errors::ParquetError::External(inner) => {
                    (inner.downcast_ref::<std::io::Error>()).is_some_and(is_disk_full)
                }
                _ => false,
            };
            match full {
                true => DataError::DiskFull { path },
                false => DataError::Parquet {
                    path,
                    message: e.to_string(),
                },
            }
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
