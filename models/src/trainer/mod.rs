//! The training loop as library code: epochs and step limits, evaluation
//! and checkpoint cadence, resumption at an exact batch, the execution
//! mode, and the ranks of a world moving in lockstep. It serves any
//! [`Model`] and any [`TrainData`], and reports progress as
//! [`TrainEvent`]s to a callback; it never prints.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_dataloader::lock::DirLock;
use ember_sharding::collective::{patiently, SETUP_TIMEOUT};
use ember_sharding::Collective;

mod data;
mod events;

pub use data::{InMemory, SyntheticBatches, TrainData};
pub use events::{TrainError, TrainEvent, TrainSummary};

use crate::{
    evaluate_data, Backend, Batch, ExecMode, InputDist, Metrics, Model, ModelError, Optimization,
    Routed, TrainState,
};

/// What a [`Trainer`] does.
#[derive(Clone, Debug)]
pub struct TrainerConfig {
    /// Epochs in all (a resumed run counts the ones already done).
    pub epochs: u64,
    /// Stop after this many steps in all, checkpointing there.
    pub max_steps: Option<u64>,
    /// How the dense step runs.
    pub mode: ExecMode,
    /// Evaluate every this many steps (0: not mid-epoch).
    pub eval_every: u64,
    /// Also evaluate at the end of each epoch (unless that step just was).
    pub eval_at_epoch_end: bool,
    /// Where checkpoints go (none: no checkpoints).
    pub checkpoint_dir: Option<PathBuf>,
    /// Also checkpoint every this many steps (0: at epoch ends only).
    pub checkpoint_every: u64,
    /// Between full checkpoints, write up to this many delta checkpoints
    /// (only what training changed: [`Model::save_checkpoint_delta`]);
    /// 0: every checkpoint is full. Where the model writes no delta (the
    /// run's first checkpoint, a world), the checkpoint is full.
    pub delta_checkpoints: u64,
    /// A [`TrainEvent::Log`] every this many batches of an epoch.
    pub log_every: u64,
    /// How long ranks wait for each other in checkpoints.
    pub setup_timeout: Duration,
    /// Learning-rate schedules, weight decay and clipping, set on the model
    /// before every step ([`Model::set_optimization`]) and recorded in the
    /// checkpoints' position: a resumed run must give the same.
    pub optimization: Optimization,
    /// Also evaluate each time this fraction of an epoch's batches has
    /// run, on a fixed grid (batch `b` of an epoch of `n` evaluates when
    /// `floor(b / (f n))` grows; DLRMv4 evaluates every 0.1% of its
    /// samples, DLRMv2's reference every 5% of an epoch). `None`: not.
    pub eval_every_fraction: Option<f64>,
    /// Stop at the first evaluation whose AUC reaches this
    /// (`--mlperf-auc-threshold`), checkpointing there.
    pub stop_at_auc: Option<f64>,
    /// Take batches, and run the model's [`input_dist`](Model::input_dist),
    /// on a pipeline thread one batch ahead of the step (TorchRec's
    /// TrainPipelineSparseDist). `false`: everything in turn on the calling
    /// thread. The same bits either way.
    pub pipeline: bool,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            epochs: 1,
            max_steps: None,
            mode: ExecMode::Strict,
            eval_every: 0,
            eval_at_epoch_end: true,
            checkpoint_dir: None,
            checkpoint_every: 0,
            delta_checkpoints: 0,
            log_every: 100,
            setup_timeout: SETUP_TIMEOUT,
            pipeline: true,
            optimization: Optimization::default(),
            eval_every_fraction: None,
            stop_at_auc: None,
        }
    }
}

/// What [`Trainer::fit`] takes beside the model and its data; the default
/// is a fresh run, no evaluation, no listener.
///
/// ```
/// # use ember_models::{Dlrm, FitOptions, TrainData, TrainError, TrainEvent, Trainer};
/// # fn run(trainer: &Trainer, model: &mut Dlrm, train: &dyn TrainData, test: &dyn TrainData) -> Result<(), TrainError> {
/// let mut losses = Vec::new();
/// let mut listener = |e: &TrainEvent| {
///     if let TrainEvent::Step { loss, .. } = e {
///         losses.push(*loss)
///     }
/// };
/// let options = FitOptions {
///     eval: Some(test),
///     from: trainer.resume(model)?, // the checkpoint directory's latest, or a fresh start
///     on_event: Some(&mut listener),
/// };
/// trainer.fit(model, train, options)?;
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct FitOptions<'a> {
    /// Evaluated on the first batches of its epoch 0 as configured
    /// (`None`: no evaluation).
    pub eval: Option<&'a dyn TrainData>,
    /// The position to start from: fresh (the default), or a checkpoint's
    /// ([`Trainer::resume`]).
    pub from: TrainState,
    /// Hears of every step, log, evaluation and checkpoint.
    pub on_event: Option<&'a mut dyn FnMut(&TrainEvent)>,
}

/// Trains a [`Model`] on a [`Backend`] as its [`TrainerConfig`] says.
///
/// ```
/// use ember_models::{Backend, DataGeneration, Dlrm, DlrmConfig, InteractionType, SyntheticConfig,
///     SyntheticData, SyntheticBatches, Trainer, TrainerConfig, TrainEvent, FitOptions};
/// use ember_sparse::TableOptimizer;
/// use ember_dense::DenseOptimizerConfig;
///
/// let config = DlrmConfig {
///     tables: DlrmConfig::criteo_tables(&[100, 200], 8),
///     bottom_mlp: vec![4, 8],
///     top_mlp: vec![8, 1],
///     interaction: InteractionType::Dot,
/// };
/// let mut model = Dlrm::builder(config.clone())
///     .optimizers(TableOptimizer::rowwise_adagrad(0.05), DenseOptimizerConfig::sgd(0.1))
///     .seed(7)
///     .build()?;
/// let data = SyntheticData::new(SyntheticConfig::for_model(&config, DataGeneration::Learnable, 3, 7))?;
/// let batches = SyntheticBatches { data, first: 0, batches: 20, size: 64, rank: 0, world_size: 1 };
/// let trainer = Trainer::new(TrainerConfig::default(), Backend::native());
/// let mut losses = Vec::new();
/// let mut on_event = |e: &TrainEvent| {
///     if let TrainEvent::Step { loss, .. } = e { losses.push(*loss) }
/// };
/// let options = FitOptions { on_event: Some(&mut on_event), ..FitOptions::default() };
/// let summary = trainer.fit(&mut model, &batches, options)?;
/// assert_eq!((summary.steps, losses.len()), (20, 20));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Trainer {
    config: TrainerConfig,
    backend: Backend,
}

/// A batch ready for its step: taken, and its input dist run if the model
/// has one.
struct Ready {
    batch: Batch,
    routed: Option<Routed>,
    input_dist: Duration,
}

impl Ready {
    fn of(batch: Batch, dist: Option<&dyn InputDist>) -> Result<Self, ModelError> {
        let Some(dist) = dist else {
            return Ok(Self {
                batch,
                routed: None,
                input_dist: Duration::ZERO,
            });
        };
        let t = Instant::now();
        let routed = Some(dist.run(&batch)?);
        Ok(Self {
            batch,
            routed,
            input_dist: t.elapsed(),
        })
    }
}

/// What the steps of an epoch change and report to.
struct EpochRun<'a, M: ?Sized> {
    model: &'a mut M,
    run: &'a mut Run,
    world: Option<&'a Arc<dyn Collective>>,
    world_size: usize,
    eval: Option<(&'a dyn TrainData, u64)>,
    on_event: &'a mut dyn FnMut(&TrainEvent),
}

/// A run's counters while it goes.
struct Run {
    state: TrainState,
    excluded: Duration,
    data_wait: Duration,
    input_dist: Duration,
    compute: Duration,
    samples: u64,
    loss: (f64, f64),
    /// Wall seconds, loss sum and steps since the last log.
    window: (f64, f64, u64),
    eval: Option<Metrics>,
    evaluated_at: Option<u64>,
    checkpoint: Option<PathBuf>,
    /// The position the last checkpoint holds.
    saved: Option<TrainState>,
    /// The step an evaluation reached the AUC target at: the run stops.
    target_reached_at: Option<u64>,
}

impl Trainer {
    /// A trainer that runs its models' dense side on `backend`.
    pub fn new(config: TrainerConfig, backend: Backend) -> Self {
        Self { config, backend }
    }

    /// The configuration.
    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// The dense backend.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The checkpoint in the checkpoint directory to resume from, if any
    /// (on a world, rank 0's choice; every rank calls this together).
    pub fn latest_checkpoint(
        &self,
        world: Option<&Arc<dyn Collective>>,
    ) -> Result<Option<PathBuf>, ModelError> {
        match &self.config.checkpoint_dir {
            Some(dir) => crate::checkpoint::latest(dir, world),
            None => Ok(None),
        }
    }

    /// Loads the latest checkpoint of the checkpoint directory into `model`
    /// and returns the position to pass to [`Trainer::fit`] (zero when there
    /// is none: a fresh start).
    pub fn resume<M: Model + ?Sized>(&self, model: &mut M) -> Result<TrainState, ModelError> {
        let latest = self.latest_checkpoint(model.world())?;
        Ok(match latest {
            Some(path) => model.load_checkpoint(&path)?.unwrap_or_default(),
            None => TrainState::default(),
        })
    }

    /// Trains `model` on `train` as configured, with what `options` add:
    /// evaluation data, a position to resume from, a listener.
    ///
    /// The model's optimizers are set for each step as
    /// [`TrainerConfig::optimization`] says, and back to their own when
    /// the run ends, however it ends.
    pub fn fit<M: Model + ?Sized>(
        &self,
        model: &mut M,
        train: &dyn TrainData,
        options: FitOptions<'_>,
    ) -> Result<TrainSummary, TrainError> {
        let result = self.fit_from(model, train, options);
        // The plain optimization: every model takes it.
        let reset = model.set_optimization(&Optimization::default(), 0);
        let summary = result?;
        reset?;
        Ok(summary)
    }

    fn fit_from<M: Model + ?Sized>(
        &self,
        model: &mut M,
        train: &dyn TrainData,
        options: FitOptions<'_>,
    ) -> Result<TrainSummary, TrainError> {
        let FitOptions {
            eval,
            from,
            on_event,
        } = options;
        let mut ignore = |_: &TrainEvent| {};
        let on_event: &mut dyn FnMut(&TrainEvent) = match on_event {
            Some(listener) => listener,
            None => &mut ignore,
        };
        let c = &self.config;
        self.backend.check_mode(c.mode)?;
        c.check().map_err(ModelError::InvalidOptimization)?;
        let world = model.world().cloned();
        // One run per checkpoint directory, held to the end.
        let _lock = self.lock_checkpoint_dir(world.as_ref())?;
        let world_size = world.as_ref().map_or(1, |w| w.world_size());
        let (state, per_epoch, skipped) =
            self.start_position(model, train, from, world.as_ref(), on_event)?;
        let eval_batches = eval_batches(eval, world.as_ref())?;
        // What the model cannot take is refused before the first step.
        model.set_optimization(&c.optimization, state.steps)?;
        let total: u64 = per_epoch.iter().skip(state.epoch as usize).sum();
        on_event(&TrainEvent::Start {
            steps: total.saturating_sub(state.batches_in_epoch),
            from: state.clone(),
        });
        let resumed_at_step = state.steps;
        let mut run = Run {
            state,
            excluded: Duration::ZERO,
            data_wait: Duration::ZERO,
            input_dist: Duration::ZERO,
            compute: Duration::ZERO,
            samples: 0,
            loss: (f64::NAN, f64::NAN),
            window: (0.0, 0.0, 0),
            eval: None,
            evaluated_at: None,
            checkpoint: None,
            saved: None,
            target_reached_at: None,
        };
        let started = Instant::now();
        let max_steps = c.max_steps.unwrap_or(u64::MAX);
        let eval = eval.map(|d| (d, eval_batches));
        while run.state.epoch < c.epochs {
            let epoch = run.state.epoch;
            let skip = run.state.batches_in_epoch;
            // Exactly the steps this epoch runs: on a world, every rank's
            // pipeline routes the same batches.
            let steps = (per_epoch[epoch as usize].saturating_sub(skip))
                .min(max_steps.saturating_sub(run.state.steps));
            let mut ctx = EpochRun {
                model: &mut *model,
                run: &mut run,
                world: world.as_ref(),
                world_size,
                eval,
                on_event: &mut *on_event,
            };
            self.run_epoch_from(&mut ctx, &per_epoch, train, (epoch, skip, steps))?;
            if run.target_reached_at.is_some() {
                // Stopped at the epoch's last batch: the position is the next epoch's start.
                if run.state.batches_in_epoch == per_epoch[epoch as usize] {
                    run.state.epoch += 1;
                    run.state.batches_in_epoch = 0;
                }
                break;
            }
            if run.state.steps >= max_steps
                && run.state.batches_in_epoch < per_epoch[epoch as usize]
            {
                break;
            }
            run.state.epoch += 1;
            run.state.batches_in_epoch = 0;
            if c.eval_at_epoch_end && run.evaluated_at != Some(run.state.steps) {
                // Reported as the epoch it ends, as that epoch's logs were.
                self.evaluate(model, eval, (&mut run, epoch), on_event)?;
            }
            self.checkpoint(model, world.as_ref(), &mut run, on_event)?;
            if run.target_reached_at.is_some() {
                break;
            }
        }
        // Stopped by max_steps, or skipped past the last epoch: the new
        // position is kept.
        let untrained_skip = skipped && run.state.steps == resumed_at_step;
        let stopped = run.state.steps >= max_steps && run.state.epoch < c.epochs;
        if stopped || run.target_reached_at.is_some() || untrained_skip {
            self.checkpoint(model, world.as_ref(), &mut run, on_event)?;
        }
        let train_seconds = started.elapsed().saturating_sub(run.excluded).as_secs_f64();
        Ok(TrainSummary {
            steps: run.state.steps,
            samples: run.samples,
            train_seconds,
            data_wait_seconds: run.data_wait.as_secs_f64(),
            input_dist_seconds: run.input_dist.as_secs_f64(),
            compute_seconds: run.compute.as_secs_f64(),
            loss_first: run.loss.0,
            loss_last: run.loss.1,
            eval: run.eval,
            checkpoint: run.checkpoint,
            target_reached_at: run.target_reached_at,
            resumed_at_step,
            state: run.state,
        })
    }

    /// Takes the checkpoint directory for this run (rank 0 takes it for
    /// the ranks of a world, which write there together).
    fn lock_checkpoint_dir(
        &self,
        world: Option<&Arc<dyn Collective>>,
    ) -> Result<Option<DirLock>, TrainError> {
        let c = &self.config;
        Ok(match &c.checkpoint_dir {
            Some(dir) if world.is_none_or(|w| w.rank() == 0) => {
                not_a_file(dir)?;
                let lock = DirLock::acquire(dir, "ember train").map_err(ModelError::from)?;
                prepare_checkpoint_dir(dir)?;
                Some(lock)
            }
            // Other ranks remove nothing: only the lock's holder may.
            Some(dir) => {
                not_a_file(dir)?;
                std::fs::create_dir_all(dir)
                    .map_err(|e| crate::checkpoint::fail_at(dir, e.to_string()))?;
                None
            }
            None => None,
        })
    }

    /// The position the run starts from, checked against the data, and the
    /// batches each epoch runs in lockstep; `true` when the rest of a
    /// resumed epoch is skipped (written under another number of ranks).
    fn start_position<M: Model + ?Sized>(
        &self,
        model: &mut M,
        train: &dyn TrainData,
        from: TrainState,
        world: Option<&Arc<dyn Collective>>,
        on_event: &mut dyn FnMut(&TrainEvent),
    ) -> Result<(TrainState, Vec<u64>, bool), TrainError> {
        let world_size = world.map_or(1, |w| w.world_size());
        let resumed = !from.is_fresh();
        if resumed && from.world_size == 0 {
            return Err(TrainError::BadPosition(
                "it was written by 0 processes".into(),
            ));
        }
        let mut state = with_data_recipe(from, train.start_state())?;
        let fingerprint = train.fingerprint();
        match state.data_fingerprint {
            0 => state.data_fingerprint = fingerprint,
            f if fingerprint != 0 && f != fingerprint => return Err(TrainError::OtherData),
            _ => {}
        }
        if let Some(spec) = train.dataset_spec() {
            model.record_dataset_spec(spec);
        }
        // A position mid-epoch counts batches of the ranks that wrote it,
        // each reading its own row groups: under another number of ranks it
        // means nothing, so the run goes on at the next epoch.
        let written_by = state.world_size.max(1);
        let skipped = written_by != world_size as u64 && state.batches_in_epoch > 0;
        if skipped {
            on_event(&TrainEvent::EpochRestSkipped {
                epoch: state.epoch,
                written_by,
            });
            state.epoch += 1;
            state.batches_in_epoch = 0;
        }
        state.world_size = world_size as u64;
        let given = self.config.optimization;
        if !resumed {
            state.optimization = given;
        } else if state.optimization != given {
            let json = |o: &Optimization| serde_json::to_string(o).unwrap_or_default();
            return Err(TrainError::OtherOptimization {
                saved: json(&state.optimization),
                given: json(&given),
            });
        }
        let per_epoch = self.lockstep_epochs(train, world, &state, on_event)?;
        if resumed {
            check_position(&state, &per_epoch, written_by == world_size as u64)?;
        }
        Ok((state, per_epoch, skipped))
    }

    /// One epoch's `steps` batches from batch `skip`: taken on a pipeline
    /// thread one batch ahead (running the model's input dist there), or
    /// in turn on this thread.
    fn run_epoch_from<M: Model + ?Sized>(
        &self,
        ctx: &mut EpochRun<'_, M>,
        per_epoch: &[u64],
        train: &dyn TrainData,
        (epoch, skip, steps): (u64, u64, u64),
    ) -> Result<(), TrainError> {
        if self.config.pipeline {
            let dist = ctx.model.input_dist();
            std::thread::scope(|scope| {
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                scope.spawn(move || {
                    for batch in train.epoch(epoch, skip).take(steps as usize) {
                        let ready = batch.and_then(|batch| Ready::of(batch, dist.as_deref()));
                        let failed = ready.is_err();
                        // A closed queue: the step failed and stopped taking.
                        if tx.send(ready).is_err() || failed {
                            return;
                        }
                    }
                });
                self.run_epoch(ctx, per_epoch, rx.into_iter())
            })
        } else {
            let batches = train.epoch(epoch, skip).take(steps as usize);
            let ready = batches.map(|b| b.and_then(|batch| Ready::of(batch, None)));
            self.run_epoch(ctx, per_epoch, ready)
        }
    }

    /// Batches per epoch that every rank can run in lockstep: the fewest
    /// any rank has.
    fn lockstep_epochs(
        &self,
        train: &dyn TrainData,
        world: Option<&Arc<dyn Collective>>,
        state: &TrainState,
        on_event: &mut dyn FnMut(&TrainEvent),
    ) -> Result<Vec<u64>, TrainError> {
        let world_size = world.map_or(1, |w| w.world_size());
        let mut per_epoch = Vec::new();
        for epoch in 0..self.config.epochs {
            let mine = train.batches_per_epoch(epoch);
            let (steps, _) = fewest_and_most(world, mine)?;
            if steps == 0 {
                return Err(TrainError::EmptyEpoch { epoch, world_size });
            }
            if steps < mine && epoch == state.epoch {
                on_event(&TrainEvent::BatchesLeftOut {
                    left_out: mine - steps,
                    of: mine,
                });
            }
            per_epoch.push(steps);
        }
        Ok(per_epoch)
    }

    /// The steps of one epoch, on batches as they come ready.
    fn run_epoch<M: Model + ?Sized>(
        &self,
        ctx: &mut EpochRun<'_, M>,
        per_epoch: &[u64],
        mut batches: impl Iterator<Item = Result<Ready, ModelError>>,
    ) -> Result<(), TrainError> {
        let c = &self.config;
        loop {
            let t = Instant::now();
            let Some(ready) = batches.next() else { break };
            let ready = ready?;
            let data_wait = t.elapsed();
            let epoch = ctx.run.state.epoch;
            self.step(ctx, ready, data_wait, t)?;
            let steps = ctx.run.state.steps;
            let (batch, of) = (ctx.run.state.batches_in_epoch, per_epoch[epoch as usize]);
            let on_grid = c
                .eval_every_fraction
                .is_some_and(|f| crosses_grid(f, batch, of));
            if (c.eval_every > 0 && steps.is_multiple_of(c.eval_every)) || on_grid {
                self.evaluate(ctx.model, ctx.eval, (ctx.run, epoch), ctx.on_event)?;
                if ctx.run.target_reached_at.is_some() {
                    break;
                }
            }
            // At an epoch's last batch the epoch's own checkpoint follows.
            let ends_epoch = batch == of;
            if c.checkpoint_every > 0 && steps.is_multiple_of(c.checkpoint_every) && !ends_epoch {
                self.checkpoint(ctx.model, ctx.world, ctx.run, ctx.on_event)?;
            }
        }
        Ok(())
    }

    fn step<M: Model + ?Sized>(
        &self,
        ctx: &mut EpochRun<'_, M>,
        ready: Ready,
        data_wait: Duration,
        started: Instant,
    ) -> Result<(), TrainError> {
        let (run, on_event, world_size) = (&mut *ctx.run, &mut *ctx.on_event, ctx.world_size);
        let state = &mut run.state;
        run.data_wait += data_wait;
        run.input_dist += ready.input_dist;
        on_event(&TrainEvent::BeforeStep { steps: state.steps });
        let t = Instant::now();
        (ctx.model).set_optimization(&self.config.optimization, state.steps)?;
        let (batch, mode) = (&ready.batch, self.config.mode);
        let out = match ready.routed {
            Some(routed) => ctx
                .model
                .train_step_routed(&self.backend, batch, routed, mode)?,
            None => ctx.model.train_step(&self.backend, batch, mode)?,
        };
        let compute = t.elapsed();
        run.compute += compute;
        if !out.loss.is_finite() {
            return Err(TrainError::NonFiniteLoss {
                step: state.steps,
                loss: out.loss,
            });
        }
        state.steps += 1;
        state.batches_in_epoch += 1;
        run.samples += (batch.size() * world_size) as u64;
        let loss = out.loss as f64;
        if run.loss.0.is_nan() {
            run.loss.0 = loss;
        }
        run.loss.1 = loss;
        on_event(&TrainEvent::Step {
            epoch: state.epoch,
            batch: state.batches_in_epoch,
            steps: state.steps,
            loss: out.loss,
            times: out.times,
            samples: batch.size(),
            ids: batch.sparse.values().len(),
            data_wait,
            input_dist: ready.input_dist,
            compute,
        });
        let w = &mut run.window;
        *w = (w.0 + started.elapsed().as_secs_f64(), w.1 + loss, w.2 + 1);
        if state
            .batches_in_epoch
            .is_multiple_of(self.config.log_every.max(1))
        {
            on_event(&TrainEvent::Log {
                epoch: state.epoch,
                batch: state.batches_in_epoch,
                steps: state.steps,
                loss: w.1 / w.2 as f64,
                ms_per_step: w.0 * 1e3 / w.2 as f64,
            });
            *w = (0.0, 0.0, 0);
        }
        Ok(())
    }

    fn evaluate<M: Model + ?Sized>(
        &self,
        model: &mut M,
        eval: Option<(&dyn TrainData, u64)>,
        (run, epoch): (&mut Run, u64),
        on_event: &mut dyn FnMut(&TrainEvent),
    ) -> Result<(), TrainError> {
        let Some((data, batches)) = eval else {
            return Ok(());
        };
        on_event(&TrainEvent::EvalStart {
            epoch,
            steps: run.state.steps,
        });
        let t = Instant::now();
        model.sync_to_host()?;
        let metrics = evaluate_data(model, &self.backend, data, batches)?;
        run.excluded += t.elapsed();
        run.eval = Some(metrics);
        run.evaluated_at = Some(run.state.steps);
        on_event(&TrainEvent::Eval {
            epoch,
            steps: run.state.steps,
            metrics,
        });
        if let Some(target) = self.config.stop_at_auc.filter(|&t| metrics.auc >= t) {
            run.target_reached_at = Some(run.state.steps);
            on_event(&TrainEvent::TargetReached {
                steps: run.state.steps,
                auc: metrics.auc,
                target,
            });
        }
        Ok(())
    }

    fn checkpoint<M: Model + ?Sized>(
        &self,
        model: &mut M,
        world: Option<&Arc<dyn Collective>>,
        run: &mut Run,
        on_event: &mut dyn FnMut(&TrainEvent),
    ) -> Result<(), TrainError> {
        let Some(dir) = &self.config.checkpoint_dir else {
            return Ok(());
        };
        if run.saved.as_ref() == Some(&run.state) {
            return Ok(());
        }
        let t = Instant::now();
        let state = &run.state;
        // Ranks write their parts at their own pace, then leave together.
        let deltas = self.config.delta_checkpoints;
        let path = patiently(world, self.config.setup_timeout, || {
            let delta = match deltas {
                0 => None,
                n => model.save_checkpoint_delta(dir, Some(state), n)?,
            };
            match delta {
                Some(path) => Ok(path),
                None => model.save_checkpoint(dir, Some(state)),
            }
        })?;
        run.excluded += t.elapsed();
        run.saved = Some(state.clone());
        on_event(&TrainEvent::Checkpoint {
            path: path.clone(),
            steps: state.steps,
        });
        run.checkpoint = Some(path);
        Ok(())
    }
}

impl TrainerConfig {
    /// Refuses optimizations, evaluation fractions and AUC targets no run
    /// can use.
    fn check(&self) -> Result<(), String> {
        self.optimization.validate()?;
        if let Some(f) = self
            .eval_every_fraction
            .filter(|f| !(*f > 0.0 && *f <= 1.0))
        {
            return Err(format!(
                "evaluation every {f} of an epoch: the fraction must be in (0, 1]"
            ));
        }
        if let Some(t) = self.stop_at_auc.filter(|t| !(*t > 0.0 && *t <= 1.0)) {
            return Err(format!("AUC target {t}: must be in (0, 1]"));
        }
        Ok(())
    }
}

/// Whether batch `batch` (1-based) of an epoch of `of` crosses a point of
/// the grid every `fraction` of the epoch: in whole millionths, so a point
/// such as 7% of 100 batches falls on batch 7, not past it by rounding.
fn crosses_grid(fraction: f64, batch: u64, of: u64) -> bool {
    let millionths = ((fraction * 1e6).round() as u128).max(1);
    let width = millionths * of as u128;
    let point = |b: u64| b as u128 * 1_000_000 / width;
    batch > 0 && point(batch) > point(batch - 1)
}

/// The evaluation batches every rank runs: the fewest any rank has (0:
/// no evaluation data).
fn eval_batches(
    eval: Option<&dyn TrainData>,
    world: Option<&Arc<dyn Collective>>,
) -> Result<u64, TrainError> {
    Ok(match eval {
        Some(data) => {
            let (fewest, most) = fewest_and_most(world, data.batches_per_epoch(0))?;
            if most == 0 {
                return Err(TrainError::EmptyEval);
            }
            if fewest == 0 {
                return Err(TrainError::EmptyEvalRank);
            }
            fewest
        }
        None => 0,
    })
}

/// Makes sure checkpoints can go to `dir` before the first step (a regular
/// file there is named now, not at the first checkpoint), and removes the
/// temporary files a killed run left in it.
fn prepare_checkpoint_dir(dir: &std::path::Path) -> Result<(), ModelError> {
    let fail = |m: String| crate::checkpoint::fail_at(dir, m);
    not_a_file(dir)?;
    std::fs::create_dir_all(dir).map_err(|e| fail(e.to_string()))?;
    // Only checkpoint files' temporaries: the directory may hold others'.
    // `.tmpXXXXXX` is what the safetensors crate's writer (earlier versions
    // of Ember) left, in a directory that holds a checkpoint.
    // Whether one is there, not which: a broken chain is the resume's
    // error, not a fresh run's.
    let has_checkpoint = [
        crate::checkpoint::CHECKPOINT_FILE,
        crate::checkpoint::INDEX_FILE,
    ]
    .iter()
    .any(|name| dir.join(name).is_file());
    let ours = |name: &str| match ember_dataloader::atomic::temp_of(name) {
        Some(file) => file.starts_with("model") && file.contains(".safetensors"),
        None => {
            has_checkpoint
                && name.len() == ".tmpXXXXXX".len()
                && name.starts_with(".tmp")
                && name[4..].bytes().all(|b| b.is_ascii_alphanumeric())
        }
    };
    ember_dataloader::atomic::remove_leftovers(dir, ours).map_err(|e| fail(e.to_string()))?;
    Ok(())
}

/// The position `from` on data whose batches are made as `data` says (a
/// fresh run's [`TrainState`]): a fresh position takes the data's recipe;
/// a resumed one must have been made the same way.
fn with_data_recipe(mut from: TrainState, data: TrainState) -> Result<TrainState, TrainError> {
    let differ =
        |what, saved: String, given: String| TrainError::OtherBatches { what, saved, given };
    if from.is_fresh() && from.batch_size == 0 {
        from.batch_size = data.batch_size;
        from.shuffle_seed = data.shuffle_seed;
        from.drop_last = data.drop_last;
    } else if data.batch_size != 0 {
        if from.batch_size != data.batch_size {
            let saved = match from.batch_size {
                0 => "none recorded".to_string(),
                b => b.to_string(),
            };
            return Err(differ("batch size", saved, data.batch_size.to_string()));
        }
        if from.shuffle_seed != data.shuffle_seed {
            let seed = |s: Option<u64>| s.map_or("none (not shuffled)".into(), |s| s.to_string());
            return Err(differ(
                "shuffle seed",
                seed(from.shuffle_seed),
                seed(data.shuffle_seed),
            ));
        }
        if from.drop_last != data.drop_last {
            let (saved, given) = (from.drop_last.to_string(), data.drop_last.to_string());
            return Err(differ("drop_last", saved, given));
        }
    }
    match (from.dense_transform, data.dense_transform) {
        (None, t) => from.dense_transform = t,
        (Some(a), Some(b)) if a != b => {
            return Err(differ(
                "dense transform",
                format!("{a:?}"),
                format!("{b:?}"),
            ))
        }
        _ => {}
    }
    match (from.id_transform, data.id_transform) {
        (None, t) => from.id_transform = t,
        (Some(a), Some(b)) if a != b => {
            return Err(differ("id transform", format!("{a:?}"), format!("{b:?}")))
        }
        _ => {}
    }
    Ok(from)
}

/// Refuses a resumed position that no run on this data can have reached:
/// `per_epoch` is the data's batches in each epoch.
/// `same_world`: the position was written by as many ranks as run now (the
/// epochs' lengths are then the ones it counted in).
fn check_position(
    state: &TrainState,
    per_epoch: &[u64],
    same_world: bool,
) -> Result<(), TrainError> {
    let bad = |m: String| Err(TrainError::BadPosition(m));
    if let Some(&batches) = per_epoch.get(state.epoch as usize) {
        if state.batches_in_epoch > batches {
            return bad(format!(
                "batch {} of epoch {}, which has {batches} batches",
                state.batches_in_epoch, state.epoch
            ));
        }
    }
    if state.steps < state.batches_in_epoch {
        return bad(format!(
            "{} steps in all, fewer than the {} batches of its epoch",
            state.steps, state.batches_in_epoch
        ));
    }
    // Each epoch takes at most the data's longest epoch of steps (twice
    // that, for slack). Under another number of ranks the epochs' lengths
    // differ (the fewest any rank has), so no bound is drawn.
    let longest = per_epoch.iter().copied().max().unwrap_or(0);
    let most = (state.epoch.saturating_add(1))
        .saturating_mul(longest.max(1))
        .saturating_mul(2);
    if same_world && !per_epoch.is_empty() && state.steps > most {
        return bad(format!(
            "{} steps in all by epoch {}, more than epochs of at most {longest} batches can take",
            state.steps, state.epoch
        ));
    }
    Ok(())
}

/// Refuses a checkpoint directory that is a regular file.
fn not_a_file(dir: &std::path::Path) -> Result<(), ModelError> {
    if dir.exists() && !dir.is_dir() {
        return Err(crate::checkpoint::fail_at(
            dir,
            "the checkpoint directory is a file, not a directory".into(),
        ));
    }
    Ok(())
}

/// The fewest and the most of `mine` over the ranks.
fn fewest_and_most(
    world: Option<&Arc<dyn Collective>>,
    mine: u64,
) -> Result<(u64, u64), TrainError> {
    let Some(comm) = world else {
        return Ok((mine, mine));
    };
    let all = comm.all_gather_u64(mine)?;
    let fewest = all.iter().copied().min().unwrap_or(0);
    Ok((fewest, all.iter().copied().max().unwrap_or(0)))
}
