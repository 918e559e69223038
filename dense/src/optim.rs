//! Optimizers for the dense parameters (the embedding tables have their own, fused into the
//! sparse backward).

use rayon::prelude::*;

use crate::error::DenseError;
use crate::param::Param;
use crate::real::Real;

/// Elements per rayon task of an update; tensors smaller than this update on one thread.
const CHUNK: usize = 1 << 14;

/// Which update rule, with torch's semantics (no weight decay, no momentum).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum DenseOptimizerConfig {
    /// `p -= lr * g`.
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// torch `Adagrad` with `initial_accumulator_value = 0`, `lr_decay = 0`:
    /// `s += g²; p -= lr * g / (sqrt(s) + eps)`.
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Added to `sqrt(s)` in the denominator, for stability.
        eps: f32,
    },
    /// torch `Adam` with bias correction:
    /// `m = b1 m + (1-b1) g; v = b2 v + (1-b2) g²;
    ///  p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
    Adam {
        /// Learning rate.
        lr: f32,
        /// Decay of the first moment `m` (torch `betas[0]`).
        beta1: f32,
        /// Decay of the second moment `v` (torch `betas[1]`).
        beta2: f32,
        /// Added to the bias-corrected `sqrt(v)` in the denominator, for stability.
        eps: f32,
    },
}

impl DenseOptimizerConfig {
    /// Plain SGD with learning rate `lr`.
    pub fn sgd(lr: f32) -> Self {
        DenseOptimizerConfig::Sgd { lr }
    }

    /// Adagrad with learning rate `lr` and torch's default `eps = 1e-10`.
    pub fn adagrad(lr: f32) -> Self {
        DenseOptimizerConfig::Adagrad { lr, eps: 1e-10 }
    }

    /// Adam with learning rate `lr` and torch's defaults `betas = (0.9, 0.999)`, `eps = 1e-8`.
    pub fn adam(lr: f32) -> Self {
        DenseOptimizerConfig::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f32 {
        match *self {
            DenseOptimizerConfig::Sgd { lr }
            | DenseOptimizerConfig::Adagrad { lr, .. }
            | DenseOptimizerConfig::Adam { lr, .. } => lr,
        }
    }

    /// The same rule at learning rate `lr`.
    pub fn with_learning_rate(mut self, lr: f32) -> Self {
        match &mut self {
            DenseOptimizerConfig::Sgd { lr: at }
            | DenseOptimizerConfig::Adagrad { lr: at, .. }
            | DenseOptimizerConfig::Adam { lr: at, .. } => *at = lr,
        }
        self
    }

    /// State tensors per parameter: Adam's two moments, Adagrad's sum of
    /// squares, none for SGD.
    pub fn state_tensors(&self) -> usize {
        match self {
            DenseOptimizerConfig::Sgd { .. } => 0,
            DenseOptimizerConfig::Adagrad { .. } => 1,
            DenseOptimizerConfig::Adam { .. } => 2,
        }
    }

    /// Adam's bias corrections at step `t` (from 1): `lr / (1 - b1^t)` and
    /// `1 / sqrt(1 - b2^t)`, in f64; `None` for the other optimizers.
    pub fn adam_bias_correction(&self, t: u64) -> Option<(f64, f64)> {
        let DenseOptimizerConfig::Adam {
            lr, beta1, beta2, ..
        } = *self
        else {
            return None;
        };
        let t = t as i32;
        Some((
            lr as f64 / (1.0 - (beta1 as f64).powi(t)),
            1.0 / (1.0 - (beta2 as f64).powi(t)).sqrt(),
        ))
    }
}

/// Weight decay of the dense parameters, in torch's two forms.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", content = "rate", rename_all = "snake_case")]
pub enum WeightDecay {
    /// None.
    #[default]
    None,
    /// L2 (torch's `weight_decay` of SGD, Adagrad and Adam): the gradient
    /// gains `rate * w` before the rule reads it.
    L2(f32),
    /// Decoupled (torch's `AdamW`): `w *= 1 - lr * rate` before the rule
    /// runs on the plain gradient; for SGD and Adagrad the same shrink.
    Decoupled(f32),
}

impl WeightDecay {
    /// The decay rate (0 for none).
    pub fn rate(&self) -> f32 {
        match *self {
            WeightDecay::None => 0.0,
            WeightDecay::L2(r) | WeightDecay::Decoupled(r) => r,
        }
    }

    /// Refuses a rate that is not a finite number `>= 0`.
    pub fn validate(&self) -> Result<(), String> {
        let r = self.rate();
        if r.is_finite() && r >= 0.0 {
            Ok(())
        } else {
            Err(format!(
                "dense weight decay {r}: must be a finite number >= 0"
            ))
        }
    }
}

/// torch's `clip_grad_norm_` (L2): when the gradients' global norm, over
/// every parameter, exceeds `max_norm`, scales them all by
/// `max_norm / (norm + 1e-6)`. Returns the norm before clipping, summed in
/// f64 (torch sums in the gradients' type).
pub fn clip_grad_norm<T: Real>(params: &mut [Param<'_, T>], max_norm: f64) -> f64 {
    let squares: f64 = (params.iter())
        .map(|p| p.grad.iter().map(|g| g.to_f64().powi(2)).sum::<f64>())
        .sum();
    let norm = squares.sqrt();
    let coefficient = max_norm / (norm + 1e-6);
    if coefficient < 1.0 {
        let c = T::from_f64(coefficient);
        for p in params.iter_mut() {
            p.grad.iter_mut().for_each(|g| *g *= c);
        }
    }
    norm
}

/// State of one parameter: Adagrad keeps its sum of squares in `v`; Adam uses both moments.
#[derive(Clone, Debug)]
struct Slot<T> {
    name: String,
    len: usize,
    m: Vec<T>,
    v: Vec<T>,
}

/// Applies a [`DenseOptimizerConfig`] to a list of [`Param`]s.
///
/// State is created on the first step and is keyed by the position of each parameter in the
/// list (names may repeat across modules, e.g. two MLPs); every later step must pass the same
/// parameters in the same order, which is checked by name and length.
#[derive(Clone, Debug)]
pub struct DenseOptimizer<T> {
    config: DenseOptimizerConfig,
    /// A schedule's rate for the next steps (`None`: the config's).
    learning_rate: Option<f32>,
    weight_decay: WeightDecay,
    steps: u64,
    slots: Vec<Slot<T>>,
}

impl<T: Real> DenseOptimizer<T> {
    /// An optimizer with no state yet: it is created on the first [`DenseOptimizer::step`].
    pub fn new(config: DenseOptimizerConfig) -> Self {
        DenseOptimizer {
            config,
            learning_rate: None,
            weight_decay: WeightDecay::None,
            steps: 0,
            slots: Vec::new(),
        }
    }

    /// The update rule and its hyperparameters.
    pub fn config(&self) -> DenseOptimizerConfig {
        self.config
    }

    /// The learning rate of the next step: a schedule's, or the config's.
    pub fn learning_rate(&self) -> f32 {
        (self.learning_rate).unwrap_or_else(|| self.config.learning_rate())
    }

    /// Sets the learning rate of the next steps (a schedule's; `None`: the
    /// config's again). The config and the state stay as they are.
    pub fn set_learning_rate(&mut self, lr: Option<f32>) {
        self.learning_rate = lr;
    }

    /// The weight decay of every step (none unless set).
    pub fn weight_decay(&self) -> WeightDecay {
        self.weight_decay
    }

    /// Sets the weight decay of the next steps.
    pub fn set_weight_decay(&mut self, decay: WeightDecay) {
        self.weight_decay = decay;
    }

    /// Steps taken so far (Adam's `t`).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Saved state per parameter, in parameter order: `(name, len, m, v)`,
    /// where Adagrad keeps its sum of squares in `v` and Adam both moments
    /// (torch's `exp_avg`, `exp_avg_sq`); unused moments are empty. Empty
    /// before the first step.
    pub fn state(&self) -> impl Iterator<Item = (&str, usize, &[T], &[T])> {
        (self.slots.iter()).map(|s| (s.name.as_str(), s.len, &s.m[..], &s.v[..]))
    }

    /// Restores what [`Self::state`] gave, and the step count, as a
    /// checkpoint does. The next `step` checks the names and lengths against
    /// the parameters, as after a first step.
    pub fn set_state(&mut self, steps: u64, state: Vec<(String, usize, Vec<T>, Vec<T>)>) {
        self.steps = steps;
        self.slots = (state.into_iter())
            .map(|(name, len, m, v)| Slot { name, len, m, v })
            .collect();
    }

    /// Updates every parameter from its gradient, at the current learning
    /// rate and with the weight decay set. L2 decay leaves the decayed
    /// gradient in the parameters' gradient buffers.
    ///
    /// # Panics
    /// When the parameters differ from those of the first step (a programming error).
    pub fn step(&mut self, mut params: Vec<Param<'_, T>>) {
        self.ensure_state(&params);
        self.steps += 1;
        let config = self.config.with_learning_rate(self.learning_rate());
        let bias_correction = config.adam_bias_correction(self.steps);
        for (p, slot) in params.iter_mut().zip(&mut self.slots) {
            match self.weight_decay {
                WeightDecay::None => {}
                WeightDecay::L2(rate) => {
                    let rate = T::from_f64(rate as f64);
                    let f = |(g, &w): (&mut T, &T)| *g += rate * w;
                    p.grad.iter_mut().zip(&*p.value).for_each(f);
                }
                WeightDecay::Decoupled(rate) => {
                    let keep = T::from_f64(1.0 - config.learning_rate() as f64 * rate as f64);
                    p.value.iter_mut().for_each(|w| *w *= keep);
                }
            }
            match config {
                DenseOptimizerConfig::Sgd { lr } => sgd(p, T::from_f64(lr as f64)),
                DenseOptimizerConfig::Adagrad { lr, eps } => adagrad(
                    p,
                    &mut slot.v,
                    T::from_f64(lr as f64),
                    T::from_f64(eps as f64),
                ),
                DenseOptimizerConfig::Adam {
                    beta1, beta2, eps, ..
                } => {
                    let (step_size, inv_bc2_sqrt) = bias_correction.expect("Adam's");
                    let k = AdamScalars {
                        b1: T::from_f64(beta1 as f64),
                        b2: T::from_f64(beta2 as f64),
                        step_size: T::from_f64(step_size),
                        inv_bc2_sqrt: T::from_f64(inv_bc2_sqrt),
                        eps: T::from_f64(eps as f64),
                    };
                    adam(p, &mut slot.m, &mut slot.v, &k)
                }
            }
        }
    }

    /// Creates the state on the first step; afterwards checks that the same parameters came.
    fn ensure_state(&mut self, params: &[Param<'_, T>]) {
        if self.steps == 0 && self.slots.is_empty() {
            let (moments, sums) = match self.config {
                DenseOptimizerConfig::Sgd { .. } => (false, false),
                DenseOptimizerConfig::Adagrad { .. } => (false, true),
                DenseOptimizerConfig::Adam { .. } => (true, true),
            };
            let zeros = |on: bool, n: usize| if on { vec![T::ZERO; n] } else { Vec::new() };
            self.slots = params
                .iter()
                .map(|p| Slot {
                    name: p.name.clone(),
                    len: p.value.len(),
                    m: zeros(moments, p.value.len()),
                    v: zeros(sums, p.value.len()),
                })
                .collect();
        }
        for index in 0..params.len().max(self.slots.len()) {
            let (p, s) = (params.get(index), self.slots.get(index));
            let ok = matches!((p, s), (Some(p), Some(s))
                if p.name == s.name && p.value.len() == s.len && p.grad.len() == s.len);
            if !ok {
                panic!(
                    "{}",
                    DenseError::ParamMismatch {
                        index,
                        got: p.map_or("<none>".into(), |p| format!(
                            "{} (grad of {})",
                            p.name,
                            p.grad.len()
                        )),
                        got_len: p.map_or(0, |p| p.value.len()),
                        expected: s.map_or("<none>".into(), |s| s.name.clone()),
                        expected_len: s.map_or(0, |s| s.len),
                    }
                );
            }
        }
    }
}

fn sgd<T: Real>(p: &mut Param<'_, T>, lr: T) {
    let f = |(w, &g): (&mut T, &T)| *w -= lr * g;
    if p.value.len() >= 2 * CHUNK {
        p.value
            .par_chunks_mut(CHUNK)
            .zip(p.grad.par_chunks_mut(CHUNK))
            .for_each(|(w, g)| w.iter_mut().zip(&*g).for_each(f));
    } else {
        p.value.iter_mut().zip(&*p.grad).for_each(f);
    }
}

fn adagrad<T: Real>(p: &mut Param<'_, T>, sum: &mut [T], lr: T, eps: T) {
    let f = |((w, &g), s): ((&mut T, &T), &mut T)| {
        *s += g * g;
        *w -= lr * g / (s.sqrt() + eps);
    };
    if p.value.len() >= 2 * CHUNK {
        p.value
            .par_chunks_mut(CHUNK)
            .zip(p.grad.par_chunks_mut(CHUNK))
            .zip(sum.par_chunks_mut(CHUNK))
            .for_each(|((w, g), s)| w.iter_mut().zip(&*g).zip(s).for_each(f));
    } else {
        p.value.iter_mut().zip(&*p.grad).zip(sum).for_each(f);
    }
}

struct AdamScalars<T> {
    b1: T,
    b2: T,
    step_size: T,
    inv_bc2_sqrt: T,
    eps: T,
}

fn adam<T: Real>(p: &mut Param<'_, T>, m: &mut [T], v: &mut [T], k: &AdamScalars<T>) {
    let f = |(((w, &g), m), v): (((&mut T, &T), &mut T), &mut T)| {
        *m = k.b1 * *m + (T::ONE - k.b1) * g;
        *v = k.b2 * *v + (T::ONE - k.b2) * g * g;
        *w -= k.step_size * *m / (v.sqrt() * k.inv_bc2_sqrt + k.eps);
    };
    if p.value.len() >= 2 * CHUNK {
        p.value
            .par_chunks_mut(CHUNK)
            .zip(p.grad.par_chunks_mut(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((w, g), m), v)| w.iter_mut().zip(&*g).zip(m).zip(v).for_each(f));
    } else {
        p.value.iter_mut().zip(&*p.grad).zip(m).zip(v).for_each(f);
    }
}
