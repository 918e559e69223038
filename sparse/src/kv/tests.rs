//! The index against a plain model of the same rules (linear searches,
//! exact counts, whole sorts) on random id streams: the same row for
//! every lookup, the same evictions and fallbacks, the same figures.

use proptest::prelude::*;

use super::{Admission, Eviction, KvConfig, KvIndex};
use crate::rng::mix;

/// One row of the model: the id it holds, when last seen, how often.
#[derive(Clone, Copy, Debug)]
struct Held {
    id: u64,
    last: u32,
    count: u32,
}

/// The rules of `KvIndex`, written plainly.
struct Model {
    config: KvConfig,
    seed: u64,
    rows: Vec<Option<Held>>,
    free: Vec<usize>,
    never_used: usize,
    hand: usize,
    sightings: std::collections::HashMap<u64, u32>,
    seen: u64,
    evicted: u64,
    fallbacks: u64,
    admitted: u64,
    rejected: u64,
    full: u64,
    /// Training batches so far: the headers' clock.
    clock: u32,
}

impl Model {
    fn new(config: KvConfig, capacity: usize, seed: u64) -> Self {
        Self {
            config,
            seed,
            rows: vec![None; capacity],
            free: Vec::new(),
            never_used: 0,
            hand: 0,
            sightings: Default::default(),
            seen: 0,
            evicted: 0,
            fallbacks: 0,
            admitted: 0,
            rejected: 0,
            full: 0,
            clock: 0,
        }
    }

    fn lookup(
        &mut self,
        id: u64,
        step: u32,
        training: bool,
        norm: &dyn Fn(usize) -> f32,
        budget: &mut usize,
    ) -> usize {
        let found = self.rows.iter().position(|h| h.is_some_and(|h| h.id == id));
        let row = match found {
            Some(r) => {
                if training {
                    let h = self.rows[r].as_mut().unwrap();
                    h.last = step;
                    h.count = h.count.saturating_add(1);
                }
                Some(r)
            }
            None if training => self.admit(id, step, norm, budget),
            None => None,
        };
        if training {
            self.seen += 1;
        }
        row.unwrap_or_else(|| {
            self.fallbacks += 1;
            self.rows.len()
        })
    }

    fn admit(
        &mut self,
        id: u64,
        step: u32,
        norm: &dyn Fn(usize) -> f32,
        budget: &mut usize,
    ) -> Option<usize> {
        let admitted = match self.config.admission {
            Admission::Always => true,
            Admission::Count { min_count, .. } => {
                let n = self.sightings.entry(id).or_default();
                *n += 1;
                *n >= min_count
            }
            Admission::Probability { p } => {
                let u = (mix(&[self.seed, id, self.seen]) >> 11) as f64 / (1u64 << 53) as f64;
                u < p
            }
        };
        if !admitted {
            self.rejected += 1;
            return None;
        }
        let mut dry = 0;
        let row = loop {
            if let Some(r) = self.free.pop() {
                break r;
            }
            if self.never_used < self.rows.len() {
                self.never_used += 1;
                break self.never_used - 1;
            }
            if *budget == 0 {
                self.full += 1;
                return None;
            }
            let looked = self.evict(step, norm);
            *budget = budget.saturating_sub(looked);
            if self.free.is_empty() {
                dry += looked;
                if dry >= self.rows.len() {
                    *budget = 0;
                }
            }
        };
        self.rows[row] = Some(Held {
            id,
            last: step,
            count: 1,
        });
        self.admitted += 1;
        Some(row)
    }

    fn evict(&mut self, step: u32, norm: &dyn Fn(usize) -> f32) -> usize {
        let cap = self.rows.len();
        let window = self.config.window().min(cap);
        let mut looked: Vec<usize> = Vec::new();
        for k in 0..window {
            let r = (self.hand + k) % cap;
            if self.rows[r].is_some_and(|h| h.last != step) {
                looked.push(r);
            }
        }
        self.hand = (self.hand + window) % cap;
        let held = |r: usize| self.rows[r].unwrap();
        let victims: Vec<usize> = match self.config.eviction {
            Eviction::Ttl { steps } => looked
                .into_iter()
                .filter(|&r| step.saturating_sub(held(r).last) > steps)
                .collect(),
            policy => {
                let mut order = looked;
                for _ in 0..order.len() {
                    // A bubble pass at a time: plain, and obviously a sort.
                    for i in 1..order.len() {
                        let (a, b) = (order[i - 1], order[i]);
                        let before = match policy {
                            Eviction::Lru => (held(b).last, b) < (held(a).last, a),
                            Eviction::Lfu => {
                                (held(b).count, held(b).last, b) < (held(a).count, held(a).last, a)
                            }
                            _ => norm(b) < norm(a) || (norm(b) == norm(a) && b < a),
                        };
                        if before {
                            order.swap(i - 1, i);
                        }
                    }
                }
                order.into_iter().take(window.div_ceil(8)).collect()
            }
        };
        for r in victims {
            self.rows[r] = None;
            self.free.push(r);
            self.evicted += 1;
        }
        window
    }
}

fn policies() -> impl Strategy<Value = Eviction> {
    prop_oneof![
        Just(Eviction::Lru),
        Just(Eviction::Lfu),
        (1u32..4).prop_map(|steps| Eviction::Ttl { steps }),
        Just(Eviction::L2Norm),
    ]
}

fn admissions() -> impl Strategy<Value = Admission> {
    prop_oneof![
        Just(Admission::Always),
        (1u32..4, prop::option::of(1u32..4)).prop_map(|(min_count, halve_every)| {
            Admission::Count {
                min_count,
                sketch_width: 1 << 16,
                halve_every,
            }
        }),
        (0.2f64..1.0).prop_map(|p| Admission::Probability { p }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn the_index_follows_the_plain_model(
        eviction in policies(),
        admission in admissions(),
        capacity in 1usize..24,
        window in 1usize..16,
        scan in prop_oneof![Just(usize::MAX), 1usize..40],
        batches in prop::collection::vec(
            (prop::collection::vec(0u64..60, 0..20), any::<bool>()),
            1..12,
        ),
    ) {
        let config = KvConfig {
            admission,
            eviction,
            eviction_window: Some(window),
            max_scan_per_batch: Some(scan),
            ..KvConfig::default()
        };
        let seed = 7;
        let mut index = KvIndex::new(config.clone(), capacity, seed);
        let mut model = Model::new(config, capacity, seed);
        // A row's norm: a fixed function of the row, ties included.
        let norm = |r: usize| (r % 5) as f32;
        for (batch, (ids, training)) in batches.into_iter().enumerate() {
            if training {
                model.clock += 1;
                // Aging: every count halves each `halve_every` batches.
                if let Admission::Count { halve_every: Some(n), .. } = admission {
                    if model.clock.is_multiple_of(n) {
                        model.sightings.values_mut().for_each(|c| *c /= 2);
                    }
                }
            }
            let step = model.clock;
            let mut rows: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
            let fresh = index.assign(&mut rows, training, &norm);
            let mut budget = scan;
            let expected: Vec<i64> = ids
                .iter()
                .map(|&id| model.lookup(id, step, training, &norm, &mut budget) as i64)
                .collect();
            prop_assert_eq!(&rows, &expected, "batch {}", batch);
            for f in &fresh {
                prop_assert_eq!(index.id_of(f.row as usize), Some(f.id));
            }
            for (r, held) in model.rows.iter().enumerate() {
                prop_assert_eq!(index.id_of(r), held.map(|h| h.id), "row {}", r);
                if let Some(h) = held {
                    prop_assert_eq!(index.row_of(h.id), Some(r as u32));
                }
            }
            let stats = index.stats();
            prop_assert_eq!(stats.seen, model.seen);
            prop_assert_eq!(stats.evicted, model.evicted);
            prop_assert_eq!(stats.fallback_reads, model.fallbacks);
            let counts = (stats.admitted, stats.rejected, stats.full);
            prop_assert_eq!(counts, (model.admitted, model.rejected, model.full));
            let held = model.rows.iter().filter(|h| h.is_some()).count() as u64;
            prop_assert_eq!(stats.occupancy, held);
        }
    }
}

#[test]
fn rows_seen_in_the_batch_are_kept_and_a_full_table_falls_back() {
    let config = KvConfig {
        eviction_window: Some(4),
        ..KvConfig::default()
    };
    let mut index = KvIndex::new(config, 2, 0);
    // Two rows, three new ids in one batch: the third finds no row it may
    // take (both were seen in this batch) and reads the fallback.
    let mut ids = vec![10, 11, 12];
    index.assign(&mut ids, true, &|_| 0.0);
    assert_eq!(ids, [0, 1, 2]);
    let stats = index.stats();
    assert_eq!(
        (stats.admitted, stats.full, stats.fallback_reads),
        (2, 1, 1)
    );
    // Next step, 12 takes the least recently seen row.
    let mut ids = vec![11, 12];
    index.assign(&mut ids, true, &|_| 0.0);
    assert_eq!(ids, [1, 0]);
    assert_eq!(index.row_of(10), None);
    // Inference reads, admits nobody and changes no header.
    let mut ids = vec![10, 12];
    index.assign(&mut ids, false, &|_| 0.0);
    assert_eq!(ids, [2, 0]);
    assert_eq!(index.stats().seen, 5);
}

#[test]
fn a_saved_map_restores_exactly_and_a_broken_one_is_refused() {
    let config = KvConfig {
        admission: Admission::Count {
            min_count: 2,
            sketch_width: 64,
            halve_every: Some(4),
        },
        eviction: Eviction::Lfu,
        eviction_window: Some(3),
        ..KvConfig::default()
    };
    let stream = |index: &mut KvIndex, steps: std::ops::Range<u64>| -> Vec<Vec<i64>> {
        steps
            .map(|step| {
                let mut ids: Vec<i64> = (0..6).map(|k| ((step * 7 + k * 3) % 11) as i64).collect();
                index.assign(&mut ids, true, &|r| r as f32);
                ids
            })
            .collect()
    };
    let mut index = KvIndex::new(config.clone(), 5, 1);
    stream(&mut index, 0..6);
    let saved = index.state();
    let mut restored = KvIndex::new(config.clone(), 5, 1);
    restored.restore(saved.clone()).unwrap();
    assert_eq!(restored.state(), saved);
    assert_eq!(stream(&mut restored, 6..12), stream(&mut index, 6..12));
    assert_eq!(restored.state(), index.state());

    let refused = |edit: &dyn Fn(&mut super::KvState)| {
        let mut state = saved.clone();
        edit(&mut state);
        let mut fresh = KvIndex::new(config.clone(), 5, 1);
        let err = fresh.restore(state).unwrap_err();
        assert_eq!(fresh.state(), KvIndex::new(config.clone(), 5, 1).state());
        err
    };
    let held: Vec<usize> = (0..5).filter(|&r| saved.counts[r] > 0).collect();
    let (a, b) = (held[0], held[1]);
    let twice = refused(&|s| s.ids[b] = s.ids[a]);
    assert!(
        twice.contains(&format!("id {} is held by two rows", saved.ids[a])),
        "{twice}"
    );
    let late = refused(&|s| s.last_seen[a] = 7);
    assert!(late.contains("after the map's clock 6"), "{late}");
    let short = refused(&|s| {
        s.counts.pop();
    });
    assert!(short.contains("for 5 rows"), "{short}");
    let orphan = refused(&|s| s.counts[a] = 0);
    assert!(
        orphan.contains(&format!("row {a} is neither held nor free")),
        "{orphan}"
    );
}

#[test]
fn a_delta_applied_in_place_is_the_later_map_and_a_broken_one_changes_nothing() {
    let config = KvConfig {
        admission: Admission::Count {
            min_count: 2,
            sketch_width: 64,
            halve_every: Some(4),
        },
        eviction: Eviction::Lru,
        eviction_window: Some(3),
        ..KvConfig::default()
    };
    let stream = |index: &mut KvIndex, steps: std::ops::Range<u64>| -> Vec<Vec<i64>> {
        steps
            .map(|step| {
                let mut ids: Vec<i64> = (0..6).map(|k| ((step * 5 + k * 3) % 13) as i64).collect();
                index.assign(&mut ids, true, &|r| r as f32);
                ids
            })
            .collect()
    };
    let mut later = KvIndex::new(config.clone(), 12, 1);
    stream(&mut later, 0..8);
    let earlier = later.clone();
    stream(&mut later, 8..9);
    let (a, b) = (earlier.state(), later.state());
    // The rows whose id or header moved, and two that did not.
    let mut rows: Vec<u64> = (0..12)
        .filter(|&r| {
            (a.ids[r], a.last_seen[r], a.counts[r]) != (b.ids[r], b.last_seen[r], b.counts[r])
        })
        .map(|r| r as u64)
        .collect();
    assert!(!rows.is_empty() && rows.len() < 10, "{rows:?}");
    let same: Vec<u64> = (0..12).filter(|r| !rows.contains(r)).take(2).collect();
    rows.extend(same);
    rows.sort_unstable();
    let mut applied = earlier.clone();
    applied.apply_delta(&rows, later.delta(&rows)).unwrap();
    assert_eq!(applied.state(), b);
    assert_eq!(stream(&mut applied, 11..16), stream(&mut later, 11..16));
    assert_eq!(applied.state(), later.state());

    // Broken: an id another (unchanged) row holds; a free row that holds
    // an id; a clock going back. The map stays as it was.
    let refused = |edit: &dyn Fn(&mut super::KvState)| {
        let mut delta = earlier.delta(&rows);
        edit(&mut delta);
        let mut index = earlier.clone();
        let err = index.apply_delta(&rows, delta).unwrap_err();
        assert_eq!(index.state(), a);
        err
    };
    let u = (0..12).find(|&r| a.counts[r] > 0 && !rows.contains(&(r as u64)));
    let u = u.expect("a held row the delta leaves alone");
    let k = (rows.iter())
        .position(|&r| b.counts[r as usize] > 0)
        .unwrap();
    let err = refused(&|d| d.ids[k] = a.ids[u]);
    assert!(
        err.contains(&format!("id {} is held by two rows", a.ids[u])),
        "{err}"
    );
    let held = (0..12).find(|&r| a.counts[r] > 0).unwrap();
    let err = refused(&|d| d.free.push(held as u32));
    assert!(err.contains(&format!("free row {held}")), "{err}");
    let err = refused(&|d| d.position.clock = 2);
    assert!(err.contains("clock 2 is before"), "{err}");

    // A row listed twice, its first copy free: the second copy's id
    // would enter the map twice.
    let r = rows[k];
    let mut twice = rows.clone();
    twice.insert(k, r);
    let mut delta = later.delta(&twice);
    delta.counts[k] = 0;
    let mut index = earlier.clone();
    let err = index.apply_delta(&twice, delta).unwrap_err();
    assert!(err.contains(&format!("row {r} after row {r}")), "{err}");
    assert_eq!(index.state(), a);
}

#[test]
fn a_map_split_by_buckets_and_merged_keeps_every_id_with_its_header() {
    use super::{id_bucket, kv_slice, merge_shards, KvShard, KvState, KvStats};
    let config = KvConfig {
        admission: Admission::Count {
            min_count: 2,
            sketch_width: 64,
            halve_every: None,
        },
        eviction: Eviction::Lru,
        eviction_window: Some(3),
        ..KvConfig::default()
    };
    let mut whole = KvIndex::new(config.clone(), 12, 3);
    for step in 0..10u64 {
        let mut ids: Vec<i64> = (0..6).map(|k| ((step * 7 + k * 5) % 10) as i64).collect();
        whole.assign(&mut ids, true, &|r| r as f32);
    }
    let saved = [KvShard {
        rows: 0..12,
        buckets: 0..4,
        state: whole.state(),
    }];
    let a = &saved[0].state;
    let held = |s: &KvState| -> Vec<(u64, u32, u32)> {
        let mut v: Vec<_> = (0..s.ids.len())
            .filter(|&r| s.counts[r] > 0)
            .map(|r| (s.ids[r], s.last_seen[r], s.counts[r]))
            .collect();
        v.sort_unstable();
        v
    };
    assert!(held(a).len() > 4, "{a:?}");
    // The same split is taken whole.
    let same = kv_slice(&saved, 0..12, 0..4, (4, Eviction::Lru));
    assert_eq!((same.from_rows, same.state), ((0..12).collect(), a.clone()));
    // Two shards of 6 rows, buckets 0..b and b..4 (b where both fit):
    // each takes its ids, from the rows that held them, and its map
    // restores.
    let below = |b: usize| {
        (a.ids.iter().zip(&a.counts))
            .filter(|&(&id, &c)| c > 0 && id_bucket(id, 4) < b)
            .count()
    };
    let b = (1..4).find(|&b| below(b) <= 6 && held(a).len() - below(b) <= 6);
    let b = b.expect("a split of the buckets that fits");
    let parts: Vec<KvShard> = [(0..6, 0..b), (6..12, b..4)]
        .into_iter()
        .map(|(rows, buckets)| {
            let slice = kv_slice(&saved, rows.clone(), buckets.clone(), (4, Eviction::Lru));
            for (i, &r) in slice.from_rows.iter().enumerate() {
                assert_eq!(slice.state.ids[i], a.ids[r]);
                assert!(buckets.contains(&id_bucket(a.ids[r], 4)));
            }
            let mut index = KvIndex::new(config.clone(), rows.len(), 3);
            index.restore(slice.state.clone()).unwrap();
            KvShard {
                rows,
                buckets,
                state: slice.state,
            }
        })
        .collect();
    let mut together: Vec<_> = parts.iter().flat_map(|p| held(&p.state)).collect();
    together.sort_unstable();
    assert_eq!(together, held(a));
    assert_eq!(parts[0].state.position.stats, a.position.stats);
    assert_eq!(parts[1].state.position.stats, KvStats::default());
    // Merged without moving a row: the ids stay in their blocks.
    let merged = merge_shards(&parts);
    let mut index = KvIndex::new(config.clone(), 12, 3);
    index.restore(merged.clone()).unwrap();
    assert_eq!(held(&merged), held(a));
    for p in &parts {
        for (l, &id) in p.state.ids.iter().enumerate() {
            if p.state.counts[l] > 0 {
                assert_eq!(index.row_of(id), Some((p.rows.start + l) as u32));
            }
        }
    }
    // Too many ids for a shard's rows: it keeps the most recently seen
    // (LRU) or the most looked up (LFU), and counts the rest evicted.
    let mut by_recency = held(a);
    by_recency.sort_by_key(|h| std::cmp::Reverse((h.1, h.2)));
    let mut by_count = held(a);
    by_count.sort_by_key(|h| std::cmp::Reverse((h.2, h.1)));
    for (eviction, order) in [(Eviction::Lru, by_recency), (Eviction::Lfu, by_count)] {
        let two = kv_slice(&saved, 0..2, 0..4, (4, eviction));
        let mut want = order[..2].to_vec();
        want.sort_unstable();
        assert_eq!(held(&two.state), want, "{eviction:?}");
        assert_eq!(two.from_rows.len(), 2);
        assert!(two.from_rows[0] < two.from_rows[1]);
        let evicted = a.position.stats.evicted + (held(a).len() - 2) as u64;
        assert_eq!(two.state.position.stats.evicted, evicted);
    }
}
