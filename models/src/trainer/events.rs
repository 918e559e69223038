//! What a run tells its listener ([`TrainEvent`]), how it ended
//! ([`TrainSummary`]) and how it failed ([`TrainError`]).

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use thiserror::Error;

use crate::{Metrics, ModelError, PhaseTimes, TrainState};

/// Progress of a run, in the order it happens.
/// Serialised as the JSON lines `ember train --json` prints: tagged by
/// `event` (`train` for a [`Log`](TrainEvent::Log); an evaluation's
/// metrics flattened into its line).
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TrainEvent {
    /// Before the first step: how many steps remain at most, from where.
    Start {
        /// Steps this run takes unless `max_steps` stops it first.
        steps: u64,
        /// The position it starts from (resumed, or zero).
        from: TrainState,
    },
    /// The checkpoint was written mid-epoch by another number of ranks, whose
    /// position means nothing here: the rest of that epoch is skipped.
    EpochRestSkipped {
        /// The epoch skipped.
        epoch: u64,
        /// The ranks that wrote the checkpoint.
        written_by: u64,
    },
    /// This rank has more batches than the rank with the fewest; the extra
    /// ones are left out so that every rank steps in lockstep.
    BatchesLeftOut {
        /// Batches of each epoch left out.
        left_out: u64,
        /// This rank's batches per epoch.
        of: u64,
    },
    /// A step is about to run (`steps` done so far).
    BeforeStep {
        /// Steps done.
        steps: u64,
    },
    /// A step ran.
    Step {
        /// The epoch and the batch within it (1-based: batches done).
        epoch: u64,
        /// See `epoch`.
        batch: u64,
        /// Steps done in all.
        steps: u64,
        /// The step's loss (over every rank's samples).
        loss: f32,
        /// The step's phases.
        times: PhaseTimes,
        /// This rank's samples and ids in the batch.
        samples: usize,
        /// See `samples`.
        ids: usize,
        /// Time the step waited for its batch (on the pipeline: for the
        /// pipeline thread to have it taken and routed).
        data_wait: Duration,
        /// Time the batch's input dist took, ahead of the step on the
        /// pipeline thread (0 when it ran inside the step).
        input_dist: Duration,
        /// Time of the step itself: forward, backward, both optimizers.
        compute: Duration,
    },
    /// Every `log_every` batches: the mean loss and wall time per step since
    /// the last log.
    #[serde(rename = "train")]
    Log {
        /// The epoch, the batch within it and the steps in all.
        epoch: u64,
        /// See `epoch`.
        batch: u64,
        /// See `epoch`.
        steps: u64,
        /// Mean loss since the last log.
        loss: f64,
        /// Mean wall time per step since the last log (data waits included).
        ms_per_step: f64,
    },
    /// An evaluation is about to run.
    EvalStart {
        /// The epoch it evaluates in, as [`Eval`](TrainEvent::Eval)'s.
        epoch: u64,
        /// Steps done.
        steps: u64,
    },
    /// An evaluation finished.
    Eval {
        /// The epoch it evaluates in, or at an epoch's end the epoch that
        /// ended (numbered as that epoch's [`Log`](TrainEvent::Log)s are);
        /// and the steps done.
        epoch: u64,
        /// See `epoch`.
        steps: u64,
        /// Its metrics (on a world, over every rank's samples).
        #[serde(flatten)]
        metrics: Metrics,
    },
    /// An evaluation's AUC reached the run's target
    /// ([`TrainerConfig::stop_at_auc`](crate::TrainerConfig::stop_at_auc)):
    /// training stops here.
    TargetReached {
        /// Steps done.
        steps: u64,
        /// The evaluation's AUC and the target.
        auc: f64,
        /// See `auc`.
        target: f64,
    },
    /// A checkpoint was written.
    Checkpoint {
        /// The file (or a set's index).
        path: PathBuf,
        /// Steps done.
        steps: u64,
    },
}

/// How a run ended.
#[derive(Clone, Debug, Default)]
pub struct TrainSummary {
    /// Steps in all (the resumed-from ones included).
    pub steps: u64,
    /// Samples trained on in this run, over every rank.
    pub samples: u64,
    /// Training time, evaluations and checkpoints excluded (data waits included).
    pub train_seconds: f64,
    /// Time the steps waited for their batches.
    pub data_wait_seconds: f64,
    /// Time of the input dists run ahead on the pipeline thread, overlapped
    /// with the steps.
    pub input_dist_seconds: f64,
    /// Time of the steps themselves.
    pub compute_seconds: f64,
    /// The first and the last step's loss of this run (NaN: no step).
    pub loss_first: f64,
    /// See `loss_first`.
    pub loss_last: f64,
    /// The last evaluation's metrics.
    pub eval: Option<Metrics>,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// The step at which an evaluation reached the AUC target, stopping
    /// the run (`None`: no target, or not reached).
    pub target_reached_at: Option<u64>,
    /// The step the run started from.
    pub resumed_at_step: u64,
    /// Where training stands now (what the last checkpoint holds).
    pub state: TrainState,
}

/// Why training stopped.
#[derive(Debug, Error)]
pub enum TrainError {
    /// The model, its data or a checkpoint failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The world's exchanges failed (a rank stopped).
    #[error(transparent)]
    Sharding(#[from] ember_sharding::ShardingError),
    /// The loss became NaN or infinite: the learning rate is too high.
    #[error("loss became {loss} at step {step}: lower the learning rate")]
    NonFiniteLoss {
        /// The step (0-based) and its loss.
        step: u64,
        /// See `step`.
        loss: f32,
    },
    /// An epoch with no batch (for some rank, on a world).
    #[error("epoch {epoch} has no batch{}", if *.world_size > 1 { " for some rank (ranks each read whole row groups: write smaller ones, or run fewer ranks)" } else { "" })]
    EmptyEpoch {
        /// The epoch and the ranks.
        epoch: u64,
        /// See `epoch`.
        world_size: usize,
    },
    /// The evaluation data has batches for some ranks but not for others.
    #[error("the evaluation data has no batch for some rank (write smaller row groups, or run fewer ranks)")]
    EmptyEvalRank,
    /// The evaluation data has no batch at all: no rows, or fewer than one
    /// batch (evaluating it would give NaN metrics).
    #[error("the evaluation data has no batch (no rows, or fewer than one batch holds)")]
    EmptyEval,
    /// Resuming on other data than the run that wrote the checkpoint.
    #[error("resume: the training data differs from the run the checkpoint continues (other files, row groups or vocabulary); resume on the same data")]
    OtherData,
    /// Resuming with batches made otherwise than the run that wrote the
    /// checkpoint (another batch size, shuffle, or transform).
    #[error("resume: the checkpoint's run made its batches with {what} {saved}, this data with {given}; resume with the same")]
    OtherBatches {
        /// What differs (`batch size`, `shuffle seed`, ...).
        what: &'static str,
        /// The checkpoint's value.
        saved: String,
        /// The data's value.
        given: String,
    },
    /// Resuming with other learning-rate schedules, weight decay or
    /// clipping than the run that wrote the checkpoint.
    #[error("resume: the checkpoint's run trained with {saved}, this run with {given}; resume with the same schedules, weight decay and clipping")]
    OtherOptimization {
        /// The checkpoint's, as JSON.
        saved: String,
        /// This run's, as JSON.
        given: String,
    },
    /// A training position no run can have reached (a damaged or
    /// hand-edited checkpoint).
    #[error("resume: the checkpoint's training position is impossible: {0}")]
    BadPosition(String),
}
