//! Key-value tables sharded table-wise (each map whole on one device): in
//! threads they train bitwise as in one process (admitting, evicting,
//! falling back), predict without admitting, and save their maps with
//! their rows: a full file, and a set written by ranks, load in one
//! process and onto another device count exactly.

use std::path::Path;
use std::sync::Arc;

use ember_dense::{DenseOptimizerConfig, NativeBackend};
use ember_models::checkpoint::{save, save_set};
use ember_models::{
    Backend, Checkpoint, DataGeneration, Dlrm, DlrmConfig, ExecMode, InteractionType, Model,
    SyntheticConfig, SyntheticData,
};
use ember_sharding::plan::TablePlan;
use ember_sharding::{Collective, InProcess, ShardingPlan};
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
