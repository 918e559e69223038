//! Helpers shared by the end-to-end tests: the `ember` binary run, its JSON
//! read, a failure checked to be clean.

#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// Runs ember, which must succeed; its stdout.
pub fn ember(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("the ember binary runs");
    assert!(
        out.status.success(),
        "ember {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs ember, which must succeed; its stderr (warnings, progress).
pub fn ember_stderr(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("the ember binary runs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ember {args:?} failed: {err}");
    err + &String::from_utf8_lossy(&out.stdout)
}

/// The last JSON line of a command's output.
pub fn json(args: &[&str]) -> serde_json::Value {
    let out = ember(args);
    let last = out.trim().lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

/// Runs ember expecting a clean failure (an error, exit code 1, or a flag
/// clap refuses, 2: never a panic or a signal); its stderr.
pub fn ember_fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("the ember binary runs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let clean = matches!(out.status.code(), Some(1 | 2));
    assert!(clean, "ember {args:?} must fail cleanly: {err}");
    err
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `ember ingest synthetic` of `rows` Criteo-schema rows (26 tables of 100
/// rows) into `dir/name`, from stream `stream`.
pub fn synthetic(dir: &Path, name: &str, rows: &str, stream: &str) -> String {
    let out = dir.join(name);
    ember(&[
        "ingest",
        "synthetic",
        "--rows",
        rows,
        "--output",
        s(&out),
        "--stream",
        stream,
        "--seed",
        "5",
        "--row-group-size",
        "1000",
        "--rows-per-file",
        "8000",
        "--arch-embedding-size",
        &["100"; 26].join("-"),
    ]);
    out.to_str().unwrap().to_string()
}

/// A small DLRM for `synthetic`'s data.
pub const ARCH: &[&str] = &[
    "--arch-sparse-feature-size",
    "4",
    "--arch-mlp-bot",
    "13-8-4",
    "--arch-mlp-top",
    "8-1",
    "--arch-embedding-size",
    "100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100-100",
    "--mini-batch-size",
    "128",
    "--learning-rate",
    "0.1",
    "--threads",
    "2",
];

/// Each tensor's name and bytes, sorted by name.
pub fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut all: Vec<_> = (st.tensors().into_iter())
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect();
    all.sort();
    all
}

/// The `logit` and `probability` columns of a predictions file.
pub fn predictions(path: &Path) -> (Vec<f32>, Vec<f32>) {
    use arrow_array::cast::AsArray;
    use arrow_array::types::Float32Type;
    let file = std::fs::File::open(path).unwrap();
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .unwrap()
        .build()
        .unwrap();
    let (mut logits, mut probs) = (Vec::new(), Vec::new());
    for batch in reader {
        let batch = batch.unwrap();
        let column = |name| {
            let c = batch.column_by_name(name).unwrap();
            c.as_primitive::<Float32Type>().values().to_vec()
        };
        logits.extend(column("logit"));
        probs.extend(column("probability"));
    }
    (logits, probs)
}

/// The names in `dir`, sorted (none for a missing directory).
pub fn names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Runs a Python program; its stdout.
pub fn python(program: &str) -> String {
    let out = Command::new("python3")
        .args(["-c", program])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Whether `python3` has pyarrow; `EMBER_REQUIRE_PYARROW=1` (set by
/// `scripts/test`) makes its absence a failure rather than a skip.
pub fn have_pyarrow() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import pyarrow"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok && std::env::var_os("EMBER_REQUIRE_PYARROW").is_some() {
        panic!("EMBER_REQUIRE_PYARROW is set but python3 cannot import pyarrow");
    }
    if !ok {
        eprintln!("skipped: python3 has no pyarrow (pip install pyarrow)");
    }
    ok
}

/// A plan of two devices for tables `(name, rows)` of dim `dim`: those of
/// `min_rows` or more key-value (default config) and row-wise by buckets,
/// the others table-wise on device 1.
pub fn bucket_plan(tables: &[(&str, usize)], dim: usize, min_rows: usize) -> String {
    use ember_sharding::{plan::TablePlan, ShardingPlan};
    let tables = (tables.iter())
        .map(|&(name, rows)| {
            let feature = name.replace("t_", "");
            let mut t = ember_sparse::EmbeddingBagConfig::new(name, rows, dim, &[&feature]);
            match rows >= min_rows {
                true => {
                    t.kv = Some(ember_sparse::KvConfig::default());
                    TablePlan::row_wise_buckets(&t, &[0, 1])
                }
                false => TablePlan::table_wise(&t, 1),
            }
        })
        .collect();
    ShardingPlan {
        num_devices: 2,
        tables,
    }
    .to_json()
}

/// The 200 real Criteo rows of `tests/data/criteo_sample.csv`, each its
/// fields as a raw day file writes them (the sample is comma-separated with
/// a header and writes integers as "260.0").
pub fn criteo_sample_rows() -> Vec<Vec<String>> {
    let csv = include_str!("../data/criteo_sample.csv");
    let rows: Vec<Vec<String>> = (csv.lines().skip(1))
        .map(|l| {
            l.split(',')
                .map(|f| f.strip_suffix(".0").unwrap_or(f).to_string())
                .collect()
        })
        .collect();
    assert_eq!(rows.len(), 200);
    rows
}

/// `rows` as the lines of a raw Criteo day file (tab-separated).
pub fn criteo_tsv(rows: &[Vec<String>]) -> String {
    rows.iter().map(|r| r.join("\t") + "\n").collect()
}
