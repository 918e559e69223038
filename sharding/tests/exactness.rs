//! Sharded execution equals the unsharded collection for every sharding
//! type, on random shapes, batches, pooling and optimizers; the planner's
//! plans are valid.

use std::sync::Arc;

use ember_sharding::plan::{ShardingType, TablePlan};
use ember_sharding::{plan, PlannerOptions, ShardedEmbeddingBagCollection, ShardingPlan, Topology};
use ember_sharding::{Collective, InProcess, InitialRows, WithDiskTiers};
use ember_sparse::rng::Rng;
use ember_sparse::{
    CachePolicy, DataType, DiskTierConfig, EmbeddingBagCollection, EmbeddingBagConfig,
    EmbeddingTable, KeyedJaggedTensor, PoolingType, TableOptimizer,
};
use proptest::prelude::*;

const TYPES: [ShardingType; 6] = [
    ShardingType::TableWise,
    ShardingType::RowWise,
    ShardingType::RowWiseMod,
    ShardingType::ColumnWise,
    ShardingType::TableRowWise,
    ShardingType::DataParallel,
];

fn optimizer(k: usize) -> TableOptimizer {
    match k {
        0 => TableOptimizer::sgd(0.3),
        1 => TableOptimizer::adagrad(0.3),
        2 => TableOptimizer::rowwise_adagrad(0.3),
        _ => TableOptimizer::adam(0.05),
    }
}

/// A plan of `kind` for every table over `n` devices (2 hosts when n = 4).
fn plan_of(
    kind: ShardingType,
    tables: &[EmbeddingBagConfig],
    n: usize,
    opt: &TableOptimizer,
) -> ShardingPlan {
    let all: Vec<usize> = (0..n).collect();
    let tables = tables
        .iter()
        .enumerate()
        .map(|(i, t)| match kind {
            ShardingType::TableWise => TablePlan::table_wise(t, i % n),
            ShardingType::RowWise => TablePlan::row_wise(t, &all, kind),
            ShardingType::RowWiseMod => TablePlan::row_wise_mod(t, &all),
            ShardingType::ColumnWise if matches!(opt, TableOptimizer::RowWiseAdagrad { .. }) => {
                TablePlan::row_wise(t, &all, ShardingType::RowWise)
            }
            ShardingType::ColumnWise => TablePlan::column_wise(t, &all[..n.min(t.embedding_dim)]),
            ShardingType::TableRowWise => {
                let per_host = n.div_ceil(2);
                let host = i % n.div_ceil(per_host);
                let devices: Vec<usize> =
                    (host * per_host..((host + 1) * per_host).min(n)).collect();
                TablePlan::row_wise(t, &devices, kind)
            }
            ShardingType::DataParallel => TablePlan::data_parallel(t, n),
        })
        .collect();
    ShardingPlan {
        num_devices: n,
        tables,
    }
}

#[derive(Debug, Clone)]
struct Case {
    tables: Vec<(usize, usize, usize, bool)>, // rows, dim, features, mean
    batch: usize,
    max_ids: usize,
    weighted: bool,
    optimizer: usize,
    kind: usize,
    devices: usize,
    seed: u64,
    /// fp32, fp16 or bf16 rows.
    dtype: DataType,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((1usize..40, 1usize..9, 1usize..3, any::<bool>()), 1..4),
        1usize..24,
        0usize..5,
        any::<bool>(),
        0usize..4,
        0usize..6,
        1usize..5,
        any::<u64>(),
        prop_oneof![
            Just(DataType::Fp32),
            Just(DataType::Fp16),
            Just(DataType::Bf16)
        ],
    )
        .prop_map(
            |(tables, batch, max_ids, weighted, optimizer, kind, devices, seed, dtype)| Case {
                tables,
                batch,
                max_ids,
                weighted,
                optimizer,
                kind,
                devices,
                seed,
                dtype,
            },
        )
}

fn configs(c: &Case) -> Vec<EmbeddingBagConfig> {
    let mut f = 0;
    (c.tables.iter().enumerate())
        .map(|(t, &(rows, dim, features, mean))| {
            let names: Vec<String> = (0..features)
                .map(|_| {
                    f += 1;
                    format!("f{f}")
                })
                .collect();
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let cfg =
                EmbeddingBagConfig::new(&format!("t{t}"), rows, dim, &refs).with_data_type(c.dtype);
            if mean {
                cfg.with_pooling(PoolingType::Mean)
            } else {
                cfg
            }
        })
        .collect()
}

fn batch(c: &Case, configs: &[EmbeddingBagConfig], rng: &mut Rng) -> KeyedJaggedTensor {
    let (mut keys, mut lengths, mut values, mut weights) = (vec![], vec![], vec![], vec![]);
    for t in configs {
        for f in &t.feature_names {
            keys.push(f.clone());
            for _ in 0..c.batch {
                let len = rng.below(c.max_ids as u64 + 1);
                lengths.push(len as i64);
                for _ in 0..len {
                    values.push(rng.below(t.num_embeddings as u64) as i64);
                    weights.push(rng.next_f32() * 2.0 - 0.5);
                }
            }
        }
    }
    KeyedJaggedTensor::from_lengths(keys, values, &lengths, c.weighted.then_some(weights)).unwrap()
}

type ShardedOut = (Vec<f32>, Option<EmbeddingBagCollection>);

fn close(what: &str, a: &[f32], b: &[f32]) -> Result<(), TestCaseError> {
    close_within(what, a, b, 1e-6)
}

fn close_within(what: &str, a: &[f32], b: &[f32], tol: f32) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        prop_assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{} [{}]: sharded {} vs unsharded {}",
            what,
            i,
            x,
            y
        );
    }
    Ok(())
}

/// A table's rows, decoded.
fn rows(t: &EmbeddingTable) -> Vec<f32> {
    let mut out = vec![0f32; t.num_embeddings() * t.dim()];
    for (id, row) in out.chunks_exact_mut(t.dim().max(1)).enumerate() {
        t.read_row(id, row);
    }
    out
}

/// Two tables' rows agree: to float rounding in fp32; in fp16 and bf16 the
/// shards round the same fp32 update with the same draws, so they land on
/// the same value or, where summation order moved the update across a
/// rounding threshold, on its neighbour.
fn same_rows(what: &str, a: &EmbeddingTable, b: &EmbeddingTable) -> Result<(), TestCaseError> {
    close_within(what, &rows(a), &rows(b), tolerance(b.data_type()))
}

/// How far sharded and unsharded values may be apart (see [`same_rows`]);
/// a row one step off moves the next forward by as much.
fn tolerance(dtype: DataType) -> f32 {
    match dtype {
        DataType::Fp16 => 2.0 * 2f32.powi(-10),
        DataType::Bf16 => 2.0 * 2f32.powi(-7),
        _ => 1e-6,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]
    #[test]
    fn sharded_equals_unsharded(c in case()) {
        let cfgs = configs(&c);
        let opt = optimizer(c.optimizer);
        let kind = TYPES[c.kind];
        let mut plain = EmbeddingBagCollection::new(cfgs.clone(), opt, c.seed).unwrap();
        let source = EmbeddingBagCollection::new(cfgs.clone(), opt, c.seed).unwrap();
        let p = plan_of(kind, &cfgs, c.devices, &opt);
        let mut sharded = ShardedEmbeddingBagCollection::from_collection(&source, p).unwrap();
        let mut rng = Rng::new(c.seed ^ 1);
        for step in 0..2 {
            let kjt = batch(&c, &cfgs, &mut rng);
            let want = plain.forward(&kjt).unwrap();
            let got = sharded.forward(&kjt).unwrap();
            close_within(&format!("{kind:?} step {step} forward"), got.values(), want.values(), tolerance(c.dtype))?;
            let grad: Vec<f32> = (0..want.values().len()).map(|_| rng.next_f32() - 0.5).collect();
            plain.backward_update(&kjt, &grad).unwrap();
            sharded.backward_update(&kjt, &grad).unwrap();
            let back = sharded.to_collection().unwrap();
            prop_assert_eq!(back.step(), plain.step());
            for (a, b) in back.tables().iter().zip(plain.tables()) {
                same_rows(&format!("{kind:?} step {step} table {}", b.name()), a, b)?;
                close(&format!("{kind:?} step {step} state of {}", b.name()), a.optimizer_state(), b.optimizer_state())?;
            }
        }
    }

    #[test]
    fn routed_ahead_equals_inline(c in case()) {
        // The input dist of batch k+1 runs on another thread while batch k
        // computes, as the trainer's pipeline runs it: the same bits.
        let cfgs = configs(&c);
        let opt = optimizer(c.optimizer);
        let source = EmbeddingBagCollection::new(cfgs.clone(), opt, c.seed).unwrap();
        let p = plan_of(TYPES[c.kind], &cfgs, c.devices, &opt);
        let mut inline = ShardedEmbeddingBagCollection::from_collection(&source, p.clone()).unwrap();
        let mut ahead = ShardedEmbeddingBagCollection::from_collection(&source, p).unwrap();
        let router = ahead.input_router().expect("threads always route ahead");
        let mut rng = Rng::new(c.seed ^ 2);
        let batches: Vec<KeyedJaggedTensor> = (0..3).map(|_| batch(&c, &cfgs, &mut rng)).collect();
        let mut routed = Some(router.route(&batches[0]).unwrap());
        for (k, kjt) in batches.iter().enumerate() {
            let want = inline.forward(kjt).unwrap();
            let grad: Vec<f32> = (0..want.values().len()).map(|_| rng.next_f32() - 0.5).collect();
            inline.backward_update(kjt, &grad).unwrap();
            let mut got = ahead.new_output(kjt.stride());
            let this = routed.take().unwrap();
            std::thread::scope(|s| {
                let next = batches.get(k + 1).map(|b| s.spawn(|| router.route(b).unwrap()));
                ahead.forward_routed(kjt, this, &mut got).unwrap();
                ahead.backward_update(kjt, &grad).unwrap();
                routed = next.map(|h| h.join().unwrap());
            });
            prop_assert_eq!(got.values(), want.values());
        }
        let (a, b) = (ahead.to_collection().unwrap(), inline.to_collection().unwrap());
        for (x, y) in a.tables().iter().zip(b.tables()) {
            prop_assert_eq!(x.row_bytes(), y.row_bytes());
            prop_assert_eq!(x.optimizer_state(), y.optimizer_state());
        }
        prop_assert_eq!(ahead.stats().bytes_sent, inline.stats().bytes_sent);
        // A routed input is for its own batch only.
        let other = router.route(&batches[0]).unwrap();
        let mut out = ahead.new_output(batches[1].stride());
        if batches[0].values() != batches[1].values() || batches[0].offsets() != batches[1].offsets() {
            prop_assert!(ahead.forward_routed(&batches[1], other, &mut out).is_err());
        }
    }

    #[test]
    fn ranks_equal_threads(c in case()) {
        // Each rank (a thread here, as a process under MPI) holds its own
        // device and its block of the batch.
        let cfgs = configs(&c);
        let opt = optimizer(c.optimizer);
        let kind = TYPES[c.kind];
        let source = EmbeddingBagCollection::new(cfgs.clone(), opt, c.seed).unwrap();
        let p = plan_of(kind, &cfgs, c.devices, &opt);
        let mut threads = ShardedEmbeddingBagCollection::from_collection(&source, p.clone()).unwrap();
        let comms: Vec<Arc<dyn Collective>> = InProcess::group(c.devices)
            .into_iter()
            .map(|g| Arc::new(g) as Arc<dyn Collective>)
            .collect();
        // Filled from the collection, or initialised in place from the seed
        // (no whole table on any rank), in RAM or on the disk tier: the
        // same rows either way.
        let dir = tempfile::tempdir().unwrap();
        let on_disk = c.seed % 3 == 2 && kind != ShardingType::DataParallel;
        let tier = DiskTierConfig { dir: dir.path().to_path_buf(), cache_rows: 1024, policy: CachePolicy::Lru };
        let seeded = WithDiskTiers {
            source: &InitialRows { seed: c.seed },
            tiers: vec![on_disk.then_some(tier); cfgs.len()],
        };
        let mut ranks: Vec<ShardedEmbeddingBagCollection> = comms
            .iter()
            .map(|comm| match c.seed % 3 {
                0 => ShardedEmbeddingBagCollection::from_collection_on_rank(&source, p.clone(), comm.clone()),
                _ => ShardedEmbeddingBagCollection::on_rank(cfgs.clone(), opt, 0, &seeded, p.clone(), comm.clone())
                    .map(|mut s| { s.set_rounding_seed(c.seed); s }),
            }.unwrap())
            .collect();
        // A disk-tier shard made from the seed writes nothing to its file:
        // its rows are made when first looked up.
        for file in std::fs::read_dir(dir.path()).unwrap() {
            let bytes = std::fs::read(file.unwrap().path()).unwrap();
            prop_assert!(bytes.iter().all(|&b| b == 0), "a shard's file was written");
        }
        let mut rng = Rng::new(c.seed ^ 1);
        let n = c.devices;
        for step in 0..2 {
            let kjt = batch(&c, &cfgs, &mut rng);
            let want = threads.forward(&kjt).unwrap();
            let grad: Vec<f32> = (0..want.values().len()).map(|_| rng.next_f32() - 0.5).collect();
            threads.backward_update(&kjt, &grad).unwrap();
            let w = want.width();
            let gathered: Vec<ShardedOut> = std::thread::scope(|s| {
                let handles: Vec<_> = ranks.iter_mut().enumerate().map(|(r, sharded)| {
                    let (kjt, grad) = (&kjt, &grad);
                    s.spawn(move || {
                        let rows = (c.batch * r / n)..(c.batch * (r + 1) / n);
                        let local = kjt.select_samples(rows.clone());
                        let out = sharded.forward(&local).unwrap();
                        sharded.backward_update(&local, &grad[rows.start * w..rows.end * w]).unwrap();
                        // Disk-tier shards are not gathered on ranks: their
                        // rows show in the next step's forward.
                        let back = (!on_disk).then(|| sharded.to_collection().unwrap());
                        (out.values().to_vec(), back)
                    })
                }).collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let forward: Vec<f32> = gathered.iter().flat_map(|(o, _)| o.clone()).collect();
            close_within(&format!("{kind:?} step {step} forward"), &forward, want.values(), tolerance(c.dtype))?;
            let plain = threads.to_collection().unwrap();
            for back in gathered.iter().filter_map(|(_, back)| back.as_ref()) {
                prop_assert_eq!(back.step(), plain.step());
                for (a, b) in back.tables().iter().zip(plain.tables()) {
                    same_rows(&format!("{kind:?} step {step} table {}", b.name()), a, b)?;
                    close(&format!("{kind:?} step {step} state of {}", b.name()), a.optimizer_state(), b.optimizer_state())?;
                }
            }
        }
    }

    #[test]
    fn planner_plans_are_valid(
        tables in prop::collection::vec((2usize..100_000, 1usize..64, 1usize..3, any::<bool>()), 1..12),
        devices in 1usize..6,
        per_host in 1usize..4,
        memory_mib in 1u64..64,
        kind in 0usize..7,
        optimizer_kind in 0usize..4,
    ) {
        let cfgs: Vec<EmbeddingBagConfig> = (tables.iter().enumerate())
            .map(|(i, &(rows, dim, f, kv))| {
                let names: Vec<String> = (0..f).map(|k| format!("t{i}f{k}")).collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                // Key-value tables: table-wise or by buckets, whatever is asked.
                EmbeddingBagConfig {
                    kv: kv.then(ember_sparse::KvConfig::default),
                    ..EmbeddingBagConfig::new(&format!("t{i}"), rows, dim, &refs)
                }
            })
            .collect();
        let mut topo = Topology::uniform(devices, memory_mib << 20);
        topo.devices_per_host = per_host;
        let opt = optimizer(optimizer_kind);
        let o = PlannerOptions { batch_size: 256, pooling_factor: 2.0, optimizer: opt, sharding: TYPES.get(kind).copied(), disk_tier: None };
        match plan(&cfgs, &topo, &o) {
            Ok((p, stats)) => {
                p.validate(&cfgs, &opt).map_err(|e| TestCaseError::fail(e.to_string()))?;
                for (d, load) in stats.devices.iter().enumerate() {
                    prop_assert!(load.storage_bytes <= topo.devices[d].memory_bytes, "device {} over capacity", d);
                }
            }
            Err(e) => {
                let text = e.to_string();
                let refused = text.contains("row-wise Adagrad") && kind == 3 && optimizer_kind == 2;
                prop_assert!(refused || (text.contains("cannot be placed") && text.contains("missing")), "{}", text);
            }
        }
        // With room to spare, every table is placed.
        let roomy = Topology::uniform(devices, 1 << 40);
        let o = PlannerOptions { sharding: None, ..o };
        prop_assert!(plan(&cfgs, &roomy, &o).is_ok());
    }
}

#[test]
fn a_backward_must_follow_the_forward_of_its_batch() {
    let cfgs = vec![EmbeddingBagConfig::new("t", 10, 4, &["f"])];
    let source = EmbeddingBagCollection::new(cfgs.clone(), TableOptimizer::sgd(0.1), 1).unwrap();
    let p = plan_of(ShardingType::RowWise, &cfgs, 2, &TableOptimizer::sgd(0.1));
    let mut sharded = ShardedEmbeddingBagCollection::from_collection(&source, p).unwrap();
    let kjt = |ids: Vec<i64>| {
        let lengths = vec![1i64; ids.len()];
        KeyedJaggedTensor::from_lengths(vec!["f".into()], ids, &lengths, None).unwrap()
    };
    let one = kjt(vec![3]);
    let err = sharded.backward_update(&one, &[0.0; 4]).unwrap_err();
    assert!(err.to_string().contains("last forward was none"), "{err}");
    sharded.forward(&one).unwrap();
    let two = kjt(vec![3, 4]);
    assert!(sharded.backward_update(&two, &[0.0; 8]).is_err());
    sharded.backward_update(&one, &[0.5; 4]).unwrap();
}

#[test]
fn more_devices_than_pool_threads_do_not_starve() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        let cfgs = vec![EmbeddingBagConfig::new("t", 40, 4, &["f"])];
        let source =
            EmbeddingBagCollection::new(cfgs.clone(), TableOptimizer::sgd(0.1), 1).unwrap();
        let p = plan_of(ShardingType::RowWise, &cfgs, 4, &TableOptimizer::sgd(0.1));
        let mut sharded = ShardedEmbeddingBagCollection::from_collection(&source, p).unwrap();
        let ids: Vec<i64> = (0..8).map(|i| i * 5).collect();
        let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], ids, &[1; 8], None).unwrap();
        let out = sharded.forward(&kjt).unwrap();
        sharded
            .backward_update(&kjt, &vec![0.1; out.values().len()])
            .unwrap();
    });
}

/// A batch may carry keys no table serves: the sharded collection pools and
/// updates exactly as on the batch of its own keys, and a backward on that
/// batch follows a forward on the wider one.
#[test]
fn keys_no_table_serves_are_ignored_forward_and_backward() {
    let configs = vec![EmbeddingBagConfig::new("t", 50, 4, &["f"])];
    let source = EmbeddingBagCollection::new(configs.clone(), TableOptimizer::sgd(0.1), 3).unwrap();
    let options = PlannerOptions {
        batch_size: 4,
        pooling_factor: 1.0,
        optimizer: TableOptimizer::sgd(0.1),
        sharding: Some(ShardingType::RowWise),
        disk_tier: None,
    };
    let (p, _) = plan(&configs, &Topology::uniform(2, 1 << 30), &options).unwrap();
    let mut wide = ShardedEmbeddingBagCollection::from_collection(&source, p.clone()).unwrap();
    let mut own = ShardedEmbeddingBagCollection::from_collection(&source, p).unwrap();
    let keys = vec!["other".to_string(), "f".to_string()];
    let batch =
        KeyedJaggedTensor::from_lengths(keys, vec![-7, 9, 1, 2, 3, 4], &[1, 1, 1, 1, 1, 1], None)
            .unwrap();
    let only_f = batch.select_keys(&["f"]).unwrap();
    let (a, b) = (wide.forward(&batch).unwrap(), own.forward(&only_f).unwrap());
    assert_eq!(a.values(), b.values());
    let grad = vec![0.5f32; 3 * 4];
    wide.backward_update(&only_f, &grad).unwrap();
    own.backward_update(&only_f, &grad).unwrap();
    assert_eq!(
        wide.forward(&only_f).unwrap().values(),
        own.forward(&only_f).unwrap().values()
    );
}
