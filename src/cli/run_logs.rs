//! The logs a run writes beside its report: the MLPerf log
//! (`--mlperf-logging`) and TensorBoard event files (`--tensorboard-dir`),
//! both fed the Trainer's events.

use std::path::PathBuf;

use clap::Args;

use ember_models::mllog::{MlperfLog, RunFacts, Submission};
use ember_models::tensorboard::TensorBoardLog;
use ember_models::{ModelError, Optimization, TrainEvent};

use super::Progress;

/// `--tensorboard-dir` (train and bench dlrm).
#[derive(Args, Clone, Debug, Default)]
pub struct TensorBoardArgs {
    /// Write TensorBoard event files here (loss, AUC, NE, calibration,
    /// learning rates, samples/s, per-phase ms), as dlrm_s_pytorch's
    /// --tensor-board-filename does.
    #[arg(long)]
    pub tensorboard_dir: Option<PathBuf>,
}

/// The MLPerf log's flags (train).
#[derive(Args, Clone, Debug)]
pub struct MlperfArgs {
    /// Write the MLPerf log (`:::MLLOG` lines; DLRMv2's keys, ruleset
    /// training 6.0.0, or with --model hstu-ranking DLRMv4's, 6.1.0) to
    /// this file, renamed into place when the run ends.
    #[arg(long, conflicts_with = "stream_window")]
    pub mlperf_logging: Option<PathBuf>,
    /// The MLPerf log's submission_org.
    #[arg(long, default_value = "Ember", requires = "mlperf_logging")]
    pub mlperf_submission_org: String,
    /// The MLPerf log's submission_division (closed or open).
    #[arg(long, default_value = "closed", value_parser = ["closed", "open"], requires = "mlperf_logging")]
    pub mlperf_submission_division: String,
}

impl MlperfArgs {
    /// The submission the log names for `benchmark` (`dlrm_dcnv2` or
    /// `dlrmv4`; the platform is the CPU).
    pub fn submission(&self, benchmark: &str) -> Submission {
        Submission {
            benchmark: benchmark.into(),
            org: self.mlperf_submission_org.clone(),
            division: self.mlperf_submission_division.clone(),
            status: "research".into(),
            platform: super::run_info::RunInfo::now().cpu,
        }
    }
}

/// The logs of one run (on rank 0), and the first error writing them.
#[derive(Default)]
pub struct RunLogs {
    mlperf: Option<MlperfLog>,
    tensorboard: Option<TensorBoardLog>,
    error: Option<ModelError>,
}

impl RunLogs {
    /// Starts the logs asked for: the MLPerf log from `mlperf` (its path,
    /// submission and facts) and TensorBoard's, logging the rates of
    /// `rates` (the base rates of the tables and dense layers, and the
    /// schedules).
    pub fn start(
        mlperf: Option<(&std::path::Path, Submission, RunFacts)>,
        tensorboard: &TensorBoardArgs,
        rates: ((f32, f32), Optimization),
    ) -> anyhow::Result<Self> {
        let mlperf = match mlperf {
            Some((path, submission, facts)) => Some(MlperfLog::create(path, &submission, facts)?),
            None => None,
        };
        let tensorboard = match &tensorboard.tensorboard_dir {
            Some(dir) => Some(TensorBoardLog::create(dir, Some(rates))?),
            None => None,
        };
        Ok(Self {
            mlperf,
            tensorboard,
            error: None,
        })
    }

    /// Gives `e` to every log; the first error is kept for [`finish`](Self::finish).
    pub fn on_event(&mut self, e: &TrainEvent) {
        if self.error.is_some() {
            return;
        }
        if let Some(log) = &mut self.mlperf {
            self.error = log.on_event(e).err();
        }
        if let (Some(log), None) = (&mut self.tensorboard, &self.error) {
            self.error = log.on_event(e).err();
        }
    }

    /// Ends every log (the MLPerf log whatever the run's outcome: its
    /// `run_stop` says `aborted` unless the target was reached) and names
    /// them; the first error writing any.
    pub fn finish(self, progress: &Progress) -> anyhow::Result<()> {
        let mlperf = self.mlperf.map(MlperfLog::finish);
        let tensorboard = self.tensorboard.map(TensorBoardLog::finish);
        if let Some(e) = self.error {
            return Err(e.into());
        }
        if let Some(path) = mlperf.transpose()? {
            progress.line(&format!("MLPerf log: {}", path.display()));
        }
        if let Some(path) = tensorboard.transpose()? {
            progress.line(&format!("TensorBoard events: {}", path.display()));
        }
        Ok(())
    }
}
