//! Evaluation over batches.

use std::borrow::Borrow;

use crate::{
    Backend, Batch, BatchError, Metrics, MetricsAccumulator, Model, ModelError, TrainData,
};

/// AUC, log loss and accuracy of the model's predictions on `batches`. On a
/// rank of a world, over every rank's batches (each rank passes its own, and
/// as many as the others).
pub fn evaluate<M: Model + ?Sized>(
    model: &mut M,
    be: &Backend,
    batches: impl IntoIterator<Item = impl Borrow<Batch>>,
) -> Result<Metrics, ModelError> {
    let mut eval = Evaluation::default();
    for batch in batches {
        eval.push(model, be, batch.borrow())?;
    }
    eval.finish(model)
}

/// AUC, log loss and accuracy of the model's predictions on the first
/// `batches` batches of `data`'s epoch 0 (on a world: over every rank's,
/// each rank passing its own data and the same count).
pub fn evaluate_data<M: Model + ?Sized>(
    model: &mut M,
    be: &Backend,
    data: &dyn TrainData,
    batches: u64,
) -> Result<Metrics, ModelError> {
    let mut eval = Evaluation::default();
    for batch in data.epoch(0, 0).take(batches as usize) {
        eval.push(model, be, &batch?)?;
    }
    eval.finish(model)
}

/// Predictions on the way to metrics. Alone, they go straight into the
/// accumulator; on a rank of a world, they are kept until `finish` gathers
/// every rank's (all ranks call it together).
#[derive(Default)]
pub struct Evaluation {
    acc: MetricsAccumulator,
    logits: Vec<f32>,
    labels: Vec<f32>,
    outputs: OutputCheck,
}

/// Counts a model's outputs that are not finite (a diverged model's), in
/// the order they come: a prediction or an evaluation with any is an
/// error, never a NaN metric or file.
///
/// ```
/// let mut check = ember_models::OutputCheck::default();
/// check.push(&[0.5, -1.0]);
/// check.push(&[2.0, f32::NAN, f32::INFINITY]);
/// let error = check.finish().unwrap_err().to_string();
/// assert!(error.contains("2 of 5") && error.contains("row 3"), "{error}");
/// ```
#[derive(Clone, Debug, Default)]
pub struct OutputCheck {
    rows: u64,
    bad: u64,
    first: Option<(u64, f32)>,
}

impl OutputCheck {
    /// Checks the next outputs, one per row.
    pub fn push(&mut self, outputs: &[f32]) {
        for (i, &y) in outputs.iter().enumerate() {
            if !y.is_finite() {
                self.bad += 1;
                self.first.get_or_insert((self.rows + i as u64, y));
            }
        }
        self.rows += outputs.len() as u64;
    }

    /// An error when any output was not finite.
    pub fn finish(&self) -> Result<(), ModelError> {
        match self.first {
            Some((row, value)) => Err(ModelError::NonFiniteOutputs {
                count: self.bad,
                rows: self.rows,
                first_row: row,
                value,
            }),
            None => Ok(()),
        }
    }
}

impl Evaluation {
    /// Predicts `batch` and keeps the predictions with its labels.
    pub fn push<M: Model + ?Sized>(
        &mut self,
        model: &mut M,
        be: &Backend,
        batch: &Batch,
    ) -> Result<(), ModelError> {
        let ranks = model.world().is_some();
        let logits = model.predict(be, batch)?;
        if ranks {
            self.logits.extend_from_slice(logits);
            self.labels.extend_from_slice(&batch.labels);
        } else {
            self.outputs.push(logits);
            self.acc.push(logits, &batch.labels);
        }
        Ok(())
    }

    /// The metrics over every prediction pushed (on a world, every rank's);
    /// an error when there were none.
    pub fn finish<M: Model + ?Sized>(mut self, model: &M) -> Result<Metrics, ModelError> {
        if let Some(comm) = model.world() {
            let mine: Vec<u8> = (self.logits.iter().chain(&self.labels))
                .flat_map(|v| v.to_le_bytes())
                .collect();
            for part in comm.all_gather(mine)? {
                let values: Vec<f32> = (part.chunks_exact(4))
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let (l, y) = values.split_at(values.len() / 2);
                self.outputs.push(l);
                self.acc.push(l, y);
            }
        }
        self.outputs.finish()?;
        let metrics = self.acc.finish();
        if metrics.count == 0 {
            // AUC and log loss of nothing are NaN: an error, not a result.
            return Err(BatchError::NoRows.into());
        }
        Ok(metrics)
    }
}
