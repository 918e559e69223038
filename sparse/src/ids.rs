//! How synthetic ids fall on a table's rows: uniformly, or by Zipf's law
//! (the `k`-th most frequent row drawn with probability proportional to
//! `k^-alpha`), the skew that real ids have and a cache of hot rows needs.
//!
//! The Zipf sampler is Hörmann and Derflinger's rejection-inversion
//! ("Rejection-inversion to generate variates from monotone discrete
//! distributions", ACM TOMACS 6(3), 1996), the method of Apache Commons'
//! `RejectionInversionZipfSampler`: exact for any number of rows, constant
//! time and memory per sample (no table of the distribution), about two
//! logarithms or exponentials a draw (28-74 ns at 40M rows, `benches/ids.rs`).
//! It is written here rather than taken from `rand_distr` so that it draws
//! from [`Rng`], whose sequence a seed fixes on every platform and version
//! (ingested data and benchmarks must not change under a dependency's
//! update), and because `rand_distr::Zipf` took 303 ns a draw at 40M rows.

use serde::{Deserialize, Serialize};

use crate::rng::Rng;
use crate::SparseError;

/// The distribution of synthetic ids over a table's rows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum IdDistribution {
    /// Every row equally likely: the worst case for a cache.
    Uniform,
    /// Zipf's law with exponent `alpha > 0`: the `k`-th most frequent row
    /// has probability `k^-alpha / H(rows, alpha)`. Ranks are scattered
    /// over the table by a fixed permutation, so hot rows are not
    /// neighbours in memory.
    Zipf {
        /// The exponent (`s` in the usual notation; larger is more skewed).
        alpha: f64,
    },
}

impl IdDistribution {
    /// A sampler of ids in `0..rows`. Fails when `rows` is 0 or `alpha` is
    /// not a finite number above 0.
    pub fn sampler(self, rows: u64) -> Result<IdSampler, SparseError> {
        if rows == 0 {
            return Err(SparseError::IdDistribution(
                "a table of 0 rows has no ids to draw".into(),
            ));
        }
        let zipf = match self {
            Self::Uniform => None,
            Self::Zipf { alpha } => Some(Zipf::new(rows, alpha)?),
        };
        Ok(IdSampler {
            rows,
            zipf,
            scatter: Scatter::new(rows),
        })
    }
}

impl std::fmt::Display for IdDistribution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Uniform => write!(f, "uniform"),
            Self::Zipf { alpha } => write!(f, "zipf (alpha {alpha})"),
        }
    }
}

/// Draws ids of one table (see [`IdDistribution::sampler`]).
#[derive(Clone, Debug)]
pub struct IdSampler {
    rows: u64,
    zipf: Option<Zipf>,
    scatter: Scatter,
}

impl IdSampler {
    /// The next id, in `0..rows`.
    #[inline]
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        match &self.zipf {
            None => rng.below(self.rows),
            Some(z) => self.scatter.apply(z.rank(rng)),
        }
    }

    /// The id of the row of frequency rank `rank` (0 is the most frequent),
    /// for `rank < rows`. Uniform ids have no ranks; this is then the
    /// same permutation, for symmetry.
    pub fn id_of_rank(&self, rank: u64) -> u64 {
        self.scatter.apply(rank)
    }
}

/// Rejection-inversion for Zipf's law on ranks `1..=n` (returned as `0..n`).
///
/// With `h(x) = x^-s` and its integral `H`, a draw inverts `H` at a uniform
/// point between `H(n + 1/2)` and `H(3/2) - h(1)`, rounds to the nearest
/// rank `k`, and accepts `k` when the point lies under `h(k)`'s share of
/// the area (a quick test settles most draws without computing it).
#[derive(Clone, Debug)]
struct Zipf {
    n: u64,
    s: f64,
    h_integral_x1: f64,
    h_integral_n: f64,
    quick_accept: f64,
}

impl Zipf {
    fn new(n: u64, s: f64) -> Result<Self, SparseError> {
        if !(s.is_finite() && s > 0.0) {
            return Err(SparseError::IdDistribution(format!(
                "the Zipf exponent must be a finite number above 0, not {s} (uniform ids are --id-distribution uniform)"
            )));
        }
        let mut z = Self {
            n,
            s,
            h_integral_x1: 0.0,
            h_integral_n: 0.0,
            quick_accept: 0.0,
        };
        z.h_integral_x1 = z.h_integral(1.5) - 1.0;
        z.h_integral_n = z.h_integral(n as f64 + 0.5);
        z.quick_accept = 2.0 - z.h_integral_inverse(z.h_integral(2.5) - z.h(2.0));
        Ok(z)
    }

    /// A rank in `0..n`, rank 0 the most likely.
    #[inline]
    fn rank(&self, rng: &mut Rng) -> u64 {
        loop {
            let u = self.h_integral_n + rng.next_f64() * (self.h_integral_x1 - self.h_integral_n);
            let x = self.h_integral_inverse(u);
            // Rounded to the nearest rank, kept in 1..=n against rounding.
            let k = ((x + 0.5) as u64).clamp(1, self.n);
            let kf = k as f64;
            if kf - x <= self.quick_accept || u >= self.h_integral(kf + 0.5) - self.h(kf) {
                return k - 1;
            }
        }
    }

    /// `h(x) = x^-s`.
    #[inline]
    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    /// `H(x) = (x^(1-s) - 1) / (1-s)` (`ln x` at `s = 1`), written so that
    /// it stays accurate near `s = 1`.
    #[inline]
    fn h_integral(&self, x: f64) -> f64 {
        let log_x = x.ln();
        exp_m1_over_x((1.0 - self.s) * log_x) * log_x
    }

    /// The inverse of [`h_integral`](Self::h_integral).
    #[inline]
    fn h_integral_inverse(&self, x: f64) -> f64 {
        // Below -1 only by rounding, where the exact value is -1.
        let t = (x * (1.0 - self.s)).max(-1.0);
        (ln_1p_over_x(t) * x).exp()
    }
}

/// `ln(1 + x) / x`, with its limit 1 (and series) near 0.
#[inline]
fn ln_1p_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// `(e^x - 1) / x`, with its limit 1 (and series) near 0.
#[inline]
fn exp_m1_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

/// A fixed permutation of `0..n`, `r -> (r * step) mod n` with `step`
/// coprime to `n` near `n / golden ratio`: consecutive ranks land far
/// apart, and every row is some rank's.
#[derive(Clone, Debug)]
struct Scatter {
    n: u64,
    step: u64,
}

impl Scatter {
    fn new(n: u64) -> Self {
        let mut step = ((n as f64 * 0.618_033_988_749_894_9) as u64).max(1);
        while gcd(step, n) != 1 {
            step += 1;
        }
        Self { n, step }
    }

    #[inline]
    fn apply(&self, r: u64) -> u64 {
        ((r as u128 * self.step as u128) % self.n as u128) as u64
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use proptest::prelude::{any, prop_assert, proptest};

    fn zipf(alpha: f64) -> IdDistribution {
        IdDistribution::Zipf { alpha }
    }

    /// The exact probability of each rank, from the definition.
    fn pmf(n: u64, s: f64) -> Vec<f64> {
        let w: Vec<f64> = (1..=n).map(|k| (k as f64).powf(-s)).collect();
        let total: f64 = w.iter().sum();
        w.iter().map(|x| x / total).collect()
    }

    #[test]
    fn ranks_follow_zipfs_law() {
        // Including s = 1 (the logarithmic case) and either side of it.
        for (n, s) in [(10u64, 0.5), (10, 1.0), (7, 1.05), (50, 1.5), (3, 3.0)] {
            let z = Zipf::new(n, s).unwrap();
            let mut rng = Rng::new(11);
            let draws = 400_000;
            let mut counts = vec![0u64; n as usize];
            for _ in 0..draws {
                counts[z.rank(&mut rng) as usize] += 1;
            }
            for (k, (&c, p)) in counts.iter().zip(pmf(n, s)).enumerate() {
                let expected = p * draws as f64;
                let sigma = (expected * (1.0 - p)).sqrt().max(1.0);
                assert!(
                    (c as f64 - expected).abs() < 5.0 * sigma,
                    "n {n}, s {s}, rank {k}: {c} draws, expected {expected:.0}"
                );
            }
        }
    }

    #[test]
    fn large_tables_put_the_expected_mass_on_the_top_ranks() {
        // 40M rows, s = 1.05: the top 1% of ranks hold H(400k)/H(40M) of
        // the mass, from the integral bounds of the sums.
        let (n, s) = (40_000_000u64, 1.05);
        let z = Zipf::new(n, s).unwrap();
        let harmonic = |m: f64| {
            // sum_{k<=m} k^-s ~ 1 + (m^(1-s) - 1) / (1-s) - correction; exact
            // enough over the first 1000 terms summed, the rest integrated.
            let head: f64 = (1..=1000).map(|k| (k as f64).powf(-s)).sum();
            let tail = ((m + 0.5).powf(1.0 - s) - 1000.5f64.powf(1.0 - s)) / (1.0 - s);
            head + tail
        };
        let expected = harmonic(n as f64 / 100.0) / harmonic(n as f64);
        let mut rng = Rng::new(3);
        let draws = 200_000;
        let top = (0..draws).filter(|_| z.rank(&mut rng) < n / 100).count() as f64 / draws as f64;
        assert!(
            (top - expected).abs() < 0.005,
            "top 1%: {top}, expected {expected}"
        );
    }

    #[test]
    fn bad_exponents_and_empty_tables_are_refused() {
        for alpha in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = zipf(alpha).sampler(10).unwrap_err().to_string();
            assert!(e.contains("Zipf exponent"), "{e}");
        }
        let e = IdDistribution::Uniform.sampler(0).unwrap_err().to_string();
        assert!(e.contains("0 rows"), "{e}");
    }

    #[test]
    fn the_same_seed_draws_the_same_ids() {
        let s = zipf(1.1).sampler(1000).unwrap();
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..100).map(|_| s.sample(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    proptest! {
        #[test]
        fn scatter_is_a_permutation(n in 1u64..5000) {
            let s = Scatter::new(n);
            let mut seen = vec![false; n as usize];
            for r in 0..n {
                let id = s.apply(r) as usize;
                prop_assert!(!seen[id], "row {} twice", id);
                seen[id] = true;
            }
        }

        #[test]
        fn ids_stay_in_the_table(
            rows in 1u64..u64::from(u32::MAX),
            alpha in 0.01f64..4.0,
            seed in any::<u64>(),
        ) {
            let mut rng = Rng::new(seed);
            for d in [IdDistribution::Uniform, zipf(alpha)] {
                let s = d.sampler(rows).unwrap();
                for _ in 0..200 {
                    prop_assert!(s.sample(&mut rng) < rows);
                }
            }
        }
    }
}
