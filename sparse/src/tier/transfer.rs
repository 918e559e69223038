//! Moving a batch's misses between the file and the cache: write-backs
//! first, then reads, many in flight on the I/O threads.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::{DiskTier, Miss, IO_THREADS, TRANSFER_AHEAD, TRANSFER_CHUNK};
use crate::optimizer::OptimizerState;
use crate::rows::TableRows;
use crate::storage::prefetch;
use crate::SparseError;

/// The threads that wait on the disk: they block in reads and writes, so
/// they are apart from the compute threads and many more than the cores.
pub(super) fn io_pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(IO_THREADS)
            .thread_name(|i| format!("ember-io-{i}"))
            .build()
            .expect("the disk tier's I/O threads could not start")
    })
}

/// One table's side of a [`transfer`]: its tier, its cache's slots, and
/// the misses [`DiskTier::assign`] gave.
pub(crate) struct Transfer<'a> {
    pub(crate) table: &'a str,
    pub(crate) tier: &'a DiskTier,
    pub(crate) slots: SlotPointers,
    pub(crate) misses: &'a [Miss],
}

/// Writes back each miss's evicted row, then reads its row: the misses of
/// every table at once. All write-backs come first: a row evicted by one
/// miss may be another miss of the same batch, read back after it is
/// written. Rows already in the page cache are then read on the compute
/// threads (a read that would wait is not started there); the rest on the
/// I/O threads, many in flight. Handing every read to the I/O threads cost
/// a thread switch per row: 2.9 us a miss with the file in the page cache,
/// where a read itself takes about one.
pub(crate) fn transfer(tables: &[Transfer<'_>]) -> Result<(), SparseError> {
    let work: Vec<(usize, usize)> = tables
        .iter()
        .enumerate()
        .flat_map(|(t, x)| (0..x.misses.len()).map(move |m| (t, m)))
        .collect();
    if work.is_empty() {
        return Ok(());
    }
    tables.par_iter().try_for_each(write_back)?;
    // Misses whose read would wait for the disk, for the I/O threads. A
    // miss's slot and log position are random lines: fetched a few misses
    // ahead.
    let waiting: Vec<(usize, usize)> = work
        .par_chunks(TRANSFER_CHUNK)
        .map_init(Vec::new, |buf, chunk| {
            let mut waiting = Vec::new();
            for (i, &(t, m)) in chunk.iter().enumerate() {
                if let Some(&(t, m)) = chunk.get(i + TRANSFER_AHEAD) {
                    prefetch_miss(&tables[t], m);
                }
                if !read_row(&tables[t], m, buf, Read::Cached)? {
                    waiting.push((t, m));
                }
            }
            Ok(waiting)
        })
        .collect::<Result<Vec<_>, SparseError>>()?
        .concat();
    if waiting.is_empty() {
        return Ok(());
    }
    io_pool().install(|| {
        waiting
            .par_iter()
            .try_for_each_init(Vec::new, |buf, &(t, m)| {
                read_row(&tables[t], m, buf, Read::Any).map(|_| ())
            })
    })
}

/// The changed rows the misses of `x` evict, appended to the file.
fn write_back(x: &Transfer<'_>) -> Result<(), SparseError> {
    let records: Vec<(u64, [&[u8]; 2])> = (x.misses.iter())
        .filter_map(|miss| {
            let old = miss.evicted()?;
            // SAFETY: each miss of a table has its own slot (a slot gets
            // one miss per stage); this pass only reads it.
            let (row, state) = unsafe { x.slots.slot(miss.slot) };
            Some((old, [&*row, &*state]))
        })
        .collect();
    x.tier.shared.log.append(x.table, &records)
}

/// Starts fetching what [`read_row`] touches for miss `m` of `x`: its
/// row's log position and its slot (row and state), written there.
fn prefetch_miss(x: &Transfer<'_>, m: usize) {
    let miss = &x.misses[m];
    x.tier.shared.log.prefetch_position(miss.id);
    let (row, state) = x.slots.addresses(miss.slot);
    prefetch(row, x.slots.stride);
    prefetch(state, 4 * x.slots.per_row);
}

/// Which reads [`read_row`] may do.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    /// Only a read served by the page cache at once.
    Cached,
    /// Any, waiting for the disk if need be.
    Any,
}

/// Miss `m` of `x`: its row read into its slot, straight from the file.
/// Returns whether it is done (`false`: the read would have waited, under
/// `Read::Cached`).
fn read_row(
    x: &Transfer<'_>,
    m: usize,
    scratch: &mut Vec<u8>,
    read: Read,
) -> Result<bool, SparseError> {
    let (tier, miss) = (x.tier, &x.misses[m]);
    // SAFETY: each miss of a table has its own slot, and one task at a
    // time handles a miss.
    let (row, state) = unsafe { x.slots.slot(miss.slot) };
    if !tier.shared.log.stored(miss.id) {
        // A row read in place may fault on the disk: not on these threads.
        if tier.make_waits() && read == Read::Cached {
            return Ok(false);
        }
        tier.make(miss.id, row, state);
        return Ok(true);
    }
    (tier.shared.log).read(
        x.table,
        miss.id,
        [row, state],
        read == Read::Cached,
        scratch,
    )
}

/// The cache's rows and state as raw pointers, for tasks that each touch
/// their own slot.
#[derive(Clone, Copy)]
pub(crate) struct SlotPointers {
    rows: *mut u8,
    stride: usize,
    state: *mut f32,
    per_row: usize,
}
// SAFETY: used only by tasks that touch distinct slots (see `slot`).
unsafe impl Send for SlotPointers {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl Sync for SlotPointers {}

impl SlotPointers {
    pub(crate) fn new(rows: &mut TableRows, state: &mut OptimizerState) -> Self {
        Self {
            stride: rows.stride(),
            rows: rows.bytes_mut().as_mut_ptr(),
            per_row: state.floats_per_row(),
            state: state.base_ptr(),
        }
    }

    /// Where slot `slot`'s row and state lie (for any `slot`; only a
    /// slot of the cache may be read there).
    fn addresses(&self, slot: usize) -> (*mut u8, *mut f32) {
        (
            self.rows.wrapping_add(slot * self.stride),
            self.state.wrapping_add(slot * self.per_row),
        )
    }

    /// # Safety
    /// `slot` is a slot of the cache, and no other task uses it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slot(&self, slot: usize) -> (&mut [u8], &mut [u8]) {
        let (row, state) = self.addresses(slot);
        let row = std::slice::from_raw_parts_mut(row, self.stride);
        let state = if self.per_row == 0 {
            &mut [][..]
        } else {
            std::slice::from_raw_parts_mut(state, self.per_row)
        };
        (row, bytemuck::cast_slice_mut(state))
    }
}
