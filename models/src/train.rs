//! Evaluation over batches.

use std::borrow::Borrow;

use ember_dense::DenseBackend;

use crate::{Batch, Dlrm, Metrics, MetricsAccumulator, ModelError};

/// AUC, log loss and accuracy of the model's predictions on `batches`. On a
/// rank of a world, over every rank's batches (each rank passes its own, and
/// as many as the others).
pub fn evaluate(
    model: &mut Dlrm,
    be: &dyn DenseBackend<f32>,
    batches: impl IntoIterator<Item = impl Borrow<Batch>>,
) -> Result<Metrics, ModelError> {
    let mut eval = Evaluation::default();
    for batch in batches {
        eval.push(model, be, batch.borrow())?;
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
}

impl Evaluation {
    /// Predicts `batch` and keeps the predictions with its labels.
    pub fn push(
        &mut self,
        model: &mut Dlrm,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<(), ModelError> {
        let ranks = model.world().is_some();
        let logits = model.predict(be, batch)?;
        if ranks {
            self.logits.extend_from_slice(logits);
            self.labels.extend_from_slice(&batch.labels);
        } else {
            self.acc.push(logits, &batch.labels);
        }
        Ok(())
    }

    /// The metrics over every prediction pushed (on a world, every rank's).
    pub fn finish(mut self, model: &Dlrm) -> Result<Metrics, ModelError> {
        if let Some(comm) = model.world() {
            let mine: Vec<u8> = (self.logits.iter().chain(&self.labels))
                .flat_map(|v| v.to_le_bytes())
                .collect();
            for part in comm.all_gather(mine)? {
                let values: Vec<f32> = (part.chunks_exact(4))
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let (l, y) = values.split_at(values.len() / 2);
                self.acc.push(l, y);
            }
        }
        Ok(self.acc.finish())
    }
}
