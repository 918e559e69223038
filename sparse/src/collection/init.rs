//! Initial rows: each row drawn alone from its own seed, so that a table in
//! RAM, a shard (`initial_rows`) and a disk-tier table that makes a row when
//! it is first looked up all hold the same bits.

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
}

/// Part of a table's initial weights, exactly as
/// [`EmbeddingBagCollection::new`](super::EmbeddingBagCollection::new)
/// with `seed` initialises the table at position `index`: every global row
/// in `rows` that `local` maps to a local row `l` has its columns `cols`
/// written to local row `l` of `out` (rounded to its data type as the whole
/// table's rows are). Only the rows it holds are drawn, so a shard is
/// initialised without the rest of its table in memory. A disk-tier
/// `out` gets its rows in runs (their optimizer state zero, as a new
/// table's), and fails with [`SparseError::Disk`] when its file cannot be
/// written.
pub fn initial_rows(
    config: &EmbeddingBagConfig,
    seed: u64,
    index: u64,
    rows: std::ops::Range<usize>,
    local: impl Fn(usize) -> Option<usize> + Sync,
    cols: std::ops::Range<usize>,
    out: &mut EmbeddingTable,
) -> Result<(), SparseError> {
    let (lo, hi) = config.init_range();
    let dim = config.embedding_dim;
    let lc = cols.len();
    let end = rows.end.min(config.num_embeddings);
    let chunks: Vec<usize> =
        (rows.start / INIT_CHUNK_ROWS..end.div_ceil(INIT_CHUNK_ROWS)).collect();
    // Chunks are drawn in parallel, in groups of about 64 MiB of draws, and
    // their wanted rows copied out in order.
    let group = ((64 << 20) / (INIT_CHUNK_ROWS * dim.max(1) * 4)).max(1);
    for group in chunks.chunks(group) {
        let drawn: Vec<(Vec<usize>, Vec<f32>)> = group
            .par_iter()
            .map(|&chunk| {
                let first = chunk * INIT_CHUNK_ROWS;
                let n = INIT_CHUNK_ROWS.min(config.num_embeddings - first);
                let mut values = vec![0f32; dim];
                // The wanted rows' columns, packed, and where they go.
                let (mut locals, mut kept) = (Vec::new(), Vec::new());
                for r in first.max(rows.start)..(first + n).min(end) {
                    if let Some(l) = local(r) {
                        draw_row((lo, hi), [seed, index, r as u64], &mut values);
                        locals.push(l);
                        kept.extend_from_slice(&values[cols.clone()]);
                    }
                }
                (locals, kept)
            })
            .collect();
        for (locals, kept) in drawn {
            if out.is_on_disk() {
                write_runs(out, &locals, &kept)?;
                continue;
            }
            for (l, row) in locals.into_iter().zip(kept.chunks_exact(lc.max(1))) {
                out.write_row(l, row);
            }
        }
    }
    Ok(())
}

/// Rows `values` (packed, fp32) to local rows `locals` of a disk-tier
/// table, each run of consecutive rows in one write, their state zero.
fn write_runs(
    out: &mut EmbeddingTable,
    locals: &[usize],
    values: &[f32],
) -> Result<(), SparseError> {
    let (dim, stride, per_row) = (out.dim(), out.bytes_per_row(), out.state_floats_per_row());
    let dtype = out.data_type();
    let mut start = 0;
    while start < locals.len() {
        let mut end = start + 1;
        while end < locals.len() && locals[end] == locals[end - 1] + 1 {
            end += 1;
        }
        let n = end - start;
        let mut bytes = vec![0u8; n * stride];
        for (r, row) in bytes.chunks_exact_mut(stride.max(1)).enumerate() {
            dtype.encode_row(&values[(start + r) * dim..][..dim], row);
        }
        out.write_stored_rows(locals[start], &bytes, &vec![0.0; n * per_row])?;
        start = end;
    }
    Ok(())
}

/// The initial values of one row (`seed`, table index, row): the one draw
/// [`new_table`], [`initial_rows`] and a disk tier's first lookup of the
/// row make, so they agree bit for bit.
fn draw_row((lo, hi): (f32, f32), key: [u64; 3], out: &mut [f32]) {
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
        return new_disk_table(config, optimizer, seed, index, tier);
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
    Ok(whole_table(
        config,
        Box::new(InMemory { rows, state }),
        index,
    ))
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
    let (lo, hi) = config.init_range();
    let (dim, dtype) = (config.embedding_dim, config.data_type);
    // validate() checked that a row's size fits.
    let stride = dtype.row_bytes(dim).unwrap_or(usize::MAX);
    let state_bytes = 4 * optimizer.state_floats_per_row(dim);
    // A row is made (drawn and encoded) when first looked up, not written
    // to the file first; zeroed tables are filled by their caller.
    let make = seed.map(|seed| -> Box<MakeRow> {
        Box::new(move |row, out| {
            DRAWN.with_borrow_mut(|values| {
                values.resize(dim, 0.0);
                draw_row((lo, hi), [seed, index, row], values);
                encode(dtype, values, out);
            })
        })
    });
    let (disk, slots) = DiskTier::create(
        tier,
        &config.name,
        config.num_embeddings,
        (stride, state_bytes),
        make,
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
    }
}
