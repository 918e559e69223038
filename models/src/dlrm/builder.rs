//! The one way to make a [`Dlrm`]: new or from a checkpoint, alone or
//! sharded, in RAM or on the disk tier, in one process or as a rank of a
//! world, checked against the machine's memory before anything is
//! allocated. Every choice has a default but the architecture.

use std::sync::Arc;

use ember_dataloader::lock::DirLock;
use ember_dense::DenseOptimizerConfig;
use ember_sharding::{Collective, PlannerOptions, ShardingPlan, Topology};
use ember_sparse::{DiskTierConfig, TableOptimizer};

use super::{Dlrm, DlrmConfig};
use crate::disk_tier::{self, DiskTierOptions};
use crate::memory::{MemoryEstimate, RunShape};
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
    tiers: Tiers,
    checkpoint: Option<&'a Checkpoint>,
    batches: BatchShape,
    memory_check: bool,
    notes: Option<&'a mut dyn FnMut(String)>,
}

/// Which tables go on the disk tier.
#[derive(Clone, Debug, Default)]
enum Tiers {
    /// All in RAM.
    #[default]
    Ram,
    /// As given, table by table.
    Given(Vec<Option<DiskTierConfig>>),
    /// Sized by the builder from one budget (or as the plan says).
    Sized(DiskTierOptions),
}

/// How a model is fed, as its memory check, its plan and its disk-tier
/// caches see it ([`DlrmBuilder::batches`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchShape {
    /// Samples in one step of this process (of a world: of this rank).
    pub batch_size: usize,
    /// Ids in one bag, on average (the memory check's and the planner's).
    pub ids_per_bag: f64,
    /// Ids in one bag at most (the disk tier's smallest cache holds
    /// [`CACHE_BATCHES`](crate::disk_tier::CACHE_BATCHES) batches of them).
    pub max_ids_per_bag: usize,
    /// Batches held at once: those queued ahead of the step and the step's.
    pub in_flight: usize,
}

impl Default for BatchShape {
    /// 128 samples, one id per bag, two batches held.
    fn default() -> Self {
        Self {
            batch_size: 128,
            ids_per_bag: 1.0,
            max_ids_per_bag: 1,
            in_flight: 2,
        }
    }
}

impl BatchShape {
    /// Ids one batch looks up in one table, at most.
    fn table_ids(&self) -> usize {
        self.batch_size.saturating_mul(self.max_ids_per_bag)
    }
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
            tiers: Tiers::Ram,
            checkpoint: None,
            batches: BatchShape::default(),
            memory_check: true,
            notes: None,
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
    /// `options` (`None`: the [`batches`](Self::batches) of every rank,
    /// this builder's table optimizer, any sharding type). Where the
    /// options give no disk-tier model, the [`disk_tier`](Self::disk_tier)'s
    /// is used. On a world every rank plans for itself, all to the same
    /// plan (the planner is deterministic).
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
    /// The caller holds the directories ([`DiskTierOptions::take_dir`]).
    pub fn disk_tiers(mut self, tiers: Vec<Option<DiskTierConfig>>) -> Self {
        self.tiers = Tiers::Given(tiers);
        self
    }

    /// Puts tables on the disk tier of `options.dir`, their caches sized
    /// from one budget: under a plan, the tables it puts there; without
    /// one, every table whose cache holds [`CACHE_BATCHES`](crate::disk_tier::CACHE_BATCHES)
    /// [`batches`](Self::batches) of ids (the others stay in RAM; none
    /// fitting is an error). The model holds the directory while it lives
    /// (on a world, rank 0 does): a second run there is refused, and files
    /// of killed runs are removed as it is taken.
    pub fn disk_tier(mut self, options: impl Into<Option<DiskTierOptions>>) -> Self {
        self.tiers = options.into().map_or(Tiers::Ram, Tiers::Sized);
        self
    }

    /// How the model is fed: sizes the memory check, the planner's
    /// default options and the disk tier's smallest caches.
    /// (Default: [`BatchShape::default`].)
    pub fn batches(mut self, batches: BatchShape) -> Self {
        self.batches = batches;
        self
    }

    /// Whether the build refuses a model (with the batches it is fed) that
    /// needs more memory than the machine has, by its [`MemoryEstimate`],
    /// before allocating any of it ([`ModelError::Memory`]). (Default: on.)
    pub fn memory_check(mut self, check: bool) -> Self {
        self.memory_check = check;
        self
    }

    /// Hears, as soon as each is known (before any refusal), what the
    /// build decided that a run's output should say: which tables went to
    /// the disk tier and why, and the files of killed runs it removed.
    pub fn notes(mut self, say: &'a mut dyn FnMut(String)) -> Self {
        self.notes = Some(say);
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
    /// plan, the world, the disk tier, the memory or the checkpoint.
    pub fn build(mut self) -> Result<Dlrm, ModelError> {
        if let Some(ckpt) = self.checkpoint {
            if ckpt.config() != &self.config {
                let path = ckpt.path().to_path_buf();
                return Err(BuildError::OtherArchitecture { path }.into());
            }
        }
        self.config.validate()?;
        let plan = self.planned()?;
        if self.world.is_some() && plan.is_none() {
            return Err(BuildError::WorldWithoutPlan.into());
        }
        let (tiers, disk_dir) = self.placed_tiers(plan.as_ref())?;
        if self.memory_check {
            self.check_memory(plan.as_ref(), &tiers)?;
        }
        let mut model = Dlrm::place(
            &self.config,
            (self.table_optimizer, self.dense_optimizer),
            self.seed,
            (plan, self.world.as_ref()),
            self.checkpoint,
            tiers,
        )?;
        model.disk_dir = disk_dir;
        Ok(model)
    }

    /// The plan the tables are sharded by, if any.
    fn planned(&self) -> Result<Option<ShardingPlan>, ModelError> {
        Ok(match &self.placement {
            Placement::Local => None,
            Placement::Plan(plan) => Some(plan.clone()),
            Placement::Planner(topology, options) => {
                let tables = &self.config.tables;
                let ranks = self.world.as_ref().map_or(1, |w| w.world_size());
                let mut options = options.clone().unwrap_or(PlannerOptions {
                    batch_size: self.batches.batch_size * ranks,
                    pooling_factor: self.batches.ids_per_bag,
                    optimizer: self.table_optimizer,
                    sharding: None,
                    disk_tier: None,
                });
                if let (None, Tiers::Sized(tier)) = (&options.disk_tier, &self.tiers) {
                    // The planner sees the global batch's ids in a table.
                    let ids = self.batches.table_ids() * ranks;
                    let model = tier.planner_model(tables, &self.table_optimizer, ids, 1.0);
                    options.disk_tier = Some(model);
                }
                Some(ember_sharding::plan(tables, topology, &options)?.0)
            }
        })
    }

    /// Each table's tier, and the disk tier's directory when this process
    /// takes it (sized tiers; on a world, rank 0).
    fn placed_tiers(
        &mut self,
        plan: Option<&ShardingPlan>,
    ) -> Result<(Vec<Option<DiskTierConfig>>, Option<DirLock>), ModelError> {
        let tables = &self.config.tables;
        let options = match &self.tiers {
            Tiers::Given(tiers) => return Ok((tiers.clone(), None)),
            Tiers::Ram => None,
            Tiers::Sized(options) => Some(options),
        };
        let ids = self.batches.table_ids();
        let tiers = disk_tier::tiers_for(options, plan, tables, &self.table_optimizer, ids)?;
        let Some(options) = options else {
            return Ok((tiers, None));
        };
        let note = |line: String, notes: &mut Option<&mut dyn FnMut(String)>| {
            if let Some(say) = notes {
                say(line)
            }
        };
        let root = self.world.as_ref().is_none_or(|w| w.rank() == 0);
        let lock = match root {
            true => {
                let taken = options.take_dir(&holder()).map_err(ModelError::from)?;
                if let Some(line) = taken.reclaimed_line() {
                    note(line, &mut self.notes);
                }
                Some(taken.lock)
            }
            false => {
                options.make_dir()?;
                None
            }
        };
        let line = disk_tier::placement_line(&options.dir, plan.is_some(), tables, &tiers);
        note(line, &mut self.notes);
        Ok((tiers, lock))
    }

    /// Refuses a model that cannot fit in this machine's memory with its
    /// batches (a disk-tier table is its cache; a rank's tables its share).
    fn check_memory(
        &self,
        plan: Option<&ShardingPlan>,
        tiers: &[Option<DiskTierConfig>],
    ) -> Result<(), ModelError> {
        let mut resident = self.config.clone();
        // A disk-tier key-value table's map stays in RAM whole.
        let mut kv_maps = 0u64;
        for (t, tier) in resident.tables.iter_mut().zip(tiers) {
            if let Some(tier) = tier {
                let cached = t.num_embeddings.min(tier.cache_rows);
                if let Some(kv) = &t.kv {
                    let whole = kv.bytes(t.num_embeddings).saturating_sub(kv.bytes(cached));
                    kv_maps = kv_maps.saturating_add(whole);
                }
                t.num_embeddings = cached;
            }
        }
        let ranks = self.world.as_ref().map_or(1, |w| w.world_size());
        let devices = match (plan, ranks) {
            (Some(p), 1) => p.num_devices,
            _ => 0,
        };
        let b = self.batches;
        let bags = b.batch_size as f64 * resident.num_sparse_features() as f64;
        let mut estimate = MemoryEstimate::of(&RunShape {
            config: &resident,
            table_optimizer: self.table_optimizer,
            batch_size: b.batch_size,
            ids_per_batch: (bags * b.ids_per_bag).min(u64::MAX as f64) as u64,
            batches_in_flight: b.in_flight,
            devices,
        });
        estimate.tables = estimate.tables.saturating_add(kv_maps) / ranks as u64;
        estimate.check(crate::available_memory())
    }
}

/// Who holds a disk-tier directory, for a run that finds it taken: this
/// program and its arguments' first word (`ember train`).
fn holder() -> String {
    let mut args = std::env::args();
    let program = args.next().unwrap_or_default();
    let name = std::path::Path::new(&program)
        .file_name()
        .map_or(program.clone(), |n| n.to_string_lossy().into_owned());
    match args.next().filter(|a| !a.starts_with('-')) {
        Some(command) => format!("{name} {command}"),
        None => name,
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
