//! Seeded parameter initializers (torch's `nn.Linear` default and xavier-normal).

use rand_xoshiro::rand_core::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::real::Real;
use crate::tensor::Tensor;

/// A deterministic stream of random numbers for initialization: the same seed gives the same
/// parameters on every machine (values are drawn in `f64` and then rounded to `T`).
#[derive(Clone, Debug)]
pub struct Initializer {
    rng: Xoshiro256PlusPlus,
}

impl Initializer {
    /// A stream seeded with `seed` (xoshiro256++).
    pub fn new(seed: u64) -> Self {
        Initializer {
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
        }
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Normal `N(mean, std²)` by Box-Muller (one draw per pair, for simplicity).
    pub fn normal(&mut self, mean: f64, std: f64) -> f64 {
        let u1 = 1.0 - self.unit(); // (0, 1], so ln is finite
        let u2 = self.unit();
        mean + std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `n` values uniform in `[-bound, bound)`.
    pub fn uniform_vec<T: Real>(&mut self, n: usize, bound: f64) -> Vec<T> {
        (0..n)
            .map(|_| T::from_f64(self.uniform(-bound, bound)))
            .collect()
    }

    /// A `[rows, cols]` tensor uniform in `[-bound, bound)`.
    pub fn uniform_tensor<T: Real>(&mut self, rows: usize, cols: usize, bound: f64) -> Tensor<T> {
        Tensor::from_fn(rows, cols, |_, _| T::from_f64(self.uniform(-bound, bound)))
    }

    /// torch's `xavier_normal_` (gain 1) for a `[rows, cols]` weight: fan_in = cols,
    /// fan_out = rows, std = sqrt(2 / (fan_in + fan_out)).
    pub fn xavier_normal<T: Real>(&mut self, rows: usize, cols: usize) -> Tensor<T> {
        let std = (2.0 / (rows + cols).max(1) as f64).sqrt();
        Tensor::from_fn(rows, cols, |_, _| T::from_f64(self.normal(0.0, std)))
    }
}
