//! `ember train`: DLRM training from Parquet, with evaluation, checkpoints
//! and exact resumption.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;

use ember_dataloader::Loader;
use ember_dense::DenseBackend;
use ember_models::checkpoint::{remove_set, save, save_set, INDEX_FILE};
use ember_models::{Batch, Checkpoint, Dlrm, Evaluation, Metrics, TrainState};

use super::arch::{ArchArgs, OptimArgs};
use super::backend::{BackendArgs, ModeArgs, Stepper};
use super::data::LoaderArgs;
use super::sharding::{planner_options, ShardingArgs};
use super::world::{place_model, Fault, Launch};
use super::Progress;

/// The checkpoint `--checkpoint-dir` holds and `--resume` reads.
pub const CHECKPOINT_FILE: &str = "model.safetensors";

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
    pub loader: LoaderArgs,
    /// Shard the tables (checkpoints stay in the unsharded layout, so a run
    /// can resume under another plan or device count).
    #[command(flatten)]
    pub sharding: ShardingArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    #[arg(long, default_value_t = 2048)]
    pub mini_batch_size: usize,
    #[arg(long, default_value_t = 1)]
    pub epochs: u64,
    /// Evaluate every this many training batches (0: at the end of each epoch).
    #[arg(long, default_value_t = 0)]
    pub eval_every: u64,
    /// Write `model.safetensors` here at the end of each epoch.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint every this many batches (0: at epoch ends only).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
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
    /// Seeds the model's initialisation and the shuffling.
    #[arg(long, default_value_t = 123)]
    pub seed: u64,
    /// Print the mean loss every this many batches.
    #[arg(long, default_value_t = 100)]
    pub print_freq: u64,
    #[arg(long)]
    pub threads: Option<usize>,
    /// JSON lines on stdout: one per log event, then the summary.
    #[arg(long)]
    pub json: bool,
}

/// One line of the training log.
#[derive(Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event {
    Train {
        epoch: u64,
        batch: u64,
        steps: u64,
        loss: f64,
        ms_per_step: f64,
    },
    Eval {
        epoch: u64,
        steps: u64,
        auc: f64,
        logloss: f64,
        accuracy: f64,
        rows: usize,
    },
    Checkpoint {
        path: PathBuf,
        steps: u64,
    },
}

#[derive(Debug, Serialize)]
pub struct TrainReport {
    pub event: &'static str,
    pub steps: u64,
    pub samples: u64,
    /// Training time, evaluation and checkpoints excluded (loader waits included).
    pub train_seconds: f64,
    pub samples_per_s: f64,
    /// Time the training loop waited for the loader.
    pub loader_wait_seconds: f64,
    pub loss_first: f64,
    pub loss_last: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval: Option<MetricsReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<PathBuf>,
    pub resumed_at_step: u64,
    /// Processes (MPI ranks) the run took; 1 unless under mpirun.
    pub world_size: usize,
    /// Under mpirun: the bytes each rank sent to the others during the run
    /// (ids, pooled rows, gradients and the dense all-reduce).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_rank_bytes_sent: Option<Vec<u64>>,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct MetricsReport {
    pub auc: f64,
    pub logloss: f64,
    pub accuracy: f64,
    pub rows: usize,
}

impl From<Metrics> for MetricsReport {
    fn from(m: Metrics) -> Self {
        Self {
            auc: m.auc,
            logloss: m.logloss,
            accuracy: m.accuracy,
            rows: m.count,
        }
    }
}

impl std::fmt::Display for MetricsReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "auc {:.4}, logloss {:.6}, accuracy {:.3} % ({} rows)",
            self.auc,
            self.logloss,
            self.accuracy * 100.0,
            self.rows
        )
    }
}

impl std::fmt::Display for TrainReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} steps, {} samples in {:.1} s: {:.0} samples/s (loader waits {:.2} s); loss {:.6} -> {:.6}",
            self.steps,
            self.samples,
            self.train_seconds,
            self.samples_per_s,
            self.loader_wait_seconds,
            self.loss_first,
            self.loss_last
        )?;
        if let Some(m) = &self.eval {
            write!(f, "\neval: {m}")?;
        }
        if let Some(p) = &self.checkpoint {
            write!(f, "\ncheckpoint: {}", p.display())?;
        }
        Ok(())
    }
}

/// Metrics of `model` over the first `batches` batches of `loader` (epoch 0,
/// in order). On a rank of a world, over every rank's (each rank passes its
/// loader and the same count).
pub fn evaluate(
    model: &mut Dlrm,
    be: &dyn DenseBackend<f32>,
    loader: &Loader,
    batches: u64,
) -> anyhow::Result<Metrics> {
    let mut eval = Evaluation::default();
    for batch in loader.epoch(0, 0).take(batches as usize) {
        eval.push(model, be, &Batch::from_loader(batch?)?)?;
    }
    Ok(eval.finish(model)?)
}

/// The checkpoint to resume from in `dir`: one file, or the set the ranks of
/// a world wrote; the newer when both are there (a crash between writing
/// one and removing the other). Rank 0 decides for every rank.
fn latest_checkpoint(dir: Option<&Path>, launch: &Launch) -> anyhow::Result<Option<PathBuf>> {
    let Some(dir) = dir else { return Ok(None) };
    let choose = || {
        let modified = |p: PathBuf| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p));
        [dir.join(INDEX_FILE), dir.join(CHECKPOINT_FILE)]
            .into_iter()
            .filter_map(modified)
            .max_by_key(|(t, _)| *t)
            .map(|(_, p)| p)
    };
    let Some(r) = launch.ranks() else {
        return Ok(choose());
    };
    let mine = match r.rank {
        0 => choose().map_or(Vec::new(), |p| {
            p.to_string_lossy().into_owned().into_bytes()
        }),
        _ => Vec::new(),
    };
    let chosen = String::from_utf8(r.comm.broadcast(0, mine)?)?;
    Ok((!chosen.is_empty()).then(|| PathBuf::from(chosen)))
}

/// The fewest and the most of `mine` over the ranks (the fewest: how many
/// batches every rank can run in lockstep).
fn fewest_and_most(launch: &Launch, mine: u64) -> anyhow::Result<(u64, u64)> {
    let Some(r) = launch.ranks() else {
        return Ok((mine, mine));
    };
    let all = r.comm.all_gather_u64(mine)?;
    let fewest = all.iter().copied().min().unwrap_or(0);
    Ok((fewest, all.iter().copied().max().unwrap_or(0)))
}

pub fn run(args: &TrainArgs, launch: &Launch) -> anyhow::Result<TrainReport> {
    args.optim.validate()?;
    anyhow::ensure!(
        args.mini_batch_size > 0,
        "--mini-batch-size must be at least 1"
    );
    anyhow::ensure!(
        !args.resume || args.checkpoint_dir.is_some(),
        "--resume needs --checkpoint-dir"
    );
    super::with_threads(args.threads, || run_in_pool(args, launch))?
}

fn run_in_pool(args: &TrainArgs, launch: &Launch) -> anyhow::Result<TrainReport> {
    let progress = Progress::new(0, "train", args.json).quiet(!launch.is_root());
    let log = |e: Event, text: String| {
        if !launch.is_root() {
            return;
        }
        if args.json {
            println!("{}", serde_json::to_string(&e).expect("events serialise"));
        } else {
            progress.line(&text);
        }
    };
    let checkpoint_path = args
        .checkpoint_dir
        .as_ref()
        .map(|d| d.join(CHECKPOINT_FILE));
    let existing = latest_checkpoint(args.checkpoint_dir.as_deref(), launch)?;
    let resume_from = match (&checkpoint_path, existing) {
        (Some(_), Some(p)) if args.resume => Some(Checkpoint::open(&p)?),
        (Some(p), _) if args.resume => {
            progress.line(&format!(
                "no checkpoint at {}: starting from scratch",
                p.display()
            ));
            None
        }
        _ => None,
    };
    let dataset = ember_dataloader::Dataset::open(&args.data)?;
    let data_fingerprint = dataset.fingerprint();
    let fresh = TrainState {
        batch_size: args.mini_batch_size as u64,
        shuffle_seed: (!args.no_shuffle).then_some(args.seed),
        drop_last: args.drop_last,
        dense_transform: Some(args.loader.dense_transform),
        id_transform: Some(args.loader.id_transform),
        data_fingerprint,
        ..TrainState::default()
    };
    // The run goes on with the architecture and optimizers it was trained with.
    let (config, table_optimizer, dense_optimizer) = match &resume_from {
        Some(ckpt) => (
            ckpt.config().clone(),
            (ckpt.table_optimizer()).unwrap_or(args.optim.table_optimizer()),
            (ckpt.dense_optimizer()).unwrap_or(args.optim.dense_optimizer()),
        ),
        None => (
            args.arch.resolve()?.0,
            args.optim.table_optimizer(),
            args.optim.dense_optimizer(),
        ),
    };
    let state = match &resume_from {
        Some(ckpt) => {
            let state = ckpt.train_state().cloned().unwrap_or(fresh);
            progress.line(&format!(
                "resuming from {} at epoch {}, batch {} (step {})",
                ckpt.path().display(),
                state.epoch,
                state.batches_in_epoch,
                state.steps
            ));
            state
        }
        None => fresh,
    };
    if state.data_fingerprint != 0 && state.data_fingerprint != data_fingerprint {
        anyhow::bail!(
            "--resume: the training data differs from the run the checkpoint continues (other files or row groups); resume on the same data"
        );
    }
    let options = planner_options(table_optimizer, args.mini_batch_size, 1.0);
    // A rank builds (or reads) only its own shards; ranks wait for the slowest.
    let mut model = launch.patiently(|| {
        let plan = args.sharding.plan_for(&config, &options, launch)?;
        let optimizers = (table_optimizer, dense_optimizer);
        let plan = plan.map(|(plan, _)| plan);
        place_model(
            launch,
            &config,
            optimizers,
            args.seed,
            plan,
            resume_from.as_ref(),
        )
    })?;
    let mut state = state;
    // A position mid-epoch counts batches of the ranks that wrote it, each
    // reading its own row groups: under another number of ranks it means
    // nothing, so the run goes on at the next epoch.
    let world_before = state.world_size.max(1) as usize;
    let skipped = world_before != launch.world_size() && state.batches_in_epoch > 0;
    if skipped {
        progress.line(&format!(
            "the checkpoint was written by {world_before} process(es) mid-epoch; under {} the rest of epoch {} is skipped",
            launch.world_size(),
            state.epoch
        ));
        state.epoch += 1;
        state.batches_in_epoch = 0;
    }
    state.world_size = launch.world_size() as u64;
    // The model holds the weights now: let go of the old file's mapping
    // before saves replace it.
    drop(resume_from);
    let resumed_at_step = state.steps;
    let features = config.feature_rows();
    // A resumed run reads the data as the run it continues did (older
    // checkpoints without a batch size take the flags').
    let batch_size = match state.batch_size {
        0 => args.mini_batch_size,
        b => b as usize,
    };
    // On ranks, the batch is global: each rank reads its own row groups in
    // batches of its share.
    let world = launch.world_size();
    anyhow::ensure!(
        batch_size % world == 0,
        "the batch of {batch_size} does not split evenly over {world} ranks"
    );
    let rank_batch = batch_size / world;
    let mut loader_config = args
        .loader
        .config(&features, config.num_dense(), rank_batch)?;
    loader_config.rank = launch.rank();
    loader_config.world_size = world;
    loader_config.shuffle_seed = state.shuffle_seed;
    loader_config.drop_last = state.drop_last;
    if let Some(t) = state.dense_transform {
        loader_config.dense_transform = t;
    }
    if let Some(t) = state.id_transform {
        loader_config.id_transform = t;
    }
    let train_loader = Loader::new(dataset, loader_config)?;
    let eval_loader = match args.eval_data.is_empty() {
        true => None,
        false => {
            let mut c = args
                .loader
                .config(&features, config.num_dense(), rank_batch)?;
            (c.rank, c.world_size) = (launch.rank(), world);
            Some(Loader::open(&args.eval_data, c)?)
        }
    };
    let backend_box = args.backend.build(args.mode.mode)?;
    let backend = backend_box.dense();
    let mut stepper = Stepper::new(args.mode.mode);
    // Ranks step in lockstep: an epoch is as many batches as the rank with
    // the fewest has (the others' extra batches are left out).
    let mut per_epoch = Vec::new();
    for e in 0..args.epochs {
        let mine = train_loader.batches_per_epoch(e);
        let (steps, _) = fewest_and_most(launch, mine)?;
        anyhow::ensure!(
            steps > 0,
            "epoch {e} has no batch{}: {} rows in batches of {batch_size}{}",
            if world > 1 { " for some rank" } else { "" },
            train_loader.dataset().num_rows(),
            if world > 1 {
                " over ranks that each read whole row groups (write smaller row groups, or run fewer ranks)"
            } else {
                ""
            }
        );
        if steps < mine && e == state.epoch {
            // On stderr from every rank: only rank 0 prints progress.
            eprintln!(
                "rank {}: {} of its {mine} batches per epoch are left out, to step with the rank that has the fewest",
                launch.rank(),
                mine - steps
            );
        }
        per_epoch.push(steps);
    }
    let eval_batches = match &eval_loader {
        Some(l) => {
            let (fewest, most) = fewest_and_most(launch, l.batches_per_epoch(0))?;
            anyhow::ensure!(
                fewest > 0 || most == 0,
                "the evaluation data has no batch for some rank (write smaller row groups, or run fewer ranks)"
            );
            fewest
        }
        None => 0,
    };
    let total: u64 = per_epoch.iter().skip(state.epoch as usize).sum();
    progress.set_total(total.saturating_sub(state.batches_in_epoch));
    progress.line(&format!(
        "ember train: {} rows in {} files, {} tables (dim {}), bottom {:?}, top {:?}, {:?}, batch {}, {} threads",
        train_loader.dataset().num_rows(),
        train_loader.dataset().files().len(),
        config.tables.len(),
        config.embedding_dim(),
        config.bottom_mlp,
        config.top_mlp_sizes(),
        config.interaction,
        batch_size,
        rayon::current_num_threads()
    ));

    let mut excluded = Duration::ZERO;
    let mut loader_wait = Duration::ZERO;
    let (mut loss_first, mut loss_last) = (f64::NAN, f64::NAN);
    let mut window = (0.0f64, 0.0f64, 0u64);
    let mut samples = 0u64;
    let mut last_eval = None;
    let mut saved = None;
    let started = Instant::now();
    let max_steps = args.max_steps.unwrap_or(u64::MAX);
    let mut checkpoint =
        |model: &mut Dlrm, state: &TrainState, excluded: &mut Duration| -> anyhow::Result<()> {
            if let Some(file) = &checkpoint_path {
                let t = Instant::now();
                let dir = file.parent().unwrap_or(Path::new("."));
                std::fs::create_dir_all(dir)?;
                // One file from one process; a set from the ranks of a world
                // (each writes its own shards). Either replaces the other.
                let path = launch.patiently(|| match model.world() {
                    None => {
                        save(model, file, Some(state))?;
                        remove_set(dir);
                        Ok(file.clone())
                    }
                    Some(_) => {
                        let index = save_set(model, dir, Some(state))?;
                        if launch.is_root() {
                            let _ = std::fs::remove_file(file);
                        }
                        Ok(index)
                    }
                })?;
                *excluded += t.elapsed();
                log(
                    Event::Checkpoint {
                        path: path.clone(),
                        steps: state.steps,
                    },
                    format!("checkpoint {} at step {}", path.display(), state.steps),
                );
                saved = Some(path.clone());
            }
            Ok(())
        };
    let mut run_eval =
        |model: &mut Dlrm, state: &TrainState, excluded: &mut Duration| -> anyhow::Result<()> {
            if let Some(loader) = &eval_loader {
                let t = Instant::now();
                let m = MetricsReport::from(evaluate(model, backend, loader, eval_batches)?);
                *excluded += t.elapsed();
                log(
                    Event::Eval {
                        epoch: state.epoch,
                        steps: state.steps,
                        auc: m.auc,
                        logloss: m.logloss,
                        accuracy: m.accuracy,
                        rows: m.rows,
                    },
                    format!(
                        "Testing at step {} of epoch {}: {m}",
                        state.steps, state.epoch
                    ),
                );
                last_eval = Some(m);
            }
            Ok(())
        };
    let fault = Fault::from_env(launch)?;
    'epochs: while state.epoch < args.epochs {
        let mut batches = train_loader.epoch(state.epoch, state.batches_in_epoch);
        loop {
            if state.steps >= max_steps {
                break 'epochs;
            }
            if state.batches_in_epoch >= per_epoch[state.epoch as usize] {
                break;
            }
            let t = Instant::now();
            let Some(batch) = batches.next() else { break };
            let batch = Batch::from_loader(batch?)?;
            loader_wait += t.elapsed();
            fault.at_step(state.steps);
            let out = stepper.step(&backend_box, &mut model, &batch)?;
            anyhow::ensure!(
                out.loss.is_finite(),
                "loss became {} at step {}: lower --learning-rate",
                out.loss,
                state.steps
            );
            state.steps += 1;
            state.batches_in_epoch += 1;
            samples += (batch.size() * world) as u64;
            progress.inc();
            let loss = out.loss as f64;
            if loss_first.is_nan() {
                loss_first = loss;
            }
            loss_last = loss;
            window = (
                window.0 + t.elapsed().as_secs_f64(),
                window.1 + loss,
                window.2 + 1,
            );
            if state.batches_in_epoch % args.print_freq.max(1) == 0 {
                let (ms, mean) = (window.0 * 1e3 / window.2 as f64, window.1 / window.2 as f64);
                log(
                    Event::Train {
                        epoch: state.epoch,
                        batch: state.batches_in_epoch,
                        steps: state.steps,
                        loss: mean,
                        ms_per_step: ms,
                    },
                    format!(
                        "Finished training it {} of epoch {}, {ms:.2} ms/it, loss {mean:.6}",
                        state.batches_in_epoch, state.epoch
                    ),
                );
                window = (0.0, 0.0, 0);
            }
            if args.eval_every > 0 && state.steps % args.eval_every == 0 {
                stepper.sync(&mut model)?;
                run_eval(&mut model, &state, &mut excluded)?;
            }
            if args.checkpoint_every > 0 && state.steps % args.checkpoint_every == 0 {
                stepper.sync(&mut model)?;
                checkpoint(&mut model, &state, &mut excluded)?;
            }
        }
        drop(batches);
        state.epoch += 1;
        state.batches_in_epoch = 0;
        if args.eval_every == 0 {
            stepper.sync(&mut model)?;
            run_eval(&mut model, &state, &mut excluded)?;
        }
        stepper.sync(&mut model)?;
        checkpoint(&mut model, &state, &mut excluded)?;
    }
    // Also after a skip to an epoch past the last: the new position is kept.
    let untrained_skip = skipped && state.steps == resumed_at_step;
    if (state.steps >= max_steps && state.epoch < args.epochs) || untrained_skip {
        stepper.sync(&mut model)?;
        checkpoint(&mut model, &state, &mut excluded)?;
    }
    progress.finish();
    let train_seconds = (started.elapsed().saturating_sub(excluded)).as_secs_f64();
    let per_rank_bytes_sent = match launch.ranks() {
        None => None,
        Some(r) => Some(r.comm.all_gather_u64(r.comm.bytes_sent())?),
    };
    Ok(TrainReport {
        event: "summary",
        steps: state.steps,
        samples,
        train_seconds,
        samples_per_s: samples as f64 / train_seconds.max(1e-9),
        loader_wait_seconds: loader_wait.as_secs_f64(),
        loss_first,
        loss_last,
        eval: last_eval,
        checkpoint: saved,
        resumed_at_step,
        world_size: launch.world_size(),
        per_rank_bytes_sent,
    })
}
