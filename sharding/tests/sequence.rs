//! The sharded embedding collection against the unsharded one: every
//! device's rows equal the whole batch's, and after training steps with
//! each optimizer and plan the tables hold the same bits (fp16 rows:
//! within their stochastic rounding).

use ember_sharding::{ShardedEmbeddingCollection, ShardingPlan, ShardingType, TablePlan};
use ember_sparse::rng::Rng;
use ember_sparse::{
    DataType, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, TableOptimizer,
};

const DIM: usize = 8;
const DEVICES: usize = 3;

fn configs(data_type: DataType) -> Vec<EmbeddingConfig> {
    // The item table is shared by the history and the candidates.
    vec![
        EmbeddingConfig::new("items", 50, DIM, &["history", "candidates"])
            .with_data_type(data_type),
        EmbeddingConfig::new("actions", 7, DIM, &["actions"]).with_data_type(data_type),
    ]
}

fn batch(rng: &mut Rng, samples: usize) -> KeyedJaggedTensor {
    let keys = ["history", "candidates", "actions"];
    let rows = [50, 50, 7];
    let (mut ids, mut lengths) = (Vec::new(), Vec::new());
    for &r in &rows {
        for _ in 0..samples {
            // Lengths 0 to 6; ids repeat within and across samples.
            let n = rng.below(7) as usize;
            lengths.push(n as i64);
            ids.extend((0..n).map(|_| ((rng.below(r.min(12)) + rng.below(2) * 30) % r) as i64));
        }
    }
    let keys = keys.iter().map(|k| k.to_string()).collect();
    KeyedJaggedTensor::from_lengths(keys, ids, &lengths, None).unwrap()
}

/// The rows of samples `range` of `kjt`, out of its whole-batch rows.
fn block_rows(kjt: &KeyedJaggedTensor, rows: &[f32], range: std::ops::Range<usize>) -> Vec<f32> {
    let b = kjt.stride();
    let mut out = Vec::new();
    for k in 0..kjt.keys().len() {
        let (from, to) = (
            kjt.offsets()[k * b + range.start],
            kjt.offsets()[k * b + range.end],
        );
        out.extend_from_slice(&rows[from * DIM..to * DIM]);
    }
    out
}

fn plans(configs: &[EmbeddingConfig]) -> Vec<ShardingPlan> {
    let bags: Vec<_> = configs.iter().map(|c| c.bag_config()).collect();
    let all: Vec<usize> = (0..DEVICES).collect();
    let plan = |items: TablePlan, actions: TablePlan| ShardingPlan {
        num_devices: DEVICES,
        tables: vec![items, actions],
    };
    vec![
        plan(
            TablePlan::table_wise(&bags[0], 2),
            TablePlan::table_wise(&bags[1], 0),
        ),
        plan(
            TablePlan::row_wise(&bags[0], &all, ShardingType::RowWise),
            TablePlan::row_wise(&bags[1], &[0, 1], ShardingType::RowWise),
        ),
        plan(
            TablePlan::row_wise_mod(&bags[0], &all),
            TablePlan::table_wise(&bags[1], 1),
        ),
        plan(
            TablePlan::row_wise(&bags[0], &[1, 2], ShardingType::TableRowWise),
            TablePlan::table_wise(&bags[1], 2),
        ),
    ]
}

fn optimizers() -> Vec<TableOptimizer> {
    vec![
        TableOptimizer::Sgd { lr: 0.1 },
        TableOptimizer::Adagrad { lr: 0.1, eps: 1e-8 },
        TableOptimizer::RowWiseAdagrad { lr: 0.1, eps: 1e-8 },
        TableOptimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        },
    ]
}

fn check(data_type: DataType, optimizer: TableOptimizer, plan: &ShardingPlan, seed: u64) {
    let mut whole = EmbeddingCollection::new(configs(data_type), optimizer, seed).unwrap();
    let mut devices = ShardedEmbeddingCollection::threads(&whole, plan).unwrap();
    let mut rng = Rng::new(seed);
    let samples = 10;
    let blocks: Vec<_> = (0..DEVICES)
        .map(|d| samples * d / DEVICES..samples * (d + 1) / DEVICES)
        .collect();
    for step in 0..4 {
        let kjt = batch(&mut rng, samples);
        let rows = whole.forward(&kjt).unwrap();
        let grad: Vec<f32> = (0..rows.values().len())
            .map(|i| ((i * 7 + step) % 11) as f32 / 11.0 - 0.4)
            .collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (devices.iter_mut().zip(&blocks))
                .map(|(device, block)| {
                    let (kjt, rows, grad) = (&kjt, rows.values(), &grad);
                    scope.spawn(move || {
                        let mine = kjt.select_samples(block.clone());
                        let got = device.forward(&mine).unwrap();
                        device
                            .backward_update(&block_rows(kjt, grad, block.clone()))
                            .unwrap();
                        (
                            got,
                            mine.offsets().to_vec(),
                            block_rows(kjt, rows, block.clone()),
                        )
                    })
                })
                .collect();
            // Checked once every device is done (a failed device would
            // leave the others waiting at the next exchange).
            for h in handles {
                let (got, offsets, want) = h.join().unwrap();
                if data_type == DataType::Fp32 {
                    // fp32: the same bits (the owners sum equal ids' gradients in the unsharded order).
                    assert_eq!(got.values(), &want[..], "step {step}: forward");
                } else {
                    for (g, w) in got.values().iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 1e-4 + 4e-3 * w.abs(),
                            "step {step}: {g} vs {w}"
                        );
                    }
                }
                assert_eq!(got.offsets(), &offsets[..]);
            }
        });
        whole.backward_update(&kjt, &grad).unwrap();
    }
    let gathered: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (devices.iter())
            .map(|d| {
                scope.spawn(move || {
                    (0..2)
                        .map(|t| d.gather_table(t).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, table) in whole.tables().iter().enumerate() {
        let rows = gathered[0][t].as_ref().expect("rank 0 gathers");
        assert!(gathered[1][t].is_none());
        let mut want = vec![0.0; DIM];
        for r in 0..table.config().num_embeddings {
            table.read_row(r, &mut want);
            for (g, w) in rows[r * DIM..(r + 1) * DIM].iter().zip(&want) {
                let tol = if data_type == DataType::Fp32 {
                    0.0
                } else {
                    1e-4 + 4e-3 * w.abs()
                };
                assert!(
                    (g - w).abs() <= tol,
                    "{optimizer:?} {:?}: table {t} row {r}: {g} vs {w}",
                    plan.tables[0].sharding
                );
            }
        }
    }
}

#[test]
fn sharded_lookups_and_updates_equal_the_unsharded_collection() {
    let configs = configs(DataType::Fp32);
    for (p, plan) in plans(&configs).iter().enumerate() {
        for (o, optimizer) in optimizers().into_iter().enumerate() {
            check(DataType::Fp32, optimizer, plan, (p * 10 + o) as u64);
        }
    }
    // Half-precision rows too (stochastic rounding seeded per shard: near, not bitwise).
    check(
        DataType::Fp16,
        TableOptimizer::Sgd { lr: 0.1 },
        &plans(&configs)[1],
        99,
    );
}

#[test]
fn column_wise_and_data_parallel_plans_are_refused_by_table() {
    let configs = configs(DataType::Fp32);
    let bags: Vec<_> = configs.iter().map(|c| c.bag_config()).collect();
    let plan = ShardingPlan {
        num_devices: 2,
        tables: vec![
            TablePlan::table_wise(&bags[0], 0),
            TablePlan::column_wise(&bags[1], &[0, 1]),
        ],
    };
    let whole = EmbeddingCollection::new(configs, TableOptimizer::Sgd { lr: 0.1 }, 1).unwrap();
    let err = ShardedEmbeddingCollection::threads(&whole, &plan)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("table actions") && err.contains("ColumnWise"),
        "{err}"
    );
}

#[test]
fn an_id_out_of_range_is_named_before_any_exchange() {
    let configs = configs(DataType::Fp32);
    let plan = ShardingPlan {
        num_devices: 1,
        tables: configs
            .iter()
            .map(|c| TablePlan::table_wise(&c.bag_config(), 0))
            .collect(),
    };
    let whole = EmbeddingCollection::new(configs, TableOptimizer::Sgd { lr: 0.1 }, 1).unwrap();
    let mut one = ShardedEmbeddingCollection::threads(&whole, &plan)
        .unwrap()
        .remove(0);
    let keys = vec!["history".to_string(), "candidates".into(), "actions".into()];
    let kjt = KeyedJaggedTensor::from_lengths(keys, vec![3, 4, 9], &[1, 1, 1], None).unwrap();
    let err = one.forward(&kjt).err().unwrap().to_string();
    assert!(err.contains("actions") && err.contains('9'), "{err}");
}

/// Key-value tables (items split by buckets over every device, actions
/// whole on one) look up and train as the unsharded collection's: every
/// position's row, each step, bitwise (never full: no shard evicts).
#[test]
fn key_value_tables_shard_by_buckets_and_table_wise_as_unsharded() {
    let mut configs = configs(DataType::Fp32);
    // Room for every id (items 0..50, actions 0..7) and each shard's share.
    (configs[0].num_embeddings, configs[1].num_embeddings) = (201, 8);
    for c in &mut configs {
        c.kv = Some(ember_sparse::KvConfig::default());
    }
    let optimizer = TableOptimizer::Adagrad { lr: 0.1, eps: 1e-8 };
    let mut whole = EmbeddingCollection::new(configs.clone(), optimizer, 3).unwrap();
    let bags: Vec<_> = configs.iter().map(|c| c.bag_config()).collect();
    let plan = ShardingPlan {
        num_devices: DEVICES,
        tables: vec![
            TablePlan::row_wise_buckets(&bags[0], &[2, 0, 1]),
            TablePlan::table_wise(&bags[1], 1),
        ],
    };
    let mut devices = ShardedEmbeddingCollection::threads(&whole, &plan).unwrap();
    let mut rng = Rng::new(3);
    let samples = 10;
    let blocks: Vec<_> = (0..DEVICES)
        .map(|d| samples * d / DEVICES..samples * (d + 1) / DEVICES)
        .collect();
    for step in 0..5 {
        let kjt = batch(&mut rng, samples);
        whole.prefetch(&kjt).unwrap();
        let rows = whole.forward(&kjt).unwrap();
        let grad: Vec<f32> = (0..rows.values().len())
            .map(|i| ((i * 7 + step) % 11) as f32 / 11.0 - 0.4)
            .collect();
        let got: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = (devices.iter_mut().zip(&blocks))
                .map(|(device, block)| {
                    let (kjt, grad) = (&kjt, &grad);
                    scope.spawn(move || {
                        let mine = kjt.select_samples(block.clone());
                        let got = device.forward(&mine).unwrap().values().to_vec();
                        let grad = block_rows(kjt, grad, block.clone());
                        device.backward_update(&grad).unwrap();
                        got
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (block, got) in blocks.iter().zip(got) {
            assert_eq!(
                got,
                block_rows(&kjt, rows.values(), block.clone()),
                "step {step}"
            );
        }
        whole.backward_update(&kjt, &grad).unwrap();
    }
    // Each bucket shard holds its buckets' ids, together the whole map's.
    let held = |t: &ember_sparse::EmbeddingTable| -> Vec<u64> {
        let s = t.kv_state().unwrap();
        (s.ids.iter().zip(&s.counts))
            .filter(|(_, &c)| c > 0)
            .map(|(&id, _)| id)
            .collect()
    };
    let mut ids: Vec<u64> = (devices.iter())
        .flat_map(|d| {
            d.local()
                .tables()
                .iter()
                .filter(|t| t.name().starts_with("items"))
                .flat_map(held)
                .collect::<Vec<_>>()
        })
        .collect();
    ids.sort_unstable();
    let mut want = held(&whole.tables()[0]);
    want.sort_unstable();
    assert_eq!(ids, want);
    let err = devices[0].gather_table(0).err().unwrap().to_string();
    assert!(err.contains("key-value table"), "{err}");
}
