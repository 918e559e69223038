//! Datasets of other schemas than Criteo's: a dataset spec's columns read
//! exactly (float and int dense columns with their transforms, a weighted
//! list column, a shared table), and bad columns named.

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{Float32Builder, Int64Builder, ListBuilder};
use arrow_array::{ArrayRef, BooleanArray, Float64Array, Int32Array, Int64Array, RecordBatch};
use ember_dataloader::{DatasetSpec, Loader, LoaderConfig};
use ember_sparse::{EmbeddingBagCollection, TableOptimizer};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;

const SPEC: &str = r#"{
    "label": "clicked",
    "dense": [{"column": "price", "transform": "log1p"}, {"column": "score"}, {"column": "age"}],
    "dense_transform": "identity",
    "sparse": [
        {"column": "history", "weights": "history_weights"},
        {"column": "item"},
        {"column": "user", "feature": "user_id"}
    ],
    "tables": [
        {"name": "t_item", "num_embeddings": 100, "embedding_dim": 4, "feature_names": ["history", "item"]},
        {"name": "t_user", "num_embeddings": 7, "embedding_dim": 4, "feature_names": ["user_id"], "pooling": "mean"}
    ]
}"#;

/// Row `r`'s history: `r % 4` ids `r*10 + k`, weights `k + 0.5`; a null
/// history every 5th row.
fn history(r: usize) -> Option<Vec<(i64, f32)>> {
    (r % 5 != 4).then(|| {
        (0..(r % 4) as i64)
            .map(|k| (r as i64 * 10 + k, k as f32 + 0.5))
            .collect()
    })
}

fn columns(rows: usize) -> Vec<(&'static str, ArrayRef)> {
    let mut ids = ListBuilder::new(Int64Builder::new());
    let mut weights = ListBuilder::new(Float32Builder::new());
    for r in 0..rows {
        match history(r) {
            Some(h) => {
                for (id, w) in h {
                    ids.values().append_value(id);
                    weights.values().append_value(w);
                }
                ids.append(true);
                weights.append(true);
            }
            None => {
                ids.append(false);
                weights.append(false);
            }
        }
    }
    let clicked: BooleanArray = (0..rows).map(|r| Some(r % 3 == 0)).collect();
    let price: Float64Array = (0..rows).map(|r| Some(r as f64 * 1.5)).collect();
    let score: Float64Array = (0..rows)
        .map(|r| (r % 7 != 0).then_some(r as f64 / 8.0))
        .collect();
    let age: Int32Array = (0..rows).map(|r| Some(20 + r as i32)).collect();
    let item: Int64Array = (0..rows)
        .map(|r| (r % 6 != 5).then_some(1000 + r as i64))
        .collect();
    let user: Int64Array = (0..rows).map(|r| Some(r as i64)).collect();
    vec![
        ("clicked", Arc::new(clicked)),
        ("price", Arc::new(price)),
        ("score", Arc::new(score)),
        ("age", Arc::new(age)),
        ("history", Arc::new(ids.finish())),
        ("history_weights", Arc::new(weights.finish())),
        ("item", Arc::new(item)),
        ("user", Arc::new(user)),
    ]
}

fn write(path: &Path, columns: Vec<(&'static str, ArrayRef)>, row_group: usize) {
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(row_group))
        .build();
    let mut w = ArrowWriter::try_new(
        std::fs::File::create(path).unwrap(),
        batch.schema(),
        Some(props),
    )
    .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

fn spec() -> DatasetSpec {
    serde_json::from_str(SPEC).unwrap()
}

#[test]
fn a_spec_reads_its_columns_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clicks.parquet");
    let rows = 23;
    write(&path, columns(rows), 5);
    let loader = Loader::open(&[path], LoaderConfig::new(8, spec())).unwrap();
    let mut row = 0;
    for batch in loader.epoch(0, 0) {
        let b = batch.unwrap();
        assert_eq!(b.dense.cols(), 3);
        assert_eq!(b.sparse.keys(), ["history", "item", "user_id"]);
        let weights = b.sparse.weights().expect("a weighted spec gives weights");
        let offsets = b.sparse.offsets();
        let n = b.size();
        for s in 0..n {
            let r = row + s;
            assert_eq!(b.labels[s], (r % 3 == 0) as u8 as f32, "row {r}");
            let dense = &b.dense.data()[s * 3..s * 3 + 3];
            assert_eq!(dense[0], (r as f32 * 1.5).ln_1p(), "row {r}");
            assert_eq!(dense[1], if r % 7 == 0 { 0.0 } else { r as f32 / 8.0 });
            assert_eq!(dense[2], 20.0 + r as f32);
            let bag = |f: usize| offsets[f * n + s]..offsets[f * n + s + 1];
            let h = history(r).unwrap_or_default();
            let ids: Vec<i64> = h.iter().map(|(id, _)| id % 100).collect();
            assert_eq!(&b.sparse.values()[bag(0)], &ids[..], "row {r}");
            let ws: Vec<f32> = h.iter().map(|(_, w)| *w).collect();
            assert_eq!(&weights[bag(0)], &ws[..], "row {r}");
            let item: Vec<i64> = (r % 6 != 5)
                .then_some((1000 + r as i64) % 100)
                .into_iter()
                .collect();
            assert_eq!(&b.sparse.values()[bag(1)], &item[..], "row {r}");
            // Unweighted features of a weighted batch weigh 1.
            assert!(weights[bag(1)].iter().all(|&w| w == 1.0));
            assert_eq!(&b.sparse.values()[bag(2)], &[r as i64 % 7]);
        }
        row += n;
    }
    assert_eq!(row, rows);
}

#[test]
fn weights_from_the_data_reach_the_kernels() {
    // The loader's batch through the spec's own tables: the history's
    // sum-pooled rows are weighted by its weight column.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clicks.parquet");
    write(&path, columns(12), 12);
    let spec = spec();
    let loader = Loader::open(&[path], LoaderConfig::new(12, spec.clone())).unwrap();
    let b = loader.epoch(0, 0).next().unwrap().unwrap();
    let ebc = EmbeddingBagCollection::new(spec.tables.clone(), TableOptimizer::None, 3).unwrap();
    let pooled = ebc.forward(&b.sparse).unwrap();
    let table = &ebc.tables()[0];
    let dim = 4;
    let k = pooled.keys().iter().position(|k| k == "history").unwrap();
    for s in 0..b.size() {
        let h = history(s).unwrap_or_default();
        let mut want = vec![0f32; dim];
        for (id, w) in &h {
            let row = &table.weights()[(id % 100) as usize * dim..][..dim];
            for (x, r) in want.iter_mut().zip(row) {
                *x += w * r;
            }
        }
        let got = pooled.get(s, k);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6, "row {s}: {got:?} vs {want:?}");
        }
    }
}

#[test]
fn bad_specs_and_columns_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str, cols: Vec<(&'static str, ArrayRef)>, spec: DatasetSpec| {
        let path = dir.path().join(name);
        write(&path, cols, 5);
        let loader = Loader::open(&[path], LoaderConfig::new(8, spec));
        match loader {
            Err(e) => e.to_string(),
            Ok(l) => match l.epoch(0, 0).find_map(Result::err) {
                Some(e) => e.to_string(),
                None => panic!("{name} loads"),
            },
        }
    };
    // A missing column, a column of the wrong type.
    let mut cols = columns(10);
    cols.retain(|(n, _)| *n != "score");
    let e = open("missing.parquet", cols, spec());
    assert!(
        e.contains("missing.parquet") && e.contains("'score'") && e.contains("missing"),
        "{e}"
    );
    let mut cols = columns(10);
    cols[2].1 = Arc::new(arrow_array::StringArray::from(vec!["x"; 10]));
    let e = open("string.parquet", cols, spec());
    assert!(
        e.contains("string.parquet") && e.contains("'score'") && e.contains("Utf8"),
        "{e}"
    );
    // Weights that do not match the ids' lengths name the row.
    let mut cols = columns(10);
    let mut w = ListBuilder::new(Float32Builder::new());
    for _ in 0..10 {
        w.values().append_value(1.0);
        w.append(true);
    }
    cols[5].1 = Arc::new(w.finish());
    let e = open("weights.parquet", cols, spec());
    assert!(
        e.contains("weights.parquet") && e.contains("'history_weights'") && e.contains("row 0"),
        "{e}"
    );
    // A label other than 0/1, a NaN dense value.
    let mut cols = columns(10);
    cols[0].1 = Arc::new(Int64Array::from((0..10).collect::<Vec<i64>>()));
    let e = open("label.parquet", cols, spec());
    assert!(
        e.contains("'clicked'") && e.contains("row 2") && e.contains("not 0 or 1"),
        "{e}"
    );
    let mut cols = columns(10);
    cols[2].1 = Arc::new(Float64Array::from(vec![f64::NAN; 10]));
    let e = open("nan.parquet", cols, spec());
    assert!(
        e.contains("'score'") && e.contains("row 0") && e.contains("NaN"),
        "{e}"
    );
    // Specs that do not hold together.
    let mut s = spec();
    s.tables[1].feature_names.push("history".into());
    assert!(s
        .validate()
        .unwrap_err()
        .to_string()
        .contains("'history' is in two tables"));
    let mut s = spec();
    s.tables.pop();
    assert!(s
        .validate()
        .unwrap_err()
        .to_string()
        .contains("'user_id' is in no table"));
    let path = dir.path().join("spec.json");
    std::fs::write(&path, SPEC.replace("\"label\"", "\"lable\"")).unwrap();
    let e = DatasetSpec::from_file(&path).unwrap_err().to_string();
    assert!(e.contains("spec.json") && e.contains("lable"), "{e}");
}
