//! Views of a collection's tables for Python: rows and optimizer state
//! through DLPack without a copy, and the checks around them (shared by
//! the bag and the sequence collections).

use std::sync::Arc;

use ember_sparse::{DataType, EmbeddingTable};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;

use crate::tensor::{Dtype, Tensor};

/// The index of table `name`, refused (naming why) where its rows are not
/// one array indexed by id in RAM; `what` names what was asked for.
pub fn viewable(tables: &[EmbeddingTable], name: &str, what: &str) -> PyResult<usize> {
    let t = tables
        .iter()
        .position(|t| t.name() == name)
        .ok_or_else(|| PyKeyError::new_err(format!("no table named '{name}'")))?;
    let table = &tables[t];
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

/// A view of `table`'s rows (checked by [`viewable`]), kept alive by
/// `owner`: `[rows, dim]` of float32, float16 or bfloat16; for the
/// quantized types the rows as stored, `[rows, row bytes]` of uint8.
pub fn rows(owner: Py<PyAny>, table: &mut EmbeddingTable) -> Tensor {
    let (rows, dim) = (table.num_embeddings(), table.dim());
    let (cols, dtype) = match table.data_type() {
        DataType::Fp32 => (dim, Dtype::F32),
        DataType::Fp16 => (dim, Dtype::F16),
        DataType::Bf16 => (dim, Dtype::Bf16),
        _ => (table.bytes_per_row(), Dtype::U8),
    };
    let bytes = table.row_bytes_mut();
    assert_eq!(bytes.len(), rows * cols * dtype.bytes(), "a table's rows");
    // SAFETY: the rows of an in-memory table are one allocation of
    // `rows * cols` values of `dtype`, made when the table was built and
    // never moved or freed while the collection (kept by `owner`) lives.
    unsafe { Tensor::view(owner, None, bytes.as_mut_ptr(), &[rows, cols], dtype) }
}

/// A view of `table`'s optimizer state (checked by [`viewable`]),
/// `[rows, floats per row]` of float32, holding `guard`; `None` when the
/// optimizer keeps none.
pub fn state(owner: Py<PyAny>, guard: &Arc<()>, table: &mut EmbeddingTable) -> Option<Tensor> {
    let (rows, per_row) = (table.num_embeddings(), table.state_floats_per_row());
    if per_row == 0 {
        return None;
    }
    let state = table.optimizer_state_mut();
    assert_eq!(state.len(), rows * per_row, "a table's optimizer state");
    let data = state.as_mut_ptr().cast();
    // SAFETY: as for `rows`: the state is one allocation of `rows *
    // per_row` floats, replaced only by a new optimizer, which the
    // collections refuse while a guard is held.
    Some(unsafe {
        Tensor::view(
            owner,
            Some(Arc::clone(guard)),
            data,
            &[rows, per_row],
            Dtype::F32,
        )
    })
}

/// Refuses a gradient that lies in a table's rows or optimizer state: the
/// backward writes those while it reads the gradient.
pub fn refuse_overlap(tables: &[EmbeddingTable], grad: &[f32]) -> PyResult<()> {
    let span = |start: *const u8, bytes: usize| (start as usize, start as usize + bytes);
    let (g0, g1) = span(grad.as_ptr().cast(), std::mem::size_of_val(grad));
    for table in tables.iter().filter(|t| !t.is_on_disk()) {
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
