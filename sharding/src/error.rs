use thiserror::Error;

/// Errors of topologies, plans, the planner, collectives and sharded
/// execution.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ShardingError {
    /// A topology that cannot be planned on: no devices, zero
    /// `devices_per_host`, or a bandwidth that is not positive.
    #[error("invalid topology: {0}")]
    Topology(String),
    /// A plan that does not cover the tables exactly (names the table), a
    /// plan that is not valid JSON, a column split the optimizer cannot run
    /// on, or a plan whose device count differs from the world's ranks.
    #[error("invalid plan: {0}")]
    Plan(String),
    /// The tables do not fit the devices (lists what is missing).
    #[error("the tables do not fit: {}", capacity_text(.unplaced, *.tables, .devices))]
    Capacity {
        /// Tables that found no room, with the fewest bytes each needs on one device.
        unplaced: Vec<(String, u64)>,
        /// Tables planned in all.
        tables: usize,
        /// Per device: bytes free, and bytes missing for an even share of
        /// what found no room.
        devices: Vec<(u64, u64)>,
    },
    /// A peer's channel closed before an exchange: that rank (or device
    /// thread) stopped.
    #[error("collective: rank {rank}: rank {peer} stopped before the exchange")]
    PeerStopped {
        /// The rank that noticed.
        rank: usize,
        /// The rank that stopped.
        peer: usize,
    },
    /// Peers sent nothing within the timeout: stopped or hung.
    #[error("collective: rank {rank}: rank {} did not exchange for {seconds} s (stopped or hung)", names(.peers))]
    PeerTimeout {
        /// The rank that gave up.
        rank: usize,
        /// The ranks it was still waiting for, in order.
        peers: Vec<usize>,
        /// How long it waited.
        seconds: f64,
    },
    /// Sharded execution failed otherwise: a message was malformed, a device
    /// thread panicked, or a backward did not match the last forward's batch.
    #[error("collective: {0}")]
    Collective(String),
    /// Reading a shard's rows from where they are kept (a checkpoint) failed.
    #[error("{0}")]
    Source(String),
    /// MPI could not be initialized.
    #[error("MPI: {0}")]
    Mpi(String),
    /// Multi-process use of a build without the `mpi` feature.
    #[error("built without mpi: rebuild with `--features mpi` (Open MPI and libclang needed; see the README)")]
    BuiltWithoutMpi,
    /// An error of the underlying embedding tables (an unknown or missing
    /// feature, an id out of range, a gradient of the wrong shape).
    #[error(transparent)]
    Sparse(#[from] ember_sparse::SparseError),
}

/// `1, 3`: ranks as a message lists them.
fn names(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    names.join(", ")
}

/// The capacity error's text: which tables found no room and what each
/// device lacks, in MiB.
fn capacity_text(unplaced: &[(String, u64)], tables: usize, devices: &[(u64, u64)]) -> String {
    let tables_text: Vec<String> = (unplaced.iter())
        .map(|(name, s)| {
            format!(
                "'{name}' needs at least {} MiB on one device",
                s.div_ceil(1 << 20)
            )
        })
        .collect();
    let missing: Vec<String> = (devices.iter().enumerate())
        .map(|(d, (free, missing))| {
            format!(
                "device {d}: {} MiB free, {} MiB missing",
                free >> 20,
                missing.div_ceil(1 << 20)
            )
        })
        .collect();
    format!(
        "{} of {tables} tables cannot be placed: {}; {}",
        unplaced.len(),
        tables_text.join(", "),
        missing.join("; ")
    )
}
