//! `ember bench dlrm`: trains a DLRM or DLRM-DCNv2 on synthetic data and
//! reports throughput, the per-phase time split, losses and (when it tests)
//! AUC. Flags follow dlrm_s_pytorch.py.

use std::time::Instant;

use anyhow::bail;
use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_models::{
    Backend, BatchShape, DataGeneration, Dlrm, DlrmConfig, ExecMode, FitOptions, InMemory, Metrics,
    Optimization, PhaseTimes, SyntheticBatches, SyntheticConfig, SyntheticData, TrainData,
    TrainEvent, TrainSummary, Trainer, TrainerConfig,
};

use super::arch::{ArchArgs, OptimArgs};
use super::backend::{BackendArgs, ModeArgs};
use super::bench_embedding::{median, BenchOptimizer};
use super::place::place;
use super::plan::{mean_ids_per_bag, planner_options, ShardingArgs};
use super::run_logs::RunLogs;
use super::world::{setup_timeout, Fault, Launch};
use super::{peak_rss_bytes, Progress};
use ember_sharding::PlannerOptions;

/// Test batches are numbered from here, apart from training batches.
const TEST_BATCH_BASE: u64 = 1 << 40;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    Random,
    Learnable,
}

#[derive(Args, Clone, Debug)]
pub struct DlrmArgs {
    #[command(flatten)]
    pub arch: ArchArgs,
    #[command(flatten)]
    pub optimization: super::optimization::OptimizationArgs,
    #[command(flatten)]
    pub tensorboard: super::run_logs::TensorBoardArgs,
    /// Ids per bag (the maximum, unless fixed) [default: 10].
    #[arg(long)]
    pub num_indices_per_lookup: Option<usize>,
    /// Every bag has exactly --num-indices-per-lookup ids.
    #[arg(long)]
    pub num_indices_per_lookup_fixed: bool,
    /// Key-value tables' ids drawn from this many times their rows (raw
    /// ids past the table, most of them new: tables fill and evict); 1:
    /// within their rows, as other tables' ids.
    #[arg(long, default_value_t = 1)]
    pub kv_id_space: u64,
    #[arg(long, value_enum, default_value_t = DataKind::Random)]
    pub data_generation: DataKind,
    /// Ids follow --data-generation unless these say otherwise.
    #[command(flatten)]
    pub ids: super::ids::IdArgs,
    /// Tables on the disk tier (sharded: those the plan cannot fit in memory).
    #[command(flatten)]
    pub tier: super::tier::TierArgs,
    /// Read the next batch's disk-tier rows ahead while a batch computes.
    #[arg(long, requires = "disk_dir")]
    pub read_ahead: bool,
    #[arg(long, default_value_t = 2048)]
    pub mini_batch_size: usize,
    #[arg(long, default_value_t = 100)]
    pub num_batches: u64,
    #[command(flatten)]
    pub optim: OptimArgs,
    #[command(flatten)]
    pub sharding: ShardingArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Evaluate every this many batches (0: never).
    #[arg(long, default_value_t = 0)]
    pub test_freq: u64,
    #[arg(long, default_value_t = 10)]
    pub test_num_batches: u64,
    /// Print a progress line every this many batches.
    #[arg(long, default_value_t = 10)]
    pub print_freq: u64,
    #[arg(long, default_value_t = 123)]
    pub seed: u64,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print one JSON object at the end (progress lines go to stderr).
    #[arg(long)]
    pub json: bool,
    /// Write the trained model into this directory: `model.safetensors`, or
    /// under mpirun a set that every rank writes its part of.
    #[arg(long)]
    pub save: Option<std::path::PathBuf>,
}

/// The architecture and data after presets and defaults are applied.
#[derive(Clone, Debug, Serialize)]
pub struct ResolvedDlrm {
    pub config: DlrmConfig,
    pub indices_per_lookup: usize,
    pub fixed_indices: bool,
    /// Each feature's ids per bag (`--preset mlperf-multihot`; empty: the
    /// same for every feature).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub indices_per_feature: Vec<usize>,
}

impl DlrmArgs {
    pub fn resolve(&self) -> anyhow::Result<ResolvedDlrm> {
        let (config, lookups, fixed) = self.arch.resolve()?;
        let indices_per_lookup = self.num_indices_per_lookup.unwrap_or(lookups);
        anyhow::ensure!(
            indices_per_lookup >= 1,
            "--num-indices-per-lookup must be at least 1"
        );
        // The preset's sizes, unless --num-indices-per-lookup says otherwise.
        let sizes = (self.arch.multi_hot_sizes()).filter(|_| self.num_indices_per_lookup.is_none());
        Ok(ResolvedDlrm {
            config,
            indices_per_lookup,
            fixed_indices: self.num_indices_per_lookup_fixed
                || (self.num_indices_per_lookup.is_none() && fixed),
            indices_per_feature: sizes.unwrap_or_default(),
        })
    }
}

/// Mean milliseconds per step of each phase.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct PhaseMs {
    pub sparse_forward: f64,
    pub dense_forward: f64,
    pub dense_backward: f64,
    pub dense_update: f64,
    pub sparse_backward_update: f64,
}

#[derive(Debug, Serialize)]
pub struct DlrmReport {
    pub run: super::run_info::RunInfo,
    pub architecture: ResolvedDlrm,
    pub data_generation: DataKind,
    /// The ids' distribution when --id-distribution chose one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id_distribution: Option<ember_sparse::IdDistribution>,
    /// With --disk-dir: the caches' hit rate over the run and the file
    /// bytes moved per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_tier: Option<super::tier::TierReport>,
    /// With key-value tables: each one's figures (ids seen, admitted,
    /// rejected, evicted, fallback reads, occupancy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_value_tables: Option<Vec<super::kv::KvTableReport>>,
    pub optimizer: BenchOptimizer,
    /// Schedules, weight decay and clipping, when any is given.
    #[serde(skip_serializing_if = "Optimization::is_default")]
    pub optimization: Optimization,
    /// The tables' data type (the first table's, when they differ).
    pub table_dtype: ember_sparse::DataType,
    pub backend: &'static str,
    pub mode: ExecMode,
    /// PJRT only: executables compiled (and the time it took), and those
    /// loaded from the compile cache instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compiles: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compile_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compile_cache_hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_load_ms: Option<f64>,
    pub threads: usize,
    pub mini_batch_size: usize,
    pub num_batches: u64,
    /// Samples per second over the timed steps (all but the first, a warm-up):
    /// the steps' own time, what the step's critical path allows.
    pub samples_per_s: f64,
    /// Samples per second of wall time over every step, waits for batches
    /// included (the Trainer's `train_seconds`).
    pub wall_samples_per_s: f64,
    /// The input dist run ahead on the pipeline thread, per step (sharded
    /// and pipelined only; in turn, it is inside the step's sparse forward).
    pub input_dist_ahead_ms: f64,
    pub ids_per_s: f64,
    pub step_ms_median: f64,
    pub phase_ms: PhaseMs,
    pub loss_first: f32,
    pub loss_last: f32,
    /// Of the last evaluation, when there was one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auc: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logloss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
    /// Normalized entropy (TorchRec's NE) and calibration of the last evaluation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ne: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<f64>,
    pub table_bytes: u64,
    pub peak_rss_bytes: u64,
    pub setup_s: f64,
    /// Processes (MPI ranks) the run took; 1 unless under mpirun.
    pub world_size: usize,
    /// With `--devices` or `--plan`: where the tables ran and what moved
    /// (under mpirun one device per rank, so per device is per rank; a
    /// rank's bytes include the dense gradients' all-reduce).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sharding: Option<ShardingReport>,
}

/// The sharded execution's counters, per step (warm-up step included).
#[derive(Debug, Serialize)]
pub struct ShardingReport {
    pub devices: usize,
    /// `table:sharding_type` on each device.
    pub shards: Vec<Vec<String>>,
    pub per_device_table_bytes: Vec<u64>,
    pub per_device_lookups_per_step: Vec<f64>,
    pub per_device_bytes_sent_per_step: Vec<f64>,
    /// Slowest device's milliseconds per step in each stage.
    pub stage_ms: StageMs,
    /// The planner's estimate for the most loaded device.
    pub estimated_max_device_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct StageMs {
    pub input_dist: f64,
    pub lookup: f64,
    pub output_dist: f64,
    pub grad_dist: f64,
    pub update: f64,
}

pub fn run(args: &DlrmArgs, launch: &Launch) -> anyhow::Result<DlrmReport> {
    if args.mini_batch_size == 0 || args.num_batches == 0 {
        bail!("--mini-batch-size and --num-batches must be at least 1");
    }
    if args.test_freq > 0 && args.test_num_batches == 0 {
        bail!("--test-num-batches must be at least 1 when --test-freq is set");
    }
    args.optim.validate()?;
    let resolved = args.resolve()?;
    super::with_threads(args.threads, || run_in_pool(args, resolved, launch))?
}

/// What the timed steps of a run add up to (step 0, a warm-up, left out
/// unless it is the only one).
#[derive(Default)]
struct Timings {
    step_s: Vec<f64>,
    phases: PhaseTimes,
    ids: u64,
    loss: (f32, f32),
    /// Seconds and loss summed since the last progress line, and steps.
    window: (f64, f64, u64),
    metrics: Option<Metrics>,
    /// The Trainer's summary of the run.
    summary: TrainSummary,
}

impl Timings {
    /// Counts one step; prints a progress line every `--print-freq` steps.
    fn step(&mut self, args: &DlrmArgs, progress: &Progress, e: &TrainEvent) {
        let TrainEvent::Step {
            steps,
            loss,
            times,
            ids,
            ..
        } = e
        else {
            return;
        };
        let seconds = times.total().as_secs_f64();
        if *steps > 1 || args.num_batches == 1 {
            self.step_s.push(seconds);
            self.ids += *ids as u64;
            self.phases += *times;
        }
        if *steps == 1 {
            self.loss.0 = *loss;
        }
        self.loss.1 = *loss;
        let w = &mut self.window;
        *w = (w.0 + seconds, w.1 + *loss as f64, w.2 + 1);
        progress.inc();
        if steps % args.print_freq.max(1) == 0 || *steps == args.num_batches {
            progress.line(&format!(
                "Finished training it {steps}/{} of epoch 0, {:.2} ms/it, loss {:.6}",
                args.num_batches,
                w.0 * 1e3 / w.2 as f64,
                w.1 / w.2 as f64
            ));
            *w = (0.0, 0.0, 0);
        }
    }
}

fn run_in_pool(
    args: &DlrmArgs,
    resolved: ResolvedDlrm,
    launch: &Launch,
) -> anyhow::Result<DlrmReport> {
    let setup = Instant::now();
    let config = &resolved.config;
    let table_optimizer = args.optim.table_optimizer();
    let (options, shape) = planned_shape(args, &resolved, launch)?;
    let dense_optimizer = args.optim.dense_optimizer();
    let builder = (Dlrm::builder(config.clone()).seed(args.seed))
        .optimizers(table_optimizer, dense_optimizer);
    // Printed once the run's progress starts, below.
    let mut lines = Vec::new();
    let placed = place(
        (&args.tier, &args.sharding),
        launch,
        (config, options),
        shape,
        (builder, &mut |line| lines.push(line)),
    )?;
    let mut model = placed.model;
    model.set_read_ahead(args.read_ahead);
    let estimated_ms = placed.stats.as_ref().map(|s| s.max_cost_s * 1e3);
    let shards = (placed.stats.as_ref()).map(|s| {
        s.devices
            .iter()
            .map(|d| d.shards.clone())
            .collect::<Vec<_>>()
    });
    let (train, test) = synthetic_data(args, &resolved, launch)?;
    let trainer = Trainer::new(
        TrainerConfig {
            epochs: 1,
            mode: args.mode.mode,
            eval_every: args.test_freq,
            eval_at_epoch_end: args.test_freq > 0,
            checkpoint_dir: args.save.clone(),
            // The Trainer's logs feed TensorBoard; the progress lines are this file's.
            log_every: args.print_freq.max(1),
            setup_timeout: setup_timeout()?,
            pipeline: !args.mode.no_pipeline,
            optimization: {
                let o = args.optimization.optimization()?;
                super::optimization::check_for(&o, &args.optim.table_optimizer(), args.mode.mode)?;
                o
            },
            ..TrainerConfig::default()
        },
        args.backend.build(args.mode.mode)?,
    );
    let setup_s = setup.elapsed().as_secs_f64();

    let progress = Progress::new(args.num_batches, "dlrm", args.json).quiet(!launch.is_root());
    let fault = Fault::from_env(launch)?;
    for line in &lines {
        progress.line(line);
    }
    progress.line(&format!(
        "ember bench dlrm: {} tables (dim {}), bottom {:?}, top {:?}, {:?}, batch {}, {} threads, setup {setup_s:.1} s",
        config.tables.len(), config.embedding_dim(), config.bottom_mlp, config.top_mlp_sizes(),
        config.interaction, args.mini_batch_size, rayon::current_num_threads()));
    let mut t = Timings::default();
    let test = (args.test_freq > 0).then_some(&test as &dyn TrainData);
    let rates = (
        (
            args.optim.table_optimizer().learning_rate(),
            args.optim.dense_optimizer().learning_rate(),
        ),
        args.optimization.optimization()?,
    );
    let mut logs = match launch.is_root() {
        true => RunLogs::start(None, &args.tensorboard, rates)?,
        false => RunLogs::default(),
    };
    let mut on_event = |e: &TrainEvent| {
        logs.on_event(e);
        match e {
            TrainEvent::BeforeStep { steps } => fault.at_step(*steps),
            TrainEvent::Eval {
                steps, metrics: m, ..
            } => {
                progress.line(&format!(
                    "Testing at - {steps}/{} of epoch 0, loss {:.6}, auc {:.4}, accuracy {:.3} %",
                    args.num_batches,
                    m.logloss,
                    m.auc,
                    m.accuracy * 100.0
                ));
                t.metrics = Some(*m);
            }
            e => t.step(args, &progress, e),
        }
    };
    let summary = trainer.fit(
        &mut model,
        train.as_ref(),
        FitOptions {
            eval: test,
            on_event: Some(&mut on_event),
            ..FitOptions::default()
        },
    );
    let finished = logs.finish(&progress);
    t.summary = summary?;
    finished?;
    progress.finish();
    let sharding = sharding_report(launch, &model, &mut t, shards, estimated_ms)?;
    let report = DlrmReport::new(
        args,
        resolved,
        trainer.backend(),
        &model,
        t,
        sharding,
        setup_s,
    );
    Ok(DlrmReport {
        world_size: launch.world_size(),
        key_value_tables: super::kv::kv_report(&model)?,
        ..report
    })
}

/// What the planner assumes of the run, and the run's shape with the ids'
/// skew (Zipf exponent) the planner assumes of the disk tier's caches.
fn planned_shape(
    args: &DlrmArgs,
    resolved: &ResolvedDlrm,
    launch: &Launch,
) -> anyhow::Result<(PlannerOptions, (BatchShape, f64))> {
    let pooling = match resolved.indices_per_feature.as_slice() {
        [] => mean_ids_per_bag(resolved.indices_per_lookup, resolved.fixed_indices),
        sizes => sizes.iter().sum::<usize>() as f64 / sizes.len() as f64,
    };
    // The planner's hit rates: the ids' skew (the generators' own is about
    // Zipf 1: log-uniform for learnable; random is uniform).
    let alpha = match args.ids.distribution()? {
        Some(ember_sparse::IdDistribution::Zipf { alpha }) => alpha,
        Some(ember_sparse::IdDistribution::Uniform) => 0.0,
        None if matches!(args.data_generation, DataKind::Random) => 0.0,
        None => 1.0,
    };
    let options = planner_options(args.optim.table_optimizer(), args.mini_batch_size, pooling);
    anyhow::ensure!(
        args.mini_batch_size >= launch.world_size(),
        "--mini-batch-size {} is the global batch: it needs at least one sample for each of the {} ranks",
        args.mini_batch_size,
        launch.world_size()
    );
    let shape = BatchShape {
        batch_size: args.mini_batch_size / launch.world_size().max(1),
        ids_per_bag: pooling,
        max_ids_per_bag: resolved.indices_per_lookup,
        // The step's batch, the pipeline's next ones and the evaluation's.
        in_flight: 4,
    };
    Ok((options, (shape, alpha)))
}

/// Training batches made before the clock, when they fit in this many
/// bytes; more are made as the steps take them (on the pipeline thread,
/// where making them shares the cores with the steps).
const IN_MEMORY_BYTES: usize = 2 << 30;

/// Bytes a batch holds: dense features and labels (f32), ids (i64), one
/// offset per bag (usize) and weights (f32).
fn batch_bytes(b: &ember_models::Batch) -> usize {
    4 * (b.dense.data().len() + b.labels.len())
        + 8 * (b.sparse.values().len() + b.sparse.offsets().len())
        + 4 * b.sparse.weights().map_or(0, |w| w.len())
}

/// The training batches (in memory when they fit [`IN_MEMORY_BYTES`]) and
/// (on a rank, its block of) the test batches, numbered apart from each other.
fn synthetic_data(
    args: &DlrmArgs,
    resolved: &ResolvedDlrm,
    launch: &Launch,
) -> anyhow::Result<(Box<dyn TrainData>, InMemory)> {
    let mut config = SyntheticConfig {
        fixed_indices: resolved.fixed_indices,
        indices_per_feature: resolved.indices_per_feature.clone(),
        ids: args.ids.distribution()?,
        ..SyntheticConfig::for_model(
            &resolved.config,
            match args.data_generation {
                DataKind::Random => DataGeneration::Random,
                DataKind::Learnable => DataGeneration::Learnable,
            },
            resolved.indices_per_lookup,
            args.seed,
        )
    };
    anyhow::ensure!(args.kv_id_space >= 1, "--kv-id-space must be at least 1");
    for table in resolved.config.tables.iter().filter(|t| t.kv.is_some()) {
        for (name, rows) in
            (config.features.iter_mut()).filter(|(n, _)| table.feature_names.contains(n))
        {
            *rows = (*rows as u64)
                .checked_mul(args.kv_id_space)
                .and_then(|r| usize::try_from(r).ok())
                .filter(|&r| r <= i64::MAX as usize)
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "--kv-id-space {}: feature {name}'s ids pass 2^63",
                        args.kv_id_space
                    )
                })?;
        }
    }
    let data = SyntheticData::new(config)?;
    let batches = |first, batches| SyntheticBatches {
        data: data.clone(),
        first,
        batches,
        size: args.mini_batch_size,
        rank: launch.rank(),
        world_size: launch.world_size(),
    };
    // Made once, so each evaluation sees the same batches.
    let test = match args.test_freq {
        0 => Vec::new(),
        _ => {
            let test = batches(TEST_BATCH_BASE, args.test_num_batches);
            test.epoch(0, 0).collect::<Result<_, _>>()?
        }
    };
    let train = batches(0, args.num_batches);
    let first = train.epoch(0, 0).next().transpose()?;
    let bytes = first.as_ref().map_or(0, batch_bytes);
    let train: Box<dyn TrainData> = match bytes.saturating_mul(args.num_batches as usize) {
        b if b <= IN_MEMORY_BYTES => {
            Box::new(InMemory(train.epoch(0, 0).collect::<Result<_, _>>()?))
        }
        _ => Box::new(train),
    };
    Ok((train, InMemory(test)))
}

/// With sharded tables: where they ran and what moved (on ranks, every
/// rank's devices); also makes `t.ids` every rank's.
fn sharding_report(
    launch: &Launch,
    model: &Dlrm,
    t: &mut Timings,
    shards: Option<Vec<Vec<String>>>,
    estimated_ms: Option<f64>,
) -> anyhow::Result<Option<(ShardingReport, u64)>> {
    let (sharding_stats, ids) = match (launch.ranks(), model.sparse_arch().sharded()) {
        (Some(r), Some(sh)) => {
            let (ids, stats) = over_ranks(&r.comm, t.ids, sh)?;
            (Some(stats), ids)
        }
        (_, sh) => (sh.map(|sh| (sh.stats(), sh.device_bytes())), t.ids),
    };
    t.ids = ids;
    Ok(sharding_stats.map(|(st, device_bytes)| {
        let steps = st.steps.max(1) as f64;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps;
        let table_bytes = device_bytes.iter().sum::<usize>() as u64;
        let report = ShardingReport {
            devices: device_bytes.len(),
            shards: shards.unwrap_or_default(),
            per_device_table_bytes: device_bytes.iter().map(|&b| b as u64).collect(),
            per_device_lookups_per_step: st.lookups.iter().map(|&l| l as f64 / steps).collect(),
            per_device_bytes_sent_per_step: st
                .bytes_sent
                .iter()
                .map(|&b| b as f64 / steps)
                .collect(),
            stage_ms: StageMs {
                input_dist: ms(st.input_dist),
                lookup: ms(st.lookup),
                output_dist: ms(st.output_dist),
                grad_dist: ms(st.grad_dist),
                update: ms(st.update),
            },
            estimated_max_device_ms: estimated_ms.unwrap_or(f64::NAN),
        };
        (report, table_bytes)
    }))
}

impl DlrmReport {
    fn new(
        args: &DlrmArgs,
        architecture: ResolvedDlrm,
        backend: &Backend,
        model: &Dlrm,
        mut t: Timings,
        sharding: Option<(ShardingReport, u64)>,
        setup_s: f64,
    ) -> Self {
        let size = args.mini_batch_size;
        let timed = t.step_s.len().max(1) as f64;
        let total_s: f64 = t.step_s.iter().sum();
        let per_step_ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / timed;
        let rate = |n: f64| if total_s > 0.0 { n / total_s } else { f64::NAN };
        let compile = backend.compile_stats();
        let (sharding, table_bytes) = match sharding {
            Some((report, bytes)) => (Some(report), bytes),
            None => (None, model.sparse_arch().bytes() as u64),
        };
        Self {
            data_generation: args.data_generation,
            // Checked when the data was made.
            id_distribution: args.ids.distribution().ok().flatten(),
            disk_tier: super::tier::TierReport::of(model, timed),
            // Set by the caller: on ranks, gathered from all.
            key_value_tables: None,
            optimizer: args.optim.kind(),
            // Checked when the trainer was made.
            optimization: args.optimization.optimization().unwrap_or_default(),
            table_dtype: (architecture.config.tables.first())
                .map_or_else(Default::default, |t| t.data_type),
            backend: backend.name(),
            mode: args.mode.mode,
            compiles: compile.as_ref().map(|s| s.compiles),
            compile_ms: compile.as_ref().map(|s| s.compile_ms),
            compile_cache_hits: compile.as_ref().map(|s| s.compile_cache_hits),
            cache_load_ms: compile.as_ref().map(|s| s.cache_load_ms),
            run: super::run_info::RunInfo::now(),
            threads: rayon::current_num_threads(),
            mini_batch_size: size,
            num_batches: args.num_batches,
            samples_per_s: rate(t.step_s.len() as f64 * size as f64),
            wall_samples_per_s: t.summary.samples as f64 / t.summary.train_seconds.max(1e-9),
            input_dist_ahead_ms: t.summary.input_dist_seconds * 1e3 / t.summary.steps.max(1) as f64,
            ids_per_s: rate(t.ids as f64),
            step_ms_median: median(&mut t.step_s) * 1e3,
            phase_ms: PhaseMs {
                sparse_forward: per_step_ms(t.phases.sparse_forward),
                dense_forward: per_step_ms(t.phases.dense_forward),
                dense_backward: per_step_ms(t.phases.dense_backward),
                dense_update: per_step_ms(t.phases.dense_update),
                sparse_backward_update: per_step_ms(t.phases.sparse_backward_update),
            },
            loss_first: t.loss.0,
            loss_last: t.loss.1,
            auc: t.metrics.map(|m| m.auc),
            logloss: t.metrics.map(|m| m.logloss),
            accuracy: t.metrics.map(|m| m.accuracy),
            ne: t.metrics.map(|m| m.ne),
            calibration: t.metrics.map(|m| m.calibration),
            // Of every rank's devices.
            table_bytes,
            peak_rss_bytes: peak_rss_bytes(),
            setup_s,
            world_size: 1,
            sharding,
            architecture,
        }
    }
}

/// The ids of every rank, and the sharding counters with every rank's own
/// device filled in (stage times: the slowest rank's).
fn over_ranks(
    comm: &std::sync::Arc<dyn ember_sharding::Collective>,
    ids: u64,
    sh: &ember_sharding::ShardedEmbeddingBagCollection,
) -> anyhow::Result<(u64, (ember_sharding::ShardingStats, Vec<usize>))> {
    let me = comm.rank();
    let mut st = sh.stats();
    let mut bytes = sh.device_bytes();
    let stages = [
        st.input_dist,
        st.lookup,
        st.output_dist,
        st.grad_dist,
        st.update,
    ];
    let mine: Vec<f64> = [
        ids as f64,
        st.lookups[me] as f64,
        st.bytes_sent[me] as f64,
        bytes[me] as f64,
    ]
    .into_iter()
    .chain(stages.iter().map(|d| d.as_secs_f64()))
    .collect();
    let parts = comm.all_gather(mine.iter().flat_map(|v| v.to_le_bytes()).collect())?;
    let mut total_ids = 0;
    let mut slowest = [0.0f64; 5];
    for (rank, part) in parts.iter().enumerate() {
        let v: Vec<f64> = (part.chunks_exact(8))
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        anyhow::ensure!(v.len() == 9, "rank {rank} sent {} counters", v.len());
        total_ids += v[0] as u64;
        st.lookups[rank] = v[1] as u64;
        st.bytes_sent[rank] = v[2] as u64;
        bytes[rank] = v[3] as usize;
        for (s, x) in slowest.iter_mut().zip(&v[4..]) {
            *s = s.max(*x);
        }
    }
    let d = std::time::Duration::from_secs_f64;
    (
        st.input_dist,
        st.lookup,
        st.output_dist,
        st.grad_dist,
        st.update,
    ) = (
        d(slowest[0]),
        d(slowest[1]),
        d(slowest[2]),
        d(slowest[3]),
        d(slowest[4]),
    );
    Ok((total_ids, (st, bytes)))
}

impl std::fmt::Display for DlrmReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.phase_ms;
        writeln!(
            f,
            "{:.0} samples/s, {:.2} M ids/s, {:.2} ms/step (median), {} threads, {} backend, {} tables",
            self.samples_per_s,
            self.ids_per_s / 1e6,
            self.step_ms_median,
            self.threads,
            self.backend,
            self.table_dtype
        )?;
        writeln!(f, "per step: sparse forward {:.2} ms, dense forward {:.2} ms, dense backward {:.2} ms, dense update {:.2} ms, sparse backward+update {:.2} ms",
            p.sparse_forward, p.dense_forward, p.dense_backward, p.dense_update, p.sparse_backward_update)?;
        writeln!(f, "loss {:.6} -> {:.6}", self.loss_first, self.loss_last)?;
        if let (Some(auc), Some(ll), Some(acc)) = (self.auc, self.logloss, self.accuracy) {
            writeln!(
                f,
                "test: auc {auc:.4}, logloss {ll:.6}, accuracy {:.3} %, ne {:.4}, calibration {:.4}",
                acc * 100.0,
                self.ne.unwrap_or(f64::NAN),
                self.calibration.unwrap_or(f64::NAN)
            )?;
        }
        if let Some(d) = &self.disk_tier {
            writeln!(f, "{d}")?;
        }
        if let Some(t) = &self.key_value_tables {
            writeln!(f, "{}", super::kv::kv_summary(t))?;
        }
        if let Some(sh) = &self.sharding {
            let s = &sh.stage_ms;
            writeln!(
                f,
                "{} devices: per step input dist {:.2} ms, lookup {:.2} ms, output dist {:.2} ms, grad dist {:.2} ms, update {:.2} ms",
                sh.devices, s.input_dist, s.lookup, s.output_dist, s.grad_dist, s.update
            )?;
            for (d, shards) in sh.shards.iter().enumerate() {
                writeln!(
                    f,
                    "  device {d}: {:.0} lookups/step, {:.2} MB sent/step, {}",
                    sh.per_device_lookups_per_step
                        .get(d)
                        .copied()
                        .unwrap_or(0.0),
                    sh.per_device_bytes_sent_per_step
                        .get(d)
                        .copied()
                        .unwrap_or(0.0)
                        / 1e6,
                    shards.join(" ")
                )?;
            }
        }
        write!(
            f,
            "tables + optimizer state {:.3} GiB, peak RSS {:.3} GiB",
            self.table_bytes as f64 / (1u64 << 30) as f64,
            self.peak_rss_bytes as f64 / (1u64 << 30) as f64
        )
    }
}
