//! The data workflow end to end through the `ember` binary: real Criteo rows
//! ingested, synthetic Parquet trained on, evaluated and predicted from a
//! checkpoint, and a stopped run resumed to the same result.

mod common;

use std::path::Path;
use std::process::Command;

use arrow_array::cast::AsArray;
use common::{
    ember, ember_fails, have_pyarrow, json, names, predictions, python, s, synthetic, tensors,
};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

#[test]
fn real_criteo_rows_ingest_without_loss() {
    let rows = common::criteo_sample_rows();
    let tsv = common::criteo_tsv(&rows);
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("day_0");
    std::fs::write(&input, tsv).unwrap();
    let out = dir.path().join("parquet");
    let v = json(&["ingest", "criteo", s(&input), "--output", s(&out), "--json"]);
    assert_eq!(v["rows_written"], 200);
    assert_eq!(v["lines_rejected"], 0);
    for (k, column) in v["nulls"].as_array().unwrap().iter().enumerate() {
        let missing = rows.iter().filter(|r| r[k + 1].is_empty()).count();
        assert_eq!(column["nulls"], missing, "{column}");
    }
    // The loader reads them back with the model's modulo.
    let b = json(&[
        "bench",
        "loader",
        "--data",
        s(&out),
        "--mini-batch-size",
        "64",
        "--json",
    ]);
    assert_eq!(b["rows"], 200);
    assert_eq!(b["batches"], 4);
    // The ecosystem's readers open the directory as one dataset: the
    // marker beside the parts starts with `_`, which they skip.
    if have_pyarrow() {
        let rows = python(&format!(
            "import pyarrow.dataset as ds; print(ds.dataset({:?}, format='parquet').count_rows())",
            s(&out)
        ));
        assert_eq!(rows.trim(), "200");
    }
}

const ARCH: &[&str] = &[
    "--arch-sparse-feature-size",
    "4",
    "--arch-mlp-bot",
    "13-8-4",
    "--arch-mlp-top",
    "8-1",
    "--mini-batch-size",
    "128",
    "--learning-rate",
    "0.1",
    "--threads",
    "2",
];

fn train(data: &str, eval: &str, ckpt: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "train",
        "--data",
        data,
        "--eval-data",
        eval,
        "--epochs",
        "2",
        "--checkpoint-dir",
        s(ckpt),
        "--json",
    ];
    args.extend_from_slice(ARCH);
    // All 26 features, as many rows as the data's ids use.
    let tables = ["100"; 26].join("-");
    args.extend_from_slice(&["--arch-embedding-size", &tables]);
    args.extend_from_slice(extra);
    json(&args)
}

#[test]
fn train_eval_predict_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "20000", "0");
    let eval_data = synthetic(dir.path(), "eval", "2000", "1");

    let full = dir.path().join("full");
    let a = train(&data, &eval_data, &full, &[]);
    assert_eq!(a["steps"], 2 * 157);
    let auc = a["eval"]["auc"].as_f64().unwrap();
    assert!(auc > 0.7, "a learnable task should train: auc {auc}");

    // Stopped after 100 steps (in the first epoch), then resumed: the same model as the run that never stopped.
    let stopped = dir.path().join("stopped");
    let b = train(&data, &eval_data, &stopped, &["--max-steps", "100"]);
    assert_eq!(b["steps"], 100);
    // What a kill during a checkpoint write leaves (ours, and what the
    // safetensors crate's writer left in earlier versions) is removed; a
    // temporary file of another program is not.
    let leftovers = [".model.safetensors.tmp", ".tmpAb12Cd", ".notes.txt.tmp"];
    for name in leftovers {
        std::fs::write(stopped.join(name), b"partial").unwrap();
    }
    // Resuming needs no architecture, optimizer or batch flags.
    let c = json(&[
        "train",
        "--data",
        &data,
        "--eval-data",
        &eval_data,
        "--epochs",
        "2",
        "--checkpoint-dir",
        s(&stopped),
        "--resume",
        "--json",
    ]);
    assert_eq!(c["resumed_at_step"], 100);
    let left: Vec<bool> = leftovers.iter().map(|n| stopped.join(n).exists()).collect();
    assert_eq!(left, [false, false, true]);
    assert_eq!(c["steps"], a["steps"]);
    assert_eq!(c["loss_last"], a["loss_last"]);
    assert_eq!(c["eval"], a["eval"]);
    let ckpt = full.join("model.safetensors");
    assert_eq!(tensors(&ckpt), tensors(&stopped.join("model.safetensors")));

    // Resuming on other data is refused, not silently continued.
    let other = synthetic(dir.path(), "other", "3000", "0");
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "train",
            "--data",
            &other,
            "--epochs",
            "2",
            "--checkpoint-dir",
            s(&stopped),
            "--resume",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("training data differs"),
        "{err}"
    );

    // A sharded run resumed on another device count and plan: checkpoints
    // stay unsharded. Table-wise keeps the unsharded summation order, so it
    // ends exactly where the unsharded run did.
    let moved = dir.path().join("moved");
    train(
        &data,
        &eval_data,
        &moved,
        &[
            "--max-steps",
            "100",
            "--devices",
            "2",
            "--sharding",
            "table-wise",
        ],
    );
    let d = json(&[
        "train",
        "--data",
        &data,
        "--eval-data",
        &eval_data,
        "--epochs",
        "2",
        "--checkpoint-dir",
        s(&moved),
        "--resume",
        "--devices",
        "3",
        "--json",
    ]);
    assert_eq!(d["steps"], a["steps"]);
    assert_eq!(
        tensors(&moved.join("model.safetensors")),
        tensors(&full.join("model.safetensors"))
    );

    // eval needs no architecture flags; it agrees with training's evaluation.
    let e = json(&[
        "eval",
        "--checkpoint",
        s(&ckpt),
        "--data",
        &eval_data,
        "--json",
    ]);
    assert_eq!(e["auc"], a["eval"]["auc"]);
    assert_eq!(e["rows"], 2000);
    if ember::dense::pjrt::plugin_for_tests().is_some() {
        // The PJRT backend serves the same checkpoint to the same AUC.
        let p = json(&[
            "eval",
            "--checkpoint",
            s(&ckpt),
            "--data",
            &eval_data,
            "--dense-backend",
            "pjrt",
            "--json",
        ]);
        let (x, y) = (p["auc"].as_f64().unwrap(), e["auc"].as_f64().unwrap());
        assert!((x - y).abs() < 1e-6, "pjrt auc {x} vs native {y}");
        // And trains from Parquet in compiled mode, checkpointing the device's parameters.
        let compiled = dir.path().join("compiled");
        let c = train(
            &data,
            &eval_data,
            &compiled,
            &["--dense-backend", "pjrt", "--mode", "compiled"],
        );
        let (x, y) = (
            c["eval"]["auc"].as_f64().unwrap(),
            a["eval"]["auc"].as_f64().unwrap(),
        );
        assert!((x - y).abs() < 1e-3, "compiled auc {x} vs native {y}");
        let reloaded = json(&[
            "eval",
            "--checkpoint",
            s(&compiled.join("model.safetensors")),
            "--data",
            &eval_data,
            "--json",
        ]);
        assert!((reloaded["auc"].as_f64().unwrap() - x).abs() < 1e-6);
    }

    let out = dir.path().join("pred.parquet");
    let p = json(&[
        "predict",
        "--checkpoint",
        s(&ckpt),
        "--data",
        &eval_data,
        "--output",
        s(&out),
        "--mini-batch-size",
        "100",
        "--json",
    ]);
    assert_eq!(p["rows"], 2000);
    let (logits, probs) = predictions(&out);
    assert_eq!(logits.len(), 2000);
    for (z, p) in logits.iter().zip(&probs) {
        assert!((1.0 / (1.0 + (-z).exp()) - p).abs() < 1e-6);
    }
}

#[test]
fn a_disk_tier_run_checkpoints_and_resumes_as_in_ram() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let tables = ["3000"; 26].join("-");
    ember(&[
        "ingest",
        "synthetic",
        "--rows",
        "4000",
        "--output",
        s(&data),
        "--seed",
        "3",
        "--arch-embedding-size",
        &tables,
    ]);
    let run = |ckpt: &Path, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            s(&data),
            "--epochs",
            "2",
            "--checkpoint-dir",
            s(ckpt),
            "--checkpoint-every",
            "7",
            "--arch-embedding-size",
            &tables,
            "--json",
        ];
        args.extend_from_slice(ARCH);
        args.extend_from_slice(extra);
        json(&args)
    };
    let ram = dir.path().join("ram");
    let a = run(&ram, &[]);
    // Caches of 40% of each table (1,200 rows for batches of 128 ids a
    // table): rows are evicted, written back and read again.
    let tier_dir = dir.path().join("tier");
    let tier = ["--disk-dir", s(&tier_dir), "--cache-memory", "40%"];
    let disk = dir.path().join("disk");
    let stopped = [&tier[..], &["--max-steps", "20"]].concat();
    let b = run(&disk, &stopped);
    assert_eq!(b["steps"], 20);
    let hit = b["disk_tier"]["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.0 && hit < 1.0, "{b}");
    assert!(
        b["disk_tier"]["bytes_written_per_step"].as_f64().unwrap() > 0.0,
        "{b}"
    );
    let c = run(&disk, &[&tier[..], &["--resume"]].concat());
    assert_eq!(c["resumed_at_step"], 20);
    assert_eq!(
        (&c["steps"], &c["loss_last"]),
        (&a["steps"], &a["loss_last"])
    );
    assert_eq!(
        tensors(&ram.join("model.safetensors")),
        tensors(&disk.join("model.safetensors"))
    );
    // Served from the disk tier, the checkpoint evaluates as from RAM.
    let eval = |extra: &[&str]| {
        let ckpt = disk.join("model.safetensors");
        let args = [
            "eval",
            "--checkpoint",
            s(&ckpt),
            "--data",
            s(&data),
            "--json",
            // Caches of 1,200 rows hold 8 batches of 100 samples' ids.
            "--mini-batch-size",
            "100",
        ];
        json(&[&args[..], extra].concat())
    };
    assert_eq!(eval(&[]), eval(&tier));
    // The tables' files went with the runs.
    assert_eq!(std::fs::read_dir(&tier_dir).unwrap().count(), 0);
}

#[test]
fn multi_hot_synthetic_data_is_read_as_lists() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("mh");
    let tables = ["100"; 26].join("-");
    ember(&[
        "ingest",
        "synthetic",
        "--rows",
        "1000",
        "--output",
        s(&out),
        "--multi-hot",
        "4",
        "--arch-embedding-size",
        &tables,
    ]);
    let b = json(&[
        "bench",
        "loader",
        "--data",
        s(&out),
        "--arch-embedding-size",
        &tables,
        "--json",
    ]);
    assert_eq!(b["rows"], 1000);
    // max(1, round(4u)) ids per bag (dlrm_s_pytorch's rule): 2.125 on average, 26 bags a row.
    let per_row = b["ids"].as_f64().unwrap() / 1000.0;
    assert!(
        (26.0 * 1.95..26.0 * 2.3).contains(&per_row),
        "{per_row} ids per row"
    );
}

/// The values of int64 column `column` in every file of `dir`.
fn int64_column(dir: &Path, column: &str) -> Vec<i64> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    files.sort();
    for path in files {
        let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap())
            .unwrap()
            .build()
            .unwrap();
        for batch in reader {
            let batch = batch.unwrap();
            let col = batch.column_by_name(column).unwrap();
            let values = col.as_primitive::<arrow_array::types::Int64Type>();
            out.extend(values.iter().flatten());
        }
    }
    out
}

#[test]
fn zipf_ids_reach_the_parquet_files() {
    let dir = tempfile::tempdir().unwrap();
    let tables = ["1000"; 26].join("-");
    let ingest = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec![
            "ingest",
            "synthetic",
            "--rows",
            "20000",
            "--output",
            s(&out),
            "--arch-embedding-size",
            &tables,
        ];
        args.extend_from_slice(extra);
        ember(&args);
        int64_column(&out, "cat_0")
    };
    // The share of the most frequent id: 1 / H(1000, 1.5) = 0.402 under
    // Zipf's law with alpha 1.5; under the default log-uniform ranks no id
    // gets more than 1 / ln(1001) = 0.145.
    let top_share = |ids: &[i64]| {
        let mut counts = std::collections::HashMap::new();
        for &id in ids {
            *counts.entry(id).or_insert(0usize) += 1;
        }
        *counts.values().max().unwrap() as f64 / ids.len() as f64
    };
    let zipf = ingest(
        "zipf",
        &["--id-distribution", "zipf", "--zipf-alpha", "1.5"],
    );
    let default = ingest("default", &[]);
    assert_eq!(zipf.len(), 20000);
    assert!(zipf.iter().all(|&id| (0..1000).contains(&id)));
    let (z, d) = (top_share(&zipf), top_share(&default));
    assert!((z - 0.402).abs() < 0.02, "zipf top share {z}");
    assert!(d < 0.16, "default top share {d}");
}

#[test]
fn data_errors_name_the_file_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "600", "0");
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "train",
            "--data",
            &data,
            "--arch-embedding-size",
            "5-5",
            "--id-transform",
            "nope",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "eval",
            "--checkpoint",
            s(&empty.join("missing.safetensors")),
            "--data",
            &data,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("missing.safetensors"),
        "{err}"
    );
}

#[test]
fn a_dataset_of_another_schema_trains_evaluates_and_predicts() {
    // A click log written by pyarrow: a boolean label, float and int dense
    // columns with nulls, a weighted list<int64> history sharing its table
    // with an item id, a user id (examples/data/clicks.spec.json).
    if !have_pyarrow() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("clicks");
    let root = env!("CARGO_MANIFEST_DIR");
    let made = Command::new("python3")
        .arg(format!("{root}/scripts/make_clicks.py"))
        .args([
            s(&data),
            "--rows",
            "16000",
            "--files",
            "2",
            "--row-group-size",
            "1000",
        ])
        .status()
        .unwrap();
    assert!(made.success());
    let spec = format!("{root}/examples/data/clicks.spec.json");
    let (train, test) = (
        data.join("clicks-00000.parquet"),
        data.join("clicks-00001.parquet"),
    );
    let ckpt = dir.path().join("ckpt");
    let mut args = vec![
        "train",
        "--data",
        s(&train),
        "--eval-data",
        s(&test),
        "--dataset-spec",
        &spec,
        "--mini-batch-size",
        "200",
        "--epochs",
        "3",
        "--learning-rate",
        "0.05",
        "--checkpoint-dir",
        s(&ckpt),
        "--json",
    ];
    let trained = json(&args);
    let auc = trained["eval"]["auc"].as_f64().unwrap();
    // The labels follow a hidden model of these very columns.
    assert!(auc > 0.62, "auc {auc}");
    assert_eq!(trained["eval"]["rows"], 8000);
    let model = s(&ckpt.join("model.safetensors")).to_string();
    let evaluated = json(&[
        "eval",
        "--checkpoint",
        &model,
        "--data",
        s(&test),
        "--dataset-spec",
        &spec,
        "--json",
    ]);
    assert_eq!(evaluated["auc"], trained["eval"]["auc"]);
    let out = dir.path().join("predictions.parquet");
    ember(&[
        "predict",
        "--checkpoint",
        &model,
        "--data",
        s(&test),
        "--dataset-spec",
        &spec,
        "--output",
        s(&out),
    ]);
    let (_, probs) = predictions(&out);
    assert!(probs.iter().all(|&p| p > 0.0 && p < 1.0));
    assert_eq!(probs.len(), 8000);
    // The shared table sharded row-wise over 2 devices learns as well.
    args.retain(|a| *a != "--checkpoint-dir" && *a != s(&ckpt));
    args.extend(["--devices", "2", "--sharding", "row-wise"]);
    let sharded = json(&args);
    let sharded_auc = sharded["eval"]["auc"].as_f64().unwrap();
    assert!((sharded_auc - auc).abs() < 1e-3, "{sharded_auc} vs {auc}");
    // A spec that does not fit the checkpoint names the table.
    let other = dir.path().join("other.json");
    let text = std::fs::read_to_string(&spec).unwrap();
    std::fs::write(
        &other,
        text.replace("\"num_embeddings\": 1000", "\"num_embeddings\": 999"),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "eval",
            "--checkpoint",
            &model,
            "--data",
            s(&test),
            "--dataset-spec",
            s(&other),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("t_user") && err.contains("999"),
        "{err}"
    );
}

/// The dtype and shape of the first table's weight in a checkpoint file.
fn first_table(path: &Path) -> (safetensors::Dtype, Vec<usize>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let weight = st
        .tensor("sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight")
        .unwrap();
    (weight.dtype(), weight.shape().to_vec())
}

#[test]
fn half_tables_train_and_quantized_checkpoints_serve() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "8000", "0");
    let eval_data = synthetic(dir.path(), "eval", "2000", "1");
    let ckpt = dir.path().join("fp16");
    let trained = train(&data, &eval_data, &ckpt, &["--table-dtype", "fp16"]);
    let auc = trained["eval"]["auc"].as_f64().unwrap();
    let file = ckpt.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    assert_eq!(first_table(&file), (safetensors::Dtype::F16, vec![100, 4]));
    let eval = |path: &Path| {
        json(&[
            "eval",
            "--checkpoint",
            s(path),
            "--data",
            &eval_data,
            "--json",
        ])
    };
    assert_eq!(eval(&file)["auc"].as_f64().unwrap(), auc);

    // int8 tables for serving: a quarter of fp32's bytes here (4 + 4 per
    // row of dim 4, against 16), predictions close to the fp16 model's.
    let int8 = dir.path().join("int8.safetensors");
    let q = json(&[
        "quantize",
        "--checkpoint",
        s(&file),
        "--dtype",
        "int8",
        "--output",
        s(&int8),
        "--json",
    ]);
    assert_eq!(q["data_type"], "int8");
    assert_eq!(q["converted"].as_array().unwrap().len(), 26);
    assert_eq!(q["table_bytes_after"], 26 * 100 * 8);
    let served = eval(&int8)["auc"].as_f64().unwrap();
    assert!(
        (served - auc).abs() < 0.01,
        "int8 auc {served} against {auc}"
    );

    // Quantized tables do not train, and the input is never overwritten.
    for (args, says) in [
        (
            vec![
                "quantize",
                "--checkpoint",
                s(&file),
                "--dtype",
                "int4",
                "--output",
                s(&file),
            ],
            "the output is the input",
        ),
        (
            vec![
                "bench",
                "embedding",
                "--rows",
                "10",
                "--table-dtype",
                "int8",
                "--optimizer",
                "sgd",
            ],
            "--table-dtype int8 is for inference",
        ),
        (
            vec!["bench", "dlrm", "--table-dtype", "mxfp4"],
            "quantized tables are for inference",
        ),
    ] {
        let err = ember_fails(&args);
        assert!(err.contains(says), "{args:?}: {err}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), bytes);

    // A fp32 run resumed with --table-dtype bf16: the saved tables are cast
    // as they load, the run says so, and goes on in bf16.
    let cast = dir.path().join("cast");
    train(&data, &eval_data, &cast, &["--max-steps", "20"]);
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "train",
            "--data",
            &data,
            "--eval-data",
            &eval_data,
            "--epochs",
            "1",
        ])
        .args([
            "--checkpoint-dir",
            s(&cast),
            "--resume",
            "--table-dtype",
            "bf16",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("26 of 26 saved tables are fp32, cast to bf16"),
        "{said}"
    );
    assert_eq!(
        first_table(&cast.join("model.safetensors")).0,
        safetensors::Dtype::BF16
    );
    // A quantized type does not train: refused before anything loads.
    let err = ember_fails(&[
        "train",
        "--data",
        &data,
        "--checkpoint-dir",
        s(&cast),
        "--resume",
        "--table-dtype",
        "int4",
    ]);
    assert!(err.contains("quantized tables are for inference"), "{err}");
}

#[test]
fn files_other_tools_write_are_read_and_careless_runs_are_refused() {
    if !have_pyarrow() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "syn", "2000", "0");
    let part = format!("{data}/synthetic-00000.parquet");
    let ckpt = dir.path().join("ckpt");
    let mut args = vec![
        "train",
        "--data",
        &data,
        "--checkpoint-dir",
        s(&ckpt),
        "--json",
    ];
    args.extend(ARCH);
    json(&args);
    let eval = |data: &str| {
        let v = json(&["eval", "--checkpoint", s(&ckpt), "--data", data, "--json"]);
        (v["auc"].as_f64().unwrap(), v["logloss"].as_f64().unwrap())
    };
    // `--checkpoint` takes the run's directory as well as its file.
    let want = eval(&part);

    // The same rows as pyarrow writes them: other codecs, dictionary-typed
    // ids (pandas' categoricals), page checksums.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    python(&format!(
        r#"
import pyarrow as pa, pyarrow.parquet as pq
t = pq.read_table({part:?})
t = t.set_column(t.schema.get_field_index("cat_0"), "cat_0", t.column("cat_0").dictionary_encode())
assert pa.types.is_dictionary(t.schema.field("cat_0").type)
for codec in ["gzip", "brotli", "lz4", "none"]:
    pq.write_table(t, "{other}/" + codec + ".parquet", compression=codec, write_page_checksum=True,
                   use_dictionary=codec != "none", row_group_size=500)
"#,
        other = s(&other)
    ));
    for codec in ["gzip", "brotli", "lz4", "none"] {
        let got = eval(&format!("{}/{codec}.parquet", s(&other)));
        assert_eq!(got, want, "{codec}");
    }
    // A flipped byte in a page: its checksum names the file.
    let plain = other.join("none.parquet");
    let at = python(&format!(
        "import pyarrow.parquet as pq; c = pq.ParquetFile({:?}).metadata.row_group(1).column(4); \
         print(c.data_page_offset + c.total_compressed_size // 2)",
        s(&plain)
    ));
    let mut bytes = std::fs::read(&plain).unwrap();
    bytes[at.trim().parse::<usize>().unwrap()] ^= 0x40;
    let corrupt = dir.path().join("corrupt.parquet");
    std::fs::write(&corrupt, bytes).unwrap();
    let err = ember_fails(&["eval", "--checkpoint", s(&ckpt), "--data", s(&corrupt)]);
    assert!(
        err.contains("corrupt.parquet") && err.to_lowercase().contains("checksum"),
        "{err}"
    );

    // Careless runs: each a clear error, nothing destroyed or left behind.
    let before = std::fs::read(&part).unwrap();
    let predict_to = |out: &str| {
        ember_fails(&[
            "predict",
            "--checkpoint",
            s(&ckpt),
            "--data",
            &data,
            "--output",
            out,
        ])
    };
    let err = predict_to(&part);
    assert!(err.contains("--output") && err.contains("--data"), "{err}");
    let err = predict_to(s(&ckpt.join("model.safetensors")));
    assert!(err.contains("checkpoint"), "{err}");
    assert_eq!(std::fs::read(&part).unwrap(), before);
    let empty = dir.path().join("empty.parquet");
    python(&format!(
        "import pyarrow.parquet as pq; t = pq.read_table({part:?}); pq.write_table(t.slice(0, 0), {:?})",
        s(&empty)
    ));
    let err = ember_fails(&["eval", "--checkpoint", s(&ckpt), "--data", s(&empty)]);
    assert!(err.contains("no rows"), "{err}");
    let err = ember_fails(&["eval", "--checkpoint", s(dir.path()), "--data", &part]);
    assert!(
        err.contains("looked for") && err.contains("model.safetensors"),
        "{err}"
    );
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let mut args = vec!["train", "--data", &data, "--checkpoint-dir", s(&file)];
    args.extend(ARCH);
    let err = ember_fails(&args);
    assert!(
        err.contains("a-file") && err.contains("not a directory"),
        "{err}"
    );

    // A full disk: /dev/full behind the temporary file fails every write
    // (a container without it skips this; a plain file there would not fail).
    #[cfg(target_os = "linux")]
    if std::fs::metadata("/dev/full").is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_char_device()
    }) {
        let out = dir.path().join("pred.parquet");
        std::os::unix::fs::symlink("/dev/full", dir.path().join(".pred.parquet.tmp")).unwrap();
        let err = predict_to(s(&out));
        assert!(
            err.contains("disk is full") && err.contains(".pred.parquet.tmp"),
            "{err}"
        );
        assert!(!out.exists() && !dir.path().join(".pred.parquet.tmp").exists());
    }
}

#[test]
fn a_stream_of_windows_is_evaluated_ahead_and_resumes_mid_window_exactly() {
    let dir = tempfile::tempdir().unwrap();
    // Three days, given out of order: windows go by natural name order.
    let days: Vec<String> = [2, 0, 1]
        .iter()
        .map(|d| synthetic(dir.path(), &format!("day_{d}"), "2000", &d.to_string()))
        .collect();
    let days: Vec<&str> = days.iter().map(String::as_str).collect();
    let run = |ckpt: &Path, extra: &[&str]| -> Vec<serde_json::Value> {
        let mut args = vec!["train", "--data"];
        args.extend(&days);
        args.extend(["--stream-window", "--checkpoint-dir", s(ckpt), "--json"]);
        args.extend(common::ARCH);
        args.extend(["--kv-min-rows", "2"]);
        args.extend(extra);
        (ember(&args).lines())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let windows = |lines: &[serde_json::Value]| -> Vec<serde_json::Value> {
        lines
            .iter()
            .filter(|l| l["event"] == "window")
            .cloned()
            .collect()
    };
    let full = run(&dir.path().join("full"), &[]);
    let seen = windows(&full);
    assert_eq!(seen.len(), 2, "{full:?}");
    for (w, line) in seen.iter().enumerate() {
        assert_eq!(line["window"], w as u64 + 1);
        assert!(line["file"]
            .as_str()
            .unwrap()
            .ends_with(&format!("day_{}", w + 1)));
        assert_eq!(line["rows"], 2000);
        assert!(line["auc"].as_f64().unwrap() > 0.5, "{line}");
    }
    // Each window's line has the key-value figures so far: more ids seen
    // (training batches) and admitted as the stream goes on.
    let figure = |w: usize, what: &str| -> u64 {
        let tables = seen[w]["key_value_tables"].as_array().unwrap();
        tables.iter().map(|t| t[what].as_u64().unwrap()).sum()
    };
    for what in ["seen", "admitted"] {
        assert!(
            figure(0, what) > 0 && figure(1, what) > figure(0, what),
            "{seen:?}"
        );
    }
    // Stopped in the middle of window 1 (after its evaluation), resumed:
    // the same last evaluation and the same weights, maps and state.
    let part = dir.path().join("part");
    let first = run(&part, &["--max-steps", "20"]);
    assert_eq!(windows(&first), seen[..1]);
    let rest = run(&part, &["--resume"]);
    assert_eq!(windows(&rest), seen[1..]);
    assert!(
        tensors(&part.join("model.safetensors"))
            == tensors(&dir.path().join("full/model.safetensors"))
    );
    // The same with delta checkpoints between full ones: the run resumes
    // from the chain, and the chain compacts into the same tensors.
    let deltas = dir.path().join("deltas");
    let every = ["--checkpoint-every", "6", "--delta-checkpoints", "2"];
    let first = run(&deltas, &[&["--max-steps", "20"][..], &every].concat());
    assert_eq!(windows(&first), seen[..1]);
    assert!(deltas.join("model.delta-000001.safetensors").exists());
    let rest = run(&deltas, &[&["--resume"][..], &every].concat());
    assert_eq!(windows(&rest), seen[1..]);
    // Named from inside its directory, a chain's delta opens (its full
    // file found beside it).
    let last = (common::names(&deltas).into_iter())
        .filter(|n| n.starts_with("model.delta-"))
        .max()
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["eval", "--checkpoint", &last, "--data", days[2], "--json"])
        .current_dir(&deltas)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let compacted = json(&["checkpoint", "compact", s(&deltas), "--json"]);
    assert!(compacted["deltas"].as_u64().unwrap() >= 1, "{compacted}");
    assert!(!deltas.join("model.delta-000001.safetensors").exists());
    assert!(
        tensors(&deltas.join("model.safetensors"))
            == tensors(&dir.path().join("full/model.safetensors"))
    );
    // `eval` of the checkpoint reports its key-value tables' figures.
    let full_dir = dir.path().join("full");
    let eval = json(&[
        "eval",
        "--checkpoint",
        s(&full_dir),
        "--data",
        days[0],
        "--json",
    ]);
    assert!(eval["auc"].as_f64().unwrap() > 0.5, "{eval}");
    let tables = eval["key_value_tables"].as_array().unwrap();
    assert_eq!(tables.len(), 26, "{eval}");
    assert!(tables.iter().all(|t| t["seen"] == 3 * 2000), "{eval}");
    let err = ember_fails(&[
        "train",
        "--data",
        days[0],
        "--stream-window",
        "--epochs",
        "2",
    ]);
    assert!(
        err.contains("--stream-window") && err.contains("--epochs"),
        "{err}"
    );
}

#[test]
fn drifting_raw_ids_are_ingested_a_window_a_file_and_train_as_a_stream() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("drift");
    let sizes = ["100"; 26].join("-");
    let ingest = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["ingest", "synthetic", "--output", s(&out), "--seed", "3"];
        args.extend(["--arch-embedding-size", &sizes]);
        args.extend(extra);
        args.iter().map(|a| a.to_string()).collect()
    };
    let run = |args: Vec<String>| ember(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let fails =
        |args: Vec<String>| ember_fails(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let err = fails(ingest(&["--rows", "3000", "--drift", "0.5"]));
    assert!(err.contains("--window-rows"), "{err}");
    let err = fails(ingest(&[
        "--rows",
        "2500",
        "--drift",
        "0.5",
        "--window-rows",
        "1000",
    ]));
    assert!(
        err.contains("--rows 2500") && err.contains("--window-rows 1000"),
        "{err}"
    );
    let err = fails(ingest(&[
        "--rows",
        "3000",
        "--drift",
        "0.5",
        "--window-rows",
        "1000",
        "--multi-hot",
        "2",
    ]));
    assert!(err.contains("--multi-hot"), "{err}");
    let err = fails(ingest(&["--rows", "3000", "--window-rows", "1000"]));
    assert!(
        err.contains("--window-rows") && err.contains("--drift"),
        "{err}"
    );
    let err = fails(ingest(&[
        "--rows",
        "3000",
        "--drift",
        "0.5",
        "--window-rows",
        "1000",
        "--rows-per-file",
        "500",
    ]));
    assert!(err.contains("--rows-per-file"), "{err}");
    run(ingest(&[
        "--rows",
        "3000",
        "--drift",
        "0.5",
        "--window-rows",
        "1000",
    ]));
    let parts: Vec<String> = names(&out)
        .into_iter()
        .filter(|n| n.ends_with(".parquet"))
        .collect();
    assert_eq!(parts.len(), 3, "{parts:?}");
    if have_pyarrow() {
        // Raw 64-bit ids far past the 100 rows, fewer shared between
        // windows 0 and 2 than 0 and 1.
        let report = python(&format!(
            "import pyarrow.parquet as pq\n\
             ids = [set(pq.read_table('{}/' + f).column('cat_0').to_pylist()) for f in {parts:?}]\n\
             rows = [pq.read_table('{}/' + f).num_rows for f in {parts:?}]\n\
             big = max(abs(i) for i in ids[0])\n\
             print(rows, big > 2**40, len(ids[0] & ids[1]) > len(ids[0] & ids[2]))",
            s(&out),
            s(&out)
        ));
        assert_eq!(report.trim(), "[1000, 1000, 1000] True True", "{report}");
    }
    // One directory of windows: each evaluated before it is trained on.
    let mut args = vec!["train", "--data", s(&out), "--stream-window", "--json"];
    args.extend(common::ARCH);
    args.extend(["--kv-min-rows", "2"]);
    let windows: Vec<serde_json::Value> = (ember(&args).lines())
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["event"] == "window")
        .collect();
    assert_eq!(windows.len(), 2, "{windows:?}");
    assert!(windows.iter().all(|w| w["rows"] == 1000), "{windows:?}");
}

/// `quantize --preset`: a new model written straight in int8 (no fp32
/// checkpoint first), the same rows whether its tables were drawn in RAM
/// or on the disk tier; served from the disk tier (rows read in place)
/// it predicts as in RAM.
#[test]
fn a_new_model_is_written_straight_in_int8_and_predicts_alike_from_the_disk_tier() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "data", "2000", "0");
    let new = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec!["quantize", "--preset", "kaggle", "--max-ind-range", "5000"];
        args.extend_from_slice(&[
            "--dtype",
            "int8",
            "--seed",
            "4",
            "--output",
            s(&out),
            "--json",
        ]);
        args.extend_from_slice(extra);
        (json(&args), out)
    };
    let tier = dir.path().join("tier");
    std::fs::create_dir(&tier).unwrap();
    let (q, in_ram) = new("ram.safetensors", &[]);
    assert!(q["checkpoint"].is_null(), "{q}");
    // 26 tables of 5000 rows of dim 16: 16 codes and a 4-byte scale and bias.
    assert_eq!(q["table_bytes_after"], 26 * 5000 * 20);
    let (_, on_disk) = new(
        "disk.safetensors",
        &["--disk-dir", s(&tier), "--cache-memory", "50%"],
    );
    // The same rows drawn either way (the files order their tensors
    // apart): predictions of each, one from the disk tier, agree bitwise.
    let predict = |ckpt: &Path, out: &str, extra: &[&str]| {
        let out = dir.path().join(out);
        let mut args = vec!["predict", "--checkpoint", s(ckpt), "--data", &data];
        args.extend_from_slice(&["--output", s(&out), "--mini-batch-size", "100"]);
        args.extend_from_slice(extra);
        ember(&args);
        std::fs::read(out).unwrap()
    };
    let tier_flags = ["--disk-dir", s(&tier), "--cache-memory", "50%"];
    let disk = predict(&on_disk, "disk.parquet", &tier_flags);
    assert!(
        predict(&in_ram, "ram.parquet", &[]) == disk,
        "predictions differ"
    );

    let file = in_ram.to_str().unwrap();
    let out = dir.path().join("x.safetensors");
    for (args, says) in [
        (
            vec!["quantize", "--checkpoint", file, "--preset", "kaggle"],
            "cannot be used with",
        ),
        (
            vec!["quantize", "--checkpoint", file, "--disk-dir", s(&tier)],
            "--disk-dir apply to a new model",
        ),
    ] {
        let mut args = args;
        args.extend_from_slice(&["--dtype", "int8", "--output", s(&out)]);
        let err = ember_fails(&args);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
