//! A DLRM with a key-value table: it trains (admitting ids), predicts
//! without admitting any, and refuses a checkpoint it cannot yet write
//! whole (the map from ids to rows) instead of writing rows that would
//! load as other ids'.

use ember_dense::NativeBackend;
use ember_models::checkpoint::save;
use ember_models::{
    Backend, DataGeneration, Dlrm, DlrmConfig, ExecMode, InteractionType, Model, ModelError,
    SyntheticConfig, SyntheticData, Unsupported,
};
use ember_sparse::{Eviction, KvConfig};

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
    match save(&mut model, &path, None) {
        Err(ModelError::Unsupported(Unsupported::KeyValueCheckpoint(table))) => {
            assert_eq!(table, "t_cat_1")
        }
        other => panic!("{other:?}"),
    }
    assert!(!path.exists());
}
