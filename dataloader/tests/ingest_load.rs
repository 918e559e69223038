//! Ingest a generated Criteo TSV (with malformed lines), load it back, and
//! check the exact tensors.

use std::io::Write;
use std::path::{Path, PathBuf};

use ember_dataloader::ingest::{ingest_criteo, IngestOptions};
use ember_dataloader::schema::{NUM_CAT, NUM_INT};
use ember_dataloader::writer::{Bag, Codec, CriteoBatchBuilder, ParquetSink, SinkOptions};
use ember_dataloader::{DataError, Loader, LoaderConfig};
use ember_sparse::EmbeddingBagConfig;

/// Good line `i`: label i%2, int_j = i*10+j except int_1 missing on odd
/// rows, cat_j = hex(i*1000+j) except cat_2 missing on rows divisible by 3.
fn good_line(i: usize) -> String {
    let mut f = vec![(i % 2).to_string()];
    for j in 0..NUM_INT {
        f.push(if j == 1 && i % 2 == 1 {
            String::new()
        } else {
            (i * 10 + j).to_string()
        });
    }
    for j in 0..NUM_CAT {
        f.push(if j == 2 && i.is_multiple_of(3) {
            String::new()
        } else {
            format!("{:x}", i * 1000 + j)
        });
    }
    f.join("\t")
}

const GOOD: usize = 7;

/// 7 good lines with 4 malformed ones between them; returns the path.
fn write_fixture(dir: &Path, name: &str, gzip: bool) -> PathBuf {
    let mut lines: Vec<String> = (0..GOOD).map(good_line).collect();
    lines.insert(2, "1\t2\t3".into()); // line 3: field count
    lines.insert(4, good_line(0).replacen('0', "7", 1)); // line 5: label
    lines.insert(6, good_line(4).replace("\t41\t", "\t4x\t")); // line 7: integer
    lines.insert(8, good_line(2).replace("\t7d1\t", "\tq7\t")); // line 9: categorical
    let text = lines.join("\n") + "\n";
    let path = dir.join(name);
    let file = std::fs::File::create(&path).unwrap();
    if gzip {
        let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
        gz.write_all(text.as_bytes()).unwrap();
        gz.finish().unwrap();
    } else {
        let mut file = file;
        file.write_all(text.as_bytes()).unwrap();
    }
    path
}

fn options(row_group_size: usize, rows_per_file: Option<u64>) -> IngestOptions {
    IngestOptions {
        sink: SinkOptions {
            rows_per_file,
            row_group_size,
            compression: Codec::Zstd,
        },
        ..Default::default()
    }
}

/// `options` with `resume` on.
fn resuming(options: IngestOptions) -> IngestOptions {
    IngestOptions {
        resume: true,
        ..options
    }
}

fn loader_config(batch: usize, rows: usize) -> LoaderConfig {
    let tables: Vec<EmbeddingBagConfig> = (0..NUM_CAT)
        .map(|i| EmbeddingBagConfig::new(&format!("t_cat_{i}"), rows, 4, &[&format!("cat_{i}")]))
        .collect();
    LoaderConfig::criteo(batch, &tables)
}

#[test]
fn ingest_then_load_gives_the_exact_tensors() {
    let dir = tempfile::tempdir().unwrap();
    for gzip in [false, true] {
        let input = write_fixture(
            dir.path(),
            if gzip { "day_1.gz" } else { "day_0.tsv" },
            gzip,
        );
        let out = dir.path().join(format!("out_{gzip}"));
        let summary = ingest_criteo(
            std::slice::from_ref(&input),
            &out,
            &options(3, Some(5)),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(summary.rows_written, GOOD as u64);
        assert_eq!(summary.lines_rejected, 4);
        for kind in ["field_count", "label", "integer", "categorical"] {
            assert_eq!(summary.rejected[kind], 1, "{kind}");
        }
        let lines: Vec<u64> = summary.first_rejected.iter().map(|r| r.line).collect();
        assert_eq!(lines, [3, 5, 7, 9]);
        assert!(
            summary.first_rejected[3].reason.contains("cat_"),
            "{:?}",
            summary.first_rejected[3]
        );
        let nulls = |c: &str| summary.nulls.iter().find(|n| n.column == c).unwrap().nulls;
        assert_eq!(nulls("int_1"), 3); // rows 1, 3, 5
        assert_eq!(nulls("cat_2"), 3); // rows 0, 3, 6
        assert_eq!(nulls("int_0"), 0);
        assert_eq!(summary.files.len(), 2, "5 rows per file");
        assert!(summary.bytes_in > 0 && summary.bytes_out > 0);

        let loader = Loader::open(std::slice::from_ref(&out), loader_config(4, 1000)).unwrap();
        assert_eq!(loader.dataset().num_rows(), GOOD as u64);
        let batches: Vec<_> = loader.epoch(0, 0).collect::<Result<_, _>>().unwrap();
        assert_eq!(batches.iter().map(|b| b.size()).collect::<Vec<_>>(), [4, 3]);
        let mut row = 0;
        for b in &batches {
            for s in 0..b.size() {
                let i = row + s;
                assert_eq!(b.labels[s], (i % 2) as f32);
                for j in 0..NUM_INT {
                    let raw = if j == 1 && i % 2 == 1 { 0 } else { i * 10 + j };
                    assert_eq!(
                        b.dense.data()[s * NUM_INT + j],
                        (raw as f32).ln_1p(),
                        "row {i} int_{j}"
                    );
                }
                for j in 0..NUM_CAT {
                    let bag = b.sparse.get(&format!("cat_{j}")).unwrap();
                    let want: Vec<i64> = if j == 2 && i % 3 == 0 {
                        vec![]
                    } else {
                        vec![((i * 1000 + j) % 1000) as i64]
                    };
                    assert_eq!(bag.bag(s), &want[..], "row {i} cat_{j}");
                }
            }
            row += b.size();
        }
        let dropped = Loader::open(
            &[out],
            LoaderConfig {
                drop_last: true,
                ..loader_config(4, 1000)
            },
        )
        .unwrap();
        assert_eq!(dropped.epoch(0, 0).count(), 1);
        assert_eq!(dropped.batches_per_epoch(0), 1);
    }
}

#[test]
fn strict_stops_at_the_first_bad_line_and_leaves_no_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    let input = write_fixture(dir.path(), "day_0", false);
    let out = dir.path().join("out");
    let opts = IngestOptions {
        strict: true,
        ..options(1, None)
    };
    let err = ingest_criteo(std::slice::from_ref(&input), &out, &opts, &mut |_| {}).unwrap_err();
    match &err {
        DataError::Malformed { path, line, .. } => {
            assert_eq!(path, &input);
            assert_eq!(*line, 3);
        }
        e => panic!("unexpected {e}"),
    }
    assert!(err.to_string().contains("day_0:3:"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // With a part per row, two parts were finished before the bad line: they go too.
    let opts = IngestOptions {
        strict: true,
        ..options(1, Some(1))
    };
    assert!(ingest_criteo(std::slice::from_ref(&input), &out, &opts, &mut |_| {}).is_err());
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn resume_skips_complete_inputs_and_redoes_interrupted_ones() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_fixture(dir.path(), "a.tsv", false);
    let b = write_fixture(dir.path(), "b.tsv", false);
    let out = dir.path().join("out");
    let first = ingest_criteo(
        &[a.clone(), b.clone()],
        &out,
        &options(4, None),
        &mut |_| {},
    )
    .unwrap();
    // Pretend `b` was interrupted: its marker is gone, a temporary file remains.
    std::fs::remove_file(out.join("_b.ingest.json")).unwrap();
    std::fs::write(out.join(".b-00001.parquet.tmp"), b"partial").unwrap();
    let opts = resuming(options(4, None));
    let second = ingest_criteo(&[a.clone(), b.clone()], &out, &opts, &mut |_| {}).unwrap();
    assert_eq!(second.resumed_inputs, vec![a]);
    assert_eq!(second.rows_written, first.rows_written);
    assert_eq!(second.files, first.files);
    assert!(!out.join(".b-00001.parquet.tmp").exists());
}

/// Writes `rows` synthetic rows with `cat_0` multi-hot (row r has r % 3 ids).
fn write_multi_hot(dir: &Path, rows: usize, row_group_size: usize) {
    let mut multi = [false; NUM_CAT];
    multi[0] = true;
    let mut builder = CriteoBatchBuilder::new(&multi);
    let opts = SinkOptions {
        rows_per_file: None,
        row_group_size,
        compression: Codec::Snappy,
    };
    let mut sink = ParquetSink::new(dir, "mh", builder.schema().clone(), opts);
    for r in 0..rows {
        let ids: Vec<i64> = (0..(r % 3) as i64).map(|k| r as i64 * 10 + k).collect();
        builder.push_row((r % 2) as i8, &[Some(r as i32); NUM_INT], |i| match i {
            0 => Bag::Many(&ids),
            _ => Bag::One(r as i64),
        });
    }
    sink.write(&builder.finish()).unwrap();
    sink.finish().unwrap();
}

#[test]
fn multi_hot_lists_shuffling_sharding_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    write_multi_hot(dir.path(), 50, 4);
    let config = loader_config(6, 1 << 20);
    let plain = Loader::open(&[dir.path().to_path_buf()], config.clone()).unwrap();
    let all: Vec<_> = plain.epoch(0, 0).collect::<Result<_, _>>().unwrap();
    let first = &all[0];
    for s in 0..6 {
        let want: Vec<i64> = (0..(s % 3) as i64).map(|k| s as i64 * 10 + k).collect();
        assert_eq!(first.sparse.get("cat_0").unwrap().bag(s), &want[..]);
    }
    // Shuffled epochs: a permutation of the row groups, reproducible, and
    // different between epochs; two ranks split the row groups.
    let shuffled = LoaderConfig {
        shuffle_seed: Some(9),
        threads: 3,
        ..config.clone()
    };
    let loader = Loader::open(&[dir.path().to_path_buf()], shuffled.clone()).unwrap();
    let labels = |l: &Loader, e, skip| -> Vec<Vec<f32>> {
        l.epoch(e, skip).map(|b| b.unwrap().labels).collect()
    };
    let dense_order = |l: &Loader, e| -> Vec<f32> {
        l.epoch(e, 0)
            .flat_map(|b| {
                let b = b.unwrap();
                (0..b.size())
                    .map(|s| b.dense.data()[s * NUM_INT])
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let e0 = dense_order(&loader, 0);
    assert_eq!(e0, dense_order(&loader, 0));
    assert_ne!(e0, dense_order(&loader, 1));
    let mut sorted = e0.clone();
    sorted.sort_by(f32::total_cmp);
    assert_eq!(sorted, dense_order(&plain, 0));
    // Resuming after 3 batches gives the rest of the same epoch.
    assert_eq!(labels(&loader, 1, 3), labels(&loader, 1, 0)[3..].to_vec());
    let mut ranks: Vec<f32> = (0..2)
        .flat_map(|rank| {
            let c = LoaderConfig {
                rank,
                world_size: 2,
                ..shuffled.clone()
            };
            dense_order(&Loader::open(&[dir.path().to_path_buf()], c).unwrap(), 0)
        })
        .collect();
    ranks.sort_by(f32::total_cmp);
    assert_eq!(ranks, sorted);
}

#[test]
fn bad_files_and_columns_are_named() {
    let dir = tempfile::tempdir().unwrap();
    write_multi_hot(dir.path(), 10, 4);
    let path = dir.path().join("mh-00000.parquet");
    let open = |c: LoaderConfig| {
        Loader::open(std::slice::from_ref(&path), c)
            .err()
            .unwrap()
            .to_string()
    };

    let mut missing = loader_config(4, 10);
    missing.spec.sparse[3].column = "cat_99".into();
    missing.spec.sparse[3].feature = Some("cat_3".into());
    let e = open(missing);
    assert!(
        e.contains("mh-00000.parquet") && e.contains("cat_99") && e.contains("missing"),
        "{e}"
    );

    let mut wrong = loader_config(4, 10);
    wrong.spec.label = "cat_0".into();
    let e = open(wrong);
    assert!(
        e.contains("cat_0") && e.contains("List") && e.contains("Int8"),
        "{e}"
    );

    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = open(loader_config(4, 10));
    assert!(
        e.contains("mh-00000.parquet") && e.contains("not a readable Parquet"),
        "{e}"
    );

    std::fs::write(&path, b"hello").unwrap();
    assert!(open(loader_config(4, 10)).contains("mh-00000.parquet"));
}

#[test]
fn overlong_lines_are_rejected_without_being_held() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("day_0");
    let mut text = good_line(0) + "\n";
    text.push_str(&"x".repeat(ember_dataloader::ingest::MAX_LINE_BYTES * 3));
    text.push('\n');
    text.push_str(&(good_line(1) + "\n"));
    std::fs::write(&path, text).unwrap();
    let s = ingest_criteo(
        &[path],
        &dir.path().join("out"),
        &options(4, None),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(s.rows_written, 2);
    assert_eq!(s.rejected["too_long"], 1);
    assert_eq!(s.first_rejected[0].line, 2);
}

#[test]
fn labels_other_than_0_or_1_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut builder = CriteoBatchBuilder::new(&[false; NUM_CAT]);
    let opts = SinkOptions {
        rows_per_file: None,
        row_group_size: 8,
        compression: Codec::None,
    };
    let mut sink = ParquetSink::new(dir.path(), "bad", builder.schema().clone(), opts);
    for label in [0, 1, 5] {
        builder.push_row(label, &[Some(1); NUM_INT], |_| Bag::One(1));
    }
    sink.write(&builder.finish()).unwrap();
    sink.finish().unwrap();
    let loader = Loader::open(&[dir.path().to_path_buf()], loader_config(2, 10)).unwrap();
    let err = loader.epoch(0, 0).find_map(|b| b.err()).expect("an error");
    let text = err.to_string();
    assert!(
        text.contains("label") && text.contains("row 2") && text.contains("5"),
        "{text}"
    );
}

#[test]
fn resume_redoes_an_input_that_changed_since_its_marker() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_fixture(dir.path(), "a.tsv", false);
    let out = dir.path().join("out");
    let opts = resuming(options(4, None));
    let first = ingest_criteo(std::slice::from_ref(&a), &out, &opts, &mut |_| {}).unwrap();
    assert_eq!(first.rows_written, GOOD as u64);
    let again = ingest_criteo(std::slice::from_ref(&a), &out, &opts, &mut |_| {}).unwrap();
    assert_eq!(again.resumed_inputs, vec![a.clone()]);
    // More lines, and a later modification time.
    let mut text = std::fs::read_to_string(&a).unwrap();
    text.push_str(&(good_line(8) + "\n"));
    std::fs::write(&a, text).unwrap();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&a)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let redone = ingest_criteo(std::slice::from_ref(&a), &out, &opts, &mut |_| {}).unwrap();
    assert!(redone.resumed_inputs.is_empty());
    assert_eq!(redone.rows_written, GOOD as u64 + 1);
}

#[test]
fn an_input_that_is_not_criteo_is_an_error_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let spaces = dir.path().join("spaces.txt");
    let lines: Vec<String> = (0..20).map(|i| good_line(i).replace('\t', " ")).collect();
    std::fs::write(&spaces, lines.join("\n") + "\n").unwrap();
    let binary = dir.path().join("binary");
    std::fs::write(
        &binary,
        (0..5000u32)
            .map(|i| (i * 7919 % 251) as u8)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let empty = dir.path().join("empty.tsv");
    std::fs::write(&empty, b"").unwrap();
    for (input, says) in [
        (&spaces, "20 of 20 lines rejected"),
        (&binary, "lines rejected"),
        (&empty, "no lines"),
    ] {
        let e = ingest_criteo(
            std::slice::from_ref(input),
            &out,
            &options(4, None),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&input.display().to_string()) && e.contains(says),
            "{e}"
        );
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "{e}");
    }
    // Under the limit (4 of 11 rejected) is fine; the user may allow anything.
    let mixed = write_fixture(dir.path(), "mixed.tsv", false);
    let strict = IngestOptions {
        max_reject_fraction: Some(0.3),
        ..options(4, None)
    };
    assert!(ingest_criteo(std::slice::from_ref(&mixed), &out, &strict, &mut |_| {}).is_err());
    assert!(ingest_criteo(&[mixed], &out, &options(4, None), &mut |_| {}).is_ok());
    let anything = IngestOptions {
        max_reject_fraction: Some(1.0),
        ..options(4, None)
    };
    let s = ingest_criteo(&[empty], &out, &anything, &mut |_| {}).unwrap();
    assert_eq!(s.rows_written, 0);
}

#[test]
fn parts_of_an_unfinished_or_earlier_ingest_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_fixture(dir.path(), "a.tsv", false);
    let b = write_fixture(dir.path(), "b.tsv", false);
    let out = dir.path().join("out");
    let both = [a.clone(), b.clone()];
    ingest_criteo(&both, &out, &options(2, Some(2)), &mut |_| {}).unwrap();
    let open = || Loader::open(std::slice::from_ref(&out), loader_config(2, 100));
    assert!(open().is_ok());
    // A kill after b's first parts, before its marker: the loader refuses.
    std::fs::remove_file(out.join("_b.ingest.json")).unwrap();
    let e = open().err().unwrap().to_string();
    assert!(
        e.contains("b-00000.parquet") && e.contains("--resume"),
        "{e}"
    );
    let opts = resuming(options(2, Some(2)));
    ingest_criteo(&both, &out, &opts, &mut |_| {}).unwrap();
    assert!(open().is_ok());
    // A part that the marker does not list: left by an earlier, longer run.
    std::fs::copy(out.join("a-00000.parquet"), out.join("a-00009.parquet")).unwrap();
    let e = open().err().unwrap().to_string();
    assert!(
        e.contains("a-00009.parquet") && e.contains("_a.ingest.json"),
        "{e}"
    );
    std::fs::remove_file(out.join("a-00009.parquet")).unwrap();
    // The same directory twice would read every row twice.
    let e = Loader::open(&[out.clone(), out.join(".")], loader_config(2, 100))
        .err()
        .unwrap();
    assert!(e.to_string().contains("given twice"), "{e}");
}

#[test]
fn resume_keeps_the_output_of_an_earlier_version_when_the_input_is_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_fixture(dir.path(), "a.tsv", false);
    let out = dir.path().join("out");
    ingest_criteo(
        std::slice::from_ref(&a),
        &out,
        &options(4, None),
        &mut |_| {},
    )
    .unwrap();
    // Earlier versions wrote `a.ingest.json`, without the input's stamp.
    let mut marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("_a.ingest.json")).unwrap()).unwrap();
    marker.as_object_mut().unwrap().remove("input_stamp");
    std::fs::write(out.join("a.ingest.json"), marker.to_string()).unwrap();
    std::fs::remove_file(out.join("_a.ingest.json")).unwrap();
    let opts = resuming(options(4, None));
    let s = ingest_criteo(std::slice::from_ref(&a), &out, &opts, &mut |_| {}).unwrap();
    assert_eq!(s.resumed_inputs, vec![a]);
    assert!(out.join("_a.ingest.json").is_file() && !out.join("a.ingest.json").exists());
}
