//! A DLRM with a key-value table: it trains (admitting ids), predicts
//! without admitting any, and saves its map with its rows: the loaded model
//! predicts the same and trains on bitwise; a map broken in the file is
//! refused, naming the table and the id.

use ember_dense::NativeBackend;
use ember_models::checkpoint::{quantize, save};
use ember_models::{
    Backend, Checkpoint, DataGeneration, Dlrm, DlrmConfig, ExecMode, InteractionType, Model,
    SyntheticConfig, SyntheticData,
};
use ember_sparse::{DataType, Eviction, KvConfig};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

#[test]
fn a_dlrm_trains_and_predicts_with_a_key_value_table() {
    let be = Backend::Native(NativeBackend::new(1));
    let mut config = DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[7, 40], 4),
        bottom_mlp: vec![3, 6, 4],
        top_mlp: vec![5, 3, 1],
        interaction: InteractionType::Dot,
    };
    let data = SyntheticData::new(SyntheticConfig::for_model(
        &config,
        DataGeneration::Learnable,
        3,
        4,
    ))
    .unwrap();
    // 40 ids, 7 rows: the table fills, evicts and falls back.
    config.tables[1].kv = Some(KvConfig {
        eviction: Eviction::Lfu,
        eviction_window: Some(4),
        ..KvConfig::default()
    });
    config.tables[1].num_embeddings = 7;
    let mut model = Dlrm::builder(config).seed(7).build().unwrap();
    let stats = |model: &Dlrm| {
        let ebc = model.sparse_arch().local().unwrap();
        ebc.tables()[1].kv_stats().unwrap()
    };
    let ids = |i: u64| {
        data.batch(i, 16)
            .sparse
            .get("cat_1")
            .unwrap()
            .values()
            .len() as u64
    };
    for i in 0..6 {
        let out = model
            .train_step(&be, &data.batch(i, 16), ExecMode::Strict)
            .unwrap();
        assert!(out.loss.is_finite());
    }
    let trained = stats(&model);
    assert_eq!(trained.seen, (0..6).map(ids).sum::<u64>());
    assert!(trained.admitted > 6 && trained.evicted > 0, "{trained:?}");
    assert_eq!(trained.occupancy, 6);
    model.predict(&be, &data.batch(100, 16)).unwrap();
    let after = stats(&model);
    assert_eq!(
        (after.admitted, after.seen),
        (trained.admitted, trained.seen)
    );
    // Training again admits again.
    model
        .train_step(&be, &data.batch(7, 16), ExecMode::Strict)
        .unwrap();
    assert_eq!(
        stats(&model).seen,
        (0..8).filter(|&i| i != 6).map(ids).sum::<u64>()
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let test = data.batch(100, 16);
    let want = model.predict(&be, &test).unwrap().to_vec();
    save(&mut model, &path, None).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let mut served = ckpt.inference_model().unwrap();
    assert_eq!(served.predict(&be, &test).unwrap(), &want[..]);
    let mut resumed = ckpt.builder().build().unwrap();
    assert_eq!(stats(&resumed), stats(&model));
    for i in 8..14 {
        let batch = data.batch(i, 16);
        let a = model
            .train_step(&be, &batch, ExecMode::Strict)
            .unwrap()
            .loss;
        let b = resumed
            .train_step(&be, &batch, ExecMode::Strict)
            .unwrap()
            .loss;
        assert_eq!(a.to_bits(), b.to_bits(), "step {i}");
    }
    let table = |m: &Dlrm| {
        let t = &m.sparse_arch().local().unwrap().tables()[1];
        (t.weights().to_vec(), t.kv_state())
    };
    assert_eq!(table(&resumed), table(&model));
    assert_eq!(stats(&resumed), stats(&model));

    // Quantized for serving (no optimizer, so no optimizer step): the map
    // keeps its own clock and loads; predictions follow the int8 rows.
    let int8 = dir.path().join("int8.safetensors");
    quantize(&path, DataType::Int8, &int8).unwrap();
    let mut quantized = Checkpoint::open(&int8).unwrap().inference_model().unwrap();
    let map = |m: &Dlrm| {
        let s = m.sparse_arch().local().unwrap().tables()[1]
            .kv_state()
            .unwrap();
        (s.ids, s.last_seen, s.counts, s.position.clock)
    };
    assert_eq!(map(&quantized), map(&served));
    let close = quantized.predict(&be, &test).unwrap();
    assert!(
        close.iter().zip(&want).all(|(a, b)| (a - b).abs() < 0.1),
        "{close:?} {want:?}"
    );

    // One id in two rows (the file rewritten without Ember's checksums,
    // which would refuse any edit): refused, naming the table and the id.
    let bytes = std::fs::read(&path).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    meta.remove("ember.crc32");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_1.kv.ids";
    let mut edited = st.tensor(ids).unwrap().data().to_vec();
    let first_id: [u8; 8] = edited[..8].try_into().unwrap();
    edited[8..16].copy_from_slice(&first_id);
    let tensors: Vec<(String, TensorView<'_>)> = (st.tensors().into_iter())
        .map(|(name, view)| match name == ids {
            true => (
                name,
                TensorView::new(view.dtype(), view.shape().to_vec(), &edited).unwrap(),
            ),
            false => (name, view),
        })
        .collect();
    let bad = dir.path().join("bad.safetensors");
    safetensors::serialize_to_file(tensors, Some(meta), &bad).unwrap();
    let err = match Checkpoint::open(&bad).and_then(|c| c.inference_model()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a broken map loaded"),
    };
    let id = u64::from_le_bytes(first_id);
    assert!(
        err.contains("t_cat_1") && err.contains(&format!("id {id} is held by two rows")),
        "{err}"
    );
}

/// A key-value table on the disk tier (its rows in a file behind a cache,
/// its map in RAM) trains bitwise as the same table in RAM: the same
/// losses, rows, optimizer state and map; saved, it loads onto the disk
/// tier again and trains on alike.
#[test]
fn a_key_value_table_on_the_disk_tier_trains_as_in_ram() {
    use ember_sparse::{Admission, DiskTierConfig, TableOptimizer};
    let be = Backend::Native(NativeBackend::new(1));
    let mut config = DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[7, 400], 4),
        bottom_mlp: vec![3, 6, 4],
        top_mlp: vec![5, 3, 1],
        interaction: InteractionType::Dot,
    };
    let data = SyntheticData::new(SyntheticConfig::for_model(
        &config,
        DataGeneration::Learnable,
        3,
        4,
    ))
    .unwrap();
    // 400 raw ids, 16 rows behind a cache of 16: it fills, evicts, and
    // rows go to and from the file.
    config.tables[1].data_type = DataType::Fp16;
    config.tables[1].num_embeddings = 17;
    config.tables[1].kv = Some(KvConfig {
        admission: Admission::Count {
            min_count: 2,
            sketch_width: 256,
            halve_every: Some(5),
        },
        eviction: Eviction::Lru,
        eviction_window: Some(8),
        ..KvConfig::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let tier = |sub: &str| {
        let path = dir.path().join(sub);
        std::fs::create_dir_all(&path).unwrap();
        let cache = DiskTierConfig {
            dir: path,
            cache_rows: 16,
            policy: Default::default(),
        };
        vec![None, Some(cache)]
    };
    let opts = (
        TableOptimizer::adam(0.02),
        ember_dense::DenseOptimizerConfig::sgd(0.1),
    );
    let build = |tiers: Vec<Option<DiskTierConfig>>| {
        Dlrm::builder(config.clone())
            .optimizers(opts.0, opts.1)
            .seed(3)
            .disk_tiers(tiers)
            .build()
            .unwrap()
    };
    let (mut ram, mut disk) = (build(vec![None, None]), build(tier("a")));
    assert!(disk.sparse_arch().local().unwrap().tables()[1].is_on_disk());
    let step = |m: &mut Dlrm, i: u64| {
        let out = m.train_step(&be, &data.batch(i, 16), ExecMode::Strict);
        out.unwrap().loss.to_bits()
    };
    for i in 0..12 {
        assert_eq!(step(&mut disk, i), step(&mut ram, i), "step {i}");
    }
    let table = |m: &Dlrm| {
        let t = &m.sparse_arch().local().unwrap().tables()[1];
        let (n, per_row) = (t.num_embeddings(), t.state_floats_per_row());
        let (mut rows, mut state) = (vec![0u8; n * t.bytes_per_row()], vec![0f32; n * per_row]);
        t.read_stored_rows(0, &mut rows, &mut state).unwrap();
        (rows, state, t.kv_state(), t.kv_stats())
    };
    let want = table(&ram);
    assert!(want.3.unwrap().evicted > 0, "{:?}", want.3);
    assert_eq!(table(&disk), want);
    let test = data.batch(100, 16);
    let predicted = ram.predict(&be, &test).unwrap().to_vec();
    assert_eq!(disk.predict(&be, &test).unwrap(), &predicted[..]);

    let path = dir.path().join("model.safetensors");
    save(&mut disk, &path, None).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let mut loaded = ckpt.builder().disk_tiers(tier("b")).build().unwrap();
    // Prediction counted its fallback reads in both.
    assert_eq!(table(&loaded), table(&ram));
    for i in 12..16 {
        assert_eq!(step(&mut loaded, i), step(&mut ram, i), "step {i}");
    }

    // L2-norm eviction would read every candidate's row from the file.
    config.tables[1].kv.as_mut().unwrap().eviction = Eviction::L2Norm;
    let err = Dlrm::builder(config.clone())
        .disk_tiers(tier("c"))
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("t_cat_1") && err.contains("L2-norm"), "{err}");
}
