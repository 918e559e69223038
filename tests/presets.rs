//! MLPerf DLRMv2's multi-hot shape: `--preset mlperf-multihot`'s bags,
//! exactly their sizes, in the Parquet `ingest synthetic` writes and in
//! `bench dlrm`'s batches; and `ingest criteo --multi-hot`, value for value
//! the MLPerf reference's own expansion of real Criteo rows.

mod common;

use arrow_array::cast::AsArray;
use arrow_array::Array;
use common::{ember, ember_fails, json, s};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

/// The record batches of the one Parquet file an ingest wrote into `dir`.
fn parquet_batches(
    dir: &std::path::Path,
) -> parquet::arrow::arrow_reader::ParquetRecordBatchReader {
    let path = (std::fs::read_dir(dir).unwrap())
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "parquet"))
        .unwrap();
    ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap())
        .unwrap()
        .build()
        .unwrap()
}

const SIZES: [usize; 26] = [
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
];

#[test]
fn multi_hot_bags_hold_mlperfs_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("mh");
    ember(&[
        "ingest",
        "synthetic",
        "--preset",
        "mlperf-multihot",
        "--max-ind-range",
        "100",
        "--rows",
        "300",
        "--output",
        s(&out),
    ]);
    let reader = parquet_batches(&out);
    let mut rows = 0;
    for batch in reader {
        let batch = batch.unwrap();
        rows += batch.num_rows();
        for (i, &size) in SIZES.iter().enumerate() {
            let column = batch.column_by_name(&format!("cat_{i}")).unwrap();
            match size {
                // One id: a scalar column, as a one-hot feature.
                1 => assert!(column
                    .as_primitive_opt::<arrow_array::types::Int64Type>()
                    .is_some()),
                _ => {
                    let lists = column.as_list::<i32>();
                    for r in 0..lists.len() {
                        assert_eq!(lists.value_length(r) as usize, size, "cat_{i} row {r}");
                    }
                }
            }
        }
    }
    assert_eq!(rows, 300);

    // bench dlrm's batches: 214 ids a sample, the sizes in its report.
    let report = json(&[
        "bench",
        "dlrm",
        "--preset",
        "mlperf-multihot",
        "--max-ind-range",
        "100",
        "--mini-batch-size",
        "64",
        "--num-batches",
        "3",
        "--json",
    ]);
    let sizes: Vec<usize> = (report["architecture"]["indices_per_feature"]
        .as_array()
        .unwrap())
    .iter()
    .map(|v| v.as_u64().unwrap() as usize)
    .collect();
    assert_eq!(sizes, SIZES);
    let per_sample =
        report["ids_per_s"].as_f64().unwrap() / report["samples_per_s"].as_f64().unwrap();
    assert!((per_sample - 214.0).abs() < 1e-6, "{per_sample}");
}

/// `tests/data/criteo_multi_hot.json` is what the MLPerf reference's code
/// makes of the 200 real rows (scripts/mlperf_multi_hot_fixture.py says
/// how): `ingest criteo --multi-hot` writes the same ids, list for list.
#[test]
fn criteo_rows_expand_as_mlperfs_reference() {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/criteo_multi_hot.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let join = |key: &str| {
        (fixture[key].as_array().unwrap().iter())
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let (sizes, rows) = (join("sizes"), join("rows"));
    let tsv = common::criteo_tsv(&common::criteo_sample_rows());
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("day_0");
    std::fs::write(&input, tsv).unwrap();
    let out = dir.path().join("mh");
    ember(&[
        "ingest",
        "criteo",
        s(&input),
        "--output",
        s(&out),
        "--multi-hot",
        &sizes,
        "--multi-hot-rows",
        &rows,
    ]);
    let reader = parquet_batches(&out);
    let batches: Vec<_> = reader.map(|b| b.unwrap()).collect();
    // A resume with other options than those that wrote the directory is
    // refused, naming them: one directory never mixes expansions.
    let err = ember_fails(&[
        "ingest",
        "criteo",
        s(&input),
        "--output",
        s(&out),
        "--resume",
    ]);
    assert!(err.contains("resume with the same --multi-hot"), "{err}");
    for (f, want) in fixture["features"].as_array().unwrap().iter().enumerate() {
        let want = want.as_array().unwrap();
        let mut got: Vec<serde_json::Value> = Vec::new();
        for batch in &batches {
            let column = batch.column_by_name(&format!("cat_{f}")).unwrap();
            for r in 0..column.len() {
                got.push(match column.is_null(r) {
                    true => serde_json::Value::Null,
                    false => match column.as_list_opt::<i32>() {
                        Some(lists) => {
                            let ids = lists.value(r);
                            let ids = ids.as_primitive::<arrow_array::types::Int64Type>();
                            serde_json::json!(ids.values().to_vec())
                        }
                        None => {
                            let ids = column.as_primitive::<arrow_array::types::Int64Type>();
                            serde_json::json!([ids.value(r)])
                        }
                    },
                });
            }
        }
        assert_eq!(&got, want, "cat_{f}");
    }
}
