//! The MLPerf training log: `:::MLLOG {json}` lines, as the `mlperf-logging`
//! package's `mllog` writes them, with every key the DLRMv2 benchmark's
//! rules (`dlrm_dcnv2`, training ruleset 6.0.0) or DLRMv4's (`dlrmv4`,
//! ruleset 6.1.0: [`Dlrmv4Facts`]) require, from a run's [`TrainEvent`]s.
//! `python -m mlperf_logging.compliance_checker --usage training --ruleset
//! 6.0.0 LOG` (6.1.0 for DLRMv4) checks it. The log is written beside its
//! path and renamed there when the run ends, with `run_stop`'s status:
//! `success` when an evaluation reached the target AUC, `aborted`
//! otherwise (the rules' two outcomes).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use ember_dataloader::atomic::AtomicFile;
use ember_dataloader::DataError;
use ember_dense::DenseOptimizerConfig;
use ember_sparse::TableOptimizer;
use serde_json::{json, Value};

use crate::{LrSchedule, ModelError, Optimization, TrainEvent};

/// Who ran what: the `submission_*` keys.
#[derive(Clone, Debug)]
pub struct Submission {
    /// `submission_benchmark`: `dlrm_dcnv2` for DLRMv2.
    pub benchmark: String,
    /// `submission_org`.
    pub org: String,
    /// `submission_division`: `closed` or `open`.
    pub division: String,
    /// `submission_status`: `onprem`, `cloud`, `preview` or `research`.
    pub status: String,
    /// `submission_platform`: the machine.
    pub platform: String,
}

/// The run's hyperparameters and sizes, logged before it starts.
#[derive(Clone, Debug)]
pub struct RunFacts {
    /// Samples per step over every rank.
    pub global_batch_size: u64,
    /// Samples in one epoch of the training data.
    pub train_samples: u64,
    /// Samples in one evaluation.
    pub eval_samples: u64,
    /// Processes the run takes (each step's batch is one rank's).
    pub ranks: u64,
    /// The run's seed.
    pub seed: u64,
    /// The tables' optimizer (DLRMv2's rules name it: `adagrad`).
    pub table_optimizer: TableOptimizer,
    /// The dense layers' optimizer.
    pub dense_optimizer: DenseOptimizerConfig,
    /// Schedules and weight decay.
    pub optimization: Optimization,
    /// DLRMv4's run (HSTU ranking): its keys instead of DLRMv2's.
    pub dlrmv4: Option<Dlrmv4Facts>,
}

/// What DLRMv4's rules (training 6.1.0) ask beyond the optimizers.
#[derive(Clone, Debug)]
pub struct Dlrmv4Facts {
    /// The most tokens a user's sequence holds (`max_sequence_length`).
    pub max_sequence_length: u64,
    /// The evaluation grid's step, as a fraction of the training samples
    /// (`eval_every_data_pct`: 0.001 in the rules, 0.1 %).
    pub eval_every_fraction: f64,
}

/// Writes one run's MLPerf log as its events come.
pub struct MlperfLog {
    file: AtomicFile,
    facts: RunFacts,
    /// The epoch in progress (`epoch_start` logged, no `epoch_stop` yet).
    open_epoch: Option<u64>,
    /// Samples of the epoch in progress, for evaluations' fractional epoch.
    samples_in_epoch: u64,
    /// Samples trained on (a resumed run's, from its start).
    samples: u64,
    /// A resumed run's epoch and the samples of it done before.
    resumed: Option<(u64, u64)>,
    reached: bool,
}

impl MlperfLog {
    /// Starts the log at `path` (written beside it until [`finish`](Self::finish)):
    /// `init_start`, the submission's keys and the run's hyperparameters.
    pub fn create(
        path: &Path,
        submission: &Submission,
        facts: RunFacts,
    ) -> Result<Self, ModelError> {
        let file = AtomicFile::create(path)?;
        let mut log = Self {
            file,
            facts,
            open_epoch: None,
            samples_in_epoch: 0,
            samples: 0,
            resumed: None,
            reached: false,
        };
        log.interval("init_start", Value::Null, json!({}))?;
        let s = submission;
        for (key, value) in [
            ("submission_benchmark", &s.benchmark),
            ("submission_org", &s.org),
            ("submission_division", &s.division),
            ("submission_status", &s.status),
            ("submission_platform", &s.platform),
        ] {
            log.point(key, json!(value), json!({}))?;
        }
        log.point("cache_clear", json!(true), json!({}))?;
        let keys = match &log.facts.dlrmv4 {
            Some(v4) => log.dlrmv4_hyperparameters(v4),
            None => log.hyperparameters(),
        };
        for (key, value) in keys {
            log.point(key, value, json!({}))?;
        }
        Ok(log)
    }

    /// The keys DLRMv2's rules ask of the optimizer and the data.
    fn hyperparameters(&self) -> Vec<(&'static str, Value)> {
        let f = &self.facts;
        let (name, eps) = match f.table_optimizer {
            TableOptimizer::Adagrad { eps, .. } | TableOptimizer::RowWiseAdagrad { eps, .. } => {
                ("adagrad", decimal(eps))
            }
            TableOptimizer::Adam { eps, .. } => ("adam", decimal(eps)),
            TableOptimizer::Sgd { .. } => ("sgd", 0.0),
            TableOptimizer::None => ("none", 0.0),
        };
        let (warmup, decay_start, decay_steps) = match f.optimization.sparse_schedule {
            LrSchedule::Constant => (0, 0, 0),
            LrSchedule::Policy {
                warmup_steps,
                decay_start_step,
                decay_steps,
            } => (warmup_steps, decay_start_step, decay_steps),
            LrSchedule::LinearWarmup { steps } => (steps, 0, 0),
        };
        let o = &f.optimization;
        let weight_decay = o.dense_weight_decay.rate().max(o.table_weight_decay);
        vec![
            ("global_batch_size", json!(f.global_batch_size)),
            ("gradient_accumulation_steps", json!(1)),
            ("seed", json!(f.seed)),
            ("opt_name", json!(name)),
            (
                "opt_base_learning_rate",
                json!(decimal(f.table_optimizer.learning_rate())),
            ),
            ("opt_adagrad_learning_rate_decay", json!(0)),
            (
                // One key for both: the larger of the dense and the tables' decay.
                "opt_weight_decay",
                json!(decimal(weight_decay)),
            ),
            ("opt_adagrad_initial_accumulator_value", json!(0)),
            ("opt_adagrad_epsilon", json!(eps)),
            ("opt_learning_rate_warmup_steps", json!(warmup)),
            ("opt_learning_rate_decay_start_step", json!(decay_start)),
            ("opt_learning_rate_decay_steps", json!(decay_steps)),
            (
                "dense_opt_base_learning_rate",
                json!(decimal(f.dense_optimizer.learning_rate())),
            ),
            ("train_samples", json!(f.train_samples)),
            ("eval_samples", json!(f.eval_samples)),
        ]
    }

    /// The keys DLRMv4's rules ask: the dense Adam and its clipping, the
    /// items' sparse optimizer, the linear warmup, the sequence length and
    /// the evaluation grid; and the disclosures every 6.1 benchmark asks
    /// (precisions, parallelism, micro batch, config).
    fn dlrmv4_hyperparameters(&self, v4: &Dlrmv4Facts) -> Vec<(&'static str, Value)> {
        let f = &self.facts;
        let o = &f.optimization;
        let (dense_name, b1, b2, eps) = match f.dense_optimizer {
            DenseOptimizerConfig::Adam {
                beta1, beta2, eps, ..
            } => ("Adam", decimal(beta1), decimal(beta2), decimal(eps)),
            DenseOptimizerConfig::Sgd { .. } => ("SGD", 0.0, 0.0, 0.0),
            DenseOptimizerConfig::Adagrad { .. } => ("Adagrad", 0.0, 0.0, 0.0),
        };
        let sparse_name = match f.table_optimizer {
            TableOptimizer::RowWiseAdagrad { .. } => "RowWiseAdagrad",
            TableOptimizer::Adagrad { .. } => "Adagrad",
            TableOptimizer::Adam { .. } => "Adam",
            TableOptimizer::Sgd { .. } => "SGD",
            TableOptimizer::None => "None",
        };
        let warmup = match o.dense_schedule {
            LrSchedule::LinearWarmup { steps } => steps,
            LrSchedule::Policy { warmup_steps, .. } => warmup_steps,
            LrSchedule::Constant => 0,
        };
        vec![
            ("global_batch_size", json!(f.global_batch_size)),
            ("gradient_accumulation_steps", json!(1)),
            (
                "micro_batch_size",
                json!(f.global_batch_size / f.ranks.max(1)),
            ),
            ("seed", json!(f.seed)),
            ("train_samples", json!(f.train_samples)),
            ("eval_samples", json!(f.eval_samples)),
            ("max_sequence_length", json!(v4.max_sequence_length)),
            ("opt_name", json!(dense_name)),
            (
                "opt_base_learning_rate",
                json!(decimal(f.dense_optimizer.learning_rate())),
            ),
            ("opt_adam_beta_1", json!(b1)),
            ("opt_adam_beta_2", json!(b2)),
            ("opt_adam_epsilon", json!(eps)),
            (
                "opt_weight_decay",
                json!(decimal(o.dense_weight_decay.rate())),
            ),
            (
                "opt_gradient_clip_norm",
                json!(o.max_grad_norm.map_or(0.0, decimal)),
            ),
            ("opt_sparse_name", json!(sparse_name)),
            (
                "opt_sparse_base_learning_rate",
                json!(decimal(f.table_optimizer.learning_rate())),
            ),
            ("opt_learning_rate_warmup_steps", json!(warmup)),
            // Both warmups (the Policy's and the linear one) start from 0.
            ("opt_learning_rate_warmup_start_lr", json!(0.0)),
            ("eval_every_data_pct", json!(v4.eval_every_fraction)),
            ("lowest_numerical_precision_in_linear", json!("fp32")),
            ("lowest_numerical_precision_in_attn", json!("fp32")),
            ("lowest_numerical_precision_in_comm", json!("fp32")),
            ("tensor_parallelism", json!(1)),
            ("pipeline_parallelism", json!(1)),
            ("context_parallelism", json!(1)),
            ("expert_parallelism", json!(1)),
            ("config_filename", json!("ember train --model hstu-ranking")),
        ]
    }

    /// Logs what `event` marks: the run's start (`init_stop`, `run_start`),
    /// epochs, evaluations (`eval_accuracy` is the AUC; the precision,
    /// recall, F1 and average precision dlrm_s_pytorch prints beside it go
    /// in its metadata) and the target.
    pub fn on_event(&mut self, event: &TrainEvent) -> Result<(), ModelError> {
        match event {
            TrainEvent::Start { from, .. } => {
                // A resumed run counts the samples before it (whole batches).
                let batch = self.facts.global_batch_size;
                self.samples = from.steps * batch;
                self.resumed = Some((from.epoch, from.batches_in_epoch * batch));
                self.interval("init_stop", Value::Null, json!({}))?;
                self.interval("run_start", Value::Null, json!({}))?;
            }
            &TrainEvent::Step { epoch, samples, .. } => {
                if self.open_epoch != Some(epoch) {
                    self.close_epoch()?;
                    self.interval("epoch_start", Value::Null, json!({ "epoch_num": epoch }))?;
                    self.open_epoch = Some(epoch);
                    self.samples_in_epoch = match self.resumed.take() {
                        Some((resumed, samples)) if resumed == epoch => samples,
                        _ => 0,
                    };
                }
                self.samples_in_epoch += samples as u64 * self.facts.ranks;
                self.samples += samples as u64 * self.facts.ranks;
            }
            &TrainEvent::EvalStart { epoch, steps } => {
                let meta = self.eval_metadata(epoch, steps);
                self.interval("eval_start", Value::Null, meta)?;
            }
            &TrainEvent::Eval {
                epoch,
                steps,
                metrics,
            } => {
                let mut meta = self.eval_metadata(epoch, steps);
                let extra = json!({
                    "precision": metrics.precision,
                    "recall": metrics.recall,
                    "f1": metrics.f1,
                    "average_precision": metrics.average_precision,
                    "logloss": metrics.logloss,
                    "accuracy": metrics.accuracy,
                });
                merge(&mut meta, extra);
                // NaN (one class) is not JSON: serde_json writes null.
                self.point("eval_accuracy", json!(metrics.auc), meta)?;
                let meta = self.eval_metadata(epoch, steps);
                self.interval("eval_stop", Value::Null, meta)?;
            }
            TrainEvent::TargetReached { .. } => self.reached = true,
            _ => {}
        }
        Ok(())
    }

    /// Ends the log: the open epoch's `epoch_stop`, `run_stop` with its
    /// status, then the file renamed into place.
    pub fn finish(mut self) -> Result<PathBuf, ModelError> {
        self.close_epoch()?;
        let status = if self.reached { "success" } else { "aborted" };
        self.interval("run_stop", Value::Null, json!({ "status": status }))?;
        let path = self.file.path().to_path_buf();
        self.file.commit()?;
        Ok(path)
    }

    fn close_epoch(&mut self) -> Result<(), ModelError> {
        if let Some(epoch) = self.open_epoch.take() {
            self.interval("epoch_stop", Value::Null, json!({ "epoch_num": epoch }))?;
        }
        Ok(())
    }

    /// An evaluation's place: the epoch and the share of it done (as the
    /// reference logs `epoch_num`), and the samples trained on. DLRMv4
    /// counts them as steps times the global batch (its grid's unit), so
    /// an epoch's short last batch does not move later evaluations off it.
    fn eval_metadata(&self, epoch: u64, steps: u64) -> Value {
        let per_epoch = self.facts.train_samples.max(1) as f64;
        let done = self.samples_in_epoch as f64;
        let samples = match self.facts.dlrmv4 {
            Some(_) => steps * self.facts.global_batch_size,
            None => self.samples,
        };
        json!({
            "epoch_num": epoch as f64 + (done / per_epoch).min(1.0),
            "samples_count": samples,
        })
    }

    fn point(&mut self, key: &str, value: Value, metadata: Value) -> Result<(), ModelError> {
        self.line("POINT_IN_TIME", key, value, metadata)
    }

    /// `*_start` and `*_stop` keys are intervals' ends.
    fn interval(&mut self, key: &str, value: Value, metadata: Value) -> Result<(), ModelError> {
        let kind = if key.ends_with("_start") {
            "INTERVAL_START"
        } else {
            "INTERVAL_END"
        };
        self.line(kind, key, value, metadata)
    }

    fn line(
        &mut self,
        event_type: &str,
        key: &str,
        value: Value,
        mut metadata: Value,
    ) -> Result<(), ModelError> {
        let time_ms =
            (SystemTime::now().duration_since(UNIX_EPOCH)).map_or(0, |d| d.as_millis() as u64);
        merge(&mut metadata, json!({ "file": "ember", "lineno": 0 }));
        let record = json!({
            "namespace": "",
            "time_ms": time_ms,
            "event_type": event_type,
            "key": key,
            "value": value,
            "metadata": metadata,
        });
        let path = self.file.temp().to_path_buf();
        writeln!(self.file.file(), ":::MLLOG {record}")
            .map_err(|e| DataError::from_io(&path, e).into())
    }
}

/// An f32 hyperparameter as the decimal it was given as (1e-8, not
/// 9.99999993922529e-9): the rules compare values with `==`.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// Adds `extra`'s fields to the object `into`.
fn merge(into: &mut Value, extra: Value) {
    if let (Some(into), Value::Object(extra)) = (into.as_object_mut(), extra) {
        into.extend(extra);
    }
}
