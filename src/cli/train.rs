//! `ember train`: DLRM training from Parquet, with evaluation, checkpoints
//! and exact resumption.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use ember_dataloader::vocabulary::VocabularyInfo;
use ember_dataloader::{Dataset, DatasetSpec, Loader};
use ember_dense::DenseOptimizerConfig;
use ember_models::{
    BatchShape, Checkpoint, Dlrm, DlrmConfig, FitOptions, Metrics, TrainData, TrainEvent,
    TrainState, TrainSummary, Trainer, TrainerConfig,
};

use super::arch::{ArchArgs, OptimArgs};
use super::backend::{BackendArgs, ModeArgs};
use super::data::LoaderArgs;
use super::place::place;
use super::plan::{planner_options, ShardingArgs};
use super::run_logs::RunLogs;
use super::world::{setup_timeout, Fault, Launch};
use super::Progress;
use ember_sparse::TableOptimizer;

use ember_models::checkpoint::CHECKPOINT_FILE;
use ember_models::mllog::RunFacts;

/// The table and dense optimizers.
type Optimizers = (TableOptimizer, DenseOptimizerConfig);

#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    /// Training data: Parquet files or directories.
    #[arg(long, required = true, num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Evaluation data, read in order.
    #[arg(long, num_args = 1..)]
    pub eval_data: Vec<PathBuf>,
    #[command(flatten)]
    pub arch: ArchArgs,
    #[command(flatten)]
    pub optim: OptimArgs,
    #[command(flatten)]
    pub optimization: super::optimization::OptimizationArgs,
    /// A sequence model instead of a DLRM (see `--model`).
    #[command(flatten)]
    pub sequence: super::train_sequence::SequenceArgs,
    #[command(flatten)]
    pub loader: LoaderArgs,
    /// Shard the tables (checkpoints stay in the unsharded layout, so a run
    /// can resume under another plan or device count).
    #[command(flatten)]
    pub sharding: ShardingArgs,
    /// Tables on the disk tier (sharded: those the plan cannot fit); checkpoints
    /// stream them, and --resume loads them back onto the disk tier.
    #[command(flatten)]
    pub tier: super::tier::TierArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Samples per step, over all ranks [default: 2048; sequence models: 128 users]
    #[arg(long)]
    pub mini_batch_size: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub epochs: u64,
    /// Evaluate every this many training batches (0: at the end of each epoch).
    #[arg(long, default_value_t = 0)]
    pub eval_every: u64,
    /// Also evaluate each time this percentage of an epoch's batches has
    /// run, on a fixed grid (DLRMv4: 0.1; MLPerf DLRMv2's reference: 5).
    #[arg(long)]
    pub eval_every_data_pct: Option<f64>,
    /// Stop at the first evaluation whose AUC reaches this, checkpointing
    /// there (dlrm_s_pytorch's and MLPerf's target: 0.80275 for DLRMv2).
    #[arg(long)]
    pub mlperf_auc_threshold: Option<f64>,
    #[command(flatten)]
    pub mlperf: super::run_logs::MlperfArgs,
    #[command(flatten)]
    pub tensorboard: super::run_logs::TensorBoardArgs,
    /// Write `model.safetensors` here at the end of each epoch.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint every this many batches (0: at epoch ends only).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Between full checkpoints, write up to this many delta checkpoints
    /// (only the rows training changed, the dense weights and the
    /// position; `ember checkpoint compact` folds a chain into one file).
    /// 0: every checkpoint is full.
    #[arg(long, default_value_t = 0)]
    pub delta_checkpoints: u64,
    /// Continue from the checkpoint in --checkpoint-dir (its architecture,
    /// optimizers and their state, at the batch where it stopped).
    #[arg(long)]
    pub resume: bool,
    /// Stop after this many steps in all, checkpointing there.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Read row groups in file order instead of shuffling them per epoch.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Drop each epoch's last, short batch.
    #[arg(long)]
    pub drop_last: bool,
    /// Seeds the model's initialisation and the shuffling [default: 123]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print the mean loss every this many batches.
    #[arg(long, default_value_t = 100)]
    pub print_freq: u64,
    #[arg(long)]
    pub threads: Option<usize>,
    /// JSON lines on stdout: one per log event, then the summary.
    #[arg(long)]
    pub json: bool,
    /// Train on a stream: the --data inputs (or one directory's files), in
    /// natural name order (day_2 before day_10), are windows, each
    /// evaluated by the model trained on the ones before it, then trained
    /// on once (AUC and log loss per window; --resume goes on mid-stream).
    #[arg(long, conflicts_with_all = ["eval_data", "eval_every"])]
    pub stream_window: bool,
}

#[derive(Debug, Serialize)]
pub struct TrainReport {
    pub event: &'static str,
    pub steps: u64,
    pub samples: u64,
    /// Training time, evaluation and checkpoints excluded (loader waits included).
    pub train_seconds: f64,
    pub samples_per_s: f64,
    /// Time the steps waited for the loader (through the pipeline).
    pub loader_wait_seconds: f64,
    /// Time of the sharded input dists run ahead on the pipeline thread.
    pub input_dist_seconds: f64,
    /// Time of the steps themselves.
    pub compute_seconds: f64,
    pub loss_first: f64,
    pub loss_last: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval: Option<MetricsReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<PathBuf>,
    pub resumed_at_step: u64,
    /// The step an evaluation reached --mlperf-auc-threshold at, stopping the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_reached_at_step: Option<u64>,
    /// With --disk-dir: the caches' hit rate over this run and the file
    /// bytes moved per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_tier: Option<super::tier::TierReport>,
    /// With key-value tables: each one's figures (ids seen, admitted,
    /// rejected, evicted, fallback reads, occupancy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_value_tables: Option<Vec<super::kv::KvTableReport>>,
    /// Processes (MPI ranks) the run took; 1 unless under mpirun.
    pub world_size: usize,
    /// Under mpirun: the bytes each rank sent to the others during the run
    /// (ids, pooled rows, gradients and the dense all-reduce).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_rank_bytes_sent: Option<Vec<u64>>,
}

/// An evaluation's metrics as the reports print them; in JSON, [`Metrics`]'s
/// own fields (`rows` for the count).
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(transparent)]
pub struct MetricsReport(pub Metrics);

impl From<Metrics> for MetricsReport {
    fn from(m: Metrics) -> Self {
        Self(m)
    }
}

impl std::fmt::Display for MetricsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "auc {:.4}, logloss {:.6}, accuracy {:.3} %, ne {:.4}, calibration {:.4} ({} rows)",
            self.0.auc,
            self.0.logloss,
            self.0.accuracy * 100.0,
            self.0.ne,
            self.0.calibration,
            self.0.count
        )
    }
}

impl std::fmt::Display for TrainReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} steps, {} samples in {:.1} s: {:.0} samples/s (steps {:.2} s, loader waits {:.2} s, input dist ahead {:.2} s); loss {:.6} -> {:.6}",
            self.steps,
            self.samples,
            self.train_seconds,
            self.samples_per_s,
            self.compute_seconds,
            self.loader_wait_seconds,
            self.input_dist_seconds,
            self.loss_first,
            self.loss_last
        )?;
        if let Some(m) = &self.eval {
            write!(f, "\neval: {m}")?;
        }
        if let Some(p) = &self.checkpoint {
            write!(f, "\ncheckpoint: {}", p.display())?;
        }
        if let Some(d) = &self.disk_tier {
            write!(f, "\n{d}")?;
        }
        if let Some(t) = &self.key_value_tables {
            write!(f, "\n{}", super::kv::kv_summary(t))?;
        }
        Ok(())
    }
}

pub fn run(args: &TrainArgs, launch: &Launch) -> anyhow::Result<TrainReport> {
    let sequence_flags = args.sequence.given();
    anyhow::ensure!(
        sequence_flags.is_empty(),
        "{} are flags of sequence models: add --model sasrec|hstu-retrieval|hstu-ranking",
        sequence_flags.join(", ")
    );
    args.optim.validate()?;
    anyhow::ensure!(args.batch() > 0, "--mini-batch-size must be at least 1");
    anyhow::ensure!(
        !args.resume || args.checkpoint_dir.is_some(),
        "--resume needs --checkpoint-dir"
    );
    if args.stream_window {
        anyhow::ensure!(
            args.epochs == 1,
            "--stream-window trains each window once: leave out --epochs"
        );
        anyhow::ensure!(
            launch.world_size() == 1,
            "--stream-window runs in one process (not under mpirun) for now"
        );
    }
    super::with_threads(args.threads, || run_in_pool(args, launch))?
}

impl TrainArgs {
    /// --mini-batch-size, or its default.
    fn batch(&self) -> usize {
        self.mini_batch_size.unwrap_or(2048)
    }

    /// --seed, or its default.
    fn seed(&self) -> u64 {
        self.seed.unwrap_or(123)
    }

    /// The flags given that a resume from `ckpt` at `state` overrides with
    /// the checkpoint's values, each with the value kept.
    fn overridden_by(&self, ckpt: &Checkpoint, state: &TrainState) -> Vec<String> {
        let mut overridden = Vec::new();
        if let Some(saved) = ckpt.table_optimizer() {
            let kept = format!("{saved:?}");
            overridden.extend(
                self.optim
                    .given()
                    .into_iter()
                    .map(|f| format!("{f} (kept: {kept})")),
            );
        }
        if let Some(b) = self
            .mini_batch_size
            .filter(|&b| b as u64 != state.batch_size)
        {
            overridden.push(format!(
                "--mini-batch-size {b} (kept: {})",
                state.batch_size
            ));
        }
        let shuffle =
            |s: Option<u64>| s.map_or("no shuffle".into(), |s| format!("shuffle seed {s}"));
        if self.seed.is_some() || self.no_shuffle {
            let wanted = (!self.no_shuffle).then_some(self.seed());
            if wanted != state.shuffle_seed {
                let flag = match self.no_shuffle {
                    true => "--no-shuffle".to_string(),
                    false => format!("--seed {}", self.seed()),
                };
                overridden.push(format!("{flag} (kept: {})", shuffle(state.shuffle_seed)));
            }
        }
        if self.drop_last && !state.drop_last {
            overridden.push("--drop-last (kept: the last, short batch)".into());
        }
        overridden
    }

    /// Flags given that do nothing in this combination, as warnings.
    fn idle_flags(&self) -> Vec<&'static str> {
        let mut idle = Vec::new();
        if self.checkpoint_every > 0 && self.checkpoint_dir.is_none() {
            idle.push("--checkpoint-every does nothing without --checkpoint-dir");
        }
        if self.delta_checkpoints > 0 && self.checkpoint_dir.is_none() {
            idle.push("--delta-checkpoints does nothing without --checkpoint-dir");
        }
        if self.eval_every > 0 && self.eval_data.is_empty() {
            idle.push("--eval-every does nothing without --eval-data");
        }
        if self.eval_every_data_pct.is_some() && self.eval_data.is_empty() {
            idle.push("--eval-every-data-pct does nothing without --eval-data");
        }
        if self.mlperf_auc_threshold.is_some() && self.eval_data.is_empty() {
            idle.push("--mlperf-auc-threshold does nothing without --eval-data");
        }
        idle
    }

    /// What the library's trainer is to do.
    /// Refuses an evaluation grid or an AUC target out of range (NaN too).
    pub fn check_eval_flags(&self) -> anyhow::Result<()> {
        if let Some(p) = self
            .eval_every_data_pct
            .filter(|p| !(*p > 0.0 && *p <= 100.0))
        {
            anyhow::bail!("--eval-every-data-pct {p}: a percentage of the epoch in (0, 100]");
        }
        if let Some(t) = self
            .mlperf_auc_threshold
            .filter(|t| !(*t > 0.0 && *t <= 1.0))
        {
            anyhow::bail!("--mlperf-auc-threshold {t}: an AUC in (0, 1]");
        }
        Ok(())
    }

    fn trainer_config(&self) -> anyhow::Result<TrainerConfig> {
        self.check_eval_flags()?;
        Ok(TrainerConfig {
            epochs: self.epochs,
            max_steps: self.max_steps,
            mode: self.mode.mode,
            eval_every: self.eval_every,
            eval_at_epoch_end: self.eval_every == 0,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            delta_checkpoints: self.delta_checkpoints,
            log_every: self.print_freq,
            setup_timeout: setup_timeout()?,
            pipeline: !self.mode.no_pipeline,
            optimization: self.optimization.optimization()?,
            eval_every_fraction: self.eval_every_data_pct.map(|p| p / 100.0),
            stop_at_auc: self.mlperf_auc_threshold,
        })
    }

    /// The position of a fresh run: how its batches are made.
    fn fresh_state(&self, dataset: &Dataset, spec: &DatasetSpec) -> TrainState {
        TrainState {
            batch_size: self.batch() as u64,
            shuffle_seed: (!self.no_shuffle).then_some(self.seed()),
            drop_last: self.drop_last,
            dense_transform: Some(spec.dense_transform),
            id_transform: Some(spec.id_transform),
            data_fingerprint: dataset.fingerprint(),
            ..TrainState::default()
        }
    }

    /// The global batch size of the run `state` continues (older
    /// checkpoints without one take the flag's).
    fn batch_size(&self, state: &TrainState) -> usize {
        match state.batch_size {
            0 => self.batch(),
            b => b as usize,
        }
    }

    /// The training and evaluation loaders of this rank, reading the data
    /// as the run that `state` continues did.
    pub(super) fn loaders(
        &self,
        launch: &Launch,
        spec: &DatasetSpec,
        dataset: Dataset,
        state: &TrainState,
    ) -> anyhow::Result<(Loader, Option<Loader>)> {
        let batch_size = self.batch_size(state);
        // On ranks, the batch is global: each rank reads its own row groups
        // in batches of its share.
        let world = launch.world_size();
        anyhow::ensure!(
            batch_size.is_multiple_of(world),
            "the batch of {batch_size} does not split evenly over {world} ranks"
        );
        let rank_batch = batch_size / world;
        let config_for = |c: &mut ember_dataloader::LoaderConfig| {
            (c.rank, c.world_size) = (launch.rank(), world);
        };
        let mut spec = spec.clone();
        if let Some(t) = state.dense_transform {
            spec.dense_transform = t;
        }
        if let Some(t) = state.id_transform {
            spec.id_transform = t;
        }
        let mut train = self.loader.config(spec.clone(), rank_batch);
        config_for(&mut train);
        train.shuffle_seed = state.shuffle_seed;
        train.drop_last = state.drop_last;
        let eval = match self.eval_data.is_empty() {
            true => None,
            false => {
                let mut c = self.loader.config(spec, rank_batch);
                config_for(&mut c);
                let eval = Loader::open(&self.eval_data, c)?;
                super::data::has_rows(&eval, "--eval-data", &self.eval_data)?;
                Some(eval)
            }
        };
        Ok((Loader::new(dataset, train)?, eval))
    }
}

/// The checkpoint `--resume` continues from, if any.
fn resume_from(
    args: &TrainArgs,
    launch: &Launch,
    progress: &Progress,
) -> anyhow::Result<Option<Checkpoint>> {
    let Some(dir) = args.checkpoint_dir.as_deref().filter(|_| args.resume) else {
        return Ok(None);
    };
    let ckpt = ember_models::checkpoint::resume(dir, launch.world())?;
    if ckpt.is_none() {
        progress.line(&format!(
            "no checkpoint at {}: starting from scratch",
            dir.join(CHECKPOINT_FILE).display()
        ));
    }
    Ok(ckpt)
}

fn run_in_pool(args: &TrainArgs, launch: &Launch) -> anyhow::Result<TrainReport> {
    let progress = Progress::new(0, "train", args.json).quiet(!launch.is_root());
    for warning in args.idle_flags() {
        progress.line(&format!("warning: {warning}"));
    }
    let mut resume = resume_from(args, launch, &progress)?;
    if resume.is_some() {
        let ignored = args.arch.given_architecture_flags();
        if !ignored.is_empty() {
            progress.line(&format!(
                "warning: {} ignored: the run resumes with the checkpoint's architecture",
                ignored.join(", ")
            ));
        }
    }
    let dataset = Dataset::open(&args.data)?;
    let (config, spec, optimizers, state) = resolve(args, &mut resume, &dataset, &progress)?;
    let trainer_config = args.trainer_config()?;
    let optimization = &trainer_config.optimization;
    super::optimization::check_for(optimization, &optimizers.0, args.mode.mode)?;
    let placed = (&config, optimizers, &state);
    let mut model = build_model(args, launch, &progress, placed, resume.as_ref())?;
    // The model holds the weights now: let go of the old file's mapping
    // before saves replace it.
    drop(resume);
    let mut logs = match launch.is_root() {
        true => run_logs((args, launch), &dataset, (optimizers, &state))?,
        false => RunLogs::default(),
    };
    let (train, eval) = args.loaders(launch, &spec, dataset, &state)?;
    let trainer = Trainer::new(trainer_config, args.backend.build(args.mode.mode)?);
    progress.line(&format!(
        "ember train: {} rows in {} files, {} tables (dim {}), bottom {:?}, top {:?}, {:?}, batch {}, {} threads",
        train.dataset().num_rows(),
        train.dataset().files().len(),
        config.tables.len(),
        config.embedding_dim(),
        config.bottom_mlp,
        config.top_mlp_sizes(),
        config.interaction,
        args.batch_size(&state),
        rayon::current_num_threads()
    ));
    let fault = Fault::from_env(launch)?;
    let eval = eval.as_ref().map(|l| l as &dyn TrainData);
    let mut on_event = |e: &TrainEvent| {
        report_event(args, launch, &progress, &fault, e);
        logs.on_event(e);
    };
    let summary = match args.stream_window {
        true => {
            let files = super::train_stream::windows(&args.data, train.dataset());
            let mut on_window = |w: &super::train_stream::WindowReport| match args.json {
                true => println!("{}", serde_json::to_string(w).expect("plain data")),
                false => progress.line(&w.to_string()),
            };
            let run = (&files[..], &spec, state, &trainer);
            super::train_stream::fit_stream(
                args,
                launch,
                run,
                &mut model,
                &mut on_event,
                &mut on_window,
            )
        }
        false => trainer
            .fit(
                &mut model,
                &train,
                FitOptions {
                    eval,
                    from: state,
                    on_event: Some(&mut on_event),
                },
            )
            .map_err(anyhow::Error::from),
    };
    // The logs end either way (the MLPerf log's status says how); the
    // run's own error first.
    let finished = logs.finish(&progress);
    let summary = summary?;
    finished?;
    progress.finish();
    let per_rank_bytes_sent = match launch.ranks() {
        None => None,
        Some(r) => Some(r.comm.all_gather_u64(r.comm.bytes_sent())?),
    };
    let steps = summary.steps.saturating_sub(summary.resumed_at_step) as f64;
    let disk_tier = super::tier::TierReport::of(&model, steps);
    Ok(TrainReport {
        disk_tier,
        key_value_tables: super::kv::kv_report(&model)?,
        ..TrainReport::new(summary, launch.world_size(), per_rank_bytes_sent)
    })
}

/// The logs asked for, started: the MLPerf log (the submission and the
/// run's hyperparameters) and TensorBoard's.
fn run_logs(
    (args, launch): (&TrainArgs, &Launch),
    dataset: &Dataset,
    (optimizers, state): (Optimizers, &TrainState),
) -> anyhow::Result<RunLogs> {
    let optimization = args.optimization.optimization()?;
    if args.mlperf.mlperf_logging.is_some()
        && optimization.sparse_schedule != optimization.dense_schedule
    {
        anyhow::bail!(
            "--mlperf-logging: the log names one learning-rate schedule; give the tables and \
             the dense layers the same (--sparse-lr-schedule and --dense-lr-schedule differ)"
        );
    }
    let rates = (
        (optimizers.0.learning_rate(), optimizers.1.learning_rate()),
        optimization,
    );
    let Some(path) = &args.mlperf.mlperf_logging else {
        return RunLogs::start(None, &args.tensorboard, rates);
    };
    let eval_samples = match args.eval_data.is_empty() {
        true => 0,
        false => Dataset::open(&args.eval_data)?.num_rows(),
    };
    let facts = RunFacts {
        global_batch_size: args.batch_size(state) as u64,
        train_samples: dataset.num_rows(),
        eval_samples,
        ranks: launch.world_size() as u64,
        seed: args.seed(),
        table_optimizer: optimizers.0,
        dense_optimizer: optimizers.1,
        optimization,
        dlrmv4: None,
    };
    let mlperf = (path.as_path(), args.mlperf.submission("dlrm_dcnv2"), facts);
    RunLogs::start(Some(mlperf), &args.tensorboard, rates)
}

/// What the run trains and from where: the checkpoint's architecture,
/// optimizers, data spec and position when it resumes (its tables cast
/// by `--table-dtype`), or the flags' for a fresh run.
fn resolve(
    args: &TrainArgs,
    resume: &mut Option<Checkpoint>,
    dataset: &Dataset,
    progress: &Progress,
) -> anyhow::Result<(DlrmConfig, DatasetSpec, Optimizers, TrainState)> {
    // The run goes on with the architecture and optimizers it was trained
    // with; `--table-dtype` casts the saved tables, and says so.
    if let (Some(ckpt), Some(dtype)) = (resume.as_mut(), args.arch.table_dtype) {
        super::arch::trainable(dtype)?;
        let cast = ckpt.cast_tables(dtype);
        if let Some((_, saved)) = cast.first() {
            progress.line(&format!(
                "--table-dtype {dtype}: {} of {} saved tables are {saved}, cast to {dtype} as they load",
                cast.len(),
                ckpt.config().tables.len()
            ));
        }
    }
    Ok(match &*resume {
        Some(ckpt) => {
            let config = ckpt.config().clone();
            let spec = args.loader.spec_for_checkpoint(ckpt)?;
            anyhow::Context::context(ckpt.check_trainable(), "--resume")?;
            let state = ckpt
                .train_state()
                .cloned()
                .unwrap_or(args.fresh_state(dataset, &spec));
            let overridden = args.overridden_by(ckpt, &state);
            if !overridden.is_empty() {
                progress.line(&format!(
                    "warning: {} ignored: the run resumes as the checkpoint's run was made",
                    overridden.join(", ")
                ));
            }
            progress.line(&format!(
                "resuming from {} at epoch {}, batch {} (step {})",
                ckpt.last_file().display(),
                state.epoch,
                state.batches_in_epoch,
                state.steps
            ));
            let optimizers = (
                ckpt.table_optimizer()
                    .unwrap_or(args.optim.table_optimizer()),
                ckpt.dense_optimizer()
                    .unwrap_or(args.optim.dense_optimizer()),
            );
            (config, spec, optimizers, state)
        }
        None => {
            let optimizers = (args.optim.table_optimizer(), args.optim.dense_optimizer());
            let arch = with_vocabulary(args, progress)?;
            let spec = args.loader.spec(&|| arch.table_shape())?;
            let config = arch.resolve_for(spec.as_ref())?.0;
            let mut spec = spec.unwrap_or_else(|| args.loader.criteo(&config.tables));
            super::data::with_model_kv(&mut spec, &config.tables);
            let state = args.fresh_state(dataset, &spec);
            (config, spec, optimizers, state)
        }
    })
}

/// The architecture flags, with the table rows of the data's vocabulary
/// when it was ingested with one (`ingest criteo --vocabulary-threshold`).
fn with_vocabulary(args: &TrainArgs, progress: &Progress) -> anyhow::Result<ArchArgs> {
    let mut arch = args.arch.clone();
    let data: Vec<_> = args.data.iter().chain(&args.eval_data).cloned().collect();
    if let Some(v) = VocabularyInfo::of_data(&data)? {
        let rows: Vec<usize> = (v.num_embeddings_per_feature.iter())
            .map(|&r| r as usize)
            .collect();
        if arch.arch_embedding_size.is_none() {
            progress.line(&format!(
                "tables of the data's vocabulary (frequency threshold {}): {} rows in all",
                v.frequency_threshold,
                rows.iter().sum::<usize>()
            ));
        }
        arch.data_rows = Some(rows);
    }
    Ok(arch)
}

/// The model as planned and placed: tables sharded by `--devices` (or
/// the ranks), on the disk tier by `--disk-dir` (whose directory it
/// holds), within memory; built (or read from the checkpoint) by every
/// rank for its own shards.
fn build_model(
    args: &TrainArgs,
    launch: &Launch,
    progress: &Progress,
    (config, optimizers, state): (&DlrmConfig, Optimizers, &TrainState),
    resume: Option<&Checkpoint>,
) -> anyhow::Result<Dlrm> {
    let builder = Dlrm::builder(config.clone())
        .optimizers(optimizers.0, optimizers.1)
        .seed(args.seed())
        .checkpoint(resume);
    // Each rank steps its share of the global batch, one id per bag (of
    // ids about as skewed as Criteo's: Zipf 1).
    let shape = BatchShape {
        batch_size: args.batch_size(state) / launch.world_size().max(1),
        // The finished batches queued and the step's (the decoding queues
        // of row groups are the loader's own estimate).
        in_flight: args.loader.prefetch.saturating_add(1),
        ..BatchShape::default()
    };
    let placed = place(
        (&args.tier, &args.sharding),
        launch,
        (config, planner_options(optimizers.0, args.batch(), 1.0)),
        (shape, 1.0),
        (builder, &mut |line| progress.line(&line)),
    )?;
    Ok(placed.model)
}

/// Prints one event of the run: a progress line (rank 0), a JSON line with
/// `--json`; and injects the test fault before the step it names.
fn report_event(
    args: &TrainArgs,
    launch: &Launch,
    progress: &Progress,
    fault: &Fault,
    e: &TrainEvent,
) {
    // The library's events are the JSON lines (`--json`).
    let log = |text: String| {
        if !launch.is_root() {
            return;
        }
        match args.json {
            true => println!("{}", serde_json::to_string(e).expect("events serialise")),
            false => progress.line(&text),
        }
    };
    match e {
        TrainEvent::Start { steps, .. } => progress.set_total(*steps),
        TrainEvent::EpochRestSkipped { epoch, written_by } => progress.line(&format!(
            "the checkpoint was written by {written_by} process(es) mid-epoch; under {} the rest of epoch {epoch} is skipped",
            launch.world_size()
        )),
        // On stderr from every rank: only rank 0 prints progress.
        TrainEvent::BatchesLeftOut { left_out, of } => eprintln!(
            "rank {}: {left_out} of its {of} batches per epoch are left out, to step with the rank that has the fewest",
            launch.rank()
        ),
        TrainEvent::BeforeStep { steps } => fault.at_step(*steps),
        TrainEvent::Step { .. } => progress.inc(),
        TrainEvent::Log { epoch, batch, steps: _, loss, ms_per_step } => log(format!(
            "Finished training it {batch} of epoch {epoch}, {ms_per_step:.2} ms/it, loss {loss:.6}"
        )),
        &TrainEvent::Eval { epoch, steps, metrics } => log(format!(
            "Testing at step {steps} of epoch {epoch}: {}",
            MetricsReport::from(metrics)
        )),
        TrainEvent::Checkpoint { path, steps } => {
            log(format!("checkpoint {} at step {steps}", path.display()))
        }
        TrainEvent::EvalStart { .. } => {}
        TrainEvent::TargetReached { steps, auc, target } => log(format!(
            "AUC {auc:.6} at step {steps} reached the target {target}: training stops"
        )),
    }
}

impl TrainReport {
    fn new(s: TrainSummary, world_size: usize, per_rank_bytes_sent: Option<Vec<u64>>) -> Self {
        Self {
            event: "summary",
            steps: s.steps,
            samples: s.samples,
            train_seconds: s.train_seconds,
            samples_per_s: s.samples as f64 / s.train_seconds.max(1e-9),
            loader_wait_seconds: s.data_wait_seconds,
            input_dist_seconds: s.input_dist_seconds,
            compute_seconds: s.compute_seconds,
            loss_first: s.loss_first,
            loss_last: s.loss_last,
            eval: s.eval.map(MetricsReport::from),
            checkpoint: s.checkpoint,
            resumed_at_step: s.resumed_at_step,
            target_reached_at_step: s.target_reached_at,
            disk_tier: None,
            key_value_tables: None,
            world_size,
            per_rank_bytes_sent,
        }
    }
}
