//! `SequenceCollection`: an `EmbeddingCollection` (unpooled lookups, every
//! id's row in place) driven from Python, as `Collection` drives the bags.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_models::checkpoint::{StateDict, StateFile};
use ember_models::ModelError;
use ember_sparse::{EmbeddingCollection, EmbeddingConfig, EmbeddingTable, TableOptimizer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kjt::Kjt;
use crate::tables::{self, exclusive, parse_optimizer, shared, NativeTables};
use crate::tensor::Tensor;
use crate::{errors, input};

/// Embedding tables read unpooled, with their fused optimizer.
#[pyclass(module = "ember._native")]
pub struct SequenceCollection {
    ec: EmbeddingCollection,
    /// Whether a lookup stages its batch first (fixed by the configs).
    staged: bool,
    /// Held by every view of the optimizer state (see `Collection`).
    state_views: Arc<()>,
}

#[pymethods]
impl SequenceCollection {
    /// Tables from their configs (a JSON list of Ember's `EmbeddingConfig`,
    /// one dim), initialised from `seed`, with the optimizer (JSON); with
    /// `disk_dir` and `cache_rows`, on the disk tier (as `Collection`).
    #[new]
    #[pyo3(signature = (tables_json, optimizer_json, seed, disk_dir=None, cache_rows=None))]
    fn new(
        py: Python<'_>,
        tables_json: &str,
        optimizer_json: &str,
        seed: u64,
        disk_dir: Option<PathBuf>,
        cache_rows: Option<usize>,
    ) -> PyResult<Self> {
        let configs: Vec<EmbeddingConfig> =
            serde_json::from_str(tables_json).map_err(|e| errors::json("tables", e))?;
        let optimizer = parse_optimizer(optimizer_json)?;
        let tiers = tables::disk_tiers(disk_dir, cache_rows, configs.len())?;
        let ec = py
            .detach(|| EmbeddingCollection::with_disk_tiers(configs, optimizer, seed, tiers))
            .map_err(errors::sparse)?;
        let staged = (ec.tables().iter()).any(|t| t.is_on_disk() || t.config().kv.is_some());
        Ok(Self {
            ec,
            staged,
            state_views: Arc::new(()),
        })
    }

    /// Replaces the fused optimizer (JSON), with fresh state and the step
    /// count at 0.
    fn set_optimizer(slf: &Bound<'_, Self>, optimizer_json: &str) -> PyResult<()> {
        tables::set_optimizer(slf, optimizer_json)
    }

    /// Whether a view of the optimizer state is alive.
    fn optimizer_state_viewed(&self) -> bool {
        tables::state_viewed(self)
    }

    /// The fused optimizer, as JSON.
    #[getter]
    fn optimizer(&self) -> String {
        serde_json::to_string(self.ec.optimizer()).unwrap_or_default()
    }

    /// Output features, in output order.
    #[getter]
    fn feature_names(&self) -> Vec<String> {
        self.ec.feature_names()
    }

    /// Whether a lookup stages its batch first: a table on the disk tier
    /// (rows through a cache) or keyed by raw ids (rows through a map).
    #[getter]
    fn staged(&self) -> bool {
        self.staged
    }

    /// Training (new ids of key-value tables are admitted), or not.
    fn set_training(slf: &Bound<'_, Self>, training: bool) -> PyResult<()> {
        exclusive(slf)?.ec.set_training(training);
        Ok(())
    }

    /// Floats per row (every table's).
    #[getter]
    fn dim(&self) -> usize {
        self.ec.dim()
    }

    /// Backward updates applied so far.
    #[getter]
    fn step(&self) -> u64 {
        self.ec.step()
    }

    /// Every id's row of every feature: `(values, offsets)`, values
    /// `[rows, dim]` float32 (the features one after another), offsets the
    /// `features * batch + 1` row offsets (int64) of each (feature,
    /// sample). The GIL is released while it runs.
    fn forward(slf: &Bound<'_, Self>, kjt: PyRef<'_, Kjt>) -> PyResult<(Tensor, Tensor)> {
        let kjt = &kjt.kjt;
        let out = if shared(slf)?.staged {
            // The batch's rows into the caches, raw ids into rows, first
            // (FBGEMM's prefetch).
            let mut this = exclusive(slf)?;
            let ec = &mut this.ec;
            slf.py().detach(|| {
                ec.prefetch(kjt)?;
                ec.forward(kjt)
            })
        } else {
            let this = shared(slf)?;
            let ec = &this.ec;
            slf.py().detach(|| ec.forward(kjt))
        }
        .map_err(errors::sparse)?;
        let (dim, offsets, values) = out.into_parts();
        let rows = values.len() / dim.max(1);
        let offsets: Vec<i64> = offsets.into_iter().map(|o| o as i64).collect();
        let n = offsets.len();
        Ok((
            Tensor::from_vec(values, &[rows, dim]),
            Tensor::from_vec(offsets, &[n]),
        ))
    }

    /// The backward of `forward(kjt)` with the optimizer applied in the
    /// scatter: `grad` is d(loss)/d(values), float32 `[rows, dim]`, read in
    /// place. The GIL is released while it runs.
    fn backward(
        slf: &Bound<'_, Self>,
        kjt: PyRef<'_, Kjt>,
        grad: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut this = exclusive(slf)?;
        let kjt = &kjt.kjt;
        let imported = input::import(grad, "grad")?.ok_or_else(|| {
            PyValueError::new_err("grad: expected a float32 array (torch, numpy) through DLPack")
        })?;
        let shape = imported.shape();
        let dim = this.ec.dim() as i64;
        if shape.len() != 2 || shape[1] != dim {
            return Err(PyValueError::new_err(format!(
                "grad: shape {shape:?}, but the rows are [rows, {dim}]"
            )));
        }
        let grad = imported.f32s("grad")?;
        tables::refuse_overlap(this.ec.tables(), grad)?;
        let ec = &mut this.ec;
        slf.py()
            .detach(|| ec.backward_update(kjt, grad))
            .map_err(errors::sparse)
    }

    fn __repr__(&self) -> String {
        format!(
            "ember._native.SequenceCollection({} tables, dim {}, optimizer {})",
            self.ec.tables().len(),
            self.ec.dim(),
            self.optimizer()
        )
    }

    /// Table `name`'s rows, a view without a copy (as `Collection.weight`).
    fn weight(slf: Bound<'_, Self>, name: &str) -> PyResult<Tensor> {
        tables::weight(slf, name)
    }

    /// Table `name`'s optimizer state, a view; `None` when the optimizer
    /// keeps none.
    fn optimizer_state(slf: Bound<'_, Self>, name: &str) -> PyResult<Option<Tensor>> {
        tables::optimizer_state(slf, name)
    }

    /// Writes the tables, their optimizer state and step count to Ember's
    /// checkpoint file `path`.
    fn save(slf: &Bound<'_, Self>, path: PathBuf) -> PyResult<()> {
        tables::save(slf, path)
    }

    /// Loads Ember's checkpoint file `path` into the tables, in place.
    fn load(slf: &Bound<'_, Self>, path: PathBuf) -> PyResult<()> {
        tables::load(slf, path)
    }
}

impl NativeTables for SequenceCollection {
    fn tables(&self) -> &[EmbeddingTable] {
        self.ec.tables()
    }
    fn tables_mut(&mut self) -> &mut [EmbeddingTable] {
        self.ec.tables_mut()
    }
    fn state_views(&self) -> &Arc<()> {
        &self.state_views
    }
    fn replace_optimizer(&mut self, optimizer: TableOptimizer) -> Result<(), ModelError> {
        Ok(self.ec.set_optimizer(optimizer)?)
    }
    fn save_to(&self, path: &Path) -> Result<(), ModelError> {
        let mut state = StateDict::new();
        state.add_embedding_collection("", &self.ec);
        state.save(path, None)
    }
    fn load_from(&mut self, path: &Path) -> Result<(), ModelError> {
        StateFile::open(path)?.load_embedding_collection("", &mut self.ec)
    }
}
