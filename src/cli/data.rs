//! Loader flags shared by `train`, `eval`, `predict` and `bench loader`:
//! which columns make a batch (a dataset spec, the simple-case flags, or
//! Criteo's), their transforms, and the decoding threads.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use ember_dataloader::{DatasetSpec, DenseTransform, IdTransform, Loader, LoaderConfig};
use ember_models::Checkpoint;
use ember_sparse::EmbeddingBagConfig;

#[derive(Args, Clone, Debug)]
pub struct LoaderArgs {
    /// The dataset's columns and tables as a JSON dataset spec (the book's
    /// "Dataset spec" page); without it, Criteo's columns.
    #[arg(long, conflicts_with_all = ["label_column", "dense_columns", "sparse_columns"])]
    pub dataset_spec: Option<PathBuf>,
    /// The simple case without a spec file: the label column...
    #[arg(long, requires = "sparse_columns")]
    pub label_column: Option<String>,
    /// ...the dense columns, comma-separated (the default transform)...
    #[arg(long, requires = "sparse_columns", value_delimiter = ',')]
    pub dense_columns: Vec<String>,
    /// ...and the sparse columns, comma-separated, each its own table
    /// `t_<column>` (rows from --arch-embedding-size, dim from
    /// --arch-sparse-feature-size).
    #[arg(long, requires = "label_column", value_delimiter = ',')]
    pub sparse_columns: Vec<String>,
    /// Dense transform of columns that name none: log1p (dlrm_s_pytorch),
    /// log-plus3 (TorchRec's Parquet path) or identity [default: the spec's, log1p].
    #[arg(long)]
    pub dense_transform: Option<DenseTransform>,
    /// Categorical transform: modulo (TorchRec, MLPerf), hash, or raw (ids already rows)
    /// [default: the spec's, modulo]. Key-value tables always take the raw id.
    #[arg(long)]
    pub id_transform: Option<IdTransform>,
    /// Parquet decoding threads (batches are assembled on one more).
    #[arg(long, default_value_t = 1)]
    pub loader_threads: usize,
    /// Decoded row groups queued ahead, per decoding thread, and finished
    /// batches queued ahead of the step.
    #[arg(long, default_value_t = 2)]
    pub prefetch: usize,
}

impl LoaderArgs {
    /// The flags given that shape how Parquet columns are read (for the
    /// commands that read no such columns to refuse by name).
    pub fn given_column_flags(&self) -> Vec<&'static str> {
        [
            ("--dataset-spec", self.dataset_spec.is_some()),
            ("--label-column", self.label_column.is_some()),
            ("--dense-columns", !self.dense_columns.is_empty()),
            ("--sparse-columns", !self.sparse_columns.is_empty()),
            ("--dense-transform", self.dense_transform.is_some()),
            ("--id-transform", self.id_transform.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// The dataset spec the flags name, if any (`shape` gives the simple
    /// case's table dim and rows). `None`: Criteo's columns.
    pub fn spec(
        &self,
        shape: &dyn Fn() -> anyhow::Result<(usize, Vec<usize>)>,
    ) -> anyhow::Result<Option<DatasetSpec>> {
        let Some(mut spec) = self.given_spec(shape)? else {
            return Ok(None);
        };
        self.override_transforms(&mut spec);
        Ok(Some(spec))
    }

    /// The spec of `--dataset-spec` or the simple-case flags, before the
    /// transform flags.
    fn given_spec(
        &self,
        shape: &dyn Fn() -> anyhow::Result<(usize, Vec<usize>)>,
    ) -> anyhow::Result<Option<DatasetSpec>> {
        let spec = match (&self.dataset_spec, &self.label_column) {
            (Some(path), _) => DatasetSpec::from_file(path)?,
            (None, Some(label)) => {
                let (dim, rows) = shape()?;
                let n = self.sparse_columns.len();
                let rows = match rows.len() {
                    1 => vec![rows[0]; n],
                    m if m == n => rows,
                    m => anyhow::bail!(
                        "--sparse-columns names {n} columns; --arch-embedding-size gives {m} table sizes (give one, or one per column)"
                    ),
                };
                let sparse: Vec<(String, usize)> =
                    self.sparse_columns.iter().cloned().zip(rows).collect();
                let spec = DatasetSpec::simple(label, &self.dense_columns, &sparse, dim);
                spec.validate()?;
                spec
            }
            (None, None) => return Ok(None),
        };
        Ok(Some(spec))
    }

    fn override_transforms(&self, spec: &mut DatasetSpec) {
        if let Some(t) = self.dense_transform {
            spec.dense_transform = t;
        }
        if let Some(t) = self.id_transform {
            spec.id_transform = t;
        }
    }

    /// The spec to read the data of `ckpt`'s model with: the inputs the
    /// checkpoint recorded (its training data's spec, or its transforms),
    /// which the flags may restate but never contradict (a model fed
    /// inputs transformed otherwise than in training predicts garbage);
    /// with nothing recorded (a TorchRec file), the flags' spec or
    /// Criteo's columns.
    pub fn spec_for_checkpoint(&self, ckpt: &Checkpoint) -> anyhow::Result<DatasetSpec> {
        let (config, source) = (ckpt.config(), ckpt.path());
        let tables = &config.tables;
        let shape = || {
            let dim = tables.first().map_or(1, |t| t.embedding_dim);
            Ok((dim, tables.iter().map(|t| t.num_embeddings).collect()))
        };
        let recorded = ckpt.recorded_inputs();
        let mut spec = match self.given_spec(&shape)? {
            Some(given) => {
                check_tables(&given, tables).with_context(|| {
                    format!("the dataset spec does not fit {}", source.display())
                })?;
                // A file from before specs were recorded holds only the
                // transforms: those alone are compared.
                let full = ckpt.dataset_spec();
                let transforms = |r: &DatasetSpec| {
                    let mut r = r.clone();
                    r.dense = given
                        .dense
                        .iter()
                        .map(|c| ember_dataloader::DenseColumn {
                            column: c.column.clone(),
                            transform: None,
                        })
                        .collect();
                    r.sparse = given.sparse.clone();
                    r
                };
                let against = match full {
                    Some(f) => Some(f.clone()),
                    None => recorded.as_ref().map(transforms),
                };
                let given_globals = match full {
                    Some(_) => given.clone(),
                    None => {
                        let mut g = given.clone();
                        g.dense.iter_mut().for_each(|c| c.transform = None);
                        g
                    }
                };
                if let Some(recorded) = &against {
                    same_inputs(&given_globals, recorded).with_context(|| {
                        format!(
                            "the dataset spec reads inputs otherwise than {} was trained on",
                            source.display()
                        )
                    })?;
                }
                given
            }
            None => recorded
                .clone()
                .unwrap_or_else(|| DatasetSpec::criteo(tables)),
        };
        let trained = |flag: &str, given: String, saved: String| {
            anyhow::anyhow!(
                "{flag} {given}: {} was trained with {saved}; leave the flag out (the checkpoint's is used) or give {saved}",
                source.display()
            )
        };
        if let Some(t) = self.dense_transform {
            if let Some(r) = recorded.as_ref().filter(|r| r.dense_transform != t) {
                let saved = r.dense_transform.to_string();
                return Err(trained("--dense-transform", t.to_string(), saved));
            }
            spec.dense_transform = t;
        }
        if let Some(t) = self.id_transform {
            if let Some(r) = recorded.as_ref().filter(|r| r.id_transform != t) {
                return Err(trained(
                    "--id-transform",
                    t.to_string(),
                    r.id_transform.to_string(),
                ));
            }
            spec.id_transform = t;
        }
        anyhow::ensure!(
            spec.num_dense() == config.num_dense(),
            "the model in {} takes {} dense features; the dataset has {} dense columns",
            source.display(),
            config.num_dense(),
            spec.num_dense()
        );
        with_model_kv(&mut spec, tables);
        Ok(spec)
    }

    /// Criteo's columns for `tables`, with the transform flags.
    pub fn criteo(&self, tables: &[EmbeddingBagConfig]) -> DatasetSpec {
        let mut spec = DatasetSpec::criteo(tables);
        self.override_transforms(&mut spec);
        spec
    }

    /// A loader of `spec`'s columns in input order (no shuffle, nothing
    /// dropped).
    pub fn open(
        &self,
        data: &[PathBuf],
        spec: DatasetSpec,
        batch_size: usize,
    ) -> anyhow::Result<Loader> {
        Ok(Loader::open(data, self.config(spec, batch_size))?)
    }

    pub fn config(&self, spec: DatasetSpec, batch_size: usize) -> LoaderConfig {
        LoaderConfig {
            threads: self.loader_threads,
            prefetch: self.prefetch,
            ..LoaderConfig::new(batch_size, spec)
        }
    }
}

/// Data with no rows would give NaN metrics: an error naming the flag's paths.
pub fn has_rows(loader: &Loader, flag: &str, paths: &[PathBuf]) -> anyhow::Result<()> {
    let named: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    anyhow::ensure!(
        loader.dataset().num_rows() > 0,
        "{flag} {}: no rows to read",
        named.join(" ")
    );
    Ok(())
}

/// Checks that `given` reads its inputs as `recorded` does: the same dense
/// transforms, id transform and weighted features (column names may
/// differ).
fn same_inputs(given: &DatasetSpec, recorded: &DatasetSpec) -> anyhow::Result<()> {
    anyhow::ensure!(
        given.num_dense() == recorded.num_dense(),
        "it has {} dense columns, the model was trained on {}",
        given.num_dense(),
        recorded.num_dense()
    );
    for j in 0..given.num_dense() {
        let (g, r) = (given.transform_of(j), recorded.transform_of(j));
        anyhow::ensure!(
            g == r,
            "dense column {j} ('{}') is transformed by {g}; in training ('{}') by {r}",
            given.dense[j].column,
            recorded.dense[j].column
        );
    }
    anyhow::ensure!(
        given.id_transform == recorded.id_transform,
        "its id transform is {}; in training it was {}",
        given.id_transform,
        recorded.id_transform
    );
    for c in &given.sparse {
        let trained = recorded.sparse.iter().find(|r| r.key() == c.key());
        let weighted = trained.map(|r| r.weights.is_some());
        anyhow::ensure!(
            weighted.is_none() || weighted == Some(c.weights.is_some()),
            "feature '{}' is {}weighted; in training it was {}",
            c.key(),
            if c.weights.is_some() { "" } else { "not " },
            if c.weights.is_some() {
                "not"
            } else {
                "weighted"
            }
        );
    }
    Ok(())
}

/// Makes `spec`'s tables key-value where the model's are (by name), so
/// that the loader hands their raw ids over unreduced.
pub fn with_model_kv(spec: &mut DatasetSpec, tables: &[EmbeddingBagConfig]) {
    for s in &mut spec.tables {
        s.kv = (tables.iter().find(|t| t.name == s.name)).and_then(|t| t.kv.clone());
    }
}

/// Checks that `spec` names exactly the model's tables (name, rows, dim,
/// features, pooling).
fn check_tables(spec: &DatasetSpec, tables: &[EmbeddingBagConfig]) -> anyhow::Result<()> {
    for t in tables {
        let Some(s) = spec.tables.iter().find(|s| s.name == t.name) else {
            anyhow::bail!("the model has table '{}', the spec has not", t.name);
        };
        let shape = |c: &EmbeddingBagConfig| {
            (
                c.num_embeddings,
                c.embedding_dim,
                c.feature_names.clone(),
                c.pooling,
            )
        };
        anyhow::ensure!(
            shape(s) == shape(t),
            "table '{}': the model has {} rows of dim {} for {:?} ({:?} pooling), the spec {} rows of dim {} for {:?} ({:?})",
            t.name, t.num_embeddings, t.embedding_dim, t.feature_names, t.pooling,
            s.num_embeddings, s.embedding_dim, s.feature_names, s.pooling
        );
    }
    if let Some(s) = spec
        .tables
        .iter()
        .find(|s| !tables.iter().any(|t| t.name == s.name))
    {
        anyhow::bail!("the spec has table '{}', the model has not", s.name);
    }
    Ok(())
}
