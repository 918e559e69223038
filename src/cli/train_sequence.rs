//! `ember train --model sasrec|hstu-retrieval|hstu-ranking`: a sequence
//! model on a user-history file (`ember ingest sequences`), trained by the
//! library's Trainer from the bucketed history loader, evaluated on the
//! held-out items at each epoch's end (or every `--eval-every` steps) and
//! tested at the end.
//!
//! The split is leave-one-out, as SASRec and HSTU's reference evaluate:
//! each user's last item is the test item and the one before it the
//! validation item; users of fewer than 4 items train on every item and
//! are not evaluated. Ranking holds out `--num-candidates` items the same
//! way (the last ones for test, the ones before for validation).

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_models::sequential::{
    evaluate_retrieval, read_histories, EvalNegatives, HistoryLoader, HstuRanking,
    HstuRankingConfig, HstuRetrieval, HstuRetrievalConfig, LeaveOut, NegativeSampling,
    RankingMetrics, RetrievalMetrics, SasRec, SasRecConfig, SasRecLoss, SequenceRetriever,
    UserHistory,
};
use ember_models::{
    Backend, ExecMode, FitOptions, Model, TrainData, TrainEvent, TrainState, Trainer, TrainerConfig,
};

use ember_models::mllog::{Dlrmv4Facts, RunFacts};
use ember_sparse::TableOptimizer;

use super::run_logs::RunLogs;
use super::train::TrainArgs;
use super::Progress;

/// The sequence models `ember train --model` trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SequenceModel {
    /// SASRec (causal self-attention, learned positions), the baseline.
    Sasrec,
    /// HSTU for next-item retrieval with sampled softmax.
    HstuRetrieval,
    /// HSTU ranking candidates' actions (DLRMv4's shape).
    HstuRanking,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SamplingArg {
    Uniform,
    InBatch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LossArg {
    Bce,
    SampledSoftmax,
}

/// `all`, or a count of sampled items.
fn parse_eval_negatives(text: &str) -> Result<EvalNegatives, String> {
    match text {
        "all" => Ok(EvalNegatives::All),
        n => match n.parse::<usize>() {
            Ok(n) if n > 0 => Ok(EvalNegatives::Sampled(n)),
            _ => Err(format!(
                "'{n}': `all` or a number of sampled items (SASRec's 100)"
            )),
        },
    }
}

/// The flags of `train --model`, named as SASRec's and HSTU's references
/// name them (in kebab case).
#[derive(Args, Clone, Debug)]
pub struct SequenceArgs {
    /// Train a sequence model on a user-history file (`--data`, from
    /// `ember ingest sequences`) instead of a DLRM.
    #[arg(long, value_enum)]
    pub model: Option<SequenceModel>,
    /// The most recent items read per user (SASRec's maxlen, HSTU's
    /// max_sequence_length; ranking: candidates included) [default: 200]
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// Item embedding and token width (SASRec's hidden_units) [default: 50]
    #[arg(long)]
    pub embedding_dim: Option<usize>,
    /// Attention blocks [default: 2]
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Heads a block [default: 1]
    #[arg(long)]
    pub num_heads: Option<usize>,
    /// HSTU's query and key width per head [default: embedding dim / heads]
    #[arg(long)]
    pub attention_dim: Option<usize>,
    /// HSTU's value and gate width per head [default: embedding dim / heads]
    #[arg(long)]
    pub linear_dim: Option<usize>,
    /// [default: 0.2]
    #[arg(long)]
    pub dropout_rate: Option<f64>,
    /// Sampled-softmax negatives a position [default: 128]
    #[arg(long)]
    pub num_negatives: Option<usize>,
    /// Where sampled-softmax negatives come from [default: uniform]
    #[arg(long, value_enum)]
    pub negative_sampling: Option<SamplingArg>,
    /// Divides the cosine similarities of the sampled softmax [default: 0.05]
    #[arg(long)]
    pub temperature: Option<f32>,
    /// SASRec's loss: bce (its own) or sampled-softmax (HSTU's) [default: bce]
    #[arg(long, value_enum)]
    pub loss: Option<LossArg>,
    /// Each held-out item ranked against `all` items or this many sampled
    /// ones the user never saw (SASRec's 100) [default: all]
    #[arg(long, value_parser = parse_eval_negatives)]
    pub eval_negatives: Option<EvalNegatives>,
    /// The cut-off of HR@k and NDCG@k.
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
    /// Ranking: candidates a user (its last items) [default: 8]
    #[arg(long)]
    pub num_candidates: Option<usize>,
    /// Ranking: action bits predicted, each a task [default: 2]
    #[arg(long)]
    pub num_tasks: Option<usize>,
    /// Sort windows of this many batches by history length before cutting
    /// them (1: no bucketing). Padded kernels gain from it; Ember's jagged
    /// ones do not, and like-length batches cost SASRec quality (HR@10
    /// 0.907 against 0.833 at 16 on the peer comparison's data).
    #[arg(long, default_value_t = 1)]
    pub bucket_batches: usize,
    /// Ranking: the dense Adam's betas, `B1,B2` (DLRMv4's: 0.95,0.999)
    /// [default: 0.9,0.98, HSTU's reference]
    #[arg(long, value_parser = parse_betas)]
    pub adam_betas: Option<(f32, f32)>,
    /// Ranking: the item table's row-wise Adagrad learning rate (DLRMv4
    /// ramps it with the dense one) [default: 0.05]
    #[arg(long)]
    pub sparse_learning_rate: Option<f32>,
}

/// `B1,B2`: Adam's two decays, each in [0, 1).
fn parse_betas(text: &str) -> Result<(f32, f32), String> {
    let parsed: Vec<f32> = (text.split(','))
        .map(|b| b.trim().parse::<f32>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("'{text}': {e}"))?;
    match parsed[..] {
        [b1, b2] if (0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2) => Ok((b1, b2)),
        _ => Err(format!("'{text}': two betas in [0, 1), as 0.95,0.999")),
    }
}

impl SequenceArgs {
    /// The sequence flags given (those with a default: when not at it).
    pub fn given(&self) -> Vec<&'static str> {
        [
            ("--max-seq-len", self.max_seq_len.is_some()),
            ("--embedding-dim", self.embedding_dim.is_some()),
            ("--num-blocks", self.num_blocks.is_some()),
            ("--num-heads", self.num_heads.is_some()),
            ("--attention-dim", self.attention_dim.is_some()),
            ("--linear-dim", self.linear_dim.is_some()),
            ("--dropout-rate", self.dropout_rate.is_some()),
            ("--num-negatives", self.num_negatives.is_some()),
            ("--negative-sampling", self.negative_sampling.is_some()),
            ("--temperature", self.temperature.is_some()),
            ("--loss", self.loss.is_some()),
            ("--eval-negatives", self.eval_negatives.is_some()),
            ("--top-k", self.top_k != 10),
            ("--num-candidates", self.num_candidates.is_some()),
            ("--num-tasks", self.num_tasks.is_some()),
            ("--bucket-batches", self.bucket_batches != 1),
            ("--adam-betas", self.adam_betas.is_some()),
            (
                "--sparse-learning-rate",
                self.sparse_learning_rate.is_some(),
            ),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// The given flags `model` has no use for.
    fn unused_by(&self, model: SequenceModel) -> Vec<&'static str> {
        let sampled_softmax = match model {
            SequenceModel::Sasrec => self.loss == Some(LossArg::SampledSoftmax),
            SequenceModel::HstuRetrieval => true,
            SequenceModel::HstuRanking => false,
        };
        let unused: &[&str] = match model {
            SequenceModel::Sasrec => &[
                "--attention-dim",
                "--linear-dim",
                "--negative-sampling",
                "--num-candidates",
                "--num-tasks",
                "--adam-betas",
                "--sparse-learning-rate",
            ],
            SequenceModel::HstuRetrieval => &[
                "--loss",
                "--num-candidates",
                "--num-tasks",
                "--adam-betas",
                "--sparse-learning-rate",
            ],
            SequenceModel::HstuRanking => &[
                "--loss",
                "--negative-sampling",
                "--eval-negatives",
                "--top-k",
            ],
        };
        let softmax_only = ["--num-negatives", "--temperature"];
        (self.given().into_iter())
            .filter(|f| unused.contains(f) || (!sampled_softmax && softmax_only.contains(f)))
            .collect()
    }
}

/// What one evaluation measured.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum Quality {
    Retrieval(RetrievalMetrics),
    Ranking(RankingMetrics),
}

impl std::fmt::Display for Quality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Quality::Retrieval(m) => write!(
                f,
                "HR@{k} {:.4}, NDCG@{k} {:.4}, MRR {:.4} ({} users)",
                m.hit_rate,
                m.ndcg,
                m.mrr,
                m.users,
                k = m.k
            ),
            Quality::Ranking(m) => {
                write!(f, "{} candidates, AUC by task:", m.candidates)?;
                for (t, task) in m.tasks.iter().enumerate() {
                    write!(f, " {t}: {:.4}", task.auc)?;
                }
                Ok(())
            }
        }
    }
}

/// One evaluation on the validation items (a JSON line with `--json`).
#[derive(Clone, Debug, Serialize)]
pub struct EvalRecord {
    pub event: &'static str,
    pub steps: u64,
    pub epoch: u64,
    #[serde(flatten)]
    pub quality: Quality,
}

#[derive(Debug, Serialize)]
pub struct SequenceTrainReport {
    pub event: &'static str,
    pub model: SequenceModel,
    /// Users trained on, and those evaluated.
    pub users: usize,
    pub evaluated_users: usize,
    pub items: usize,
    pub steps: u64,
    pub samples: u64,
    /// Training time, evaluations and checkpoints excluded.
    pub train_seconds: f64,
    pub seconds_per_epoch: f64,
    pub samples_per_s: f64,
    /// An epoch's tokens as padded batches would hold them, over the real
    /// ones (what bucketing saves a padded kernel).
    pub padded_over_real_tokens: f64,
    pub loss_first: f64,
    pub loss_last: f64,
    /// Every evaluation on the validation items.
    pub evals: Vec<EvalRecord>,
    /// On the test items, at the end.
    pub test: Quality,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<PathBuf>,
    /// The machine, date and command.
    pub run: super::run_info::RunInfo,
}

impl std::fmt::Display for SequenceTrainReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} steps, {} samples in {:.1} s ({:.2} s an epoch, {:.0} samples/s); loss {:.4} -> {:.4}\ntest: {}",
            self.steps,
            self.samples,
            self.train_seconds,
            self.seconds_per_epoch,
            self.samples_per_s,
            self.loss_first,
            self.loss_last,
            self.test
        )
    }
}

/// The model being trained (boxed: one of them lives for the run).
enum Built {
    SasRec(Box<SasRec>),
    Retrieval(Box<HstuRetrieval>),
    Ranking(Box<HstuRanking>),
}

impl Built {
    /// The item table's optimizer and the dense layers'.
    fn optimizers(&self) -> (TableOptimizer, ember_dense::DenseOptimizerConfig) {
        match self {
            Built::SasRec(m) => m.optimizers(),
            Built::Retrieval(m) => m.optimizers(),
            Built::Ranking(m) => m.optimizers(),
        }
    }

    fn model(&mut self) -> &mut dyn Model {
        match self {
            Built::SasRec(m) => m.as_mut(),
            Built::Retrieval(m) => m.as_mut(),
            Built::Ranking(m) => m.as_mut(),
        }
    }

    fn evaluate(
        &mut self,
        backend: &Backend,
        users: &[UserHistory],
        args: &SequenceArgs,
        max_len: usize,
    ) -> anyhow::Result<Quality> {
        let retriever: &mut dyn SequenceRetriever = match self {
            Built::SasRec(m) => m.as_mut(),
            Built::Retrieval(m) => m.as_mut(),
            Built::Ranking(m) => {
                return Ok(Quality::Ranking(m.evaluate(backend.dense(), users, 256)?))
            }
        };
        let negatives = args.eval_negatives.unwrap_or(EvalNegatives::All);
        let m = evaluate_retrieval(
            retriever,
            backend.dense(),
            users,
            (max_len + 1, 256),
            (negatives, args.top_k),
            1,
        )?;
        Ok(Quality::Retrieval(m))
    }
}

fn build(args: &TrainArgs, kind: SequenceModel, items: usize) -> anyhow::Result<Built> {
    let s = &args.sequence;
    let max_len = s.max_seq_len.unwrap_or(200);
    let dim = s.embedding_dim.unwrap_or(50);
    let heads = s.num_heads.unwrap_or(1);
    let blocks = s.num_blocks.unwrap_or(2);
    let sizes = [
        ("--max-seq-len", max_len),
        ("--embedding-dim", dim),
        ("--num-heads", heads),
        ("--num-blocks", blocks),
    ];
    for (flag, v) in sizes {
        anyhow::ensure!(v > 0, "{flag} must be at least 1");
    }
    anyhow::ensure!(
        heads <= dim,
        "--num-heads {heads}: more heads than --embedding-dim {dim} has columns"
    );
    let per_head = dim / heads;
    let dropout = s.dropout_rate.unwrap_or(0.2);
    let lr = args.optim.learning_rate.unwrap_or(1e-3);
    let seed = args.seed.unwrap_or(123);
    let negatives = s.num_negatives.unwrap_or(128);
    let temperature = s.temperature.unwrap_or(0.05);
    anyhow::ensure!(
        (0.0..1.0).contains(&dropout),
        "--dropout-rate {dropout}: must be within 0 and 1 (1 excluded)"
    );
    Ok(match kind {
        SequenceModel::Sasrec => Built::SasRec(Box::new(SasRec::new(SasRecConfig {
            hidden_units: dim,
            num_blocks: blocks,
            num_heads: heads,
            dropout_rate: dropout,
            lr,
            loss: match s.loss.unwrap_or(LossArg::Bce) {
                LossArg::Bce => SasRecLoss::Bce,
                LossArg::SampledSoftmax => SasRecLoss::SampledSoftmax {
                    negatives,
                    temperature,
                },
            },
            seed,
            ..SasRecConfig::new(items, max_len)
        })?)),
        SequenceModel::HstuRetrieval => {
            Built::Retrieval(Box::new(HstuRetrieval::new(HstuRetrievalConfig {
                embedding_dim: dim,
                num_blocks: blocks,
                num_heads: heads,
                attention_dim: s.attention_dim.unwrap_or(per_head),
                linear_dim: s.linear_dim.unwrap_or(per_head),
                num_negatives: negatives,
                negative_sampling: match s.negative_sampling.unwrap_or(SamplingArg::Uniform) {
                    SamplingArg::Uniform => NegativeSampling::Uniform,
                    SamplingArg::InBatch => NegativeSampling::InBatch,
                },
                temperature,
                dropout_rate: dropout,
                learning_rate: lr,
                seed,
                ..HstuRetrievalConfig::new(items, max_len)
            })?))
        }
        SequenceModel::HstuRanking => {
            let defaults = HstuRankingConfig::new(items, max_len);
            let sparse_lr = defaults.table_optimizer.learning_rate();
            Built::Ranking(Box::new(HstuRanking::new(HstuRankingConfig {
                embedding_dim: dim,
                num_blocks: blocks,
                num_heads: heads,
                attention_dim: s.attention_dim.unwrap_or(per_head),
                linear_dim: s.linear_dim.unwrap_or(per_head),
                num_candidates: s.num_candidates.unwrap_or(8),
                num_tasks: s.num_tasks.unwrap_or(2),
                head_hidden: dim,
                dropout_rate: dropout,
                learning_rate: lr,
                adam_betas: s.adam_betas.unwrap_or(defaults.adam_betas),
                table_optimizer: TableOptimizer::RowWiseAdagrad {
                    lr: s.sparse_learning_rate.unwrap_or(sparse_lr),
                    eps: 1e-8,
                },
                seed,
                ..defaults
            })?))
        }
    })
}

/// Steps between evaluations every `pct` % of an epoch of `samples`, as
/// DLRMv4's reference counts them (`data_pct_to_global_steps`): the
/// fraction taken in samples and divided once by the batch, rounded up.
fn grid_steps(pct: f64, samples: u64, batch: u64) -> u64 {
    ((pct / 100.0 * samples as f64 / batch.max(1) as f64).ceil() as u64).max(1)
}

/// The flags of a DLRM run that mean nothing to a sequence model.
fn dlrm_only_flags(args: &TrainArgs) -> Vec<&'static str> {
    let (l, sh, t) = (&args.loader, &args.sharding, &args.tier);
    let mut given = args.arch.given_architecture_flags();
    given.extend(l.given_column_flags());
    given.extend(
        [
            ("--optimizer", args.optim.optimizer.is_some()),
            (
                "--eval-data (the evaluation items are held out of --data)",
                !args.eval_data.is_empty(),
            ),
            ("--drop-last", args.drop_last),
            ("--loader-threads", l.loader_threads != 1),
            ("--prefetch", l.prefetch != 2),
            ("--devices", sh.devices.is_some()),
            (
                "--sharding",
                sh.sharding != super::plan::ShardingChoice::Auto,
            ),
            ("--plan", sh.plan.is_some()),
            ("--memory-per-device", sh.memory_per_device.is_some()),
            ("--disk-per-device", sh.disk_per_device.is_some()),
            ("--disk-dir", t.disk_dir.is_some()),
            ("--cache-memory", t.cache_memory.is_some()),
            (
                "--mode (sequence models run strict)",
                args.mode.mode != ExecMode::Strict,
            ),
            (
                "--dense-backend (sequence models run native)",
                args.backend.dense_backend != super::backend::BackendKind::Native,
            ),
            ("--compile-cache", args.backend.compile_cache.is_some()),
            ("--pjrt-plugin", args.backend.plugin.pjrt_plugin.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag)),
    );
    given
}

pub fn run(args: &TrainArgs, kind: SequenceModel) -> anyhow::Result<SequenceTrainReport> {
    let name = kind
        .to_possible_value()
        .map_or("?".into(), |v| v.get_name().to_string());
    let ignored = dlrm_only_flags(args);
    anyhow::ensure!(
        ignored.is_empty(),
        "--model {name}: {} apply to DLRM runs only",
        ignored.join(", ")
    );
    let ranking_only = [
        (
            "--mlperf-logging (DLRMv4's log)",
            args.mlperf.mlperf_logging.is_some(),
        ),
        (
            "--mlperf-auc-threshold (an AUC)",
            args.mlperf_auc_threshold.is_some(),
        ),
    ];
    if let (Some((flag, _)), false) = (
        ranking_only.iter().find(|(_, given)| *given),
        kind == SequenceModel::HstuRanking,
    ) {
        anyhow::bail!("--model {name}: {flag} is for --model hstu-ranking");
    }
    args.check_eval_flags()?;
    anyhow::ensure!(
        args.eval_every == 0 || args.eval_every_data_pct.is_none(),
        "--eval-every and --eval-every-data-pct: give one evaluation schedule"
    );
    let unused = args.sequence.unused_by(kind);
    anyhow::ensure!(
        unused.is_empty(),
        "--model {name} has no use for {}",
        unused.join(", ")
    );
    anyhow::ensure!(
        args.data.len() == 1 && args.data[0].is_file(),
        "--data: one user-history Parquet file (from `ember ingest sequences`), not {}",
        args.data
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    anyhow::ensure!(
        !args.resume || args.checkpoint_dir.is_some(),
        "--resume needs --checkpoint-dir"
    );
    super::with_threads(args.threads, || run_in_pool(args, kind))?
}

fn run_in_pool(args: &TrainArgs, kind: SequenceModel) -> anyhow::Result<SequenceTrainReport> {
    let s = &args.sequence;
    let path = &args.data[0];
    let users = read_histories(path)?;
    if kind == SequenceModel::HstuRanking {
        let r = users.iter().position(|u| u.actions.len() != u.items.len());
        if let Some(r) = r {
            anyhow::bail!(
                "{}: row {r} has no actions: ranking predicts them (ingest an action column; \
                 task t is bit t of the action)",
                path.display()
            );
        }
    }
    let items = 1 + users
        .iter()
        .flat_map(|u| &u.items)
        .max()
        .copied()
        .unwrap_or(0) as usize;
    let ranking = kind == SequenceModel::HstuRanking;
    let held = if ranking {
        s.num_candidates.unwrap_or(8)
    } else {
        1
    };
    let LeaveOut { train, valid, test } = LeaveOut::split(&users, held);
    let max_len = s.max_seq_len.unwrap_or(200);
    // Retrieval reads max_len inputs and the item after them.
    let window = if ranking { max_len } else { max_len + 1 };
    let batch = args.mini_batch_size.unwrap_or(128);
    anyhow::ensure!(batch > 0, "--mini-batch-size must be at least 1");
    let seed = args.seed.unwrap_or(123);
    let mut loader = HistoryLoader::new(train, batch, window).bucketed(s.bucket_batches);
    if !args.no_shuffle {
        loader = loader.shuffled(seed);
    }
    anyhow::ensure!(
        !loader.users().is_empty(),
        "{}: no user has 2 items or more to train on",
        path.display()
    );
    let (padded, real) = loader.padded_and_real_tokens(0);
    let mut built = build(args, kind, items)?;
    let backend = Backend::native();
    let mut state = TrainState::default();
    if args.resume {
        let dir = args.checkpoint_dir.as_ref().expect("checked in run");
        let path = dir.join(ember_models::checkpoint::CHECKPOINT_FILE);
        state = built.model().load_checkpoint(&path)?.unwrap_or_default();
    }
    let per_epoch = loader.batches_per_epoch(0);
    let total = (args.epochs.saturating_mul(per_epoch)).min(args.max_steps.unwrap_or(u64::MAX));
    let users_per_epoch = loader.users().len() as u64;
    let every = match (args.eval_every, args.eval_every_data_pct) {
        (0, Some(pct)) => grid_steps(pct, users_per_epoch, batch as u64),
        (0, None) => per_epoch.max(1),
        (steps, _) => steps,
    };
    let optimization = args.optimization.optimization()?;
    let progress = Progress::new(total, "train", args.json);
    let (table_optimizer, dense_optimizer) = built.optimizers();
    let facts = RunFacts {
        global_batch_size: batch as u64,
        train_samples: users_per_epoch,
        eval_samples: valid.len() as u64,
        ranks: 1,
        seed,
        table_optimizer,
        dense_optimizer,
        optimization,
        dlrmv4: Some(Dlrmv4Facts {
            max_sequence_length: max_len as u64,
            eval_every_fraction: match args.eval_every_data_pct {
                Some(pct) => pct / 100.0,
                None => (every * batch as u64) as f64 / users_per_epoch.max(1) as f64,
            },
        }),
    };
    let mlperf = (args.mlperf.mlperf_logging.as_deref())
        .map(|path| (path, args.mlperf.submission("dlrmv4"), facts.clone()));
    let rates = (
        (
            facts.table_optimizer.learning_rate(),
            facts.dense_optimizer.learning_rate(),
        ),
        optimization,
    );
    let mut logs = RunLogs::start(mlperf, &args.tensorboard, rates)?;
    let mut started = false;
    let mut evals = Vec::new();
    let (mut samples, mut seconds, mut loss_first, mut loss_last) = (0, 0.0, f64::NAN, f64::NAN);
    let mut checkpoint = None;
    while state.steps < total {
        let stop = ((state.steps / every + 1) * every).min(total);
        let trainer = Trainer::new(
            TrainerConfig {
                epochs: args.epochs,
                max_steps: Some(stop),
                mode: ExecMode::Strict,
                eval_at_epoch_end: false,
                checkpoint_dir: args.checkpoint_dir.clone(),
                checkpoint_every: args.checkpoint_every,
                log_every: args.print_freq.max(1),
                pipeline: !args.mode.no_pipeline,
                optimization,
                ..TrainerConfig::default()
            },
            Backend::native(),
        );
        let mut listen = |e: &TrainEvent| {
            // Each stretch between evaluations is one `fit`: the logs see
            // the run start once.
            if !matches!(e, TrainEvent::Start { .. }) || !std::mem::replace(&mut started, true) {
                logs.on_event(e);
            }
            match e {
            TrainEvent::Step { .. } => progress.inc(),
            TrainEvent::Log { .. } if args.json => {
                println!("{}", serde_json::to_string(e).expect("events serialise"))
            }
            TrainEvent::Log { epoch, batch, loss, ms_per_step, .. } => progress.line(&format!(
                "Finished training it {batch} of epoch {epoch}, {ms_per_step:.2} ms/it, loss {loss:.6}"
            )),
            _ => {}
        }
        };
        let options = FitOptions {
            eval: None,
            from: state.clone(),
            on_event: Some(&mut listen),
        };
        let summary = trainer.fit(built.model(), &loader, options)?;
        anyhow::ensure!(
            summary.state.steps > state.steps,
            "training stopped at step {} of {total}",
            state.steps
        );
        samples += summary.samples;
        seconds += summary.train_seconds;
        if loss_first.is_nan() {
            loss_first = summary.loss_first;
        }
        loss_last = summary.loss_last;
        checkpoint = summary.checkpoint.or(checkpoint);
        state = summary.state;
        // At an epoch's end the position is the next epoch's start: the
        // evaluation is of the epoch that ended, as the Trainer numbers it.
        let epoch = match state.batches_in_epoch {
            0 => state.epoch.saturating_sub(1),
            _ => state.epoch,
        };
        let steps = state.steps;
        logs.on_event(&TrainEvent::EvalStart { epoch, steps });
        let quality = built.evaluate(&backend, &valid, s, max_len)?;
        // DLRMv4's accuracy is the first task's AUC (the click).
        let first_task = match &quality {
            Quality::Ranking(r) => r.tasks.first().copied(),
            Quality::Retrieval(_) => None,
        };
        let mut reached = None;
        if let Some(metrics) = first_task {
            logs.on_event(&TrainEvent::Eval {
                epoch,
                steps,
                metrics,
            });
            let target = args.mlperf_auc_threshold.filter(|&t| metrics.auc >= t);
            if let Some(target) = target {
                let auc = metrics.auc;
                logs.on_event(&TrainEvent::TargetReached { steps, auc, target });
                reached = Some(steps);
            }
        }
        let record = EvalRecord {
            event: "eval",
            steps: state.steps,
            epoch: state.epoch,
            quality,
        };
        match args.json {
            true => println!("{}", serde_json::to_string(&record)?),
            false => progress.line(&format!(
                "valid at step {}: {}",
                record.steps, record.quality
            )),
        }
        evals.push(record);
        if let Some(steps) = reached {
            progress.line(&format!(
                "--mlperf-auc-threshold reached at step {steps}: stopping"
            ));
            break;
        }
    }
    progress.finish();
    logs.finish(&progress)?;
    let test = built.evaluate(&backend, &test, s, max_len)?;
    let epochs = samples as f64 / loader.users().len().max(1) as f64;
    Ok(SequenceTrainReport {
        event: "summary",
        model: kind,
        users: loader.users().len(),
        evaluated_users: valid.len(),
        items,
        steps: state.steps,
        samples,
        train_seconds: seconds,
        seconds_per_epoch: seconds / epochs.max(1e-9),
        samples_per_s: samples as f64 / seconds.max(1e-9),
        padded_over_real_tokens: padded as f64 / real.max(1) as f64,
        loss_first,
        loss_last,
        evals,
        test,
        checkpoint,
        run: super::run_info::RunInfo::now(),
    })
}
