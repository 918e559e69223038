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
    let (mut logits, mut labels) = (Vec::new(), Vec::new());
    for batch in batches {
        let batch = batch.borrow();
        logits.extend_from_slice(model.predict(be, batch)?);
        labels.extend_from_slice(&batch.labels);
    }
    let mut acc = MetricsAccumulator::default();
    push_over_ranks(model, &logits, &labels, &mut acc)?;
    Ok(acc.finish())
}

/// Pushes this process's predictions into `acc`; on a rank of a world,
/// every rank's (all ranks call this together).
pub fn push_over_ranks(
    model: &Dlrm,
    logits: &[f32],
    labels: &[f32],
    acc: &mut MetricsAccumulator,
) -> Result<(), ModelError> {
    let Some(comm) = model.world() else {
        acc.push(logits, labels);
        return Ok(());
    };
    let mine: Vec<u8> = (logits.iter().chain(labels))
        .flat_map(|v| v.to_le_bytes())
        .collect();
    for part in comm.all_gather(mine)? {
        let values: Vec<f32> = (part.chunks_exact(4))
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (l, y) = values.split_at(values.len() / 2);
        acc.push(l, y);
    }
    Ok(())
}
