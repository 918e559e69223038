//! A DLRM whose tables are on the disk tier trains bit for bit as the same
//! model in RAM, and checkpoints (streamed a piece at a time) to the very
//! file the RAM model writes, from which both resume exactly.

use ember_dense::{DenseOptimizerConfig, NativeBackend};
use ember_models::{Backend, ExecMode};
use ember_models::{
    Checkpoint, DataGeneration, Dlrm, DlrmConfig, InteractionType, Model, SyntheticConfig,
    SyntheticData,
};
use ember_sparse::{CachePolicy, DataType, DiskTierConfig, TableOptimizer};

fn config() -> DlrmConfig {
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[3000, 500, 40], 8),
        bottom_mlp: vec![13, 16, 8],
        top_mlp: vec![16, 1],
        interaction: InteractionType::Dot,
    }
}

fn model(optimizer: TableOptimizer, tiers: Vec<Option<DiskTierConfig>>) -> Dlrm {
    Dlrm::builder(config())
        .optimizers(optimizer, DenseOptimizerConfig::sgd(0.05))
        .seed(9)
        .disk_tiers(tiers)
        .build()
        .unwrap()
}

fn data() -> SyntheticData {
    SyntheticData::new(SyntheticConfig::for_model(
        &config(),
        DataGeneration::Learnable,
        3,
        4,
    ))
    .unwrap()
}

/// Tiers for the first two tables (caches of 256 rows: batches of 64
/// samples evict and read back rows), one of each policy; the third,
/// small, in RAM.
fn tiers(dir: &std::path::Path) -> Vec<Option<DiskTierConfig>> {
    let tier = |policy| {
        Some(DiskTierConfig {
            dir: dir.to_path_buf(),
            cache_rows: 256,
            policy,
        })
    };
    vec![tier(CachePolicy::Lru), tier(CachePolicy::Lfu), None]
}

/// A safetensors file's metadata and tensors (name, dtype, shape, bytes;
/// checksums included), whatever the order of its header.
type Contents = (
    Vec<(String, String)>,
    Vec<(String, String, Vec<usize>, Vec<u8>)>,
);

fn contents(bytes: &[u8]) -> Contents {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let mut meta: Vec<_> = header.metadata().clone().unwrap().into_iter().collect();
    meta.sort();
    let file = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let mut tensors: Vec<_> = (file.tensors().into_iter())
        .map(|(n, t)| {
            (
                n,
                format!("{:?}", t.dtype()),
                t.shape().to_vec(),
                t.data().to_vec(),
            )
        })
        .collect();
    tensors.sort();
    (meta, tensors)
}

#[test]
fn disk_tier_dlrm_trains_checkpoints_and_resumes_as_in_ram() {
    let dir = tempfile::tempdir().unwrap();
    let be = Backend::Native(NativeBackend::new(2));
    let data = data();
    for optimizer in [
        TableOptimizer::rowwise_adagrad(0.05),
        TableOptimizer::adam(0.01),
        TableOptimizer::adagrad(0.05),
    ] {
        let mut ram = model(optimizer, Vec::new());
        let mut disk = model(optimizer, tiers(dir.path()));
        for i in 0..12 {
            let batch = data.batch(i, 64);
            let a = ram.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            let b = disk.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            assert_eq!(a.to_bits(), b.to_bits(), "step {i}");
        }
        let tables = disk.sparse_arch().local().unwrap().tables();
        let stats = tables[0].tier_stats().unwrap();
        assert!(stats.misses > 0 && stats.bytes_written > 0, "{stats:?}");
        assert!(tables[2].tier_stats().is_none());

        // The streamed checkpoint holds the RAM model's tensors and
        // metadata, byte for byte.
        let saved = |m: &mut Dlrm, name: &str| {
            let path = m.save_checkpoint(&dir.path().join(name), None).unwrap();
            contents(&std::fs::read(&path).unwrap())
        };
        let file = saved(&mut disk, "disk");
        assert!(file == saved(&mut ram, "ram"), "{optimizer:?}");

        // Loaded onto the disk tier (and, in place, keeping its tiers), it
        // trains on exactly as the model that never stopped.
        let ckpt = Checkpoint::open(&dir.path().join("disk")).unwrap();
        let dense = DenseOptimizerConfig::sgd(0.05);
        let mut loaded = ckpt
            .builder()
            .optimizers(optimizer, dense)
            .disk_tiers(tiers(dir.path()))
            .build()
            .unwrap();
        let mut in_place = model(optimizer, tiers(dir.path()));
        let path = dir.path().join("disk").join("model.safetensors");
        in_place.load_checkpoint(&path).unwrap();
        let on_disk = in_place.sparse_arch().local().unwrap().tables();
        assert!(on_disk[0].is_on_disk() && !on_disk[2].is_on_disk());
        for i in 12..16 {
            let batch = data.batch(i, 64);
            let a = ram.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            let b = loaded
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            let c = in_place
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            assert_eq!(
                (a.to_bits(), a.to_bits()),
                (b.to_bits(), c.to_bits()),
                "step {i}"
            );
        }
    }
}

#[test]
fn a_checkpoint_loads_onto_the_disk_tier_cast_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let be = Backend::Native(NativeBackend::new(2));
    let optimizer = TableOptimizer::rowwise_adagrad(0.05);
    let mut ram = model(optimizer, Vec::new());
    ram.train_step(&be, &data().batch(0, 64), ExecMode::Strict)
        .unwrap();
    let path = ram.save_checkpoint(dir.path(), None).unwrap();
    let dense = DenseOptimizerConfig::sgd(0.05);

    // fp32 rows cast to fp16 as they stream, as into RAM.
    let mut ckpt = Checkpoint::open(&path).unwrap();
    ckpt.cast_tables(DataType::Fp16);
    let mut half_ram = ckpt.builder().optimizers(optimizer, dense).build().unwrap();
    let mut half_disk = ckpt
        .builder()
        .optimizers(optimizer, dense)
        .disk_tiers(tiers(dir.path()))
        .build()
        .unwrap();
    let batch = data().batch(1, 64);
    let a = half_ram.predict(&be, &batch).unwrap().to_vec();
    let b = half_disk.predict(&be, &batch).unwrap().to_vec();
    assert_eq!(a, b);
    drop(half_disk);

    // A corrupt row is found by its checksum, the tensor named.
    let name = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight";
    let bad = corrupt_copy(&path, name, 100);
    let err = Checkpoint::open(&bad)
        .unwrap()
        .builder()
        .optimizers(optimizer, dense)
        .disk_tiers(tiers(dir.path()))
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(name) && err.contains("corrupt"), "{err}");
    let rows_files = (std::fs::read_dir(dir.path()).unwrap())
        .filter(|e| e.as_ref().unwrap().path().extension() == Some("rows".as_ref()))
        .count();
    assert_eq!(rows_files, 0, "the failed load's table files are removed");
}

/// A copy of checkpoint `path` (as `bad.safetensors` beside it) with one
/// bit flipped at byte `at` of tensor `name`'s data.
fn corrupt_copy(path: &std::path::Path, name: &str, at: usize) -> std::path::PathBuf {
    let mut bytes = std::fs::read(path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let start = 8 + header + json[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[start + at] ^= 1;
    let bad = path.with_file_name("bad.safetensors");
    std::fs::write(&bad, bytes).unwrap();
    bad
}

/// A table's rows (as stored) and optimizer state, whole.
fn stored(t: &ember_sparse::EmbeddingTable) -> (Vec<u8>, Vec<u32>) {
    let mut rows = vec![0u8; t.num_embeddings() * t.bytes_per_row()];
    let mut state = vec![0f32; t.num_embeddings() * t.state_floats_per_row()];
    t.read_stored_rows(0, &mut rows, &mut state).unwrap();
    (rows, state.iter().map(|x| x.to_bits()).collect())
}

/// A plan of `sharding` over `devices`.
fn plan(sharding: ember_sharding::ShardingType, devices: usize) -> ember_sharding::ShardingPlan {
    let options = ember_sharding::PlannerOptions {
        batch_size: 64,
        pooling_factor: 1.0,
        optimizer: TableOptimizer::adam(0.01),
        sharding: Some(sharding),
        disk_tier: None,
    };
    let topo = ember_sharding::Topology::uniform(devices, 1 << 30);
    ember_sharding::plan(&config().tables, &topo, &options)
        .unwrap()
        .0
}

#[test]
fn sharded_disk_tier_tables_train_as_in_ram_each_device_caching_its_shards() {
    use ember_sharding::ShardingType;
    let dir = tempfile::tempdir().unwrap();
    let be = Backend::Native(NativeBackend::new(2));
    let data = data();
    let optimizers = (TableOptimizer::adam(0.01), DenseOptimizerConfig::sgd(0.05));
    for sharding in [
        ShardingType::TableWise,
        ShardingType::RowWise,
        ShardingType::RowWiseMod,
        ShardingType::ColumnWise,
        ShardingType::TableRowWise,
    ] {
        let placed = |tiers| {
            let plan = Some(plan(sharding, 2));
            (Dlrm::builder(config()).optimizers(optimizers.0, optimizers.1))
                .seed(9)
                .plan(plan)
                .disk_tiers(tiers)
                .build()
                .unwrap()
        };
        let (mut ram, mut disk) = (placed(Vec::new()), placed(tiers(dir.path())));
        // Sharded from a disk-tier model too (resharding copies its rows).
        let mut moved = model(optimizers.0, tiers(dir.path()));
        moved.shard(Some(plan(sharding, 2))).unwrap();
        // Neither wrote a row: the shards make theirs on first lookup, as
        // the tables they came from would have. Gathered back, such rows
        // are not copied either: the gathered tables make them alike.
        let no_record = |what: &str| {
            for file in std::fs::read_dir(dir.path()).unwrap() {
                let path = file.unwrap().path();
                if path.is_file() {
                    let bytes = std::fs::read(&path).unwrap();
                    assert!(
                        bytes.iter().all(|&b| b == 0),
                        "{sharding:?} {what}: {path:?}"
                    );
                }
            }
        };
        no_record("sharded");
        let back = moved.sparse_arch().sharded().unwrap().to_collection();
        assert!(back.as_ref().unwrap().tables()[0].is_on_disk());
        no_record("gathered");
        drop(back);
        for i in 0..8 {
            let batch = data.batch(i, 64);
            let a = ram.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            let b = disk.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            let c = moved
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            assert_eq!(
                (a.to_bits(), a.to_bits()),
                (b.to_bits(), c.to_bits()),
                "{sharding:?} step {i}"
            );
        }
        let sharded = disk.sparse_arch().sharded().unwrap();
        let on_disk = sharded
            .local_shards()
            .iter()
            .filter(|s| s.data.is_on_disk())
            .count();
        assert!(on_disk >= 2, "{sharding:?}: {on_disk} shards on disk");
        assert_eq!(disk.sparse_arch().disk_tiers(), tiers(dir.path()));
        // Gathered, they come back on the disk tier, row for row. Only the
        // rows that changed are written: 8 batches of 64 change at most
        // 512 rows of the first table.
        let in_ram = ram
            .sparse_arch()
            .sharded()
            .unwrap()
            .to_collection()
            .unwrap();
        for model in [&disk, &moved] {
            let gathered = model.sparse_arch().sharded().unwrap().to_collection();
            let gathered = gathered.unwrap();
            assert!(gathered.tables()[0].is_on_disk() && !gathered.tables()[2].is_on_disk());
            for (g, r) in gathered.tables().iter().zip(in_ram.tables()) {
                assert_eq!(stored(g), stored(r), "{sharding:?}: {}", g.name());
            }
            let first = &gathered.tables()[0];
            let written = (0..first.num_embeddings())
                .filter(|&r| !first.row_is_initial(r))
                .count();
            assert!(written <= 8 * 64, "{sharding:?}: {written} rows written");
        }
        // Saved, they stream into a set of this process's shards; built
        // from it under the plan (and loaded in place), the model trains
        // on as the one that never stopped.
        let saved = dir.path().join(format!("{sharding:?}"));
        let index = disk.save_checkpoint(&saved, None).unwrap();
        assert!(
            index.ends_with(ember_models::checkpoint::INDEX_FILE),
            "{index:?}"
        );
        let ckpt = Checkpoint::open(&saved).unwrap();
        let mut resumed = (ckpt.builder().optimizers(optimizers.0, optimizers.1))
            .plan(plan(sharding, 2))
            .disk_tiers(tiers(dir.path()))
            .build()
            .unwrap();
        moved.load_checkpoint(&index).unwrap();
        assert!(moved.sparse_arch().sharded().is_some());
        for i in 8..11 {
            let batch = data.batch(i, 64);
            let a = ram.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            let b = resumed
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            let c = moved
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            assert_eq!(
                (a.to_bits(), a.to_bits()),
                (b.to_bits(), c.to_bits()),
                "{sharding:?} step {i}"
            );
        }
        // Resharded under another plan (gathered onto the disk tier, then
        // split again), it steps as the RAM model resharded alike.
        let other = match sharding {
            ShardingType::TableWise => ShardingType::RowWise,
            _ => ShardingType::TableWise,
        };
        ram.shard(Some(plan(other, 2))).unwrap();
        resumed.shard(Some(plan(other, 2))).unwrap();
        assert_eq!(resumed.sparse_arch().disk_tiers(), tiers(dir.path()));
        for i in 11..13 {
            let batch = data.batch(i, 64);
            let a = ram.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            let b = resumed
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            assert_eq!(a.to_bits(), b.to_bits(), "{sharding:?} resharded, step {i}");
        }
    }
}

#[test]
fn a_disk_tier_model_resharded_again_and_again_trains_as_in_ram() {
    use ember_sharding::ShardingType;
    // Each move gathers the shards (their untouched rows made alike, not
    // copied) and splits them again: the rows still initial go through
    // every move made, never stored.
    let dir = tempfile::tempdir().unwrap();
    let be = Backend::Native(NativeBackend::new(2));
    let data = data();
    let opt = TableOptimizer::adam(0.01);
    let (mut ram, mut disk) = (model(opt, Vec::new()), model(opt, tiers(dir.path())));
    let plans = [
        Some(plan(ShardingType::ColumnWise, 2)),
        Some(plan(ShardingType::RowWiseMod, 2)),
        Some(plan(ShardingType::TableWise, 2)),
        None,
    ];
    for (p, placed) in plans.into_iter().enumerate() {
        ram.shard(placed.clone()).unwrap();
        disk.shard(placed).unwrap();
        for i in 0..2 {
            let batch = data.batch((2 * p + i) as u64, 64);
            let a = ram.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            let b = disk.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
            assert_eq!(a.to_bits(), b.to_bits(), "move {p} step {i}");
        }
    }
    let (ram, disk) = (
        ram.sparse_arch().local().unwrap(),
        disk.sparse_arch().local().unwrap(),
    );
    for (r, d) in ram.tables().iter().zip(disk.tables()) {
        assert_eq!(stored(r), stored(d), "{}", r.name());
    }
}

/// An inference checkpoint (int8 tables) on the disk tier reads its rows
/// where they lie in the checkpoint, checked first: it predicts as in
/// RAM, its tables' files take no disk, and a corrupt row is found.
#[test]
fn an_inference_checkpoint_serves_its_rows_in_place() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let be = Backend::Native(NativeBackend::new(2));
    let mut trained = model(TableOptimizer::rowwise_adagrad(0.05), Vec::new());
    trained
        .train_step(&be, &data().batch(0, 64), ExecMode::Strict)
        .unwrap();
    let fp32 = trained.save_checkpoint(dir.path(), None).unwrap();
    let int8 = dir.path().join("int8.safetensors");
    ember_models::checkpoint::quantize(&fp32, DataType::Int8, &int8).unwrap();

    let ckpt = Checkpoint::open(&int8).unwrap();
    let mut ram = ckpt.inference_model().unwrap();
    let mut disk = ckpt
        .builder()
        .optimizers(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
        .disk_tiers(tiers(dir.path()))
        .build()
        .unwrap();
    for b in 1..4 {
        let batch = data().batch(b, 64);
        let a = ram.predict(&be, &batch).unwrap().to_vec();
        assert_eq!(a, disk.predict(&be, &batch).unwrap(), "batch {b}");
    }
    let tables = disk.sparse_arch().local().unwrap().tables();
    for t in tables.iter().filter(|t| t.is_on_disk()) {
        let file = std::fs::metadata(t.disk_path().unwrap()).unwrap();
        assert_eq!(file.blocks(), 0, "{}: nothing copied", t.name());
    }
    drop(disk);

    // A corrupt row is found by its checksum before anything serves.
    let name = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_1.weight";
    let bad = corrupt_copy(&int8, name, 50);
    let err = Checkpoint::open(&bad)
        .unwrap()
        .builder()
        .optimizers(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
        .disk_tiers(tiers(dir.path()))
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(name) && err.contains("corrupt"), "{err}");
}
