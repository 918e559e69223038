//! The sharded collection. Each device (a thread here) owns an ordinary
//! `EmbeddingBagCollection` of its shards; a step runs in three stages, each
//! ending in one all-to-all-v:
//!
//! ```text
//! forward:  input dist   each device sends the ids of its own samples to the
//!                        devices owning their rows (unique ids + indices)
//!           lookup       owners pool their shards' rows (partial sums for
//!                        row splits) with the fused kernels
//!           output dist  pooled slices go back to the samples' devices,
//!                        summed (row splits) or placed (column splits)
//! backward: grad dist    gradient slices go to the owners; data-parallel
//!                        replicas get every device's bags and gradients
//!           update       owners run the fused backward on their shards
//! ```
//! Two ways to run: every device a thread of this process (`from_collection`:
//! the input is the whole batch, samples owned in contiguous blocks, device
//! d: `B*d/N..B*(d+1)/N`, and the output is the whole batch's), or this
//! process one rank of a multi-process world holding its own device only
//! (`from_collection_on_rank`: the input is this rank's samples, blocks in
//! rank order, and the output is theirs).

mod build;
mod codec;
mod entry;
mod gather;
mod layout;
mod route;
mod source;
mod stages;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use ember_sparse::{EmbeddingBagConfig, TableOptimizer};
use serde::Serialize;

use crate::collective::{Collective, InProcess};
use crate::plan::ShardingPlan;

pub use route::{InputRouter, RoutedInput};
pub use source::{shard_tier, InitialRows, LocalShard, ShardSource, WithDiskTiers};

use layout::Layout;
use stages::Device;

/// Counters of the sharded execution, summed over calls (stage times are
/// the slowest device's per call).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardingStats {
    /// Backward updates run by this collection (since it was made).
    pub steps: u64,
    /// Ids looked up by each device.
    pub lookups: Vec<u64>,
    /// Bytes each device sent to other devices.
    pub bytes_sent: Vec<u64>,
    /// Forward: sending ids to the devices owning their rows.
    pub input_dist: Duration,
    /// Forward: the owners' pooled lookups.
    pub lookup: Duration,
    /// Forward: sending pooled slices back to the samples' devices.
    pub output_dist: Duration,
    /// Backward: sending gradient slices to the owners.
    pub grad_dist: Duration,
    /// Backward: the owners' fused optimizer updates.
    pub update: Duration,
}

/// An `EmbeddingBagCollection` split over devices by a [`ShardingPlan`];
/// results equal the unsharded collection's up to summation order.
pub struct ShardedEmbeddingBagCollection {
    configs: Vec<EmbeddingBagConfig>,
    plan: ShardingPlan,
    optimizer: TableOptimizer,
    /// Shared with the collection's input routers.
    layout: Arc<Layout>,
    /// The devices this process runs (all, or its rank's one).
    devices: Vec<Device>,
    exec: Exec,
    step: u64,
    /// Seeds the stochastic rounding of fp16/bf16 shards (the unsharded
    /// collection's), so shards round as the whole tables would.
    rounding_seed: u64,
    stats: ShardingStats,
    /// Bytes sent through collectives replaced after a failed exchange.
    bytes_before: Vec<u64>,
    /// Bytes routers sent for this collection's forwards (threads only: a
    /// rank's router channel counts with the world's collective).
    routed_bytes: Vec<u64>,
    /// Batch size and id count of the last forward: a backward must match it.
    last_forward: Option<(usize, usize)>,
    /// Every device's samples in the last forward (global positions).
    owners: Vec<Range<usize>>,
    /// Each table's disk tier (its shards'; `None`: in RAM), alike on
    /// every rank.
    tiers: Vec<Option<ember_sparse::DiskTierConfig>>,
    /// How each disk-tier table made the rows it held no record of when
    /// it was sharded (as its shards make theirs still initial), to gather
    /// them back without copying those rows; empty when not known.
    makers: Vec<Option<ember_sparse::RowMaker>>,
}

enum Exec {
    /// Every device in this process, one thread each.
    Threads(Vec<InProcess>),
    /// This process is rank `rank()` of a multi-process world.
    Rank(Arc<dyn Collective>),
}
