//! `ember ingest criteo --vocabulary-threshold`: the table sizes reach
//! `train`, and every way of mixing two numberings is refused by name.
//! (The ids themselves are checked against TorchRec's preprocessing in
//! python/tests/test_vocabulary.py, the counting against a plain
//! reference in the library's tests.)

mod common;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::Array;
use common::{ember_fails, ember_stderr, json, s};
use ember::dataloader::multi_hot::MultiHot;

/// The 200 real rows as two raw Criteo day files in `dir`.
fn days(dir: &std::path::Path) -> [std::path::PathBuf; 2] {
    let rows = common::criteo_sample_rows();
    let day = |k: usize, rows: &[Vec<String>]| {
        let path = dir.join(format!("day_{k}"));
        std::fs::write(&path, common::criteo_tsv(rows)).unwrap();
        path
    };
    [day(0, &rows[..120]), day(1, &rows[120..])]
}

#[test]
fn train_takes_the_table_sizes_of_the_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let [d0, d1] = days(dir.path());
    let out = dir.path().join("out");
    let args = ["ingest", "criteo", s(&d0), s(&d1), "--output", s(&out)];
    let v = json(&[&args[..], &["--vocabulary-threshold", "2", "--json"]].concat());
    assert_eq!(v["rows_written"], 200);
    let sizes: Vec<u64> = (v["vocabulary"]["num_embeddings_per_feature"]
        .as_array()
        .unwrap())
    .iter()
    .map(|x| x.as_u64().unwrap())
    .collect();
    assert_eq!(sizes.len(), 26);
    assert!(sizes.iter().all(|&n| n >= 2));
    let total: u64 = sizes.iter().sum();

    let train = out.join("day_0-00000.parquet");
    let eval = out.join("day_1-00000.parquet");
    let base = [
        "train",
        "--data",
        s(&train),
        "--eval-data",
        s(&eval),
        "--preset",
        "kaggle",
    ];
    let err = ember_stderr(&[&base[..], &["--mini-batch-size", "40"]].concat());
    assert!(
        err.contains(&format!("threshold 2): {total} rows in all")),
        "{err}"
    );
    // Fewer rows than the vocabulary numbers: refused, unless folding is asked for.
    let small = vec!["4"; 26].join("-");
    let err = ember_fails(&[&base[..], &["--arch-embedding-size", &small]].concat());
    assert!(err.contains("--max-ind-range"), "{err}");
    ember_stderr(
        &[
            &base[..],
            &["--arch-embedding-size", &small, "--max-ind-range", "4"],
        ]
        .concat(),
    );

    // Data of another numbering beside it is refused, naming both.
    let raw = dir.path().join("raw");
    ember_stderr(&["ingest", "criteo", s(&d1), "--output", s(&raw)]);
    let err = ember_fails(&[
        "train",
        "--data",
        s(&train),
        "--eval-data",
        s(&raw),
        "--preset",
        "kaggle",
    ]);
    assert!(
        err.contains("has a vocabulary") && err.contains("raw"),
        "{err}"
    );

    // Raw ids into the vocabulary's directory, or a day it did not count.
    let err = ember_fails(&["ingest", "criteo", s(&d0), "--output", s(&out)]);
    assert!(err.contains("numbered by a vocabulary"), "{err}");
    let err = ember_fails(&[
        "ingest",
        "criteo",
        s(&d1),
        "--output",
        s(&out),
        "--vocabulary-threshold",
        "2",
    ]);
    assert!(err.contains("another input (day_0)"), "{err}");
}

#[test]
fn a_resume_keeps_one_numbering() {
    let dir = tempfile::tempdir().unwrap();
    let [d0, d1] = days(dir.path());
    let out = dir.path().join("out");
    let args = ["ingest", "criteo", s(&d0), s(&d1), "--output", s(&out)];
    json(&[&args[..], &["--vocabulary-threshold", "3", "--json"]].concat());
    let again = json(
        &[
            &args[..],
            &["--vocabulary-threshold", "3", "--resume", "--json"],
        ]
        .concat(),
    );
    assert_eq!(again["resumed_inputs"].as_array().unwrap().len(), 2);
    let sizes = std::fs::read(out.join("_vocabulary.json")).unwrap();
    let err = ember_fails(&[&args[..], &["--vocabulary-threshold", "2", "--resume"]].concat());
    assert!(err.contains("--vocabulary-threshold 3"), "{err}");
    // Refused before anything changed.
    assert_eq!(std::fs::read(out.join("_vocabulary.json")).unwrap(), sizes);
    assert!(!out.join("_vocabulary.spill").exists());

    // Table sizes of another numbering beside the parts: the loader refuses them.
    let other = dir.path().join("other");
    ember_stderr(
        &[
            &args[..4],
            &["--output", s(&other), "--vocabulary-threshold", "2"],
        ]
        .concat(),
    );
    std::fs::copy(other.join("_vocabulary.json"), out.join("_vocabulary.json")).unwrap();
    let err = ember_fails(&["train", "--data", s(&out), "--preset", "kaggle"]);
    assert!(
        err.contains("its ids were numbered by a vocabulary of threshold 3"),
        "{err}"
    );
    std::fs::write(out.join("_vocabulary.json"), &sizes).unwrap();

    // A vocabulary reads its inputs twice: a directory (or a pipe) is refused.
    let err = ember_fails(&[
        "ingest",
        "criteo",
        s(dir.path()),
        "--output",
        s(&other),
        "--vocabulary-threshold",
        "2",
    ]);
    assert!(err.contains("not a regular file"), "{err}");
    // A day that changed renumbers the ids: both days are redone.
    let text = std::fs::read_to_string(&d1).unwrap();
    std::fs::write(
        &d1,
        text.lines()
            .take(40)
            .map(|l| format!("{l}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let redone = json(
        &[
            &args[..],
            &["--vocabulary-threshold", "3", "--resume", "--json"],
        ]
        .concat(),
    );
    assert_eq!(
        redone["resumed_inputs"].as_array().unwrap().len(),
        0,
        "{redone}"
    );
    assert_eq!(redone["rows_written"], 160);

    // A checkpoint of this numbering does not resume on another.
    let ckpt = dir.path().join("ckpt");
    let train = [
        "train",
        "--data",
        s(&out),
        "--preset",
        "kaggle",
        "--checkpoint-dir",
        s(&ckpt),
    ];
    ember_stderr(&[&train[..], &["--mini-batch-size", "50", "--max-steps", "2"]].concat());
    ember_stderr(&[&args[..], &["--vocabulary-threshold", "2"]].concat());
    let err = ember_fails(&[&train[..], &["--mini-batch-size", "50", "--resume"]].concat());
    assert!(err.contains("row groups or vocabulary"), "{err}");

    // A vocabulary run that did not finish: the loader says so, and raw
    // ids are not ingested beside its parts.
    std::fs::remove_file(out.join("_vocabulary.json")).unwrap();
    let err = ember_fails(&["train", "--data", s(&out), "--preset", "kaggle"]);
    assert!(
        err.contains("did not finish (run it again with --resume)"),
        "{err}"
    );
    let err = ember_fails(&["ingest", "criteo", s(&d0), "--output", s(&out)]);
    assert!(err.contains("of an unfinished run"), "{err}");
}

#[test]
fn a_malformed_line_under_strict_names_its_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let [d0, d1] = days(dir.path());
    let mut text = std::fs::read_to_string(&d1).unwrap();
    text.push_str("1\tnot a line\n");
    std::fs::write(&d1, text).unwrap();
    let out = dir.path().join("out");
    let err = ember_fails(&[
        "ingest",
        "criteo",
        s(&d0),
        s(&d1),
        "--output",
        s(&out),
        "--strict",
        "--vocabulary-threshold",
        "2",
    ]);
    assert!(err.contains("day_1:81"), "{err}");
    assert!(!out.join("_vocabulary.json").exists());
    assert!(!out.join("_vocabulary.spill").exists());
}

/// Every row's ids of each categorical column of `file` (a scalar as one id).
fn bags(file: &std::path::Path) -> Vec<Vec<Vec<i64>>> {
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
        std::fs::File::open(file).unwrap(),
    )
    .unwrap()
    .build()
    .unwrap();
    let mut out = vec![Vec::new(); 26];
    for batch in reader {
        let batch = batch.unwrap();
        for (f, column_bags) in out.iter_mut().enumerate() {
            let column = batch.column_by_name(&format!("cat_{f}")).unwrap();
            for r in 0..column.len() {
                assert!(
                    !column.is_null(r),
                    "cat_{f} row {r}: a vocabulary leaves no null"
                );
                column_bags.push(match column.as_list_opt::<i32>() {
                    Some(lists) => lists.value(r).as_primitive::<Int64Type>().values().to_vec(),
                    None => vec![column.as_primitive::<Int64Type>().value(r)],
                });
            }
        }
    }
    out
}

#[test]
fn multi_hot_expands_the_contiguous_ids_as_mlperf_does() {
    let dir = tempfile::tempdir().unwrap();
    let [d0, d1] = days(dir.path());
    let (voc, mh) = (dir.path().join("voc"), dir.path().join("mh"));
    let args = [
        "ingest",
        "criteo",
        s(&d0),
        s(&d1),
        "--vocabulary-threshold",
        "2",
    ];
    ember_stderr(&[&args[..], &["--output", s(&voc)]].concat());
    let sizes = "3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1";
    let rows = vec!["7"; 26].join(",");
    let expand = ["--multi-hot", sizes, "--multi-hot-rows", &rows];
    ember_stderr(&[&args[..], &["--output", s(&mh)], &expand[..]].concat());
    let sizes: Vec<usize> = sizes.split(',').map(|n| n.parse().unwrap()).collect();
    let tables = MultiHot::mlperf(&sizes, &[7; 26]).unwrap();
    let mut want = Vec::new();
    for day in ["day_0-00000.parquet", "day_1-00000.parquet"] {
        let (ids, got) = (bags(&voc.join(day)), bags(&mh.join(day)));
        for f in 0..26 {
            assert_eq!(ids[f].len(), got[f].len());
            for (id, bag) in ids[f].iter().zip(&got[f]) {
                // MLPerf's rule on the contiguous id: row `id mod rows`.
                tables.expand(f, id[0], &mut want);
                assert_eq!(bag, &want, "{day} cat_{f} id {}", id[0]);
            }
        }
    }
}
