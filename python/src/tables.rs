//! What the native collections (bags and sequences) share: borrowing one
//! from Python threads, replacing its optimizer, saving and loading Ember's
//! checkpoints, and views of its tables' rows and optimizer state through
//! DLPack without a copy, with the checks around them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_models::ModelError;
use ember_sharding::ShardingPlan;
use ember_sparse::{
    CachePolicy, DataType, DiskTierConfig, EmbeddingBagConfig, EmbeddingTable, TableOptimizer,
};
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pyclass::boolean_struct::False;
use pyo3::PyClass;

use crate::errors;
use crate::tensor::{Dtype, Tensor};

/// A native collection of tables, as the functions below need it.
pub trait NativeTables: PyClass<Frozen = False> + Send + Sync {
    /// Its tables (none when they are sharded).
    fn tables(&self) -> &[EmbeddingTable];
    /// Its tables, mutable (to take views).
    fn tables_mut(&mut self) -> &mut [EmbeddingTable];
    /// The devices its tables are sharded over (`None`: whole here).
    fn sharded_over(&self) -> Option<usize> {
        None
    }
    /// Held by every view of the optimizer state.
    fn state_views(&self) -> &Arc<()>;
    /// Replaces the fused optimizer (fresh state, the step count at 0).
    fn replace_optimizer(&mut self, optimizer: TableOptimizer) -> Result<(), ModelError>;
    /// Writes the tables, their optimizer state and step count to `path`
    /// (Ember's checkpoint: safetensors, TorchRec's names).
    fn save_to(&self, path: &Path) -> Result<(), ModelError>;
    /// Reads what `save_to` wrote into the tables (the optimizer state
    /// when the saved optimizer is of this collection's kind).
    fn load_from(&mut self, path: &Path) -> Result<(), ModelError>;
}

/// The disk tier of every one of `tables` tables: in `disk_dir`, behind a
/// cache of `cache_rows` rows each (least recently used evicted first);
/// none when neither is given.
pub fn disk_tiers(
    disk_dir: Option<PathBuf>,
    cache_rows: Option<usize>,
    tables: usize,
) -> PyResult<Vec<Option<DiskTierConfig>>> {
    match (disk_dir, cache_rows) {
        (Some(dir), Some(cache_rows)) => Ok(vec![
            Some(DiskTierConfig {
                dir,
                cache_rows,
                policy: CachePolicy::Lru,
            });
            tables
        ]),
        (None, None) => Ok(Vec::new()),
        _ => Err(PyValueError::new_err(
            "the disk tier takes both disk_dir and cache_rows (rows each table's cache holds)",
        )),
    }
}

/// Saves the collection's tables to Ember's checkpoint file `path`
/// (written whole or not at all); the GIL is released meanwhile.
pub fn save<T: NativeTables>(slf: &Bound<'_, T>, path: PathBuf) -> PyResult<()> {
    let this = shared(slf)?;
    let collection = &*this;
    slf.py()
        .detach(|| collection.save_to(&path))
        .map_err(errors::model)
}

/// Loads Ember's checkpoint file `path` into the collection's tables, in
/// place (views of them see the loaded rows).
pub fn load<T: NativeTables>(slf: &Bound<'_, T>, path: PathBuf) -> PyResult<()> {
    let mut this = exclusive(slf)?;
    let collection = &mut *this;
    slf.py()
        .detach(|| collection.load_from(&path))
        .map_err(errors::model)
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

/// Whether a view of the collection's optimizer state is alive.
pub fn state_viewed<T: NativeTables>(collection: &T) -> bool {
    Arc::strong_count(collection.state_views()) > 1
}

/// Replaces the collection's optimizer (JSON), refused while a view of
/// the old state lives; the GIL is released while the state is made.
pub fn set_optimizer<T: NativeTables>(slf: &Bound<'_, T>, optimizer_json: &str) -> PyResult<()> {
    let optimizer = parse_optimizer(optimizer_json)?;
    let mut this = exclusive(slf)?;
    if state_viewed(&*this) {
        return Err(PyRuntimeError::new_err(
            "the optimizer state is viewed by a live tensor: let go of the views \
             (optimizer_state) before replacing the optimizer",
        ));
    }
    let collection = &mut *this;
    slf.py()
        .detach(|| collection.replace_optimizer(optimizer))
        .map_err(errors::model)
}

/// Table `name`'s rows, a view (see [`rows`]).
pub fn weight<T: NativeTables>(slf: Bound<'_, T>, name: &str) -> PyResult<Tensor> {
    let owner = slf.clone().into_any().unbind();
    let mut this = exclusive(&slf)?;
    refuse_sharded(&*this, "rows")?;
    let t = viewable(this.tables(), name, "rows")?;
    Ok(rows(owner, &mut this.tables_mut()[t]))
}

/// Table `name`'s optimizer state, a view (see [`state`]).
pub fn optimizer_state<T: NativeTables>(slf: Bound<'_, T>, name: &str) -> PyResult<Option<Tensor>> {
    let owner = slf.clone().into_any().unbind();
    let mut this = exclusive(&slf)?;
    refuse_sharded(&*this, "optimizer state")?;
    let t = viewable(this.tables(), name, "optimizer state")?;
    let guard = Arc::clone(this.state_views());
    Ok(state(owner, &guard, &mut this.tables_mut()[t]))
}

/// Refuses a view (of `what`) into sharded tables: their rows are in
/// pieces on the devices.
fn refuse_sharded<T: NativeTables>(collection: &T, what: &str) -> PyResult<()> {
    match collection.sharded_over() {
        Some(n) => Err(PyValueError::new_err(format!(
            "the tables are sharded over {n} devices: their {what} are in shards, not one \
             array to view (gathered() copies them whole)"
        ))),
        None => Ok(()),
    }
}

/// Refuses sharding for tables whose lookups are staged (on the disk tier,
/// by `tiers` or by the plan, or keyed by raw ids): in one process the
/// modules shard tables in RAM indexed by id.
pub fn refuse_staged_sharding(
    configs: &[EmbeddingBagConfig],
    tiers: &[Option<DiskTierConfig>],
    plan: &ShardingPlan,
) -> PyResult<()> {
    if let Some(t) = plan.tables.iter().find(|t| t.cache_rows.is_some()) {
        return Err(PyValueError::new_err(format!(
            "the plan puts table '{}' on the disk tier (cache_rows): the modules shard \
             tables in RAM (plan without the disk tier)",
            t.table
        )));
    }
    let kv = configs.iter().find(|c| c.kv.is_some());
    if let Some(c) = kv {
        return Err(PyValueError::new_err(format!(
            "table '{}' is a key-value table: the modules shard tables in RAM indexed by id \
             (keep key-value tables whole)",
            c.name
        )));
    }
    if !tiers.is_empty() {
        return Err(PyValueError::new_err(
            "the disk tier and sharding together: the modules shard tables in RAM (keep \
             disk-tier tables whole)",
        ));
    }
    Ok(())
}

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
