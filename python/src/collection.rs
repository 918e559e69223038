//! `Collection`: an `EmbeddingBagCollection` driven from Python. The
//! lookups and the fused backward release the GIL; outputs and table views
//! cross as DLPack tensors without copies.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_models::checkpoint::{StateDict, StateFile};
use ember_models::ModelError;
use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingTable, KeyedJaggedTensor, SparseError,
    TableOptimizer,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::kjt::Kjt;
use crate::tables::{self, exclusive, parse_optimizer, shared, NativeTables};
use crate::tensor::{BufferPool, PooledBuffer, Tensor};
use crate::{errors, input};

/// Embedding-bag tables with their fused optimizer.
#[pyclass(module = "ember._native")]
pub struct Collection {
    ebc: EmbeddingBagCollection,
    /// Whether a lookup stages its batch first (fixed by the configs).
    staged: bool,
    pool: BufferPool,
    /// Held by every view of the optimizer state: the state is replaced
    /// only when none is alive.
    state_views: Arc<()>,
}

impl Collection {
    /// A buffer for `kjt`'s pooled output, with its rows and width.
    fn output(&self, kjt: &KeyedJaggedTensor) -> PyResult<(PooledBuffer, usize, usize)> {
        let (batch, width) = (kjt.stride(), self.ebc.width());
        let len = batch.checked_mul(width).ok_or_else(|| {
            PyValueError::new_err(format!("{batch} samples of width {width} overflow"))
        })?;
        Ok((PooledBuffer::take(&self.pool, len)?, batch, width))
    }
}

impl NativeTables for Collection {
    fn tables(&self) -> &[EmbeddingTable] {
        self.ebc.tables()
    }
    fn tables_mut(&mut self) -> &mut [EmbeddingTable] {
        self.ebc.tables_mut()
    }
    fn state_views(&self) -> &Arc<()> {
        &self.state_views
    }
    fn replace_optimizer(&mut self, optimizer: TableOptimizer) -> Result<(), SparseError> {
        self.ebc.set_optimizer(optimizer)
    }
    fn save_to(&self, path: &Path) -> Result<(), ModelError> {
        let mut state = StateDict::new();
        state.add_collection("", &self.ebc);
        state.save(path, None)
    }
    fn load_from(&mut self, path: &Path) -> Result<(), ModelError> {
        StateFile::open(path)?.load_collection("", &mut self.ebc)
    }
}

#[pymethods]
impl Collection {
    /// Tables from their configs (a JSON list of Ember's
    /// `EmbeddingBagConfig`), initialised from `seed`, with the optimizer
    /// (Ember's `TableOptimizer` as JSON) fused into `backward`. With
    /// `disk_dir`, every table on the disk tier there, behind a cache of
    /// `cache_rows` rows each (least recently used evicted first).
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
        let configs: Vec<EmbeddingBagConfig> =
            serde_json::from_str(tables_json).map_err(|e| errors::json("tables", e))?;
        let optimizer = parse_optimizer(optimizer_json)?;
        let tiers = tables::disk_tiers(disk_dir, cache_rows, configs.len())?;
        // Drawing gigabytes of rows takes seconds: other threads go on.
        let ebc = py
            .detach(|| EmbeddingBagCollection::with_disk_tiers(configs, optimizer, seed, tiers))
            .map_err(errors::sparse)?;
        let staged = (ebc.tables().iter()).any(|t| t.is_on_disk() || t.config().kv.is_some());
        Ok(Self {
            ebc,
            staged,
            pool: BufferPool::default(),
            state_views: Arc::new(()),
        })
    }

    /// Replaces the fused optimizer (JSON), with fresh state and the step
    /// count at 0.
    fn set_optimizer(slf: &Bound<'_, Self>, optimizer_json: &str) -> PyResult<()> {
        tables::set_optimizer(slf, optimizer_json)
    }

    /// Whether a view of the optimizer state is alive (the optimizer
    /// cannot be replaced then).
    fn optimizer_state_viewed(&self) -> bool {
        tables::state_viewed(self)
    }

    /// The fused optimizer, as JSON.
    #[getter]
    fn optimizer(&self) -> String {
        serde_json::to_string(self.ebc.optimizer()).unwrap_or_default()
    }

    /// The tables' configs, as JSON.
    #[getter]
    fn tables(&self) -> String {
        let configs: Vec<&EmbeddingBagConfig> =
            self.ebc.tables().iter().map(|t| t.config()).collect();
        serde_json::to_string(&configs).unwrap_or_default()
    }

    /// Output features, in output order.
    #[getter]
    fn feature_names(&self) -> Vec<String> {
        self.ebc.feature_names()
    }

    /// Each output feature's width.
    #[getter]
    fn feature_dims(&self) -> Vec<usize> {
        self.ebc.feature_dims()
    }

    /// The width of an output row: the sum of the feature dims.
    #[getter]
    fn width(&self) -> usize {
        self.ebc.width()
    }

    /// Backward updates applied so far.
    #[getter]
    fn step(&self) -> u64 {
        self.ebc.step()
    }

    /// Pooled lookup of every feature: a new `[batch, width]` float32
    /// tensor. The GIL is released while it runs.
    fn forward(slf: &Bound<'_, Self>, kjt: PyRef<'_, Kjt>) -> PyResult<Tensor> {
        let kjt = &kjt.kjt;
        let (mut out, batch, width);
        let done = if shared(slf)?.staged {
            // The batch's rows into the disk tier's caches and raw ids into
            // rows first (FBGEMM's prefetch), which changes the collection;
            // the backward updates the same rows.
            let mut this = exclusive(slf)?;
            (out, batch, width) = this.output(kjt)?;
            let (ebc, values) = (&mut this.ebc, out.values_mut());
            slf.py().detach(|| {
                ebc.prefetch(kjt)?;
                ebc.forward_into_slice(kjt, values)
            })
        } else {
            let this = shared(slf)?;
            (out, batch, width) = this.output(kjt)?;
            let (ebc, values) = (&this.ebc, out.values_mut());
            slf.py().detach(|| ebc.forward_into_slice(kjt, values))
        };
        done.map_err(errors::sparse)?;
        Ok(Tensor::owned(out, batch, width))
    }

    /// Whether a lookup stages its batch first: a table on the disk tier
    /// (rows through a cache) or keyed by raw ids (rows through a map).
    #[getter]
    fn staged(&self) -> bool {
        self.staged
    }

    /// Training (new ids of key-value tables are admitted), or not.
    fn set_training(slf: &Bound<'_, Self>, training: bool) -> PyResult<()> {
        exclusive(slf)?.ebc.set_training(training);
        Ok(())
    }

    /// The backward of `forward(kjt)` with the optimizer applied in the
    /// scatter: `grad` is d(loss)/d(output), a contiguous float32 CPU
    /// array of `[batch, width]` (read in place). The GIL is released
    /// while it runs.
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
        let want = [kjt.stride() as i64, this.ebc.width() as i64];
        if shape != want {
            return Err(PyValueError::new_err(format!(
                "grad: shape {shape:?}, but the output was {want:?} (batch, width)"
            )));
        }
        let grad = imported.f32s("grad")?;
        tables::refuse_overlap(this.ebc.tables(), grad)?;
        let ebc = &mut this.ebc;
        slf.py()
            .detach(|| ebc.backward_update(kjt, grad))
            .map_err(errors::sparse)
    }

    /// Table `name`'s rows, a view without a copy: `[rows, dim]` of
    /// float32, float16 or bfloat16; for the quantized types the rows as
    /// stored, `[rows, row bytes]` of uint8 (layouts in Ember's
    /// `DataType::row_bytes`). Writes through the view change the table.
    fn weight(slf: Bound<'_, Self>, name: &str) -> PyResult<Tensor> {
        tables::weight(slf, name)
    }

    /// Table `name`'s optimizer state, a view: `[rows, floats per row]`
    /// of float32 (Adagrad: one per column; row-wise Adagrad: one; Adam:
    /// `[m | v]`); `None` when the optimizer keeps none.
    fn optimizer_state(slf: Bound<'_, Self>, name: &str) -> PyResult<Option<Tensor>> {
        tables::optimizer_state(slf, name)
    }

    /// Writes the tables, their optimizer state and step count to Ember's
    /// checkpoint file `path` (safetensors, TorchRec's names).
    fn save(slf: &Bound<'_, Self>, path: PathBuf) -> PyResult<()> {
        tables::save(slf, path)
    }

    /// Loads Ember's checkpoint file `path` into the tables, in place.
    fn load(slf: &Bound<'_, Self>, path: PathBuf) -> PyResult<()> {
        tables::load(slf, path)
    }

    fn __repr__(&self) -> String {
        format!(
            "ember._native.Collection({} tables, width {}, optimizer {})",
            self.ebc.tables().len(),
            self.ebc.width(),
            self.optimizer()
        )
    }
}
