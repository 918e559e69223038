//! DLRM (dot interaction) and DLRM-DCNv2 (low-rank cross network), in
//! TorchRec's structure: sparse_arch (embedding bags) → dense_arch (bottom
//! MLP) → inter_arch → over_arch (top MLP ending in one logit).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_dense::{
    Activation, BceWithLogits, DenseBackend, DenseOptimizer, DenseOptimizerConfig, DotInteraction,
    HasParams, LowRankCrossNet, Mlp, Param, Real, Tensor,
};
use ember_sharding::{
    Collective, InitialRows, ShardSource, ShardedEmbeddingBagCollection, ShardingPlan,
};
use ember_sparse::{EmbeddingBagCollection, EmbeddingBagConfig, KeyedTensor, TableOptimizer};
use serde::{Deserialize, Serialize};

use crate::model::DataParallel;
use crate::sparse_arch::SparseArch;
use crate::{Backend, Batch, CompiledDenseStep, ExecMode, Model, ModelError, TrainState};

/// How the bottom MLP's output and the pooled embeddings interact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum InteractionType {
    /// Pairwise dot products (DLRM).
    Dot,
    /// Low-rank cross network over the concatenated features (DLRM-DCNv2).
    Dcn {
        /// Cross layers (TorchRec's `num_layers`), each
        /// `x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`.
        layers: usize,
        /// The rank of each layer's `W_l V_l` (TorchRec's `low_rank`).
        rank: usize,
    },
}

/// The architecture of a DLRM, as dlrm_s_pytorch's flags describe it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DlrmConfig {
    /// The embedding tables, all of one embedding dim; their features, in
    /// order, are the sparse inputs.
    pub tables: Vec<EmbeddingBagConfig>,
    /// Bottom MLP sizes including its input (the number of dense features),
    /// e.g. `[13, 512, 256, 64, 16]`; the last equals the embedding dim.
    pub bottom_mlp: Vec<usize>,
    /// Top MLP sizes after its input (which follows from the interaction),
    /// e.g. `[512, 256, 1]`; the last is 1.
    pub top_mlp: Vec<usize>,
    /// How the bottom MLP's output and the pooled embeddings interact.
    pub interaction: InteractionType,
}

impl DlrmConfig {
    /// Criteo-style tables: feature `cat_i` looks up table `t_cat_i`.
    pub fn criteo_tables(rows: &[usize], dim: usize) -> Vec<EmbeddingBagConfig> {
        rows.iter()
            .enumerate()
            .map(|(i, &r)| {
                EmbeddingBagConfig::new(&format!("t_cat_{i}"), r, dim, &[&format!("cat_{i}")])
            })
            .collect()
    }

    /// Number of dense features: the bottom MLP's input.
    pub fn num_dense(&self) -> usize {
        self.bottom_mlp[0]
    }

    /// The embedding dim of the tables (the first table's; 0 without tables).
    pub fn embedding_dim(&self) -> usize {
        self.tables.first().map_or(0, |t| t.embedding_dim)
    }

    /// Every sparse feature with its table's row count, in output order.
    pub fn feature_rows(&self) -> Vec<(String, usize)> {
        (self.tables.iter())
            .flat_map(|t| {
                t.feature_names
                    .iter()
                    .map(|f| (f.clone(), t.num_embeddings))
            })
            .collect()
    }

    /// Number of pooled embedding vectors per sample.
    pub fn num_sparse_features(&self) -> usize {
        self.tables.iter().map(|t| t.feature_names.len()).sum()
    }

    /// Width of the interaction's output, the top MLP's input.
    pub fn interaction_output_dim(&self) -> usize {
        let (f, d) = (self.num_sparse_features(), self.embedding_dim());
        match self.interaction {
            InteractionType::Dot => d + f * (f + 1) / 2,
            InteractionType::Dcn { .. } => (f + 1) * d,
        }
    }

    /// Top MLP sizes including its input.
    pub fn top_mlp_sizes(&self) -> Vec<usize> {
        let mut sizes = vec![self.interaction_output_dim()];
        sizes.extend(&self.top_mlp);
        sizes
    }

    /// Checks the architecture: at least one table, none of 0 rows, one
    /// embedding dim for all, a bottom MLP of an input and at least one
    /// layer ending in that dim, a top MLP ending in 1, no size 0, and a
    /// DCN of at least one layer and rank 1. Fails with
    /// [`ModelError::Config`] saying what is wrong.
    pub fn validate(&self) -> Result<(), ModelError> {
        let fail = |m: String| Err(ModelError::Config(m));
        if self.tables.is_empty() {
            return fail("at least one embedding table is needed".into());
        }
        if let Some(t) = self.tables.iter().find(|t| t.num_embeddings == 0) {
            return fail(format!("table '{}' has no rows", t.name));
        }
        let dim = self.embedding_dim();
        if let Some(t) = self.tables.iter().find(|t| t.embedding_dim != dim) {
            return fail(format!(
                "all tables need one embedding dim for the interaction: '{}' has {}, the first has {dim}",
                t.name, t.embedding_dim
            ));
        }
        if self.bottom_mlp.len() < 2 || self.bottom_mlp.contains(&0) {
            return fail(format!(
                "bottom MLP {:?} needs an input and at least one layer, none of size 0",
                self.bottom_mlp
            ));
        }
        if *self.bottom_mlp.last().unwrap() != dim {
            return fail(format!(
                "the bottom MLP ends in {} but the embedding dim is {dim}: they must match",
                self.bottom_mlp.last().unwrap()
            ));
        }
        if self.top_mlp.last() != Some(&1) || self.top_mlp.contains(&0) {
            return fail(format!(
                "top MLP {:?} must end in a single logit (1)",
                self.top_mlp
            ));
        }
        if let InteractionType::Dcn { layers, rank } = self.interaction {
            if layers == 0 || rank == 0 {
                return fail("a DCN needs at least one layer and a rank of at least 1".into());
            }
        }
        Ok(())
    }
}

// One arch per model, so the size difference of the variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum InteractionArch<T: Real> {
    Dot(DotInteraction<T>),
    Dcn {
        net: LowRankCrossNet<T>,
        dim: usize,
        combined: Tensor<T>,
        d_dense: Tensor<T>,
        d_sparse: Tensor<T>,
    },
}

/// Everything of a DLRM after the embedding lookups: bottom MLP, interaction,
/// top MLP. Generic over the float type so gradients can be checked in f64.
pub struct DenseArch<T: Real> {
    bottom: Mlp<T>,
    interaction: InteractionArch<T>,
    top: Mlp<T>,
}

impl<T: Real> DenseArch<T> {
    /// A freshly initialised dense arch for `config` (validated first);
    /// `seed` makes the initial weights.
    pub fn new(config: &DlrmConfig, seed: u64) -> Result<Self, ModelError> {
        config.validate()?;
        let (f, d) = (config.num_sparse_features(), config.embedding_dim());
        let interaction = match config.interaction {
            InteractionType::Dot => InteractionArch::Dot(DotInteraction::new(f, d)),
            InteractionType::Dcn { layers, rank } => InteractionArch::Dcn {
                net: LowRankCrossNet::new((f + 1) * d, layers, rank, seed ^ 0xDC17),
                dim: d,
                combined: Tensor::zeros(0, 0),
                d_dense: Tensor::zeros(0, 0),
                d_sparse: Tensor::zeros(0, 0),
            },
        };
        Ok(Self {
            // TorchRec's DenseArch MLP applies ReLU after its last layer too.
            bottom: Mlp::new(&config.bottom_mlp, Activation::Relu, seed ^ 0xB0770),
            interaction,
            top: Mlp::new(&config.top_mlp_sizes(), Activation::None, seed ^ 0x70B),
        })
    }

    /// Logits `[batch, 1]` from dense features `[batch, num_dense]` and pooled
    /// embeddings `[batch, F * D]`.
    pub fn forward(
        &mut self,
        be: &dyn DenseBackend<T>,
        dense: &Tensor<T>,
        pooled: &Tensor<T>,
    ) -> &Tensor<T> {
        let bottom_out = self.bottom.forward(be, dense);
        let top_in = match &mut self.interaction {
            InteractionArch::Dot(dot) => dot.forward(be, bottom_out, pooled),
            InteractionArch::Dcn { net, combined, .. } => {
                be.concat_columns(bottom_out, pooled, combined);
                net.forward(be, combined)
            }
        };
        self.top.forward(be, top_in)
    }

    /// The gradient of the pooled embeddings from the last backward.
    pub fn pooled_grad(&self) -> &Tensor<T> {
        match &self.interaction {
            InteractionArch::Dot(dot) => dot.dsparse(),
            InteractionArch::Dcn { d_sparse, .. } => d_sparse,
        }
    }

    fn pooled_grad_mut(&mut self) -> &mut Tensor<T> {
        match &mut self.interaction {
            InteractionArch::Dot(dot) => dot.dsparse_mut(),
            InteractionArch::Dcn { d_sparse, .. } => d_sparse,
        }
    }

    /// Backward from the logits' gradient; fills every parameter's gradient
    /// and returns the gradient of the pooled embeddings `[batch, F * D]`.
    pub fn backward(&mut self, be: &dyn DenseBackend<T>, d_logits: &Tensor<T>) -> &Tensor<T> {
        let d_top_in = self
            .top
            .backward(be, d_logits, true)
            .expect("asked for the input gradient");
        let (d_bottom_out, d_pooled) = match &mut self.interaction {
            InteractionArch::Dot(dot) => dot.backward(be, d_top_in),
            InteractionArch::Dcn {
                net,
                dim,
                d_dense,
                d_sparse,
                ..
            } => {
                let d_combined = net.backward(be, d_top_in);
                be.split_columns(d_combined, *dim, d_dense, d_sparse);
                (&*d_dense, &*d_sparse)
            }
        };
        self.bottom.backward(be, d_bottom_out, false);
        d_pooled
    }

    /// The first NaN or infinity among the last forward's layer outputs, in
    /// forward order, named after the layer.
    pub fn first_non_finite_activation(&self) -> Option<ModelError> {
        let (_, outs) = self.bottom.activations();
        for (i, t) in outs.iter().enumerate() {
            if let Some(e) = non_finite(
                &format!("dense_arch.model._mlp.{i} output"),
                t.data(),
                t.cols(),
            ) {
                return Some(e);
            }
        }
        let (top_in, outs) = self.top.activations();
        if let Some(e) = non_finite("inter_arch output", top_in.data(), top_in.cols()) {
            return Some(e);
        }
        let last = outs.len() - 1;
        for (i, t) in outs.iter().enumerate() {
            let what = match i == last {
                true => "over_arch.model.1 output (the logits)".to_string(),
                false => format!("over_arch.model.0._mlp.{i} output"),
            };
            if let Some(e) = non_finite(&what, t.data(), t.cols()) {
                return Some(e);
            }
        }
        None
    }

    /// The first NaN or infinity among the last backward's parameter
    /// gradients, named after the parameter.
    pub fn first_non_finite_gradient(&mut self) -> Option<ModelError> {
        self.params().into_iter().find_map(|p| {
            let i = p.grad.iter().position(|g| !g.to_f64().is_finite())?;
            Some(ModelError::NonFinite {
                what: format!("the gradient of {}", p.name),
                location: format!("element {i}"),
                value: p.grad[i].to_f64() as f32,
            })
        })
    }

    /// The bottom MLP (TorchRec's `dense_arch`), ReLU after every layer.
    pub fn bottom(&self) -> &Mlp<T> {
        &self.bottom
    }
    /// The top MLP (TorchRec's `over_arch`), its last layer giving the logit.
    pub fn top(&self) -> &Mlp<T> {
        &self.top
    }
    /// The cross network of a DLRM-DCNv2 (TorchRec's `inter_arch.crossnet`);
    /// `None` for the dot interaction, which has no parameters.
    pub fn cross_net(&self) -> Option<&LowRankCrossNet<T>> {
        match &self.interaction {
            InteractionArch::Dcn { net, .. } => Some(net),
            InteractionArch::Dot(_) => None,
        }
    }
}

/// TorchRec's name prefix of bottom MLP layer `i`.
pub(crate) fn bottom_linear_prefix(i: usize) -> String {
    format!("dense_arch.model._mlp.{i}._linear.")
}

/// TorchRec's name prefix of top layer `i` of `layers`: its OverArch is
/// Sequential(MLP(all but the last layer), Linear).
pub(crate) fn top_linear_prefix(i: usize, layers: usize) -> String {
    match i + 1 == layers {
        true => "over_arch.model.1.".into(),
        false => format!("over_arch.model.0._mlp.{i}._linear."),
    }
}

impl<T: Real> HasParams<T> for DenseArch<T> {
    /// Parameters named as in TorchRec's DLRM `state_dict`.
    fn params(&mut self) -> Vec<Param<'_, T>> {
        let mut params: Vec<_> = (self.bottom.params().into_iter())
            .map(|p| p.with_prefix("dense_arch.model."))
            .collect();
        if let InteractionArch::Dcn { net, .. } = &mut self.interaction {
            params.extend(
                net.params()
                    .into_iter()
                    .map(|p| p.with_prefix("inter_arch.crossnet.")),
            );
        }
        // TorchRec's OverArch is Sequential(MLP(all but the last layer), Linear).
        let last = format!("_mlp.{}._linear.", self.top.layers().len() - 1);
        params.extend(self.top.params().into_iter().map(|mut p| {
            p.name = match p.name.strip_prefix(&last) {
                Some(tensor) => format!("over_arch.model.1.{tensor}"),
                None => format!("over_arch.model.0.{}", p.name),
            };
            p
        }));
        params
    }
}

/// The first NaN or infinity of a row-major `[rows, cols]` buffer, as an error.
fn non_finite<T: Real>(what: &str, data: &[T], cols: usize) -> Option<ModelError> {
    let i = data.iter().position(|v| !v.to_f64().is_finite())?;
    Some(ModelError::NonFinite {
        what: what.to_string(),
        location: format!("sample {}, column {}", i / cols.max(1), i % cols.max(1)),
        value: data[i].to_f64() as f32,
    })
}

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
}

impl Dlrm {
    /// A new model in one process: `config` validated, tables in one local
    /// collection with `table_optimizer` fused into their backward, the
    /// dense arch stepped by `dense_optimizer`, all initialised from `seed`.
    pub fn new(
        config: DlrmConfig,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
        seed: u64,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let sparse_arch = SparseArch::Local(EmbeddingBagCollection::new(
            config.tables.clone(),
            table_optimizer,
            seed,
        )?);
        Self::with_tables(config, sparse_arch, dense_optimizer, seed)
    }

    /// [`Dlrm::new`] as rank `comm.rank()` of a multi-process world: the same
    /// model, of which this rank holds (and ever allocates) only the shards
    /// of its device under `plan` (one device per rank). The rank steps on
    /// its own samples and averages the dense gradients with the other
    /// ranks. Every rank makes this call with the same arguments.
    pub fn new_on_rank(
        config: DlrmConfig,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
        seed: u64,
        plan: ShardingPlan,
        comm: Arc<dyn Collective>,
    ) -> Result<Self, ModelError> {
        let rows = InitialRows { seed };
        let tables = (table_optimizer, 0, &rows as &dyn ShardSource);
        Self::on_rank(config, tables, dense_optimizer, seed, plan, comm)
    }

    /// A rank's model whose shards come from `source` (with the table
    /// optimizer and its step count); the dense part is initialised from
    /// `seed`.
    pub fn on_rank(
        config: DlrmConfig,
        (table_optimizer, step, source): (TableOptimizer, u64, &dyn ShardSource),
        dense_optimizer: DenseOptimizerConfig,
        seed: u64,
        plan: ShardingPlan,
        comm: Arc<dyn Collective>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let sharded = ShardedEmbeddingBagCollection::on_rank(
            config.tables.clone(),
            table_optimizer,
            step,
            source,
            plan,
            comm.clone(),
        )?;
        let mut model =
            Self::with_tables(config, SparseArch::Sharded(sharded), dense_optimizer, seed)?;
        model.world = Some(DataParallel::new(comm));
        Ok(model)
    }

    fn with_tables(
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
            return Err(ModelError::Config(
                "a model that is one rank of a world cannot be resharded in place".into(),
            ));
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
            return Err(ModelError::Batch(format!(
                "dense features are [{}, {}], expected [{n}, {}]",
                batch.dense.rows(),
                batch.dense.cols(),
                self.config.num_dense()
            )));
        }
        if batch.sparse.stride() != n {
            return Err(ModelError::Batch(format!(
                "sparse features hold {} samples, the labels {n}",
                batch.sparse.stride()
            )));
        }
        Ok(())
    }

    /// Pooled lookup, then the pooled rows as a dense `[batch, F * D]` tensor.
    fn lookup(&mut self, batch: &Batch) -> Result<(), ModelError> {
        self.sparse_arch
            .forward_into(&batch.sparse, &mut self.pooled)?;
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
    pub fn predict(
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
            return Err(ModelError::Config(
                "the compiled step runs in one process; on ranks use strict, debug or defer-fuse"
                    .into(),
            ));
        }
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
    pub fn train_step(
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
    pub fn train_step_checked(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<StepOutput, ModelError> {
        self.step(be, batch, Run::Checked)
    }

    /// `--mode defer-fuse`: [`Dlrm::train_step`] with the dense forward, loss
    /// and backward issued as one window the backend may record and run fused
    /// ([`DenseBackend::fused`]); `dense_forward` times the whole window.
    pub fn train_step_fused(
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

    /// The model placed by `plan`, from `checkpoint` or new from `seed`.
    /// On a rank of `world`, only its shards are ever built (or read);
    /// alone, the whole model is built, then sharded over threads.
    pub fn place(
        config: &DlrmConfig,
        (table_optimizer, dense_optimizer): (TableOptimizer, DenseOptimizerConfig),
        seed: u64,
        plan: Option<ShardingPlan>,
        checkpoint: Option<&crate::Checkpoint>,
        world: Option<&Arc<dyn Collective>>,
    ) -> Result<Dlrm, ModelError> {
        Ok(match (checkpoint, plan, world) {
            (Some(ckpt), Some(plan), Some(comm)) => {
                ckpt.model_on_rank(table_optimizer, dense_optimizer, plan, comm.clone())?
            }
            (None, Some(plan), Some(comm)) => Dlrm::new_on_rank(
                config.clone(),
                table_optimizer,
                dense_optimizer,
                seed,
                plan,
                comm.clone(),
            )?,
            (checkpoint, plan, _) => {
                let mut model = match checkpoint {
                    Some(ckpt) => ckpt.model(table_optimizer, dense_optimizer)?,
                    None => Dlrm::new(config.clone(), table_optimizer, dense_optimizer, seed)?,
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
        match (mode, backend.pjrt_backend()) {
            (ExecMode::Compiled, Some(pjrt)) => self.step_compiled(pjrt, batch),
            (ExecMode::Debug, _) => self.train_step_checked(backend.dense(), batch),
            (ExecMode::DeferFuse, _) => self.train_step_fused(backend.dense(), batch),
            _ => Dlrm::train_step(self, backend.dense(), batch),
        }
    }

    fn predict(
        &mut self,
        backend: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<&[f32], ModelError> {
        Dlrm::predict(self, backend, batch)
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

    /// One file (`model.safetensors`) from one process; a set (an index and
    /// one file per rank, each rank writing its own shards) from the ranks
    /// of a world. Either replaces the other.
    fn save_checkpoint(
        &mut self,
        dir: &Path,
        train: Option<&TrainState>,
    ) -> Result<PathBuf, ModelError> {
        self.sync_to_host()?;
        let file = dir.join(crate::checkpoint::CHECKPOINT_FILE);
        std::fs::create_dir_all(dir).map_err(|e| crate::checkpoint::fail_at(dir, e.to_string()))?;
        match self.world().map(|c| c.rank()) {
            None => {
                crate::checkpoint::save(self, &file, train)?;
                crate::checkpoint::remove_set(dir);
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

    /// Reads a checkpoint of this architecture into this (one-process)
    /// model, keeping its optimizers and its sharding over threads. On a
    /// rank, build the model from the checkpoint instead
    /// ([`Dlrm::place`]), which reads only the rank's own shards.
    fn load_checkpoint(&mut self, path: &Path) -> Result<Option<TrainState>, ModelError> {
        if self.world.is_some() {
            return Err(ModelError::Config(
                "a rank's model is built from its checkpoint (Dlrm::place), not loaded in place"
                    .into(),
            ));
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
        // Drop this model's tables before the checkpoint's are built.
        self.sparse_arch =
            SparseArch::Local(EmbeddingBagCollection::zeroed(Vec::new(), optimizers.0)?);
        *self = Dlrm::place(&self.config.clone(), optimizers, 0, plan, Some(&ckpt), None)?;
        Ok(ckpt.train_state().cloned())
    }
}
