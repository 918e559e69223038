//! Sharding flags (`bench dlrm`, `plan`) and `ember plan`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_models::DlrmConfig;
use ember_sharding::plan::MAX_DEVICES;
use ember_sharding::planner::PlanStats;
use ember_sharding::topology::parse_bytes;
use ember_sharding::{plan, stats, PlannerOptions, ShardingPlan, ShardingType, Topology};
use ember_sparse::TableOptimizer;

use super::arch::{ArchArgs, OptimArgs};
use super::world::Launch;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ShardingChoice {
    /// The planner picks per table.
    Auto,
    TableWise,
    RowWise,
    RowWiseMod,
    ColumnWise,
    TableRowWise,
    DataParallel,
}

impl ShardingChoice {
    fn sharding_type(self) -> Option<ShardingType> {
        match self {
            Self::Auto => None,
            Self::TableWise => Some(ShardingType::TableWise),
            Self::RowWise => Some(ShardingType::RowWise),
            Self::RowWiseMod => Some(ShardingType::RowWiseMod),
            Self::ColumnWise => Some(ShardingType::ColumnWise),
            Self::TableRowWise => Some(ShardingType::TableRowWise),
            Self::DataParallel => Some(ShardingType::DataParallel),
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct ShardingArgs {
    /// Shard the tables over this many devices (worker threads owning their
    /// shards) [default: no sharding, one collection].
    #[arg(long)]
    pub devices: Option<usize>,
    #[arg(long, value_enum, default_value_t = ShardingChoice::Auto)]
    pub sharding: ShardingChoice,
    /// A plan file (from `ember plan`, or written by hand) instead of planning.
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// Memory of each device, e.g. 16GiB [default: 16GiB].
    #[arg(long)]
    pub memory_per_device: Option<String>,
    /// Disk of each device for disk-tier shards, e.g. 500GB (with
    /// --disk-dir) [default: as much as they need].
    #[arg(long)]
    pub disk_per_device: Option<String>,
    /// Devices per host, for table-row-wise [default: all on one host].
    #[arg(long)]
    pub devices_per_host: Option<usize>,
    /// A topology JSON file (devices with memory and bandwidth) instead of the flags above.
    #[arg(long)]
    pub topology: Option<PathBuf>,
}

/// `--devices n`: 1 to the most a plan file holds.
fn check_devices(devices: usize) -> anyhow::Result<()> {
    anyhow::ensure!(devices >= 1, "--devices must be at least 1");
    anyhow::ensure!(
        devices <= MAX_DEVICES,
        "--devices {devices}: at most {MAX_DEVICES} (the most a plan file holds)"
    );
    Ok(())
}

impl ShardingArgs {
    /// Checks the flags that need no plan: the device count's range.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.devices.map_or(Ok(()), check_devices)
    }

    pub fn topology(&self, devices: usize) -> anyhow::Result<Topology> {
        if let Some(path) = &self.topology {
            let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
            let topo: Topology = serde_json::from_str(&text)
                .with_context(|| format!("{}: not a topology", path.display()))?;
            topo.validate()?;
            return Ok(topo);
        }
        check_devices(devices)?;
        let memory = parse_bytes(self.memory_per_device.as_deref().unwrap_or("16GiB"))
            .map_err(|e| anyhow::anyhow!("--memory-per-device: {e}"))?;
        let mut topo = Topology::uniform(devices, memory);
        if let Some(text) = &self.disk_per_device {
            let disk = parse_bytes(text).map_err(|e| anyhow::anyhow!("--disk-per-device: {e}"))?;
            for d in &mut topo.devices {
                d.disk_bytes = Some(disk);
            }
        }
        if let Some(per_host) = self.devices_per_host {
            topo.devices_per_host = per_host;
        }
        topo.validate()?;
        Ok(topo)
    }

    /// [`ShardingArgs::plan`], or on a rank of a world: a plan of one device
    /// per rank, made once (on rank 0) and sent to every rank.
    pub fn plan_for(
        &self,
        config: &DlrmConfig,
        options: &PlannerOptions,
        launch: &Launch,
    ) -> anyhow::Result<Option<(ShardingPlan, PlanStats)>> {
        let Some(r) = launch.ranks() else {
            return self.plan(config, options);
        };
        if let Some(d) = self.devices {
            anyhow::ensure!(
                d == r.size,
                "--devices {d} under {} MPI ranks: each rank runs one device, so --devices must be {} (or left out)",
                r.size,
                r.size
            );
        }
        let args = ShardingArgs {
            devices: Some(r.size),
            ..self.clone()
        };
        let text = match r.rank {
            0 => {
                let (plan, _) = args.plan(config, options)?.expect("devices are given");
                serde_json::to_vec(&plan)?
            }
            _ => Vec::new(),
        };
        let text = r.comm.broadcast(0, text)?;
        let plan =
            ShardingPlan::from_json(std::str::from_utf8(&text)?).context("the plan rank 0 sent")?;
        anyhow::ensure!(
            plan.num_devices == r.size,
            "the plan is for {} devices, the job has {} ranks (one device each)",
            plan.num_devices,
            r.size
        );
        let topo = args.topology(r.size)?;
        let s = stats(&config.tables, &plan, &topo, options);
        Ok(Some((plan, s)))
    }

    /// The plan to run under, or `None` to run unsharded.
    pub fn plan(
        &self,
        config: &DlrmConfig,
        options: &PlannerOptions,
    ) -> anyhow::Result<Option<(ShardingPlan, PlanStats)>> {
        let devices = match (self.devices, &self.plan, &self.topology) {
            (None, None, None) => return Ok(None),
            (Some(n), _, _) => n,
            _ => 0,
        };
        if let Some(path) = &self.plan {
            let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
            let p = ShardingPlan::from_json(&text).with_context(|| path.display().to_string())?;
            p.validate(&config.tables, &options.optimizer)
                .with_context(|| path.display().to_string())?;
            let topo = self.topology(if devices == 0 { p.num_devices } else { devices })?;
            anyhow::ensure!(
                topo.num_devices() == p.num_devices,
                "{}: the plan is for {} devices, the topology has {}",
                path.display(),
                p.num_devices,
                topo.num_devices()
            );
            let s = stats(&config.tables, &p, &topo, options);
            return Ok(Some((p, s)));
        }
        let topo = self.topology(devices)?;
        let options = PlannerOptions {
            sharding: self.sharding.sharding_type(),
            ..options.clone()
        };
        Ok(Some(plan(&config.tables, &topo, &options)?))
    }
}

#[derive(Args, Clone, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub arch: ArchArgs,
    #[command(flatten)]
    pub optim: OptimArgs,
    #[command(flatten)]
    pub sharding: ShardingArgs,
    /// With --disk-dir, a table that does not fit a device's memory goes
    /// on the disk tier, with a cache of --cache-memory.
    #[command(flatten)]
    pub tier: super::tier::TierArgs,
    /// Global batch size the cost model assumes.
    #[arg(long, default_value_t = 2048)]
    pub mini_batch_size: usize,
    /// Mean ids per bag the cost model assumes [default: the preset's].
    #[arg(long)]
    pub num_indices_per_lookup: Option<f64>,
    /// Where to write the plan (JSON).
    #[arg(long)]
    pub output: PathBuf,
    /// Also draw each device's memory and estimated time per step (PNG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct PlanReport {
    pub output: PathBuf,
    pub num_devices: usize,
    pub stats: PlanStats,
}

impl std::fmt::Display for PlanReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.stats)?;
        write!(
            f,
            "plan for {} devices written to {}",
            self.num_devices,
            self.output.display()
        )
    }
}

pub fn planner_options(optimizer: TableOptimizer, batch: usize, pooling: f64) -> PlannerOptions {
    PlannerOptions {
        batch_size: batch,
        pooling_factor: pooling,
        optimizer,
        sharding: None,
        disk_tier: None,
    }
}

/// The mean ids per bag of `--num-indices-per-lookup n`: dlrm_s_pytorch
/// draws 1..=n ids per bag unless fixed, about (n + 1) / 2 on average.
pub fn mean_ids_per_bag(n: usize, fixed: bool) -> f64 {
    match fixed {
        true => n as f64,
        false => (n as f64 + 1.0) / 2.0,
    }
}

pub fn run_plan(args: &PlanArgs) -> anyhow::Result<PlanReport> {
    args.optim.validate()?;
    let (config, lookups, fixed) = args.arch.resolve()?;
    let preset_mean = (args.arch.multi_hot_sizes())
        .map(|sizes| sizes.iter().sum::<usize>() as f64 / sizes.len() as f64);
    let pooling = (args.num_indices_per_lookup)
        .or(preset_mean)
        .unwrap_or(mean_ids_per_bag(lookups, fixed));
    let optimizer = args.optim.table_optimizer();
    // Ids as skewed as Criteo's (Zipf 1) for the caches' hit rates.
    let batch_ids = (args.mini_batch_size as f64 * pooling) as usize;
    let options = PlannerOptions {
        disk_tier: (args.tier.options()?)
            .map(|t| t.planner_model(&config.tables, &optimizer, batch_ids, 1.0)),
        ..planner_options(optimizer, args.mini_batch_size, pooling)
    };
    let sharding = ShardingArgs {
        devices: Some(args.sharding.devices.unwrap_or(1)),
        ..args.sharding.clone()
    };
    let (p, stats) = sharding.plan(&config, &options)?.expect("devices given");
    let _lock = ember_dataloader::lock::DirLock::for_file(&args.output, "ember plan")?;
    ember_dataloader::atomic::write_atomic(&args.output, p.to_json().as_bytes())?;
    if let Some(png) = &args.plot {
        let title = format!(
            "ember plan: {} tables on {} devices, batch {}",
            config.tables.len(),
            p.num_devices,
            args.mini_batch_size
        );
        super::plan_plot::write(&stats, &title, png)?;
    }
    Ok(PlanReport {
        output: args.output.clone(),
        num_devices: p.num_devices,
        stats,
    })
}
