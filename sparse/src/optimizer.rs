//! Table optimizers, applied row by row inside the backward scatter so that
//! no dense gradient of a table ever exists (FBGEMM's "fused" TBE optimizers).

use serde::{Deserialize, Serialize};

use crate::storage::AlignedBuffer;

/// The optimizer fused into a collection's backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TableOptimizer {
    /// No update: the collection is used for inference or forward benchmarks.
    None,
    /// w -= lr * g
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// Per element: s += g²; w -= lr * g / (sqrt(s) + eps)
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Added to sqrt(s) to keep the step finite.
        eps: f32,
    },
    /// FBGEMM's row-wise Adagrad, one state float per row:
    /// s += mean(g²); w -= lr * g / (sqrt(s) + eps)
    RowWiseAdagrad {
        /// Learning rate.
        lr: f32,
        /// Added to sqrt(s) to keep the step finite.
        eps: f32,
    },
    /// Adam with bias correction by the collection's step count. Only rows
    /// seen in a batch are updated (their moments are not decayed otherwise),
    /// as in FBGEMM's sparse Adam.
    Adam {
        /// Learning rate.
        lr: f32,
        /// Decay of the first moment (mean of g), in [0, 1).
        beta1: f32,
        /// Decay of the second moment (mean of g²), in [0, 1).
        beta2: f32,
        /// Added to sqrt(v̂) to keep the step finite.
        eps: f32,
    },
}

impl TableOptimizer {
    /// Rejects hyper-parameters that would turn the tables into NaN or inf.
    pub fn validate(&self) -> Result<(), String> {
        let ok = |v: f32| v.is_finite() && v >= 0.0;
        match *self {
            Self::None => Ok(()),
            Self::Sgd { lr } if ok(lr) => Ok(()),
            Self::Adagrad { lr, eps } | Self::RowWiseAdagrad { lr, eps } if ok(lr) && ok(eps) => {
                Ok(())
            }
            Self::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } if ok(lr)
                && ok(eps)
                && (0.0..1.0).contains(&beta1)
                && (0.0..1.0).contains(&beta2) =>
            {
                Ok(())
            }
            _ => Err(format!(
                "invalid optimizer {self:?}: lr and eps must be finite and >= 0, betas in [0, 1)"
            )),
        }
    }

    /// SGD at `lr`.
    pub fn sgd(lr: f32) -> Self {
        Self::Sgd { lr }
    }
    /// Adagrad at `lr`, with FBGEMM's default `eps = 1e-8`.
    pub fn adagrad(lr: f32) -> Self {
        Self::Adagrad { lr, eps: 1e-8 }
    }
    /// Row-wise Adagrad at `lr`, with FBGEMM's default `eps = 1e-8`.
    pub fn rowwise_adagrad(lr: f32) -> Self {
        Self::RowWiseAdagrad { lr, eps: 1e-8 }
    }
    /// Adam at `lr`, with FBGEMM's defaults `beta1 = 0.9`, `beta2 = 0.999`,
    /// `eps = 1e-8`.
    pub fn adam(lr: f32) -> Self {
        Self::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }

    /// The learning rate (0 for [`TableOptimizer::None`]).
    pub fn learning_rate(&self) -> f32 {
        match *self {
            Self::None => 0.0,
            Self::Sgd { lr }
            | Self::Adagrad { lr, .. }
            | Self::RowWiseAdagrad { lr, .. }
            | Self::Adam { lr, .. } => lr,
        }
    }

    /// State floats kept per row of a table with `dim` columns.
    pub fn state_floats_per_row(&self, dim: usize) -> usize {
        match self {
            Self::None | Self::Sgd { .. } => 0,
            Self::Adagrad { .. } => dim,
            Self::RowWiseAdagrad { .. } => 1,
            Self::Adam { .. } => 2 * dim,
        }
    }
}

/// Optimizer state of one table, laid out row-major so a row's state sits in
/// one place: `[rows, state_floats_per_row]` (for Adam, `[m | v]` per row).
#[derive(Clone, Debug)]
pub(crate) struct OptimizerState {
    per_row: usize,
    buffer: Option<AlignedBuffer>,
}

impl OptimizerState {
    pub(crate) fn new(opt: &TableOptimizer, rows: usize, dim: usize) -> Option<Self> {
        let per_row = opt.state_floats_per_row(dim);
        let buffer = if per_row == 0 {
            None
        } else {
            Some(AlignedBuffer::new(rows.checked_mul(per_row)?, |_| {})?)
        };
        Some(Self { per_row, buffer })
    }

    /// The state floats of every row, row-major.
    pub fn as_slice(&self) -> &[f32] {
        self.buffer.as_ref().map_or(&[], |b| b.as_slice())
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        self.buffer.as_mut().map_or(&mut [], |b| b.as_mut_slice())
    }

    pub fn floats_per_row(&self) -> usize {
        self.per_row
    }

    pub(crate) fn base_ptr(&mut self) -> *mut f32 {
        self.buffer
            .as_mut()
            .map_or(std::ptr::null_mut(), |b| b.as_mut_slice().as_mut_ptr())
    }
}

/// What a training loop sets between steps beside the optimizer's
/// configuration: the learning rate a schedule gives this step, and
/// FBGEMM's L2 weight decay (`WeightDecayMode.L2`). The default changes
/// nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TableStepSettings {
    /// The learning rate of the next steps (`None`: the optimizer's own).
    pub learning_rate: Option<f32>,
    /// FBGEMM's L2 decay: each seen row's summed gradient gains
    /// `weight_decay * w` before the update (0: none). Rows no batch
    /// touches do not decay, as in FBGEMM.
    pub weight_decay: f32,
}

impl TableStepSettings {
    /// Refuses a rate or decay that is not a finite number `>= 0`, and a
    /// decay for an optimizer FBGEMM's L2 mode does not serve here (SGD,
    /// Adagrad and row-wise Adagrad take one).
    pub fn validate(&self, optimizer: &TableOptimizer) -> Result<(), String> {
        let ok = |v: f32| v.is_finite() && v >= 0.0;
        if let Some(lr) = self.learning_rate.filter(|&lr| !ok(lr)) {
            return Err(format!("learning rate {lr}: must be a finite number >= 0"));
        }
        if !ok(self.weight_decay) {
            return Err(format!(
                "table weight decay {}: must be a finite number >= 0",
                self.weight_decay
            ));
        }
        let decays = matches!(
            optimizer,
            TableOptimizer::Sgd { .. }
                | TableOptimizer::Adagrad { .. }
                | TableOptimizer::RowWiseAdagrad { .. }
        );
        if self.weight_decay > 0.0 && !decays {
            return Err(format!(
                "table weight decay is for SGD, Adagrad and row-wise Adagrad, not {optimizer:?}"
            ));
        }
        Ok(())
    }
}

/// The scalars of one step, computed once for all rows: the learning
/// rate, the weight decay and Adam's bias corrections at step `t` (1-based).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepFactors {
    pub lr: f32,
    pub weight_decay: f32,
    pub correction1: f32,
    pub correction2: f32,
}

impl StepFactors {
    pub fn at(opt: &TableOptimizer, step: u64, settings: TableStepSettings) -> Self {
        let (correction1, correction2) = match opt {
            TableOptimizer::Adam { beta1, beta2, .. } => {
                (1.0 - beta1.powf(step as f32), 1.0 - beta2.powf(step as f32))
            }
            _ => (1.0, 1.0),
        };
        Self {
            lr: (settings.learning_rate).unwrap_or_else(|| opt.learning_rate()),
            weight_decay: settings.weight_decay,
            correction1,
            correction2,
        }
    }
}

/// Lanes of [`sum_of_squares`]: one 512-bit vector of fp32.
const SUM_LANES: usize = 16;

/// `Σ g²` in a fixed order on every instruction set: 16 interleaved
/// partial sums, then added pairwise. A one-by-one sum is a chain of
/// dependent adds that does not vectorise (half of the row-wise Adagrad
/// update's time at dim 128); this order does, and stays the same whatever
/// the ISA, so results do not depend on the machine.
#[inline(always)]
fn sum_of_squares(g: &[f32]) -> f32 {
    let mut acc = [0.0f32; SUM_LANES];
    let chunks = g.chunks_exact(SUM_LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (a, x) in acc.iter_mut().zip(chunk) {
            *a += x * x;
        }
    }
    for (a, x) in acc.iter_mut().zip(rest) {
        *a += x * x;
    }
    let mut half = SUM_LANES;
    while half > 1 {
        half /= 2;
        for i in 0..half {
            acc[i] += acc[i + half];
        }
    }
    acc[0]
}

/// Applies one optimizer step to one row, given the row's summed gradient
/// (which L2 weight decay changes in place). `state` is that row's state
/// (`state_floats_per_row` floats).
#[inline(always)]
pub(crate) fn update_row(
    opt: &TableOptimizer,
    factors: StepFactors,
    row: &mut [f32],
    grad: &mut [f32],
    state: &mut [f32],
) {
    if factors.weight_decay != 0.0 {
        // FBGEMM's L2 mode: g += decay * w, before the optimizer reads g.
        for (g, w) in grad.iter_mut().zip(&*row) {
            *g += factors.weight_decay * w;
        }
    }
    let grad = &*grad;
    let lr = factors.lr;
    match *opt {
        TableOptimizer::None => {}
        TableOptimizer::Sgd { .. } => {
            for (w, g) in row.iter_mut().zip(grad) {
                *w -= lr * g;
            }
        }
        TableOptimizer::Adagrad { eps, .. } => {
            for ((w, g), s) in row.iter_mut().zip(grad).zip(state.iter_mut()) {
                *s += g * g;
                *w -= lr * g / (s.sqrt() + eps);
            }
        }
        TableOptimizer::RowWiseAdagrad { eps, .. } => {
            let mean_sq = sum_of_squares(grad) / grad.len() as f32;
            state[0] += mean_sq;
            let step = lr / (state[0].sqrt() + eps);
            for (w, g) in row.iter_mut().zip(grad) {
                *w -= step * g;
            }
        }
        TableOptimizer::Adam {
            beta1, beta2, eps, ..
        } => {
            let (m, v) = state.split_at_mut(row.len());
            for (((w, g), m), v) in row.iter_mut().zip(grad).zip(m).zip(v) {
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                let m_hat = *m / factors.correction1;
                let v_hat = *v / factors.correction2;
                *w -= lr * m_hat / (v_hat.sqrt() + eps);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The lane-wise sum is the sum of squares to fp32's rounding:
        /// within n ulps of the float64 sum, for any length (whole lanes
        /// and a remainder).
        #[test]
        fn sum_of_squares_is_the_sum(g in proptest::collection::vec(-1e3f32..1e3, 0..300)) {
            let exact: f64 = g.iter().map(|&x| x as f64 * x as f64).sum();
            let got = sum_of_squares(&g) as f64;
            let bound = (g.len() + 1) as f64 * f32::EPSILON as f64 * exact;
            prop_assert!((got - exact).abs() <= bound, "{got} vs {exact}");
        }
    }
}
