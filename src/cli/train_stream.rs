//! `ember train --stream-window`: the `--data` inputs, in natural name
//! order (`day_2` before `day_10`, as Criteo's days), are the windows of a
//! stream. Each window is evaluated by the model trained on the windows
//! before it (no future leakage), then trained on once; a checkpoint
//! records the window, so `--resume` goes on mid-stream exactly.

use std::path::PathBuf;

use serde::Serialize;

use ember_dataloader::{Dataset, DatasetSpec};
use ember_models::checkpoint::{natural_key, TrainState};
use ember_models::{Dlrm, Evaluation, FitOptions, TrainEvent, TrainSummary, Trainer};

use super::train::TrainArgs;
use super::world::Launch;

/// One window's figures, taken before the model trained on it.
#[derive(Debug, Serialize)]
pub struct WindowReport {
    /// Always `"window"` (a JSON line among the trainer's events).
    pub event: &'static str,
    pub window: u64,
    pub file: PathBuf,
    pub rows: usize,
    pub auc: f64,
    pub logloss: f64,
    /// The key-value tables' figures so far (its evaluation's reads too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_value_tables: Option<Vec<super::kv::KvTableReport>>,
}

impl std::fmt::Display for WindowReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "window {} ({}), before training on it: auc {:.4}, logloss {:.6} ({} rows)",
            self.window,
            self.file.display(),
            self.auc,
            self.logloss,
            self.rows
        )
    }
}

/// The windows, in natural order of their paths: the `--data` inputs
/// (files, or directories such as one `ingest` run's output each), or with
/// one directory of plain Parquet files, its files.
pub fn windows(inputs: &[PathBuf], dataset: &Dataset) -> Vec<PathBuf> {
    let mut windows = match inputs {
        [one] if one.is_dir() => dataset.files().iter().map(|f| f.path.clone()).collect(),
        _ => inputs.to_vec(),
    };
    windows.sort_by_key(|p| natural_key(&p.to_string_lossy()));
    windows
}

/// Trains `model` on the stream of `files` from `state` (a fresh run's, or
/// a checkpoint's with its window), evaluating each window first; returns
/// the run's summary (the windows' together) and each window's figures.
pub fn fit_stream(
    args: &TrainArgs,
    launch: &Launch,
    (files, spec, mut state, trainer): (&[PathBuf], &DatasetSpec, TrainState, &Trainer),
    model: &mut Dlrm,
    on_event: &mut dyn FnMut(&TrainEvent),
    on_window: &mut dyn FnMut(&WindowReport),
) -> anyhow::Result<TrainSummary> {
    // Where the stream stands: a window finished (its epoch done) goes on
    // with the next; one in progress goes on where it stopped, its
    // evaluation already reported.
    let (mut window, mut evaluate) = match state.window {
        None if state.is_fresh() => (0, true),
        None => anyhow::bail!(
            "--stream-window: the checkpoint is not from a stream (it records no window); resume without --stream-window"
        ),
        Some(w) if state.epoch >= 1 => (w + 1, true),
        Some(w) => (w, false),
    };
    if evaluate {
        // A window starts afresh: its own data, from its first batch.
        (state.epoch, state.batches_in_epoch, state.data_fingerprint) = (0, 0, 0);
    }
    let mut total: Option<TrainSummary> = None;
    while (window as usize) < files.len() {
        let file = &files[window as usize];
        state.window = Some(window);
        let dataset = Dataset::open(std::slice::from_ref(file))?;
        let (loader, _) = args.loaders(launch, spec, dataset, &state)?;
        if evaluate && window > 0 {
            let mut eval = Evaluation::default();
            for batch in loader.epoch(0, 0) {
                eval.push(model, trainer.backend(), &batch?)?;
            }
            let metrics = eval.finish(model)?;
            on_window(&WindowReport {
                event: "window",
                window,
                file: file.clone(),
                rows: metrics.count,
                auc: metrics.auc,
                logloss: metrics.logloss,
                key_value_tables: super::kv::kv_report(model)?,
            });
        }
        let summary = trainer.fit(
            model,
            &loader,
            FitOptions {
                eval: None,
                from: state.clone(),
                on_event: Some(&mut *on_event),
            },
        )?;
        state = summary.state.clone();
        let reached_max = args.max_steps.is_some_and(|m| state.steps >= m);
        total = Some(match total {
            None => summary,
            Some(t) => TrainSummary {
                samples: t.samples + summary.samples,
                train_seconds: t.train_seconds + summary.train_seconds,
                data_wait_seconds: t.data_wait_seconds + summary.data_wait_seconds,
                input_dist_seconds: t.input_dist_seconds + summary.input_dist_seconds,
                compute_seconds: t.compute_seconds + summary.compute_seconds,
                loss_first: t.loss_first,
                resumed_at_step: t.resumed_at_step,
                ..summary
            },
        });
        if reached_max || state.epoch == 0 {
            break;
        }
        (state.epoch, state.batches_in_epoch, state.data_fingerprint) = (0, 0, 0);
        window += 1;
        evaluate = true;
    }
    total.ok_or_else(|| {
        anyhow::anyhow!(
            "--stream-window: every one of the {} windows is trained already",
            files.len()
        )
    })
}
