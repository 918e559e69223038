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
    /// with its rows in local order and their optimizer state (and a
    /// key-value table's map).
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
        let global = &self.tables()[t];
        // A key-value table's ids of the shard's buckets, into its first rows.
        let sliced = (shard.rows.buckets()).and_then(|(r, b, of)| global.kv_slice(r, b, of));
        let Some(slice) = sliced else {
            copy_rows(global, local, shard.rows, shard.column_range(), opt)?;
            // Table-wise, a key-value table's map whole.
            if let Some(state) = global.kv_state() {
                local.load_kv_state(state)?;
            }
            return Ok(());
        };
        copy_listed_rows(global, local, &slice.from_rows)?;
        Ok(local.load_kv_state(slice.state)?)
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
        policy: tier.policy,
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
        let split = shard.rows;
        ember_sparse::initial_rows(
            config,
            self.seed,
            t as u64,
            move |l| split.global(l),
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
    let shard = ShardSpan::new(global, rows, cols.clone(), opt);
    // Rows still initial in a disk-tier table are made in the shard too,
    // on first lookup, rather than made and copied now.
    let made =
        (global.row_maker()).is_some_and(|m| local.make_rows_as(&m, move |l| rows.global(l), cols));
    let copied = |l: usize| !made || !global.row_is_initial(rows.global(l));
    let mut buffers = Buffers::default();
    for (first, n, g0) in shard.runs(local.num_embeddings(), &copied) {
        buffers.read_global(global, g0, shard.span(n))?;
        shard.to_local(&mut buffers, n);
        local.write_stored_rows(first, &buffers.lrows, &buffers.lstate)?;
    }
    Ok(())
}

/// Copies rows `from_rows` of `global` (rows and optimizer state, every
/// column) into `local`'s rows from 0, a run of consecutive rows (at most
/// a piece) at a time.
fn copy_listed_rows(
    global: &EmbeddingTable,
    local: &mut EmbeddingTable,
    from_rows: &[usize],
) -> Result<(), ShardingError> {
    let (stride, per_row) = (global.bytes_per_row(), global.state_floats_per_row());
    let (mut rows, mut state) = (Vec::new(), Vec::new());
    let mut at = 0;
    let runs = from_rows.chunk_by(|a, b| *b == a + 1);
    for run in runs.flat_map(|r| r.chunks(1 << 16)) {
        rows.resize(run.len() * stride, 0);
        state.resize(run.len() * per_row, 0.0);
        global.read_stored_rows(run[0], &mut rows, &mut state)?;
        local.write_stored_rows(at, &rows, &state)?;
        at += run.len();
    }
    Ok(())
}

/// A shard's rows and state to copy back: its local table, or the bytes
/// and state a rank sent of it.
pub(super) enum ShardRows<'a> {
    Table(&'a EmbeddingTable),
    Bytes { rows: &'a [u8], state: &'a [f32] },
}

/// Copies a shard's rows and state back into the global table the same
/// way: each piece over the span of global rows it falls in (read, its
/// rows and columns set, written back), neither table ever whole in memory.
/// With `made` (the global table makes its rows as the shard's were
/// made), the rows still initial in the shard are left out.
pub(super) fn copy_rows_back(
    local: ShardRows<'_>,
    global: &mut EmbeddingTable,
    (rows, cols): (RowSplit, Range<usize>),
    opt: &TableOptimizer,
    made: bool,
) -> Result<(), ShardingError> {
    let shard = ShardSpan::new(global, rows, cols, opt);
    let local_rows = match &local {
        ShardRows::Table(t) => t.num_embeddings(),
        ShardRows::Bytes { rows, .. } => rows.len() / shard.lstride.max(1),
    };
    // Not a key-value shard's own fallback row (past its block).
    let local_rows = local_rows.min(rows.count(global.num_embeddings()));
    let copied = |l: usize| match &local {
        ShardRows::Table(t) => !made || !t.row_is_initial(l),
        ShardRows::Bytes { .. } => true,
    };
    let mut buffers = Buffers::default();
    for (first, n, g0) in shard.runs(local_rows, &copied) {
        match &local {
            ShardRows::Table(t) => {
                buffers.lrows.resize(n * shard.lstride, 0);
                buffers.lstate.resize(n * shard.ls, 0.0);
                t.read_stored_rows(first, &mut buffers.lrows, &mut buffers.lstate)?;
            }
            ShardRows::Bytes { rows, state } => {
                buffers.lrows.clear();
                buffers
                    .lrows
                    .extend_from_slice(&rows[first * shard.lstride..][..n * shard.lstride]);
                buffers.lstate.clear();
                buffers
                    .lstate
                    .extend_from_slice(&state[first * shard.ls..][..n * shard.ls]);
            }
        }
        buffers.read_global(global, g0, shard.span(n))?;
        shard.to_global(&mut buffers, n);
        global.write_stored_rows(g0, &buffers.grows, &buffers.gstate)?;
    }
    Ok(())
}

/// Where a shard's rows and state floats sit in its table's, and the
/// pieces the copies between them go in.
struct ShardSpan {
    /// A local row's bytes within a global row's.
    bytes: Range<usize>,
    /// (local, global) state floats.
    map: Vec<(usize, usize)>,
    /// Bytes and state floats of a global and of a local row.
    gstride: usize,
    lstride: usize,
    gs: usize,
    ls: usize,
    rows: RowSplit,
    /// Global rows between consecutive local rows.
    step: usize,
    /// Local rows a piece: about 8 MiB of the global rows it spans.
    piece: usize,
}

impl ShardSpan {
    fn new(
        global: &EmbeddingTable,
        rows: RowSplit,
        cols: Range<usize>,
        opt: &TableOptimizer,
    ) -> Self {
        let (dim, lc) = (global.dim(), cols.len());
        let (gs, ls) = (opt.state_floats_per_row(dim), opt.state_floats_per_row(lc));
        let map = state_map(opt, dim, cols.clone());
        let bytes = (global.data_type())
            .column_range(dim, cols)
            .expect("plans split the columns of fp32, fp16 and bf16 tables only");
        let gstride = global.bytes_per_row();
        let step = match rows {
            RowSplit::Mod { modulus, .. } => modulus,
            RowSplit::All | RowSplit::Block { .. } | RowSplit::Buckets { .. } => 1,
        };
        let piece = ((8 << 20) / ((gstride + 4 * gs) * step).max(1)).max(1);
        Self {
            lstride: bytes.len(),
            bytes,
            map,
            gstride,
            gs,
            ls,
            rows,
            step,
            piece,
        }
    }

    /// `(first local row, rows, first global row)` of each piece of a
    /// shard of `local_rows` rows, over the rows `copied` keeps: a piece
    /// is cut where it leaves rows out.
    fn runs<'a>(
        &'a self,
        local_rows: usize,
        copied: &'a dyn Fn(usize) -> bool,
    ) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
        (0..local_rows).step_by(self.piece).flat_map(move |first| {
            let end = self.piece.min(local_rows - first) + first;
            let mut runs = Vec::new();
            let mut l = first;
            while l < end {
                let start = l;
                while l < end && copied(l) {
                    l += 1;
                }
                if l > start {
                    runs.push((start, l - start, self.rows.global(start)));
                }
                l += 1;
            }
            runs
        })
    }

    /// Global rows from a piece of `n` local rows' first to its last.
    fn span(&self, n: usize) -> usize {
        (n - 1) * self.step + 1
    }

    /// The piece's local rows and state, out of the global span.
    fn to_local(&self, b: &mut Buffers, n: usize) {
        b.lrows.clear();
        b.lstate.clear();
        for r in 0..n {
            let g = r * self.step;
            b.lrows
                .extend_from_slice(&b.grows[g * self.gstride..][self.bytes.clone()]);
            let at = b.lstate.len();
            b.lstate.resize(at + self.ls, 0.0);
            for &(l, s) in &self.map {
                b.lstate[at + l] = b.gstate[g * self.gs + s];
            }
        }
    }

    /// The piece's local rows and state, into the global span.
    fn to_global(&self, b: &mut Buffers, n: usize) {
        for r in 0..n {
            let at = r * self.step * self.gstride;
            b.grows[at + self.bytes.start..at + self.bytes.end]
                .copy_from_slice(&b.lrows[r * self.lstride..(r + 1) * self.lstride]);
            for &(l, s) in &self.map {
                b.gstate[r * self.step * self.gs + s] = b.lstate[r * self.ls + l];
            }
        }
    }
}

/// A piece's rows and state: the shard's and the global span's.
#[derive(Default)]
struct Buffers {
    lrows: Vec<u8>,
    lstate: Vec<f32>,
    grows: Vec<u8>,
    gstate: Vec<f32>,
}

impl Buffers {
    /// `span` global rows from `g0` (and their state).
    fn read_global(
        &mut self,
        global: &EmbeddingTable,
        g0: usize,
        span: usize,
    ) -> Result<(), ShardingError> {
        self.grows.resize(span * global.bytes_per_row(), 0);
        self.gstate
            .resize(span * global.state_floats_per_row(), 0.0);
        Ok(global.read_stored_rows(g0, &mut self.grows, &mut self.gstate)?)
    }
}

/// (local, global) positions of a row's state floats for a column range.
fn state_map(opt: &TableOptimizer, dim: usize, cols: Range<usize>) -> Vec<(usize, usize)> {
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
