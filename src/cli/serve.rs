//! `ember eval` and `ember predict`: a checkpoint on Parquet data. The
//! architecture comes from the checkpoint, so no model flags are needed.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Serialize;

use ember_dataloader::writer::PredictionWriter;
use ember_models::{Batch, Checkpoint, Dlrm};

use super::backend::{BackendArgs, ExecMode};
use super::data::LoaderArgs;
use super::train::MetricsReport;
use super::Progress;
use ember_models::evaluate_data;

#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
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

impl ServeArgs {
    fn open(&self) -> anyhow::Result<(Dlrm, ember_dataloader::Loader)> {
        anyhow::ensure!(
            self.mini_batch_size > 0,
            "--mini-batch-size must be at least 1"
        );
        let ckpt = Checkpoint::open(&self.checkpoint)?;
        let none = ember_sparse::TableOptimizer::None;
        let tiers = (self.tier).tiers(&ckpt.config().tables, &none, self.mini_batch_size)?;
        self.tier.make_dir()?;
        let dense = ember_dense::DenseOptimizerConfig::sgd(0.0);
        let model = ckpt.model_with_disk_tiers(none, dense, tiers)?;
        let config = model.config();
        let spec = self
            .loader
            .spec_for(&config.tables, config.num_dense(), &self.checkpoint)?;
        let loader = self.loader.open(&self.data, spec, self.mini_batch_size)?;
        super::data::has_rows(&loader, "--data", &self.data)?;
        Ok((model, loader))
    }
}

pub fn eval(args: &ServeArgs) -> anyhow::Result<MetricsReport> {
    super::with_threads(args.threads, || {
        let (mut model, loader) = args.open()?;
        let be = args.backend.build(ExecMode::Strict)?;
        let batches = loader.batches_per_epoch(0);
        Ok(evaluate_data(&mut model, be.dense(), &loader, batches)?.into())
    })?
}

#[derive(Args, Clone, Debug)]
pub struct PredictArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Parquet file to write: columns `logit` and `probability`, one row per input row.
    #[arg(long)]
    pub output: PathBuf,
}

#[derive(Debug, Serialize)]
pub struct PredictReport {
    pub rows: u64,
    pub output: PathBuf,
}

impl std::fmt::Display for PredictReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} predictions written to {}",
            self.rows,
            self.output.display()
        )
    }
}

pub fn predict(args: &PredictArgs) -> anyhow::Result<PredictReport> {
    super::with_threads(args.serve.threads, || {
        let (mut model, loader) = args.serve.open()?;
        refuse_an_input(&args.output, &args.serve.checkpoint, &loader)?;
        let be = args.serve.backend.build(ExecMode::Strict)?;
        let progress = Progress::new(loader.batches_per_epoch(0), "predict", args.serve.json);
        let mut out = PredictionWriter::create(&args.output)?;
        for batch in loader.epoch(0, 0) {
            let batch = Batch::from_loader(batch?)?;
            out.write(model.predict(be.dense(), &batch)?)?;
            progress.inc();
        }
        progress.finish();
        Ok(PredictReport {
            rows: out.finish()?,
            output: args.output.clone(),
        })
    })?
}

/// Writing over a file being read (or the checkpoint) would destroy it: the
/// output must be none of the inputs.
fn refuse_an_input(
    output: &Path,
    checkpoint: &Path,
    loader: &ember_dataloader::Loader,
) -> anyhow::Result<()> {
    let Some(out) = same_file_key(output) else {
        return Ok(());
    };
    // A checkpoint directory: the file that was read in it.
    let checkpoint = match checkpoint.is_dir() {
        true => ember_models::checkpoint::latest(checkpoint, None)?,
        false => Some(checkpoint.to_path_buf()),
    };
    if let Some(c) = checkpoint {
        anyhow::ensure!(
            same_file_key(&c).as_ref() != Some(&out),
            "--output {}: it is the checkpoint ({}); predictions go to a new file",
            output.display(),
            c.display()
        );
    }
    for f in loader.dataset().files() {
        if same_file_key(&f.path).as_ref() == Some(&out) {
            anyhow::bail!(
                "--output {}: it is one of the --data files ({}); predictions go to a new file",
                output.display(),
                f.path.display()
            );
        }
    }
    Ok(())
}

/// The canonical path `path` names (its directory canonical, for a file
/// not written yet), or `None` when its directory does not exist.
fn same_file_key(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Some(p);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Some(std::fs::canonicalize(dir).ok()?.join(path.file_name()?))
}
