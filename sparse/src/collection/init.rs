//! Initial rows: each row drawn alone from its own seed, so that a table in
//! RAM, a shard (`initial_rows`) and a disk-tier table that makes a row when
//! it is first looked up all hold the same bits.

use std::sync::Arc;

use rayon::prelude::*;

use super::backward::BackwardScratch;
use super::store::{InMemory, OnDisk, TableStore};
use super::{EmbeddingTable, TablePart};
use crate::optimizer::OptimizerState;
use crate::rows::{encode, TableRows};
use crate::tier::{DiskTier, MakeRow};
use crate::{DiskTierConfig, EmbeddingBagConfig, SparseError, TableOptimizer};

/// Rows a task of the initialisation draws.
const INIT_CHUNK_ROWS: usize = 4096;

thread_local! {
    /// A row's draws as a disk tier makes it on a miss (no allocation per
    /// miss).
    static DRAWN: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A whole row's bytes as a shard's maker makes its part of it.
    static WHOLE_ROW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Part of a table's initial weights, exactly as
/// [`EmbeddingBagCollection::new`](super::EmbeddingBagCollection::new)
/// with `seed` initialises the table at position `index`: each local row
/// `l` of `out` gets columns `cols` of global row `global(l)`, rounded to
/// its data type as the whole table's rows are. Only the rows `out` holds
/// are drawn, so a shard is initialised without the rest of its table in
/// memory. A disk-tier `out` (not looked up yet) is not written at all:
/// its rows are made so when first looked up, as a new disk-tier table's
/// are, their optimizer state zero. A key-value `out` gets the empty map
/// of that seed (and its zero fallback row).
pub fn initial_rows(
    config: &EmbeddingBagConfig,
    seed: u64,
    index: u64,
    global: impl Fn(usize) -> usize + Send + Sync + 'static,
    cols: std::ops::Range<usize>,
    out: &mut EmbeddingTable,
) -> Result<(), SparseError> {
    let range = config.init_range();
    let dim = config.embedding_dim;
    let lc = cols.len();
    if out.is_on_disk() {
        out.set_row_maker(
            false,
            seeded_maker(config, [seed, index], global, cols).into(),
        );
        return out.attach_kv(seed);
    }
    let locals = out.num_embeddings();
    // Rows are drawn in parallel, in groups of about 64 MiB of draws, and
    // written in order.
    let group = ((64 << 20) / (INIT_CHUNK_ROWS * lc.max(1) * 4)).max(1) * INIT_CHUNK_ROWS;
    for first in (0..locals).step_by(group) {
        let chunks: Vec<usize> = (first..(first + group).min(locals))
            .step_by(INIT_CHUNK_ROWS)
            .collect();
        let drawn: Vec<Vec<f32>> = chunks
            .par_iter()
            .map(|&start| {
                let mut values = vec![0f32; dim];
                let mut kept = Vec::new();
                for l in start..(start + INIT_CHUNK_ROWS).min(locals) {
                    draw_row(range, [seed, index, global(l) as u64], &mut values);
                    kept.extend_from_slice(&values[cols.clone()]);
                }
                kept
            })
            .collect();
        for (&start, kept) in chunks.iter().zip(drawn) {
            for (l, row) in (start..).zip(kept.chunks_exact(lc.max(1))) {
                out.write_row(l, row);
            }
        }
    }
    out.attach_kv(seed)
}

impl EmbeddingTable {
    /// Whether row `id` of a disk-tier table holds its initial value, made
    /// when looked up (never stored, not cached); false for a table in RAM.
    pub fn row_is_initial(&self, id: usize) -> bool {
        self.store.tier().is_some_and(|t| t.is_made(id as u64))
    }

    /// How this disk-tier table makes the rows it holds no record of, to
    /// build others alike with [`make_rows_as`](Self::make_rows_as)
    /// (`None`: in RAM, or built to be filled, such rows reading as zeros).
    pub fn row_maker(&self) -> Option<RowMaker> {
        let tier = self.store.tier()?;
        Some(RowMaker {
            make: tier.maker()?,
            waits: tier.make_waits(),
            data_type: self.data_type(),
            dim: self.dim(),
            row_bytes: self.bytes_per_row(),
        })
    }

    /// Makes this disk-tier table's rows not stored the way `source` (the
    /// [`row_maker`](Self::row_maker) of another table) makes its own:
    /// local row `l` as columns `cols` of `source`'s row `global(l)`. A
    /// shard copied from such a table, or a table gathered from such
    /// shards, then needs no copy of the rows still initial (see
    /// [`row_is_initial`](Self::row_is_initial)). For a table not looked
    /// up yet. Returns whether it was set: this table on the disk tier, of
    /// `source`'s type, and `cols` columns this type splits.
    pub fn make_rows_as(
        &mut self,
        source: &RowMaker,
        global: impl Fn(usize) -> usize + Send + Sync + 'static,
        cols: std::ops::Range<usize>,
    ) -> bool {
        let dtype = source.data_type;
        let Some(bytes) = dtype.column_range(source.dim, cols) else {
            return false;
        };
        if !self.is_on_disk() || self.data_type() != dtype || self.bytes_per_row() != bytes.len() {
            return false;
        }
        let (make, whole) = (Arc::clone(&source.make), source.row_bytes);
        self.set_row_maker(
            source.waits,
            Arc::new(move |l, out| {
                let mut made = |row: &mut Vec<u8>| {
                    row.resize(whole, 0);
                    make(global(l as usize) as u64, row);
                    out.copy_from_slice(&row[bytes.clone()]);
                };
                // `make` may be a shard's maker too, holding the buffer: then
                // this one takes a row of its own.
                WHOLE_ROW.with(|row| match row.try_borrow_mut() {
                    Ok(mut row) => made(&mut row),
                    Err(_) => made(&mut Vec::new()),
                })
            }),
        );
        true
    }

    /// Makes this disk-tier table's rows not stored exactly as `source`
    /// makes its table's, sharing it (a table of the same rows and type,
    /// not looked up yet: the one gathered from the shards `source`'s
    /// table was split into). Returns whether it was set.
    pub fn make_rows_like(&mut self, source: &RowMaker) -> bool {
        let alike = self.is_on_disk()
            && (self.data_type(), self.dim(), self.bytes_per_row())
                == (source.data_type, source.dim, source.row_bytes);
        if alike {
            self.set_row_maker(source.waits, Arc::clone(&source.make));
        }
        alike
    }
}

/// How a disk-tier table makes a row it holds no record of (from its
/// seed, as a new table's), shared by the tables made alike from it: its
/// shards, and the table they are gathered back into.
#[derive(Clone)]
pub struct RowMaker {
    make: Arc<MakeRow>,
    /// Whether making a row may wait for the disk (rows read in place).
    waits: bool,
    data_type: crate::DataType,
    dim: usize,
    /// Bytes of a whole row of the table it makes.
    row_bytes: usize,
}

impl std::fmt::Debug for RowMaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (f.debug_struct("RowMaker"))
            .field("data_type", &self.data_type)
            .field("dim", &self.dim)
            .finish_non_exhaustive()
    }
}

/// The maker of a disk-tier table whose row `l` is columns `cols` of
/// global row `global(l)` of the table `config` at `index`, drawn from
/// `seed` (a whole table: `global` the identity, every column).
fn seeded_maker(
    config: &EmbeddingBagConfig,
    [seed, index]: [u64; 2],
    global: impl Fn(usize) -> usize + Send + Sync + 'static,
    cols: std::ops::Range<usize>,
) -> Box<MakeRow> {
    let (range, dim, dtype) = (config.init_range(), config.embedding_dim, config.data_type);
    Box::new(move |l, bytes| {
        DRAWN.with_borrow_mut(|values| {
            values.resize(dim, 0.0);
            draw_row(range, [seed, index, global(l as usize) as u64], values);
            encode(dtype, &values[cols.clone()], bytes);
        })
    })
}

/// The initial values of one row (`seed`, table index, row): the one draw
/// [`new_table`], [`initial_rows`] and a disk tier's first lookup of the
/// row make, so they agree bit for bit.
pub(super) fn draw_row((lo, hi): (f32, f32), key: [u64; 3], out: &mut [f32]) {
    let mut rng = crate::rng::Rng::new(crate::rng::mix(&key));
    for x in out {
        *x = lo + (hi - lo) * rng.next_f32();
    }
}

/// [`draw_row`] for the consecutive rows from `first` that `out` holds.
fn draw_rows(
    range: (f32, f32),
    [seed, index]: [u64; 2],
    first: usize,
    out: &mut [f32],
    dim: usize,
) {
    for (r, row) in out.chunks_exact_mut(dim.max(1)).enumerate() {
        draw_row(range, [seed, index, (first + r) as u64], row);
    }
}

/// A table initialised from `seed` (zeros without one), in RAM or (with
/// `tier`) in a file behind a cache.
pub(super) fn new_table(
    config: EmbeddingBagConfig,
    optimizer: &TableOptimizer,
    seed: Option<u64>,
    index: u64,
    tier: Option<&DiskTierConfig>,
) -> Result<EmbeddingTable, SparseError> {
    if let Some(tier) = tier {
        if config
            .kv
            .as_ref()
            .is_some_and(|kv| kv.eviction == crate::Eviction::L2Norm)
        {
            return Err(SparseError::InvalidConfig {
                table: config.name.clone(),
                reason: "L2-norm eviction reads every candidate's row, a disk read each on the disk tier: use LRU, LFU or TTL there".into(),
            });
        }
        let mut table = new_disk_table(config, optimizer, seed, index, tier)?;
        table.attach_kv(seed.unwrap_or(0))?;
        return Ok(table);
    }
    let (lo, hi) = config.init_range();
    let dim = config.embedding_dim;
    let alloc_error = |bytes| SparseError::Allocation {
        table: config.name.clone(),
        bytes,
    };
    // validate() checked that the size fits.
    let bytes = config.bytes().unwrap_or(usize::MAX);
    let mut rows = TableRows::new(config.data_type, config.num_embeddings, dim)
        .ok_or_else(|| alloc_error(bytes))?;
    if let Some(seed) = seed {
        rows.fill(INIT_CHUNK_ROWS, |chunk, values| {
            draw_rows(
                (lo, hi),
                [seed, index],
                chunk * INIT_CHUNK_ROWS,
                values,
                dim,
            )
        });
    }
    let state = OptimizerState::new(optimizer, config.num_embeddings, dim).ok_or_else(|| {
        alloc_error(optimizer.state_floats_per_row(dim) * config.num_embeddings * 4)
    })?;
    let mut table = whole_table(config, Box::new(InMemory { rows, state }), index);
    table.attach_kv(seed.unwrap_or(0))?;
    Ok(table)
}

/// A disk-tier table: an empty cache in front of a file whose rows are
/// made when first looked up (the rows `new` would draw in RAM, and zero
/// state), or (without a seed) left for the caller to fill.
fn new_disk_table(
    config: EmbeddingBagConfig,
    optimizer: &TableOptimizer,
    seed: Option<u64>,
    index: u64,
    tier: &DiskTierConfig,
) -> Result<EmbeddingTable, SparseError> {
    let (dim, dtype) = (config.embedding_dim, config.data_type);
    // validate() checked that a row's size fits.
    let stride = dtype.row_bytes(dim).unwrap_or(usize::MAX);
    let state_bytes = 4 * optimizer.state_floats_per_row(dim);
    // A row is made (drawn and encoded) when first looked up, not written
    // to the file first; zeroed tables are filled by their caller.
    let make = seed.map(|seed| seeded_maker(&config, [seed, index], |row| row, 0..dim));
    let (disk, slots) = DiskTier::create(
        tier,
        &config.name,
        config.num_embeddings,
        (stride, state_bytes),
        make,
        // Key-value tables write rows (new ids, the fallback) as they run.
        !matches!(optimizer, TableOptimizer::None) || config.kv.is_some(),
    )?;
    let alloc_error = |bytes| SparseError::Allocation {
        table: config.name.clone(),
        bytes,
    };
    let rows = TableRows::new(dtype, slots, dim).ok_or_else(|| alloc_error(slots * stride))?;
    let state = OptimizerState::new(optimizer, slots, dim)
        .ok_or_else(|| alloc_error(slots * state_bytes))?;
    let store = OnDisk {
        rows,
        state,
        tier: disk,
    };
    Ok(whole_table(config, Box::new(store), index))
}

/// Table `index` of its collection, whole (not a shard), in `store`.
fn whole_table(
    config: EmbeddingBagConfig,
    store: Box<dyn TableStore>,
    index: u64,
) -> EmbeddingTable {
    EmbeddingTable {
        config,
        store,
        part: TablePart::whole(index),
        scratch: BackwardScratch::default(),
        kv: None,
        changed: Default::default(),
    }
}
