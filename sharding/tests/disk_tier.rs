//! The planner and the disk tier: a table that does not fit in memory is
//! placed on the disk tier with a cache instead of failing, within each
//! device's disk; a table that fits stays in memory; plans say so and are
//! checked.

use ember_sharding::{
    plan, DiskTierModel, PlannerOptions, ShardingError, ShardingPlan, ShardingType, Topology,
};
use ember_sparse::{CachePolicy, EmbeddingBagConfig, TableOptimizer};

fn options(disk: Option<f64>) -> PlannerOptions {
    PlannerOptions {
        batch_size: 1024,
        pooling_factor: 1.0,
        optimizer: TableOptimizer::rowwise_adagrad(0.1),
        sharding: None,
        disk_tier: disk.map(|share| DiskTierModel {
            cache_share: share,
            min_cache_rows: 8 * 1024,
            reads_per_s: ember_sharding::DEFAULT_DISK_READS_PER_S,
            zipf_alpha: 1.0,
            policy: CachePolicy::Lru,
        }),
    }
}

/// A 10M-row table (dim 16: 68 bytes a row with its state, 680 MB) and a
/// small one, on two devices of 256 MiB.
fn tables() -> Vec<EmbeddingBagConfig> {
    vec![
        EmbeddingBagConfig::new("big", 10_000_000, 16, &["f"]),
        EmbeddingBagConfig::new("small", 50_000, 16, &["g"]),
    ]
}

#[test]
fn a_table_too_large_for_memory_goes_on_the_disk_tier() {
    let topo = Topology::uniform(2, 256 << 20);
    let err = plan(&tables(), &topo, &options(None)).unwrap_err();
    assert!(matches!(err, ShardingError::Capacity { .. }), "{err}");

    let (p, stats) = plan(&tables(), &topo, &options(Some(0.25))).unwrap();
    p.validate(&tables(), &TableOptimizer::rowwise_adagrad(0.1))
        .unwrap();
    let big = p.table("big").unwrap();
    // A quarter of the rows, in whole cache sets.
    assert_eq!(big.cache_rows, Some(2_500_000));
    assert_eq!(
        p.table("small").unwrap().cache_rows,
        None,
        "it fits in memory"
    );
    for (d, load) in stats.devices.iter().enumerate() {
        assert!(
            load.storage_bytes <= load.memory_bytes,
            "device {d}: {load:?}"
        );
    }
    let on_disk: u64 = stats.devices.iter().map(|d| d.disk_bytes).sum();
    assert_eq!(
        on_disk,
        ember_sparse::disk_tier_file_bytes(10_000_000, 68),
        "every row of the big table, once"
    );
    assert!(on_disk > 10_000_000 * 68);
    // The cache's bookkeeping is memory too: LFU's counts (4 bytes a row
    // of the table and of the cache) and bypass map, beside a bit and a file position a row.
    let kept = |p: CachePolicy| p.bookkeeping_bytes(10_000_000, 2_500_000);
    assert_eq!(kept(CachePolicy::Lru), 10_000_000 / 8 + 4 * 10_000_000);
    let mut lfu = options(Some(0.25));
    if let Some(m) = &mut lfu.disk_tier {
        m.policy = CachePolicy::Lfu;
    }
    let (_, lfu_stats) = plan(&tables(), &topo, &lfu).unwrap();
    let storage =
        |s: &ember_sharding::PlanStats| -> u64 { s.devices.iter().map(|d| d.storage_bytes).sum() };
    assert_eq!(
        storage(&lfu_stats) - storage(&stats),
        kept(CachePolicy::Lfu) - kept(CachePolicy::Lru)
    );
    assert!(kept(CachePolicy::Lfu) - kept(CachePolicy::Lru) > 10_000_000 * 4);
    assert!(stats
        .devices
        .iter()
        .any(|d| d.shards.iter().any(|s| s.ends_with("+disk"))));
    // The plan says so in its file, and reads back the same.
    let text = p.to_json();
    assert!(text.contains("\"cache_rows\""), "{text}");
    assert_eq!(ShardingPlan::from_json(&text).unwrap(), p);
    let tiers = p.disk_tiers(&tables(), std::path::Path::new("/ssd"), CachePolicy::Lfu);
    assert_eq!(tiers[0].as_ref().unwrap().cache_rows, 2_500_000);
    assert_eq!(tiers[0].as_ref().unwrap().policy, CachePolicy::Lfu);
    assert!(tiers[1].is_none());

    // Disks too small for it: the capacity error again.
    let mut small_disks = topo.clone();
    for d in &mut small_disks.devices {
        d.disk_bytes = Some(100 << 20);
    }
    let err = plan(&tables(), &small_disks, &options(Some(0.25))).unwrap_err();
    assert!(matches!(err, ShardingError::Capacity { .. }), "{err}");

    // With room in memory, nothing goes to disk: it is cheaper in memory.
    let roomy = Topology::uniform(2, 4 << 30);
    let (p, _) = plan(&tables(), &roomy, &options(Some(0.25))).unwrap();
    assert!(!p.uses_disk_tier());
}

#[test]
fn disk_tier_plans_are_checked() {
    let topo = Topology::uniform(2, 256 << 20);
    let (p, _) = plan(&tables(), &topo, &options(Some(0.25))).unwrap();
    let opt = TableOptimizer::rowwise_adagrad(0.1);
    let edit = |f: &dyn Fn(&mut ember_sharding::TablePlan)| {
        let mut q = p.clone();
        f(q.tables.iter_mut().find(|t| t.table == "big").unwrap());
        q.validate(&tables(), &opt).unwrap_err().to_string()
    };
    let err = edit(&|t| t.cache_rows = Some(8));
    assert!(
        err.contains("'big'") && err.contains("below one cache set"),
        "{err}"
    );
    let err = edit(&|t| {
        *t = ember_sharding::TablePlan::data_parallel(&tables()[0], 2);
        t.cache_rows = Some(1024);
    });
    assert!(err.contains("data-parallel"), "{err}");
    // Plans written before the disk tier read as before: in memory.
    let old = r#"{"num_devices":1,"tables":[{"table":"big","sharding":"table_wise","shards":[{"device":0,"rows":{"kind":"all"},"columns":[0,16]}]}]}"#;
    let old = ShardingPlan::from_json(old).unwrap();
    assert_eq!(old.tables[0].cache_rows, None);
    assert_eq!(old.tables[0].sharding, ShardingType::TableWise);
}

#[test]
fn hit_rates_follow_the_ids_skew() {
    let model = |alpha| DiskTierModel {
        cache_share: 0.1,
        min_cache_rows: 16,
        reads_per_s: 48_000.0,
        zipf_alpha: alpha,
        policy: CachePolicy::Lru,
    };
    let rows = 40_000_000;
    assert!(
        (model(0.0).hit_rate(rows) - 0.1).abs() < 1e-9,
        "uniform: the share"
    );
    let (zipf1, zipf12) = (model(1.0).hit_rate(rows), model(1.2).hit_rate(rows));
    // H(4M) / H(40M) for s = 1: (ln 4e6 + 0.58) / (ln 4e7 + 0.58), about 0.87.
    assert!((zipf1 - 0.868).abs() < 0.01, "{zipf1}");
    assert!(zipf12 > zipf1 && zipf12 < 1.0, "{zipf12}");
}
