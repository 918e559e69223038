//! `ember eval` and `ember predict`: a checkpoint on Parquet data. The
//! architecture comes from the checkpoint, so no model flags are needed.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Serialize;

use anyhow::Context;
use ember_dataloader::atomic::same_file;
use ember_dataloader::lock::DirLock;
use ember_dataloader::writer::PredictionWriter;
use ember_models::sequential::SequenceModelConfig;
use ember_models::{Checkpoint, Dlrm, Model, OutputCheck};

use super::backend::{BackendArgs, ExecMode};
use super::data::LoaderArgs;
use super::train::MetricsReport;
use super::Progress;
use ember_models::evaluate_data;

#[derive(Args, Clone, Debug)]
pub struct EvalArgs {
    /// A safetensors checkpoint (Ember's, or a TorchRec DLRM state_dict), a
    /// set's index, or a run's --checkpoint-dir (its newer checkpoint).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Parquet files or directories, read in order.
    #[arg(long, required = true, num_args = 1..)]
    pub data: Vec<PathBuf>,
    #[arg(long, default_value_t = 2048)]
    pub mini_batch_size: usize,
    #[command(flatten)]
    pub loader: LoaderArgs,
    /// Tables on the disk tier: a checkpoint larger than memory is served
    /// from files, streamed in a piece at a time.
    #[command(flatten)]
    pub tier: super::tier::TierArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

impl EvalArgs {
    /// The checkpoint's model and a loader of the data, reading its label
    /// column when `labels` (eval; predict reads data without one too).
    fn open(&self, labels: bool) -> anyhow::Result<Opened> {
        anyhow::ensure!(
            self.mini_batch_size > 0,
            "--mini-batch-size must be at least 1"
        );
        let ckpt = Checkpoint::open(&self.checkpoint)?;
        let none = ember_sparse::TableOptimizer::None;
        let dense = ember_dense::DenseOptimizerConfig::sgd(0.0);
        let batches = ember_models::BatchShape {
            batch_size: self.mini_batch_size,
            ..Default::default()
        };
        let model = (ckpt.builder().optimizers(none, dense))
            .disk_tier(self.tier.options()?)
            .batches(batches)
            .notes(&mut |line| eprintln!("{line}"))
            .build()
            .map_err(|e| self.tier.explain(e))?;
        let spec = self.loader.spec_for_checkpoint(&ckpt)?;
        let config = ember_dataloader::LoaderConfig {
            labels,
            ..self.loader.config(spec, self.mini_batch_size)
        };
        let loader = ember_dataloader::Loader::open(&self.data, config)?;
        super::data::has_rows(&loader, "--data", &self.data)?;
        Ok(Opened {
            model,
            loader,
            checkpoint_files: ckpt.files(),
        })
    }
}

/// A checkpoint's model, opened to serve data.
struct Opened {
    model: Dlrm,
    loader: ember_dataloader::Loader,
    /// The checkpoint's files, which no output may be.
    checkpoint_files: Vec<PathBuf>,
}

/// What `eval` reports: the metrics, and the checkpoint's key-value
/// tables' figures (their training's, and this run's fallback reads).
#[derive(Debug, serde::Serialize)]
pub struct EvalReport {
    #[serde(flatten)]
    pub metrics: MetricsReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_value_tables: Option<Vec<super::kv::KvTableReport>>,
}

impl std::fmt::Display for EvalReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.metrics)?;
        if let Some(t) = &self.key_value_tables {
            write!(f, "\n{}", super::kv::kv_summary(t))?;
        }
        Ok(())
    }
}

pub fn eval(args: &EvalArgs) -> anyhow::Result<EvalReport> {
    if let Some(config) = SequenceModelConfig::of_checkpoint(&args.checkpoint)? {
        anyhow::bail!(
            "{} is a {} checkpoint: eval reads DLRM checkpoints; `train --model {}` evaluates \
             sequence models, and `predict` scores their histories",
            args.checkpoint.display(),
            config.name(),
            config.name()
        );
    }
    super::with_threads(args.threads, || {
        let opened = args.open(true)?;
        let (mut model, loader) = (opened.model, opened.loader);
        let be = args.backend.build(ExecMode::Strict)?;
        let batches = loader.batches_per_epoch(0);
        let metrics = evaluate_data(&mut model, &be, &loader, batches)
            .with_context(|| format!("eval of {}", args.checkpoint.display()))?;
        Ok(EvalReport {
            metrics: metrics.into(),
            key_value_tables: super::kv::kv_report(&model)?,
        })
    })?
}

#[derive(Args, Clone, Debug)]
pub struct PredictArgs {
    #[command(flatten)]
    pub eval: EvalArgs,
    /// Parquet file to write: columns `logit` and `probability`, one row per input row
    /// (a sequence model's: one row per history, see the serving guide).
    #[arg(long)]
    pub output: PathBuf,
    /// Items a retrieval model (SASRec, HSTU retrieval) gives each history, best first.
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
}

#[derive(Debug, Serialize)]
pub struct PredictReport {
    pub rows: u64,
    pub output: PathBuf,
    /// From the first batch read to the last prediction written: the
    /// offline throughput serving is measured against.
    pub seconds: f64,
    pub samples_per_s: f64,
}

impl PredictReport {
    /// `rows` written to `output` since `started`.
    pub fn since(started: std::time::Instant, rows: u64, output: &Path) -> Self {
        let seconds = started.elapsed().as_secs_f64();
        Self {
            rows,
            output: output.to_path_buf(),
            seconds,
            samples_per_s: rows as f64 / seconds.max(1e-9),
        }
    }
}

impl std::fmt::Display for PredictReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} predictions written to {} ({:.0} samples/s)",
            self.rows,
            self.output.display(),
            self.samples_per_s
        )
    }
}

pub fn predict(args: &PredictArgs) -> anyhow::Result<PredictReport> {
    if let Some(config) = SequenceModelConfig::of_checkpoint(&args.eval.checkpoint)? {
        return super::predict_sequence::predict(args, &config);
    }
    super::with_threads(args.eval.threads, || {
        let opened = args.eval.open(false)?;
        let (mut model, loader) = (opened.model, opened.loader);
        refuse_an_input(&args.output, &opened.checkpoint_files, &loader)?;
        // One writer of the output's directory: two runs writing one file
        // would share its temporary file.
        let _lock = DirLock::for_file(&args.output, "ember predict").context("--output")?;
        let be = args.eval.backend.build(ExecMode::Strict)?;
        let progress = Progress::new(loader.batches_per_epoch(0), "predict", args.eval.json);
        let mut out = PredictionWriter::create(&args.output)?;
        let mut outputs = OutputCheck::default();
        let started = std::time::Instant::now();
        for batch in loader.epoch(0, 0) {
            let batch = batch?;
            let logits = model.predict(&be, &batch)?;
            outputs.push(logits);
            out.write(logits)?;
            progress.inc();
        }
        progress.finish();
        // Dropped unfinished, the writer leaves no file.
        (outputs.finish()).with_context(|| {
            format!(
                "predict with {}: nothing written",
                args.eval.checkpoint.display()
            )
        })?;
        Ok(PredictReport::since(started, out.finish()?, &args.output))
    })?
}

/// Writing over a file being read (or the checkpoint) would destroy it: the
/// output must be none of the inputs.
fn refuse_an_input(
    output: &Path,
    checkpoint: &[PathBuf],
    loader: &ember_dataloader::Loader,
) -> anyhow::Result<()> {
    if let Some(c) = checkpoint.iter().find(|c| same_file(c, output)) {
        anyhow::bail!(
            "--output {}: it is the checkpoint ({}); predictions go to a new file",
            output.display(),
            c.display()
        );
    }
    for f in loader.dataset().files() {
        if same_file(&f.path, output) {
            anyhow::bail!(
                "--output {}: it is one of the --data files ({}); predictions go to a new file",
                output.display(),
                f.path.display()
            );
        }
    }
    Ok(())
}
