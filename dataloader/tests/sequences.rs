//! Interactions into per-user histories: every input format, the order
//! within a user, and errors that name the file, line and column.

use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch};
use ember_dataloader::sequences::{
    ingest_sequences, read_histories, read_user_item_file, InteractionFormat,
    SequenceIngestOptions, UserHistory,
};
use ember_dataloader::DataError;

fn ingest(dir: &Path, name: &str, text: &str) -> Result<Vec<UserHistory>, DataError> {
    let input = dir.join(name);
    std::fs::write(&input, text).unwrap();
    let out = dir.join("histories.parquet");
    ingest_sequences(&input, &out, &SequenceIngestOptions::default(), &mut |_| {})?;
    read_histories(&out)
}

fn history(items: &[i64], timestamps: &[i64], actions: &[i64]) -> UserHistory {
    UserHistory {
        items: items.to_vec(),
        timestamps: timestamps.to_vec(),
        actions: actions.to_vec(),
    }
}

#[test]
fn csv_with_a_header_groups_by_user_and_sorts_by_time_stably() {
    let dir = tempfile::tempdir().unwrap();
    // MovieLens-20M's header; user 2 first in the file, ties at time 5.
    let text = "userId,movieId,rating,timestamp\n2,10,4,9\n1,7,5,5\n1,8,3,5\n1,6,1,2\n2,11,2,1\n";
    let got = ingest(dir.path(), "ratings.csv", text).unwrap();
    assert_eq!(
        got,
        vec![
            history(&[6, 7, 8], &[2, 5, 5], &[1, 5, 3]),
            history(&[11, 10], &[1, 9], &[2, 4]),
        ]
    );
}

#[test]
fn every_text_format_reads_the_same_histories() {
    let dir = tempfile::tempdir().unwrap();
    let ml = ingest(dir.path(), "ratings.dat", "1::20::5::100\n1::21::3::50\n").unwrap();
    assert_eq!(ml, vec![history(&[21, 20], &[50, 100], &[3, 5])]);
    // No header: user item timestamp, tab-separated.
    let tsv = ingest(dir.path(), "x.tsv", "1\t20\t100\n1\t21\t50\n").unwrap();
    assert_eq!(tsv, vec![history(&[21, 20], &[50, 100], &[])]);
    // SASRec's files: the line number is the time.
    let txt = ingest(dir.path(), "x.txt", "3 5\n1 4\n3 6\n").unwrap();
    assert_eq!(
        txt,
        vec![history(&[4], &[2], &[]), history(&[5, 6], &[1, 3], &[])]
    );
    let path = dir.path().join("x.txt");
    assert_eq!(read_user_item_file(&path).unwrap(), txt);
}

#[test]
fn parquet_interactions_of_any_integer_width() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("events.parquet");
    let columns: Vec<(&str, ArrayRef)> = vec![
        ("user_id", Arc::new(Int32Array::from(vec![9, 9, 4]))),
        ("item_id", Arc::new(Int64Array::from(vec![1, 2, 3]))),
        ("timestamp", Arc::new(Int64Array::from(vec![30, 10, 20]))),
    ];
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let file = std::fs::File::create(&input).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let out = dir.path().join("h.parquet");
    let summary =
        ingest_sequences(&input, &out, &SequenceIngestOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(summary.format, InteractionFormat::Parquet);
    assert_eq!((summary.users, summary.items, summary.max_item), (2, 3, 3));
    assert_eq!(
        read_histories(&out).unwrap(),
        vec![history(&[3], &[20], &[]), history(&[2, 1], &[10, 30], &[])]
    );
}

#[test]
fn bad_lines_are_named_and_leave_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "a.csv",
            "user,item\n1,2\n1,x\n",
            "a.csv:3: item 'x' is not an integer",
        ),
        ("b.csv", "user,item\n1,-2\n", "b.csv:2: item -2 is negative"),
        (
            "c.csv",
            "name,when\n1,2\n",
            "c.csv:1: the header (name, when) has no user column",
        ),
        ("d.dat", "1::2\n", "d.dat:1: no timestamp column"),
        ("e.txt", "", "e.txt: no interactions"),
        ("f.txt", "1 2 3\n", "f.txt:1: '1 2 3' is not `user item`"),
    ];
    for (name, text, expected) in cases {
        let err = ingest(dir.path(), name, text).unwrap_err().to_string();
        assert!(err.contains(expected), "{name}: {err}");
        assert!(!dir.path().join("histories.parquet").exists(), "{name}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
    let unknown = ingest(dir.path(), "f.json", "{}").unwrap_err().to_string();
    assert!(unknown.contains("--format"), "{unknown}");
}

#[test]
fn a_file_that_is_not_histories_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.parquet");
    let batch = RecordBatch::try_from_iter(vec![(
        "items",
        Arc::new(Int64Array::from(vec![1])) as ArrayRef,
    )])
    .unwrap();
    let file = std::fs::File::create(&path).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let err = read_histories(&path).unwrap_err().to_string();
    assert!(err.contains("column 'timestamps': missing"), "{err}");
}

#[test]
fn no_actions_leaves_out_a_column_it_could_not_read() {
    // MovieLens-20M's half-star ratings are not integer actions.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("ratings.csv");
    std::fs::write(
        &input,
        "userId,movieId,rating,timestamp\n1,10,3.5,9\n1,11,4.0,5\n",
    )
    .unwrap();
    let out = dir.path().join("h.parquet");
    let err = ingest_sequences(&input, &out, &SequenceIngestOptions::default(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ratings.csv:2: action '3.5' is not an integer (--no-actions"),
        "{err}"
    );
    let options = SequenceIngestOptions {
        actions: false,
        ..SequenceIngestOptions::default()
    };
    let summary = ingest_sequences(&input, &out, &options, &mut |_| {}).unwrap();
    assert!(!summary.actions);
    assert_eq!(
        read_histories(&out).unwrap(),
        vec![history(&[11, 10], &[5, 9], &[])]
    );
}

#[test]
fn histories_written_keep_their_actions_beside_an_empty_history() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("h.parquet");
    let users = vec![history(&[1, 2], &[3, 4], &[1, 0]), history(&[], &[], &[])];
    let options = SequenceIngestOptions::default();
    ember_dataloader::sequences::write_histories(&users, None, &out, &options).unwrap();
    assert_eq!(read_histories(&out).unwrap(), users);
    let err = ember_dataloader::sequences::write_histories(&users, Some(&[7]), &out, &options)
        .unwrap_err()
        .to_string();
    assert!(err.contains("one per history (2)"), "{err}");
}
