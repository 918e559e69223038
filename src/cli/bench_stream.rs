//! `ember bench stream`: a DLRM trained on a stream of windows of drifting
//! raw-id data, each window evaluated before it is trained on
//! (progressive validation: no future leakage), so tables keyed by raw id
//! (`--kv-min-rows`) can be compared with `id mod rows` at the same bytes.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use ember_dataloader::IdTransform;
use ember_models::{
    evaluate, Backend, Batch, Dlrm, DriftingConfig, DriftingData, ExecMode, Metrics, Model,
};

use super::arch::{ArchArgs, OptimArgs};
use super::kv::{kv_report, kv_summary, KvTableReport};
use super::Progress;

#[derive(Args, Clone, Debug)]
pub struct StreamArgs {
    #[command(flatten)]
    pub arch: ArchArgs,
    #[command(flatten)]
    pub optim: OptimArgs,
    /// Windows of the stream: each is evaluated, then trained on.
    #[arg(long, default_value_t = 10)]
    pub windows: u64,
    /// Batches per window.
    #[arg(long, default_value_t = 20)]
    pub window_batches: u64,
    #[arg(long, default_value_t = 2048)]
    pub mini_batch_size: usize,
    /// Distinct raw ids per feature, as a multiple of --data-rows.
    #[arg(long, default_value_t = 100)]
    pub id_space: u64,
    /// How far popularity moves per window, as a share of --data-rows.
    #[arg(long, default_value_t = 0.5)]
    pub drift: f64,
    /// The rows the data's id space and drift are counted in, the same for
    /// every feature, so that models of other table sizes meet the same
    /// stream [default: each feature's table's rows].
    #[arg(long)]
    pub data_rows: Option<usize>,
    #[arg(long, default_value_t = 123)]
    pub seed: u64,
    /// Checkpoint here after each window: a full checkpoint after the
    /// first, a delta (the rows the window changed) after each later one;
    /// the report gives their bytes.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// One window's figures, measured before the model trained on it.
#[derive(Debug, Serialize)]
pub struct WindowReport {
    pub window: u64,
    pub auc: f64,
    pub logloss: f64,
    /// Bytes of the checkpoint written after training on the window (with
    /// --checkpoint-dir): full after window 0, a delta after the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct StreamReport {
    pub windows: Vec<WindowReport>,
    /// Mean AUC over the windows after the first (which meets an
    /// untrained model).
    pub mean_auc: f64,
    pub mean_logloss: f64,
    /// Bytes of the tables and their optimizer state (and key-value maps).
    pub table_bytes: u64,
    /// Training samples per second (evaluation not counted).
    pub train_samples_per_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_value_tables: Option<Vec<KvTableReport>>,
    /// With --checkpoint-dir: the median delta's bytes over the full
    /// checkpoint's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta_over_full: Option<f64>,
    pub run: super::run_info::RunInfo,
}

impl std::fmt::Display for StreamReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for w in &self.windows {
            writeln!(
                f,
                "window {}: auc {:.4}, logloss {:.4}",
                w.window, w.auc, w.logloss
            )?;
        }
        writeln!(
            f,
            "mean after window 0: auc {:.4}, logloss {:.4}; tables {:.1} MiB; {:.0} training samples/s",
            self.mean_auc,
            self.mean_logloss,
            self.table_bytes as f64 / (1 << 20) as f64,
            self.train_samples_per_s
        )?;
        if let Some(t) = &self.key_value_tables {
            writeln!(f, "{}", kv_summary(t))?;
        }
        let sizes: Vec<u64> = self
            .windows
            .iter()
            .filter_map(|w| w.checkpoint_bytes)
            .collect();
        if let (Some(full), Some(ratio)) = (sizes.first(), self.delta_over_full) {
            writeln!(
                f,
                "checkpoints: full {:.1} MiB, median delta {:.3} of it",
                *full as f64 / (1 << 20) as f64,
                ratio
            )?;
        }
        Ok(())
    }
}

/// The batch with the ids of tables not keyed by raw id reduced by
/// `id mod rows`, as the loader reduces them.
fn reduced(mut batch: Batch, model: &Dlrm) -> anyhow::Result<Batch> {
    let mut values = batch.sparse.values().to_vec();
    for t in &model.config().tables {
        if t.kv.is_some() {
            continue;
        }
        for f in &t.feature_names {
            let k = (batch.sparse.key_index(f))
                .ok_or_else(|| anyhow::anyhow!("no feature '{f}' in the batch"))?;
            for v in &mut values[batch.sparse.key_range(k)] {
                *v = IdTransform::Modulo.apply(*v, t.num_embeddings as u64);
            }
        }
    }
    batch.sparse = batch.sparse.with_values(values);
    Ok(batch)
}

/// Saves a delta of `model` in `dir` (a full checkpoint when there is no
/// chain of its own there yet); returns the bytes written.
fn checkpoint(model: &mut Dlrm, dir: &Path) -> anyhow::Result<u64> {
    let path = match model.save_checkpoint_delta(dir, None, u64::MAX)? {
        Some(path) => path,
        None => model.save_checkpoint(dir, None)?,
    };
    Ok(std::fs::metadata(&path)?.len())
}

pub fn run(args: &StreamArgs) -> anyhow::Result<StreamReport> {
    anyhow::ensure!(
        args.windows >= 2,
        "--windows {}: 2 at least (the first meets an untrained model)",
        args.windows
    );
    let (config, _, _) = args.arch.resolve()?;
    let data = DriftingData::new(DriftingConfig {
        num_dense: config.num_dense(),
        features: (config.feature_rows().into_iter())
            .map(|(name, rows)| (name, args.data_rows.unwrap_or(rows)))
            .collect(),
        space_per_row: args.id_space,
        window_batches: args.window_batches,
        drift: args.drift,
        seed: args.seed,
    })?;
    let mut model = Dlrm::builder(config)
        .optimizers(args.optim.table_optimizer(), args.optim.dense_optimizer())
        .seed(args.seed)
        .build()?;
    let be = Backend::native();
    // One writer of the checkpoint directory, as a training run's.
    let _lock = match &args.checkpoint_dir {
        Some(dir) => Some(ember_dataloader::lock::DirLock::acquire(
            dir,
            "ember bench stream",
        )?),
        None => None,
    };
    let progress = Progress::new(args.windows, "windows", args.json);
    let (mut windows, mut train_seconds) = (Vec::new(), 0.0);
    for w in 0..args.windows {
        let first = w * args.window_batches;
        let batches = (first..first + args.window_batches)
            .map(|i| reduced(data.batch(i, args.mini_batch_size), &model))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let Metrics { auc, logloss, .. } = evaluate(&mut model, &be, &batches)?;
        let start = Instant::now();
        for batch in &batches {
            model.train_step(&be, batch, ExecMode::Strict)?;
        }
        train_seconds += start.elapsed().as_secs_f64();
        let checkpoint_bytes = match &args.checkpoint_dir {
            Some(dir) => Some(checkpoint(&mut model, dir)?),
            None => None,
        };
        windows.push(WindowReport {
            window: w,
            auc,
            logloss,
            checkpoint_bytes,
        });
        progress.inc();
    }
    progress.finish();
    let later = &windows[1..];
    let mean = |f: fn(&WindowReport) -> f64| later.iter().map(f).sum::<f64>() / later.len() as f64;
    let samples = (args.windows * args.window_batches) as f64 * args.mini_batch_size as f64;
    let delta_over_full = windows[0].checkpoint_bytes.map(|full| {
        let mut deltas: Vec<u64> = later.iter().filter_map(|w| w.checkpoint_bytes).collect();
        deltas.sort_unstable();
        deltas[deltas.len() / 2] as f64 / full as f64
    });
    Ok(StreamReport {
        delta_over_full,
        mean_auc: mean(|w| w.auc),
        mean_logloss: mean(|w| w.logloss),
        windows,
        table_bytes: model.sparse_arch().bytes() as u64,
        train_samples_per_s: samples / train_seconds.max(1e-9),
        key_value_tables: kv_report(&model)?,
        run: super::run_info::RunInfo::now(),
    })
}
