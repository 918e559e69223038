use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum ShardingError {
    #[error("invalid topology: {0}")]
    Topology(String),
    /// A plan that does not cover the tables exactly (names the table).
    #[error("invalid plan: {0}")]
    Plan(String),
    /// The tables do not fit the devices (lists what is missing).
    #[error("the tables do not fit: {0}")]
    Capacity(String),
    #[error("collective: {0}")]
    Collective(String),
    /// Reading a shard's rows from where they are kept (a checkpoint).
    #[error("{0}")]
    Source(String),
    /// MPI could not be initialized.
    #[error("MPI: {0}")]
    Mpi(String),
    /// Multi-process use of a build without the `mpi` feature.
    #[error("built without mpi: rebuild with `--features mpi` (Open MPI and libclang needed; see the README)")]
    BuiltWithoutMpi,
    #[error(transparent)]
    Sparse(#[from] ember_sparse::SparseError),
}
