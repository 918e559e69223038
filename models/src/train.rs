//! Evaluation over batches.

use std::borrow::Borrow;

use ember_dense::DenseBackend;

use crate::{Batch, Dlrm, Metrics, MetricsAccumulator, ModelError};

/// AUC, log loss and accuracy of the model's predictions on `batches`.
pub fn evaluate(
    model: &mut Dlrm,
    be: &dyn DenseBackend<f32>,
    batches: impl IntoIterator<Item = impl Borrow<Batch>>,
) -> Result<Metrics, ModelError> {
    let mut acc = MetricsAccumulator::default();
    for batch in batches {
        let batch = batch.borrow();
        let logits = model.predict(be, batch)?;
        acc.push(logits, &batch.labels);
    }
    Ok(acc.finish())
}
