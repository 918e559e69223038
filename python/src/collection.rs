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

fn parse_optimizer(json: &str) -> PyResult<TableOptimizer> {
    serde_json::from_str(json).map_err(|e| errors::json("optimizer", e))
}

impl Collection {
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
    fn new(tables_json: &str, optimizer_json: &str, seed: u64) -> PyResult<Self> {
        let configs: Vec<EmbeddingBagConfig> =
            serde_json::from_str(tables_json).map_err(|e| errors::json("tables", e))?;
        let optimizer = parse_optimizer(optimizer_json)?;
        let ebc = EmbeddingBagCollection::new(configs, optimizer, seed).map_err(errors::sparse)?;
        Ok(Self {
            ebc,
            pool: BufferPool::default(),
            state_views: Arc::new(()),
        })
    }

    /// Replaces the fused optimizer (JSON), with fresh state.
    fn set_optimizer(&mut self, optimizer_json: &str) -> PyResult<()> {
        let optimizer = parse_optimizer(optimizer_json)?;
        if Arc::strong_count(&self.state_views) > 1 {
            return Err(PyRuntimeError::new_err(
                "the optimizer state is viewed by a live tensor: let go of the views \
                 (optimizer_state) before replacing the optimizer",
            ));
        }
        self.ebc.set_optimizer(optimizer).map_err(errors::sparse)
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
    fn forward(&self, py: Python<'_>, kjt: PyRef<'_, Kjt>) -> PyResult<Tensor> {
        let kjt = &kjt.kjt;
        let (batch, width) = (kjt.stride(), self.ebc.width());
        let mut out = PooledBuffer::take(&self.pool, batch * width);
        let ebc = &self.ebc;
        py.detach(|| ebc.forward_into_slice(kjt, out.values_mut()))
            .map_err(errors::sparse)?;
        Ok(Tensor::owned(out, batch, width))
    }

    /// The backward of `forward(kjt)` with the optimizer applied in the
    /// scatter: `grad` is d(loss)/d(output), a contiguous float32 CPU
    /// array of `[batch, width]` (read in place). The GIL is released
    /// while it runs.
    fn backward(
        &mut self,
        py: Python<'_>,
        kjt: PyRef<'_, Kjt>,
        grad: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let kjt = &kjt.kjt;
        let imported = input::import(grad, "grad")?.ok_or_else(|| {
            PyValueError::new_err("grad: expected a float32 array (torch, numpy) through DLPack")
        })?;
        let shape = imported.shape();
        let want = [kjt.stride() as i64, self.ebc.width() as i64];
        if shape != want {
            return Err(PyValueError::new_err(format!(
                "grad: shape {shape:?}, but the output was {want:?} (batch, width)"
            )));
        }
        let grad = imported.f32s("grad")?;
        let ebc = &mut self.ebc;
        py.detach(|| ebc.backward_update(kjt, grad))
            .map_err(errors::sparse)
    }

    /// Table `name`'s rows, a view without a copy: `[rows, dim]` of
    /// float32, float16 or bfloat16; for the quantized types the rows as
    /// stored, `[rows, row bytes]` of uint8 (layouts in Ember's
    /// `DataType::row_bytes`). Writes through the view change the table.
    fn weight(slf: Bound<'_, Self>, name: &str) -> PyResult<Tensor> {
        let owner = slf.clone().into_any().unbind();
        let mut this = slf.try_borrow_mut()?;
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
        debug_assert_eq!(
            bytes.len(),
            rows * cols * crate::tensor::element_bytes(dtype)
        );
        // SAFETY: the rows of an in-memory table are one allocation of
        // `rows * cols` values of `dtype`, made when the table was built and
        // never moved or freed while the collection (kept by `owner`) lives.
        Ok(unsafe { Tensor::view(owner, None, bytes.as_mut_ptr(), rows, cols, dtype) })
    }

    /// Table `name`'s optimizer state, a view: `[rows, floats per row]`
    /// of float32 (Adagrad: one per column; row-wise Adagrad: one; Adam:
    /// `[m | v]`); `None` when the optimizer keeps none.
    fn optimizer_state(slf: Bound<'_, Self>, name: &str) -> PyResult<Option<Tensor>> {
        let owner = slf.clone().into_any().unbind();
        let mut this = slf.try_borrow_mut()?;
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
            Tensor::view(owner, guard, state, rows, per_row, Dtype::F32)
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
