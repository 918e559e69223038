//! The embedding collection (unpooled lookups) against plain references:
//! the forward reads each id's row in its place; the fused backward equals
//! a by-hand SGD update, and for every optimizer and training type the bag
//! collection's update of the same gradients with each id in its own bag;
//! the disk tier changes nothing.

use ember_sparse::{
    CachePolicy, DataType, DiskTierConfig, EmbeddingBagCollection, EmbeddingBagConfig,
    EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, SparseError, TableOptimizer,
};
use proptest::prelude::*;

const DIM: usize = 4;

/// Items read by a history and a candidate; users read by a user feature.
fn configs(dtype: DataType) -> Vec<EmbeddingConfig> {
    vec![
        EmbeddingConfig::new("items", 30, DIM, &["history", "candidate"]).with_data_type(dtype),
        EmbeddingConfig::new("users", 10, DIM, &["user"]).with_data_type(dtype),
    ]
}

/// A batch with the collection's keys in another order, and a key no
/// table serves: `lengths[f][s]` ids of feature `f` for sample `s`.
fn batch(lengths: &[Vec<usize>; 3], seed: u64) -> KeyedJaggedTensor {
    let keys = ["candidate", "other", "user", "history"];
    let rows = [30u64, 1000, 10, 30];
    let order = [1usize, 9, 2, 0]; // lengths' feature of each key (9: the unserved key's)
    let stride = lengths[0].len();
    let mut state = seed | 1;
    let mut next = |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n) as i64
    };
    let (mut values, mut lens) = (Vec::new(), Vec::new());
    for (k, &f) in order.iter().enumerate() {
        for s in 0..stride {
            let n = lengths.get(f).map_or(1, |l| l[s]);
            lens.push(n as i64);
            // Few distinct ids: duplicates within and across samples.
            values.extend((0..n).map(|_| next(rows[k].min(7))));
        }
    }
    let keys = keys.iter().map(|k| k.to_string()).collect();
    KeyedJaggedTensor::from_lengths(keys, values, &lens, None).unwrap()
}

fn lengths() -> impl Strategy<Value = [Vec<usize>; 3]> {
    (1usize..5).prop_flat_map(|b| {
        let l = || prop::collection::vec(0usize..5, b);
        (l(), l(), l()).prop_map(|(h, c, u)| [h, c, u])
    })
}

/// Each id's row of each of the collection's features, in its order.
fn reference_forward(ec: &EmbeddingCollection, kjt: &KeyedJaggedTensor) -> Vec<f32> {
    let mut out = Vec::new();
    for (feature, table) in [("history", 0), ("candidate", 0), ("user", 1)] {
        let k = kjt.key_index(feature).unwrap();
        for &id in &kjt.values()[kjt.key_range(k)] {
            let mut row = vec![0.0; DIM];
            ec.tables()[table].read_row(id as usize, &mut row);
            out.extend(row);
        }
    }
    out
}

fn gradient(rows: usize, seed: u64) -> Vec<f32> {
    (0..rows * DIM)
        .map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

/// The same tables as a bag collection, and the batch with every id in a
/// bag of its own: bag `r` (of `rows`) holds output row `r`'s id, under
/// its feature's key; the gradient follows.
fn as_bags(kjt: &KeyedJaggedTensor, grad: &[f32]) -> (KeyedJaggedTensor, Vec<f32>) {
    let features = ["history", "candidate", "user"];
    let rows: usize = features
        .iter()
        .map(|f| kjt.key_range(kjt.key_index(f).unwrap()).len())
        .sum();
    let (mut values, mut lens) = (Vec::new(), Vec::new());
    let mut bag_grad = vec![0.0f32; rows * 3 * DIM];
    let mut r = 0;
    for (f, feature) in features.iter().enumerate() {
        let ids = &kjt.values()[kjt.key_range(kjt.key_index(feature).unwrap())];
        let first = r;
        for bag in 0..rows {
            let mine = bag >= first && bag < first + ids.len();
            lens.push(mine as i64);
            if mine {
                values.push(ids[bag - first]);
                let at = bag * 3 * DIM + f * DIM;
                bag_grad[at..at + DIM].copy_from_slice(&grad[bag * DIM..(bag + 1) * DIM]);
            }
        }
        r += ids.len();
    }
    let keys = features.iter().map(|k| k.to_string()).collect();
    (
        KeyedJaggedTensor::from_lengths(keys, values, &lens, None).unwrap(),
        bag_grad,
    )
}

fn bag_configs(dtype: DataType) -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("items", 30, DIM, &["history", "candidate"]).with_data_type(dtype),
        EmbeddingBagConfig::new("users", 10, DIM, &["user"]).with_data_type(dtype),
    ]
}

fn rows_of(tables: &[ember_sparse::EmbeddingTable]) -> Vec<Vec<f32>> {
    tables
        .iter()
        .map(|t| {
            (0..t.num_embeddings())
                .flat_map(|id| {
                    let mut row = vec![0.0; t.dim()];
                    t.read_row(id, &mut row);
                    row
                })
                .chain(t.optimizer_state().iter().copied())
                .collect()
        })
        .collect()
}

proptest! {
    #[test]
    fn forward_reads_each_ids_row(lengths in lengths(), seed in any::<u64>(), which in 0usize..4) {
        let dtype = [DataType::Fp32, DataType::Fp16, DataType::Bf16, DataType::Int8][which];
        let ec = EmbeddingCollection::new(configs(dtype), TableOptimizer::None, 3).unwrap();
        let kjt = batch(&lengths, seed);
        let out = ec.forward(&kjt).unwrap();
        prop_assert_eq!(out.values(), &reference_forward(&ec, &kjt)[..]);
        prop_assert_eq!(out.keys(), ["history", "candidate", "user"]);
        for (f, feature) in out.keys().iter().enumerate() {
            let (rows, offsets) = out.feature(feature).unwrap();
            let lens: Vec<usize> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
            prop_assert_eq!(&lens, &lengths[f]);
            prop_assert_eq!(rows.len(), offsets[lengths[f].len()] * DIM);
        }
    }

    #[test]
    fn backward_is_the_bag_collections_with_one_id_a_bag(
        lengths in lengths(),
        seed in any::<u64>(),
        which in 0usize..4,
        dtype in 0usize..3,
    ) {
        let optimizer = [
            TableOptimizer::sgd(0.1),
            TableOptimizer::adagrad(0.1),
            TableOptimizer::rowwise_adagrad(0.1),
            TableOptimizer::adam(0.01),
        ][which];
        let dtype = [DataType::Fp32, DataType::Fp16, DataType::Bf16][dtype];
        let mut ec = EmbeddingCollection::new(configs(dtype), optimizer, 5).unwrap();
        let mut ebc = EmbeddingBagCollection::new(bag_configs(dtype), optimizer, 5).unwrap();
        prop_assert_eq!(rows_of(ec.tables()), rows_of(ebc.tables()));
        for step in 0..2 {
            let kjt = batch(&lengths, seed ^ step);
            let rows = ec.forward(&kjt).unwrap().values().len() / DIM;
            let grad = gradient(rows, seed ^ step);
            ec.backward_update(&kjt, &grad).unwrap();
            let (bags, bag_grad) = as_bags(&kjt, &grad);
            ebc.backward_update(&bags, &bag_grad).unwrap();
        }
        prop_assert_eq!(rows_of(ec.tables()), rows_of(ebc.tables()));
        prop_assert_eq!(ec.step(), 2);
    }
}

#[test]
fn sgd_updates_each_row_by_its_summed_gradient() {
    let mut ec =
        EmbeddingCollection::new(configs(DataType::Fp32), TableOptimizer::sgd(0.5), 1).unwrap();
    let kjt = batch(&[vec![3, 0, 2], vec![1, 1, 1], vec![0, 1, 0]], 99);
    let before = rows_of(ec.tables());
    let rows = reference_forward(&ec, &kjt).len() / DIM;
    let grad = gradient(rows, 4);
    ec.backward_update(&kjt, &grad).unwrap();
    let mut want = before.clone();
    let mut r = 0;
    for (feature, table) in [("history", 0), ("candidate", 0), ("user", 1)] {
        let k = kjt.key_index(feature).unwrap();
        for &id in &kjt.values()[kjt.key_range(k)] {
            for c in 0..DIM {
                want[table][id as usize * DIM + c] -= 0.5 * grad[r * DIM + c];
            }
            r += 1;
        }
    }
    for (got, want) in rows_of(ec.tables()).iter().zip(&want) {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
    }
}

#[test]
fn the_disk_tier_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTierConfig {
        dir: dir.path().into(),
        cache_rows: 16,
        policy: CachePolicy::Lru,
    };
    let opt = TableOptimizer::rowwise_adagrad(0.1);
    let mut ram = EmbeddingCollection::new(configs(DataType::Fp16), opt, 8).unwrap();
    let tiers = vec![Some(tier), None];
    let mut disk =
        EmbeddingCollection::with_disk_tiers(configs(DataType::Fp16), opt, 8, tiers).unwrap();
    for step in 0..4 {
        let kjt = batch(&[vec![4, 2], vec![1, 1], vec![1, 0]], 2 * step);
        let r = disk.forward(&kjt).map(|_| ());
        assert!(matches!(r, Err(SparseError::NotPrefetched { .. })), "{r:?}");
        disk.prefetch(&kjt).unwrap();
        let (a, b) = (ram.forward(&kjt).unwrap(), disk.forward(&kjt).unwrap());
        assert_eq!(a, b, "step {step}");
        let grad = gradient(a.values().len() / DIM, step);
        ram.backward_update(&kjt, &grad).unwrap();
        disk.backward_update(&kjt, &grad).unwrap();
    }
    let kjt = batch(&[vec![4, 4], vec![1, 1], vec![1, 1]], 77);
    disk.prefetch(&kjt).unwrap();
    assert_eq!(ram.forward(&kjt).unwrap(), disk.forward(&kjt).unwrap());
}

#[test]
fn bad_input_is_named() {
    let mut ec =
        EmbeddingCollection::new(configs(DataType::Fp32), TableOptimizer::sgd(0.1), 1).unwrap();
    let keys: Vec<String> = ["history", "candidate", "user"]
        .iter()
        .map(|k| k.to_string())
        .collect();
    let kjt =
        KeyedJaggedTensor::from_lengths(keys.clone(), vec![1, 30, 2, 3], &[1, 1, 1, 0, 1, 0], None)
            .unwrap();
    let err = ec.forward(&kjt).unwrap_err();
    assert!(
        matches!(&err, SparseError::IdOutOfRange { table, feature, sample: 1, id: 30, .. } if table == "items" && feature == "history"),
        "{err}"
    );
    let before = rows_of(ec.tables());
    assert!(ec.backward_update(&kjt, &[0.0; 4 * DIM]).is_err());
    assert_eq!(
        rows_of(ec.tables()),
        before,
        "a refused backward changes nothing"
    );
    let ok =
        KeyedJaggedTensor::from_lengths(keys, vec![1, 2, 3], &[1, 0, 1, 0, 1, 0], None).unwrap();
    assert!(matches!(
        ec.backward_update(&ok, &[0.0; 5]),
        Err(SparseError::GradShape { .. })
    ));
    let missing =
        KeyedJaggedTensor::from_lengths(vec!["history".into()], vec![1], &[1], None).unwrap();
    assert!(
        matches!(ec.forward(&missing), Err(SparseError::MissingFeature(f)) if f == "candidate")
    );
    let mixed = vec![
        EmbeddingConfig::new("a", 5, 4, &["x"]),
        EmbeddingConfig::new("b", 5, 8, &["y"]),
    ];
    let err = EmbeddingCollection::new(mixed, TableOptimizer::None, 1).unwrap_err();
    assert!(err.to_string().contains("share one dim"), "{err}");
}

/// An optimizer set after building trains as one built in; the forward's
/// parts come out as its accessors show them.
#[test]
fn optimizer_set_after_building_and_parts_out() {
    let kjt = batch(&[vec![2, 0], vec![1, 1], vec![1, 1]], 3);
    let mut built =
        EmbeddingCollection::new(configs(DataType::Fp32), TableOptimizer::adagrad(0.1), 1).unwrap();
    let mut set =
        EmbeddingCollection::new(configs(DataType::Fp32), TableOptimizer::None, 1).unwrap();
    set.set_optimizer(TableOptimizer::adagrad(0.1)).unwrap();
    let out = built.forward(&kjt).unwrap();
    let (values, offsets) = (out.values().to_vec(), out.offsets().to_vec());
    let (dim, parts_offsets, parts_values) = out.into_parts();
    assert_eq!(
        (dim, parts_offsets, parts_values),
        (built.dim(), offsets, values.clone())
    );
    let grad = gradient(values.len() / built.dim(), 9);
    built.backward_update(&kjt, &grad).unwrap();
    set.backward_update(&kjt, &grad).unwrap();
    assert_eq!(rows_of(built.tables()), rows_of(set.tables()));
}
