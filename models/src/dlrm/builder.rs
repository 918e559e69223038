//! The one way to make a [`Dlrm`]: new or from a checkpoint, alone or
//! sharded, in RAM or on the disk tier, in one process or as a rank of a
//! world. Every choice has a default but the architecture.

use std::sync::Arc;

use ember_dense::DenseOptimizerConfig;
use ember_sharding::{Collective, PlannerOptions, ShardingPlan, Topology};
use ember_sparse::{DiskTierConfig, TableOptimizer};

use super::{Dlrm, DlrmConfig};
use crate::{Checkpoint, ModelError};

/// Where the tables go.
#[derive(Clone, Debug, Default)]
enum Placement {
    /// One local collection.
    #[default]
    Local,
    /// Sharded by this plan.
    Plan(ShardingPlan),
    /// Sharded by the plan the planner makes for this topology.
    Planner(Topology, Option<PlannerOptions>),
}

/// Builds a [`Dlrm`]; made by [`Dlrm::builder`].
///
/// ```
/// use ember_models::{Dlrm, DlrmConfig, InteractionType, ModelError};
/// use ember_sparse::TableOptimizer;
///
/// let config = DlrmConfig {
///     tables: DlrmConfig::criteo_tables(&[1000, 1000, 1000], 8),
///     bottom_mlp: vec![4, 16, 8],
///     top_mlp: vec![16, 1],
///     interaction: InteractionType::Dot,
/// };
/// let model = Dlrm::builder(config)
///     .table_optimizer(TableOptimizer::rowwise_adagrad(0.05))
///     .seed(7)
///     .shard_over(2) // the planner's plan over 2 in-process devices
///     .build()?;
/// assert!(model.sparse_arch().local().is_none());
/// # Ok::<(), ModelError>(())
/// ```
#[must_use = "a builder does nothing until `build`"]
pub struct DlrmBuilder<'a> {
    config: DlrmConfig,
    table_optimizer: TableOptimizer,
    dense_optimizer: DenseOptimizerConfig,
    seed: u64,
    placement: Placement,
    world: Option<Arc<dyn Collective>>,
    tiers: Vec<Option<DiskTierConfig>>,
    checkpoint: Option<&'a Checkpoint>,
}

/// The table optimizer a builder starts with: row-wise Adagrad (FBGEMM's
/// `EXACT_ROWWISE_ADAGRAD`), learning rate 0.01, as `ember train`.
pub const DEFAULT_TABLE_OPTIMIZER: TableOptimizer = TableOptimizer::RowWiseAdagrad {
    lr: 0.01,
    eps: 1e-8,
};

/// The dense optimizer a builder starts with: Adagrad, learning rate 0.01,
/// as `ember train`.
pub const DEFAULT_DENSE_OPTIMIZER: DenseOptimizerConfig = DenseOptimizerConfig::Adagrad {
    lr: 0.01,
    eps: 1e-10,
};

impl Dlrm {
    /// A builder of a model of `config`: row-wise Adagrad on the tables
    /// and Adagrad on the dense arch (both at 0.01), seed 0, one local
    /// collection in RAM, one process, new weights; each can be changed.
    pub fn builder<'a>(config: DlrmConfig) -> DlrmBuilder<'a> {
        DlrmBuilder {
            config,
            table_optimizer: DEFAULT_TABLE_OPTIMIZER,
            dense_optimizer: DEFAULT_DENSE_OPTIMIZER,
            seed: 0,
            placement: Placement::Local,
            world: None,
            tiers: Vec::new(),
            checkpoint: None,
        }
    }
}

impl<'a> DlrmBuilder<'a> {
    /// Both optimizers: [`table_optimizer`](Self::table_optimizer) and
    /// [`dense_optimizer`](Self::dense_optimizer).
    pub fn optimizers(self, table: TableOptimizer, dense: DenseOptimizerConfig) -> Self {
        self.table_optimizer(table).dense_optimizer(dense)
    }

    /// The optimizer fused into the tables' backward
    /// ([`TableOptimizer::None`]: frozen tables, for inference).
    pub fn table_optimizer(mut self, optimizer: TableOptimizer) -> Self {
        self.table_optimizer = optimizer;
        self
    }

    /// The optimizer that steps the dense arch.
    pub fn dense_optimizer(mut self, optimizer: DenseOptimizerConfig) -> Self {
        self.dense_optimizer = optimizer;
        self
    }

    /// The seed of every new weight (and of stochastic rounding).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Shards the tables by `plan` (made by [`ember_sharding::plan()`] or by
    /// hand): over threads in one process, or one device per rank of a
    /// [`world`](Self::world).
    /// (`None`: one local collection.)
    pub fn plan(mut self, plan: impl Into<Option<ShardingPlan>>) -> Self {
        self.placement = plan.into().map_or(Placement::Local, Placement::Plan);
        self
    }

    /// Shards the tables by the planner's plan for `topology`, under
    /// `options` (`None`: a batch of 128, one id per bag, this builder's
    /// table optimizer, any sharding type, no disk tier). On a world every
    /// rank plans for itself, all to the same plan (the planner is
    /// deterministic). With [`disk_tiers`](Self::disk_tiers), give options
    /// with the disk tier's model, or a [`plan`](Self::plan): a plan made
    /// without it may replicate a disk-tier table, which the build refuses.
    pub fn planner(mut self, topology: Topology, options: Option<PlannerOptions>) -> Self {
        self.placement = Placement::Planner(topology, options);
        self
    }

    /// Shards the tables over `devices` in-process devices of equal memory
    /// by the planner's plan (as TorchRec's `DistributedModelParallel`
    /// with its default planner); with a [`world`](Self::world), its
    /// ranks are the devices.
    pub fn shard_over(self, devices: usize) -> Self {
        self.planner(Topology::uniform(devices, UNBOUNDED_DEVICE_BYTES), None)
    }

    /// Builds this rank's part of a model shared by the processes of
    /// `world` (one device per rank; every rank makes the same call): it
    /// holds, and ever allocates, only its own shards, and averages the
    /// dense gradients with the other ranks. Needs a plan. (`None`: one
    /// process.)
    pub fn world(mut self, world: impl Into<Option<Arc<dyn Collective>>>) -> Self {
        self.world = world.into();
        self
    }

    /// Puts the tables whose entry is `Some` on the disk tier (their
    /// shards too, each device caching its own); a missing entry: in RAM.
    pub fn disk_tiers(mut self, tiers: Vec<Option<DiskTierConfig>>) -> Self {
        self.tiers = tiers;
        self
    }

    /// Starts from `checkpoint`'s weights (as [`Checkpoint::builder`], which
    /// also takes the checkpoint's architecture and optimizers) instead of new ones, with its
    /// optimizer state and step counts where the optimizer is of the same
    /// kind (so training resumes exactly), and its dataset spec. Its
    /// architecture must be the builder's. (`None`: new weights.)
    pub fn checkpoint(mut self, checkpoint: impl Into<Option<&'a Checkpoint>>) -> Self {
        self.checkpoint = checkpoint.into();
        self
    }

    /// The model; errors name what is wrong with the configuration, the
    /// plan, the world or the checkpoint.
    pub fn build(self) -> Result<Dlrm, ModelError> {
        if let Some(ckpt) = self.checkpoint {
            if ckpt.config() != &self.config {
                let path = ckpt.path().to_path_buf();
                return Err(BuildError::OtherArchitecture { path }.into());
            }
        }
        self.config.validate()?;
        let plan = match self.placement {
            Placement::Local => None,
            Placement::Plan(plan) => Some(plan),
            Placement::Planner(topology, options) => {
                let options = options.unwrap_or(PlannerOptions {
                    batch_size: 128,
                    pooling_factor: 1.0,
                    optimizer: self.table_optimizer,
                    sharding: None,
                    disk_tier: None,
                });
                let tables = &self.config.tables;
                Some(ember_sharding::plan(tables, &topology, &options)?.0)
            }
        };
        if self.world.is_some() && plan.is_none() {
            return Err(BuildError::WorldWithoutPlan.into());
        }
        Dlrm::place(
            &self.config,
            (self.table_optimizer, self.dense_optimizer),
            self.seed,
            (plan, self.world.as_ref()),
            self.checkpoint,
            self.tiers,
        )
    }
}

impl Checkpoint {
    /// A builder of the model this checkpoint holds: its architecture, its
    /// weights, and the optimizers it was trained with (the builder's
    /// defaults where it names none), whose state resumes exactly. Change
    /// the optimizers for fine-tuning, or use
    /// [`inference_model`](Self::inference_model) for none.
    pub fn builder(&self) -> DlrmBuilder<'_> {
        let table = self.table_optimizer().unwrap_or(DEFAULT_TABLE_OPTIMIZER);
        let dense = self.dense_optimizer().unwrap_or(DEFAULT_DENSE_OPTIMIZER);
        Dlrm::builder(self.config().clone())
            .optimizers(table, dense)
            .checkpoint(self)
    }
}

/// The memory `shard_over` gives each device: the planner balances load,
/// and the machine's real memory is checked where the model is built.
const UNBOUNDED_DEVICE_BYTES: u64 = 1 << 50;

/// What the builder cannot make as asked ([`ModelError::Build`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The checkpoint holds another architecture than the builder's.
    #[error("{} holds another architecture than the builder's", path.display())]
    OtherArchitecture {
        /// The checkpoint.
        path: std::path::PathBuf,
    },
    /// A world without a plan: its ranks would not know their shards.
    #[error("a model on a world needs a plan (`plan`, `planner` or `shard_over`)")]
    WorldWithoutPlan,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InteractionType;

    fn config(rows: usize) -> DlrmConfig {
        DlrmConfig {
            tables: DlrmConfig::criteo_tables(&[rows, rows], 4),
            bottom_mlp: vec![3, 4],
            top_mlp: vec![4, 1],
            interaction: InteractionType::Dot,
        }
    }

    #[test]
    fn what_cannot_be_built_is_named() {
        let world: Arc<dyn Collective> = Arc::new(ember_sharding::InProcess::group(1).remove(0));
        let err = Dlrm::builder(config(10))
            .world(world)
            .build()
            .err()
            .unwrap();
        assert!(matches!(
            err,
            ModelError::Build(BuildError::WorldWithoutPlan)
        ));

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(crate::checkpoint::CHECKPOINT_FILE);
        let mut model = Dlrm::builder(config(10)).build().unwrap();
        crate::checkpoint::save(&mut model, &path, None).unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        let err = Dlrm::builder(config(20))
            .checkpoint(&ckpt)
            .build()
            .err()
            .unwrap();
        assert!(matches!(
            err,
            ModelError::Build(BuildError::OtherArchitecture { path: p }) if p == path
        ));
        // The checkpoint's own builder starts from its architecture.
        assert_eq!(ckpt.builder().build().unwrap().config(), &config(10));

        let mut bad = config(10);
        bad.bottom_mlp = vec![3, 5];
        let err = Dlrm::builder(bad).build().err().unwrap();
        assert!(matches!(
            err,
            ModelError::Architecture(crate::dlrm::ArchitectureError::BottomDim { ends: 5, dim: 4 })
        ));
    }
}
