//! The dataset spec: which Parquet columns a model reads and how. The label
//! column, the dense columns (integer or float, each with a transform), the
//! sparse columns (int64 or `list<int64>`, optionally weighted by a float
//! column of the same lengths) and the tables their features look up
//! (TorchRec's `EmbeddingBagConfig`, so one table can serve several
//! features). Criteo is one preset of it, [`DatasetSpec::criteo`].

use std::collections::HashSet;
use std::path::Path;

use ember_sparse::EmbeddingBagConfig;
use serde::{Deserialize, Serialize};

use crate::schema::{int_column, LABEL, NUM_INT};
use crate::transform::{DenseTransform, IdTransform};
use crate::DataError;

/// A dense input column.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenseColumn {
    /// The Parquet column: int32, int64, float or double; a null reads as 0
    /// before the transform.
    pub column: String,
    /// Its transform; the spec's `dense_transform` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<DenseTransform>,
}

/// A sparse input column: one feature of the batch's KeyedJaggedTensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SparseColumn {
    /// The Parquet column of ids: int64 (one id, or none when null) or
    /// `list<int64>` (a bag; null items are skipped).
    pub column: String,
    /// The feature's key in the batch, as a table's `feature_names` name it
    /// (the column's name when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature: Option<String>,
    /// A column of per-id weights with the ids' shape: `list<float>` (or
    /// `list<double>`) of the same lengths for a list column, float (or
    /// double) for a scalar one. TorchRec's weighted KJT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
}

impl SparseColumn {
    /// The feature's key: `feature`, or the column's name.
    pub fn key(&self) -> &str {
        self.feature.as_deref().unwrap_or(&self.column)
    }
}

/// Which columns of a Parquet dataset make a batch, and the tables its
/// sparse features look up. Serialised as the JSON that
/// `--dataset-spec` reads:
///
/// ```
/// use ember_dataloader::DatasetSpec;
///
/// let spec: DatasetSpec = serde_json::from_str(r#"{
///     "label": "clicked",
///     "dense": [{"column": "price", "transform": "log1p"}, {"column": "age"}],
///     "dense_transform": "identity",
///     "sparse": [
///         {"column": "history", "weights": "history_weights"},
///         {"column": "item"}
///     ],
///     "tables": [
///         {"name": "t_item", "num_embeddings": 1000, "embedding_dim": 8,
///          "feature_names": ["history", "item"], "pooling": "mean"}
///     ]
/// }"#)?;
/// spec.validate()?;
/// assert_eq!(spec.num_dense(), 2);
/// assert!(spec.weighted());
/// // Both features look up the one shared table.
/// assert_eq!(spec.rows_of("history"), Some(1000));
/// assert_eq!(spec.rows_of("item"), Some(1000));
///
/// // Criteo is a preset: label, int_0..int_12, cat_i for each table's features.
/// let criteo = DatasetSpec::criteo(&[ember_sparse::EmbeddingBagConfig::new("t_cat_0", 10, 4, &["cat_0"])]);
/// assert_eq!((criteo.num_dense(), criteo.sparse[0].column.as_str()), (13, "cat_0"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    /// The label column: 0 or 1, never null (int8/16/32/64, boolean, float
    /// or double).
    pub label: String,
    /// Dense columns, in input order.
    #[serde(default)]
    pub dense: Vec<DenseColumn>,
    /// The transform of dense columns that name none (`log1p` when absent).
    #[serde(default)]
    pub dense_transform: DenseTransform,
    /// Sparse columns, in the batch's key order.
    pub sparse: Vec<SparseColumn>,
    /// The tables: every sparse feature is in exactly one table's
    /// `feature_names`; its ids are reduced into the table's rows.
    pub tables: Vec<EmbeddingBagConfig>,
    /// Raw id → table row (`modulo` when absent; key-value tables take
    /// the raw id whatever this says).
    #[serde(default)]
    pub id_transform: IdTransform,
}

impl DatasetSpec {
    /// The Criteo schema Ember's ingest writes: `label`, `int_0..int_12`
    /// (log1p), and the column of each of the tables' features (`cat_i`).
    pub fn criteo(tables: &[EmbeddingBagConfig]) -> Self {
        Self {
            label: LABEL.into(),
            dense: (0..NUM_INT)
                .map(|i| DenseColumn {
                    column: int_column(i),
                    transform: None,
                })
                .collect(),
            dense_transform: DenseTransform::default(),
            sparse: (tables.iter())
                .flat_map(|t| &t.feature_names)
                .map(|f| SparseColumn {
                    column: f.clone(),
                    feature: None,
                    weights: None,
                })
                .collect(),
            tables: tables.to_vec(),
            id_transform: IdTransform::default(),
        }
    }

    /// Reads a spec from a JSON file and validates it; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(path).map_err(DataError::io(path))?;
        let spec: Self = serde_json::from_str(&text).map_err(|e| DataError::Spec {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        spec.validate().map_err(|e| match e {
            DataError::InvalidSpec(message) => DataError::Spec {
                path: path.to_path_buf(),
                message,
            },
            e => e,
        })?;
        Ok(spec)
    }

    /// Checks the spec on its own (the files are checked when opened): a
    /// label, unique column and feature names, every feature in exactly one
    /// table, tables of at least one row and one column.
    pub fn validate(&self) -> Result<(), DataError> {
        let fail = |m: String| Err(DataError::InvalidSpec(m));
        if self.label.is_empty() {
            return fail("the label column has no name".into());
        }
        if self.sparse.is_empty() {
            return fail("no sparse column".into());
        }
        let mut dense = HashSet::new();
        for c in &self.dense {
            if !dense.insert(&c.column) {
                return fail(format!("dense column '{}' is listed twice", c.column));
            }
        }
        let mut features = HashSet::new();
        for c in &self.sparse {
            if !features.insert(c.key()) {
                return fail(format!("sparse feature '{}' is listed twice", c.key()));
            }
        }
        let mut tables = HashSet::new();
        let mut seen = HashSet::new();
        for t in &self.tables {
            if !tables.insert(&t.name) {
                return fail(format!("table '{}' is listed twice", t.name));
            }
            if t.num_embeddings == 0 || t.embedding_dim == 0 {
                return fail(format!(
                    "table '{}' has {} rows of dim {}: both must be at least 1",
                    t.name, t.num_embeddings, t.embedding_dim
                ));
            }
            for f in &t.feature_names {
                if !features.contains(f.as_str()) {
                    return fail(format!(
                        "table '{}' names feature '{f}', which no sparse column reads",
                        t.name
                    ));
                }
                if !seen.insert(f.as_str()) {
                    return fail(format!("feature '{f}' is in two tables"));
                }
            }
        }
        if let Some(c) = self.sparse.iter().find(|c| !seen.contains(c.key())) {
            return fail(format!("feature '{}' is in no table", c.key()));
        }
        Ok(())
    }

    /// Dense features per row.
    pub fn num_dense(&self) -> usize {
        self.dense.len()
    }

    /// The rows of the table that feature `key` looks up.
    pub fn rows_of(&self, key: &str) -> Option<u64> {
        (self.tables.iter())
            .find(|t| t.feature_names.iter().any(|f| f == key))
            .map(|t| t.num_embeddings as u64)
    }

    /// How feature `key`'s raw ids reach its table's rows: unchanged
    /// ([`IdTransform::Raw`]) for a key-value table, whose map finds the
    /// row; else the spec's `id_transform`.
    pub fn id_transform_of(&self, key: &str) -> IdTransform {
        let table = self
            .tables
            .iter()
            .find(|t| t.feature_names.iter().any(|f| f == key));
        match table.is_some_and(|t| t.kv.is_some()) {
            true => IdTransform::Raw,
            false => self.id_transform,
        }
    }

    /// Whether some sparse column carries weights (then every batch's
    /// KeyedJaggedTensor has weights: 1.0 for the unweighted features).
    pub fn weighted(&self) -> bool {
        self.sparse.iter().any(|c| c.weights.is_some())
    }

    /// The transform of dense column `j`.
    pub fn transform_of(&self, j: usize) -> DenseTransform {
        self.dense[j].transform.unwrap_or(self.dense_transform)
    }

    /// A spec of the simple case: `label`, `dense` columns with the default
    /// transform, and each sparse column its own table `t_<column>` of
    /// `rows` rows of `dim` floats.
    pub fn simple(label: &str, dense: &[String], sparse: &[(String, usize)], dim: usize) -> Self {
        Self {
            label: label.into(),
            dense: (dense.iter())
                .map(|c| DenseColumn {
                    column: c.clone(),
                    transform: None,
                })
                .collect(),
            dense_transform: DenseTransform::default(),
            sparse: (sparse.iter())
                .map(|(c, _)| SparseColumn {
                    column: c.clone(),
                    feature: None,
                    weights: None,
                })
                .collect(),
            tables: (sparse.iter())
                .map(|(c, rows)| EmbeddingBagConfig::new(&format!("t_{c}"), *rows, dim, &[c]))
                .collect(),
            id_transform: IdTransform::default(),
        }
    }
}
