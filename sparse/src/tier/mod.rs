//! The disk tier: a table whose rows (and their optimizer state) live in a
//! file, with a bounded cache of hot rows in memory, as FBGEMM's SSD TBE and
//! its LXU cache.
//!
//! The kernels never see the file. A batch is first *staged*
//! ([`EmbeddingBagCollection::prefetch`](crate::EmbeddingBagCollection::prefetch)):
//! each id is looked up in a set-associative cache (16 ways, least recently
//! used out), misses get a slot (the slot's old row is written back first
//! when it changed), and all of the batch's misses are read from the file
//! at once, many reads in flight. The batch's ids are then rewritten as
//! slot numbers, and the forward and the fused backward run on the cache's
//! slots exactly as on a table in RAM of that many rows. Stochastic
//! rounding draws by each slot's real id, so a disk-tier table trains bit
//! for bit as the same table in RAM.
//!
//! The file is a log of records (see [`log`]): a record is a row's bytes
//! in its data type, then its optimizer state (fp32), and a changed row
//! leaving the cache is appended, its older record left to be cleaned. It
//! is created (its space reserved) when the table is built, and removed
//! when the table is dropped: it is the table's working storage, not a
//! checkpoint. A new table's records are not written up front: a row not
//! yet stored is made from the table's seed when looked up, and written
//! when it first leaves the cache changed.

mod config;
mod log;
mod transfer;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::optimizer::OptimizerState;
use crate::rows::TableRows;
use crate::storage::{prefetch_every, HugeArray};
use crate::SparseError;
use config::{bypass_map_bytes, cache_layout};
pub use config::{CachePolicy, DiskTierConfig, TierStats};
pub use log::file_bytes as disk_tier_file_bytes;
pub use log::reclaim_row_files;
use log::RowLog;
pub(crate) use transfer::{transfer, SlotPointers, Transfer};

/// Ways of each cache set: a row may sit in any of 16 slots.
pub const CACHE_WAYS: usize = 16;
/// Reads and writes in flight while a batch's misses are fetched: the disks
/// this was measured on (cloud SSDs) need a queue depth of 32-64 to reach
/// their random-read rate (about 48k 4 KiB reads/s at 64, 6k at 1).
const IO_THREADS: usize = 64;
/// A slot holding no row.
const EMPTY: u64 = u64::MAX;
/// The bit of a slot's meta word that says its row changed; the other 31
/// are the epoch it was last used in.
const DIRTY: u32 = 1 << 31;
/// How many ids ahead staging fetches a set's lines.
const ASSIGN_AHEAD: usize = 16;
/// Misses a transfer task takes at a time, and how far ahead in them it
/// fetches a miss's slot and log position.
const TRANSFER_CHUNK: usize = 256;
const TRANSFER_AHEAD: usize = 8;
/// Under LFU, one slot in this many at least is kept for rows not
/// admitted to their set ([`Bypass`]).
const BYPASS_SHARE: usize = 32;

/// A staged miss: `slot` now holds `id`, read from the file; `before` is
/// the row it held and its meta word (for [`evicted`](Self::evicted), and
/// for undoing a refused batch).
pub(crate) struct Miss {
    slot: usize,
    id: u64,
    before: (u64, u32),
}

impl Miss {
    /// The changed row the slot held, to write back first.
    fn evicted(&self) -> Option<u64> {
        let (old, meta) = self.before;
        (old != EMPTY && meta & DIRTY != 0).then_some(old)
    }
}

/// The part of a tier another thread may read while its table computes:
/// the file, and the id each cache slot holds (atomics: staging writes
/// them while a [`ReadAhead`] reads).
#[derive(Debug)]
pub(crate) struct Shared {
    /// The file. Rows it holds no record of are made (by the tier's
    /// maker, from the table's seed) when they are looked up.
    log: RowLog,
    sets: usize,
    /// The row each slot holds (`u32::MAX`: none).
    tags: HugeArray<AtomicU32>,
}

impl Shared {
    fn set_of(&self, id: u64) -> usize {
        // A hash of the id scaled to the sets (multiply-shift, no division).
        ((crate::rng::splitmix(id) as u128 * self.sets as u128) >> 64) as usize
    }

    /// The row slot `slot` holds, or [`EMPTY`].
    fn tag(&self, slot: usize) -> u64 {
        match self.tags[slot].load(Ordering::Relaxed) {
            u32::MAX => EMPTY,
            id => id as u64,
        }
    }

    /// Whether slot `slot` holds row `id` (a row of the table).
    fn holds(&self, slot: usize, id: u64) -> bool {
        self.tags[slot].load(Ordering::Relaxed) == id as u32
    }

    fn set_tag(&self, slot: usize, id: u64) {
        // Rows are below 2^32 - 1 (the log's limit); EMPTY becomes u32::MAX.
        self.tags[slot].store(id as u32, Ordering::Relaxed)
    }

    fn slot_of(&self, id: u64) -> Option<usize> {
        let base = self.set_of(id) * CACHE_WAYS;
        (base..base + CACHE_WAYS).find(|&s| self.holds(s, id))
    }
}

/// Reads a batch's disk-tier rows ahead, on any thread, while an earlier
/// batch computes (FBGEMM's prefetch pipeline): for every id whose row is
/// not cached, the kernel is asked to bring its record into the page
/// cache, so that the batch's [`prefetch`](crate::EmbeddingBagCollection::prefetch)
/// finds it there. It changes nothing in the cache; a row cached or
/// evicted meanwhile only makes a hint useless.
#[derive(Clone, Debug)]
pub struct ReadAhead {
    /// Per feature of a disk-tier table: its name, tier and rows.
    pub(crate) features: Vec<(String, Arc<Shared>, u64)>,
}

impl ReadAhead {
    /// Hints the rows of `kjt`'s ids that are not cached; returns how many
    /// (ids out of range are skipped: `prefetch` reports them).
    pub fn run(&self, kjt: &crate::KeyedJaggedTensor) -> usize {
        let mut hinted = 0;
        for (k, key) in kjt.keys().iter().enumerate() {
            let Some((_, shared, rows)) = self.features.iter().find(|f| &f.0 == key) else {
                continue;
            };
            for &id in &kjt.values()[kjt.key_range(k)] {
                // A row not stored is made, not read: nothing to hint.
                let id = id as u64;
                if id < *rows && shared.log.stored(id) && shared.slot_of(id).is_none() {
                    shared.log.will_need(id);
                    hinted += 1;
                }
            }
        }
        hinted
    }
}

/// What staging a batch does besides finding rows.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    /// A forward: a new epoch of the LRU clock; lookups counted.
    Lookup,
    /// A backward: the rows will change (marked dirty), same epoch.
    Update,
}

/// LFU's lookup counts: each table row's, kept up to date when its row
/// leaves the cache, and each slot's (its row's count, counted on while
/// cached), so that a lookup and a victim's choice touch only the set.
#[derive(Debug)]
struct Counts {
    rows: HugeArray<u32>,
    slots: HugeArray<u32>,
}

/// Makes a row's bytes (in the table's type) where a disk-tier table's
/// file holds none: `(row, bytes)` (drawn from the seed, or read in place).
pub type MakeRow = dyn Fn(u64, &mut [u8]) + Send + Sync;

/// A bit per row of a table.
#[derive(Debug)]
struct RowBits(Vec<u64>);

impl RowBits {
    fn new(rows: usize) -> Self {
        Self(vec![0; rows.div_ceil(64)])
    }
    /// Sets the bit; returns whether it was set before.
    fn set(&mut self, row: u64) -> bool {
        let (word, bit) = (&mut self.0[row as usize / 64], 1 << (row % 64));
        let before = *word & bit != 0;
        *word |= bit;
        before
    }
    fn bytes(&self) -> usize {
        std::mem::size_of_val(self.0.as_slice())
    }
}

/// A table's [`MakeRow`] (shared with the shards made from the table).
struct Maker(Arc<MakeRow>);

impl std::fmt::Debug for Maker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Maker")
    }
}

/// The disk tier of one table: its file and the cache's bookkeeping. The
/// cached rows and state themselves are the table's (resident) rows.
#[derive(Debug)]
pub(crate) struct DiskTier {
    /// The file and the slots' ids, which a [`ReadAhead`] reads too.
    shared: Arc<Shared>,
    /// Per slot: the epoch it was last used in, and [`DIRTY`] when its
    /// row changed since it was read. One word, so that a lookup and the
    /// backward's marking touch one line of a set, not two arrays.
    meta: HugeArray<u32>,
    /// Under [`CachePolicy::Lfu`], the lookup counts.
    lfu: Option<Counts>,
    /// Slots for rows LFU does not admit to their set (none under LRU).
    bypass: Bypass,
    /// Whether each row of the table was ever cached (for
    /// [`TierStats::first_misses`]).
    cached_once: RowBits,
    /// Makes the rows whose record is not in the file (none for a table
    /// its caller fills: every record is then stored).
    make: Option<Maker>,
    /// Whether its rows change (an optimizer updates them).
    trains: bool,
    /// Whether the maker reads the rows from elsewhere (in place), and so
    /// may wait for the disk: such rows are made on the I/O threads.
    make_waits: bool,
    /// Bytes of a row in the file's records (the state follows).
    row_bytes: usize,
    /// Bytes of a row and its state.
    record: usize,
    /// The cache's rows as configured (sets and bypass slots).
    cache_rows: usize,
    epoch: u32,
    stats: TierStats,
}

/// The slots after the sets', for rows LFU leaves out of their set (as
/// FBGEMM's `lfu_cache_insert`, which serves those from the table itself):
/// a slot serves the batch that looked its row up, and keeps the row until
/// a later miss takes the slot (round robin), so a row found here is a
/// hit. A batch that finds no free slot here admits its rows as LRU would.
#[derive(Debug, Default)]
struct Bypass {
    first: usize,
    len: usize,
    /// The next slot to try.
    next: usize,
    /// The epoch of the tries, and how many slots were tried in it.
    tried: (u32, usize),
    /// The slot holding each row.
    of: HashMap<u64, usize, BuildHasherDefault<IdHasher>>,
}

impl Bypass {
    fn new(first: usize, len: usize) -> Self {
        Self {
            first,
            len,
            of: HashMap::with_capacity_and_hasher(len, Default::default()),
            ..Self::default()
        }
    }

    fn holds(&self, slot: usize) -> bool {
        (self.first..self.first + self.len).contains(&slot)
    }

    fn slot_of(&self, id: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        self.of.get(&id).copied()
    }

    /// A slot no row of this epoch's batches uses, if one is left.
    fn take(&mut self, meta: &[u32], epoch: u32) -> Option<usize> {
        if self.tried.0 != epoch {
            self.tried = (epoch, 0);
        }
        // Slots found in use stay in use this epoch: one round at most.
        while self.tried.1 < self.len {
            let slot = self.first + self.next;
            self.next = (self.next + 1) % self.len;
            self.tried.1 += 1;
            if meta[slot] & !DIRTY < epoch {
                return Some(slot);
            }
        }
        None
    }

    /// `slot` now holds `id` in place of `old`.
    fn replace(&mut self, slot: usize, old: u64, id: u64) {
        if old != EMPTY {
            self.of.remove(&old);
        }
        if id != EMPTY {
            self.of.insert(id, slot);
        }
    }

    fn bytes(&self) -> usize {
        bypass_map_bytes(self.len)
    }
}

/// Hashes a row id (already spread: [`crate::rng::splitmix`]).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = crate::rng::splitmix(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = crate::rng::splitmix(id);
    }
}

impl DiskTier {
    /// A tier for `rows` rows, its file in `config.dir` (records of
    /// `row_bytes + state_bytes`), its disk space reserved when it
    /// `trains` (rows that change are written long after the table is
    /// built; the others only while it is built, if at all). A row's record
    /// is written when the row first leaves the cache changed (or is
    /// flushed), and until then the row is made by `make` (its state zero)
    /// when looked up: a new table costs no writes. Without `make`, such a
    /// row is zeros (for a caller that writes every record: a checkpoint's
    /// load, a shard's copy). Returns the tier and its cache's size in
    /// rows.
    pub(crate) fn create(
        config: &DiskTierConfig,
        table: &str,
        rows: usize,
        (row_bytes, state_bytes): (usize, usize),
        make: Option<Box<MakeRow>>,
        trains: bool,
    ) -> Result<(Self, usize), SparseError> {
        let (set_slots, bypass) = cache_layout(config.policy, config.cache_rows);
        if set_slots == 0 {
            return Err(SparseError::InvalidConfig {
                table: table.to_string(),
                reason: format!(
                    "a disk-tier cache of {} rows is below one set of {CACHE_WAYS}",
                    config.cache_rows
                ),
            });
        }
        let (sets, slots) = (set_slots / CACHE_WAYS, set_slots + bypass);
        let log = RowLog::create(&config.dir, table, rows, row_bytes + state_bytes, trains)?;
        let shared = Arc::new(Shared {
            log,
            sets,
            tags: HugeArray::new(slots, || AtomicU32::new(u32::MAX)),
        });
        let tier = Self {
            shared,
            meta: HugeArray::new(slots, || 0),
            lfu: (config.policy == CachePolicy::Lfu).then(|| Counts {
                rows: HugeArray::new(rows, || 0),
                slots: HugeArray::new(set_slots, || 0),
            }),
            bypass: Bypass::new(set_slots, bypass),
            cached_once: RowBits::new(rows),
            make: make.map(|m| Maker(m.into())),
            trains,
            make_waits: false,
            row_bytes,
            record: row_bytes + state_bytes,
            cache_rows: config.cache_rows,
            epoch: 0,
            stats: TierStats::default(),
        };
        Ok((tier, slots))
    }

    /// Makes the rows not stored with `make` from now on: for a tier
    /// whose cache holds no row yet (one made earlier would disagree).
    pub(crate) fn set_maker(&mut self, make: Arc<MakeRow>) {
        debug_assert!(self.untouched());
        self.make = Some(Maker(make));
    }

    /// Makes the rows not stored by reading them with `read` from
    /// elsewhere (a file mapped in place), which may wait for the disk: on
    /// the I/O threads, many in flight, as reads of the tier's own file.
    pub(crate) fn set_reader(&mut self, read: Arc<MakeRow>) {
        self.set_maker(read);
        self.make_waits = true;
    }

    /// Whether making a row may wait for the disk.
    pub(crate) fn make_waits(&self) -> bool {
        self.make_waits
    }

    /// Whether its rows change.
    pub(crate) fn trains(&self) -> bool {
        self.trains
    }

    /// Whether no row was looked up yet.
    pub(crate) fn untouched(&self) -> bool {
        self.stats.lookups == 0 && self.stats.misses == 0
    }

    /// The maker of the rows not stored, if the tier has one.
    pub(crate) fn maker(&self) -> Option<Arc<MakeRow>> {
        self.make.as_ref().map(|m| Arc::clone(&m.0))
    }

    /// Whether row `id` holds what the maker makes: neither stored in the
    /// file nor cached (where it may have changed).
    pub(crate) fn is_made(&self, id: u64) -> bool {
        self.make.is_some() && !self.shared.log.stored(id) && self.slot_of(id).is_none()
    }

    /// Bytes the cache keeps in memory beside its rows: LFU's counts and
    /// bypass map, a bit per row of the table, and the log's positions.
    pub(crate) fn bookkeeping_bytes(&self) -> usize {
        let lfu = self.lfu.as_ref().map_or(0, |c| {
            std::mem::size_of_val(&*c.rows) + std::mem::size_of_val(&*c.slots)
        });
        lfu + self.bypass.bytes() + self.cached_once.bytes() + self.shared.log.bytes()
    }

    pub(crate) fn stats(&self) -> TierStats {
        self.stats
    }

    /// The id each slot holds (`u32::MAX` for none): the rows' real places,
    /// for stochastic rounding.
    pub(crate) fn slot_ids(&self) -> &[AtomicU32] {
        &self.shared.tags
    }

    /// The file and the slots' ids, for reading ahead from another thread.
    pub(crate) fn shared(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    pub(crate) fn path(&self) -> &Path {
        self.shared.log.path()
    }

    /// The slot holding `id`, if any.
    pub(crate) fn slot_of(&self, id: u64) -> Option<usize> {
        self.shared.slot_of(id).or_else(|| self.bypass.slot_of(id))
    }

    /// Rewrites `ids` (checked to be rows of the table) as the slots that
    /// will hold them, and returns the misses: rows to read from the file
    /// (each after writing back the changed row its slot held), for
    /// [`transfer`]. A batch's rows stay in the cache until the next
    /// `Lookup`: a set whose 16 slots all hold rows of the batch cannot
    /// take another, and fails with [`SparseError::CacheFull`] (the cache
    /// then holds the rows it held before the batch), unless a bypass slot
    /// takes it (LFU).
    pub(crate) fn assign(
        &mut self,
        table: &str,
        ids: &mut [i64],
        stage: Stage,
    ) -> Result<Vec<Miss>, SparseError> {
        if stage == Stage::Lookup {
            if self.epoch == DIRTY - 1 {
                // Once in 2^31 batches the clock starts again: every slot
                // counts as last used before it (recency is lost once).
                self.meta.iter_mut().for_each(|m| *m &= DIRTY);
                self.epoch = 0;
            }
            self.epoch += 1;
            self.stats.lookups += ids.len() as u64;
        }
        let epoch = self.epoch;
        // Each id's set first, so that the sets' tags and stamps (random
        // lines, a DRAM miss each) are fetched a few ids ahead of use.
        let sets: Vec<usize> = ids.iter().map(|&v| self.shared.set_of(v as u64)).collect();
        let counted = u32::from(stage == Stage::Lookup);
        let mut misses = Vec::new();
        for (i, v) in ids.iter_mut().enumerate() {
            if let Some(&ahead) = sets.get(i + ASSIGN_AHEAD) {
                self.prefetch_set(ahead);
            }
            let id = *v as u64;
            let base = sets[i] * CACHE_WAYS;
            let slot = match (base..base + CACHE_WAYS).find(|&s| self.shared.holds(s, id)) {
                Some(slot) => {
                    if let Some(lfu) = &mut self.lfu {
                        lfu.slots[slot] = lfu.slots[slot].saturating_add(counted);
                    }
                    slot
                }
                None => match self.bypass.slot_of(id) {
                    // Left out of its set earlier, still held.
                    Some(slot) => {
                        if let Some(lfu) = &mut self.lfu {
                            let count = &mut lfu.rows[id as usize];
                            *count = count.saturating_add(counted);
                        }
                        slot
                    }
                    None => match self.miss(id, sets[i], epoch, counted) {
                        Some(miss) => {
                            let slot = miss.slot;
                            misses.push(miss);
                            slot
                        }
                        None => {
                            self.undo(&misses);
                            return Err(SparseError::CacheFull {
                                table: table.to_string(),
                                cache_rows: self.shared.tags.len(),
                            });
                        }
                    },
                },
            };
            let dirty = if stage == Stage::Update {
                DIRTY
            } else {
                self.meta[slot] & DIRTY
            };
            self.meta[slot] = epoch | dirty;
            *v = slot as i64;
        }
        Ok(misses)
    }

    /// Keeps the misses [`assign`](Self::assign) gave, once every table of
    /// the batch has its slots: counts them.
    pub(crate) fn commit(&mut self, misses: &[Miss], stage: Stage) {
        let mut first = 0;
        for m in misses {
            first += u64::from(!self.cached_once.set(m.id));
        }
        if stage == Stage::Lookup {
            self.stats.misses += misses.len() as u64;
            self.stats.first_misses += first;
        }
    }

    /// Gives row `id` (not cached) a slot in set `set`, or under LFU a
    /// bypass slot when the row is looked up less often than the set's
    /// candidate (FBGEMM's LFU admission) or the set has none; `None`
    /// when no slot is free.
    fn miss(&mut self, id: u64, set: usize, epoch: u32, counted: u32) -> Option<Miss> {
        // An empty slot, else by the policy among the slots not holding a
        // row of this batch.
        let base = set * CACHE_WAYS;
        let (meta, shared) = (&self.meta, &self.shared);
        let free = (base..base + CACHE_WAYS).filter(|&s| meta[s] & !DIRTY < epoch);
        let victim = match &self.lfu {
            None => free.min_by_key(|&s| (shared.tag(s) != EMPTY, meta[s] & !DIRTY)),
            Some(lfu) => {
                free.min_by_key(|&s| (shared.tag(s) != EMPTY, lfu.slots[s], meta[s] & !DIRTY))
            }
        };
        let admitted = match (victim, &self.lfu) {
            (Some(_), None) => victim,
            (Some(s), Some(lfu)) => (shared.tag(s) == EMPTY
                || lfu.slots[s] <= lfu.rows[id as usize].saturating_add(counted))
            .then_some(s),
            (None, _) => None,
        };
        let slot = match admitted {
            Some(slot) => slot,
            None => self.bypass.take(&self.meta, epoch).or(victim)?,
        };
        let old = self.shared.tag(slot);
        if let Some(lfu) = &mut self.lfu {
            if self.bypass.holds(slot) {
                self.bypass.replace(slot, old, id);
                let count = &mut lfu.rows[id as usize];
                *count = count.saturating_add(counted);
            } else {
                if old != EMPTY {
                    lfu.rows[old as usize] = lfu.slots[slot];
                }
                lfu.slots[slot] = lfu.rows[id as usize].saturating_add(counted);
            }
        }
        let miss = Miss {
            slot,
            id,
            before: (old, self.meta[slot]),
        };
        self.shared.set_tag(slot, id);
        self.meta[slot] &= !DIRTY;
        Some(miss)
    }

    /// After [`transfer`]: counts the bytes moved, or (when it failed)
    /// empties the misses' slots, whose rows may not have arrived.
    pub(crate) fn settle(&mut self, misses: &[Miss], transferred: bool) {
        if !transferred {
            return self.forget(misses);
        }
        let record = self.record as u64;
        let written = misses.iter().filter(|m| m.evicted().is_some()).count() as u64;
        // Rows not stored were made, not read.
        let read = misses
            .iter()
            .filter(|m| self.shared.log.stored(m.id))
            .count() as u64;
        self.stats.bytes_read += read * record;
        self.stats.bytes_written += written * record;
    }

    /// Marks the rows in `slots` changed (the backward of a staged batch,
    /// a row written by hand).
    pub(crate) fn mark_changed(&mut self, slots: &[i64]) {
        for (i, &s) in slots.iter().enumerate() {
            if let Some(&ahead) = slots.get(i + ASSIGN_AHEAD) {
                prefetch_every(self.meta.as_ptr().wrapping_add(ahead as usize), 4, 64);
            }
            self.meta[s as usize] |= DIRTY;
        }
    }

    /// Starts fetching set `set`'s tags and stamps into the CPU's cache.
    fn prefetch_set(&self, set: usize) {
        let base = set * CACHE_WAYS;
        prefetch_every(
            self.shared.tags.as_ptr().wrapping_add(base),
            CACHE_WAYS * 4,
            64,
        );
        prefetch_every(self.meta.as_ptr().wrapping_add(base), CACHE_WAYS * 4, 64);
        if let Some(lfu) = &self.lfu {
            prefetch_every(lfu.slots.as_ptr().wrapping_add(base), CACHE_WAYS * 4, 64);
        }
    }

    /// Puts back the rows the misses of a batch refused before any transfer
    /// replaced (by this table or another of the batch): their slots still
    /// hold them, changes and all (last miss first, though a slot takes one
    /// miss a batch).
    pub(crate) fn undo(&mut self, misses: &[Miss]) {
        for m in misses.iter().rev() {
            let (old, meta) = m.before;
            if self.bypass.holds(m.slot) {
                // The lookup stays counted (in the row's count already).
                self.bypass.replace(m.slot, m.id, old);
            } else if let Some(lfu) = &mut self.lfu {
                lfu.rows[m.id as usize] = lfu.slots[m.slot];
                lfu.slots[m.slot] = if old == EMPTY {
                    0
                } else {
                    lfu.rows[old as usize]
                };
            }
            self.shared.set_tag(m.slot, old);
            self.meta[m.slot] = meta;
        }
    }

    /// Empties the slots of misses whose rows may not have arrived (their
    /// lookups stay counted).
    fn forget(&mut self, misses: &[Miss]) {
        for m in misses {
            if self.bypass.holds(m.slot) {
                self.bypass.replace(m.slot, m.id, EMPTY);
            } else if let Some(lfu) = &mut self.lfu {
                lfu.rows[m.id as usize] = lfu.slots[m.slot];
            }
            self.shared.set_tag(m.slot, EMPTY);
            self.meta[m.slot] &= !DIRTY;
        }
    }

    /// Writes every changed cached row (and its state) to the file.
    pub(crate) fn flush(
        &mut self,
        table: &str,
        rows: &mut TableRows,
        state: &mut OptimizerState,
    ) -> Result<(), SparseError> {
        let dirty: Vec<usize> = (0..self.meta.len())
            .filter(|&s| self.meta[s] & DIRTY != 0)
            .collect();
        let slots = SlotPointers::new(rows, state);
        let records: Vec<(u64, [&[u8]; 2])> = (dirty.iter())
            .map(|&s| {
                // SAFETY: distinct slots; read only.
                let (row, state) = unsafe { slots.slot(s) };
                (self.shared.tag(s), [&*row, &*state])
            })
            .collect();
        self.shared.log.append(table, &records)?;
        for &s in &dirty {
            self.meta[s] &= !DIRTY;
        }
        self.stats.bytes_written += dirty.len() as u64 * self.record as u64;
        Ok(())
    }

    /// Where the tier is and how many rows its cache holds: the config
    /// that builds the same tier again.
    pub(crate) fn config(&self) -> DiskTierConfig {
        let path = self.path();
        DiskTierConfig {
            dir: path.parent().map_or_else(PathBuf::new, Path::to_path_buf),
            cache_rows: self.cache_rows,
            policy: if self.lfu.is_some() {
                CachePolicy::Lfu
            } else {
                CachePolicy::Lru
            },
        }
    }

    /// The records (row and state) of rows `first..` as the file stores
    /// them (not the cache), as many as `buf` holds; rows not stored yet
    /// made.
    pub(crate) fn read_records(
        &self,
        table: &str,
        first: u64,
        buf: &mut [u8],
    ) -> Result<(), SparseError> {
        self.shared.log.read_range(table, first, buf)?;
        let record = self.record;
        for (r, rec) in (first..).zip(buf.chunks_exact_mut(record)) {
            if !self.shared.log.stored(r) {
                let (bytes, state) = rec.split_at_mut(self.row_bytes);
                self.make(r, bytes, state);
            }
        }
        Ok(())
    }

    /// Row `row`'s initial bytes (zeros without a maker) and state (zero),
    /// for a row not stored.
    fn make(&self, row: u64, bytes: &mut [u8], state: &mut [u8]) {
        match &self.make {
            Some(make) => (make.0)(row, bytes),
            None => bytes.fill(0),
        }
        state.fill(0);
    }

    /// Overwrites the records (row and state) of rows `first..` in the
    /// file (not the cache), as many as `buf` holds.
    pub(crate) fn write_records(
        &self,
        table: &str,
        first: u64,
        buf: &[u8],
    ) -> Result<(), SparseError> {
        let record = self.record;
        let records: Vec<(u64, [&[u8]; 2])> = (first..)
            .zip(buf.chunks_exact(record))
            .map(|(r, rec)| (r, [rec, &[][..]]))
            .collect();
        self.shared.log.append(table, &records)
    }

    /// Overwrites row `id`'s bytes (not its state) in the file.
    pub(crate) fn write_row_bytes(
        &self,
        table: &str,
        id: u64,
        bytes: &[u8],
    ) -> Result<(), SparseError> {
        let mut record = vec![0u8; self.record];
        self.read_records(table, id, &mut record)?;
        let state = &record[self.row_bytes..];
        self.shared.log.append(table, &[(id, [bytes, state])])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock's wrap (once in 2^31 batches) keeps every slot's changed
    /// mark, and a batch's rows stay its own across it: one set of 16
    /// slots, batches of 4 new rows, each row changed.
    #[test]
    fn the_clock_wraps_without_losing_a_changed_row() {
        let dir = tempfile::tempdir().unwrap();
        let config = DiskTierConfig {
            dir: dir.path().to_path_buf(),
            cache_rows: CACHE_WAYS,
            policy: CachePolicy::Lru,
        };
        let (mut tier, _) = DiskTier::create(&config, "t", 64, (4, 0), None, true).unwrap();
        tier.epoch = DIRTY - 4;
        let mut changed = std::collections::HashSet::new();
        for batch in 0..12u64 {
            let rows = batch * 4..batch * 4 + 4;
            let mut ids: Vec<i64> = rows.clone().map(|r| r as i64).collect();
            let misses = tier.assign("t", &mut ids.clone(), Stage::Lookup).unwrap();
            tier.commit(&misses, Stage::Lookup);
            let evicted: Vec<u64> = misses.iter().filter_map(Miss::evicted).collect();
            assert_eq!(
                evicted.len(),
                if batch < 4 { 0 } else { 4 },
                "batch {batch}"
            );
            for old in evicted {
                assert!(changed.remove(&old), "batch {batch} evicted {old}");
            }
            let again = tier.assign("t", &mut ids, Stage::Update).unwrap();
            assert!(again.is_empty(), "batch {batch}'s rows left the cache");
            changed.extend(rows);
        }
        assert!(tier.epoch < 12);
    }
}
