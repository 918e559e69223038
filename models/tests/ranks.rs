//! A model split over ranks (threads standing in for MPI processes): built
//! in place, trained, saved as a checkpoint set by every rank together, and
//! read back exactly in one process and under another number of ranks.

use ember_models::{Backend, ExecMode, Model};
use std::path::Path;
use std::sync::Arc;

use ember_dense::{DenseOptimizerConfig, HasParams};
use ember_models::checkpoint::save_set;
use ember_models::{
    Checkpoint, DataGeneration, Dlrm, DlrmConfig, InteractionType, SyntheticConfig, SyntheticData,
};
use ember_sharding::plan::TablePlan;
use ember_sharding::{Collective, InProcess, ShardingPlan, ShardingType};
use ember_sparse::{DataType, TableOptimizer};

fn config(dtype: DataType) -> DlrmConfig {
    DlrmConfig {
        tables: (DlrmConfig::criteo_tables(&[50, 37, 20], 6).into_iter())
            .map(|t| t.with_data_type(dtype))
            .collect(),
        bottom_mlp: vec![13, 8, 6],
        top_mlp: vec![8, 1],
        interaction: InteractionType::Dot,
    }
}

/// Hand-made, with two shards of one table on one device: rows of table 0
/// in three blocks (devices 0, 1, 0), columns of table 1 in three (1, 0, 1),
/// table 2 interleaved by id mod 2.
fn plan_of_two(c: &DlrmConfig) -> ShardingPlan {
    let t = &c.tables;
    ShardingPlan {
        num_devices: 2,
        tables: vec![
            TablePlan::row_wise(&t[0], &[0, 1, 0], ShardingType::RowWise),
            TablePlan::column_wise(&t[1], &[1, 0, 1]),
            TablePlan::row_wise_mod(&t[2], &[0, 1]),
        ],
    }
}

fn plan_of_three(c: &DlrmConfig) -> ShardingPlan {
    let t = &c.tables;
    ShardingPlan {
        num_devices: 3,
        tables: vec![
            TablePlan::column_wise(&t[0], &[2, 0, 1]),
            TablePlan::row_wise(&t[1], &[1, 2], ShardingType::RowWise),
            TablePlan::table_wise(&t[2], 0),
        ],
    }
}

/// Runs `body(rank, collective)` on `n` threads; results by rank.
fn on_ranks<R: Send>(n: usize, body: impl Fn(Arc<dyn Collective>) -> R + Sync) -> Vec<R> {
    let comms: Vec<Arc<dyn Collective>> = InProcess::group(n)
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let body = &body;
                s.spawn(move || body(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every table's rows (decoded) and optimizer state (gathered from every
/// rank), then every dense parameter.
fn tensors(model: &mut Dlrm) -> Vec<(String, Vec<f32>)> {
    let mut out: Vec<(String, Vec<f32>)> = Vec::new();
    {
        let tables = model.sparse_arch().unsharded().unwrap();
        for t in tables.tables() {
            let mut rows = vec![0f32; t.num_embeddings() * t.dim()];
            for (id, row) in rows.chunks_exact_mut(t.dim()).enumerate() {
                t.read_row(id, row);
            }
            out.push((t.name().to_string(), rows));
            out.push((format!("{} state", t.name()), t.optimizer_state().to_vec()));
        }
    }
    for p in model.dense_arch_mut().params() {
        out.push((p.name, p.value.to_vec()));
    }
    out
}

fn same(what: &str, a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for ((name, x), (_, y)) in a.iter().zip(b) {
        assert!(x == y, "{what}: {name} differs");
    }
}

#[test]
fn a_set_written_by_ranks_reads_back_exactly_anywhere() {
    // fp16 and bf16 shards too: their pieces in F16/BF16, their rounding
    // drawn by global position, so rank-split training is the one process's.
    for dtype in [DataType::Fp32, DataType::Fp16, DataType::Bf16] {
        a_set_reads_back_exactly(dtype);
    }
}

fn a_set_reads_back_exactly(dtype: DataType) {
    let config = config(dtype);
    let table_opt = TableOptimizer::adam(0.05);
    let dense_opt = DenseOptimizerConfig::adam(0.01);
    let data = SyntheticData::new(SyntheticConfig::for_model(
        &config,
        DataGeneration::Random,
        3,
        5,
    ))
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let index = dir.path().join("model.safetensors.index.json");

    // A fresh model on ranks is the one process's model, exactly.
    let single = {
        let mut m = Dlrm::builder(config.clone())
            .optimizers(table_opt, dense_opt)
            .seed(9)
            .build()
            .unwrap();
        tensors(&mut m)
    };

    // Two ranks: built in place, two steps, saved together.
    let written = on_ranks(2, |comm| {
        let rank = comm.rank();
        let mut m = Dlrm::builder(config.clone())
            .optimizers(table_opt, dense_opt)
            .seed(9)
            .plan(plan_of_two(&config))
            .world(comm)
            .build()
            .unwrap();
        let fresh = tensors(&mut m);
        let be = Backend::Native(ember_dense::NativeBackend::new(1));
        for i in 0..2 {
            let b = data.batch(i, 16);
            let mine = b.select(8 * rank..8 * (rank + 1));
            m.train_step(&be, &mine, ExecMode::Strict).unwrap();
        }
        save_set(&mut m, dir.path(), None).unwrap();
        (fresh, tensors(&mut m))
    });
    same(&format!("{dtype} fresh on rank 0"), &written[0].0, &single);
    same("ranks agree", &written[0].1, &written[1].1);
    let want = &written[0].1;

    // In one process.
    let ckpt = Checkpoint::open(&index).unwrap();
    let mut m = ckpt
        .builder()
        .optimizers(table_opt, dense_opt)
        .build()
        .unwrap();
    same("read in one process", &tensors(&mut m), want);

    // On three ranks under another plan, each reading only its rows.
    let read = on_ranks(3, |comm| {
        let ckpt = Checkpoint::open(Path::new(&index)).unwrap();
        let mut m = (ckpt.builder().optimizers(table_opt, dense_opt))
            .plan(plan_of_three(&config))
            .world(comm)
            .build()
            .unwrap();
        tensors(&mut m)
    });
    for (r, got) in read.iter().enumerate() {
        same(&format!("read on rank {r} of 3"), got, want);
    }
}
