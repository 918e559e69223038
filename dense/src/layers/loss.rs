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
    pub fn new() -> Self {
        BceWithLogits {
            grad: Tensor::default(),
            loss: T::ZERO,
        }
    }

    /// Stores the mean loss and `dL/dlogits` (shaped like `logits`).
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
