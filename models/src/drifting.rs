//! Synthetic click data for tables keyed by raw ids: 64-bit ids from a
//! space far larger than any table, whose popularity drifts from window to
//! window (new ids become hot, old ones go cold), with labels from a fixed
//! hidden logistic model of the ids, so a table that keeps the right ids
//! learns more than one whose ids collide.

use ember_dense::Tensor;
use ember_sparse::rng::{mix, Rng};
use ember_sparse::KeyedJaggedTensor;
use serde::{Deserialize, Serialize};

use crate::data::{hidden_effect, DENSE_EFFECT, SPARSE_EFFECT};
use crate::{Batch, ModelError, SyntheticError};

/// What to generate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriftingConfig {
    /// Dense features per sample.
    pub num_dense: usize,
    /// Feature names and the rows of the table each one looks up: feature
    /// `f` draws from `space_per_row × rows` distinct ids.
    pub features: Vec<(String, usize)>,
    /// Distinct ids per feature, as a multiple of its table's rows.
    pub space_per_row: u64,
    /// Batches per window: batch `i` is in window `i / window_batches`.
    pub window_batches: u64,
    /// How far popularity moves per window, as a share of the table's rows:
    /// the id at popularity rank `k` in window `w` is the one at rank
    /// `k + w × drift × rows` in window 0.
    pub drift: f64,
    /// Seeds the hidden model and the batches: batch `i` is a pure function
    /// of (`seed`, `i`).
    pub seed: u64,
}

/// A deterministic source of drifting raw-id batches (one id per bag).
#[derive(Clone, Debug)]
pub struct DriftingData {
    config: DriftingConfig,
    dense_weights: Vec<f64>,
}

impl DriftingData {
    /// A generator for `config`; fails on a table of 0 rows, a space or
    /// window of 0, or a drift that is not a finite share of at least 0.
    pub fn new(config: DriftingConfig) -> Result<Self, ModelError> {
        if let Some((name, _)) = config.features.iter().find(|(_, rows)| *rows == 0) {
            return Err(SyntheticError::EmptyTable(name.clone()).into());
        }
        if config.space_per_row == 0 || config.window_batches == 0 {
            return Err(SyntheticError::Drift("the id space and the window are 1 at least").into());
        }
        if !(config.drift >= 0.0 && config.drift.is_finite()) {
            return Err(SyntheticError::Drift("the drift is a finite share of at least 0").into());
        }
        let mut rng = Rng::new(mix(&[config.seed, 0xDE45E]));
        let dense_weights = (0..config.num_dense)
            .map(|_| DENSE_EFFECT * (2.0 * rng.next_f64() - 1.0))
            .collect();
        Ok(Self {
            config,
            dense_weights,
        })
    }

    /// What it generates.
    pub fn config(&self) -> &DriftingConfig {
        &self.config
    }

    /// The window batch `index` belongs to.
    pub fn window_of(&self, index: u64) -> u64 {
        index / self.config.window_batches
    }

    /// Batch number `index` of `size` samples: each feature's raw id (the
    /// `u64` as `i64` bits) and labels from the hidden model.
    pub fn batch(&self, index: u64, size: usize) -> Batch {
        let c = &self.config;
        let window = self.window_of(index);
        let mut rng = Rng::new(mix(&[c.seed, 0xD21F7, index]));
        let mut dense = Tensor::zeros(size, c.num_dense);
        for x in dense.data_mut() {
            *x = rng.next_f32();
        }
        let mut logit = vec![0.0f64; size];
        let mut values = Vec::with_capacity(c.features.len() * size);
        for (f, &(_, rows)) in c.features.iter().enumerate() {
            let space = rows as u64 * c.space_per_row;
            let shift = (window as f64 * c.drift * rows as f64) as u64;
            for z in logit.iter_mut() {
                // Log-uniform popularity over the space, as the learnable
                // generator's over a table, moved along by the drift.
                let rank = ((space as f64 + 1.0).powf(rng.next_f64()) - 1.0) as u64;
                let item = (rank.min(space - 1) + shift) % space;
                *z += SPARSE_EFFECT * hidden_effect(c.seed, f, item);
                values.push(mix(&[c.seed, 0x1D5, f as u64, item]) as i64);
            }
        }
        let labels = (0..size)
            .map(|s| {
                let dense_part: f64 = (dense.row(s).iter().zip(&self.dense_weights))
                    .map(|(&x, w)| w * (x as f64 - 0.5))
                    .sum();
                let p = 1.0 / (1.0 + (-(logit[s] + dense_part)).exp());
                (rng.next_f64() < p) as u8 as f32
            })
            .collect();
        let keys = c.features.iter().map(|(name, _)| name.clone()).collect();
        let lengths = vec![1; c.features.len() * size];
        let sparse =
            KeyedJaggedTensor::from_lengths(keys, values, &lengths, None).expect("one id a bag");
        Batch {
            dense,
            sparse,
            labels,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(drift: f64) -> DriftingData {
        DriftingData::new(DriftingConfig {
            num_dense: 2,
            features: vec![("a".into(), 100)],
            space_per_row: 100,
            window_batches: 4,
            drift,
            seed: 3,
        })
        .unwrap()
    }

    fn ids(d: &DriftingData, window: u64) -> std::collections::HashSet<i64> {
        (window * 4..window * 4 + 4)
            .flat_map(|i| d.batch(i, 512).sparse.values().to_vec())
            .collect()
    }

    #[test]
    fn ids_are_raw_and_their_popularity_drifts() {
        let d = data(5.0);
        let batch = d.batch(0, 1000);
        let again = d.batch(0, 1000);
        assert_eq!(batch.sparse, again.sparse);
        assert_eq!(batch.labels, again.labels);
        // Raw 64-bit ids, far past the table's 100 rows.
        assert!(batch
            .sparse
            .values()
            .iter()
            .any(|&v| !(0..100).contains(&v)));
        // Hot ids of window 0 go cold: fewer shared with a later window
        // than between two draws of the same window without drift.
        let (w0, w4) = (ids(&d, 0), ids(&d, 4));
        let still = data(0.0);
        let (s0, s4) = (ids(&still, 0), ids(&still, 4));
        assert!(w0.intersection(&w4).count() * 2 < s0.intersection(&s4).count());
        assert!(DriftingData::new(DriftingConfig {
            drift: f64::NAN,
            ..d.config().clone()
        })
        .is_err());
    }
}
