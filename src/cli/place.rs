//! What `train` and `bench dlrm` do between their flags and their first
//! step: plan the tables over `--devices` (or the ranks), put those that do
//! not fit on the disk tier of `--disk-dir`, check the run fits in memory,
//! and build the model through the library's builder.

use ember_dataloader::lock::DirLock;
use ember_models::{Dlrm, DlrmBuilder, DlrmConfig};
use ember_sharding::{PlanStats, PlannerOptions};
use ember_sparse::TableOptimizer;

use super::plan::ShardingArgs;
use super::tier::TierArgs;
use super::world::Launch;

/// The run's shape as the memory check and the disk tier's caches see it.
pub struct RunShape {
    /// Samples per step on this rank, and ids per bag.
    pub per_rank: (usize, f64),
    /// Batches held at once (the step's, the queues').
    pub in_flight: usize,
    /// Ids one batch looks up, which each disk-tier cache must hold.
    pub batch_ids: usize,
}

/// A placed model and what its placement says.
pub struct Placed {
    /// The model (on a rank: its own shards).
    pub model: Dlrm,
    /// The planner's estimate, when it planned.
    pub stats: Option<PlanStats>,
    /// The disk directory's lock, held while the run uses it.
    pub disk_lock: Option<DirLock>,
}

/// Plans, places and builds `builder`'s model (of `config`, whose tables
/// `table_optimizer` updates) for the run `what`. `say` hears, as soon as
/// they are known (before a refusal), the tables reclaimed from a dead
/// run's disk directory and where each table went.
pub fn place(
    (tier, sharding): (&TierArgs, &ShardingArgs),
    launch: &Launch,
    (config, table_optimizer): (&DlrmConfig, TableOptimizer),
    (options, shape): (&PlannerOptions, RunShape),
    (builder, what, say): (DlrmBuilder<'_>, &str, &mut dyn FnMut(String)),
) -> anyhow::Result<Placed> {
    sharding.validate()?;
    let devices = sharding.devices.unwrap_or(0);
    let planned = launch.patiently(|| sharding.plan_for(config, options, launch))?;
    let (plan, stats) = planned.unzip();
    let tables = &config.tables;
    let tiers = tier.tiers_for(plan.as_ref(), tables, &table_optimizer, shape.batch_ids)?;
    let placement = tier.placement(plan.as_ref(), tables, &tiers, shape.batch_ids)?;
    let (disk_lock, reclaimed) = tier.take_dir(launch.is_root(), what)?;
    [reclaimed, placement]
        .into_iter()
        .flatten()
        .for_each(&mut *say);
    super::arch::check_memory(
        &super::tier::resident(config, &tiers),
        table_optimizer,
        shape.per_rank,
        shape.in_flight,
        (devices, launch.world_size()),
    )?;
    // A rank builds (or reads) only its own shards; ranks wait for the slowest.
    let model = launch.patiently(|| {
        let builder = builder.plan(plan).world(launch.world().cloned());
        Ok(builder.disk_tiers(tiers).build()?)
    })?;
    Ok(Placed {
        model,
        stats,
        disk_lock,
    })
}
