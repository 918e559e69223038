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
    /// MLPerf's multi-hot expansion cannot be made (which way: the message).
    #[error("multi-hot expansion: {0}")]
    MultiHot(String),
    /// A frequency-thresholded vocabulary cannot be made or used (which
    /// way: the message).
    #[error("vocabulary: {0}")]
    Vocabulary(String),
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
    /// A line of an interactions file (CSV, TSV, MovieLens `::` or
    /// `user item`) that cannot be read.
    #[error("{}:{line}: {message}", path.display())]
    BadLine {
        /// The text file.
        path: PathBuf,
        /// The 1-based line number.
        line: u64,
        /// What is wrong, naming the column.
        message: String,
    },
    /// An interactions file with no interactions.
    #[error("{}: no interactions (an empty file, or a header alone)", path.display())]
    NoInteractions {
        /// The input.
        path: PathBuf,
    },
    /// An option out of its range (a zero batch size, a rank not below the
    /// world size, a prefetch depth above its limit), found before any data
    /// is read.
    #[error("{option} {value}: {expected}")]
    Option {
        /// The option, as the library and the CLI name it (`batch size`, `--prefetch`).
        option: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        expected: String,
    },
    /// A dataset spec that does not hold together (which way: the message);
    /// from a file, [`DataError::Spec`] names it.
    #[error("dataset spec: {0}")]
    InvalidSpec(String),
    /// The loader's queues would not fit in memory when full.
    #[error(
        "the loader's queues need at least {:.2} GiB when full ({threads} threads x {prefetch} \
         row groups of up to {largest_row_group} rows, and {prefetch} batches) and {:.2} GiB is \
         available: lower --prefetch or --loader-threads, or write smaller row groups",
        *need as f64 / (1u64 << 30) as f64,
        *available as f64 / (1u64 << 30) as f64
    )]
    QueuesTooLarge {
        /// Bytes the full queues hold.
        need: u64,
        /// Bytes available.
        available: u64,
        /// Decoding threads.
        threads: usize,
        /// Row groups (and batches) queued ahead.
        prefetch: usize,
        /// The largest row group's rows.
        largest_row_group: usize,
    },
    /// A decoding thread stopped without a result (it panicked).
    #[error("a decoding thread stopped without a result")]
    DecoderStopped,
    /// No input files: none given, or a directory without `.parquet` files
    /// (`path`).
    #[error("{}", match path { Some(p) => format!("{}: no .parquet files in this directory", p.display()), None => "no input files".into() })]
    NoInput {
        /// The directory, when one was given.
        path: Option<PathBuf>,
    },
    /// A file given twice (under two names).
    #[error("{}: given twice (also as {}); each file is read once", path.display(), first.display())]
    GivenTwice {
        /// The second name.
        path: PathBuf,
        /// The first.
        first: PathBuf,
    },
    /// A part of an ingested set that is not whole (which way: `why`).
    #[error("{}: {why}: rerun the ingest that wrote it (`ember ingest criteo --resume` repairs it, `ember ingest synthetic` writes the set anew), or remove the part", path.display())]
    PartialSet {
        /// The part (or the marker that lists a missing part).
        path: PathBuf,
        /// What is wrong, naming the completion marker.
        why: String,
    },
    /// Two ingest inputs would write the same output files.
    #[error("inputs {} and {} would write the same output files", first.display(), second.display())]
    SameOutputs {
        /// One input.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// An ingest input with no lines.
    #[error("{}: no lines (an empty file); --max-reject-fraction 1 accepts it", path.display())]
    EmptyInput {
        /// The input.
        path: PathBuf,
    },
    /// An ingest input with more of its lines rejected than allowed: not
    /// Criteo data.
    #[error(
        "{}: {rejected} of {lines} lines rejected{}: is it a Criteo TSV \
         (a label and 13 integer and 26 categorical fields, tab-separated)? \
         --max-reject-fraction (now {max}) sets how many may be",
        path.display(),
        first.as_ref().map_or(String::new(), |(line, why)| format!("; line {line}: {why}"))
    )]
    TooManyRejects {
        /// The input.
        path: PathBuf,
        /// Lines rejected.
        rejected: u64,
        /// Lines in all.
        lines: u64,
        /// The first rejected line (1-based) and why.
        first: Option<(u64, String)>,
        /// The largest fraction allowed.
        max: f64,
    },
    /// A batch that is not of the Criteo schema written to a Criteo file
    /// (which way: the message).
    #[error("not a batch of the Criteo schema: {0}")]
    NotCriteo(String),
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
