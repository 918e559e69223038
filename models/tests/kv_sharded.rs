//! Key-value tables sharded table-wise (each map whole on one device): in
//! threads they train bitwise as in one process (admitting, evicting,
//! falling back), predict without admitting, and save their maps with
//! their rows: a full file, and a set written by ranks, load in one
//! process and onto another device count exactly. Sharded row-wise by
//! buckets of the ids' hash, each shard holds its buckets' ids; saved,
//! the shards resume bitwise on the same plan, and on another device
//! count (or in one process) every id keeps its row, header and state.

use std::path::Path;
use std::sync::Arc;

use ember_dense::{DenseOptimizerConfig, NativeBackend};
use ember_models::checkpoint::{save, save_set};
use ember_models::{
    Backend, Checkpoint, DataGeneration, Dlrm, DlrmConfig, ExecMode, InteractionType, Model,
    SyntheticConfig, SyntheticData,
};
use ember_sharding::plan::TablePlan;
use ember_sharding::{Collective, InProcess, RowSplit, ShardingPlan};
use ember_sparse::{Admission, Eviction, KvConfig, TableOptimizer};

/// An fp32 table and two key-value tables over 40 raw ids: one of 8 rows
/// (LRU, admitting on the second sighting: it fills, evicts and falls
/// back), one of 30 (LFU, admitting always).
fn setup() -> (DlrmConfig, SyntheticData) {
    let mut config = DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[50, 40, 40], 4),
        bottom_mlp: vec![3, 6, 4],
        top_mlp: vec![5, 3, 1],
        interaction: InteractionType::Dot,
    };
    let data = SyntheticConfig::for_model(&config, DataGeneration::Learnable, 3, 4);
    let data = SyntheticData::new(data).unwrap();
    config.tables[1].num_embeddings = 9;
    config.tables[1].kv = Some(KvConfig {
        admission: Admission::Count {
            min_count: 2,
            sketch_width: 64,
            halve_every: None,
        },
        eviction: Eviction::Lru,
        eviction_window: Some(4),
        ..KvConfig::default()
    });
    config.tables[2].num_embeddings = 31;
    config.tables[2].kv = Some(KvConfig {
        eviction: Eviction::Lfu,
        ..KvConfig::default()
    });
    (config, data)
}

/// Every table whole on one of `devices` devices.
fn table_wise(config: &DlrmConfig, devices: &[usize]) -> ShardingPlan {
    let tables = (config.tables.iter().zip(devices))
        .map(|(t, &d)| TablePlan::table_wise(t, d))
        .collect();
    let num_devices = devices.iter().max().unwrap() + 1;
    ShardingPlan {
        num_devices,
        tables,
    }
}

fn optimizers() -> (TableOptimizer, DenseOptimizerConfig) {
    (
        TableOptimizer::rowwise_adagrad(0.05),
        DenseOptimizerConfig::adam(0.01),
    )
}

fn build(config: &DlrmConfig, plan: Option<ShardingPlan>) -> Dlrm {
    let (table, dense) = optimizers();
    (Dlrm::builder(config.clone()).optimizers(table, dense))
        .seed(5)
        .plan(plan)
        .build()
        .unwrap()
}

/// The loss bits of training `model` on `batches` (of 16; on a rank of
/// `ranks`, its block of each).
fn train(
    model: &mut Dlrm,
    data: &SyntheticData,
    batches: std::ops::Range<u64>,
    (rank, ranks): (usize, usize),
) -> Vec<u32> {
    let be = Backend::Native(NativeBackend::new(1));
    let per = 16 / ranks;
    (batches.map(|i| {
        let batch = data.batch(i, 16).select(per * rank..per * (rank + 1));
        let out = model.train_step(&be, &batch, ExecMode::Strict);
        out.unwrap().loss.to_bits()
    }))
    .collect()
}

/// Every table's rows, optimizer state, map and figures, gathered.
fn tables(model: &Dlrm) -> String {
    let ebc = model.sparse_arch().unsharded().unwrap();
    let mut out = format!("step {}\n", ebc.step());
    for t in ebc.tables() {
        let bits: Vec<u32> = t.weights().iter().map(|v| v.to_bits()).collect();
        let state: Vec<u32> = t.optimizer_state().iter().map(|v| v.to_bits()).collect();
        out += &format!(
            "{} {bits:?} {state:?} {:?} {:?}\n",
            t.name(),
            t.kv_state(),
            t.kv_stats()
        );
    }
    out
}

#[test]
fn key_value_tables_sharded_table_wise_train_save_and_move_as_in_one_process() {
    let (config, data) = setup();
    let mut one = build(&config, None);
    let mut sharded = build(&config, Some(table_wise(&config, &[0, 1, 0])));
    assert_eq!(tables(&sharded), tables(&one), "fresh");
    let losses = train(&mut one, &data, 0..8, (0, 1));
    assert_eq!(train(&mut sharded, &data, 0..8, (0, 1)), losses);
    assert_eq!(tables(&sharded), tables(&one), "trained");
    let kv = |m: &Dlrm| m.sparse_arch().unsharded().unwrap().tables()[1].kv_stats();
    let stats = kv(&one).unwrap();
    assert!(stats.evicted > 0 && stats.rejected > 0, "{stats:?}");

    // Predicting admits nothing.
    let be = Backend::Native(NativeBackend::new(1));
    let test = data.batch(100, 16);
    let want = one.predict(&be, &test).unwrap().to_vec();
    assert_eq!(sharded.predict(&be, &test).unwrap(), &want[..]);
    let after = kv(&sharded).unwrap();
    assert_eq!(Some(after), kv(&one));
    assert_eq!((after.seen, after.admitted), (stats.seen, stats.admitted));

    // Saved whole, loaded onto three devices and in one process.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    save(&mut sharded, &path, None).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let (table, dense) = optimizers();
    let mut three = (ckpt.builder().optimizers(table, dense))
        .plan(table_wise(&config, &[2, 0, 1]))
        .build()
        .unwrap();
    let mut alone = ckpt.builder().optimizers(table, dense).build().unwrap();
    assert_eq!(tables(&three), tables(&one), "loaded on three devices");
    let more = train(&mut one, &data, 8..14, (0, 1));
    assert_eq!(train(&mut three, &data, 8..14, (0, 1)), more);
    assert_eq!(train(&mut alone, &data, 8..14, (0, 1)), more);
    assert_eq!(tables(&three), tables(&one), "trained on");
}

/// Runs `body(collective)` on `n` threads standing in for ranks.
fn on_ranks<R: Send>(n: usize, body: impl Fn(Arc<dyn Collective>) -> R + Sync) -> Vec<R> {
    let comms = InProcess::group(n).into_iter();
    let comms: Vec<Arc<dyn Collective>> = comms.map(|c| Arc::new(c) as _).collect();
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = (comms.into_iter())
            .map(|c| s.spawn(move || body(c)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn key_value_tables_on_ranks_save_a_set_that_loads_anywhere() {
    let (config, data) = setup();
    let dir = tempfile::tempdir().unwrap();
    let (table, dense) = optimizers();
    let written = on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut m = (Dlrm::builder(config.clone()).optimizers(table, dense))
            .seed(5)
            .plan(table_wise(&config, &[1, 0, 1]))
            .world(comm)
            .build()
            .unwrap();
        let got = train(&mut m, &data, 0..6, (rank, 2));
        save_set(&mut m, dir.path(), None).unwrap();
        (got, tables(&m))
    });
    // The ranks' losses are of the whole batch (reduced in another order
    // than one process sums, so not its bits); every rank gathers the same.
    assert_eq!(written[0], written[1]);
    let want = &written[0].1;
    let index = dir.path().join("model.safetensors.index.json");
    let ckpt = Checkpoint::open(&index).unwrap();
    let alone = ckpt.builder().optimizers(table, dense).build().unwrap();
    assert_eq!(&tables(&alone), want, "the set in one process");
    let read = on_ranks(3, |comm| {
        let ckpt = Checkpoint::open(Path::new(&index)).unwrap();
        let m = (ckpt.builder().optimizers(table, dense))
            .plan(table_wise(&config, &[0, 2, 1]))
            .world(comm)
            .build()
            .unwrap();
        tables(&m)
    });
    for state in &read {
        assert_eq!(state, want, "the set on three ranks");
    }
}

/// Table 2 of [`setup`] with 60 rows (40 ids: never full), and a plan of
/// `devices` devices: table 0 table-wise on the first, table 1 on the
/// last, table 2 row-wise by buckets over all.
fn by_buckets(devices: &[usize]) -> (DlrmConfig, ShardingPlan) {
    let (mut config, _) = setup();
    config.tables[2].num_embeddings = 61;
    let t = &config.tables;
    let tables = vec![
        TablePlan::table_wise(&t[0], devices[0]),
        TablePlan::table_wise(&t[1], *devices.last().unwrap()),
        TablePlan::row_wise_buckets(&t[2], devices),
    ];
    let num_devices = devices.len();
    (
        config,
        ShardingPlan {
            num_devices,
            tables,
        },
    )
}

/// Every tensor of every file in `dir` has the bytes its checksum says
/// (the last shard's block and its fallback row are two pieces streamed
/// from one table).
fn every_checksum_holds(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let meta = header.metadata().clone().unwrap();
        let sums: std::collections::HashMap<String, String> =
            serde_json::from_str(&meta["ember.crc32"]).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in file.tensors() {
            let got = format!("{:08x}", crc32fast::hash(t.data()));
            assert_eq!(got, sums[&name], "{name} in {path:?}");
        }
    }
}

/// Every id a key-value table holds (gathered), with its row's bits,
/// optimizer state bits, header and count, by id.
/// An id, its row's bits, its state's bits, its header and count.
type Held = (u64, Vec<u32>, Vec<u32>, u32, u32);

fn held(model: &Dlrm, table: usize) -> Vec<Held> {
    let ebc = model.sparse_arch().unsharded().unwrap();
    let t = &ebc.tables()[table];
    let s = t.kv_state().unwrap();
    let (stride, per) = (t.bytes_per_row(), t.state_floats_per_row());
    let mut out: Vec<_> = (0..s.ids.len())
        .filter(|&r| s.counts[r] > 0)
        .map(|r| {
            // As stored (in RAM or on the disk tier); fp32 rows.
            let (mut row, mut state) = (vec![0u8; stride], vec![0f32; per]);
            t.read_stored_rows(r, &mut row, &mut state).unwrap();
            let words = row.chunks_exact(4);
            (
                s.ids[r],
                words
                    .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                    .collect(),
                state.iter().map(|v| v.to_bits()).collect(),
                s.last_seen[r],
                s.counts[r],
            )
        })
        .collect();
    out.sort_unstable();
    out
}

/// Each bucket shard's ids are of its buckets; returns the shards' maps.
fn bucket_maps(model: &Dlrm) -> Vec<ember_sparse::KvState> {
    let sharded = model.sparse_arch().sharded().unwrap();
    let mut maps = Vec::new();
    for l in sharded.local_shards() {
        let RowSplit::Buckets {
            first_bucket,
            end_bucket,
            buckets,
            ..
        } = l.shard.rows
        else {
            continue;
        };
        let state = l.data.kv_state().unwrap();
        for (id, &c) in state.ids.iter().zip(&state.counts).filter(|(_, &c)| c > 0) {
            let b = ember_sparse::id_bucket(*id, buckets);
            assert!(
                (first_bucket..end_bucket).contains(&b),
                "id {id} (count {c}) in bucket {b}"
            );
        }
        maps.push(state);
    }
    maps
}

#[test]
fn key_value_tables_sharded_by_buckets_resume_bitwise_and_move_to_any_device_count() {
    let (_, data) = setup();
    let (config, plan) = by_buckets(&[0, 1]);
    let mut model = build(&config, Some(plan.clone()));
    train(&mut model, &data, 0..8, (0, 1));
    let maps = bucket_maps(&model);
    assert_eq!(maps.len(), 2);
    assert!(
        maps.iter().all(|m| m.counts.iter().any(|&c| c > 0)),
        "{maps:?}"
    );
    let want = held(&model, 2);
    assert!(want.len() > 20, "{}", want.len());
    // Never full (every id admitted, 40 ids for 60 rows): the one process
    // holds the same ids with the same headers; their rows differ only by
    // the order a bag's partial sums add up in.
    let mut one = build(&config, None);
    train(&mut one, &data, 0..8, (0, 1));
    let alone = held(&one, 2);
    let headers = |h: &[Held]| h.iter().map(|x| (x.0, x.3, x.4)).collect::<Vec<_>>();
    assert_eq!(headers(&alone), headers(&want));
    for (a, b) in alone.iter().zip(&want) {
        for (x, y) in a.1.iter().zip(&b.1) {
            let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(1.0),
                "id {}: {x} {y}",
                a.0
            );
        }
    }

    // Saved as a set: the shards' own maps.
    let dir = tempfile::tempdir().unwrap();
    let index = model.save_checkpoint(dir.path(), None).unwrap();
    assert!(index.ends_with("model.safetensors.index.json"), "{index:?}");
    assert!(!dir.path().join("model.safetensors").exists());
    every_checksum_holds(dir.path());
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let (table, dense) = optimizers();
    let load = |plan: Option<ShardingPlan>| {
        (ckpt.builder().optimizers(table, dense))
            .plan(plan)
            .build()
            .unwrap()
    };
    // On the same plan, bitwise: maps, rows, and training on.
    let mut resumed = load(Some(plan));
    assert_eq!(bucket_maps(&resumed), maps);
    assert_eq!(tables(&resumed), tables(&model));
    let more = train(&mut model, &data, 8..12, (0, 1));
    assert_eq!(train(&mut resumed, &data, 8..12, (0, 1)), more);
    assert_eq!(tables(&resumed), tables(&model));

    // On three devices, and in one process: every id with its row.
    let (_, three) = by_buckets(&[2, 0, 1]);
    let moved = load(Some(three));
    assert_eq!(bucket_maps(&moved).len(), 3);
    assert_eq!(held(&moved, 2), want);
    assert_eq!(held(&load(None), 2), want);

    // Over 30 devices (2 rows each) some shards get more ids of their
    // buckets than they have rows: each keeps the most looked up (the
    // table evicts by LFU) and counts the others evicted.
    let (_, thirty) = by_buckets(&(0..30).collect::<Vec<_>>());
    let spread = load(Some(thirty));
    let kept = held(&spread, 2);
    assert!(kept.len() < want.len(), "{}", kept.len());
    assert!(kept.iter().all(|k| want.contains(k)));
    let stats = |m: &Dlrm| {
        let ebc = m.sparse_arch().unsharded().unwrap();
        ebc.tables()[2].kv_stats().unwrap()
    };
    let saved = ckpt.kv_stats().unwrap();
    let before = saved.iter().find(|(t, _)| t == "t_cat_2").unwrap().1;
    let after = stats(&spread);
    assert_eq!(
        after.evicted - before.evicted,
        (want.len() - kept.len()) as u64
    );
    assert_eq!(after.seen, before.seen);
}

#[test]
fn key_value_shards_of_buckets_on_ranks_save_a_set_that_moves() {
    let (_, data) = setup();
    let (config, plan) = by_buckets(&[0, 1]);
    let (table, dense) = optimizers();
    let dir = tempfile::tempdir().unwrap();
    let written = on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut m = (Dlrm::builder(config.clone()).optimizers(table, dense))
            .seed(5)
            .plan(plan.clone())
            .world(comm)
            .build()
            .unwrap();
        train(&mut m, &data, 0..6, (rank, 2));
        save_set(&mut m, dir.path(), None).unwrap();
        (bucket_maps(&m), held(&m, 2))
    });
    assert_eq!(written[0].1, written[1].1);
    let want = &written[0].1;
    assert!(want.len() > 20, "{}", want.len());
    let index = dir.path().join("model.safetensors.index.json");
    // The same plan on two ranks: each rank's shard its own map again.
    let again = on_ranks(2, |comm| {
        let ckpt = Checkpoint::open(Path::new(&index)).unwrap();
        let m = (ckpt.builder().optimizers(table, dense))
            .plan(plan.clone())
            .world(comm)
            .build()
            .unwrap();
        bucket_maps(&m)
    });
    assert_eq!(again[0], written[0].0);
    assert_eq!(again[1], written[1].0);
    // Three ranks, and one process: every id with its row.
    let (_, three) = by_buckets(&[1, 2, 0]);
    let moved = on_ranks(3, |comm| {
        let ckpt = Checkpoint::open(Path::new(&index)).unwrap();
        let m = (ckpt.builder().optimizers(table, dense))
            .plan(three.clone())
            .world(comm)
            .build()
            .unwrap();
        held(&m, 2)
    });
    assert!(moved.iter().all(|h| h == want));
    let ckpt = Checkpoint::open(&index).unwrap();
    let alone = ckpt.builder().optimizers(table, dense).build().unwrap();
    assert_eq!(&held(&alone, 2), want);
}

#[test]
fn key_value_shards_of_buckets_on_the_disk_tier_train_save_and_move_as_in_ram() {
    let (_, data) = setup();
    let (config, plan) = by_buckets(&[0, 1]);
    let dir = tempfile::tempdir().unwrap();
    // Table 2's shards on the disk tier, each caching 16 rows.
    let tiers = |d: &Path| {
        std::fs::create_dir_all(d).unwrap();
        let tier = ember_sparse::DiskTierConfig {
            dir: d.to_path_buf(),
            cache_rows: 32,
            policy: ember_sparse::CachePolicy::default(),
        };
        vec![None, None, Some(tier)]
    };
    let (table, dense) = optimizers();
    let placed = |tiers: Vec<Option<ember_sparse::DiskTierConfig>>| {
        (Dlrm::builder(config.clone()).optimizers(table, dense))
            .seed(5)
            .plan(plan.clone())
            .disk_tiers(tiers)
            .build()
            .unwrap()
    };
    let (mut ram, mut disk) = (placed(Vec::new()), placed(tiers(&dir.path().join("tier"))));
    let on_disk = disk.sparse_arch().sharded().unwrap().local_shards();
    assert_eq!(on_disk.iter().filter(|s| s.data.is_on_disk()).count(), 2);
    let losses = train(&mut ram, &data, 0..8, (0, 1));
    assert_eq!(train(&mut disk, &data, 0..8, (0, 1)), losses);
    assert_eq!(bucket_maps(&disk), bucket_maps(&ram));
    assert_eq!(held(&disk, 2), held(&ram, 2));
    // Saved (a set, streamed), resumed on the disk tier and on the plan.
    let ckpt_dir = dir.path().join("ckpt");
    disk.save_checkpoint(&ckpt_dir, None).unwrap();
    every_checksum_holds(&ckpt_dir);
    let ckpt = Checkpoint::open(&ckpt_dir).unwrap();
    let mut resumed = (ckpt.builder().optimizers(table, dense))
        .plan(plan.clone())
        .disk_tiers(tiers(&dir.path().join("tier2")))
        .build()
        .unwrap();
    assert_eq!(bucket_maps(&resumed), bucket_maps(&disk));
    let more = train(&mut ram, &data, 8..11, (0, 1));
    assert_eq!(train(&mut resumed, &data, 8..11, (0, 1)), more);
    // Moved into one process, in RAM.
    let alone = ckpt.builder().optimizers(table, dense).build().unwrap();
    assert_eq!(held(&alone, 2), held(&disk, 2));
}
