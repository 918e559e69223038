//! `ember bench dlrm`: trains a DLRM or DLRM-DCNv2 on synthetic data and
//! reports throughput, the per-phase time split, losses and (when it tests)
//! AUC. Flags follow dlrm_s_pytorch.py.

use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_models::{
    evaluate, Batch, DataGeneration, DlrmConfig, Metrics, PhaseTimes, SyntheticConfig,
    SyntheticData,
};

use ember_models::checkpoint::{save, save_set};

use super::arch::{ArchArgs, OptimArgs};
use super::backend::{BackendArgs, ExecMode, ModeArgs, Stepper};
use super::bench_embedding::{median, BenchOptimizer};
use super::sharding::{mean_ids_per_bag, planner_options, ShardingArgs};
use super::world::{place_model, Fault, Launch};
use super::{peak_rss_bytes, Progress};

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
    /// Ids per bag (the maximum, unless fixed) [default: 10].
    #[arg(long)]
    pub num_indices_per_lookup: Option<usize>,
    /// Every bag has exactly --num-indices-per-lookup ids.
    #[arg(long)]
    pub num_indices_per_lookup_fixed: bool,
    #[arg(long, value_enum, default_value_t = DataKind::Random)]
    pub data_generation: DataKind,
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
}

impl DlrmArgs {
    pub fn resolve(&self) -> anyhow::Result<ResolvedDlrm> {
        let (config, lookups, fixed) = self.arch.resolve()?;
        let indices_per_lookup = self.num_indices_per_lookup.unwrap_or(lookups);
        anyhow::ensure!(
            indices_per_lookup >= 1,
            "--num-indices-per-lookup must be at least 1"
        );
        Ok(ResolvedDlrm {
            config,
            indices_per_lookup,
            fixed_indices: self.num_indices_per_lookup_fixed
                || (self.num_indices_per_lookup.is_none() && fixed),
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
    pub architecture: ResolvedDlrm,
    pub data_generation: DataKind,
    pub optimizer: BenchOptimizer,
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
    /// Samples per second over the timed steps (all but the first, a warm-up).
    pub samples_per_s: f64,
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

fn run_in_pool(
    args: &DlrmArgs,
    resolved: ResolvedDlrm,
    launch: &Launch,
) -> anyhow::Result<DlrmReport> {
    let setup = Instant::now();
    let config = &resolved.config;
    let table_optimizer = args.optim.table_optimizer();
    let pooling = mean_ids_per_bag(resolved.indices_per_lookup, resolved.fixed_indices);
    let options = planner_options(table_optimizer, args.mini_batch_size, pooling);
    anyhow::ensure!(
        args.mini_batch_size >= launch.world_size(),
        "--mini-batch-size {} is the global batch: it needs at least one sample for each of the {} ranks",
        args.mini_batch_size,
        launch.world_size()
    );
    let planned = launch.patiently(|| args.sharding.plan_for(config, &options, launch))?;
    let estimated_ms = planned.as_ref().map(|(_, s)| s.max_cost_s * 1e3);
    let shards = planned.as_ref().map(|(_, s)| {
        s.devices
            .iter()
            .map(|d| d.shards.clone())
            .collect::<Vec<_>>()
    });
    let dense_optimizer = args.optim.dense_optimizer();
    // A rank builds only its own shards (ranks wait for the slowest).
    let optimizers = (table_optimizer, dense_optimizer);
    let plan = planned.map(|(plan, _)| plan);
    let mut model =
        launch.patiently(|| place_model(launch, config, optimizers, args.seed, plan, None))?;
    // On a rank, its block of every global batch.
    let mine = |b: Batch| match launch.ranks() {
        Some(r) => b.select(b.size() * r.rank / r.size..b.size() * (r.rank + 1) / r.size),
        None => b,
    };
    let backend = args.backend.build(args.mode.mode)?;
    let mut stepper = Stepper::new(args.mode.mode);
    let data = SyntheticData::new(SyntheticConfig {
        fixed_indices: resolved.fixed_indices,
        ..SyntheticConfig::for_model(
            config,
            match args.data_generation {
                DataKind::Random => DataGeneration::Random,
                DataKind::Learnable => DataGeneration::Learnable,
            },
            resolved.indices_per_lookup,
            args.seed,
        )
    })?;
    let size = args.mini_batch_size;
    let test_batches: Vec<Batch> = if args.test_freq > 0 {
        (0..args.test_num_batches)
            .map(|i| mine(data.batch(TEST_BATCH_BASE + i, size)))
            .collect()
    } else {
        Vec::new()
    };
    let setup_s = setup.elapsed().as_secs_f64();

    let progress = Progress::new(args.num_batches, "dlrm", args.json).quiet(!launch.is_root());
    let fault = Fault::from_env(launch)?;
    progress.line(&format!(
        "ember bench dlrm: {} tables (dim {}), bottom {:?}, top {:?}, {:?}, batch {size}, {} threads, setup {setup_s:.1} s",
        config.tables.len(), config.embedding_dim(), config.bottom_mlp, config.top_mlp_sizes(),
        config.interaction, rayon::current_num_threads()));
    let mut step_s = Vec::new();
    let mut phases = PhaseTimes::default();
    let mut ids = 0u64;
    let (mut loss_first, mut loss_last) = (f32::NAN, f32::NAN);
    let mut window = (0.0f64, 0.0f64, 0u64);
    let mut last_metrics: Option<Metrics> = None;
    for i in 0..args.num_batches {
        // Every batch is new, made off the clock: cycling a few batches would
        // let the model memorise random labels and keep their rows in cache.
        let batch = mine(data.batch(i, size));
        fault.at_step(i);
        let out = stepper.step(&backend, &mut model, &batch)?;
        if !out.loss.is_finite() {
            bail!(
                "loss became {} at batch {i}: lower --learning-rate",
                out.loss
            );
        }
        let seconds = out.times.total().as_secs_f64();
        // Step 0 (allocations, first touches) is a warm-up unless it is the only one.
        if i > 0 || args.num_batches == 1 {
            step_s.push(seconds);
            ids += batch.sparse.values().len() as u64;
            add_times(&mut phases, &out.times);
        }
        if i == 0 {
            loss_first = out.loss;
        }
        loss_last = out.loss;
        window = (window.0 + seconds, window.1 + out.loss as f64, window.2 + 1);
        progress.inc();
        let done = i + 1;
        if done % args.print_freq.max(1) == 0 || done == args.num_batches {
            progress.line(&format!(
                "Finished training it {done}/{} of epoch 0, {:.2} ms/it, loss {:.6}",
                args.num_batches,
                window.0 * 1e3 / window.2 as f64,
                window.1 / window.2 as f64
            ));
            window = (0.0, 0.0, 0);
        }
        if args.test_freq > 0 && (done % args.test_freq == 0 || done == args.num_batches) {
            stepper.sync(&mut model)?;
            let m = evaluate(&mut model, backend.dense(), &test_batches)?;
            progress.line(&format!(
                "Testing at - {done}/{} of epoch 0, loss {:.6}, auc {:.4}, accuracy {:.3} %",
                args.num_batches,
                m.logloss,
                m.auc,
                m.accuracy * 100.0
            ));
            last_metrics = Some(m);
        }
    }
    progress.finish();
    if let Some(dir) = &args.save {
        stepper.sync(&mut model)?;
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        launch.patiently(|| {
            match model.world() {
                Some(_) => drop(save_set(&mut model, dir, None)?),
                None => save(&mut model, &dir.join("model.safetensors"), None)?,
            }
            Ok(())
        })?;
    }
    // On ranks: every rank's ids and sharding counters.
    let (ids, sharding_stats) = match (launch.ranks(), model.sparse_arch().sharded()) {
        (Some(r), Some(sh)) => {
            let (ids, stats) = over_ranks(&r.comm, ids, sh)?;
            (ids, Some(stats))
        }
        (_, sh) => (ids, sh.map(|sh| (sh.stats(), sh.device_bytes()))),
    };
    let timed = step_s.len().max(1) as f64;
    let total_s: f64 = step_s.iter().sum();
    let per_step_ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / timed;
    let compile = backend.compile_stats();
    Ok(DlrmReport {
        data_generation: args.data_generation,
        optimizer: args.optim.optimizer,
        backend: backend.name(),
        mode: args.mode.mode,
        compiles: compile.as_ref().map(|s| s.compiles),
        compile_ms: compile.as_ref().map(|s| s.compile_ms),
        compile_cache_hits: compile.as_ref().map(|s| s.compile_cache_hits),
        cache_load_ms: compile.as_ref().map(|s| s.cache_load_ms),
        threads: rayon::current_num_threads(),
        mini_batch_size: size,
        num_batches: args.num_batches,
        samples_per_s: if total_s > 0.0 {
            step_s.len() as f64 * size as f64 / total_s
        } else {
            f64::NAN
        },
        ids_per_s: if total_s > 0.0 {
            ids as f64 / total_s
        } else {
            f64::NAN
        },
        step_ms_median: median(&mut step_s) * 1e3,
        phase_ms: PhaseMs {
            sparse_forward: per_step_ms(phases.sparse_forward),
            dense_forward: per_step_ms(phases.dense_forward),
            dense_backward: per_step_ms(phases.dense_backward),
            dense_update: per_step_ms(phases.dense_update),
            sparse_backward_update: per_step_ms(phases.sparse_backward_update),
        },
        loss_first,
        loss_last,
        auc: last_metrics.map(|m| m.auc),
        logloss: last_metrics.map(|m| m.logloss),
        accuracy: last_metrics.map(|m| m.accuracy),
        // Of every rank's devices.
        table_bytes: (sharding_stats.as_ref())
            .map_or(model.sparse_arch().bytes(), |(_, b)| b.iter().sum())
            as u64,
        peak_rss_bytes: peak_rss_bytes(),
        setup_s,
        world_size: launch.world_size(),
        sharding: sharding_stats.map(|(st, device_bytes)| {
            let steps = st.steps.max(1) as f64;
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps;
            ShardingReport {
                devices: device_bytes.len(),
                shards: shards.clone().unwrap_or_default(),
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
            }
        }),
        architecture: resolved,
    })
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

fn add_times(sum: &mut PhaseTimes, t: &PhaseTimes) {
    sum.sparse_forward += t.sparse_forward;
    sum.dense_forward += t.dense_forward;
    sum.dense_backward += t.dense_backward;
    sum.dense_update += t.dense_update;
    sum.sparse_backward_update += t.sparse_backward_update;
}

impl std::fmt::Display for DlrmReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.phase_ms;
        writeln!(
            f,
            "{:.0} samples/s, {:.2} M ids/s, {:.2} ms/step (median), {} threads, {} backend",
            self.samples_per_s,
            self.ids_per_s / 1e6,
            self.step_ms_median,
            self.threads,
            self.backend
        )?;
        writeln!(f, "per step: sparse forward {:.2} ms, dense forward {:.2} ms, dense backward {:.2} ms, dense update {:.2} ms, sparse backward+update {:.2} ms",
            p.sparse_forward, p.dense_forward, p.dense_backward, p.dense_update, p.sparse_backward_update)?;
        writeln!(f, "loss {:.6} -> {:.6}", self.loss_first, self.loss_last)?;
        if let (Some(auc), Some(ll), Some(acc)) = (self.auc, self.logloss, self.accuracy) {
            writeln!(
                f,
                "test: auc {auc:.4}, logloss {ll:.6}, accuracy {:.3} %",
                acc * 100.0
            )?;
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
