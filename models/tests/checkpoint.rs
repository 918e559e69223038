//! Checkpoints: exact round trips, exact resumption, TorchRec-named files
//! without Ember metadata, and errors that name the tensor.

mod common;
use common::weights;

use ember_models::{Backend, ExecMode, Model};
use std::collections::HashMap;
use std::path::Path;

use ember_dense::{DenseOptimizerConfig, HasParams, NativeBackend};
use ember_models::checkpoint::{save, table_weight_name};
use ember_models::{
    Checkpoint, DataGeneration, Dlrm, DlrmConfig, InteractionType, SyntheticConfig, SyntheticData,
    TrainState,
};
use ember_sparse::TableOptimizer;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

fn config(interaction: InteractionType, tables: usize) -> DlrmConfig {
    let rows: Vec<usize> = (0..tables).map(|t| 5 + t).collect();
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&rows, 4),
        bottom_mlp: vec![3, 6, 4],
        top_mlp: vec![5, 3, 1],
        interaction,
    }
}

fn data(config: &DlrmConfig) -> SyntheticData {
    SyntheticData::new(SyntheticConfig::for_model(
        config,
        DataGeneration::Learnable,
        3,
        4,
    ))
    .unwrap()
}

fn optimizers() -> [(TableOptimizer, DenseOptimizerConfig); 3] {
    [
        (
            TableOptimizer::rowwise_adagrad(0.1),
            DenseOptimizerConfig::adagrad(0.1),
        ),
        (TableOptimizer::adam(0.01), DenseOptimizerConfig::adam(0.01)),
        (TableOptimizer::adagrad(0.1), DenseOptimizerConfig::sgd(0.1)),
    ]
}

#[test]
fn save_load_predicts_identically_and_resumes_exactly() {
    let be = Backend::Native(NativeBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    for interaction in [
        InteractionType::Dot,
        InteractionType::Dcn { layers: 2, rank: 3 },
    ] {
        for (table_opt, dense_opt) in optimizers() {
            let cfg = config(interaction, 3);
            let data = data(&cfg);
            let mut model = Dlrm::builder(cfg.clone())
                .optimizers(table_opt, dense_opt)
                .seed(7)
                .build()
                .unwrap();
            for i in 0..4 {
                model
                    .train_step(&be, &data.batch(i, 16), ExecMode::Strict)
                    .unwrap();
            }
            let path = dir.path().join("model.safetensors");
            let state = TrainState {
                epoch: 1,
                batches_in_epoch: 4,
                steps: 4,
                batch_size: 16,
                shuffle_seed: Some(3),
                ..Default::default()
            };
            save(&mut model, &path, Some(&state)).unwrap();
            let ckpt = Checkpoint::open(&path).unwrap();
            assert_eq!(ckpt.config(), &cfg);
            assert_eq!(ckpt.train_state(), Some(&state));
            assert_eq!(ckpt.table_optimizer(), Some(table_opt));
            let test = data.batch(100, 32);
            let want = model.predict(&be, &test).unwrap().to_vec();
            let mut served = ckpt.inference_model().unwrap();
            assert_eq!(served.predict(&be, &test).unwrap(), &want[..]);

            // Resuming: the loaded model continues exactly as the original.
            let mut resumed = ckpt
                .builder()
                .optimizers(table_opt, dense_opt)
                .build()
                .unwrap();
            assert_eq!(weights(&mut resumed), weights(&mut model));
            for i in 4..7 {
                let batch = data.batch(i, 16);
                let a = model
                    .train_step(&be, &batch, ExecMode::Strict)
                    .unwrap()
                    .loss;
                let b = resumed
                    .train_step(&be, &batch, ExecMode::Strict)
                    .unwrap()
                    .loss;
                assert_eq!(a, b, "{interaction:?} {table_opt:?} step {i}");
            }
            assert_eq!(weights(&mut resumed), weights(&mut model));
        }
    }
}

/// Name, dtype, shape and bytes of each tensor of a file.
type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

/// Rewrites `src` into `dst` keeping only TorchRec's model tensors (no
/// metadata, no optimizer state), with `edit` applied to the tensor list.
fn rewrite(src: &Path, dst: &Path, metadata: bool, edit: impl FnOnce(&mut Tensors)) {
    let bytes = std::fs::read(src).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Tensors = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| metadata || !n.starts_with("optimizer."))
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = if metadata {
        let (_, m) = SafeTensors::read_metadata(&bytes).unwrap();
        m.metadata().clone()
    } else {
        None
    };
    safetensors::serialize_to_file(views, meta.map(|m: HashMap<_, _>| m), dst).unwrap();
}

#[test]
fn torchrec_named_files_without_metadata_load_with_the_inferred_architecture() {
    let be = Backend::Native(NativeBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    // 12 tables: the names sort t_cat_10 before t_cat_2, the features must not.
    for interaction in [
        InteractionType::Dot,
        InteractionType::Dcn { layers: 3, rank: 2 },
    ] {
        let cfg = config(interaction, 12);
        let mut model = Dlrm::builder(cfg.clone())
            .optimizers(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
            .seed(3)
            .build()
            .unwrap();
        let ours = dir.path().join("ours.safetensors");
        save(&mut model, &ours, None).unwrap();
        let torchrec = dir.path().join("torchrec.safetensors");
        rewrite(&ours, &torchrec, false, |_| {});
        let ckpt = Checkpoint::open(&torchrec).unwrap();
        assert_eq!(ckpt.config(), &cfg);
        assert_eq!(ckpt.table_optimizer(), None);
        let test = data(&cfg).batch(0, 8);
        let want = model.predict(&be, &test).unwrap().to_vec();
        assert_eq!(
            ckpt.inference_model().unwrap().predict(&be, &test).unwrap(),
            &want[..]
        );
    }
}

#[test]
fn bad_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(InteractionType::Dot, 3);
    let mut model = Dlrm::builder(cfg)
        .optimizers(
            TableOptimizer::rowwise_adagrad(0.1),
            DenseOptimizerConfig::sgd(0.1),
        )
        .seed(3)
        .build()
        .unwrap();
    let ours = dir.path().join("ours.safetensors");
    save(&mut model, &ours, None).unwrap();
    let bad = dir.path().join("bad.safetensors");
    let error = |edit: &dyn Fn(&mut Tensors)| {
        rewrite(&ours, &bad, true, edit);
        Checkpoint::open(&bad).err().expect("must fail").to_string()
    };
    let t1 = table_weight_name("t_cat_1");
    let e = error(&|t| t.retain(|(n, ..)| *n != t1));
    assert!(e.contains(&t1) && e.contains("missing"), "{e}");

    let bias = "over_arch.model.1.bias";
    let e = error(&|t| {
        let x = t.iter_mut().find(|x| x.0 == bias).unwrap();
        x.2 = vec![1, 1];
    });
    assert!(e.contains(bias) && e.contains("shape [1, 1]"), "{e}");

    let w = "dense_arch.model._mlp.0._linear.weight";
    let e = error(&|t| {
        let x = t.iter_mut().find(|x| x.0 == w).unwrap();
        x.1 = Dtype::I32;
    });
    assert!(e.contains(w) && e.contains("I32"), "{e}");

    // The optimizer state is checked when a model that uses it is built.
    let m1 = format!(
        "optimizer.{}",
        table_weight_name("t_cat_0").replace(".weight", ".momentum1")
    );
    rewrite(&ours, &bad, true, |t| t.retain(|(n, ..)| *n != m1));
    let ckpt = Checkpoint::open(&bad).unwrap();
    let e = ckpt
        .builder()
        .optimizers(
            TableOptimizer::rowwise_adagrad(0.1),
            DenseOptimizerConfig::sgd(0.1),
        )
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&m1), "{e}");

    std::fs::write(&bad, b"\x08\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    assert!(Checkpoint::open(&bad)
        .err()
        .unwrap()
        .to_string()
        .contains("bad.safetensors"));
    let truncated = std::fs::read(&ours).unwrap();
    std::fs::write(&bad, &truncated[..truncated.len() / 2]).unwrap();
    let e = Checkpoint::open(&bad).err().unwrap().to_string();
    assert!(e.contains("bad.safetensors"), "{e}");
}

#[test]
fn bytes_in_memory_read_as_the_file_does() {
    let be = Backend::Native(NativeBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(InteractionType::Dcn { layers: 2, rank: 3 }, 3);
    let data = data(&cfg);
    let (table_opt, dense_opt) = (TableOptimizer::adam(0.01), DenseOptimizerConfig::adam(0.01));
    let mut model = Dlrm::builder(cfg.clone())
        .optimizers(table_opt, dense_opt)
        .seed(11)
        .build()
        .unwrap();
    for i in 0..3 {
        model
            .train_step(&be, &data.batch(i, 16), ExecMode::Strict)
            .unwrap();
    }
    let path = dir.path().join("model.safetensors");
    let state = TrainState {
        steps: 3,
        batch_size: 16,
        ..Default::default()
    };
    save(&mut model, &path, Some(&state)).unwrap();
    let bytes = std::fs::read(&path).unwrap();

    let file = Checkpoint::open(&path).unwrap();
    let memory = Checkpoint::from_bytes(bytes.clone(), "in-memory model").unwrap();
    assert_eq!(memory.path(), Path::new("in-memory model"));
    assert_eq!(memory.config(), file.config());
    assert_eq!(memory.train_state(), Some(&state));
    assert_eq!(memory.table_optimizer(), file.table_optimizer());
    let test = data.batch(60, 32);
    let bits = |ckpt: &Checkpoint| -> Vec<u32> {
        let mut m = ckpt.inference_model().unwrap();
        let logits = m.predict(&be, &test).unwrap().to_vec();
        logits.iter().map(|x| x.to_bits()).collect()
    };
    assert_eq!(bits(&memory), bits(&file));
    // Resuming from memory continues exactly as from the file.
    let mut a = file
        .builder()
        .optimizers(table_opt, dense_opt)
        .build()
        .unwrap();
    let mut b = memory
        .builder()
        .optimizers(table_opt, dense_opt)
        .build()
        .unwrap();
    assert_eq!(weights(&mut a), weights(&mut b));

    for garbage in [
        b"not a safetensors file".to_vec(),
        bytes[..bytes.len() / 2].to_vec(),
    ] {
        let e = Checkpoint::from_bytes(garbage, "upload-42")
            .err()
            .expect("must fail");
        assert!(e.to_string().contains("upload-42"), "{e}");
    }
}

#[test]
fn checkpoints_move_between_plans_and_device_counts() {
    use ember_sharding::plan::{ShardingType, TablePlan};
    use ember_sharding::ShardingPlan;
    let be = Backend::Native(NativeBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(InteractionType::Dot, 4);
    let data = data(&cfg);
    let plan = |kind: ShardingType, n: usize| {
        let all: Vec<usize> = (0..n).collect();
        let tables = (cfg.tables.iter().enumerate())
            .map(|(i, t)| match kind {
                ShardingType::RowWise => TablePlan::row_wise(t, &all, kind),
                ShardingType::DataParallel => TablePlan::data_parallel(t, n),
                _ => TablePlan::table_wise(t, i % n),
            })
            .collect();
        ShardingPlan {
            num_devices: n,
            tables,
        }
    };
    let (table_opt, dense_opt) = (TableOptimizer::adam(0.01), DenseOptimizerConfig::adam(0.01));
    let mut trained = Dlrm::builder(cfg.clone())
        .optimizers(table_opt, dense_opt)
        .seed(5)
        .build()
        .unwrap();
    trained.shard(Some(plan(ShardingType::RowWise, 2))).unwrap();
    for i in 0..3 {
        trained
            .train_step(&be, &data.batch(i, 16), ExecMode::Strict)
            .unwrap();
    }
    let a = dir.path().join("a.safetensors");
    save(&mut trained, &a, None).unwrap();
    let test = data.batch(50, 24);
    let sharded_logits = trained.predict(&be, &test).unwrap().to_vec();

    let ckpt = Checkpoint::open(&a).unwrap();
    let mut unsharded = ckpt
        .builder()
        .optimizers(table_opt, dense_opt)
        .build()
        .unwrap();
    let want = unsharded.predict(&be, &test).unwrap().to_vec();
    // Row-wise partial sums differ from one sum only in rounding.
    for (x, y) in sharded_logits.iter().zip(&want) {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
    }
    // What every plan below must reproduce: the file's contents, and the
    // loss of a step from the file's model.
    let saved = read(&a);
    let batch = data.batch(9, 16);
    let fresh = (ckpt
        .builder()
        .optimizers(table_opt, dense_opt)
        .build()
        .unwrap())
    .train_step(&be, &batch, ExecMode::Strict)
    .unwrap()
    .loss;
    for (kind, n) in [
        (ShardingType::TableWise, 3),
        (ShardingType::DataParallel, 2),
        (ShardingType::TableWise, 1),
    ] {
        let mut m = ckpt
            .builder()
            .optimizers(table_opt, dense_opt)
            .build()
            .unwrap();
        m.shard(Some(plan(kind, n))).unwrap();
        assert_eq!(m.predict(&be, &test).unwrap(), &want[..], "{kind:?} on {n}");
        // Saved again from another plan: the same file contents.
        let b = dir.path().join("b.safetensors");
        save(&mut m, &b, None).unwrap();
        assert_eq!(read(&b), saved);
        // And training goes on identically under the new plan.
        let l1 = m.train_step(&be, &batch, ExecMode::Strict).unwrap().loss;
        assert!((l1 - fresh).abs() <= 1e-6, "{l1} vs {fresh}");
    }
}

/// A safetensors file's tensors, sorted by name.
fn read(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<u8>)> = (st.tensors().into_iter())
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect();
    v.sort();
    v
}

/// The metadata of safetensors `bytes`.
fn st_meta(bytes: &[u8]) -> std::collections::HashMap<String, String> {
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    meta.metadata().clone().unwrap()
}

/// The byte range of tensor `name`'s data in safetensors `bytes`.
fn data_range(bytes: &[u8], name: &str) -> std::ops::Range<usize> {
    let (header, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let (start, end) = meta.info(name).unwrap().data_offsets;
    (8 + header + start)..(8 + header + end)
}

#[test]
fn corrupt_or_diverged_checkpoints_are_refused_with_the_tensor_named() {
    let be = Backend::Native(NativeBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(InteractionType::Dot, 3);
    let opt = (
        TableOptimizer::rowwise_adagrad(0.1),
        DenseOptimizerConfig::adagrad(0.1),
    );
    let mut model = Dlrm::builder(cfg.clone())
        .optimizers(opt.0, opt.1)
        .seed(3)
        .build()
        .unwrap();
    let batch = data(&cfg).batch(0, 8);
    model.train_step(&be, &batch, ExecMode::Strict).unwrap();
    let ours = dir.path().join("ours.safetensors");
    save(&mut model, &ours, None).unwrap();
    let good = std::fs::read(&ours).unwrap();
    let t1 = table_weight_name("t_cat_1");
    let load_error = |path: &Path| match Checkpoint::open(path) {
        Ok(ckpt) => (ckpt.inference_model().err()).map_or(String::new(), |e| e.to_string()),
        Err(e) => e.to_string(),
    };

    // One flipped bit in a table's rows: the checksum names the tensor.
    let bad = dir.path().join("bad.safetensors");
    let mut flipped = good.clone();
    flipped[data_range(&good, &t1).start + 5] ^= 0x10;
    std::fs::write(&bad, &flipped).unwrap();
    let e = load_error(&bad);
    assert!(e.contains(&t1) && e.contains("checksum"), "{e}");
    // ... and in a dense parameter.
    let w = "over_arch.model.1.bias";
    let mut flipped = good.clone();
    flipped[data_range(&good, w).start] ^= 1;
    std::fs::write(&bad, &flipped).unwrap();
    let e = load_error(&bad);
    assert!(e.contains(w) && e.contains("checksum"), "{e}");

    // A file without checksums (TorchRec's) loads, as it is: unverified.
    let bytes = std::fs::read(&ours).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = meta.metadata().clone().unwrap();
    assert!(meta.remove("ember.crc32").is_some());
    let plain = dir.path().join("plain.safetensors");
    safetensors::serialize_to_file(st.tensors(), Some(meta), &plain).unwrap();
    let mut served = Checkpoint::open(&plain).unwrap().inference_model().unwrap();
    let want = model.predict(&be, &batch).unwrap().to_vec();
    assert_eq!(served.predict(&be, &batch).unwrap(), &want[..]);

    // A corrupted name in the metadata must not pass for a file without
    // checksums, nor for one whose metadata has no checksum: the checksums
    // under another key, or the metadata's own checksum under another name,
    // with a flipped row or step beside them (found by the fuzz test).
    let rewritten = |edit: &dyn Fn(&mut std::collections::HashMap<String, String>)| {
        let mut meta = st_meta(&good);
        edit(&mut meta);
        let path = dir.path().join("edited.safetensors");
        let st = SafeTensors::deserialize(&good).unwrap();
        safetensors::serialize_to_file(st.tensors(), Some(meta), &path).unwrap();
        path
    };
    let renamed = rewritten(&|meta| {
        let sums = meta.remove("ember.crc32").unwrap();
        meta.insert("ember.crc33".into(), sums);
    });
    let mut flipped = std::fs::read(&renamed).unwrap();
    let at = data_range(&flipped, &t1).start;
    flipped[at] ^= 1;
    std::fs::write(&renamed, &flipped).unwrap();
    let e = load_error(&renamed);
    assert!(e.contains("ember.crc33") && e.contains("corrupt"), "{e}");
    let unsummed = rewritten(&|meta| {
        let sums = meta["ember.crc32"].replace("\"__metadata__\"", "\"__metadatb__\"");
        meta.insert("ember.crc32".into(), sums);
        let step: u64 = meta["ember.sparse_step"].parse().unwrap();
        meta.insert("ember.sparse_step".into(), (step + 1).to_string());
    });
    let e = load_error(&unsummed);
    assert!(e.contains("(__metadata__)") && e.contains("corrupt"), "{e}");

    // Values no training produces: NaN rows, a NaN parameter, negative sums
    // of squares; each refused with the tensor, row and column.
    let fresh = || {
        Dlrm::builder(cfg.clone())
            .optimizers(opt.0, opt.1)
            .seed(3)
            .build()
            .unwrap()
    };
    let tables = |m: &mut Dlrm| {
        let ebc = m.sparse_arch_mut().local_mut().unwrap();
        ebc.tables_mut()[1].weights_mut()[2 * 4 + 3] = f32::NAN;
    };
    let mut m = fresh();
    tables(&mut m);
    save(&mut m, &bad, None).unwrap();
    let e = load_error(&bad);
    assert!(
        e.contains(&t1) && e.contains("row 2, column 3 holds NaN"),
        "{e}"
    );

    let mut m = fresh();
    for p in m.dense_arch_mut().params() {
        if p.name == w {
            p.value[0] = f32::INFINITY;
        }
    }
    save(&mut m, &bad, None).unwrap();
    let e = load_error(&bad);
    assert!(e.contains(w) && e.contains("infinite"), "{e}");

    let mut m = fresh();
    m.train_step(&be, &batch, ExecMode::Strict).unwrap();
    let ebc = m.sparse_arch_mut().local_mut().unwrap();
    ebc.tables_mut()[0].optimizer_state_mut()[4] = -1.0;
    save(&mut m, &bad, None).unwrap();
    let ckpt = Checkpoint::open(&bad).unwrap();
    let e = ckpt
        .builder()
        .optimizers(opt.0, opt.1)
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("t_cat_0.momentum1") && e.contains("row 4, column 0 holds a negative"),
        "{e}"
    );
    // Serving needs no optimizer state: it still loads.
    assert!(ckpt.inference_model().is_ok());
}

#[cfg(unix)]
#[test]
fn checkpoints_are_written_with_the_mode_of_other_outputs_and_no_leftover() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(InteractionType::Dot, 2);
    let mut model = Dlrm::builder(cfg)
        .optimizers(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
        .seed(1)
        .build()
        .unwrap();
    let path = dir.path().join("model.safetensors");
    save(&mut model, &path, None).unwrap();
    let other = dir.path().join("other");
    std::fs::write(&other, b"").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), mode(&other));
    let names: Vec<_> = (std::fs::read_dir(dir.path()).unwrap())
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn an_embedding_collection_saves_under_torchrecs_names_and_resumes_exactly() {
    use ember_models::checkpoint::{StateDict, StateFile};
    use ember_sparse::{DataType, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor};
    let dir = tempfile::tempdir().unwrap();
    let configs = vec![
        EmbeddingConfig::new("items", 50, 4, &["history", "candidate"]),
        EmbeddingConfig::new("actions", 5, 4, &["action"]).with_data_type(DataType::Bf16),
    ];
    let opt = TableOptimizer::adam(0.01);
    let mut trained = EmbeddingCollection::new(configs.clone(), opt, 1).unwrap();
    let keys: Vec<String> = ["history", "candidate", "action"]
        .map(String::from)
        .to_vec();
    let batch = |ids: Vec<i64>| {
        KeyedJaggedTensor::from_lengths(keys.clone(), ids, &[3, 1, 3], None).unwrap()
    };
    let step = |ec: &mut EmbeddingCollection, ids: Vec<i64>| {
        let kjt = batch(ids);
        let rows = ec.forward(&kjt).unwrap().values().len();
        let grad: Vec<f32> = (0..rows).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        ec.backward_update(&kjt, &grad).unwrap();
    };
    step(&mut trained, vec![1, 2, 1, 3, 0, 4, 4]);
    let mut state = StateDict::new();
    state.add_embedding_collection("sequence.", &trained);
    let path = dir.path().join("state.safetensors");
    state.save(&path, None).unwrap();

    let names: Vec<String> = read(&path).into_iter().map(|(n, _)| n).collect();
    for want in [
        "sequence.embeddings.items.weight",
        "sequence.embeddings.actions.weight",
        "optimizer.sequence.embeddings.items.momentum1",
        "optimizer.sequence.embeddings.items.momentum2",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    // The same seed, as a resumed run has: bf16 rows round stochastically
    // by it (the rows and Adam's moments come from the file).
    let mut loaded = EmbeddingCollection::new(configs, opt, 1).unwrap();
    assert_ne!(
        trained.forward(&batch(vec![1; 7])),
        loaded.forward(&batch(vec![1; 7]))
    );
    StateFile::open(&path)
        .unwrap()
        .load_embedding_collection("sequence.", &mut loaded)
        .unwrap();
    assert_eq!(loaded.step(), 1);
    // The next step is the same from the saved state as from the live one.
    step(&mut trained, vec![1, 9, 2, 3, 1, 1, 0]);
    step(&mut loaded, vec![1, 9, 2, 3, 1, 1, 0]);
    let all = batch((0..7).map(|i| i % 5).collect());
    assert_eq!(
        trained.forward(&all).unwrap(),
        loaded.forward(&all).unwrap()
    );
}

/// A user's state with a key-value table: its map is saved beside its rows
/// (keyed by the table's full name), loads whole, and the next steps are
/// the live ones', admissions and evictions included.
#[test]
fn a_key_value_table_in_a_users_state_saves_its_map_and_trains_on() {
    use ember_models::checkpoint::{StateDict, StateFile};
    use ember_sparse::{EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, KvConfig};
    let dir = tempfile::tempdir().unwrap();
    let configs = vec![EmbeddingConfig {
        kv: Some(KvConfig {
            eviction_window: Some(2),
            ..KvConfig::default()
        }),
        ..EmbeddingConfig::new("items", 6, 4, &["history"])
    }];
    let opt = TableOptimizer::adagrad(0.1);
    let batch = |ids: Vec<i64>| {
        let keys = vec!["history".to_string()];
        KeyedJaggedTensor::from_lengths(keys, ids, &[2, 2], None).unwrap()
    };
    let step = |ec: &mut EmbeddingCollection, ids: Vec<i64>| {
        let kjt = batch(ids);
        ec.prefetch(&kjt).unwrap();
        let rows = ec.forward(&kjt).unwrap().values().len();
        let grad: Vec<f32> = (0..rows).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        ec.backward_update(&kjt, &grad).unwrap();
    };
    let mut trained = EmbeddingCollection::new(configs.clone(), opt, 1).unwrap();
    for k in 0..4 {
        step(&mut trained, vec![k * 100, 7, 1 << 40, k + 50]);
    }
    let mut state = StateDict::new();
    state.add_embedding_collection("user.", &trained);
    let path = dir.path().join("state.safetensors");
    state.save(&path, None).unwrap();
    let names: Vec<String> = read(&path).into_iter().map(|(n, _)| n).collect();
    assert!(
        names.iter().any(|n| n == "user.embeddings.items.kv.ids"),
        "{names:?}"
    );
    let mut loaded = EmbeddingCollection::new(configs, opt, 1).unwrap();
    StateFile::open(&path)
        .unwrap()
        .load_embedding_collection("user.", &mut loaded)
        .unwrap();
    let map = |ec: &EmbeddingCollection| ec.tables()[0].kv_state().unwrap();
    assert_eq!(map(&loaded), map(&trained));
    for k in 4..7 {
        step(&mut trained, vec![k * 100, 7, 3, k + 50]);
        step(&mut loaded, vec![k * 100, 7, 3, k + 50]);
    }
    assert_eq!(map(&loaded), map(&trained));
    assert!(map(&trained).position.stats.evicted > 0);
    assert_eq!(trained.tables()[0].weights(), loaded.tables()[0].weights());
    assert_eq!(
        trained.tables()[0].optimizer_state(),
        loaded.tables()[0].optimizer_state()
    );
}

/// TorchRec's own `EmbeddingCollection` (its state_dict, a batch and its
/// forward), written by scripts/torchrec_sequence_fixture.py: Ember's reads
/// the same tensors under the same names and returns the same rows.
#[test]
fn torchrecs_embedding_collection_loads_and_looks_up_the_same() {
    use ember_models::checkpoint::StateFile;
    use ember_sparse::{EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor};
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/torchrec_embedding_collection.safetensors");
    let file = StateFile::open(&path).unwrap();
    let configs = vec![
        EmbeddingConfig::new("t_items", 50, 4, &["history", "candidate"]),
        EmbeddingConfig::new("t_actions", 5, 4, &["action"]),
    ];
    let mut ec = EmbeddingCollection::new(configs, TableOptimizer::None, 1).unwrap();
    file.load_embedding_collection("", &mut ec).unwrap();
    let ints = |name: &str, len| -> Vec<i64> {
        let v = file.tensor(name, &[len]).unwrap();
        v.iter().map(|&x| x as i64).collect()
    };
    let keys = ["history", "candidate", "action"]
        .map(String::from)
        .to_vec();
    let kjt = KeyedJaggedTensor::from_lengths(
        keys.clone(),
        ints("batch.values", 11),
        &ints("batch.lengths", 9),
        None,
    )
    .unwrap();
    let out = ec.forward(&kjt).unwrap();
    for key in &keys {
        let (rows, _) = out.feature(key).unwrap();
        let want = file
            .tensor(&format!("output.{key}"), &[rows.len() / 4, 4])
            .unwrap();
        assert_eq!(rows, &want[..], "{key}");
    }
}
