//! Key-value tables in a collection: pooled lookups of raw 64-bit ids read
//! the rows the map gives them (or the fallback), the fused optimizer
//! updates exactly those rows, new ids start from a row drawn from the
//! id with zero optimizer state, and inference admits nobody.

use std::collections::HashMap;

use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, Eviction, Fallback, KeyedJaggedTensor, KvConfig,
    SparseError, TableOptimizer,
};
use proptest::prelude::*;

const DIM: usize = 4;

fn collection(rows: usize, kv: KvConfig, optimizer: TableOptimizer) -> EmbeddingBagCollection {
    let config = EmbeddingBagConfig {
        kv: Some(kv),
        ..EmbeddingBagConfig::new("t", rows, DIM, &["a", "b"])
    };
    EmbeddingBagCollection::new(vec![config], optimizer, 3).unwrap()
}

/// Every row of the table, by row.
fn rows_of(ebc: &EmbeddingBagCollection) -> Vec<Vec<f32>> {
    let t = ebc.table("t").unwrap();
    (0..t.num_embeddings()).map(|r| t.row(r).to_vec()).collect()
}

/// A batch of `bags` (feature "a" then "b", two samples each).
fn batch(bags: &[Vec<i64>; 4]) -> KeyedJaggedTensor {
    let lengths: Vec<i64> = bags.iter().map(|b| b.len() as i64).collect();
    let values = bags.concat();
    KeyedJaggedTensor::from_lengths(vec!["a".into(), "b".into()], values, &lengths, None).unwrap()
}

/// Raw ids: small ones that repeat, and far ones (negative as i64).
fn raw_id() -> impl Strategy<Value = i64> {
    prop_oneof![0i64..12, Just(i64::MIN), Just(-1), Just(1 << 62)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn lookups_and_updates_follow_the_map(
        fallback in prop_oneof![Just(Fallback::Zeros), Just(Fallback::SharedRow)],
        eviction in prop_oneof![Just(Eviction::Lru), Just(Eviction::Lfu), Just(Eviction::L2Norm)],
        batches in prop::collection::vec(
            prop::array::uniform4(prop::collection::vec(raw_id(), 0..4)),
            1..8,
        ),
    ) {
        let kv = KvConfig { fallback, eviction, eviction_window: Some(3), ..KvConfig::default() };
        let lr = 0.5;
        let mut ebc = collection(6, kv, TableOptimizer::sgd(lr));
        let fallback_row = 5;
        // Each id's row when it was first given one.
        let mut first_rows: HashMap<i64, Vec<f32>> = HashMap::new();
        for bags in &batches {
            let kjt = batch(bags);
            let held: Vec<bool> = {
                let table = ebc.table("t").unwrap();
                bags.concat().iter().map(|&id| table.kv_row_of(id as u64).is_some()).collect()
            };
            ebc.prefetch(&kjt).unwrap();
            let table = ebc.table("t").unwrap();
            let row_of = |id: i64| table.kv_row_of(id as u64).unwrap_or(fallback_row);
            let before = rows_of(&ebc);
            for (&id, &was_held) in bags.concat().iter().zip(&held) {
                let r = row_of(id);
                if r == fallback_row {
                    continue;
                }
                prop_assert_eq!(table.kv_id_of(r), Some(id as u64));
                // A row given afresh is the id's own draw, wherever it lands.
                if !was_held {
                    let first = first_rows.entry(id).or_insert_with(|| before[r].clone());
                    prop_assert_eq!(&before[r], &*first, "id {}", id);
                }
            }
            if fallback == Fallback::Zeros {
                prop_assert_eq!(&before[fallback_row], &vec![0.0; DIM]);
            }
            // Pooled: the sum of the rows the map gives.
            let pooled = ebc.forward(&kjt).unwrap();
            for (k, bag) in bags.iter().enumerate() {
                let (feature, sample) = (k / 2, k % 2);
                let mut sum = [0f32; DIM];
                for &id in bag {
                    for (s, v) in sum.iter_mut().zip(&before[row_of(id)]) {
                        *s += v;
                    }
                }
                prop_assert_eq!(pooled.get(sample, feature), &sum[..]);
            }
            // Backward: each row moves by lr times its summed gradient (all
            // ones), the zero fallback row not at all.
            let grad = vec![1.0f32; 2 * 2 * DIM];
            let mut hits = [0f32; 6];
            for bag in bags {
                for &id in bag {
                    hits[row_of(id)] += 1.0;
                }
            }
            ebc.backward_update(&kjt, &grad).unwrap();
            let after = rows_of(&ebc);
            for r in 0..6 {
                let moved = match (r == fallback_row, fallback) {
                    (true, Fallback::Zeros) => 0.0,
                    _ => hits[r],
                };
                for (a, b) in after[r].iter().zip(&before[r]) {
                    prop_assert!((a - (b - lr * moved)).abs() < 1e-6, "row {}", r);
                }
            }
        }
        let table = ebc.table("t").unwrap();
        let stats = table.kv_stats().unwrap();
        prop_assert!(stats.occupancy <= 5);
        prop_assert_eq!(stats.admitted - stats.evicted, stats.occupancy);
    }
}

#[test]
fn a_returning_id_starts_again_from_its_draw_with_zero_state() {
    let kv = KvConfig {
        eviction_window: Some(2),
        ..KvConfig::default()
    };
    let adagrad = TableOptimizer::adagrad(0.1);
    let mut ebc = collection(3, kv, adagrad);
    let step = |ebc: &mut EmbeddingBagCollection, ids: [i64; 2]| {
        let kjt = batch(&[vec![ids[0]], vec![ids[1]], vec![], vec![]]);
        ebc.prefetch(&kjt).unwrap();
        ebc.forward(&kjt).unwrap();
        ebc.backward_update(&kjt, &[1.0; 2 * 2 * DIM]).unwrap();
    };
    let first_row = |ebc: &mut EmbeddingBagCollection, id: i64| {
        let kjt = batch(&[vec![id], vec![], vec![], vec![]]);
        ebc.prefetch(&kjt).unwrap();
        let t = ebc.table("t").unwrap();
        let r = t.kv_row_of(id as u64).unwrap();
        (
            r,
            t.row(r).to_vec(),
            t.optimizer_state()[r * DIM..(r + 1) * DIM].to_vec(),
        )
    };
    let (_, drawn, state) = first_row(&mut ebc, 77);
    assert_eq!(state, [0.0; DIM]);
    // 77 trains, then 5 and 6 push it out of the two rows.
    step(&mut ebc, [77, 77]);
    step(&mut ebc, [5, 6]);
    let t = ebc.table("t").unwrap();
    assert_eq!(t.kv_row_of(77), None);
    assert_eq!(t.kv_stats().unwrap().evicted, 1);
    // Back again: the same draw, optimizer state zero, in whichever row.
    let (_, again, state) = first_row(&mut ebc, 77);
    assert_eq!(again, drawn);
    assert_eq!(state, [0.0; DIM]);
}

#[test]
fn inference_admits_nobody_and_reads_the_fallback() {
    let mut ebc = collection(4, KvConfig::default(), TableOptimizer::sgd(0.1));
    ebc.set_training(false);
    let kjt = batch(&[vec![1, 2], vec![3], vec![], vec![4]]);
    ebc.prefetch(&kjt).unwrap();
    let pooled = ebc.forward(&kjt).unwrap();
    assert!(pooled.values().iter().all(|&v| v == 0.0));
    let stats = ebc.table("t").unwrap().kv_stats().unwrap();
    assert_eq!(
        (stats.admitted, stats.seen, stats.fallback_reads),
        (0, 0, 4)
    );
}

#[test]
fn a_key_value_table_must_be_prefetched_and_configured_sanely() {
    let mut ebc = collection(4, KvConfig::default(), TableOptimizer::sgd(0.1));
    let kjt = batch(&[vec![1], vec![], vec![], vec![]]);
    assert!(matches!(
        ebc.forward(&kjt),
        Err(SparseError::NotPrefetched { .. })
    ));
    let bad = |kv: KvConfig, rows: usize| {
        let config = EmbeddingBagConfig {
            kv: Some(kv),
            ..EmbeddingBagConfig::new("t", rows, DIM, &["a"])
        };
        match EmbeddingBagCollection::new(vec![config], TableOptimizer::sgd(0.1), 0) {
            Err(SparseError::InvalidConfig { table, reason }) => format!("{table}: {reason}"),
            other => panic!("{other:?}"),
        }
    };
    assert!(bad(KvConfig::default(), 1).contains("2 rows"));
    let ttl0 = KvConfig {
        eviction: Eviction::Ttl { steps: 0 },
        ..KvConfig::default()
    };
    assert!(bad(ttl0, 4).contains("ttl"));
    let json = r#"{"name":"t","num_embeddings":4,"embedding_dim":4,"feature_names":["a"],
        "kv":{"admission":{"kind":"count","min_count":2,"sketch_width":1024},"eviction":{"kind":"lfu"}}}"#;
    let config: EmbeddingBagConfig = serde_json::from_str(json).unwrap();
    assert_eq!(config.kv.unwrap().eviction, Eviction::Lfu);
    ebc.prefetch(&kjt).unwrap();
    assert!(ebc.forward(&kjt).is_ok());
}

/// TorchRec's `EmbeddingCollection` over a key-value table: every raw id
/// reads the row the map gives it (the zero fallback for ids without one),
/// the fused update moves exactly those rows by their summed gradient, and
/// the map is the one a bag collection keeps on the same ids.
#[test]
fn a_sequence_collection_reads_and_trains_a_key_value_table_by_raw_id() {
    use ember_sparse::{EmbeddingCollection, EmbeddingConfig};
    let kv = KvConfig {
        eviction_window: Some(3),
        ..KvConfig::default()
    };
    let config = EmbeddingConfig {
        kv: Some(kv.clone()),
        ..EmbeddingConfig::new("t", 6, DIM, &["a", "b"])
    };
    let lr = 0.5;
    let mut ec = EmbeddingCollection::new(vec![config], TableOptimizer::sgd(lr), 3).unwrap();
    let mut ebc = collection(6, kv, TableOptimizer::sgd(lr));
    let batches: [[Vec<i64>; 4]; 4] = [
        [vec![7, -1], vec![7], vec![1 << 62], vec![]],
        [vec![8, 9, 10], vec![-1], vec![11], vec![7, 12]],
        [vec![i64::MIN], vec![8], vec![13, 14], vec![7]],
        [vec![15], vec![16, 7], vec![], vec![9]],
    ];
    for bags in &batches {
        let kjt = batch(bags);
        ec.prefetch(&kjt).unwrap();
        ebc.prefetch(&kjt).unwrap();
        let table = &ec.tables()[0];
        assert_eq!(table.kv_state(), ebc.table("t").unwrap().kv_state());
        let out = ec.forward(&kjt).unwrap();
        let rows: Vec<usize> = (bags.concat().iter())
            .map(|&id| table.kv_row_of(id as u64).unwrap_or(5))
            .collect();
        let before: Vec<Vec<f32>> = (0..6).map(|r| table.row(r).to_vec()).collect();
        for (k, &r) in rows.iter().enumerate() {
            assert_eq!(
                &out.values()[k * DIM..(k + 1) * DIM],
                &before[r][..],
                "id {k}"
            );
        }
        let grad: Vec<f32> = (0..rows.len() * DIM)
            .map(|i| (i % 7) as f32 * 0.1 - 0.3)
            .collect();
        ec.backward_update(&kjt, &grad).unwrap();
        let table = &ec.tables()[0];
        for (r, old) in before.iter().enumerate() {
            // The summed gradient of the row's ids, applied once.
            let mut summed = [0f32; DIM];
            for (k, _) in rows.iter().enumerate().filter(|(_, &s)| s == r && r != 5) {
                for (s, g) in summed.iter_mut().zip(&grad[k * DIM..(k + 1) * DIM]) {
                    *s += g;
                }
            }
            let want: Vec<f32> = (old.iter().zip(summed)).map(|(w, g)| w - lr * g).collect();
            let got = table.row(r);
            let close = got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-6);
            assert!(close, "row {r}: {got:?} against {want:?}");
        }
    }
    // In inference nobody is admitted: a new id reads the zero fallback.
    ec.set_training(false);
    let kjt = batch(&[vec![1000], vec![], vec![], vec![]]);
    ec.prefetch(&kjt).unwrap();
    assert_eq!(ec.forward(&kjt).unwrap().values(), &[0.0; DIM]);
    assert_eq!(ec.tables()[0].kv_row_of(1000), None);
}
