//! `--preset mlperf-multihot`: MLPerf DLRMv2's multi-hot bags, exactly
//! their sizes, in the Parquet `ingest synthetic` writes and in `bench
//! dlrm`'s batches.

mod common;

use arrow_array::cast::AsArray;
use arrow_array::Array;
use common::{ember, json, s};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

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
    let path = (std::fs::read_dir(&out).unwrap())
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "parquet"))
        .unwrap();
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).unwrap())
        .unwrap()
        .build()
        .unwrap();
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
