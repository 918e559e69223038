//! The disk tier: tables in a file behind a cache train and pool bit for bit
//! as the same tables in RAM, whatever the cache size (evictions, rows
//! written back and read again), and fail with errors that name the table.

use ember_sparse::{
    CachePolicy, DataType, DiskTierConfig, EmbeddingBagCollection, EmbeddingBagConfig,
    KeyedJaggedTensor, SparseError, TableOptimizer,
};
use proptest::prelude::*;

/// Random bags (duplicates included, optionally weighted) over `tables`,
/// feature `f{t}` for table `t`, plus a shared feature `s` of table 0.
fn batch(
    tables: &[(usize, usize)],
    size: usize,
    seed: u64,
    weighted: bool,
) -> (KeyedJaggedTensor, usize) {
    let mut rng = ember_sparse::rng::Rng::new(seed);
    let mut keys: Vec<String> = (0..tables.len()).map(|t| format!("f{t}")).collect();
    keys.push("s".into());
    let (mut lengths, mut values) = (Vec::new(), Vec::new());
    let rows_of = |k: usize| {
        if k < tables.len() {
            tables[k].0
        } else {
            tables[0].0
        }
    };
    for k in 0..keys.len() {
        for _ in 0..size {
            let len = rng.below(4) as i64;
            lengths.push(len);
            // Half the ids from a few hot rows: hits, and duplicates.
            values.extend((0..len).map(|_| {
                let rows = rows_of(k) as u64;
                (if rng.below(2) == 0 {
                    rng.below(rows.min(8))
                } else {
                    rng.below(rows)
                }) as i64
            }));
        }
    }
    let weights = weighted.then(|| values.iter().map(|_| rng.next_f32() + 0.5).collect());
    let width = tables.iter().map(|t| t.1).sum::<usize>() + tables[0].1;
    (
        KeyedJaggedTensor::from_lengths(keys, values, &lengths, weights).unwrap(),
        width,
    )
}

fn configs(tables: &[(usize, usize)], dtype: DataType) -> Vec<EmbeddingBagConfig> {
    tables
        .iter()
        .enumerate()
        .map(|(t, &(rows, dim))| {
            let name = format!("f{t}");
            let features: Vec<&str> = if t == 0 {
                vec![&name, "s"]
            } else {
                vec![&name]
            };
            EmbeddingBagConfig::new(&format!("t{t}"), rows, dim, &features).with_data_type(dtype)
        })
        .collect()
}

fn all_rows(ebc: &EmbeddingBagCollection) -> Vec<Vec<u32>> {
    ebc.tables()
        .iter()
        .map(|t| {
            let mut all = Vec::new();
            let mut row = vec![0f32; t.dim()];
            for id in 0..t.num_embeddings() {
                t.read_row(id, &mut row);
                all.extend(row.iter().map(|x| x.to_bits()));
            }
            all
        })
        .collect()
}

/// A table's rows and state as stored, read `piece` rows at a time.
fn stored(table: &ember_sparse::EmbeddingTable, piece: usize) -> (Vec<u8>, Vec<u32>) {
    let (stride, per_row, rows) = (
        table.bytes_per_row(),
        table.state_floats_per_row(),
        table.num_embeddings(),
    );
    let (mut bytes, mut state) = (vec![0u8; rows * stride], vec![0f32; rows * per_row]);
    for first in (0..rows).step_by(piece) {
        let n = piece.min(rows - first);
        table
            .read_stored_rows(
                first,
                &mut bytes[first * stride..(first + n) * stride],
                &mut state[first * per_row..(first + n) * per_row],
            )
            .unwrap();
    }
    (bytes, bits(&state))
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Several steps of forward and fused backward, in RAM and on the disk
    /// tier with a small cache (one to four sets of 16): the same pooled
    /// outputs and the same rows, bit for bit, for every trainable type and
    /// optimizer.
    #[test]
    fn disk_tier_trains_as_ram(
        tables in prop::collection::vec((20usize..300, prop_oneof![Just(4usize), Just(16), Just(7)]), 1..3),
        sets in 2usize..5,
        dtype in prop_oneof![Just(DataType::Fp32), Just(DataType::Fp16), Just(DataType::Bf16)],
        optimizer in prop_oneof![
            Just(TableOptimizer::sgd(0.1)),
            Just(TableOptimizer::rowwise_adagrad(0.1)),
            Just(TableOptimizer::adam(0.01)),
        ],
        weighted in any::<bool>(),
        policy in prop_oneof![Just(CachePolicy::Lru), Just(CachePolicy::Lfu)],
        seed in any::<u64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let mut ram = EmbeddingBagCollection::new(configs(&tables, dtype), optimizer, seed).unwrap();
        let tiers = tables.iter().map(|_| Some(DiskTierConfig {
            dir: dir.path().to_path_buf(),
            cache_rows: sets * ember_sparse::CACHE_WAYS,
            policy,
        })).collect();
        let mut disk = EmbeddingBagCollection::with_disk_tiers(configs(&tables, dtype), optimizer, seed, tiers).unwrap();
        prop_assert_eq!(all_rows(&ram), all_rows(&disk));
        for step in 0..4u64 {
            // Few enough samples that a batch fits the cache's sets.
            let (kjt, width) = batch(&tables, 3, seed ^ step, weighted);
            let expected = ram.forward(&kjt).unwrap();
            disk.prefetch(&kjt).unwrap();
            let got = disk.forward(&kjt).unwrap();
            prop_assert_eq!(bits(expected.values()), bits(got.values()), "forward of step {}", step);
            let grad: Vec<f32> = (0..kjt.stride() * width).map(|i| ((i * 7 + step as usize) % 11) as f32 / 5.0 - 1.0).collect();
            ram.backward_update(&kjt, &grad).unwrap();
            disk.backward_update(&kjt, &grad).unwrap();
        }
        prop_assert_eq!(all_rows(&ram), all_rows(&disk), "rows after training");
        // Rows and state as stored, read in pieces: the cache's newer rows
        // over the file's.
        let piece = 1 + (seed % 37) as usize;
        for (r, d) in ram.tables().iter().zip(disk.tables()) {
            prop_assert_eq!(stored(r, piece), stored(d, piece), "stored rows of {}", r.name());
        }
        // Loaded piece by piece into other tables (another seed, a cache
        // already holding rows), they train on as the originals.
        let tiers = tables.iter().map(|_| Some(DiskTierConfig {
            dir: dir.path().to_path_buf(),
            cache_rows: sets * ember_sparse::CACHE_WAYS,
            policy,
        })).collect();
        let mut loaded = EmbeddingBagCollection::with_disk_tiers(configs(&tables, dtype), optimizer, !seed, tiers).unwrap();
        let (kjt, _) = batch(&tables, 3, seed, weighted);
        loaded.prefetch(&kjt).unwrap();
        loaded.forward(&kjt).unwrap();
        for (from, to) in ram.tables().iter().zip(loaded.tables_mut()) {
            let (rows, state) = stored(from, from.num_embeddings());
            let state: Vec<f32> = state.into_iter().map(f32::from_bits).collect();
            let (stride, per_row) = (from.bytes_per_row(), from.state_floats_per_row());
            for first in (0..from.num_embeddings()).step_by(piece) {
                let n = piece.min(from.num_embeddings() - first);
                to.write_stored_rows(
                    first,
                    &rows[first * stride..(first + n) * stride],
                    &state[first * per_row..(first + n) * per_row],
                ).unwrap();
            }
        }
        loaded.set_step(ram.step());
        loaded.set_rounding_seed(ram.rounding_seed());
        let (kjt, width) = batch(&tables, 3, !seed, weighted);
        let grad: Vec<f32> = (0..kjt.stride() * width).map(|i| (i % 5) as f32 / 4.0 - 0.5).collect();
        for ebc in [&mut ram, &mut loaded, &mut disk] {
            ebc.prefetch(&kjt).unwrap();
            ebc.forward(&kjt).unwrap();
            ebc.backward_update(&kjt, &grad).unwrap();
        }
        for (r, l) in ram.tables().iter().zip(loaded.tables()) {
            prop_assert_eq!(stored(r, piece), stored(l, piece), "loaded rows of {}", r.name());
        }
        // Flushed, every row comes from the file alone.
        for t in disk.tables_mut() {
            t.flush().unwrap();
        }
        prop_assert_eq!(all_rows(&ram), all_rows(&disk));
    }
}

fn disk_collection(
    dir: &std::path::Path,
    rows: usize,
    cache_rows: usize,
) -> EmbeddingBagCollection {
    let configs = vec![EmbeddingBagConfig::new("big", rows, 4, &["f"])];
    let tier = DiskTierConfig {
        dir: dir.to_path_buf(),
        cache_rows,
        policy: CachePolicy::Lru,
    };
    EmbeddingBagCollection::with_disk_tiers(configs, TableOptimizer::sgd(0.1), 1, vec![Some(tier)])
        .unwrap()
}

fn bags(ids: &[i64]) -> KeyedJaggedTensor {
    KeyedJaggedTensor::from_lengths(vec!["f".into()], ids.to_vec(), &vec![1; ids.len()], None)
        .unwrap()
}

#[test]
fn hit_rates_count_every_lookup() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebc = disk_collection(dir.path(), 1000, 64);
    let kjt = bags(&[1, 2, 3, 3]);
    ebc.prefetch(&kjt).unwrap();
    let s = ebc.tables()[0].tier_stats().unwrap();
    // 4 lookups, 3 distinct rows missed (the second 3 waits on the
    // first), made from the seed: a new table's rows are not in its file.
    assert_eq!((s.lookups, s.misses), (4, 3));
    assert_eq!(s.bytes_read, 0);
    ebc.prefetch(&kjt).unwrap();
    let s = ebc.tables()[0].tier_stats().unwrap();
    assert_eq!((s.lookups, s.misses), (8, 3));
    assert!((s.hit_rate() - 5.0 / 8.0).abs() < 1e-12);
    // 64 rows of cache, 4 sets: 100 distinct rows evict some of 1, 2, 3,
    // whose misses then are not first lookups.
    for first in [10, 35, 60, 85] {
        ebc.prefetch(&bags(&(first..first + 25).collect::<Vec<_>>()))
            .unwrap();
    }
    let before = ebc.tables()[0].tier_stats().unwrap();
    assert_eq!(before.first_misses, 103);
    ebc.prefetch(&kjt).unwrap();
    let s = ebc.tables()[0].tier_stats().unwrap().since(&before);
    assert!(s.misses > 0 && s.first_misses == 0, "{s:?}");
    assert_eq!(s.hit_rate_bound(), 1.0);
}

#[test]
fn forward_without_prefetch_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebc = disk_collection(dir.path(), 100, 16);
    let err = ebc.forward(&bags(&[1])).unwrap_err();
    assert!(
        matches!(&err, SparseError::NotPrefetched { table } if table == "big"),
        "{err}"
    );
    ebc.prefetch(&bags(&[2])).unwrap();
    // Another batch than the one staged is refused too.
    assert!(ebc.forward(&bags(&[1])).is_err());
    assert!(ebc.forward(&bags(&[2])).is_ok());
}

#[test]
fn bad_ids_and_full_sets_name_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebc = disk_collection(dir.path(), 100, 16);
    let err = ebc.prefetch(&bags(&[5, 100])).unwrap_err();
    assert!(
        matches!(&err, SparseError::IdOutOfRange { table, id: 100, sample: 1, .. } if table == "big"),
        "{err}"
    );
    // One set of 16: a batch of 17 distinct rows cannot be held at once.
    let ids: Vec<i64> = (0..17).collect();
    let err = ebc.prefetch(&bags(&ids)).unwrap_err();
    assert!(
        matches!(&err, SparseError::CacheFull { table, cache_rows: 16 } if table == "big"),
        "{err}"
    );
    // The cache still works after the refusal.
    ebc.prefetch(&bags(&ids[..16])).unwrap();
    ebc.forward(&bags(&ids[..16])).unwrap();
}

/// A batch refused for a full set leaves the cache as it was: the changed
/// rows its misses would have evicted are kept (they were not yet written
/// back), under either policy.
#[test]
fn a_refused_batch_loses_no_changed_row() {
    for policy in CachePolicy::ALL {
        let dir = tempfile::tempdir().unwrap();
        let configs = || vec![EmbeddingBagConfig::new("t", 100, 4, &["f"])];
        let opt = TableOptimizer::sgd(0.5);
        let tier = DiskTierConfig {
            dir: dir.path().to_path_buf(),
            cache_rows: 16,
            policy,
        };
        let mut disk =
            EmbeddingBagCollection::with_disk_tiers(configs(), opt, 3, vec![Some(tier)]).unwrap();
        let mut ram = EmbeddingBagCollection::new(configs(), opt, 3).unwrap();
        // 16 rows in the set, all changed.
        let kjt = bags(&(0..16).collect::<Vec<_>>());
        let grad = vec![1.0; 16 * 4];
        disk.prefetch(&kjt).unwrap();
        disk.forward(&kjt).unwrap();
        disk.backward_update(&kjt, &grad).unwrap();
        ram.backward_update(&kjt, &grad).unwrap();
        // 17 other rows: refused after evicting all 16.
        let err = disk
            .prefetch(&bags(&(50..67).collect::<Vec<_>>()))
            .unwrap_err();
        assert!(matches!(err, SparseError::CacheFull { .. }), "{err}");
        // Those 16 are still cached (no read), then as RAM's once flushed.
        disk.prefetch(&kjt).unwrap();
        let s = disk.tables()[0].tier_stats().unwrap();
        assert_eq!(s.misses, 16, "{policy}: misses");
        disk.tables_mut()[0].flush().unwrap();
        assert_eq!(all_rows(&ram), all_rows(&disk), "{policy}");
    }
}

#[test]
fn files_are_named_in_errors_and_removed_with_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir");
    let configs = vec![EmbeddingBagConfig::new("big", 10, 4, &["f"])];
    let tier = DiskTierConfig {
        dir: missing.clone(),
        cache_rows: 16,
        policy: CachePolicy::Lru,
    };
    let err = EmbeddingBagCollection::with_disk_tiers(
        configs,
        TableOptimizer::sgd(0.1),
        1,
        vec![Some(tier)],
    )
    .unwrap_err();
    assert!(
        matches!(&err, SparseError::Disk { table, path, .. } if table == "big" && path.starts_with(&missing)),
        "{err}"
    );
    let ebc = disk_collection(dir.path(), 10, 16);
    let path = ebc.tables()[0].disk_path().unwrap().to_path_buf();
    assert!(path.exists());
    drop(ebc);
    assert!(!path.exists());
    let tier = DiskTierConfig {
        dir: dir.path().to_path_buf(),
        cache_rows: 15,
        policy: CachePolicy::Lru,
    };
    let configs = vec![EmbeddingBagConfig::new("small", 10, 4, &["f"])];
    let err = EmbeddingBagCollection::with_disk_tiers(
        configs,
        TableOptimizer::sgd(0.1),
        1,
        vec![Some(tier)],
    )
    .unwrap_err();
    assert!(err.to_string().contains("below one set"), "{err}");
}

/// A row evicted by one miss and needed again later in the same batch is
/// read back after its changes are written: one set of 16 full of changed
/// rows, then batches that each evict a row and ask for it right after.
#[test]
fn a_row_evicted_and_wanted_by_one_batch_keeps_its_changes() {
    let dir = tempfile::tempdir().unwrap();
    let configs = || vec![EmbeddingBagConfig::new("t", 64, 4, &["f"])];
    let opt = TableOptimizer::sgd(0.5);
    let tier = DiskTierConfig {
        dir: dir.path().to_path_buf(),
        cache_rows: 16,
        policy: CachePolicy::Lru,
    };
    let mut disk =
        EmbeddingBagCollection::with_disk_tiers(configs(), opt, 3, vec![Some(tier)]).unwrap();
    let mut ram = EmbeddingBagCollection::new(configs(), opt, 3).unwrap();
    let mut step = |ids: Vec<i64>| {
        let kjt = bags(&ids);
        let grad: Vec<f32> = (0..ids.len() * 4).map(|i| (i % 5) as f32 - 2.0).collect();
        disk.prefetch(&kjt).unwrap();
        let got = disk.forward(&kjt).unwrap();
        let expected = ram.forward(&kjt).unwrap();
        assert_eq!(
            bits(got.values()),
            bits(expected.values()),
            "forward of {ids:?}"
        );
        disk.backward_update(&kjt, &grad).unwrap();
        ram.backward_update(&kjt, &grad).unwrap();
    };
    for round in 0..8i64 {
        // 16 rows in the set, all changed by the backward.
        step((0..16).map(|i| (i + 16 * round) % 64).collect());
        // Eight new rows evict the eight least recently placed, which the
        // second half of the batch asks for (read while, on another
        // thread, the first half writes them back).
        let new = (0..8).map(|i| (i + 16 * round + 16) % 64);
        let old = (0..8).map(|i| (i + 16 * round) % 64);
        step(new.chain(old).collect());
    }
    assert_eq!(all_rows(&ram), all_rows(&disk));
}

#[test]
fn a_failed_read_names_the_table_and_file_and_leaves_the_cache_usable() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebc = disk_collection(dir.path(), 1000, 64);
    let path = ebc.tables()[0].disk_path().unwrap().to_path_buf();
    // Rows in the file (a new table's are made, not read).
    for id in [3, 4, 900] {
        ebc.tables_mut()[0].write_row(id, &[1.0; 4]);
    }
    // The file loses all but its first two records, rows 3 and 4 (as a
    // disk failing under it would): a record is a 4-byte header and the
    // row (sgd keeps no state).
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(2 * (4 + 4 * 4)).unwrap();
    let err = ebc.prefetch(&bags(&[3, 900])).unwrap_err();
    assert!(
        matches!(&err, SparseError::Disk { table, path: p, .. } if table == "big" && *p == path),
        "{err}"
    );
    // Rows still in the file are served, and a forward needs its prefetch.
    ebc.prefetch(&bags(&[3, 4])).unwrap();
    ebc.forward(&bags(&[3, 4])).unwrap();
}

#[test]
fn rows_written_by_hand_read_back_from_the_cache_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebc = disk_collection(dir.path(), 1000, 16);
    ebc.prefetch(&bags(&[7])).unwrap();
    let table = &mut ebc.tables_mut()[0];
    // Row 7 is cached, row 500 only in the file.
    table.write_row(7, &[1.0, 2.0, 3.0, 4.0]);
    table.write_row(500, &[5.0, 6.0, 7.0, 8.0]);
    let mut row = [0f32; 4];
    table.read_row(7, &mut row);
    assert_eq!(row, [1.0, 2.0, 3.0, 4.0]);
    table.read_row(500, &mut row);
    assert_eq!(row, [5.0, 6.0, 7.0, 8.0]);
    // The cached row's change reaches the file (flushed, then evicted by
    // 16 other rows) and comes back from it.
    table.flush().unwrap();
    let fresh: Vec<i64> = (100..116).collect();
    ebc.prefetch(&bags(&fresh)).unwrap();
    ebc.prefetch(&bags(&[7])).unwrap();
    let pooled = ebc.forward(&bags(&[7])).unwrap();
    assert_eq!(pooled.values(), [1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn read_ahead_hints_the_rows_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebc = disk_collection(dir.path(), 1000, 64);
    let ahead = ebc.read_ahead().expect("a disk-tier table");
    // A new table's rows are made, not read: nothing to hint.
    assert_eq!(ahead.run(&bags(&[1, 2, 2])), 0);
    for id in [1, 2] {
        ebc.tables_mut()[0].write_row(id, &[1.0; 4]);
    }
    // Ids past the table are left to prefetch to report.
    assert_eq!(ahead.run(&bags(&[1, 2, 2, 5000])), 3);
    ebc.prefetch(&bags(&[1])).unwrap();
    assert_eq!(ahead.run(&bags(&[1, 2, 2])), 2);
    let ram = EmbeddingBagCollection::new(
        vec![EmbeddingBagConfig::new("t", 10, 4, &["f"])],
        TableOptimizer::sgd(0.1),
        1,
    )
    .unwrap();
    assert!(ram.read_ahead().is_none());
}

/// LFU admits a row to its set only over a row looked up no more often, as
/// FBGEMM's; the others are served from bypass slots, where a later batch
/// finds them again. A cache of 31 rows: one set of 16 and, under LFU, 15
/// bypass slots; trained beside the same table in RAM.
#[test]
fn lfu_serves_rarely_used_rows_beside_their_set() {
    let run = |policy: CachePolicy| {
        let dir = tempfile::tempdir().unwrap();
        let configs = || vec![EmbeddingBagConfig::new("t", 1000, 4, &["f"])];
        let opt = TableOptimizer::rowwise_adagrad(0.5);
        let tier = DiskTierConfig {
            dir: dir.path().to_path_buf(),
            cache_rows: 31,
            policy,
        };
        let mut disk =
            EmbeddingBagCollection::with_disk_tiers(configs(), opt, 3, vec![Some(tier)]).unwrap();
        let mut ram = EmbeddingBagCollection::new(configs(), opt, 3).unwrap();
        let mut misses = Vec::new();
        let mut step = |ids: std::ops::Range<i64>| -> Result<(), SparseError> {
            let kjt = bags(&ids.collect::<Vec<_>>());
            let before = disk.tables()[0].tier_stats().unwrap().misses;
            disk.prefetch(&kjt)?;
            assert_eq!(disk.forward(&kjt)?.values(), ram.forward(&kjt)?.values());
            let grad: Vec<f32> = (0..kjt.stride() * 4)
                .map(|i| (i % 7) as f32 - 3.0)
                .collect();
            disk.backward_update(&kjt, &grad)?;
            ram.backward_update(&kjt, &grad)?;
            misses.push(disk.tables()[0].tier_stats().unwrap().misses - before);
            Ok(())
        };
        // 16 hot rows, three times; 10 cold rows; the hot ones again; the
        // cold ones again; then 20 new rows at once.
        for _ in 0..3 {
            step(0..16).unwrap();
        }
        step(100..110).unwrap();
        step(0..16).unwrap();
        step(100..110).unwrap();
        let wide = step(200..220);
        assert_eq!(all_rows(&ram), all_rows(&disk), "{policy}: rows, cached");
        disk.tables_mut()[0].flush().unwrap();
        assert_eq!(all_rows(&ram), all_rows(&disk), "{policy}: rows, flushed");
        (misses, wide)
    };
    let (lfu, wide) = run(CachePolicy::Lfu);
    // The cold rows go to bypass slots: the hot ones stay (no misses), and
    // the cold ones are found there again.
    assert_eq!(lfu, [16, 0, 0, 10, 0, 0, 20]);
    assert!(wide.is_ok(), "{wide:?}");
    let (lru, wide) = run(CachePolicy::Lru);
    // LRU has the same set and no bypass: the cold rows evict hot ones
    // (which then evict each other, the oldest first), and 20 rows cannot
    // be held by 16 slots at once.
    assert_eq!(lru, [16, 0, 0, 10, 16, 10]);
    assert!(
        matches!(wide, Err(SparseError::CacheFull { .. })),
        "{wide:?}"
    );
}

/// A batch one table refuses leaves the other tables' caches as they were:
/// their changed rows, which its misses would have evicted, are kept.
#[test]
fn a_batch_refused_by_one_table_loses_no_row_of_another() {
    let dir = tempfile::tempdir().unwrap();
    let configs = || {
        vec![
            EmbeddingBagConfig::new("t0", 200, 4, &["f0"]),
            EmbeddingBagConfig::new("t1", 200, 4, &["f1"]),
        ]
    };
    let opt = TableOptimizer::sgd(0.5);
    let tier = Some(DiskTierConfig {
        dir: dir.path().to_path_buf(),
        cache_rows: 16,
        policy: CachePolicy::Lru,
    });
    let mut disk =
        EmbeddingBagCollection::with_disk_tiers(configs(), opt, 3, vec![tier.clone(), tier])
            .unwrap();
    let mut ram = EmbeddingBagCollection::new(configs(), opt, 3).unwrap();
    // 16 samples; t1's first bag takes the ids beyond 16.
    let two = |a: Vec<i64>, b: Vec<i64>| {
        let mut lengths = vec![1; 32];
        lengths[16] += b.len() as i64 - 16;
        let keys = vec!["f0".into(), "f1".into()];
        KeyedJaggedTensor::from_lengths(keys, [a, b].concat(), &lengths, None).unwrap()
    };
    let kjt = two((0..16).collect(), (0..16).collect());
    let grad = vec![1.0; 16 * 8];
    disk.prefetch(&kjt).unwrap();
    disk.forward(&kjt).unwrap();
    disk.backward_update(&kjt, &grad).unwrap();
    ram.backward_update(&kjt, &grad).unwrap();
    // t0 could take its 16 new rows (evicting its 16 changed ones); t1
    // cannot hold 17 at once, an out-of-range id, and the batch is refused.
    let wide = two((100..116).collect(), (0..17).collect());
    let err = disk.prefetch(&wide).unwrap_err();
    assert!(matches!(err, SparseError::CacheFull { .. }), "{err}");
    let bad = two(
        (100..116).collect(),
        [vec![500], (1..16).collect()].concat(),
    );
    let err = disk.prefetch(&bad).unwrap_err();
    assert!(matches!(err, SparseError::IdOutOfRange { .. }), "{err}");
    disk.prefetch(&kjt).unwrap();
    assert_eq!(disk.forward(&kjt).unwrap(), ram.forward(&kjt).unwrap());
    for t in disk.tables_mut() {
        t.flush().unwrap();
    }
    assert_eq!(all_rows(&ram), all_rows(&disk));
}

#[test]
fn tables_made_from_one_another_make_the_same_rows() {
    // A whole table's rows, a shard of its odd rows' last 4 columns, a
    // shard of that shard, and a table made alike: each made row is the
    // whole table's, through every maker in between.
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTierConfig {
        dir: dir.path().to_path_buf(),
        cache_rows: 64,
        policy: CachePolicy::Lru,
    };
    let table = |rows: usize, dim: usize, seed: Option<u64>| {
        let configs = vec![EmbeddingBagConfig::new("t", rows, dim, &["f"])];
        let (opt, tiers) = (TableOptimizer::sgd(0.1), vec![Some(tier.clone())]);
        match seed {
            Some(seed) => EmbeddingBagCollection::with_disk_tiers(configs, opt, seed, tiers),
            None => EmbeddingBagCollection::zeroed_with_disk_tiers(configs, opt, tiers),
        }
        .unwrap()
    };
    let whole = table(100, 8, Some(3));
    let whole = &whole.tables()[0];
    let (mut odd, mut half, mut alike) =
        (table(50, 4, None), table(25, 2, None), table(100, 8, None));
    let odd = &mut odd.tables_mut()[0];
    assert!(odd.make_rows_as(&whole.row_maker().unwrap(), |l| 2 * l + 1, 4..8));
    let half = &mut half.tables_mut()[0];
    assert!(half.make_rows_as(&odd.row_maker().unwrap(), |l| 2 * l, 2..4));
    let alike = &mut alike.tables_mut()[0];
    assert!(alike.make_rows_like(&whole.row_maker().unwrap()));
    assert!(
        !alike.make_rows_like(&odd.row_maker().unwrap()),
        "another shape"
    );
    let (all, made) = (stored(whole, 7).0, stored(half, 7).0);
    for l in 0..25 {
        // Row 4l + 1 of the whole table, its columns 6 and 7 (fp32).
        let at = (4 * l + 1) * 32 + 6 * 4;
        assert_eq!(made[l * 8..(l + 1) * 8], all[at..at + 8], "row {l}");
    }
    assert_eq!(stored(alike, 7), stored(whole, 7));
}

/// The file holds the optimizer state of the optimizer the table was built
/// with: another that keeps state is refused; one that keeps none (SGD's
/// rate) is taken.
#[test]
fn an_optimizer_with_state_is_refused_on_the_disk_tier() {
    let dir = tempfile::tempdir().unwrap();
    let mut ebc = disk_collection(dir.path(), 1000, 64);
    let err = ebc
        .set_optimizer(TableOptimizer::rowwise_adagrad(0.1))
        .unwrap_err();
    assert!(err.to_string().contains("on the disk tier"), "{err}");
    assert_eq!(ebc.optimizer(), &TableOptimizer::sgd(0.1));
    ebc.set_optimizer(TableOptimizer::sgd(0.5)).unwrap();
    assert_eq!(ebc.optimizer(), &TableOptimizer::sgd(0.5));
}

/// An inference table's rows read in place (from bytes of another's, as a
/// checkpoint mapped) pool as the same rows in RAM, and its file holds no
/// block: nothing was copied, nothing reserved.
#[test]
fn rows_read_in_place_pool_as_in_ram_and_take_no_disk() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let (rows, dim) = (5000, 16);
    let config = EmbeddingBagConfig {
        data_type: DataType::Int8,
        ..EmbeddingBagConfig::new("big", rows, dim, &["f"])
    };
    let ram = EmbeddingBagCollection::new(vec![config.clone()], TableOptimizer::None, 3).unwrap();
    let bytes: std::sync::Arc<Vec<u8>> = ram.tables()[0].row_bytes().to_vec().into();
    let stride = bytes.len() / rows;
    let tier = DiskTierConfig {
        dir: dir.path().to_path_buf(),
        cache_rows: 2048,
        policy: CachePolicy::Lru,
    };
    let mut disk = EmbeddingBagCollection::zeroed_with_disk_tiers(
        vec![config],
        TableOptimizer::None,
        vec![Some(tier)],
    )
    .unwrap();
    let source = std::sync::Arc::clone(&bytes);
    let read = move |row: u64, out: &mut [u8]| {
        out.copy_from_slice(&source[row as usize * stride..][..stride])
    };
    disk.tables_mut()[0]
        .read_rows_in_place(std::sync::Arc::new(read))
        .unwrap();
    for seed in 0..4 {
        let ids: Vec<i64> = (0..100)
            .map(|i| (i * 7919 + seed * 131) % rows as i64)
            .collect();
        let kjt = bags(&ids);
        disk.prefetch(&kjt).unwrap();
        let (want, got) = (ram.forward(&kjt).unwrap(), disk.forward(&kjt).unwrap());
        assert_eq!(want.values(), got.values());
    }
    let file = disk.tables()[0].disk_path().unwrap();
    assert_eq!(
        std::fs::metadata(file).unwrap().blocks(),
        0,
        "no block of the file"
    );
    // A second source, or a table that trains, is refused by name.
    let again = disk.tables_mut()[0].read_rows_in_place(std::sync::Arc::new(|_, _| ()));
    let again = again.unwrap_err().to_string();
    assert!(
        again.contains("big") && again.contains("made or looked up already"),
        "{again}"
    );
    let mut trains = disk_collection(dir.path(), 100, 64);
    let err = trains.tables_mut()[0].read_rows_in_place(std::sync::Arc::new(|_, _| ()));
    assert!(err.unwrap_err().to_string().contains("trains"));
}

/// A disk-tier table built for inference (its file's space not reserved)
/// is not given an optimizer later.
#[test]
fn an_inference_disk_tier_table_takes_no_optimizer_later() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTierConfig {
        dir: dir.path().to_path_buf(),
        cache_rows: 256,
        policy: CachePolicy::Lru,
    };
    let configs = vec![EmbeddingBagConfig::new("big", 1000, 4, &["f"])];
    let mut ebc =
        EmbeddingBagCollection::with_disk_tiers(configs, TableOptimizer::None, 1, vec![Some(tier)])
            .unwrap();
    let err = ebc.set_optimizer(TableOptimizer::sgd(0.1)).unwrap_err();
    assert!(err.to_string().contains("built for inference"), "{err}");
    ebc.set_optimizer(TableOptimizer::None).unwrap();
}
