//! [`KvIndex`]: a key-value table's map from raw ids to rows, with each
//! row's header, admission and eviction. The map is hashbrown's
//! `HashTable` of row numbers (the ids live once, beside the headers),
//! hashed by splitmix: 5 bytes a row at most 7/8 full, against 12 or more
//! for a map holding the ids too. Measured (`benches/kv_map.rs`): 0.11 of
//! the machine's random-gather rate, lookups being dependent cache misses. The rows themselves are an
//! ordinary table's: staging rewrites a batch's raw ids as rows, and the
//! kernels run on them as on any table.

use hashbrown::HashTable;
use serde::Serialize;

use super::sketch::CountMinSketch;
use super::{Admission, Eviction, KvConfig};
use crate::rng::{mix, splitmix};

/// What a key-value table has done since it was first built (carried
/// through checkpoints).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct KvStats {
    /// Ids looked up by training batches.
    pub seen: u64,
    /// New ids given a row.
    pub admitted: u64,
    /// Sightings of new ids that admission turned away.
    pub rejected: u64,
    /// Sightings of new ids admitted but left without a row: nothing could
    /// be evicted within the batch's scan budget.
    pub full: u64,
    /// Rows given up to make room.
    pub evicted: u64,
    /// Lookups (training and inference) that read the fallback row.
    pub fallback_reads: u64,
    /// Rows holding an id now.
    pub occupancy: u64,
    /// Rows that can hold an id.
    pub capacity: u64,
}

impl KvStats {
    /// Adds `other`'s figures (another shard's of the same table).
    pub fn add(&mut self, other: &KvStats) {
        self.seen += other.seen;
        self.admitted += other.admitted;
        self.rejected += other.rejected;
        self.full += other.full;
        self.evicted += other.evicted;
        self.fallback_reads += other.fallback_reads;
        self.occupancy += other.occupancy;
        self.capacity += other.capacity;
    }
}

/// A key-value table's map as saved: per row the id, header and count (0:
/// free), the free rows in reuse order, the sketch's counters, and where
/// the index stands. Restored exactly, a run goes on bitwise.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvState {
    /// The id each row holds (meaningless where `counts` is 0).
    pub ids: Vec<u64>,
    /// The clock (training batch) each row was last looked up at.
    pub last_seen: Vec<u32>,
    /// Training lookups since the row was given; 0: the row is free.
    pub counts: Vec<u32>,
    /// Free rows given up by eviction, reused last first.
    pub free: Vec<u32>,
    /// The admission sketch's counters (empty without count admission).
    pub sketch: Vec<u32>,
    /// Where the index stands.
    pub position: KvPosition,
}

/// A [`KvState`] borrowed from the map (a checkpoint writes it without
/// copying the map).
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    /// The id each row holds.
    pub ids: &'a [u64],
    /// Each row's last training lookup (clock).
    pub last_seen: &'a [u32],
    /// Each row's training lookups (0: free).
    pub counts: &'a [u32],
    /// Free rows, reused last first.
    pub free: &'a [u32],
    /// The admission sketch's counters.
    pub sketch: &'a [u32],
    /// Where the index stands.
    pub position: KvPosition,
}

impl KvView<'_> {
    /// The state, copied.
    pub fn to_state(&self) -> KvState {
        KvState {
            ids: self.ids.to_vec(),
            last_seen: self.last_seen.to_vec(),
            counts: self.counts.to_vec(),
            free: self.free.to_vec(),
            sketch: self.sketch.to_vec(),
            position: self.position,
        }
    }
}

impl KvState {
    /// The state, borrowed.
    pub fn view(&self) -> KvView<'_> {
        KvView {
            ids: &self.ids,
            last_seen: &self.last_seen,
            counts: &self.counts,
            free: &self.free,
            sketch: &self.sketch,
            position: self.position,
        }
    }
}

/// Where a key-value table's index stands (a checkpoint's metadata).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct KvPosition {
    /// Seeds probabilistic admission and the rows made for new ids.
    pub seed: u64,
    /// Training batches the index has staged: its own clock, which the
    /// headers count in (apart from any optimizer's step, so a table
    /// without one, or loaded under another, keeps time).
    pub clock: u64,
    /// Rows from here on have never held an id.
    pub never_used: u64,
    /// Where the next eviction pass starts.
    pub hand: u64,
    /// The figures so far.
    pub stats: KvStats,
}

/// A row newly given to an id in a batch: the caller makes its values
/// afresh and zeroes its optimizer state before the batch reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fresh {
    pub(crate) row: u32,
    pub(crate) id: u64,
}

/// The map from raw ids to the rows `0..capacity` of a table whose row
/// `capacity` is the fallback. Row `r` holds an id when `counts[r] > 0`.
#[derive(Clone)]
pub(crate) struct KvIndex {
    config: KvConfig,
    /// Seeds probabilistic admission.
    seed: u64,
    capacity: usize,
    /// Rows by their id's hash (the ids themselves are in `keys`).
    map: HashTable<u32>,
    keys: Vec<u64>,
    /// The clock each row was last looked up at by a training batch.
    last_seen: Vec<u32>,
    /// Training batches staged so far.
    clock: u32,
    /// Training lookups since the row was given (0: the row is free).
    counts: Vec<u32>,
    /// Rows given up, reused last first.
    free: Vec<u32>,
    /// Rows `never_used..capacity` have never held an id.
    never_used: usize,
    /// Where the next eviction pass starts.
    hand: usize,
    sketch: Option<CountMinSketch>,
    /// The counted figures (occupancy and capacity come from the map).
    stats: KvStats,
    /// Rows given up since the table last took them (its changed rows).
    given_up: Vec<u32>,
}

impl std::fmt::Debug for KvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (f.debug_struct("KvIndex"))
            .field("config", &self.config)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn hash(id: u64) -> u64 {
    splitmix(id)
}

impl KvIndex {
    /// An empty index over `capacity` rows (the config checked).
    pub(crate) fn new(config: KvConfig, capacity: usize, seed: u64) -> Self {
        let sketch = match config.admission {
            Admission::Count { sketch_width, .. } => Some(CountMinSketch::new(sketch_width)),
            _ => None,
        };
        Self {
            config,
            seed,
            capacity,
            map: HashTable::new(),
            keys: vec![0; capacity],
            last_seen: vec![0; capacity],
            counts: vec![0; capacity],
            free: Vec::new(),
            never_used: 0,
            hand: 0,
            clock: 0,
            sketch,
            stats: KvStats::default(),
            given_up: Vec::new(),
        }
    }

    /// The fallback row.
    pub(crate) fn fallback_row(&self) -> usize {
        self.capacity
    }

    /// Seeds probabilistic admission and the rows made for new ids.
    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    pub(crate) fn config(&self) -> &KvConfig {
        &self.config
    }

    /// The figures, with occupancy and capacity as the map stands.
    pub(crate) fn stats(&self) -> KvStats {
        KvStats {
            occupancy: self.map.len() as u64,
            capacity: self.capacity as u64,
            ..self.stats
        }
    }

    /// Counters of the admission sketch (0 without one).
    pub(crate) fn sketch_len(&self) -> usize {
        self.sketch.as_ref().map_or(0, |s| s.counters().len())
    }

    /// The map as saved, borrowed.
    pub(crate) fn view(&self) -> KvView<'_> {
        KvView {
            ids: &self.keys,
            last_seen: &self.last_seen,
            counts: &self.counts,
            free: &self.free,
            sketch: self.sketch.as_ref().map_or(&[][..], |s| s.counters()),
            position: self.position(),
        }
    }

    /// The map as saved.
    pub(crate) fn state(&self) -> KvState {
        KvState {
            ids: self.keys.clone(),
            last_seen: self.last_seen.clone(),
            counts: self.counts.clone(),
            ..self.headless_state()
        }
    }

    /// The map as saved without its rows' ids, headers and counts.
    fn headless_state(&self) -> KvState {
        KvState {
            ids: Vec::new(),
            last_seen: Vec::new(),
            counts: Vec::new(),
            free: self.free.clone(),
            sketch: self
                .sketch
                .as_ref()
                .map_or(Vec::new(), |s| s.counters().to_vec()),
            position: self.position(),
        }
    }

    /// Where the index stands.
    fn position(&self) -> KvPosition {
        KvPosition {
            seed: self.seed,
            clock: self.clock as u64,
            never_used: self.never_used as u64,
            hand: self.hand as u64,
            stats: self.stats(),
        }
    }

    /// The map as a delta saves it (see `EmbeddingTable::kv_delta`).
    pub(crate) fn delta(&self, rows: &[u64]) -> KvState {
        let held: Vec<usize> = (rows.iter().map(|&r| r as usize))
            .filter(|&r| r < self.capacity)
            .collect();
        let pick = |v: &[u32]| held.iter().map(|&r| v[r]).collect();
        let mut state = self.headless_state();
        state.ids = held.iter().map(|&r| self.keys[r]).collect();
        (state.last_seen, state.counts) = (pick(&self.last_seen), pick(&self.counts));
        state
    }

    /// Writes a delta's rows over the map in place: of `rows` (ascending,
    /// the table's changed rows) those below the fallback row take
    /// `delta`'s ids, headers and counts, in order; the free rows, sketch
    /// and position are `delta`'s. Checked first, so nothing changes on an
    /// error, which names the id or row at fault: the changed rows hold
    /// ids no other row holds, the free rows are free and listed once,
    /// every row ever used is held or free, and neither the clock nor the
    /// rows ever used go back. Costs the changed rows, not the table.
    pub(crate) fn apply_delta(&mut self, rows: &[u64], delta: KvState) -> Result<(), String> {
        let cap = self.capacity;
        // Each row once: a row listed twice would enter the map twice.
        if let Some(w) = rows.windows(2).find(|w| w[1] <= w[0]) {
            return Err(format!(
                "changed rows are not ascending: row {} after row {}",
                w[1], w[0]
            ));
        }
        let held: Vec<usize> = (rows.iter().map(|&r| r as usize))
            .filter(|&r| r < cap)
            .collect();
        let lengths = [delta.ids.len(), delta.last_seen.len(), delta.counts.len()];
        if lengths.iter().any(|&n| n != held.len()) {
            return Err(format!(
                "{lengths:?} ids, headers and counts for {} changed rows",
                held.len()
            ));
        }
        let position = delta.position;
        let (clock, never_used) = (position.clock, position.never_used as usize);
        if clock > u32::MAX as u64 || clock < self.clock as u64 {
            return Err(format!(
                "clock {clock} is before the map's {} or past {}",
                self.clock,
                u32::MAX
            ));
        }
        if never_used > cap || never_used < self.never_used || position.hand as usize >= cap.max(1)
        {
            return Err(format!(
                "position (never used from row {never_used}, hand at row {}) out of its {cap} rows, or rows ever used went back from {}",
                position.hand, self.never_used
            ));
        }
        if delta.sketch.len() != self.sketch_len() {
            return Err(format!(
                "{} sketch counters, not {}",
                delta.sketch.len(),
                self.sketch_len()
            ));
        }
        let changed: std::collections::HashMap<usize, usize> =
            held.iter().enumerate().map(|(k, &r)| (r, k)).collect();
        let mut ids = std::collections::HashSet::new();
        for (k, &r) in held.iter().enumerate() {
            let (id, count) = (delta.ids[k], delta.counts[k]);
            if count == 0 {
                continue;
            }
            if r >= never_used {
                return Err(format!("row {r} holds id {id} past the rows ever used"));
            }
            if delta.last_seen[k] as u64 > clock {
                return Err(format!(
                    "id {id} (row {r}) was last seen at batch {}, after the map's clock {clock}",
                    delta.last_seen[k]
                ));
            }
            let elsewhere = self
                .row_of(id)
                .is_some_and(|o| !changed.contains_key(&(o as usize)));
            if !ids.insert(id) || elsewhere {
                return Err(format!("id {id} is held by two rows"));
            }
        }
        let count_of = |r: usize| changed.get(&r).map_or(self.counts[r], |&k| delta.counts[k]);
        let mut listed = std::collections::HashSet::new();
        for &r in &delta.free {
            let r = r as usize;
            if r >= never_used || count_of(r) > 0 || !listed.insert(r) {
                return Err(format!(
                    "free row {r} is out of range, holds an id or is listed twice"
                ));
            }
        }
        // Rows ever used are held or free: as many as both together.
        let was_held = held.iter().filter(|&&r| self.counts[r] > 0).count();
        let now_held = self.map.len() - was_held + ids.len();
        if now_held + delta.free.len() != never_used {
            return Err(format!(
                "{never_used} rows ever used, but {now_held} held and {} free",
                delta.free.len()
            ));
        }
        for &r in held.iter().filter(|&&r| self.counts[r] > 0) {
            let (keys, id) = (&self.keys, self.keys[r]);
            if let Ok(entry) = self.map.find_entry(hash(id), |&s| keys[s as usize] == id) {
                entry.remove();
            }
        }
        for (k, &r) in held.iter().enumerate() {
            self.keys[r] = delta.ids[k];
            self.last_seen[r] = delta.last_seen[k];
            self.counts[r] = delta.counts[k];
        }
        for &r in held.iter().filter(|&&r| self.counts[r] > 0) {
            let keys = &self.keys;
            self.map
                .insert_unique(hash(keys[r]), r as u32, |&s| hash(keys[s as usize]));
        }
        if let Some(sketch) = self.sketch.as_mut() {
            sketch.counters_mut().copy_from_slice(&delta.sketch);
        }
        self.free = delta.free;
        (self.never_used, self.hand) = (never_used, position.hand as usize);
        self.seed = position.seed;
        self.clock = clock as u32;
        self.stats = position.stats;
        self.given_up.clear();
        Ok(())
    }

    /// Replaces the map with a saved one, checked whole first: one row per
    /// id, free rows free and listed once, headers not past its clock. The
    /// error names the id or row at fault.
    pub(crate) fn restore(&mut self, state: KvState) -> Result<(), String> {
        let clock = state.position.clock;
        if clock > u32::MAX as u64 {
            return Err(format!("clock {clock} is past {}", u32::MAX));
        }
        let cap = self.capacity;
        let lengths = [state.ids.len(), state.last_seen.len(), state.counts.len()];
        if lengths.iter().any(|&n| n != cap) {
            return Err(format!(
                "{lengths:?} ids, headers and counts for {cap} rows"
            ));
        }
        let sketch_len = self.sketch.as_ref().map_or(0, |s| s.counters().len());
        if state.sketch.len() != sketch_len {
            return Err(format!(
                "{} sketch counters, not {sketch_len}",
                state.sketch.len()
            ));
        }
        let (never_used, hand) = (state.position.never_used as usize, state.position.hand);
        if never_used > cap || hand as usize >= cap.max(1) {
            return Err(format!(
                "position (never used from row {never_used}, hand at row {hand}) past {cap} rows"
            ));
        }
        let mut map = HashTable::with_capacity(never_used);
        let mut listed = vec![false; cap];
        for &r in &state.free {
            let r = r as usize;
            if r >= never_used || state.counts[r] > 0 || std::mem::replace(&mut listed[r], true) {
                return Err(format!(
                    "free row {r} is out of range, holds an id or is listed twice"
                ));
            }
        }
        for (r, &free) in listed.iter().enumerate() {
            let (id, count) = (state.ids[r], state.counts[r]);
            if count == 0 {
                if r < never_used && !free {
                    return Err(format!("row {r} is neither held nor free"));
                }
                continue;
            }
            if r >= never_used {
                return Err(format!("row {r} holds id {id} past the rows ever used"));
            }
            if state.last_seen[r] as u64 > clock {
                return Err(format!(
                    "id {id} (row {r}) was last seen at batch {}, after the map's clock {clock}",
                    state.last_seen[r]
                ));
            }
            let ids = &state.ids;
            if map
                .find(hash(id), |&s: &u32| ids[s as usize] == id)
                .is_some()
            {
                return Err(format!("id {id} is held by two rows"));
            }
            map.insert_unique(hash(id), r as u32, |&s| hash(ids[s as usize]));
        }
        if let Some(sketch) = self.sketch.as_mut() {
            sketch.counters_mut().copy_from_slice(&state.sketch);
        }
        self.map = map;
        (self.keys, self.last_seen, self.counts) = (state.ids, state.last_seen, state.counts);
        self.free = state.free;
        (self.never_used, self.hand) = (never_used, hand as usize);
        self.seed = state.position.seed;
        self.clock = clock as u32;
        self.stats = state.position.stats;
        self.given_up.clear();
        Ok(())
    }

    /// The row holding `id`, if any.
    pub(crate) fn row_of(&self, id: u64) -> Option<u32> {
        let keys = &self.keys;
        self.map
            .find(hash(id), |&r| keys[r as usize] == id)
            .copied()
    }

    /// The id row `r` holds, if any.
    pub(crate) fn id_of(&self, r: usize) -> Option<u64> {
        (self.counts[r] > 0).then(|| self.keys[r])
    }

    /// Bytes of the map, the headers and the sketch.
    pub(crate) fn bytes(&self) -> usize {
        self.map.capacity() * (4 + 1)
            + self.capacity * (8 + 4 + 4)
            + 4 * self.free.capacity()
            + self.sketch.as_ref().map_or(0, CountMinSketch::bytes)
    }

    /// Rewrites a batch's raw ids (as `i64` bits) as rows, in order. A
    /// training batch moves the clock on one, admits new ids (rows given
    /// up to make room; never one looked up in this batch) and updates the
    /// header of every row it looks up; otherwise new ids only read the
    /// fallback and nothing else changes but `fallback_reads`. `norm(r)`
    /// is row `r`'s L2 norm (for L2 eviction). Returns the rows given to
    /// new ids.
    pub(crate) fn assign(
        &mut self,
        ids: &mut [i64],
        training: bool,
        norm: &dyn Fn(usize) -> f32,
    ) -> Vec<Fresh> {
        if training {
            self.clock = self.clock.saturating_add(1);
            if let Admission::Count {
                halve_every: Some(n),
                ..
            } = self.config.admission
            {
                if self.clock.is_multiple_of(n.max(1)) {
                    self.sketch
                        .as_mut()
                        .expect("a count admission's sketch")
                        .halve();
                }
            }
        }
        let step = self.clock;
        let mut fresh = Vec::new();
        let mut budget = self.config.scan_per_batch();
        for v in ids.iter_mut() {
            let id = *v as u64;
            let row = match self.row_of(id) {
                Some(r) if training => {
                    let r = r as usize;
                    self.last_seen[r] = step;
                    self.counts[r] = self.counts[r].saturating_add(1);
                    Some(r)
                }
                Some(r) => Some(r as usize),
                None if training => self.admit(id, step, &mut budget, norm, &mut fresh),
                None => None,
            };
            if training {
                self.stats.seen += 1;
            }
            *v = match row {
                Some(r) => r as i64,
                None => {
                    self.stats.fallback_reads += 1;
                    self.capacity as i64
                }
            };
        }
        fresh
    }

    /// A sighting of `id`, which holds no row: its row if admission lets
    /// it in and room is found.
    fn admit(
        &mut self,
        id: u64,
        step: u32,
        budget: &mut usize,
        norm: &dyn Fn(usize) -> f32,
        fresh: &mut Vec<Fresh>,
    ) -> Option<usize> {
        let admitted = match self.config.admission {
            Admission::Always => true,
            Admission::Count { min_count, .. } => {
                let sketch = self.sketch.as_mut().expect("a count admission's sketch");
                sketch.add(id) >= min_count
            }
            Admission::Probability { p } => {
                let draw = mix(&[self.seed, id, self.stats.seen]);
                ((draw >> 11) as f64 * (1.0 / (1u64 << 53) as f64)) < p
            }
        };
        if !admitted {
            self.stats.rejected += 1;
            return None;
        }
        // Passes until one frees a row, within the batch's budget; a
        // whole sweep that frees nothing spends the budget: nothing later
        // in the batch can be freed either (its rows only get pinned).
        let mut dry = 0;
        let row = match self.take_free() {
            Some(r) => r,
            None => loop {
                if *budget == 0 || self.capacity == 0 {
                    self.stats.full += 1;
                    return None;
                }
                let looked = self.evict_pass(step, norm);
                *budget = budget.saturating_sub(looked);
                if let Some(r) = self.take_free() {
                    break r;
                }
                dry += looked;
                if dry >= self.capacity {
                    *budget = 0;
                }
            },
        };
        self.keys[row] = id;
        self.last_seen[row] = step;
        self.counts[row] = 1;
        let keys = &self.keys;
        self.map
            .insert_unique(hash(id), row as u32, |&r| hash(keys[r as usize]));
        self.stats.admitted += 1;
        fresh.push(Fresh {
            row: row as u32,
            id,
        });
        Some(row)
    }

    /// The rows given up since the last call.
    pub(crate) fn take_given_up(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.given_up)
    }

    fn take_free(&mut self) -> Option<usize> {
        if let Some(r) = self.free.pop() {
            return Some(r as usize);
        }
        (self.never_used < self.capacity).then(|| {
            self.never_used += 1;
            self.never_used - 1
        })
    }

    /// Looks at the next window of rows from the hand and gives up the
    /// policy's victims among those not looked up at `step`; returns the
    /// rows looked at.
    fn evict_pass(&mut self, step: u32, norm: &dyn Fn(usize) -> f32) -> usize {
        let window = self.config.window().min(self.capacity);
        let mut candidates: Vec<usize> = (0..window)
            .map(|k| (self.hand + k) % self.capacity)
            .filter(|&r| self.counts[r] > 0 && self.last_seen[r] != step)
            .collect();
        self.hand = (self.hand + window) % self.capacity;
        let take = window.div_ceil(8);
        let (seen, counts) = (&self.last_seen, &self.counts);
        match self.config.eviction {
            Eviction::Ttl { steps } => {
                candidates.retain(|&r| step.saturating_sub(seen[r]) > steps);
            }
            Eviction::Lru => candidates.sort_by_key(|&r| (seen[r], r)),
            Eviction::Lfu => candidates.sort_by_key(|&r| (counts[r], seen[r], r)),
            Eviction::L2Norm => {
                let mut scored: Vec<(f32, usize)> =
                    candidates.iter().map(|&r| (norm(r), r)).collect();
                scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                candidates = scored.into_iter().map(|(_, r)| r).collect();
            }
        }
        if !matches!(self.config.eviction, Eviction::Ttl { .. }) {
            candidates.truncate(take);
        }
        for r in candidates {
            self.give_up(r);
        }
        window
    }

    fn give_up(&mut self, r: usize) {
        let (keys, id) = (&self.keys, self.keys[r]);
        if let Ok(entry) = self.map.find_entry(hash(id), |&s| keys[s as usize] == id) {
            entry.remove();
        }
        self.counts[r] = 0;
        self.free.push(r as u32);
        self.given_up.push(r as u32);
        self.stats.evicted += 1;
    }
}
