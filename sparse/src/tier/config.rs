//! What a disk-tier table is given (its directory, cache size and
//! eviction policy) and what it reports (its cache's counts).

use std::path::PathBuf;

use super::{BYPASS_SHARE, CACHE_WAYS};

/// Where a disk-tier table lives: a directory for its file, how many rows
/// its cache holds (at least one set of [`CACHE_WAYS`]: the sets take a
/// multiple of it, and under LFU the rest, one row in 32 at least, are
/// bypass slots), and which row a miss evicts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskTierConfig {
    /// Directory of the table's file (`<table>.<pid>.<n>.rows`).
    pub dir: PathBuf,
    /// Rows the cache holds in memory.
    pub cache_rows: usize,
    /// Which cached row a miss replaces.
    pub policy: CachePolicy,
}

/// Which cached row of its set a miss replaces, as FBGEMM's
/// `CacheAlgorithm`. Either way only rows the batch does not use are
/// candidates, an empty slot goes first, and the choice never changes
/// results: only which rows are read and written back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CachePolicy {
    /// The row looked up longest ago (FBGEMM's default).
    #[default]
    Lru,
    /// The row looked up fewest times since the table was built, ties to
    /// the least recent: as FBGEMM's LFU, a count per row of the table
    /// (`lfu_state`; 4 bytes a row here, in memory beside the cache). As
    /// there, a row looked up less often than every candidate of its set
    /// is not admitted: it is served for its batch from one of the
    /// cache's bypass slots (one slot in 32), and the set keeps its rows.
    /// It keeps a stationary skew's hot rows better than LRU; counts never
    /// decay, so LRU follows ids whose popularity drifts sooner.
    Lfu,
}

impl CachePolicy {
    /// Both, in order.
    pub const ALL: [CachePolicy; 2] = [CachePolicy::Lru, CachePolicy::Lfu];

    /// The name flags and reports use: `lru`, `lfu`.
    pub fn name(self) -> &'static str {
        match self {
            CachePolicy::Lru => "lru",
            CachePolicy::Lfu => "lfu",
        }
    }

    /// Memory a disk-tier table of `table_rows` rows keeps beside its
    /// cache of `cache_rows` rows: per row, where the file holds its
    /// record (4 bytes) and whether it was ever cached (a bit), and under
    /// LFU a count per row and per set slot, and the bypass slots' map.
    pub fn bookkeeping_bytes(self, table_rows: u64, cache_rows: u64) -> u64 {
        let per_row = table_rows.div_ceil(64) * 8 + 4 * table_rows;
        let (set_slots, bypass) = cache_layout(self, cache_rows as usize);
        match self {
            CachePolicy::Lru => per_row,
            CachePolicy::Lfu => {
                per_row + 4 * (table_rows + set_slots as u64) + bypass_map_bytes(bypass) as u64
            }
        }
    }
}

/// A cache of `cache_rows` rows as its set slots and bypass slots: under
/// LFU the rows the sets leave (one in 32 at least) are bypass slots; under
/// LRU they are not used.
pub(super) fn cache_layout(policy: CachePolicy, cache_rows: usize) -> (usize, usize) {
    let lfu = policy == CachePolicy::Lfu;
    let kept = usize::from(lfu) * (cache_rows / BYPASS_SHARE);
    let set_slots = (cache_rows - kept) / CACHE_WAYS * CACHE_WAYS;
    (set_slots, usize::from(lfu) * (cache_rows - set_slots))
}

/// Bytes of a map made for `n` rows (the standard hash map's table: a
/// power of two of buckets, at most 7/8 full, 16 bytes and a control byte
/// each).
pub(super) fn bypass_map_bytes(n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    (n * 8 / 7 + 1).next_power_of_two() * 17
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CachePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown cache policy '{s}' (one of lru, lfu)"))
    }
}

/// How a disk-tier table's cache has done since it was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Ids looked up by forward passes (every occurrence).
    pub lookups: u64,
    /// Lookups whose row was not in the cache and was read from the file.
    pub misses: u64,
    /// Of the misses, those of rows never cached before (a row's first
    /// lookup since the table was built): no cache, of any policy or size,
    /// avoids them.
    pub first_misses: u64,
    /// Bytes read from the file.
    pub bytes_read: u64,
    /// Bytes written to the file (evicted rows that had changed, flushes).
    pub bytes_written: u64,
}

impl TierStats {
    /// The figures since `earlier`, a reading of the same cache.
    pub fn since(&self, earlier: &TierStats) -> TierStats {
        TierStats {
            lookups: self.lookups - earlier.lookups,
            misses: self.misses - earlier.misses,
            first_misses: self.first_misses - earlier.first_misses,
            bytes_read: self.bytes_read - earlier.bytes_read,
            bytes_written: self.bytes_written - earlier.bytes_written,
        }
    }

    /// Share of lookups served from the cache (1 with no lookups).
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            1.0
        } else {
            1.0 - self.misses as f64 / self.lookups as f64
        }
    }

    /// The best hit rate any cache could have had on these lookups: one
    /// that missed only rows looked up for the first time.
    pub fn hit_rate_bound(&self) -> f64 {
        if self.lookups == 0 {
            1.0
        } else {
            1.0 - self.first_misses as f64 / self.lookups as f64
        }
    }
}

/// Several caches' figures together (the tables of a collection).
impl std::iter::Sum for TierStats {
    fn sum<I: Iterator<Item = TierStats>>(iter: I) -> TierStats {
        iter.fold(TierStats::default(), |a, b| TierStats {
            lookups: a.lookups + b.lookups,
            misses: a.misses + b.misses,
            first_misses: a.first_misses + b.first_misses,
            bytes_read: a.bytes_read + b.bytes_read,
            bytes_written: a.bytes_written + b.bytes_written,
        })
    }
}
