//! `Collection`: an `EmbeddingBagCollection` driven from Python. The
//! lookups and the fused backward release the GIL; outputs and table views
//! cross as DLPack tensors without copies.

use ember_sparse::{DataType, EmbeddingBagCollection, EmbeddingBagConfig, TableOptimizer};
use std::sync::Arc;

use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::kjt::Kjt;
use crate::tensor::{BufferPool, Dtype, PooledBuffer, Tensor};
use crate::{errors, input};

/// Embedding-bag tables with their fused optimizer.
#[pyclass(module = "ember._native")]
pub struct Collection {
    ebc: EmbeddingBagCollection,
    pool: BufferPool,
    /// Held by every view of the optimizer state: the state is replaced
    /// only when none is alive.
    state_views: Arc<()>,
}

/// The collection for a lookup; refused (not waited for) while another
/// thread's backward holds it.
fn shared<'py>(slf: &Bound<'py, Collection>) -> PyResult<PyRef<'py, Collection>> {
    slf.try_borrow().map_err(|_| {
        PyRuntimeError::new_err(
            "the collection is being updated by another thread (a backward, or a new \
             optimizer): run its lookups and backwards from one thread, or one at a time",
        )
    })
}

/// The collection for an update or a view; refused (not waited for) while
/// another thread uses it.
fn exclusive<'py>(slf: &Bound<'py, Collection>) -> PyResult<PyRefMut<'py, Collection>> {
    slf.try_borrow_mut().map_err(|_| {
        PyRuntimeError::new_err(
            "the collection is in use by another thread (a lookup or a backward): run its \
             lookups and backwards from one thread, or one at a time",
        )
    })
}

fn parse_optimizer(json: &str) -> PyResult<TableOptimizer> {
    serde_json::from_str(json).map_err(|e| errors::json("optimizer", e))
}

impl Collection {
    /// Refuses a gradient that lies in a table's rows or optimizer state:
    /// the backward writes those while it reads the gradient.
    fn refuse_overlap(&self, grad: &[f32]) -> PyResult<()> {
        let span = |start: *const u8, bytes: usize| (start as usize, start as usize + bytes);
        let (g0, g1) = span(grad.as_ptr().cast(), std::mem::size_of_val(grad));
        for table in self.ebc.tables().iter().filter(|t| !t.is_on_disk()) {
            let rows = table.row_bytes();
            let state = table.optimizer_state();
            for (what, (a0, a1)) in [
                ("rows", span(rows.as_ptr(), rows.len())),
                (
                    "optimizer state",
                    span(state.as_ptr().cast(), std::mem::size_of_val(state)),
                ),
            ] {
                if a0 < a1 && g0 < a1 && a0 < g1 {
                    return Err(PyValueError::new_err(format!(
                        "grad: it lies in the {what} of table '{}', which the backward updates",
                        table.name()
                    )));
                }
            }
        }
        Ok(())
    }

    fn table_index(&self, name: &str) -> PyResult<usize> {
        self.ebc
            .tables()
            .iter()
            .position(|t| t.name() == name)
            .ok_or_else(|| PyKeyError::new_err(format!("no table named '{name}'")))
    }

    /// Table `name`, refused (naming why) where its rows are not one
    /// array indexed by id in RAM.
    fn viewable_table(&self, name: &str, what: &str) -> PyResult<usize> {
        let t = self.table_index(name)?;
        let table = &self.ebc.tables()[t];
        if table.is_on_disk() {
            return Err(PyValueError::new_err(format!(
                "table '{name}' is on the disk tier: its {what} are not in memory as one array"
            )));
        }
        if table.config().kv.is_some() {
            return Err(PyValueError::new_err(format!(
                "table '{name}' is a key-value table: its rows are found by id through a map, \
                 so its {what} are not indexed by id"
            )));
        }
        Ok(t)
    }
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
        this.refuse_overlap(grad)?;
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
        let t = this.viewable_table(name, "rows")?;
        let table = &mut this.ebc.tables_mut()[t];
        let (rows, dim, dtype) = (table.num_embeddings(), table.dim(), table.data_type());
        let (cols, dtype) = match dtype {
            DataType::Fp32 => (dim, Dtype::F32),
            DataType::Fp16 => (dim, Dtype::F16),
            DataType::Bf16 => (dim, Dtype::Bf16),
            _ => (table.bytes_per_row(), Dtype::U8),
        };
        let bytes = table.row_bytes_mut();
        debug_assert_eq!(bytes.len(), rows * cols * dtype.bytes());
        // SAFETY: the rows of an in-memory table are one allocation of
        // `rows * cols` values of `dtype`, made when the table was built and
        // never moved or freed while the collection (kept by `owner`) lives.
        Ok(unsafe { Tensor::view(owner, None, bytes.as_mut_ptr(), &[rows, cols], dtype) })
    }

    /// Table `name`'s optimizer state, a view: `[rows, floats per row]`
    /// of float32 (Adagrad: one per column; row-wise Adagrad: one; Adam:
    /// `[m | v]`); `None` when the optimizer keeps none.
    fn optimizer_state(slf: Bound<'_, Self>, name: &str) -> PyResult<Option<Tensor>> {
        let owner = slf.clone().into_any().unbind();
        let mut this = exclusive(&slf)?;
        let t = this.viewable_table(name, "optimizer state")?;
        let table = &mut this.ebc.tables_mut()[t];
        let (rows, per_row) = (table.num_embeddings(), table.state_floats_per_row());
        if per_row == 0 {
            return Ok(None);
        }
        let state = table.optimizer_state_mut().as_mut_ptr().cast();
        let guard = Some(Arc::clone(&this.state_views));
        // SAFETY: as for `weight`: the state is one allocation of
        // `rows * per_row` floats, replaced only by `set_optimizer`, which
        // is refused while `guard` is held.
        Ok(Some(unsafe {
            Tensor::view(owner, guard, state, &[rows, per_row], Dtype::F32)
        }))
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
