//! Initial rows: tables drawn chunk by independently seeded chunk, and
//! `initial_rows`, which draws only the chunks a shard holds, bit for bit alike.

use rayon::prelude::*;

use super::backward::BackwardScratch;
use super::store::{InMemory, OnDisk, TableStore};
use super::{EmbeddingTable, TablePart};
use crate::optimizer::OptimizerState;
use crate::rows::{encode, TableRows};
use crate::tier::{DiskTier, FillRecords};
use crate::{DiskTierConfig, EmbeddingBagConfig, SparseError, TableOptimizer};

/// Rows initialised per independently seeded chunk (keeps init reproducible
/// whatever the thread count).
const INIT_CHUNK_ROWS: usize = 4096;

/// Part of a table's initial weights, exactly as
/// [`EmbeddingBagCollection::new`](super::EmbeddingBagCollection::new)
/// with `seed` initialises the table at position `index`: every global row
/// in `rows` that `local` maps to a local row `l` has its columns `cols`
/// written to local row `l` of `out` (rounded to its data type as the whole
/// table's rows are). Only the chunks holding `rows` are drawn, so a shard
/// is initialised without the rest of its table in memory. A disk-tier
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
                let mut values = vec![0f32; n * dim];
                draw_chunk((lo, hi), [seed, index, chunk as u64], &mut values);
                // The wanted rows' columns, packed, and where they go.
                let (mut locals, mut kept) = (Vec::new(), Vec::new());
                for r in first.max(rows.start)..(first + n).min(end) {
                    if let Some(l) = local(r) {
                        locals.push(l);
                        kept.extend_from_slice(&values[(r - first) * dim..][cols.clone()]);
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

/// The initial values of one chunk of `INIT_CHUNK_ROWS` rows (`seed`, table
/// index, chunk index): the one draw both [`new_table`] and [`initial_rows`]
/// make, so they agree bit for bit.
fn draw_chunk((lo, hi): (f32, f32), key: [u64; 3], out: &mut [f32]) {
    let mut rng = crate::rng::Rng::new(crate::rng::mix(&key));
    for x in out {
        *x = lo + (hi - lo) * rng.next_f32();
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
            draw_chunk((lo, hi), [seed, index, chunk as u64], values)
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

/// A disk-tier table: its file written chunk by chunk with the rows `new`
/// would draw in RAM (and zero state), or (without a seed) left for the
/// caller to fill; then an empty cache.
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
    let record = stride + state_bytes;
    let draw = |first: usize, records: &mut [u8]| {
        // `first` is a multiple of INIT_CHUNK_ROWS: one chunk of draws.
        debug_assert_eq!(first % INIT_CHUNK_ROWS, 0);
        let rows = records.len() / record;
        let mut values = vec![0f32; rows * dim];
        if let Some(seed) = seed {
            let chunk = (first / INIT_CHUNK_ROWS) as u64;
            draw_chunk((lo, hi), [seed, index, chunk], &mut values);
        }
        for (r, rec) in records.chunks_exact_mut(record).enumerate() {
            encode(dtype, &values[r * dim..(r + 1) * dim], &mut rec[..stride]);
            rec[stride..].fill(0);
        }
    };
    // Zeroed tables are filled by their caller: their files stay sparse
    // until then (no pass of zeros written first).
    let init = seed.is_some().then_some(&draw as &FillRecords<'_>);
    let (disk, slots) = DiskTier::create(
        tier,
        &config.name,
        config.num_embeddings,
        (stride, state_bytes),
        INIT_CHUNK_ROWS,
        init,
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
