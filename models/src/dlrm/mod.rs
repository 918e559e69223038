//! DLRM (dot interaction) and DLRM-DCNv2 (low-rank cross network), in
//! TorchRec's structure: sparse_arch (embedding bags) → dense_arch (bottom
//! MLP) → inter_arch → over_arch (top MLP ending in one logit).

mod builder;
mod config;
mod dense_arch;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_dense::{
    clip_grad_norm, BceWithLogits, DenseBackend, DenseOptimizer, DenseOptimizerConfig, HasParams,
    Tensor, WeightDecay,
};
use ember_sharding::{
    Collective, InitialRows, InputRouter, RoutedInput, ShardSource, ShardedEmbeddingBagCollection,
    ShardingPlan,
};
use ember_sparse::{DiskTierConfig, EmbeddingBagCollection, KeyedTensor, TableOptimizer};
use serde::Serialize;

use crate::model::DataParallel;
use crate::sparse_arch::SparseArch;
use crate::{
    Backend, Batch, BatchError, CompiledDenseStep, ExecMode, InputDist, Model, ModelError,
    Optimization, Routed, TrainState, Unsupported,
};

pub use builder::{
    BatchShape, BuildError, DlrmBuilder, DEFAULT_DENSE_OPTIMIZER, DEFAULT_TABLE_OPTIMIZER,
};
pub use config::{ArchitectureError, DlrmConfig, InteractionType};
pub use dense_arch::DenseArch;
pub(crate) use dense_arch::{bottom_linear_prefix, top_linear_prefix};

/// Wall time of each phase of a training step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PhaseTimes {
    /// The batch checks and the pooled embedding lookup.
    pub sparse_forward: Duration,
    /// Dense forward and loss (with `--mode defer-fuse` the backward too;
    /// compiled: the whole dense step).
    pub dense_forward: Duration,
    /// Dense backward (0 when it ran inside `dense_forward`).
    pub dense_backward: Duration,
    /// The dense optimizer's step.
    pub dense_update: Duration,
    /// The embeddings' backward with the fused table optimizer.
    pub sparse_backward_update: Duration,
}

impl std::ops::AddAssign for PhaseTimes {
    /// Phase by phase (a sum over steps).
    fn add_assign(&mut self, t: Self) {
        self.sparse_forward += t.sparse_forward;
        self.dense_forward += t.dense_forward;
        self.dense_backward += t.dense_backward;
        self.dense_update += t.dense_update;
        self.sparse_backward_update += t.sparse_backward_update;
    }
}

impl PhaseTimes {
    /// The sum of the phases.
    pub fn total(&self) -> Duration {
        self.sparse_forward
            + self.dense_forward
            + self.dense_backward
            + self.dense_update
            + self.sparse_backward_update
    }
}

/// How a training step runs its dense part.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Run {
    /// Op by op.
    Eager,
    /// Op by op, with every output checked before any update (`--mode debug`).
    Checked,
    /// As one window of the backend (`--mode defer-fuse`).
    Fused,
}

/// What one training step reports.
#[derive(Clone, Copy, Debug)]
pub struct StepOutput {
    /// The batch's mean binary cross-entropy, before the update (on a
    /// world: the mean over every rank's samples).
    pub loss: f32,
    /// How long each phase took.
    pub times: PhaseTimes,
}

/// A whole DLRM in f32: embedding bags with a fused optimizer, the dense
/// arch and its optimizer, and the buffers reused across steps.
pub struct Dlrm {
    config: DlrmConfig,
    sparse_arch: SparseArch,
    dense_arch: DenseArch<f32>,
    dense_optimizer: DenseOptimizer<f32>,
    pooled: KeyedTensor,
    pooled_dense: Tensor<f32>,
    loss: BceWithLogits<f32>,
    /// Set when this process is one rank of a data-parallel world.
    world: Option<DataParallel>,
    /// The compiled mode's step, made at its first step (and again when
    /// the batch size changes); while it runs, the device holds the truth.
    compiled: Option<CompiledDenseStep>,
    /// The input dist of the batch the running step looks up, when it ran
    /// ahead ([`Model::train_step_routed`]).
    routed: Option<RoutedInput>,
    /// Whether the Trainer's pipeline reads disk-tier rows ahead (see
    /// [`Dlrm::set_read_ahead`]).
    read_ahead: bool,
    /// How the model reads its inputs (see [`Dlrm::dataset_spec`]).
    dataset_spec: Option<ember_dataloader::DatasetSpec>,
    /// Clip the dense gradients at this global norm (set by
    /// [`Model::set_optimization`]).
    max_grad_norm: Option<f32>,
    /// The disk tier's directory, held while the model's tables use it
    /// (taken by [`DlrmBuilder::disk_tier`]).
    disk_dir: Option<ember_dataloader::lock::DirLock>,
    /// The checkpoint chain the tables' changed rows count from (the one
    /// last saved, or loaded): what a delta checkpoint builds on.
    chain_head: Option<crate::checkpoint::ChainHead>,
}

/// [`Model::input_dist`] of a sharded [`Dlrm`]: its tables' input router.
struct DlrmInputDist(InputRouter);

/// [`Model::input_dist`] of a [`Dlrm`] with disk-tier tables: the next
/// batch's missing rows read ahead while the current one computes.
struct DiskReadAhead(ember_sparse::ReadAhead);

/// What [`DiskReadAhead`] hands the step: nothing but that it ran.
struct ReadAheadDone;

impl InputDist for DiskReadAhead {
    fn run(&self, batch: &Batch) -> Result<Routed, ModelError> {
        self.0.run(&batch.sparse);
        Ok(Box::new(ReadAheadDone))
    }
}

impl InputDist for DlrmInputDist {
    fn run(&self, batch: &Batch) -> Result<Routed, ModelError> {
        Ok(Box::new(self.0.route(&batch.sparse)?))
    }
}

impl Dlrm {
    /// A new model in one process, with the tables whose entry of `tiers`
    /// is `Some` on the disk tier (see
    /// [`EmbeddingBagCollection::with_disk_tiers`]): each forward first
    /// brings its batch's rows into their caches. Checkpoints stream such
    /// tables a piece at a time, and [`shard`](Self::shard) puts their
    /// shards on the disk tier too.
    pub(crate) fn with_disk_tiers(
        config: DlrmConfig,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
        seed: u64,
        tiers: Vec<Option<ember_sparse::DiskTierConfig>>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let sparse_arch = SparseArch::Local(EmbeddingBagCollection::with_disk_tiers(
            config.tables.clone(),
            table_optimizer,
            seed,
            tiers,
        )?);
        Self::with_tables(config, sparse_arch, dense_optimizer, seed)
    }

    /// Whether the Trainer's pipeline reads the next batch's disk-tier rows
    /// ahead (an [`ember_sparse::ReadAhead`] as its input dist) while a
    /// batch computes; off by default. On two cores the read-ahead's
    /// system calls took time from the dense model, and the full MLPerf
    /// step ran slower with it (see the book's disk-tier guide).
    pub fn set_read_ahead(&mut self, on: bool) {
        self.read_ahead = on;
    }

    /// The dataset spec of the data this model is trained on (set by the
    /// [`Trainer`](crate::Trainer) from a `Loader`, or read from its
    /// checkpoint): its checkpoints carry it, so that evaluation reads
    /// inputs as training did. `None`: not known.
    pub fn dataset_spec(&self) -> Option<&ember_dataloader::DatasetSpec> {
        self.dataset_spec.as_ref()
    }

    /// The checkpoint chain this model's changed rows count from.
    pub(crate) fn chain_head(&self) -> Option<&crate::checkpoint::ChainHead> {
        self.chain_head.as_ref()
    }

    pub(crate) fn set_chain_head(&mut self, head: Option<crate::checkpoint::ChainHead>) {
        self.chain_head = head;
    }

    /// Sets (or clears) what [`dataset_spec`](Self::dataset_spec) returns.
    pub fn set_dataset_spec(&mut self, spec: Option<ember_dataloader::DatasetSpec>) {
        self.dataset_spec = spec;
    }

    /// A rank's model whose shards come from `source` (with the table
    /// optimizer and its step count); the dense part is initialised from
    /// `seed`.
    pub(crate) fn on_rank(
        config: DlrmConfig,
        (table_optimizer, step, source): (TableOptimizer, u64, &dyn ShardSource),
        dense_optimizer: DenseOptimizerConfig,
        seed: u64,
        plan: ShardingPlan,
        comm: Option<Arc<dyn Collective>>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let tables = config.tables.clone();
        let mut sharded = match &comm {
            Some(comm) => ShardedEmbeddingBagCollection::on_rank(
                tables,
                table_optimizer,
                step,
                source,
                plan,
                comm.clone(),
            )?,
            None => ShardedEmbeddingBagCollection::from_source(
                tables,
                table_optimizer,
                step,
                source,
                plan,
            )?,
        };
        // As a one-process model's collection: its rounding is seeded like its rows.
        sharded.set_rounding_seed(seed);
        let mut model =
            Self::with_tables(config, SparseArch::Sharded(sharded), dense_optimizer, seed)?;
        model.world = comm.map(DataParallel::new);
        Ok(model)
    }

    /// A model of `sparse_arch`'s tables, its dense part new from `seed`.
    pub(crate) fn with_tables(
        config: DlrmConfig,
        sparse_arch: SparseArch,
        dense_optimizer: DenseOptimizerConfig,
        seed: u64,
    ) -> Result<Self, ModelError> {
        let dense_arch = DenseArch::new(&config, seed)?;
        let pooled = sparse_arch.new_output(0);
        Ok(Self {
            config,
            sparse_arch,
            dense_arch,
            dense_optimizer: DenseOptimizer::new(dense_optimizer),
            pooled,
            pooled_dense: Tensor::zeros(0, 0),
            loss: BceWithLogits::new(),
            world: None,
            compiled: None,
            routed: None,
            read_ahead: false,
            dataset_spec: None,
            disk_dir: None,
            max_grad_norm: None,
            chain_head: None,
        })
    }

    /// The architecture.
    pub fn config(&self) -> &DlrmConfig {
        &self.config
    }
    /// The embedding tables (TorchRec's `sparse_arch`), local or sharded.
    pub fn sparse_arch(&self) -> &SparseArch {
        &self.sparse_arch
    }
    /// The embedding tables, mutably. Resharding through this leaves the
    /// model's pooled output buffer stale; use [`Dlrm::shard`] for that.
    pub fn sparse_arch_mut(&mut self) -> &mut SparseArch {
        &mut self.sparse_arch
    }
    /// Shards the tables over devices by `plan`, or gathers them back into
    /// one collection (`None`).
    pub fn shard(&mut self, plan: Option<ShardingPlan>) -> Result<(), ModelError> {
        if self.world.is_some() {
            return Err(Unsupported::ReshardOnRank.into());
        }
        // Rows that move lose count of their changes: deltas start again
        // from the next full checkpoint.
        if plan.is_some() || self.sparse_arch.local().is_none() {
            self.chain_head = None;
        }
        self.sparse_arch.reshard(plan)?;
        self.pooled = self.sparse_arch.new_output(0);
        Ok(())
    }

    /// The world's collective, when this model is one rank of it.
    pub fn world(&self) -> Option<&Arc<dyn Collective>> {
        self.world.as_ref().map(|w| w.comm())
    }
    /// The bottom MLP, interaction and top MLP. In the compiled mode the
    /// host copy is stale until [`Model::sync_to_host`].
    pub fn dense_arch(&self) -> &DenseArch<f32> {
        &self.dense_arch
    }
    /// The dense arch, mutably (its parameters, e.g. to read or set them).
    pub fn dense_arch_mut(&mut self) -> &mut DenseArch<f32> {
        &mut self.dense_arch
    }
    /// The dense parameters' optimizer, with its state and step count.
    pub fn dense_optimizer(&self) -> &DenseOptimizer<f32> {
        &self.dense_optimizer
    }
    /// The dense optimizer, mutably (e.g. to restore its state).
    pub fn dense_optimizer_mut(&mut self) -> &mut DenseOptimizer<f32> {
        &mut self.dense_optimizer
    }

    fn check_batch(&self, batch: &Batch) -> Result<(), ModelError> {
        let n = batch.size();
        if batch.dense.rows() != n || batch.dense.cols() != self.config.num_dense() {
            return Err(BatchError::DenseShape {
                rows: batch.dense.rows(),
                cols: batch.dense.cols(),
                samples: n,
                num_dense: self.config.num_dense(),
            }
            .into());
        }
        if batch.sparse.stride() != n {
            return Err(BatchError::SparseSamples {
                sparse: batch.sparse.stride(),
                labels: n,
            }
            .into());
        }
        Ok(())
    }

    /// Pooled lookup (of the input dist that ran ahead, if any), then the
    /// pooled rows as a dense `[batch, F * D]` tensor.
    fn lookup(&mut self, batch: &Batch) -> Result<(), ModelError> {
        match self.routed.take() {
            Some(routed) => {
                (self.sparse_arch).forward_routed(&batch.sparse, routed, &mut self.pooled)?
            }
            None => (self.sparse_arch).forward_into(&batch.sparse, &mut self.pooled)?,
        }
        self.pooled_dense.resize(batch.size(), self.pooled.width());
        self.pooled_dense
            .data_mut()
            .copy_from_slice(self.pooled.values());
        Ok(())
    }

    /// The batch checked and looked up: the first phase of every step.
    fn checked_lookup(&mut self, batch: &Batch) -> Result<PhaseTimes, ModelError> {
        self.check_batch(batch)?;
        let t = Instant::now();
        self.lookup(batch)?;
        Ok(PhaseTimes {
            sparse_forward: t.elapsed(),
            ..PhaseTimes::default()
        })
    }

    /// Logits of a batch (no update).
    pub(crate) fn logits(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<&[f32], ModelError> {
        self.check_batch(batch)?;
        self.lookup(batch)?;
        Ok(self
            .dense_arch
            .forward(be, &batch.dense, &self.pooled_dense)
            .data())
    }

    /// One training step with the dense part as one compiled executable
    /// (`step`, made for this model): the lookup, the compiled dense step
    /// (reported as `dense_forward`: forward, backward and update together),
    /// then the sparse backward. The host copy of the dense parameters is
    /// stale until `step.sync_to_host(model)`.
    pub fn train_step_compiled(
        &mut self,
        step: &mut crate::CompiledDenseStep,
        batch: &Batch,
    ) -> Result<StepOutput, ModelError> {
        if self.world.is_some() {
            return Err(Unsupported::CompiledOnRanks.into());
        }
        if self.max_grad_norm.is_some() || self.dense_optimizer.weight_decay() != WeightDecay::None
        {
            return Err(Unsupported::CompiledOptimization.into());
        }
        step.set_learning_rate(self.dense_optimizer.learning_rate());
        let mut times = self.checked_lookup(batch)?;
        let t = Instant::now();
        let (loss, d_pooled) =
            step.run(batch.dense.data(), self.pooled_dense.data(), &batch.labels)?;
        times.dense_forward = t.elapsed();
        let t = Instant::now();
        self.sparse_arch.backward_update(&batch.sparse, &d_pooled)?;
        times.sparse_backward_update = t.elapsed();
        Ok(StepOutput { loss, times })
    }

    /// One training step: forward, loss, backward, and both optimizers.
    pub(crate) fn eager_step(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<StepOutput, ModelError> {
        self.step(be, batch, Run::Eager)
    }

    /// `--mode debug`: a training step that, before any update, checks the
    /// pooled embeddings, every layer's output, the loss and every gradient
    /// for NaN and infinity; the first one is an error naming the table or
    /// layer, the sample and the value, and the model is left unchanged.
    pub(crate) fn checked_step(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<StepOutput, ModelError> {
        self.step(be, batch, Run::Checked)
    }

    /// `--mode defer-fuse`: the eager step with the dense forward, loss
    /// and backward issued as one window the backend may record and run fused
    /// ([`DenseBackend::fused`]); `dense_forward` times the whole window.
    pub(crate) fn fused_step(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<StepOutput, ModelError> {
        self.step(be, batch, Run::Fused)
    }

    fn step(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
        run: Run,
    ) -> Result<StepOutput, ModelError> {
        let mut times = self.checked_lookup(batch)?;
        if run == Run::Checked {
            self.check_pooled("the pooled embeddings of", self.pooled.values())?;
        }

        let t = Instant::now();
        if run == Run::Fused {
            let (arch, loss, pooled) = (&mut self.dense_arch, &mut self.loss, &self.pooled_dense);
            let mut dense = || {
                let logits = arch.forward(be, &batch.dense, pooled);
                loss.forward_backward(be, logits, &batch.labels);
                arch.backward(be, loss.grad());
            };
            // SAFETY: every tensor the ops are given belongs to `self` or `batch`,
            // both borrowed for this whole call, and `dense` only runs layers,
            // which touch their buffers through the backend's ops.
            unsafe { be.fused(&mut dense) };
            times.dense_forward = t.elapsed();
        } else {
            let logits = self
                .dense_arch
                .forward(be, &batch.dense, &self.pooled_dense);
            self.loss.forward_backward(be, logits, &batch.labels);
            times.dense_forward = t.elapsed();
            let t = Instant::now();
            self.dense_arch.backward(be, self.loss.grad());
            times.dense_backward = t.elapsed();
        }
        let mut loss = self.loss.loss();
        if let Some(world) = &mut self.world {
            let scale;
            (loss, scale) = world.average(self.dense_arch.params(), batch.size(), loss)?;
            // The pooled gradient stays per sample: only its 1/n becomes 1/total.
            (self.dense_arch.pooled_grad_mut().data_mut().iter_mut()).for_each(|g| *g *= scale);
        }

        if run == Run::Checked {
            if let Some(e) = self.dense_arch.first_non_finite_activation() {
                return Err(e);
            }
            if !loss.is_finite() {
                return Err(ModelError::NonFinite {
                    what: "the loss".into(),
                    location: "the batch mean".into(),
                    value: loss,
                });
            }
            let d_pooled = self.dense_arch.pooled_grad().data();
            self.check_pooled("the gradient of the pooled embeddings of", d_pooled)?;
            if let Some(e) = self.dense_arch.first_non_finite_gradient() {
                return Err(e);
            }
        }
        let t = Instant::now();
        self.sparse_arch
            .backward_update(&batch.sparse, self.dense_arch.pooled_grad().data())?;
        times.sparse_backward_update = t.elapsed();

        let t = Instant::now();
        if let Some(max_norm) = self.max_grad_norm {
            // Every rank holds the averaged gradients: the same norm, the same clip.
            clip_grad_norm(&mut self.dense_arch.params(), max_norm as f64);
        }
        self.dense_optimizer.step(self.dense_arch.params());
        times.dense_update = t.elapsed();
        Ok(StepOutput { loss, times })
    }

    /// A pooled-layout buffer's first NaN or infinity, named by its feature's table.
    fn check_pooled(&self, what: &str, values: &[f32]) -> Result<(), ModelError> {
        let width = self.pooled.width().max(1);
        let Some(i) = values.iter().position(|v| !v.is_finite()) else {
            return Ok(());
        };
        let (sample, col) = (i / width, i % width);
        let k = (self.pooled.offset_per_key().iter())
            .rposition(|&o| o <= col)
            .unwrap_or(0)
            .min(self.pooled.keys().len().saturating_sub(1));
        let feature = self.pooled.keys().get(k).cloned().unwrap_or_default();
        let table = (self.config.tables.iter())
            .find(|t| t.feature_names.contains(&feature))
            .map_or(String::new(), |t| t.name.clone());
        Err(ModelError::NonFinite {
            what: format!("{what} feature '{feature}' (table '{table}')"),
            location: format!(
                "sample {sample}, column {}",
                col - self.pooled.offset_per_key()[k]
            ),
            value: values[i],
        })
    }
}

impl Dlrm {
    /// The compiled mode's step: made for this batch size on first use
    /// (after bringing a previous step's state home), then run.
    fn step_compiled(
        &mut self,
        pjrt: &Arc<ember_dense::pjrt::PjrtBackend>,
        batch: &Batch,
    ) -> Result<StepOutput, ModelError> {
        // One executable per batch size: a short last batch gets its own.
        if self.compiled.as_ref().map(|s| s.batch_size()) != Some(batch.size()) {
            self.sync_to_host()?;
            self.compiled = Some(CompiledDenseStep::new(pjrt.clone(), self, batch.size())?);
        }
        let mut step = self.compiled.take().expect("made above");
        let out = self.train_step_compiled(&mut step, batch);
        self.compiled = Some(step);
        out
    }

    /// The model placed by `plan`, from `checkpoint` or new from `seed`,
    /// the tables whose entry of `tiers` is `Some` (none: empty) on the
    /// disk tier (their shards too, each device caching its own). On a
    /// rank of `world`, only its shards are ever built (or read); alone,
    /// the whole model is built, then sharded over threads.
    pub(crate) fn place(
        config: &DlrmConfig,
        (table_optimizer, dense_optimizer): (TableOptimizer, DenseOptimizerConfig),
        seed: u64,
        (plan, world): (Option<ShardingPlan>, Option<&Arc<dyn Collective>>),
        checkpoint: Option<&crate::Checkpoint>,
        tiers: Vec<Option<DiskTierConfig>>,
    ) -> Result<Dlrm, ModelError> {
        Ok(match (checkpoint, plan, world) {
            (Some(ckpt), Some(plan), Some(comm)) => {
                let placed = (plan, Some(comm.clone()));
                ckpt.model_on_rank(table_optimizer, dense_optimizer, placed, tiers)?
            }
            // Key-value shards of buckets read their own maps, as on ranks
            // (through one collection they would become one map).
            (Some(ckpt), Some(plan), None)
                if has_bucket_shards(&plan) && ckpt.delta_count() == 0 =>
            {
                let placed = (plan, None);
                ckpt.model_on_rank(table_optimizer, dense_optimizer, placed, tiers)?
            }
            (None, Some(plan), Some(comm)) => {
                let rows = InitialRows { seed };
                let source = ember_sharding::WithDiskTiers {
                    source: &rows,
                    tiers,
                };
                let tables = (table_optimizer, 0, &source as &dyn ShardSource);
                let (config, comm) = (config.clone(), Some(comm.clone()));
                Self::on_rank(config, tables, dense_optimizer, seed, plan, comm)?
            }
            (checkpoint, plan, _) => {
                let mut model = match checkpoint {
                    Some(ckpt) => {
                        ckpt.model_with_disk_tiers(table_optimizer, dense_optimizer, tiers)?
                    }
                    None => {
                        let config = config.clone();
                        let opts = (table_optimizer, dense_optimizer);
                        Dlrm::with_disk_tiers(config, opts.0, opts.1, seed, tiers)?
                    }
                };
                model.shard(plan)?;
                model
            }
        })
    }
}

impl Model for Dlrm {
    fn train_step(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        backend.check_mode(mode)?;
        self.sparse_arch.set_training(true);
        match (mode, backend.pjrt_backend()) {
            (ExecMode::Compiled, Some(pjrt)) => self.step_compiled(pjrt, batch),
            (ExecMode::Debug, _) => self.checked_step(backend.dense(), batch),
            (ExecMode::DeferFuse, _) => self.fused_step(backend.dense(), batch),
            _ => self.eager_step(backend.dense(), batch),
        }
    }

    fn input_dist(&self) -> Option<Arc<dyn InputDist>> {
        if let Some(router) = self.sparse_arch.input_router() {
            return Some(Arc::new(DlrmInputDist(router)));
        }
        let ahead = self.sparse_arch.read_ahead().filter(|_| self.read_ahead)?;
        Some(Arc::new(DiskReadAhead(ahead)))
    }

    fn train_step_routed(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        routed: Routed,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        if routed.is::<ReadAheadDone>() {
            // The disk-tier rows were hinted ahead: the step is the plain one.
            return self.train_step(backend, batch, mode);
        }
        let routed =
            (routed.downcast::<RoutedInput>()).map_err(|_| Unsupported::ForeignRoutedInput)?;
        self.routed = Some(*routed);
        let out = self.train_step(backend, batch, mode);
        // Never left for another batch, whether the step ran or failed.
        self.routed = None;
        out
    }

    /// The tables' rate and decay go to every shard's fused update; the
    /// dense rate, decay and clipping to the dense step (clipping the
    /// averaged gradients, before the update).
    fn set_optimization(&mut self, o: &Optimization, step: u64) -> Result<(), ModelError> {
        o.validate().map_err(ModelError::InvalidOptimization)?;
        let table = self.sparse_arch.optimizer();
        self.sparse_arch
            .set_step_settings(o.table_settings(&table, step))?;
        o.set_dense(&mut self.dense_optimizer, step);
        self.max_grad_norm = o.max_grad_norm;
        Ok(())
    }

    fn predict(&mut self, backend: &Backend, batch: &Batch) -> Result<&[f32], ModelError> {
        // Key-value tables read in inference: new ids are not admitted.
        self.sparse_arch.set_training(false);
        self.logits(backend.dense(), batch)
    }

    fn sync_to_host(&mut self) -> Result<(), ModelError> {
        if let Some(mut step) = self.compiled.take() {
            let result = step.sync_to_host(self);
            self.compiled = Some(step);
            result?;
        }
        Ok(())
    }

    fn world(&self) -> Option<&Arc<dyn Collective>> {
        Dlrm::world(self)
    }

    fn record_dataset_spec(&mut self, spec: &ember_dataloader::DatasetSpec) {
        self.dataset_spec = Some(spec.clone());
    }

    /// One file (`model.safetensors`) from one process; a set (an index and
    /// one file per rank, each rank writing its own shards) from the ranks
    /// of a world, and from one process whose disk-tier tables are sharded
    /// or whose key-value tables are sharded by buckets (one file of every
    /// shard). Either replaces the other.
    fn save_checkpoint(
        &mut self,
        dir: &Path,
        train: Option<&TrainState>,
    ) -> Result<PathBuf, ModelError> {
        self.sync_to_host()?;
        let file = dir.join(crate::checkpoint::CHECKPOINT_FILE);
        std::fs::create_dir_all(dir).map_err(|e| crate::checkpoint::fail_at(dir, e.to_string()))?;
        let disk_shards = self.sparse_arch.sharded().is_some()
            && self.sparse_arch.disk_tiers().iter().any(Option::is_some);
        // Key-value shards of buckets keep their own maps in a set (one
        // file gathers them into one map, which trains on differently).
        let bucket_shards =
            (self.sparse_arch.sharded()).is_some_and(|s| has_bucket_shards(s.plan()));
        match self.world().map(|c| c.rank()) {
            // Disk-tier shards are never gathered: a set of this process's.
            None if disk_shards || bucket_shards => {
                let index = crate::checkpoint::save_set(self, dir, train)?;
                let _ = std::fs::remove_file(&file);
                Ok(index)
            }
            None => {
                let identity = crate::checkpoint::save_full(self, &file, train)?;
                crate::checkpoint::remove_set(dir);
                crate::checkpoint::after_full_save(self, dir, identity);
                Ok(file)
            }
            Some(rank) => {
                let index = crate::checkpoint::save_set(self, dir, train)?;
                if rank == 0 {
                    let _ = std::fs::remove_file(&file);
                }
                Ok(index)
            }
        }
    }

    /// A delta of what training changed since this model's last checkpoint
    /// in `dir` (one file, or a chain: see [`save_delta`](crate::checkpoint::save_delta));
    /// `None` when there is none to build on, the chain already holds
    /// `max_chain` deltas, or the model is sharded or a rank of a world.
    fn save_checkpoint_delta(
        &mut self,
        dir: &Path,
        train: Option<&TrainState>,
        max_chain: u64,
    ) -> Result<Option<PathBuf>, ModelError> {
        if self
            .chain_head
            .as_ref()
            .is_none_or(|h| h.sequence >= max_chain)
        {
            return Ok(None);
        }
        self.sync_to_host()?;
        crate::checkpoint::write_delta(self, dir, train)
    }

    /// Reads a checkpoint of this architecture into this (one-process)
    /// model, keeping its optimizers and its sharding over threads. On a
    /// rank, build the model from the checkpoint instead
    /// ([`Checkpoint::builder`](crate::Checkpoint::builder) with a world),
    /// which reads only the rank's own shards.
    fn load_checkpoint(&mut self, path: &Path) -> Result<Option<TrainState>, ModelError> {
        if self.world.is_some() {
            return Err(Unsupported::LoadOnRank.into());
        }
        let ckpt = crate::Checkpoint::open(path)?;
        if ckpt.config() != &self.config {
            return Err(crate::checkpoint::fail_at(
                path,
                "the checkpoint holds another architecture than this model".into(),
            ));
        }
        let plan = self.sparse_arch.sharded().map(|s| s.plan().clone());
        let optimizers = (self.sparse_arch.optimizer(), self.dense_optimizer.config());
        let tiers = self.sparse_arch.disk_tiers();
        let read_ahead = self.read_ahead;
        // Drop this model's tables (and files) before the checkpoint's are built.
        self.sparse_arch =
            SparseArch::Local(EmbeddingBagCollection::zeroed(Vec::new(), optimizers.0)?);
        let config = self.config.clone();
        *self = Dlrm::place(&config, optimizers, 0, (plan, None), Some(&ckpt), tiers)?;
        self.read_ahead = read_ahead;
        Ok(ckpt.train_state().cloned())
    }
}

/// Whether `plan` shards a key-value table by buckets.
fn has_bucket_shards(plan: &ShardingPlan) -> bool {
    (plan.tables.iter().flat_map(|p| &p.shards))
        .any(|s| matches!(s.rows, ember_sharding::RowSplit::Buckets { .. }))
}
