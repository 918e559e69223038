//! `plan`: Ember's planner from Python, for tables sharded over the
//! in-process devices of one module (TorchRec's `EmbeddingShardingPlanner`
//! with a `Topology`).

use ember_sharding::plan::MAX_DEVICES;
use ember_sharding::{PlannerOptions, ShardingType, Topology};
use ember_sparse::EmbeddingBagConfig;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors;
use crate::tables::parse_optimizer;

/// Each device's memory when none is given: the planner then balances
/// the load alone (as the Rust API's `DlrmBuilder::shard_over`).
const UNBOUNDED_DEVICE_BYTES: u64 = 1 << 50;

/// The planner's plan (Ember's `ShardingPlan`, JSON) of `tables_json`
/// (Ember's `EmbeddingBagConfig`s) over `devices` devices of
/// `memory_bytes` each (`None`: as much as the tables need; the planner
/// then balances the load), for batches of `batch_size` samples with
/// `pooling_factor` ids a bag on average, under the optimizer
/// (`optimizer_json`), every table of type `sharding` (snake case, e.g.
/// `"row_wise"`) or each of the planner's choosing.
#[pyfunction]
#[pyo3(signature = (tables_json, devices, batch_size, pooling_factor, optimizer_json, sharding=None, memory_bytes=None))]
pub fn plan(
    tables_json: &str,
    devices: usize,
    batch_size: usize,
    pooling_factor: f64,
    optimizer_json: &str,
    sharding: Option<&str>,
    memory_bytes: Option<u64>,
) -> PyResult<String> {
    let tables: Vec<EmbeddingBagConfig> =
        serde_json::from_str(tables_json).map_err(|e| errors::json("tables", e))?;
    let sharding: Option<ShardingType> = sharding
        .map(|s| serde_json::from_value(s.into()).map_err(|e| errors::json("sharding type", e)))
        .transpose()?;
    if devices == 0 || devices > MAX_DEVICES {
        return Err(PyValueError::new_err(format!(
            "{devices} devices: from 1 to {MAX_DEVICES}"
        )));
    }
    if !(pooling_factor.is_finite() && pooling_factor > 0.0) || batch_size == 0 {
        return Err(PyValueError::new_err(format!(
            "batch_size {batch_size} and pooling_factor {pooling_factor}: both must be positive"
        )));
    }
    let options = PlannerOptions {
        batch_size,
        pooling_factor,
        optimizer: parse_optimizer(optimizer_json)?,
        sharding,
        disk_tier: None,
    };
    let memory = memory_bytes.unwrap_or(UNBOUNDED_DEVICE_BYTES);
    let topology = Topology::uniform(devices, memory);
    let (plan, _) = ember_sharding::plan(&tables, &topology, &options)
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    serde_json::to_string(&plan).map_err(|e| PyValueError::new_err(e.to_string()))
}
