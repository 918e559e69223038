//! Shard sources: where a new sharded collection's rows come from
//! (`ShardSource`, an unsharded collection, `InitialRows`) and `LocalShard`.

use std::ops::Range;

use ember_sparse::{EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingTable, TableOptimizer};

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
}

/// An unsharded collection's tables.
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
        );
        Ok(())
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
        );
        Ok(())
    }
}

/// Copies a shard's rows (their bytes, in the table's type) and optimizer
/// state from the global table.
fn copy_rows(
    global: &EmbeddingTable,
    local: &mut EmbeddingTable,
    rows: RowSplit,
    cols: Range<usize>,
    opt: &TableOptimizer,
) {
    let (dim, lc) = (global.dim(), cols.len());
    let (gs, ls) = (opt.state_floats_per_row(dim), opt.state_floats_per_row(lc));
    let map = state_map(opt, dim, cols.clone());
    let dtype = global.data_type();
    let bytes = dtype
        .column_range(dim, cols)
        .expect("plans split the columns of fp32, fp16 and bf16 tables only");
    let (gstride, lstride) = (global.bytes_per_row(), bytes.len());
    for lr in 0..local.num_embeddings() {
        let gr = rows.global(lr);
        let from = gr * gstride;
        local.row_bytes_mut()[lr * lstride..(lr + 1) * lstride]
            .copy_from_slice(&global.row_bytes()[from + bytes.start..from + bytes.end]);
        for &(l, g) in &map {
            local.optimizer_state_mut()[lr * ls + l] = global.optimizer_state()[gr * gs + g];
        }
    }
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
