//! A key-value table split by the buckets of its ids' hash: each shard
//! holds the ids of a range of buckets in a block of the table's rows,
//! with a map of its own. Buckets, not rows, are what moves when a table
//! is loaded onto another split (TorchRec's collision-free tables do the
//! same): [`kv_slice`] gives a shard its part of a saved table, whole
//! when the saved table was split the same way, its ids gathered
//! otherwise; [`merge_shards`] makes the shards one map again without
//! moving a row.

use std::ops::Range;

use super::{Eviction, KvPosition, KvState, KvStats, KvView};
use crate::rng::splitmix;

/// Mixed into an id before it is hashed to its bucket, so buckets and the
/// map's own hash of the id are apart.
const BUCKET_TAG: u64 = 0x6b76_5f62_7563_6b74;

/// The bucket of raw id `id` among `buckets`: its hash, scaled
/// (multiply-shift), so ids in sequence spread over every bucket.
pub fn id_bucket(id: u64, buckets: usize) -> usize {
    ((splitmix(id ^ BUCKET_TAG) as u128 * buckets as u128) >> 64) as usize
}

/// One shard of a key-value table: its block of the table's rows, the
/// buckets whose ids it holds, and its map (over its own rows, from 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvShard {
    /// The table's rows it holds (its local rows from 0).
    pub rows: Range<usize>,
    /// The buckets of its ids.
    pub buckets: Range<usize>,
    /// Its map, over `rows.len()` rows.
    pub state: KvState,
}

/// A shard's part of a saved key-value table: the saved rows (of the
/// table, in the saved shards' blocks) its local rows take, in order, and
/// its map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSlice {
    /// Local row `i` takes saved row `from_rows[i]`; local rows past them
    /// hold no id.
    pub from_rows: Vec<usize>,
    /// The shard's map.
    pub state: KvState,
}

/// The part of `saved` (every shard of a table, in row order, their
/// blocks covering its rows) that a shard of `rows` holding `buckets` of
/// `of` takes. A saved shard of the same rows and buckets is taken whole:
/// rows, map, free rows, sketch and position, so training goes on bitwise.
/// Otherwise every saved id of those buckets is taken, in saved row order,
/// into the shard's first rows, with its header and count; the shard has
/// no free rows, the saved clocks' latest, the sketches summed (counts of
/// other buckets' ids only raise the estimates, as collisions do), and,
/// if it holds bucket 0, the saved figures summed (so the table's totals
/// stay). Ids are spread over buckets by hash, so a full table's shares
/// rarely match the shards' rows: when the ids are more than the shard's
/// rows, it keeps those `eviction` would keep (LFU: the most looked up;
/// otherwise the most recently seen) and counts the others evicted.
pub fn kv_slice(
    saved: &[KvShard],
    rows: Range<usize>,
    buckets: Range<usize>,
    (of, eviction): (usize, Eviction),
) -> KvSlice {
    let views: Vec<ShardView> = (saved.iter())
        .map(|s| (s.rows.clone(), s.buckets.clone(), s.state.view()))
        .collect();
    slice(&views, rows, buckets, (of, eviction))
}

/// A shard's rows, buckets and map, borrowed.
pub(crate) type ShardView<'a> = (Range<usize>, Range<usize>, KvView<'a>);

/// [`kv_slice`] of borrowed maps (a table's own, uncopied).
pub(crate) fn slice(
    saved: &[ShardView],
    rows: Range<usize>,
    buckets: Range<usize>,
    (of, eviction): (usize, Eviction),
) -> KvSlice {
    if let Some((_, _, same)) = (saved.iter()).find(|s| s.0 == rows && s.1 == buckets) {
        return KvSlice {
            from_rows: rows.collect(),
            state: same.to_state(),
        };
    }
    let cap = rows.len();
    let mut state = KvState {
        ids: Vec::with_capacity(cap),
        last_seen: Vec::with_capacity(cap),
        counts: Vec::with_capacity(cap),
        ..KvState::default()
    };
    // (saved row, id, header, count) of every id of the buckets.
    let mut taken = Vec::new();
    for (at, _, st) in saved {
        for (l, &id) in st.ids.iter().enumerate() {
            if st.counts[l] > 0 && buckets.contains(&id_bucket(id, of)) {
                taken.push((at.start + l, id, st.last_seen[l], st.counts[l]));
            }
        }
    }
    let evicted = taken.len().saturating_sub(cap);
    if evicted > 0 {
        match eviction {
            Eviction::Lfu => taken.sort_by_key(|t| std::cmp::Reverse((t.3, t.2, t.0))),
            _ => taken.sort_by_key(|t| std::cmp::Reverse((t.2, t.3, t.0))),
        }
        taken.truncate(cap);
        taken.sort_unstable_by_key(|t| t.0);
    }
    let mut from_rows = Vec::with_capacity(taken.len());
    for (row, id, last_seen, count) in taken {
        from_rows.push(row);
        state.ids.push(id);
        state.last_seen.push(last_seen);
        state.counts.push(count);
    }
    let held = from_rows.len();
    state.ids.resize(cap, 0);
    state.last_seen.resize(cap, 0);
    state.counts.resize(cap, 0);
    state.sketch = summed_sketch(saved.iter().map(|s| s.2.sketch));
    let first = saved.first().map(|s| s.2.position);
    state.position = KvPosition {
        seed: first.map_or(0, |p| p.seed),
        clock: (saved.iter())
            .map(|s| s.2.position.clock)
            .max()
            .unwrap_or(0),
        never_used: held as u64,
        hand: 0,
        stats: KvStats {
            evicted: evicted as u64,
            ..KvStats::default()
        },
    };
    if buckets.start == 0 {
        state
            .position
            .stats
            .add(&summed_stats(saved.iter().map(|s| s.2.position)));
    }
    KvSlice { from_rows, state }
}

/// The shards' maps as one map of the table (their blocks side by side),
/// no row moved: each shard's ids and headers in its block; its free
/// rows, and the rows it never used below the last shard's, free; the
/// latest clock, the sketches and figures summed, the first shard's seed.
/// A shard's own free rows, positions and sketch are not kept: the map
/// trains on as one.
pub fn merge_shards(shards: &[KvShard]) -> KvState {
    // One shard is the table's map as it is (its free rows and position too).
    if let [whole] = shards {
        return whole.state.clone();
    }
    let mut out = KvState {
        sketch: summed_sketch(shards.iter().map(|s| &s.state.sketch[..])),
        ..KvState::default()
    };
    let last = shards.len().saturating_sub(1);
    for (k, s) in shards.iter().enumerate() {
        let st = &s.state;
        out.ids.extend(&st.ids);
        out.last_seen.extend(&st.last_seen);
        out.counts.extend(&st.counts);
        let at = s.rows.start as u32;
        out.free.extend(st.free.iter().map(|&r| at + r));
        if k < last {
            let never = st.position.never_used as u32;
            out.free.extend(at + never..s.rows.end as u32);
        }
    }
    let last_start = shards.last().map_or(0, |s| s.rows.start);
    let never_used = shards.last().map_or(0, |s| s.state.position.never_used);
    out.position = KvPosition {
        seed: shards.first().map_or(0, |s| s.state.position.seed),
        clock: (shards.iter())
            .map(|s| s.state.position.clock)
            .max()
            .unwrap_or(0),
        never_used: last_start as u64 + never_used,
        hand: 0,
        stats: summed_stats(shards.iter().map(|s| s.state.position)),
    };
    out
}

/// The shards' sketches, counter by counter (saturating).
fn summed_sketch<'a>(sketches: impl Iterator<Item = &'a [u32]>) -> Vec<u32> {
    let mut sum: Vec<u32> = Vec::new();
    for sketch in sketches {
        sum.resize(sum.len().max(sketch.len()), 0);
        for (a, &b) in sum.iter_mut().zip(sketch) {
            *a = a.saturating_add(b);
        }
    }
    sum
}

/// The shards' figures summed (a map's occupancy and capacity are its
/// own: it counts them afresh).
fn summed_stats(positions: impl Iterator<Item = KvPosition>) -> KvStats {
    let mut total = KvStats::default();
    for p in positions {
        total.add(&p.stats);
    }
    total
}
