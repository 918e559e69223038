//! Outputs that are never silently wrong (issue "trustworthy outputs"):
//! each test here reproduces a way Ember once said "done" while its result
//! was wrong, mixed or lost, through the binary as a user runs it, or
//! through the library as a user's program calls it.

mod common;

use ember_models::Model;
use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, Float32Array, Int64Array, Int8Array, RecordBatch};
use common::{ember, ember_fails, ember_stderr, json, names, predictions, s, synthetic, ARCH};
use ember::dataloader::{DatasetSpec, DenseTransform, IdTransform, Loader, LoaderConfig};
use ember::dense::{DenseOptimizerConfig, HasParams};
use ember::models::{
    Backend, Checkpoint, Dlrm, DlrmConfig, FitOptions, InteractionType, TrainState, Trainer,
    TrainerConfig,
};
use ember::sparse::TableOptimizer;

/// Trains `ARCH` on `data` for one epoch into `ckpt`, evaluating on `eval`.
fn train(data: &str, eval: &str, ckpt: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "train",
        "--data",
        data,
        "--eval-data",
        eval,
        "--checkpoint-dir",
        s(ckpt),
        "--json",
    ];
    args.extend_from_slice(ARCH);
    args.extend_from_slice(extra);
    json(&args)
}

/// The architecture `ARCH` gives, for checkpoints made by the library.
fn arch() -> DlrmConfig {
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[100; 26], 4),
        bottom_mlp: vec![13, 8, 4],
        top_mlp: vec![8, 1],
        interaction: InteractionType::Dot,
    }
}

fn new_model() -> Dlrm {
    let opt = TableOptimizer::rowwise_adagrad(0.1);
    Dlrm::builder(arch())
        .optimizers(opt, DenseOptimizerConfig::sgd(0.1))
        .seed(7)
        .build()
        .unwrap()
}

#[test]
fn eval_and_predict_read_inputs_as_the_checkpoint_was_trained() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "4000", "0");
    let eval_data = synthetic(dir.path(), "eval", "1000", "1");
    let ckpt = dir.path().join("ckpt");
    let transforms = ["--dense-transform", "log-plus3", "--id-transform", "hash"];
    let trained = train(&data, &eval_data, &ckpt, &transforms);

    // No flags: the checkpoint's transforms, so training's own metrics.
    let e = json(&[
        "eval",
        "--checkpoint",
        s(&ckpt),
        "--data",
        &eval_data,
        "--json",
    ]);
    assert_eq!(e["auc"], trained["eval"]["auc"]);
    // The library's load path gives the same spec.
    let spec = Checkpoint::open(&ckpt).unwrap().input_spec();
    assert_eq!(
        (spec.dense_transform, spec.id_transform),
        (DenseTransform::LogPlus3, IdTransform::Hash)
    );
    // A flag that disagrees is refused with both values named; one that
    // agrees is accepted.
    let base = ["eval", "--checkpoint", s(&ckpt), "--data", &eval_data];
    let err = ember_fails(&[&base[..], &["--dense-transform", "log1p"]].concat());
    assert!(err.contains("log1p") && err.contains("log-plus3"), "{err}");
    let err = ember_fails(&[&base[..], &["--id-transform", "modulo"]].concat());
    assert!(err.contains("modulo") && err.contains("hash"), "{err}");
    let agreed = json(&[&base[..], &["--dense-transform", "log-plus3", "--json"]].concat());
    assert_eq!(agreed["auc"], e["auc"]);

    // predict reads as eval does: the same logits as the library's model
    // on batches read with the recorded spec.
    let out = dir.path().join("p.parquet");
    ember(&[
        "predict",
        "--checkpoint",
        s(&ckpt),
        "--data",
        &eval_data,
        "--output",
        s(&out),
    ]);
    let ckpt = Checkpoint::open(&ckpt).unwrap();
    let mut model = ckpt.inference_model().unwrap();
    let loader = ckpt.loader(&[eval_data.into()], 1000).unwrap();
    let batch = loader.epoch(0, 0).next().unwrap().unwrap();
    let be = Backend::native();
    let want = model.predict(&be, &batch).unwrap().to_vec();
    assert_eq!(predictions(&out).0, want);
}

#[test]
fn a_diverged_checkpoint_is_an_error_not_nan_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let eval_data = synthetic(dir.path(), "eval", "1000", "1");
    // Finite weights whose products overflow: a diverged model.
    let mut model = new_model();
    for p in model.dense_arch_mut().params() {
        p.value.iter_mut().for_each(|w| *w = 1e30);
    }
    let ckpt = dir.path().join("model.safetensors");
    ember::models::checkpoint::save(&mut model, &ckpt, None).unwrap();
    let err = ember_fails(&["eval", "--checkpoint", s(&ckpt), "--data", &eval_data]);
    assert!(
        err.contains("1000 of 1000 model outputs are not finite") && err.contains("row 0"),
        "{err}"
    );
    assert!(err.contains(s(&ckpt)), "{err}");
    let out = dir.path().join("p.parquet");
    let err = ember_fails(&[
        "predict",
        "--checkpoint",
        s(&ckpt),
        "--data",
        &eval_data,
        "--output",
        s(&out),
    ]);
    assert!(
        err.contains("not finite") && err.contains("nothing written"),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(!out.exists() && left.len() == 2, "{left:?}");
}

/// Writes a Parquet file of columns `y` (int8 label, when given), `x`
/// (float) and `c` (int64 ids).
fn write_small(path: &Path, label: Option<&[i8]>, x: &[f32], c: &[i64]) {
    let mut columns: Vec<(&str, ArrayRef)> = Vec::new();
    if let Some(y) = label {
        columns.push(("y", Arc::new(Int8Array::from(y.to_vec()))));
    }
    columns.push(("x", Arc::new(Float32Array::from(x.to_vec()))));
    columns.push(("c", Arc::new(Int64Array::from(c.to_vec()))));
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

const SMALL_SPEC: &str = r#"{"label": "y", "dense": [{"column": "x"}], "dense_transform": "identity",
    "sparse": [{"column": "c"}],
    "tables": [{"name": "t_c", "num_embeddings": 50, "embedding_dim": 4, "feature_names": ["c"]}]}"#;

#[test]
fn nan_dense_values_are_refused_under_every_transform() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("nan.parquet");
    write_small(
        &file,
        Some(&[0, 1, 0, 1]),
        &[0.5, 1.0, f32::NAN, 2.0],
        &[1, 2, 3, 4],
    );
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, SMALL_SPEC).unwrap();
    for t in ["log1p", "log-plus3", "identity"] {
        let err = ember_fails(&[
            "bench",
            "loader",
            "--data",
            s(&file),
            "--dataset-spec",
            s(&spec),
            "--dense-transform",
            t,
            "--mini-batch-size",
            "4",
        ]);
        assert!(
            err.contains(s(&file))
                && err.contains("'x'")
                && err.contains("row 2")
                && err.contains("NaN"),
            "{t}: {err}"
        );
    }
}

#[test]
fn predict_reads_unlabelled_data_and_eval_says_it_needs_labels() {
    let dir = tempfile::tempdir().unwrap();
    let (x, c): (Vec<f32>, Vec<i64>) = (0..400).map(|i| ((i % 7) as f32 / 7.0, i % 50)).unzip();
    let y: Vec<i8> = (0..400).map(|i| (i % 50 < 25) as i8).collect();
    let labelled = dir.path().join("labelled.parquet");
    write_small(&labelled, Some(&y), &x, &c);
    let unlabelled_dir = dir.path().join("serving");
    std::fs::create_dir(&unlabelled_dir).unwrap();
    let unlabelled = unlabelled_dir.join("requests.parquet");
    write_small(&unlabelled, None, &x, &c);
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, SMALL_SPEC).unwrap();
    let ckpt = dir.path().join("ckpt");
    ember(&[
        "train",
        "--data",
        s(&labelled),
        "--dataset-spec",
        s(&spec),
        "--arch-mlp-bot",
        "1-4",
        "--arch-mlp-top",
        "4-1",
        "--mini-batch-size",
        "64",
        "--checkpoint-dir",
        s(&ckpt),
    ]);
    // The recorded spec reads the serving data: no flags needed.
    let (a, b) = (dir.path().join("a.parquet"), dir.path().join("b.parquet"));
    let p = json(&[
        "predict",
        "--checkpoint",
        s(&ckpt),
        "--data",
        s(&unlabelled),
        "--output",
        s(&a),
        "--json",
    ]);
    assert_eq!(p["rows"], 400);
    ember(&[
        "predict",
        "--checkpoint",
        s(&ckpt),
        "--data",
        s(&labelled),
        "--output",
        s(&b),
    ]);
    assert_eq!(predictions(&a).0, predictions(&b).0);
    let err = ember_fails(&["eval", "--checkpoint", s(&ckpt), "--data", s(&unlabelled)]);
    assert!(
        err.contains(s(&unlabelled))
            && err.contains("'y'")
            && err.contains("label column is needed"),
        "{err}"
    );
}

#[test]
fn resume_refuses_inference_checkpoints_and_names_the_flags_it_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "2000", "0");
    let eval_data = synthetic(dir.path(), "eval", "500", "1");
    let ckpt = dir.path().join("ckpt");
    train(&data, &eval_data, &ckpt, &[]);
    for dtype in ["int8", "fp16", "fp32"] {
        let served = dir.path().join(dtype);
        std::fs::create_dir(&served).unwrap();
        let file = served.join("model.safetensors");
        ember(&[
            "quantize",
            "--checkpoint",
            s(&ckpt),
            "--dtype",
            dtype,
            "--output",
            s(&file),
        ]);
        let before = std::fs::read(&file).unwrap();
        let err = ember_fails(&[
            "train",
            "--data",
            &data,
            "--checkpoint-dir",
            s(&served),
            "--resume",
        ]);
        assert!(err.contains("written for inference"), "{dtype}: {err}");
        assert_eq!(std::fs::read(&file).unwrap(), before, "{dtype}");
    }
    let out = ember_stderr(&[
        "train",
        "--data",
        &data,
        "--checkpoint-dir",
        s(&ckpt),
        "--resume",
        "--epochs",
        "2",
        "--learning-rate",
        "0.5",
        "--optimizer",
        "adam",
        "--mini-batch-size",
        "64",
        "--seed",
        "9",
    ]);
    let warning = out
        .lines()
        .find(|l| l.starts_with("warning:"))
        .unwrap_or_default();
    for flag in [
        "--learning-rate 0.5",
        "--optimizer adam",
        "--mini-batch-size 64",
        "--seed 9",
    ] {
        assert!(warning.contains(flag), "{flag}: {out}");
    }
}

#[test]
fn disk_dir_says_where_tables_went_and_refuses_caches_too_small() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    let bench = |cache: &str| {
        vec![
            "bench".to_string(),
            "dlrm".into(),
            "--arch-embedding-size".into(),
            "200000-100".into(),
            "--arch-sparse-feature-size".into(),
            "4".into(),
            "--arch-mlp-bot".into(),
            "13-4".into(),
            "--arch-mlp-top".into(),
            "4-1".into(),
            "--mini-batch-size".into(),
            "64".into(),
            "--num-batches".into(),
            "2".into(),
            "--disk-dir".into(),
            s(&disk).into(),
            "--cache-memory".into(),
            cache.into(),
        ]
    };
    let args = bench("50%");
    let out = ember_stderr(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        out.contains("1 of 2 tables (t_cat_0); in RAM: 1 (t_cat_1)"),
        "{out}"
    );
    for tiny in ["0", "1B", "0.01%"] {
        let args = bench(tiny);
        let err = ember_fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(
            err.contains("--cache-memory")
                && (err.contains("no table goes to the disk tier") || err.contains("above 0%")),
            "{tiny}: {err}"
        );
    }
    // train and eval say the same.
    let data = synthetic(dir.path(), "train", "2000", "0");
    let ckpt = dir.path().join("ckpt");
    let err = ember_fails(
        &[
            &[
                "train",
                "--data",
                &data,
                "--checkpoint-dir",
                s(&ckpt),
                "--disk-dir",
                s(&disk),
            ][..],
            ARCH,
        ]
        .concat(),
    );
    assert!(err.contains("no table goes to the disk tier"), "{err}");
}

/// Saves `new_model()` into `dir` with the training position `state`.
fn checkpoint_at(dir: &Path, state: TrainState) {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("model.safetensors");
    ember::models::checkpoint::save(&mut new_model(), &path, Some(&state)).unwrap();
}

#[test]
fn impossible_training_positions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "2000", "0");
    let good = TrainState {
        epoch: 0,
        batches_in_epoch: 3,
        steps: 3,
        batch_size: 128,
        shuffle_seed: Some(123),
        world_size: 1,
        ..TrainState::default()
    };
    let resume = |ckpt: &Path| {
        vec![
            "train",
            "--data",
            &data,
            "--checkpoint-dir",
            s(ckpt),
            "--resume",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>()
    };
    let ok = dir.path().join("ok");
    checkpoint_at(&ok, good.clone());
    let v = json(
        &[
            resume(&ok).iter().map(String::as_str).collect::<Vec<_>>(),
            vec!["--json"],
        ]
        .concat(),
    );
    assert_eq!(v["resumed_at_step"], 3);
    let cases = [
        (
            "batch size",
            TrainState {
                batch_size: 0,
                ..good.clone()
            },
            "batch size none recorded",
        ),
        (
            "world size",
            TrainState {
                world_size: 0,
                ..good.clone()
            },
            "0 processes",
        ),
        (
            "batch index",
            TrainState {
                batches_in_epoch: 1000,
                steps: 1000,
                ..good.clone()
            },
            "batch 1000 of epoch 0",
        ),
        (
            "steps",
            TrainState {
                steps: u64::MAX - 1,
                ..good.clone()
            },
            "steps in all",
        ),
        (
            "steps below the batch",
            TrainState {
                steps: 1,
                ..good.clone()
            },
            "fewer than",
        ),
    ];
    for (what, state, says) in cases {
        let ckpt = dir.path().join(what.replace(' ', "_"));
        checkpoint_at(&ckpt, state);
        let before = std::fs::read(ckpt.join("model.safetensors")).unwrap();
        let err = ember_fails(&resume(&ckpt).iter().map(String::as_str).collect::<Vec<_>>());
        assert!(err.contains(says), "{what}: {err}");
        assert_eq!(
            std::fs::read(ckpt.join("model.safetensors")).unwrap(),
            before,
            "{what}"
        );
    }
}

#[test]
fn quantize_never_writes_over_its_input_or_requantizes() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "2000", "0");
    let eval_data = synthetic(dir.path(), "eval", "500", "1");
    let ckpt = dir.path().join("ckpt");
    train(&data, &eval_data, &ckpt, &[]);
    let file = ckpt.join("model.safetensors");
    let before = std::fs::read(&file).unwrap();
    let link = dir.path().join("link.safetensors");
    std::os::unix::fs::symlink(&file, &link).unwrap();
    let dotted = ckpt.join("..").join("ckpt").join("model.safetensors");
    for output in [&file, &link, &dotted] {
        let err = ember_fails(&[
            "quantize",
            "--checkpoint",
            s(&ckpt),
            "--dtype",
            "int8",
            "--output",
            s(output),
        ]);
        assert!(
            err.contains("input checkpoint"),
            "{}: {err}",
            output.display()
        );
    }
    assert_eq!(std::fs::read(&file).unwrap(), before);
    // A quantized checkpoint is not quantized again into another type.
    let int4 = dir.path().join("int4.safetensors");
    ember(&[
        "quantize",
        "--checkpoint",
        s(&ckpt),
        "--dtype",
        "int4",
        "--output",
        s(&int4),
    ]);
    let int8 = dir.path().join("int8.safetensors");
    let err = ember_fails(&[
        "quantize",
        "--checkpoint",
        s(&int4),
        "--dtype",
        "int8",
        "--output",
        s(&int8),
    ]);
    assert!(err.contains("already quantized (int4)"), "{err}");
    assert!(!int8.exists());
}

#[test]
fn absurd_layer_counts_are_refused_at_once() {
    let err = ember_fails(&[
        "bench",
        "dlrm",
        "--arch-interaction-op",
        "dcn",
        "--dcn-num-layers",
        "1000000",
        "--dcn-low-rank-dim",
        "4",
        "--mini-batch-size",
        "2",
        "--num-batches",
        "1",
    ]);
    assert!(
        err.contains("1000000 cross layers") && err.contains("at most 128"),
        "{err}"
    );
}

#[test]
fn a_trainer_fed_by_a_loader_records_how_its_batches_were_made() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "2000", "0");
    let mut config = LoaderConfig::criteo(256, &arch().tables);
    config.shuffle_seed = Some(7);
    config.spec.dense_transform = DenseTransform::LogPlus3;
    let loader = Loader::open(&[data.into()], config.clone()).unwrap();
    let ckpt = dir.path().join("ckpt");
    let trainer = Trainer::new(
        TrainerConfig {
            checkpoint_dir: Some(ckpt.clone()),
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let mut model = new_model();
    trainer
        .fit(
            &mut model,
            &loader,
            FitOptions {
                eval: None,
                from: TrainState::default(),
                on_event: None,
            },
        )
        .unwrap();
    let saved = Checkpoint::open(&ckpt).unwrap();
    let state = saved.train_state().unwrap();
    assert_eq!((state.batch_size, state.shuffle_seed), (256, Some(7)));
    assert_eq!(state.dense_transform, Some(DenseTransform::LogPlus3));
    assert_eq!(saved.dataset_spec(), Some(&config.spec));
    // Resuming with batches made otherwise is refused.
    let mut other = config;
    other.batch_size = 128;
    let loader = Loader::open(&[dir.path().join("train")], other).unwrap();
    let state = trainer.resume(&mut model).unwrap();
    let err = trainer
        .fit(
            &mut model,
            &loader,
            FitOptions {
                eval: None,
                from: state,
                on_event: None,
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("batch size 256"), "{err}");
    let _: Option<&DatasetSpec> = saved.dataset_spec();
}

/// Waits (at most two minutes) until `ready` holds.
fn wait_for(what: &str, ready: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !ready() {
        assert!(
            start.elapsed().as_secs() < 120,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Sends `signal` (`libc::SIGSTOP`, `SIGCONT`, `SIGKILL`) to a child.
fn signal(child: &std::process::Child, signal: libc::c_int) {
    // SAFETY: a signal to our own child, which has not been reaped.
    let r = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
}

fn spawn(args: &[&str]) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_second_writer_of_a_directory_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "4000", "0");
    let ckpt = dir.path().join("ckpt");
    let lock = ckpt.join(".ember.lock");
    let train = [
        &[
            "train",
            "--data",
            &data,
            "--checkpoint-dir",
            s(&ckpt),
            "--epochs",
            "3",
        ][..],
        ARCH,
    ]
    .concat();
    // The first run holds the directory, stopped while it does.
    let mut first = spawn(&train);
    wait_for("the first run's lock", || lock.exists());
    signal(&first, libc::SIGSTOP);
    let err = ember_fails(&train);
    let holder = format!("is in use by pid {} (started", first.id());
    assert!(
        err.contains(s(&ckpt)) && err.contains(&holder) && err.contains("ember train"),
        "{err}"
    );
    // Readers are not blocked.
    std::fs::create_dir_all(&ckpt).unwrap();
    signal(&first, libc::SIGCONT);
    assert!(first.wait().unwrap().success());
    assert!(!lock.exists());
    let ckpt_file = Checkpoint::open(&ckpt).unwrap();
    assert_eq!(ckpt_file.train_state().unwrap().epoch, 3);

    // Two ingests into one directory: the second is refused, the first's
    // set is whole.
    let out = dir.path().join("out");
    let ingest = |rows: &str| {
        vec![
            "ingest".to_string(),
            "synthetic".into(),
            "--rows".into(),
            rows.into(),
            "--output".into(),
            s(&out).into(),
            "--row-group-size".into(),
            "1000".into(),
        ]
    };
    let args = ingest("200000");
    let mut first = spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_for("the first ingest's lock", || {
        out.join(".ember.lock").exists()
    });
    signal(&first, libc::SIGSTOP);
    let args = ingest("1000");
    let err = ember_fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        err.contains(&format!("is in use by pid {}", first.id())),
        "{err}"
    );
    signal(&first, libc::SIGCONT);
    assert!(first.wait().unwrap().success());
    let v = json(&[
        "bench",
        "loader",
        "--data",
        s(&out),
        "--mini-batch-size",
        "4096",
        "--json",
    ]);
    assert_eq!(v["rows"], 200000);
}

#[test]
fn a_failed_ingest_leaves_the_previous_set_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let ingest = [
        "ingest",
        "synthetic",
        "--output",
        s(&out),
        "--row-group-size",
        "1000",
        "--rows-per-file",
        "1000",
    ];
    ember(&[&ingest[..], &["--rows", "3000", "--seed", "1"]].concat());
    let before: Vec<(String, Vec<u8>)> = names(&out)
        .into_iter()
        .map(|n| (n.clone(), std::fs::read(out.join(&n)).unwrap()))
        .collect();
    assert_eq!(before.len(), 4, "{before:?}");
    // A second, larger set that cannot be written whole: files are limited
    // to 64 KiB (a full disk, as the process sees it), past its first part.
    let script = format!(
        "trap '' XFSZ; ulimit -f 64; exec {} {} --rows 20000 --seed 2",
        env!("CARGO_BIN_EXE_ember"),
        ingest.join(" ")
    );
    let failed = std::process::Command::new("bash")
        .args(["-c", &script])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(1), "{err}");
    let after: Vec<(String, Vec<u8>)> = names(&out)
        .into_iter()
        .map(|n| (n.clone(), std::fs::read(out.join(&n)).unwrap()))
        .collect();
    assert_eq!(after, before, "{err}");
    let v = json(&[
        "bench",
        "loader",
        "--data",
        s(&out),
        "--mini-batch-size",
        "1000",
        "--json",
    ]);
    assert_eq!(v["rows"], 3000);
    // A rerun that succeeds replaces it whole.
    ember(&[&ingest[..], &["--rows", "2000", "--seed", "2"]].concat());
    assert_eq!(names(&out).len(), 3);
}

#[test]
fn a_set_missing_a_listed_part_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    ember(&[
        "ingest",
        "synthetic",
        "--output",
        s(&out),
        "--rows",
        "3000",
        "--rows-per-file",
        "1000",
    ]);
    std::fs::remove_file(out.join("synthetic-00001.parquet")).unwrap();
    let err = ember_fails(&["bench", "loader", "--data", s(&out)]);
    assert!(
        err.contains("synthetic-00001.parquet, which is missing"),
        "{err}"
    );
}

#[test]
fn table_files_of_killed_runs_are_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    let bench = |batches: &str| {
        [
            "bench",
            "dlrm",
            "--arch-embedding-size",
            "200000-100000",
            "--arch-sparse-feature-size",
            "16",
            "--arch-mlp-bot",
            "13-16",
            "--arch-mlp-top",
            "16-1",
            "--mini-batch-size",
            "64",
            "--num-batches",
            batches,
            "--disk-dir",
            s(&disk),
        ]
        .map(String::from)
        .to_vec()
    };
    let rows = |d: &Path| {
        names(d)
            .into_iter()
            .filter(|n| n.ends_with(".rows"))
            .count()
    };
    let args = bench("100000000");
    let mut run = spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_for("the run's table files", || {
        disk.exists() && rows(&disk) == 2
    });
    signal(&run, libc::SIGKILL);
    run.wait().unwrap();
    // Its files (sized for the whole tables) and its lock file stay.
    assert_eq!(rows(&disk), 2);
    assert!(disk.join(".ember.lock").exists());
    let args = bench("2");
    let out = ember_stderr(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        out.contains("removed 2 table file(s) of killed runs"),
        "{out}"
    );
    assert_eq!(names(&disk), Vec::<String>::new());
}

#[test]
fn a_state_file_loads_tables_of_every_tier_and_type() {
    use ember::models::checkpoint::{StateDict, StateFile};
    use ember::sparse::{
        CachePolicy, DataType, DiskTierConfig, EmbeddingBagCollection, EmbeddingBagConfig,
    };
    let dir = tempfile::tempdir().unwrap();
    let mut item = EmbeddingBagConfig::new("t_item", 3000, 8, &["item"]);
    item.data_type = DataType::Fp16;
    let mut user = EmbeddingBagConfig::new("t_user", 500, 8, &["user"]);
    user.data_type = DataType::Bf16;
    let configs = vec![item, user];
    let tier = Some(DiskTierConfig {
        dir: dir.path().join("disk"),
        cache_rows: 512,
        policy: CachePolicy::Lru,
    });
    std::fs::create_dir_all(dir.path().join("disk")).unwrap();
    let opt = TableOptimizer::rowwise_adagrad(0.1);
    let saved =
        EmbeddingBagCollection::with_disk_tiers(configs.clone(), opt, 3, vec![tier.clone(), None])
            .unwrap();
    let mut state = StateDict::new();
    state.add_collection("sparse.", &saved);
    let path = dir.path().join("state.safetensors");
    state.save(&path, None).unwrap();

    // Loaded into a disk-tier collection (it panicked), and by hand (only
    // f32 was read).
    let file = StateFile::open(&path).unwrap();
    let mut loaded =
        EmbeddingBagCollection::zeroed_with_disk_tiers(configs, opt, vec![tier, None]).unwrap();
    file.load_collection("sparse.", &mut loaded).unwrap();
    let (mut a, mut b) = (vec![0f32; 8], vec![0f32; 8]);
    for (t, rows) in [(0, 3000), (1, 500)] {
        let name = ["t_item", "t_user"][t];
        let by_hand = file
            .tensor(&format!("sparse.embedding_bags.{name}.weight"), &[rows, 8])
            .unwrap();
        for r in 0..rows {
            saved.tables()[t].read_row(r, &mut a);
            loaded.tables()[t].read_row(r, &mut b);
            assert_eq!(a, b, "{name} row {r}");
            assert_eq!(&by_hand[r * 8..(r + 1) * 8], &a[..], "{name} row {r}");
        }
    }
}
