//! `Collection`: an `EmbeddingBagCollection` driven from Python. The
//! lookups and the fused backward release the GIL; outputs and table views
//! cross as DLPack tensors without copies.

use ember_sparse::{EmbeddingBagCollection, EmbeddingBagConfig, TableOptimizer};
use std::sync::Arc;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pyclass::boolean_struct::False;
use pyo3::PyClass;

use crate::kjt::Kjt;
use crate::tensor::{BufferPool, PooledBuffer, Tensor};
use crate::{errors, input, views};

/// Embedding-bag tables with their fused optimizer.
#[pyclass(module = "ember._native")]
pub struct Collection {
    ebc: EmbeddingBagCollection,
    pool: BufferPool,
    /// Held by every view of the optimizer state: the state is replaced
    /// only when none is alive.
    state_views: Arc<()>,
}

/// A collection for a lookup; refused (not waited for) while another
/// thread's backward holds it.
pub fn shared<'py, T: PyClass>(slf: &Bound<'py, T>) -> PyResult<PyRef<'py, T>> {
    slf.try_borrow().map_err(|_| {
        PyRuntimeError::new_err(
            "the collection is being updated by another thread (a backward, or a new \
             optimizer): run its lookups and backwards from one thread, or one at a time",
        )
    })
}

/// A collection for an update or a view; refused (not waited for) while
/// another thread uses it.
pub fn exclusive<'py, T: PyClass<Frozen = False>>(
    slf: &Bound<'py, T>,
) -> PyResult<PyRefMut<'py, T>> {
    slf.try_borrow_mut().map_err(|_| {
        PyRuntimeError::new_err(
            "the collection is in use by another thread (a lookup or a backward): run its \
             lookups and backwards from one thread, or one at a time",
        )
    })
}

/// A `TableOptimizer` from its JSON.
pub fn parse_optimizer(json: &str) -> PyResult<TableOptimizer> {
    serde_json::from_str(json).map_err(|e| errors::json("optimizer", e))
}

#[pymethods]
impl Collection {
    /// Tables from their configs (a JSON list of Ember's
    /// `EmbeddingBagConfig`), initialised from `seed`, with the optimizer
    /// (Ember's `TableOptimizer` as JSON) fused into `backward`.
    #[new]
    fn new(py: Python<'_>, tables_json: &str, optimizer_json: &str, seed: u64) -> PyResult<Self> {
        let configs: Vec<EmbeddingBagConfig> =
            serde_json::from_str(tables_json).map_err(|e| errors::json("tables", e))?;
        if let Some(config) = configs.iter().find(|c| c.kv.is_some()) {
            return Err(PyValueError::new_err(format!(
                "table '{}': key-value tables are not offered from Python yet",
                config.name
            )));
        }
        let optimizer = parse_optimizer(optimizer_json)?;
        // Drawing gigabytes of rows takes seconds: other threads go on.
        let ebc = py
            .detach(|| EmbeddingBagCollection::new(configs, optimizer, seed))
            .map_err(errors::sparse)?;
        Ok(Self {
            ebc,
            pool: BufferPool::default(),
            state_views: Arc::new(()),
        })
    }

    /// Replaces the fused optimizer (JSON), with fresh state and the step
    /// count at 0.
    fn set_optimizer(slf: &Bound<'_, Self>, optimizer_json: &str) -> PyResult<()> {
        let optimizer = parse_optimizer(optimizer_json)?;
        let mut this = exclusive(slf)?;
        if this.optimizer_state_viewed() {
            return Err(PyRuntimeError::new_err(
                "the optimizer state is viewed by a live tensor: let go of the views \
                 (optimizer_state) before replacing the optimizer",
            ));
        }
        let ebc = &mut this.ebc;
        slf.py()
            .detach(|| ebc.set_optimizer(optimizer))
            .map_err(errors::sparse)
    }

    /// Whether a view of the optimizer state is alive (the optimizer
    /// cannot be replaced then).
    fn optimizer_state_viewed(&self) -> bool {
        Arc::strong_count(&self.state_views) > 1
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
        let this = shared(slf)?;
        let kjt = &kjt.kjt;
        let (batch, width) = (kjt.stride(), this.ebc.width());
        let len = batch.checked_mul(width).ok_or_else(|| {
            PyValueError::new_err(format!("{batch} samples of width {width} overflow"))
        })?;
        let mut out = PooledBuffer::take(&this.pool, len)?;
        let ebc = &this.ebc;
        slf.py()
            .detach(|| ebc.forward_into_slice(kjt, out.values_mut()))
            .map_err(errors::sparse)?;
        Ok(Tensor::owned(out, batch, width))
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
        views::refuse_overlap(this.ebc.tables(), grad)?;
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
        let owner = slf.clone().into_any().unbind();
        let mut this = exclusive(&slf)?;
        let t = views::viewable(this.ebc.tables(), name, "rows")?;
        Ok(views::rows(owner, &mut this.ebc.tables_mut()[t]))
    }

    /// Table `name`'s optimizer state, a view: `[rows, floats per row]`
    /// of float32 (Adagrad: one per column; row-wise Adagrad: one; Adam:
    /// `[m | v]`); `None` when the optimizer keeps none.
    fn optimizer_state(slf: Bound<'_, Self>, name: &str) -> PyResult<Option<Tensor>> {
        let owner = slf.clone().into_any().unbind();
        let mut this = exclusive(&slf)?;
        let t = views::viewable(this.ebc.tables(), name, "optimizer state")?;
        let guard = Arc::clone(&this.state_views);
        Ok(views::state(owner, &guard, &mut this.ebc.tables_mut()[t]))
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
