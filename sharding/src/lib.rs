//! ember-sharding: embedding tables split over devices ("SparseCores"), as
//! TorchRec shards an `EmbeddingBagCollection`.
//!
//! - [`topology`]: the devices, their memory and bandwidths.
//! - [`plan`](mod@plan): sharding types and a plan (which rows and columns of which
//!   table live on which device), serde JSON, validated.
//! - [`planner`]: a cost model and a greedy placement balancing the most
//!   loaded device.
//! - [`collective`]: all-to-all-v, all-reduce and barrier behind a trait, and
//!   an in-process backend (one thread per device); [`mpi`]: the backend
//!   for one process per device, started by `mpirun` (with the `mpi`
//!   feature; without it, the same API fails with "built without mpi").
//! - [`sharded`]: the sharded collection: input distribution, lookups on the
//!   owning devices, output distribution, and the routed fused backward.
//! - [`sequence`]: the sharded `EmbeddingCollection` (unpooled rows),
//!   table-wise and row-wise.

pub mod collective;
mod error;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(not(feature = "mpi"))]
#[path = "mpi_stub.rs"]
pub mod mpi;
pub mod plan;
pub mod planner;
pub mod sequence;
pub mod sharded;
pub mod topology;
mod wire;

pub use collective::{Collective, InProcess};
pub use error::ShardingError;
pub use plan::{RowSplit, Shard, ShardingPlan, ShardingType, TablePlan};
pub use planner::{
    plan, stats, DiskTierModel, PlanStats, PlannerOptions, DEFAULT_DISK_READS_PER_S,
};
pub use sequence::ShardedEmbeddingCollection;
pub use sharded::{
    shard_tier, InitialRows, InputRouter, LocalShard, RoutedInput, ShardSource,
    ShardedEmbeddingBagCollection, ShardingStats, WithDiskTiers,
};
pub use topology::Topology;
