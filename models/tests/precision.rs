//! Tables below fp32 through a whole model: half-precision training saves
//! and resumes exactly, across plans; checkpoints keep each table's type
//! (safetensors F16/BF16/U8); fp32 checkpoints cast to fp16 and back; a
//! quantized checkpoint serves predictions close to its fp32 model's.

use ember_dense::{DenseOptimizerConfig, NativeBackend};
use ember_models::checkpoint::{quantize, save, table_weight_name};
use ember_models::{Backend, ExecMode, Model};
use ember_models::{
    Checkpoint, DataGeneration, Dlrm, DlrmConfig, InteractionType, SyntheticConfig, SyntheticData,
};
use ember_sharding::plan::{ShardingType, TablePlan};
use ember_sharding::ShardingPlan;
use ember_sparse::{DataType, TableOptimizer};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

fn config(dtype: DataType) -> DlrmConfig {
    let tables = DlrmConfig::criteo_tables(&[50, 70, 90], 8)
        .into_iter()
        .map(|t| t.with_data_type(dtype))
        .collect();
    DlrmConfig {
        tables,
        bottom_mlp: vec![3, 8],
        top_mlp: vec![6, 1],
        interaction: InteractionType::Dot,
    }
}

fn data(config: &DlrmConfig) -> SyntheticData {
    SyntheticData::new(SyntheticConfig::for_model(
        config,
        DataGeneration::Learnable,
        2,
        4,
    ))
    .unwrap()
}

const OPT: (TableOptimizer, DenseOptimizerConfig) = (
    TableOptimizer::Adam {
        lr: 0.05,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    },
    DenseOptimizerConfig::Sgd { lr: 0.1 },
);

/// Every table's rows as stored, and their optimizer state.
fn tables(model: &Dlrm) -> Vec<(Vec<u8>, Vec<f32>)> {
    (model.sparse_arch().unsharded().unwrap().tables().iter())
        .map(|t| (t.row_bytes().to_vec(), t.optimizer_state().to_vec()))
        .collect()
}

fn dtypes_in(path: &std::path::Path, config: &DlrmConfig) -> Vec<(Dtype, Vec<usize>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    (config.tables.iter())
        .map(|t| {
            let v = st.tensor(&table_weight_name(&t.name)).unwrap();
            (v.dtype(), v.shape().to_vec())
        })
        .collect()
}

#[test]
fn half_tables_save_in_their_type_and_resume_bit_for_bit() {
    let be = Backend::Native(NativeBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    for (dtype, stored) in [(DataType::Fp16, Dtype::F16), (DataType::Bf16, Dtype::BF16)] {
        let cfg = config(dtype);
        let data = data(&cfg);
        let mut model = Dlrm::builder(cfg.clone())
            .optimizers(OPT.0, OPT.1)
            .seed(11)
            .build()
            .unwrap();
        for i in 0..3 {
            model
                .train_step(&be, &data.batch(i, 16), ExecMode::Strict)
                .unwrap();
        }
        let path = dir.path().join(format!("{dtype}.safetensors"));
        save(&mut model, &path, None).unwrap();
        assert_eq!(
            dtypes_in(&path, &cfg),
            vec![
                (stored, vec![50, 8]),
                (stored, vec![70, 8]),
                (stored, vec![90, 8])
            ]
        );
        let ckpt = Checkpoint::open(&path).unwrap();
        assert_eq!(ckpt.config(), &cfg, "the config keeps each table's type");
        let mut resumed = ckpt.builder().optimizers(OPT.0, OPT.1).build().unwrap();
        assert_eq!(tables(&resumed), tables(&model));
        // The stochastic rounding goes on with the same draws.
        for i in 3..6 {
            let batch = data.batch(i, 16);
            let a = model
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            let b = resumed
                .train_step(&be, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            assert_eq!(a, b, "{dtype} step {i}");
        }
        assert_eq!(tables(&resumed), tables(&model), "{dtype}");
        // The draws follow the model's seed, which the file keeps.
        assert_eq!(resumed.sparse_arch().rounding_seed(), 11);
    }
}

#[test]
fn half_training_is_the_same_under_any_plan() {
    let be = Backend::Native(NativeBackend::new(1));
    let cfg = config(DataType::Fp16);
    let data = data(&cfg);
    for (kind, n) in [
        (ShardingType::TableWise, 2),
        (ShardingType::ColumnWise, 2),
        (ShardingType::DataParallel, 2),
    ] {
        let all: Vec<usize> = (0..n).collect();
        let plan = ShardingPlan {
            num_devices: n,
            tables: (cfg.tables.iter().enumerate())
                .map(|(i, t)| match kind {
                    ShardingType::TableWise => TablePlan::table_wise(t, i % n),
                    ShardingType::ColumnWise => TablePlan::column_wise(t, &all),
                    _ => TablePlan::data_parallel(t, n),
                })
                .collect(),
        };
        let mut sharded = Dlrm::builder(cfg.clone())
            .optimizers(OPT.0, OPT.1)
            .seed(3)
            .build()
            .unwrap();
        sharded.shard(Some(plan)).unwrap();
        let mut reference = Dlrm::builder(cfg.clone())
            .optimizers(OPT.0, OPT.1)
            .seed(3)
            .build()
            .unwrap();
        for i in 0..3 {
            let batch = data.batch(i, 16);
            reference.train_step(&be, &batch, ExecMode::Strict).unwrap();
            sharded.train_step(&be, &batch, ExecMode::Strict).unwrap();
        }
        // These plans keep each bag's sum whole, so the same fp32 updates
        // meet the same draws: the same bits.
        assert_eq!(tables(&sharded), tables(&reference), "{kind:?} on {n}");
    }
}

#[test]
fn fp32_checkpoints_cast_to_fp16_and_back() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(DataType::Fp32);
    let mut model = Dlrm::builder(cfg.clone())
        .optimizers(OPT.0, OPT.1)
        .seed(5)
        .build()
        .unwrap();
    let path = dir.path().join("fp32.safetensors");
    save(&mut model, &path, None).unwrap();

    let mut ckpt = Checkpoint::open(&path).unwrap();
    let cast = ckpt.cast_tables(DataType::Fp16);
    assert_eq!(cast.len(), 3);
    assert!(cast.iter().all(|(_, saved)| *saved == DataType::Fp32));
    let mut half = ckpt.builder().optimizers(OPT.0, OPT.1).build().unwrap();
    let fp32 = model.sparse_arch().unsharded().unwrap();
    let fp16 = half.sparse_arch().unsharded().unwrap();
    for (a, b) in fp32.tables().iter().zip(fp16.tables()) {
        assert_eq!(b.data_type(), DataType::Fp16);
        let mut row = vec![0f32; 8];
        for id in 0..a.num_embeddings() {
            b.read_row(id, &mut row);
            let nearest: Vec<f32> = a
                .row(id)
                .iter()
                .map(|&x| half::f16::from_f32(x).to_f32())
                .collect();
            assert_eq!(row, nearest, "table {} row {id}", a.name());
        }
        // The optimizer state stays fp32 and carries over.
        assert_eq!(a.optimizer_state(), b.optimizer_state());
    }
    drop((fp32, fp16));
    // Saved as fp16, then cast back to fp32: the fp16 values, exactly.
    let path16 = dir.path().join("fp16.safetensors");
    save(&mut half, &path16, None).unwrap();
    let mut back = Checkpoint::open(&path16).unwrap();
    assert_eq!(back.cast_tables(DataType::Fp32).len(), 3);
    let full = back.builder().optimizers(OPT.0, OPT.1).build().unwrap();
    let (full, half) = (
        full.sparse_arch().unsharded().unwrap(),
        half.sparse_arch().unsharded().unwrap(),
    );
    let mut row = vec![0f32; 8];
    for (a, b) in full.tables().iter().zip(half.tables()) {
        for id in 0..a.num_embeddings() {
            b.read_row(id, &mut row);
            assert_eq!(a.row(id), &row[..]);
        }
    }
}

#[test]
fn quantized_checkpoints_serve_close_to_their_fp32_model() {
    let be = Backend::Native(NativeBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(DataType::Fp32);
    let data = data(&cfg);
    let mut model = Dlrm::builder(cfg.clone())
        .optimizers(OPT.0, OPT.1)
        .seed(9)
        .build()
        .unwrap();
    for i in 0..20 {
        model
            .train_step(&be, &data.batch(i, 32), ExecMode::Strict)
            .unwrap();
    }
    let path = dir.path().join("fp32.safetensors");
    save(&mut model, &path, None).unwrap();
    let test = data.batch(1000, 256);
    let want = model.predict(&be, &test).unwrap().to_vec();
    for (dtype, row_bytes, tolerance) in [
        (DataType::Int8, 12, 0.01),
        (DataType::Fp8, 12, 0.05),
        (DataType::Int4, 8, 0.1),
        (DataType::Mxfp4, 5, 0.2),
    ] {
        let out = dir.path().join(format!("{dtype}.safetensors"));
        let summary = quantize(&path, dtype, &out).unwrap();
        assert_eq!(summary.table_bytes_after, (50 + 70 + 90) * row_bytes);
        assert_eq!(
            dtypes_in(&out, &cfg)[0],
            (Dtype::U8, vec![50, row_bytes as usize])
        );
        let ckpt = Checkpoint::open(&out).unwrap();
        assert_eq!(ckpt.config().tables[0].data_type, dtype);
        // Quantized tables do not train.
        assert!(ckpt.builder().optimizers(OPT.0, OPT.1).build().is_err());
        let mut served = ckpt.inference_model().unwrap();
        let got = served.predict(&be, &test).unwrap();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst > 0.0 && worst < tolerance,
            "{dtype}: logits differ by up to {worst}"
        );
    }
    // The input is never overwritten.
    let err = quantize(&path, DataType::Int8, &path)
        .unwrap_err()
        .to_string();
    assert!(err.contains("the output is the input"), "{err}");
}
