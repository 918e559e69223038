//! What `train` and `bench dlrm` do between their flags and their first
//! step: plan the tables over `--devices` (or the ranks), then let the
//! library's builder put tables on the disk tier of `--disk-dir`, check
//! the run fits in memory, and build the model.

use ember_models::{BatchShape, Dlrm, DlrmBuilder, DlrmConfig};
use ember_sharding::{PlanStats, PlannerOptions};

use super::plan::ShardingArgs;
use super::tier::TierArgs;
use super::world::Launch;

/// A placed model and what its placement says.
pub struct Placed {
    /// The model (on a rank: its own shards; holding the disk directory).
    pub model: Dlrm,
    /// The planner's estimate, when it planned.
    pub stats: Option<PlanStats>,
}

/// Plans `config`'s tables by the flags under `options` (whose disk-tier
/// model `place` fills in), and builds `builder`'s model on them for
/// batches of `shape`. `say` hears, as soon as they are known (before a
/// refusal), the tables reclaimed from a dead run's disk directory and
/// where each table went.
pub fn place<'a>(
    (tier, sharding): (&TierArgs, &ShardingArgs),
    launch: &Launch,
    (config, mut options): (&DlrmConfig, PlannerOptions),
    (shape, zipf_alpha): (BatchShape, f64),
    (builder, say): (DlrmBuilder<'a>, &'a mut dyn FnMut(String)),
) -> anyhow::Result<Placed> {
    sharding.validate()?;
    let disk_tier = tier.options()?;
    if let Some(disk) = &disk_tier {
        // The planner sees the global batch's ids in a table: the run's
        // (a resumed run's batch is its checkpoint's, not the flag's).
        let ids = shape.batch_size * launch.world_size().max(1) * shape.max_ids_per_bag;
        let (tables, optimizer) = (&config.tables, &options.optimizer);
        options.disk_tier = Some(disk.planner_model(tables, optimizer, ids, zipf_alpha));
    }
    let planned = launch.patiently(|| sharding.plan_for(config, &options, launch))?;
    let (plan, stats) = planned.unzip();
    // A rank builds (or reads) only its own shards; ranks wait for the slowest.
    let model = launch.patiently(|| {
        let builder = (builder.plan(plan))
            .world(launch.world().cloned())
            .disk_tier(disk_tier.clone())
            .batches(shape)
            .notes(say);
        builder.build().map_err(|e| memory_flags(tier.explain(e)))
    })?;
    Ok(Placed { model, stats })
}

/// An out-of-memory refusal names the flags that size the run.
fn memory_flags(e: anyhow::Error) -> anyhow::Error {
    match e.downcast_ref::<ember_models::ModelError>() {
        Some(ember_models::ModelError::Memory(_)) => anyhow::anyhow!(
            "{e} (--mini-batch-size, --arch-mlp-bot/--arch-mlp-top, --dcn-num-layers/\
             --dcn-low-rank-dim, --num-indices-per-lookup and the table sizes set them)"
        ),
        _ => e,
    }
}
