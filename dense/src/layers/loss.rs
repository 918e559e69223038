//! Binary cross-entropy on logits, the DLRM training loss.

use crate::backend::DenseBackend;
use crate::real::Real;
use crate::tensor::Tensor;

/// Mean BCE-with-logits plus its gradient, kept in a reused `[n, 1]`-shaped buffer that feeds
/// straight into the over arch's backward.
#[derive(Clone, Debug, Default)]
pub struct BceWithLogits<T> {
    grad: Tensor<T>,
    loss: T,
}

impl<T: Real> BceWithLogits<T> {
    /// A loss with an empty gradient buffer and a loss of 0 until the first
    /// [`BceWithLogits::forward_backward`].
    pub fn new() -> Self {
        BceWithLogits {
            grad: Tensor::default(),
            loss: T::ZERO,
        }
    }

    /// Stores the mean loss over the batch and `dL/dlogits = (sigmoid(z) - y) / n`, shaped
    /// `[n, 1]`. `logits` holds one logit per sample (`n` values, e.g. `[n, 1]`) and `labels`
    /// the `n` targets in `[0, 1]` (torch `BCEWithLogitsLoss`, mean reduction).
    pub fn forward_backward(&mut self, be: &dyn DenseBackend<T>, logits: &Tensor<T>, labels: &[T]) {
        be.bce_with_logits(logits.data(), labels, &mut self.grad, &mut self.loss);
    }

    /// The mean loss from the last [`BceWithLogits::forward_backward`].
    pub fn loss(&self) -> T {
        self.loss
    }

    /// The gradient from the last [`BceWithLogits::forward_backward`].
    pub fn grad(&self) -> &Tensor<T> {
        &self.grad
    }
}
