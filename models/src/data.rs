//! Batches and synthetic data.
//!
//! Two generators, selected like dlrm_s_pytorch's `--data-generation`:
//! - `random`: uniform ids, uniform dense values in [0, 1), labels 0/1 with
//!   probability 1/2. Nothing to learn; for speed measurements.
//! - `learnable`: ids drawn from a power law (log-uniform over the rows, so a
//!   few thousand ids carry most of the traffic, as in click logs), and labels
//!   drawn from a fixed hidden logistic model of the features. A model that
//!   trains well approaches the hidden model's AUC.
//!
//! Batch `i` is a pure function of (seed, i): batches can be generated in any
//! order, on any thread, and a run is reproducible.

pub use ember_dataloader::Batch;
use ember_dense::Tensor;
use ember_sparse::rng::{mix, splitmix, Rng};
use ember_sparse::{IdDistribution, IdSampler, KeyedJaggedTensor};
use serde::{Deserialize, Serialize};

use crate::{ModelError, SyntheticError};

/// Which generator makes the batches (dlrm_s_pytorch's `--data-generation`;
/// serialised in lowercase: `random`, `learnable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataGeneration {
    /// Uniform ids, uniform dense values in [0, 1), labels 0/1 with
    /// probability 1/2: nothing to learn, for speed measurements.
    Random,
    /// Power-law ids and labels drawn from a fixed hidden logistic model of
    /// the features: a model that trains well approaches its AUC.
    Learnable,
}

/// What to generate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyntheticConfig {
    /// The generator.
    pub kind: DataGeneration,
    /// Dense features per sample (the columns of [`Batch::dense`]).
    pub num_dense: usize,
    /// Feature names and the number of rows of the table each one looks up.
    pub features: Vec<(String, usize)>,
    /// Ids per bag: exactly this many when `fixed_indices`, else uniform-ish
    /// in 1..=this many (dlrm_s_pytorch's rule).
    pub indices_per_lookup: usize,
    /// Per-feature override of `indices_per_lookup` (empty: none).
    #[serde(default)]
    pub indices_per_feature: Vec<usize>,
    /// Every bag holds exactly its number of ids (else a varying number).
    pub fixed_indices: bool,
    /// How ids fall on each table's rows; `None` is the generator's own:
    /// uniform for `Random`, a log-uniform rank for `Learnable`. Labels
    /// follow the generator either way.
    #[serde(default)]
    pub ids: Option<IdDistribution>,
    /// Seeds the batches and the hidden model: batch `i` is a pure
    /// function of (`seed`, `i`).
    pub seed: u64,
}

impl SyntheticConfig {
    /// Data for `model`'s dense and sparse features: `indices_per_lookup`
    /// ids per bag (varying, as dlrm_s_pytorch's default), no per-feature
    /// overrides.
    pub fn for_model(
        model: &crate::DlrmConfig,
        kind: DataGeneration,
        indices_per_lookup: usize,
        seed: u64,
    ) -> Self {
        Self {
            kind,
            num_dense: model.num_dense(),
            features: model.feature_rows(),
            indices_per_lookup,
            indices_per_feature: Vec::new(),
            fixed_indices: false,
            ids: None,
            seed,
        }
    }
}

/// Weight of each sparse feature's hidden effect (unit variance) in the
/// hidden logit: 26 features give the hidden model a logit spread of ~2.5,
/// an AUC near 0.87 for a perfect learner.
pub(crate) const SPARSE_EFFECT: f64 = 0.5;
/// Scale of the hidden weights of the dense features.
pub(crate) const DENSE_EFFECT: f64 = 1.5;

/// A deterministic synthetic data source.
#[derive(Clone, Debug)]
pub struct SyntheticData {
    config: SyntheticConfig,
    dense_weights: Vec<f64>,
    /// One per feature when `config.ids` is set.
    samplers: Vec<IdSampler>,
}

impl SyntheticData {
    /// A generator for `config`. Fails with [`ModelError::Synthetic`] when a
    /// feature's table has 0 rows, a bag size is 0, `indices_per_feature`
    /// is neither empty nor one per feature, or the id distribution is
    /// invalid.
    pub fn new(config: SyntheticConfig) -> Result<Self, ModelError> {
        if let Some((name, _)) = config.features.iter().find(|(_, rows)| *rows == 0) {
            return Err(SyntheticError::EmptyTable(name.clone()).into());
        }
        if !config.indices_per_feature.is_empty()
            && config.indices_per_feature.len() != config.features.len()
        {
            return Err(SyntheticError::BagSizes {
                given: config.indices_per_feature.len(),
                features: config.features.len(),
            }
            .into());
        }
        if config.indices_per_lookup == 0 || config.indices_per_feature.contains(&0) {
            return Err(SyntheticError::EmptyBags.into());
        }
        let mut rng = Rng::new(mix(&[config.seed, 0xDE45E]));
        let dense_weights = (0..config.num_dense)
            .map(|_| DENSE_EFFECT * (2.0 * rng.next_f64() - 1.0))
            .collect();
        let samplers = match config.ids {
            None => Vec::new(),
            Some(ids) => config
                .features
                .iter()
                .map(|(_, rows)| ids.sampler(*rows as u64))
                .collect::<Result<_, _>>()?,
        };
        Ok(Self {
            config,
            dense_weights,
            samplers,
        })
    }

    /// What it generates.
    pub fn config(&self) -> &SyntheticConfig {
        &self.config
    }

    /// Batch number `index` of `size` samples.
    pub fn batch(&self, index: u64, size: usize) -> Batch {
        let c = &self.config;
        let mut rng = Rng::new(mix(&[c.seed, index]));
        let mut dense = Tensor::zeros(size, c.num_dense);
        for x in dense.data_mut() {
            *x = rng.next_f32();
        }
        let num_features = c.features.len();
        let mut lengths = Vec::with_capacity(num_features * size);
        let mut values = Vec::with_capacity(num_features * size * c.indices_per_lookup);
        // Hidden logit per sample (only used by `learnable`).
        let mut logit = vec![0.0f64; size];
        for (f, (_, rows)) in c.features.iter().enumerate() {
            for z in logit.iter_mut() {
                let len = self.bag_length(&mut rng, f, *rows);
                lengths.push(len as i64);
                let mut effect = 0.0;
                for _ in 0..len {
                    let id = match (self.samplers.get(f), c.kind) {
                        (Some(ids), _) => ids.sample(&mut rng),
                        (None, DataGeneration::Random) => rng.below(*rows as u64),
                        (None, DataGeneration::Learnable) => power_law_id(&mut rng, *rows as u64),
                    };
                    effect += hidden_effect(c.seed, f, id);
                    values.push(id as i64);
                }
                *z += SPARSE_EFFECT * effect / len.max(1) as f64;
            }
        }
        let labels = match c.kind {
            DataGeneration::Random => (0..size).map(|_| (rng.below(2)) as f32).collect(),
            DataGeneration::Learnable => (0..size)
                .map(|s| {
                    let dense_part: f64 = dense
                        .row(s)
                        .iter()
                        .zip(&self.dense_weights)
                        .map(|(&x, w)| w * (x as f64 - 0.5))
                        .sum();
                    let p = 1.0 / (1.0 + (-(logit[s] + dense_part)).exp());
                    (rng.next_f64() < p) as u8 as f32
                })
                .collect(),
        };
        let keys = c.features.iter().map(|(name, _)| name.clone()).collect();
        let sparse = KeyedJaggedTensor::from_lengths(keys, values, &lengths, None)
            .expect("generated lengths always sum to the values");
        Batch {
            dense,
            sparse,
            labels,
        }
    }

    fn bag_length(&self, rng: &mut Rng, feature: usize, rows: usize) -> usize {
        let c = &self.config;
        let n = c
            .indices_per_feature
            .get(feature)
            .copied()
            .unwrap_or(c.indices_per_lookup);
        if self.config.fixed_indices {
            n
        } else {
            // dlrm_s_pytorch: max(1, round(U[0,1) * min(rows, n)))
            ((rng.next_f64() * rows.min(n) as f64).round() as usize).max(1)
        }
    }
}

/// A log-uniform rank (P(rank < x) = ln(1+x)/ln(1+rows)), scattered over the
/// table by a hash so hot rows are not neighbours in memory.
fn power_law_id(rng: &mut Rng, rows: u64) -> u64 {
    let rank = ((rows as f64 + 1.0).powf(rng.next_f64()) - 1.0) as u64;
    splitmix(rank) % rows
}

/// The hidden model's effect of id `id` of feature `f`: uniform with unit variance.
pub(crate) fn hidden_effect(seed: u64, f: usize, id: u64) -> f64 {
    let u = (mix(&[seed, f as u64, id]) >> 11) as f64 / (1u64 << 53) as f64;
    (2.0 * u - 1.0) * 3f64.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kind: DataGeneration, fixed: bool) -> SyntheticConfig {
        SyntheticConfig {
            kind,
            num_dense: 3,
            features: vec![("a".into(), 10), ("b".into(), 1000)],
            indices_per_lookup: 4,
            indices_per_feature: vec![],
            fixed_indices: fixed,
            ids: None,
            seed: 5,
        }
    }

    #[test]
    fn an_id_distribution_replaces_the_generators_own() {
        let zipf = IdDistribution::Zipf { alpha: 1.2 };
        for kind in [DataGeneration::Random, DataGeneration::Learnable] {
            let data = SyntheticData::new(SyntheticConfig {
                ids: Some(zipf),
                ..config(kind, true)
            })
            .unwrap();
            let batch = data.batch(0, 4096);
            let ids = &batch.sparse.values()[batch.sparse.key_range(1)];
            // The most frequent row of table b (1000 rows) has probability
            // 1 / H(1000, 1.2) = 0.229; a log-uniform rank gives no row
            // more than 1 / ln(1001) ~ 0.145.
            let top = zipf.sampler(1000).unwrap().id_of_rank(0) as i64;
            let share = ids.iter().filter(|&&id| id == top).count() as f64 / ids.len() as f64;
            assert!((share - 0.229).abs() < 0.02, "{kind:?}: {share}");
            assert_eq!(batch.sparse, data.batch(0, 4096).sparse);
        }
        let bad = SyntheticData::new(SyntheticConfig {
            ids: Some(IdDistribution::Zipf { alpha: -1.0 }),
            ..config(DataGeneration::Random, true)
        });
        assert!(
            matches!(bad, Err(ModelError::Sparse(e)) if e.to_string().contains("Zipf exponent"))
        );
    }

    #[test]
    fn batches_are_reproducible_and_in_range() {
        for kind in [DataGeneration::Random, DataGeneration::Learnable] {
            let data = SyntheticData::new(config(kind, false)).unwrap();
            let a = data.batch(3, 64);
            let b = data.batch(3, 64);
            assert_eq!(a.sparse, b.sparse);
            assert_eq!(a.labels, b.labels);
            assert_ne!(a.sparse, data.batch(4, 64).sparse);
            let lengths = a.sparse.lengths();
            assert!(lengths.iter().all(|&l| (1..=4).contains(&l)));
            let range_b = a.sparse.key_range(1);
            assert!(a.sparse.values()[range_b]
                .iter()
                .all(|&id| (0..1000).contains(&id)));
            assert!(a.labels.iter().all(|&y| y == 0.0 || y == 1.0));
        }
        let fixed = SyntheticData::new(config(DataGeneration::Random, true))
            .unwrap()
            .batch(0, 8);
        assert!(fixed.sparse.lengths().iter().all(|&l| l == 4));
    }

    #[test]
    fn power_law_concentrates_traffic() {
        let mut rng = Rng::new(1);
        let mut counts = std::collections::HashMap::new();
        for _ in 0..100_000 {
            *counts
                .entry(power_law_id(&mut rng, 100_000))
                .or_insert(0usize) += 1;
        }
        let mut c: Vec<usize> = counts.into_values().collect();
        c.sort_unstable_by(|a, b| b.cmp(a));
        let top1000: usize = c.iter().take(1000).sum();
        assert!(top1000 > 50_000, "top 1000 ids carry {top1000} of 100000");
    }
}
