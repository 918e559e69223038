//! How the optimizers change over a run: learning-rate schedules (for the
//! tables and the dense layers apart), weight decay and gradient clipping.
//! The [`Trainer`](crate::Trainer) gives them to the model before every
//! step ([`Model::set_optimization`](crate::Model::set_optimization)); a
//! checkpoint records them with its position, so a resumed run goes on
//! with the same rates, bit for bit.

use ember_dense::{DenseOptimizer, WeightDecay};
use ember_sparse::{TableOptimizer, TableStepSettings};
use serde::{Deserialize, Serialize};

/// dlrm_s_pytorch's floor under a decayed rate (`min_lr`).
const POLICY_MIN_LR: f64 = 1e-7;

/// A learning rate as a function of the step: the rate of the step taken
/// after `step` steps, from the optimizer's own (base) rate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LrSchedule {
    /// The base rate throughout.
    #[default]
    Constant,
    /// dlrm_s_pytorch's `LRPolicyScheduler` (`--lr-num-warmup-steps`,
    /// `--lr-decay-start-step`, `--lr-num-decay-steps`), stepped after each
    /// optimizer step as there, so step `k` (from 0) reads its count
    /// `s = k + 1`: below `warmup_steps` the rate is `base * s / warmup`;
    /// from `decay_start_step` for `decay_steps` steps it is
    /// `max(1e-7, base * ((decay - (s - start)) / decay)²)`; elsewhere, when
    /// it decays at all, it stays at the last rate set (so between warmup
    /// and decay at `base * (warmup - 1) / warmup`, after the decay at its
    /// last value), and without decay it is the base rate. Where the
    /// script has no last rate (no warmup step before a later decay) it
    /// fails; here the rate is the base.
    Policy {
        /// `--lr-num-warmup-steps`.
        warmup_steps: u64,
        /// `--lr-decay-start-step`; not before the warmup's end.
        decay_start_step: u64,
        /// `--lr-num-decay-steps` (0: no decay).
        decay_steps: u64,
    },
    /// Linear warmup from 0 (DLRMv4's): step `k` (from 0) at
    /// `base * min(1, (k + 1) / steps)`, the base rate from step
    /// `steps - 1` on.
    LinearWarmup {
        /// Steps to the base rate.
        steps: u64,
    },
}

impl LrSchedule {
    /// Refuses a policy whose decay starts before its warmup ends, as
    /// dlrm_s_pytorch does.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            LrSchedule::Policy {
                warmup_steps,
                decay_start_step,
                ..
            } if decay_start_step < warmup_steps => Err(format!(
                "the learning rate's warmup ({warmup_steps} steps) must finish before its \
                 decay starts (step {decay_start_step})"
            )),
            _ => Ok(()),
        }
    }

    /// Whether the rate is the base rate at every step.
    pub fn is_constant(&self) -> bool {
        match *self {
            LrSchedule::Constant => true,
            LrSchedule::Policy {
                warmup_steps,
                decay_steps,
                ..
            } => warmup_steps <= 1 && decay_steps == 0,
            LrSchedule::LinearWarmup { steps } => steps <= 1,
        }
    }

    /// The rate of the step taken after `step` steps, from base rate
    /// `base` (in f64, as the Python schedulers compute it, then f32).
    pub fn rate(&self, base: f32, step: u64) -> f32 {
        let base = base as f64;
        let rate = match *self {
            LrSchedule::Constant => base,
            LrSchedule::LinearWarmup { steps } if steps > 0 => {
                base * ((step + 1) as f64 / steps as f64).min(1.0)
            }
            LrSchedule::LinearWarmup { .. } => base,
            LrSchedule::Policy {
                warmup_steps: w,
                decay_start_step: d,
                decay_steps: n,
            } => {
                let s = step.saturating_add(1);
                let warm = |s: u64| base * (1.0 - (w - s) as f64 / w as f64);
                let decayed = |s: u64| {
                    let k = (s - d) as f64;
                    (base * ((n as f64 - k) / n as f64).powi(2)).max(POLICY_MIN_LR)
                };
                let end = d.saturating_add(n);
                if s < w {
                    warm(s)
                } else if d <= s && s < end {
                    decayed(s)
                } else if n == 0 {
                    base
                } else if s >= end && end >= 2 {
                    // Frozen at the decay's last rate (step end - 1 >= 1).
                    decayed(end - 1)
                } else if s < d && w >= 2 {
                    // Frozen at the warmup's last rate until the decay.
                    warm(w - 1)
                } else {
                    base
                }
            }
        };
        rate as f32
    }
}

/// Everything about the optimizers that a run sets beside their own
/// configuration; the default changes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Optimization {
    /// The tables' learning rate over the steps.
    #[serde(default)]
    pub sparse_schedule: LrSchedule,
    /// The dense layers' learning rate over the steps.
    #[serde(default)]
    pub dense_schedule: LrSchedule,
    /// Weight decay of the dense parameters (torch's L2 or AdamW's).
    #[serde(default)]
    pub dense_weight_decay: WeightDecay,
    /// FBGEMM's L2 weight decay of the tables (`WeightDecayMode.L2`: SGD,
    /// Adagrad and row-wise Adagrad), on the rows a batch reads.
    #[serde(default)]
    pub table_weight_decay: f32,
    /// Clip the dense gradients by their global L2 norm (torch's
    /// `clip_grad_norm_`; DLRMv4 clips at 1.0). The tables' gradients are
    /// fused into their update and never whole, as in TorchRec.
    #[serde(default)]
    pub max_grad_norm: Option<f32>,
}

/// Validated optimizations hold no NaN: equality is an equivalence (a
/// checkpoint's position, which holds one, compares whole).
impl Eq for Optimization {}

impl Optimization {
    /// Whether it changes nothing: the optimizers' own constant rates, no
    /// decay, no clipping.
    pub fn is_plain(&self) -> bool {
        self.sparse_schedule.is_constant()
            && self.dense_schedule.is_constant()
            && self.dense_weight_decay == WeightDecay::None
            && self.table_weight_decay == 0.0
            && self.max_grad_norm.is_none()
    }

    /// Whether it is the default (what a position without one recorded,
    /// from an earlier Ember, held).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// What the tables' fused update takes for the step after `step`
    /// steps, with `table` the optimizer it was built with: the schedule's
    /// rate (none when constant: the optimizer's own) and the decay.
    pub fn table_settings(&self, table: &TableOptimizer, step: u64) -> TableStepSettings {
        TableStepSettings {
            learning_rate: scheduled(&self.sparse_schedule, table.learning_rate(), step),
            weight_decay: self.table_weight_decay,
        }
    }

    /// Sets `dense`'s rate for the step after `step` steps and its decay.
    pub fn set_dense(&self, dense: &mut DenseOptimizer<f32>, step: u64) {
        let base = dense.config().learning_rate();
        dense.set_learning_rate(scheduled(&self.dense_schedule, base, step));
        dense.set_weight_decay(self.dense_weight_decay);
    }

    /// Refuses a schedule, decay or norm that no run can use.
    pub fn validate(&self) -> Result<(), String> {
        self.sparse_schedule.validate()?;
        self.dense_schedule.validate()?;
        self.dense_weight_decay.validate()?;
        let t = self.table_weight_decay;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!(
                "table weight decay {t}: must be a finite number >= 0"
            ));
        }
        match self.max_grad_norm {
            Some(n) if !(n.is_finite() && n > 0.0) => Err(format!(
                "gradient clipping norm {n}: must be a finite number > 0"
            )),
            _ => Ok(()),
        }
    }
}

/// A schedule's rate at `step`; `None` when constant (the optimizer's own
/// rate, as built).
fn scheduled(schedule: &LrSchedule, base: f32, step: u64) -> Option<f32> {
    (!schedule.is_constant()).then(|| schedule.rate(base, step))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// dlrm_s_pytorch's policy by hand: warmup 4, decay from step 6 over 4.
    #[test]
    fn policy_matches_the_hand_computed_rates() {
        let p = LrSchedule::Policy {
            warmup_steps: 4,
            decay_start_step: 6,
            decay_steps: 4,
        };
        // Counts s = 1..=12: warmup 1/4, 2/4, 3/4; frozen at 3/4 for
        // s = 4, 5; decay (4/4)², (3/4)², (2/4)², (1/4)²; frozen after.
        let expected = [
            0.25, 0.5, 0.75, 0.75, 0.75, 1.0, 0.5625, 0.25, 0.0625, 0.0625, 0.0625, 0.0625,
        ];
        let got: Vec<f32> = (0..12).map(|k| p.rate(1.0, k)).collect();
        assert_eq!(got, expected.map(|x: f64| x as f32));
        // The decayed rate never goes below dlrm_s_pytorch's min_lr.
        assert_eq!(p.rate(1e-6, 8), 1e-7);
    }

    #[test]
    fn policy_without_decay_is_the_base_after_warmup() {
        let p = LrSchedule::Policy {
            warmup_steps: 2,
            decay_start_step: 2,
            decay_steps: 0,
        };
        assert_eq!(
            [p.rate(0.1, 0), p.rate(0.1, 1), p.rate(0.1, 50)],
            [0.05, 0.1, 0.1]
        );
        // A decay from step 0: the counts start at 1, (3/3)² never seen.
        let d = LrSchedule::Policy {
            warmup_steps: 0,
            decay_start_step: 0,
            decay_steps: 3,
        };
        let got: Vec<f32> = (0..4).map(|k| d.rate(9.0, k)).collect();
        assert_eq!(got, [4.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn linear_warmup_reaches_the_base_at_its_last_step() {
        let w = LrSchedule::LinearWarmup { steps: 4 };
        let got: Vec<f32> = (0..6).map(|k| w.rate(2.0, k)).collect();
        assert_eq!(got, [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]);
        assert!(LrSchedule::LinearWarmup { steps: 1 }.is_constant());
    }

    #[test]
    fn a_decay_before_the_warmup_ends_is_refused() {
        let p = LrSchedule::Policy {
            warmup_steps: 10,
            decay_start_step: 5,
            decay_steps: 3,
        };
        assert!(p.validate().unwrap_err().contains("must finish before"));
    }
}
