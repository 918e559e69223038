//! Stand-in for the MPI backend in builds without the `mpi` feature: the
//! same API, whose [`MpiWorld::init`] fails with a clear "built without
//! mpi" error, so a program that can run under `mpirun` compiles either way.

use std::time::Duration;

use crate::collective::Collective;
use crate::ShardingError;

/// No value of this type exists: without MPI there is no world.
enum Never {}

/// An MPI world (never made in this build: [`MpiWorld::init`] fails).
pub struct MpiWorld {
    never: Never,
}

impl MpiWorld {
    /// Fails: this build has no MPI.
    pub fn init() -> Result<Self, ShardingError> {
        Err(ShardingError::BuiltWithoutMpi)
    }

    /// Stops this process (there is no job to stop).
    pub fn abort_job(code: i32) -> ! {
        std::process::exit(code)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        match self.never {}
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        match self.never {}
    }

    /// The collective over all ranks.
    pub fn collective(&self, _timeout: Duration) -> MpiCollective {
        match self.never {}
    }
}

/// The MPI collective (never made in this build).
pub struct MpiCollective {
    never: Never,
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        match self.never {}
    }
    fn world_size(&self) -> usize {
        match self.never {}
    }
    fn all_to_all_v(&self, _: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, ShardingError> {
        match self.never {}
    }
    fn bytes_sent(&self) -> u64 {
        match self.never {}
    }
}
