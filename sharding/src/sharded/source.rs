//! Shard sources: where a new sharded collection's rows come from
//! (`ShardSource`, an unsharded collection, `InitialRows`) and `LocalShard`.

use std::ops::Range;

use ember_sparse::{
    DiskTierConfig, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingTable, TableOptimizer,
    CACHE_WAYS,
};

use crate::plan::{RowSplit, Shard};
use crate::ShardingError;

/// One shard of a table as this process holds it.
pub struct LocalShard<'a> {
    /// The (global) table's name.
    pub table: &'a str,
    /// The shard's position in the table's plan.
    pub index: usize,
    /// Which rows and columns of the table.
    pub shard: &'a crate::plan::Shard,
    /// Its rows (local order) and optimizer state.
    pub data: &'a EmbeddingTable,
}

/// Where the rows (and optimizer state) of the shards come from when a
/// sharded collection is made.
pub trait ShardSource {
    /// Fills `local`, the local table of `shard` of table `t` (`config`),
    /// with its rows in local order and their optimizer state.
    fn fill(
        &self,
        t: usize,
        config: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError>;

    /// Where table `t`'s shards live: `Some` puts each on the disk tier of
    /// its device, its file in that directory, its cache that share of
    /// `cache_rows` its rows are of the table's (see [`shard_tier`]).
    /// Default: in RAM.
    fn disk_tier(&self, t: usize) -> Option<DiskTierConfig> {
        let _ = t;
        None
    }
}

/// An unsharded collection's tables; a disk-tier table's shards go on
/// the disk tier too.
impl ShardSource for EmbeddingBagCollection {
    fn fill(
        &self,
        t: usize,
        _: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError> {
        let opt = self.optimizer();
        copy_rows(
            &self.tables()[t],
            local,
            shard.rows,
            shard.column_range(),
            opt,
        )
    }

    fn disk_tier(&self, t: usize) -> Option<DiskTierConfig> {
        self.tables()[t].disk_tier()
    }
}

/// `source`'s rows, with the tables whose entry of `tiers` is `Some`
/// sharded onto the disk tier (each rank caching its own shards).
pub struct WithDiskTiers<'a> {
    /// Where the rows come from.
    pub source: &'a dyn ShardSource,
    /// One per table, or empty (all in RAM).
    pub tiers: Vec<Option<DiskTierConfig>>,
}

impl ShardSource for WithDiskTiers<'_> {
    fn fill(
        &self,
        t: usize,
        config: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError> {
        self.source.fill(t, config, shard, local)
    }

    fn disk_tier(&self, t: usize) -> Option<DiskTierConfig> {
        self.tiers.get(t).cloned().flatten()
    }
}

/// The disk tier of a shard of `shard_rows` of a table of `table_rows`
/// whose tier is `tier`: the same directory, a cache of the shard's share
/// of the table's (by rows, in whole sets of [`CACHE_WAYS`], at least one).
pub fn shard_tier(tier: &DiskTierConfig, table_rows: usize, shard_rows: usize) -> DiskTierConfig {
    let share = (tier.cache_rows as u128 * shard_rows as u128).div_ceil(table_rows.max(1) as u128);
    let rows = (share as usize)
        .next_multiple_of(CACHE_WAYS)
        .max(CACHE_WAYS);
    DiskTierConfig {
        dir: tier.dir.clone(),
        cache_rows: rows,
    }
}

/// The initial rows a new collection seeded with `seed` would hold (the
/// optimizer state starts as a new table's).
pub struct InitialRows {
    /// The seed the unsharded collection would be made with.
    pub seed: u64,
}

impl ShardSource for InitialRows {
    fn fill(
        &self,
        t: usize,
        config: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError> {
        let rows = match shard.rows {
            RowSplit::Block { start, end } => start..end,
            RowSplit::All | RowSplit::Mod { .. } => 0..config.num_embeddings,
        };
        ember_sparse::initial_rows(
            config,
            self.seed,
            t as u64,
            rows,
            |g| shard.rows.local(g),
            shard.column_range(),
            local,
        )?;
        Ok(())
    }
}

/// Copies a shard's rows (their bytes, in the table's type) and optimizer
/// state from the global table, a piece of rows at a time (either table
/// may be on the disk tier).
fn copy_rows(
    global: &EmbeddingTable,
    local: &mut EmbeddingTable,
    rows: RowSplit,
    cols: Range<usize>,
    opt: &TableOptimizer,
) -> Result<(), ShardingError> {
    let (dim, lc) = (global.dim(), cols.len());
    let (gs, ls) = (opt.state_floats_per_row(dim), opt.state_floats_per_row(lc));
    let map = state_map(opt, dim, cols.clone());
    let dtype = global.data_type();
    let bytes = dtype
        .column_range(dim, cols)
        .expect("plans split the columns of fp32, fp16 and bf16 tables only");
    let gstride = global.bytes_per_row();
    // Global rows between consecutive local rows.
    let step = match rows {
        RowSplit::Mod { modulus, .. } => modulus,
        RowSplit::All | RowSplit::Block { .. } => 1,
    };
    // About 8 MiB of the global table's rows read a piece.
    let piece = ((8 << 20) / ((gstride + 4 * gs) * step).max(1)).max(1);
    let (mut grows, mut gstate, mut lrows, mut lstate) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for first in (0..local.num_embeddings()).step_by(piece) {
        let n = piece.min(local.num_embeddings() - first);
        // The global rows from this piece's first to its last.
        let (g0, span) = (rows.global(first), (n - 1) * step + 1);
        grows.resize(span * gstride, 0);
        gstate.resize(span * gs, 0.0);
        global.read_stored_rows(g0, &mut grows, &mut gstate)?;
        lrows.clear();
        lstate.clear();
        for r in (0..span).step_by(step) {
            lrows.extend_from_slice(&grows[r * gstride..][bytes.clone()]);
            let at = lstate.len();
            lstate.resize(at + ls, 0.0);
            for &(l, g) in &map {
                lstate[at + l] = gstate[r * gs + g];
            }
        }
        local.write_stored_rows(first, &lrows, &lstate)?;
    }
    Ok(())
}

/// (local, global) positions of a row's state floats for a column range.
pub(super) fn state_map(
    opt: &TableOptimizer,
    dim: usize,
    cols: Range<usize>,
) -> Vec<(usize, usize)> {
    let lc = cols.len();
    match opt {
        TableOptimizer::None | TableOptimizer::Sgd { .. } => vec![],
        TableOptimizer::RowWiseAdagrad { .. } => vec![(0, 0)],
        TableOptimizer::Adagrad { .. } => cols.enumerate().collect(),
        TableOptimizer::Adam { .. } => cols
            .clone()
            .enumerate()
            .chain(cols.enumerate().map(|(l, g)| (lc + l, dim + g)))
            .collect(),
    }
}
