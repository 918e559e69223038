//! A DLRM whose tables are on the disk tier trains bit for bit as the same
//! model in RAM, and refuses what it cannot do yet (checkpoints, sharding)
//! with an error naming the table.

use ember_dense::{DenseOptimizerConfig, NativeBackend};
use ember_models::{
    DataGeneration, Dlrm, DlrmConfig, InteractionType, Model, SyntheticConfig, SyntheticData,
};
use ember_sparse::{DiskTierConfig, TableOptimizer};

fn config() -> DlrmConfig {
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[3000, 500, 40], 8),
        bottom_mlp: vec![13, 16, 8],
        top_mlp: vec![16, 1],
        interaction: InteractionType::Dot,
    }
}

fn model(tiers: Vec<Option<DiskTierConfig>>) -> Dlrm {
    Dlrm::with_disk_tiers(
        config(),
        TableOptimizer::rowwise_adagrad(0.05),
        DenseOptimizerConfig::sgd(0.05),
        9,
        tiers,
    )
    .unwrap()
}

#[test]
fn disk_tier_dlrm_trains_as_in_ram() {
    let dir = tempfile::tempdir().unwrap();
    let be = NativeBackend::new(2);
    let data = SyntheticData::new(SyntheticConfig::for_model(
        &config(),
        DataGeneration::Learnable,
        3,
        4,
    ))
    .unwrap();
    let mut ram = model(Vec::new());
    // Caches of 256 rows: batches of 64 samples evict and read back rows.
    let tier = Some(DiskTierConfig {
        dir: dir.path().to_path_buf(),
        cache_rows: 256,
    });
    let mut disk = model(vec![tier.clone(), tier, None]);
    for i in 0..12 {
        let batch = data.batch(i, 64);
        let a = ram.train_step(&be, &batch).unwrap().loss;
        let b = disk.train_step(&be, &batch).unwrap().loss;
        assert_eq!(a.to_bits(), b.to_bits(), "step {i}");
    }
    let tables = disk.sparse_arch().local().unwrap().tables();
    let stats = tables[0].tier_stats().unwrap();
    assert!(stats.misses > 0 && stats.bytes_written > 0, "{stats:?}");
    assert!(tables[2].tier_stats().is_none());
    let out = dir.path().join("ckpt");
    let err = disk.save_checkpoint(&out, None).unwrap_err();
    assert!(
        err.to_string().contains("'t_cat_0' is on the disk tier"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(&out).map_or(0, |d| d.count()),
        0,
        "nothing written"
    );
}
