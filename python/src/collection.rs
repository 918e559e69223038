//! `Collection`: an `EmbeddingBagCollection` driven from Python, whole in
//! this process or sharded over in-process devices by a plan. The lookups
//! and the fused backward release the GIL; outputs and table views cross
//! as DLPack tensors without copies.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_models::checkpoint::{StateDict, StateFile};
use ember_models::{ModelError, SparseArch};
use ember_sharding::{ShardedEmbeddingBagCollection, ShardingPlan};
use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingTable, KeyedJaggedTensor, KeyedTensor,
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
    /// The tables: one collection, or shards on in-process devices.
    arch: SparseArch,
    /// The tables' configs, as built (the shards' are their parts).
    configs: Vec<EmbeddingBagConfig>,
    /// Whether a lookup stages its batch first (fixed by the configs).
    staged: bool,
    /// The batch whose ids the shards routed last (their backward reuses
    /// that routing): held, so that its identity cannot be reused.
    routed: Option<Py<Kjt>>,
    pool: BufferPool,
    /// Held by every view of the optimizer state: the state is replaced
    /// only when none is alive.
    state_views: Arc<()>,
}

impl Collection {
    /// `arch`'s tables, staged or not as their configs say.
    fn new_of(arch: SparseArch, configs: Vec<EmbeddingBagConfig>) -> Self {
        let staged = (arch.local().iter())
            .flat_map(|e| e.tables())
            .any(|t| t.is_on_disk() || t.config().kv.is_some());
        Self {
            arch,
            configs,
            staged,
            routed: None,
            pool: BufferPool::default(),
            state_views: Arc::new(()),
        }
    }

    fn feature_names_of(&self) -> Vec<String> {
        match &self.arch {
            SparseArch::Local(e) => e.feature_names(),
            SparseArch::Sharded(s) => s.feature_names(),
        }
    }

    fn feature_dims_of(&self) -> Vec<usize> {
        match &self.arch {
            SparseArch::Local(e) => e.feature_dims(),
            SparseArch::Sharded(s) => s.feature_dims(),
        }
    }

    fn width_of(&self) -> usize {
        self.feature_dims_of().iter().sum()
    }

    /// The sharded tables, or why a method of sharded tables (`what`) was
    /// called on whole ones.
    fn sharded(&self, what: &str) -> PyResult<&ShardedEmbeddingBagCollection> {
        self.arch
            .sharded()
            .ok_or_else(|| PyValueError::new_err(format!("{what}: the tables are not sharded")))
    }

    /// A buffer for `kjt`'s pooled output, with its rows and width.
    fn output(&self, kjt: &KeyedJaggedTensor) -> PyResult<(PooledBuffer, usize, usize)> {
        let (batch, width) = (kjt.stride(), self.width_of());
        let len = batch.checked_mul(width).ok_or_else(|| {
            PyValueError::new_err(format!("{batch} samples of width {width} overflow"))
        })?;
        Ok((PooledBuffer::take(&self.pool, len)?, batch, width))
    }
}

/// Replaces `sharded` by the shards of `ebc` after `change` (the same
/// plan): how sharded tables take a new optimizer or loaded rows.
fn reshard(
    sharded: &mut ShardedEmbeddingBagCollection,
    mut ebc: EmbeddingBagCollection,
    change: impl FnOnce(&mut EmbeddingBagCollection) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    change(&mut ebc)?;
    *sharded = ShardedEmbeddingBagCollection::from_collection(&ebc, sharded.plan().clone())?;
    Ok(())
}

impl NativeTables for Collection {
    fn tables(&self) -> &[EmbeddingTable] {
        self.arch
            .local()
            .map_or_else(Default::default, |e| e.tables())
    }
    fn tables_mut(&mut self) -> &mut [EmbeddingTable] {
        (self.arch.local_mut()).map_or_else(Default::default, |e| e.tables_mut())
    }
    fn sharded_over(&self) -> Option<usize> {
        self.arch.sharded().map(|s| s.num_devices())
    }
    fn state_views(&self) -> &Arc<()> {
        &self.state_views
    }
    fn replace_optimizer(&mut self, optimizer: TableOptimizer) -> Result<(), ModelError> {
        match &mut self.arch {
            SparseArch::Local(e) => Ok(e.set_optimizer(optimizer)?),
            SparseArch::Sharded(s) => {
                let ebc = s.to_collection()?;
                reshard(s, ebc, |e| Ok(e.set_optimizer(optimizer)?))
            }
        }
    }
    fn save_to(&self, path: &Path) -> Result<(), ModelError> {
        let tables = self.arch.unsharded()?;
        let mut state = StateDict::new();
        state.add_collection("", &tables);
        state.save(path, None)
    }
    fn load_from(&mut self, path: &Path) -> Result<(), ModelError> {
        let file = StateFile::open(path)?;
        match &mut self.arch {
            SparseArch::Local(e) => file.load_collection("", e),
            SparseArch::Sharded(s) => {
                let ebc = s.to_collection()?;
                reshard(s, ebc, |e| file.load_collection("", e))
            }
        }
    }
}

#[pymethods]
impl Collection {
    /// Tables from their configs (a JSON list of Ember's
    /// `EmbeddingBagConfig`), initialised from `seed`, with the optimizer
    /// (Ember's `TableOptimizer` as JSON) fused into `backward`. With
    /// `disk_dir`, every table on the disk tier there, behind a cache of
    /// `cache_rows` rows each (least recently used evicted first). With
    /// `plan_json` (Ember's `ShardingPlan`), the tables sharded by it over
    /// in-process devices, each a thread (in RAM, indexed by id: neither
    /// the disk tier nor key-value tables).
    #[new]
    #[pyo3(signature = (tables_json, optimizer_json, seed, disk_dir=None, cache_rows=None, plan_json=None))]
    fn new(
        py: Python<'_>,
        tables_json: &str,
        optimizer_json: &str,
        seed: u64,
        disk_dir: Option<PathBuf>,
        cache_rows: Option<usize>,
        plan_json: Option<&str>,
    ) -> PyResult<Self> {
        let configs: Vec<EmbeddingBagConfig> =
            serde_json::from_str(tables_json).map_err(|e| errors::json("tables", e))?;
        let optimizer = parse_optimizer(optimizer_json)?;
        let tiers = tables::disk_tiers(disk_dir, cache_rows, configs.len())?;
        let plan: Option<ShardingPlan> = plan_json
            .map(|json| serde_json::from_str(json).map_err(|e| errors::json("plan", e)))
            .transpose()?;
        if let Some(plan) = &plan {
            tables::refuse_staged_sharding(&configs, &tiers, plan)?;
            // Before the devices' channels are made for its device count.
            (plan.validate(&configs, &optimizer))
                .map_err(|e| PyValueError::new_err(e.to_string()))?;
        }
        let built = configs.clone();
        // Drawing gigabytes of rows takes seconds: other threads go on.
        let arch = py
            .detach(|| {
                let ebc = EmbeddingBagCollection::with_disk_tiers(built, optimizer, seed, tiers)?;
                Ok::<_, ModelError>(match plan {
                    None => SparseArch::Local(ebc),
                    Some(plan) => SparseArch::Sharded(
                        ShardedEmbeddingBagCollection::from_collection(&ebc, plan)?,
                    ),
                })
            })
            .map_err(errors::model)?;
        Ok(Self::new_of(arch, configs))
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
        serde_json::to_string(&self.arch.optimizer()).unwrap_or_default()
    }

    /// The tables' configs, as JSON.
    #[getter]
    fn tables(&self) -> String {
        serde_json::to_string(&self.configs).unwrap_or_default()
    }

    /// Output features, in output order.
    #[getter]
    fn feature_names(&self) -> Vec<String> {
        self.feature_names_of()
    }

    /// Each output feature's width.
    #[getter]
    fn feature_dims(&self) -> Vec<usize> {
        self.feature_dims_of()
    }

    /// The width of an output row: the sum of the feature dims.
    #[getter]
    fn width(&self) -> usize {
        self.width_of()
    }

    /// Backward updates applied so far.
    #[getter]
    fn step(&self) -> u64 {
        self.arch.step()
    }

    /// The plan the tables are sharded by (Ember's `ShardingPlan` as
    /// JSON); `None` when they are whole.
    #[getter]
    fn plan(&self) -> Option<String> {
        let sharded = self.arch.sharded()?;
        serde_json::to_string(sharded.plan()).ok()
    }

    /// Sharded tables gathered into a new collection of whole tables (a
    /// copy of every row and its optimizer state), for their state dict.
    /// The GIL is released while it runs.
    fn gathered(slf: &Bound<'_, Self>) -> PyResult<Self> {
        let this = shared(slf)?;
        let sharded = this.sharded("gathered")?;
        let ebc = slf
            .py()
            .detach(|| sharded.to_collection())
            .map_err(|e| errors::model(e.into()))?;
        Ok(Self::new_of(SparseArch::Local(ebc), this.configs.clone()))
    }

    /// Shards `whole` (whole tables of these configs, from `gathered`) by
    /// this collection's plan in place of its shards: rows, optimizer
    /// state and step count. The GIL is released while it runs.
    fn reshard_from(slf: &Bound<'_, Self>, whole: PyRef<'_, Collection>) -> PyResult<()> {
        let mut this = exclusive(slf)?;
        this.sharded("reshard_from")?;
        let ebc = (whole.arch.local())
            .filter(|_| {
                whole.configs == this.configs && whole.arch.optimizer() == this.arch.optimizer()
            })
            .ok_or_else(|| {
                PyValueError::new_err(
                    "reshard_from: expected whole tables of these configs and optimizer \
                     (from gathered())",
                )
            })?;
        let SparseArch::Sharded(sharded) = &mut this.arch else {
            unreachable!("checked above");
        };
        let plan = sharded.plan().clone();
        let resharded = slf
            .py()
            .detach(|| ShardedEmbeddingBagCollection::from_collection(ebc, plan))
            .map_err(|e| errors::model(e.into()))?;
        *sharded = resharded;
        Ok(())
    }

    /// Pooled lookup of every feature: a new `[batch, width]` float32
    /// tensor. The GIL is released while it runs.
    fn forward(slf: &Bound<'_, Self>, batch_kjt: &Bound<'_, Kjt>) -> PyResult<Tensor> {
        let kjt = &batch_kjt.get().kjt;
        let (mut out, batch, width);
        if shared(slf)?.arch.sharded().is_some() {
            // The devices keep the batch's routing for its backward.
            let mut this = exclusive(slf)?;
            (out, batch, width) = this.output(kjt)?;
            let (names, dims) = (this.feature_names_of(), this.feature_dims_of());
            let mut keyed = KeyedTensor::new(names, dims, std::mem::take(out.vec_mut()))
                .map_err(errors::sparse)?;
            let SparseArch::Sharded(sharded) = &mut this.arch else {
                unreachable!("checked above");
            };
            let done = slf.py().detach(|| sharded.forward_into(kjt, &mut keyed));
            *out.vec_mut() = keyed.into_values();
            done.map_err(|e| errors::model(e.into()))?;
            this.routed = Some(batch_kjt.clone().unbind());
            return Ok(Tensor::owned(out, batch, width));
        }
        let done = if shared(slf)?.staged {
            // The batch's rows into the disk tier's caches and raw ids into
            // rows first (FBGEMM's prefetch), which changes the collection;
            // the backward updates the same rows.
            let mut this = exclusive(slf)?;
            (out, batch, width) = this.output(kjt)?;
            let ebc = this
                .arch
                .local_mut()
                .expect("whole tables: sharded returned above");
            let values = out.values_mut();
            slf.py().detach(|| {
                ebc.prefetch(kjt)?;
                ebc.forward_into_slice(kjt, values)
            })
        } else {
            let this = shared(slf)?;
            (out, batch, width) = this.output(kjt)?;
            let ebc = this
                .arch
                .local()
                .expect("whole tables: sharded returned above");
            let values = out.values_mut();
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
        exclusive(slf)?.arch.set_training(training);
        Ok(())
    }

    /// The backward of `forward(kjt)` with the optimizer applied in the
    /// scatter: `grad` is d(loss)/d(output), a contiguous float32 CPU
    /// array of `[batch, width]` (read in place). The GIL is released
    /// while it runs.
    fn backward(
        slf: &Bound<'_, Self>,
        batch_kjt: &Bound<'_, Kjt>,
        grad: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut this = exclusive(slf)?;
        let kjt = &batch_kjt.get().kjt;
        let imported = input::import(grad, "grad")?.ok_or_else(|| {
            PyValueError::new_err("grad: expected a float32 array (torch, numpy) through DLPack")
        })?;
        let shape = imported.shape();
        let want = [kjt.stride() as i64, this.width_of() as i64];
        if shape != want {
            return Err(PyValueError::new_err(format!(
                "grad: shape {shape:?}, but the output was {want:?} (batch, width)"
            )));
        }
        let grad = imported.f32s("grad")?;
        // Shards are never viewed: no gradient can lie in them.
        tables::refuse_overlap(NativeTables::tables(&*this), grad)?;
        // Shards update the rows their last forward routed: a backward of
        // another batch (two lookups before their backwards) routes its
        // own ids again first.
        let last = this.routed.as_ref().map(|k| k.as_ptr());
        let reroute = this.arch.sharded().is_some() && last != Some(batch_kjt.as_ptr());
        let arch = &mut this.arch;
        slf.py()
            .detach(|| {
                if let (true, SparseArch::Sharded(sharded)) = (reroute, &mut *arch) {
                    sharded.forward(kjt)?;
                }
                arch.backward_update(kjt, grad)
            })
            .map_err(errors::model)?;
        if reroute {
            this.routed = Some(batch_kjt.clone().unbind());
        }
        Ok(())
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
        let sharded =
            (self.sharded_over()).map_or(String::new(), |n| format!(", sharded over {n} devices"));
        format!(
            "ember._native.Collection({} tables, width {}, optimizer {}{sharded})",
            self.configs.len(),
            self.width_of(),
            self.optimizer()
        )
    }
}
