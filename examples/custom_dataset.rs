//! A click log of the user's own schema, from Parquet to AUC: the log is
//! written with the `parquet` crate (a boolean label, a float and an int
//! dense column, a list-of-ids history and two id columns), described by a
//! `DatasetSpec` (the history and the candidate item share one table), read
//! by Ember's `Loader`, and trained on by a DLRM from the builder.
//!
//! `cargo run --release --example custom_dataset`

use std::path::Path;
use std::sync::Arc;

use arrow_array::builder::{Int64Builder, ListBuilder};
use arrow_array::{ArrayRef, BooleanArray, Float64Array, Int32Array, Int64Array, RecordBatch};
use ember::prelude::*;
use ember::sparse::rng::Rng;
use parquet::arrow::ArrowWriter;

const USERS: u64 = 400;
const ITEMS: u64 = 800;
/// Users and items fall into this many taste groups; a user clicks items
/// of their own group.
const GROUPS: u64 = 8;

/// Writes `rows` impressions to `path`: a user, a candidate item, the
/// user's last few items (all of their group), the item's price and the
/// user's age; clicked when the item is of the user's group.
fn write_log(path: &Path, rows: usize, seed: u64) -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = Rng::new(seed);
    let group = |id: u64| id % GROUPS;
    let item_of = |rng: &mut Rng, g: u64| rng.below(ITEMS / GROUPS) * GROUPS + g;
    let (mut users, mut items, mut clicked) = (Vec::new(), Vec::new(), Vec::new());
    let (mut prices, mut ages) = (Vec::new(), Vec::new());
    let mut history = ListBuilder::new(Int64Builder::new());
    for _ in 0..rows {
        let user = rng.below(USERS);
        let item = rng.below(ITEMS);
        for _ in 0..1 + rng.below(4) {
            history
                .values()
                .append_value(item_of(&mut rng, group(user)) as i64);
        }
        history.append(true);
        users.push(user as i64);
        items.push(item as i64);
        clicked.push(group(item) == group(user));
        prices.push(1.0 + 99.0 * rng.next_f32() as f64);
        ages.push(18 + rng.below(60) as i32);
    }
    let columns: Vec<(&str, ArrayRef)> = vec![
        ("clicked", Arc::new(BooleanArray::from(clicked))),
        ("price", Arc::new(Float64Array::from(prices))),
        ("age", Arc::new(Int32Array::from(ages))),
        ("history", Arc::new(history.finish())),
        ("item", Arc::new(Int64Array::from(items))),
        ("user", Arc::new(Int64Array::from(users))),
    ];
    let batch = RecordBatch::try_from_iter(columns)?;
    let mut writer = ArrowWriter::try_new(std::fs::File::create(path)?, batch.schema(), None)?;
    writer.write(&batch)?;
    writer.close()?;
    Ok(())
}

/// The log's columns for Ember: which is the label, which are dense (and
/// their transforms), which are ids and which table each looks up.
fn spec() -> DatasetSpec {
    let dense = |column: &str, transform| DenseColumn {
        column: column.into(),
        transform,
    };
    let ids = |column: &str| SparseColumn {
        column: column.into(),
        feature: None,
        weights: None,
    };
    DatasetSpec {
        label: "clicked".into(),
        dense: vec![
            dense("price", Some(DenseTransform::Log1p)),
            dense("age", None), // the spec's dense_transform: log1p
        ],
        dense_transform: DenseTransform::default(),
        sparse: vec![ids("history"), ids("item"), ids("user")],
        tables: vec![
            // The history's items and the candidate read one table, as
            // TorchRec's `feature_names` allow; a history is a mean bag.
            EmbeddingBagConfig::new("t_item", ITEMS as usize, 16, &["history", "item"])
                .with_pooling(PoolingType::Mean),
            EmbeddingBagConfig::new("t_user", USERS as usize, 16, &["user"]),
        ],
        id_transform: IdTransform::default(),
    }
}

/// Writes a training and a test log into `dir`, trains a DLRM on the first
/// for `epochs` epochs and returns its metrics on the second.
fn run(dir: &Path, epochs: u64) -> Result<Metrics, Box<dyn std::error::Error>> {
    let (train_file, test_file) = (dir.join("train.parquet"), dir.join("test.parquet"));
    write_log(&train_file, 20_000, 1)?;
    write_log(&test_file, 4_000, 2)?;
    let spec = spec();
    spec.validate()?;
    let config = DlrmConfig {
        tables: spec.tables.clone(),
        bottom_mlp: vec![spec.num_dense(), 32, 16],
        top_mlp: vec![32, 1],
        interaction: InteractionType::Dot,
    };
    let mut model = Dlrm::builder(config)
        .optimizers(
            TableOptimizer::rowwise_adagrad(0.1),
            DenseOptimizerConfig::adagrad(0.1),
        )
        .seed(7)
        .build()?;
    let loader = |file: &Path, shuffle| {
        let mut config = LoaderConfig::new(256, spec.clone());
        config.shuffle_seed = shuffle;
        Loader::open(&[file.to_path_buf()], config)
    };
    let (train, test) = (loader(&train_file, Some(3))?, loader(&test_file, None)?);
    let trainer = Trainer::new(
        TrainerConfig {
            epochs,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let options = FitOptions {
        eval: Some(&test),
        ..FitOptions::default()
    };
    let summary = trainer.fit(&mut model, &train, options)?;
    Ok(summary.eval.expect("evaluated at the epoch's end"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("ember-custom-dataset-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let metrics = run(&dir, 3);
    std::fs::remove_dir_all(&dir)?;
    let m = metrics?;
    println!(
        "test AUC {:.3}, log loss {:.3}, accuracy {:.1} %",
        m.auc,
        m.logloss,
        m.accuracy * 100.0
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The click depends only on the user's and the item's groups, which
    /// the shared item table and the user table can learn: near 1 after
    /// three epochs (a spec that mixed up the columns would stay near 0.5).
    #[test]
    fn a_custom_schema_trains_to_a_useful_auc() {
        let dir = tempfile::tempdir().unwrap();
        let m = super::run(dir.path(), 3).unwrap();
        assert!(m.auc > 0.9, "AUC {}", m.auc);
    }
}
