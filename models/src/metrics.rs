//! Evaluation metrics on logits and 0/1 labels, under TorchRec's
//! definitions where it has them (`torchrec.metrics`: `ne`, `calibration`,
//! `ctr`).

use serde::Serialize;

/// Metrics over a set of predictions (NaN where undefined: no samples, one class).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Metrics {
    /// Exact ROC AUC (ties get half credit); NaN when one class is absent.
    pub auc: f64,
    /// Mean binary cross-entropy of sigmoid(logit).
    pub logloss: f64,
    /// Share of predictions on the right side of probability 0.5.
    pub accuracy: f64,
    /// Normalized entropy (TorchRec's `NE`): the cross-entropy summed over
    /// the samples, over that of always predicting the observed CTR (the
    /// entropy of the labels); below 1 is better than the base rate. NaN
    /// with one class.
    pub ne: f64,
    /// Predicted over observed CTR (TorchRec's `calibration`: the sum of
    /// the probabilities over the sum of the labels); 1 is calibrated. NaN
    /// with no positive.
    pub calibration: f64,
    /// Observed CTR: the share of positive labels (TorchRec's `ctr`).
    pub ctr: f64,
    /// Of the samples predicted positive (probability above 0.5, as
    /// dlrm_s_pytorch rounds), the share that are (scikit-learn's
    /// `precision_score`; 0 when none is predicted positive).
    pub precision: f64,
    /// Of the positives, the share predicted positive (`recall_score`; 0
    /// with no positive).
    pub recall: f64,
    /// `2 precision recall / (precision + recall)` (`f1_score`; 0 when both are).
    pub f1: f64,
    /// Average precision (`average_precision_score`): over the scores from
    /// the highest, each distinct score's precision weighted by the recall
    /// it adds; NaN with no positive.
    pub average_precision: f64,
    /// Number of predictions (`rows` in JSON, as the command line names
    /// them).
    #[serde(rename = "rows")]
    pub count: usize,
}

/// Accumulates (logit, label) pairs, then computes [`Metrics`].
#[derive(Clone, Debug, Default)]
pub struct MetricsAccumulator {
    scores: Vec<(f32, bool)>,
    logloss_sum: f64,
    correct: usize,
    positives: usize,
    /// Positives predicted positive (z > 0).
    true_positives: usize,
    /// Samples predicted positive.
    predicted_positives: usize,
    probability_sum: f64,
}

impl MetricsAccumulator {
    /// Adds a batch's logits and their 0/1 labels (a label above 0.5 is
    /// positive), pair by pair.
    pub fn push(&mut self, logits: &[f32], labels: &[f32]) {
        for (&z, &y) in logits.iter().zip(labels) {
            let positive = y > 0.5;
            let z = z as f64;
            // log(1 + e^-|z|) + max(z, 0) - z*y, stable for large |z|.
            self.logloss_sum += z.max(0.0) - z * y as f64 + (-z.abs()).exp().ln_1p();
            if (z > 0.0) == positive {
                self.correct += 1;
            }
            self.positives += usize::from(positive);
            self.predicted_positives += usize::from(z > 0.0);
            self.true_positives += usize::from(z > 0.0 && positive);
            self.probability_sum += 1.0 / (1.0 + (-z).exp());
            self.scores.push((z as f32, positive));
        }
    }

    /// The metrics over everything pushed so far (the accumulator stays as
    /// it is); NaN where undefined.
    pub fn finish(&self) -> Metrics {
        let n = self.scores.len() as f64;
        let (pos, ctr) = (self.positives as f64, self.positives as f64 / n);
        // The labels' entropy, summed (TorchRec's `ce_norm`; natural logs
        // here and in the cross-entropy, so the ratio is TorchRec's base 2).
        let norm = -pos * ctr.ln() - (n - pos) * (1.0 - ctr).ln();
        let share = |part: usize, of: usize| match of {
            0 => 0.0,
            of => part as f64 / of as f64,
        };
        let precision = share(self.true_positives, self.predicted_positives);
        let recall = share(self.true_positives, self.positives);
        Metrics {
            auc: roc_auc(&self.scores),
            logloss: self.logloss_sum / n,
            accuracy: self.correct as f64 / n,
            ne: match pos > 0.0 && pos < n {
                true => self.logloss_sum / norm,
                false => f64::NAN,
            },
            calibration: self.probability_sum / pos,
            ctr,
            precision,
            recall,
            f1: match precision + recall {
                0.0 => 0.0,
                sum => 2.0 * precision * recall / sum,
            },
            average_precision: average_precision(&self.scores),
            count: self.scores.len(),
        }
    }
}

/// Exact ROC AUC by the rank-sum (Mann-Whitney) formula with mid-ranks for ties.
pub fn roc_auc(scores: &[(f32, bool)]) -> f64 {
    if scores.iter().any(|s| s.0.is_nan()) {
        return f64::NAN;
    }
    let mut sorted: Vec<(f32, bool)> = scores.to_vec();
    sorted.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
    let positives = sorted.iter().filter(|s| s.1).count() as f64;
    let negatives = sorted.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return f64::NAN;
    }
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j < sorted.len() && sorted[j].0 == sorted[i].0 {
            j += 1;
        }
        // Ranks i+1..=j share their mean.
        let mid_rank = (i + 1 + j) as f64 / 2.0;
        let tied_positives = sorted[i..j].iter().filter(|s| s.1).count() as f64;
        rank_sum += mid_rank * tied_positives;
        i = j;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

/// scikit-learn's `average_precision_score`: `sum_n (R_n - R_{n-1}) P_n`
/// over the distinct scores from the highest (tied samples cross the
/// threshold together); NaN with no positive or a NaN score.
pub fn average_precision(scores: &[(f32, bool)]) -> f64 {
    let positives = scores.iter().filter(|s| s.1).count();
    if positives == 0 || scores.iter().any(|s| s.0.is_nan()) {
        return f64::NAN;
    }
    let mut sorted: Vec<(f32, bool)> = scores.to_vec();
    sorted.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
    let (mut tp, mut seen, mut recall, mut ap) = (0usize, 0usize, 0.0, 0.0);
    for group in sorted.chunk_by(|a, b| a.0 == b.0) {
        tp += group.iter().filter(|s| s.1).count();
        seen += group.len();
        let now = tp as f64 / positives as f64;
        ap += (now - recall) * (tp as f64 / seen as f64);
        recall = now;
    }
    ap
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AUC by its definition: P(score of a positive > score of a negative), ties 1/2.
    fn pairwise_auc(scores: &[(f32, bool)]) -> f64 {
        let (mut wins, mut pairs) = (0.0, 0.0);
        for p in scores.iter().filter(|s| s.1) {
            for n in scores.iter().filter(|s| !s.1) {
                pairs += 1.0;
                wins += if p.0 > n.0 {
                    1.0
                } else if p.0 == n.0 {
                    0.5
                } else {
                    0.0
                };
            }
        }
        wins / pairs
    }

    #[test]
    fn auc_matches_pairwise_definition_with_ties() {
        let mut rng = ember_sparse::rng::Rng::new(3);
        for _ in 0..50 {
            let scores: Vec<(f32, bool)> = (0..40)
                .map(|_| ((rng.below(6) as f32) / 2.0, rng.below(3) == 0))
                .collect();
            if scores.iter().all(|s| s.1) || scores.iter().all(|s| !s.1) {
                continue;
            }
            assert!((roc_auc(&scores) - pairwise_auc(&scores)).abs() < 1e-12);
        }
        assert!(roc_auc(&[(1.0, true), (2.0, true)]).is_nan());
        assert!(roc_auc(&[(f32::NAN, true), (2.0, false)]).is_nan());
    }

    /// Precision, recall, F1 and average precision by hand: logits
    /// (3, 1, 1, -1, -2) with labels (1, 0, 1, 1, 0).
    #[test]
    fn precision_recall_and_average_precision_by_hand() {
        let mut acc = MetricsAccumulator::default();
        acc.push(&[3.0, 1.0, 1.0, -1.0, -2.0], &[1.0, 0.0, 1.0, 1.0, 0.0]);
        let m = acc.finish();
        // Predicted positive: the first three, two of them right.
        assert_eq!((m.precision, m.recall), (2.0 / 3.0, 2.0 / 3.0));
        assert!((m.f1 - 2.0 / 3.0).abs() < 1e-15);
        // Thresholds 3 (P 1, R 1/3), 1 (the tie: P 2/3, R 2/3), -1 (P 3/4,
        // R 1), -2 (adds no recall).
        let want = 1.0 / 3.0 + (1.0 / 3.0) * (2.0 / 3.0) + (1.0 / 3.0) * 0.75;
        assert!((m.average_precision - want).abs() < 1e-15);
        // Nothing predicted positive, no positive: 0 and NaN as scikit-learn.
        let mut acc = MetricsAccumulator::default();
        acc.push(&[-1.0, -2.0], &[0.0, 0.0]);
        let m = acc.finish();
        assert_eq!((m.precision, m.recall, m.f1), (0.0, 0.0, 0.0));
        assert!(m.average_precision.is_nan());
    }

    #[test]
    fn logloss_and_accuracy_by_hand() {
        let mut acc = MetricsAccumulator::default();
        acc.push(&[0.0, 2.0, -1.0], &[1.0, 0.0, 0.0]);
        let m = acc.finish();
        let expected = (2f64.ln() + (1.0 + 2f64.exp()).ln() + (1.0 + (-1f64).exp()).ln()) / 3.0;
        assert!((m.logloss - expected).abs() < 1e-12);
        // z=0 counts as predicting 0: wrong for label 1; z=2 wrong; z=-1 right.
        assert!((m.accuracy - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(m.count, 3);
        // One positive in three: the labels' entropy is
        // -ln(1/3) - 2 ln(2/3), summed; NE the summed cross-entropy over it.
        let norm = -(1f64 / 3.0).ln() - 2.0 * (2f64 / 3.0).ln();
        assert!((m.ne - 3.0 * expected / norm).abs() < 1e-12);
        let sigmoid = |z: f64| 1.0 / (1.0 + (-z).exp());
        let predicted = sigmoid(0.0) + sigmoid(2.0) + sigmoid(-1.0);
        assert!((m.calibration - predicted / 1.0).abs() < 1e-12);
        assert!((m.ctr - 1.0 / 3.0).abs() < 1e-12);
        // Predicting the base rate everywhere: NE 1, calibrated.
        let base = (1f64 / 3.0 / (2.0 / 3.0)).ln() as f32;
        let mut acc = MetricsAccumulator::default();
        acc.push(&[base; 3], &[1.0, 0.0, 0.0]);
        let m = acc.finish();
        assert!(
            (m.ne - 1.0).abs() < 1e-6 && (m.calibration - 1.0).abs() < 1e-6,
            "{m:?}"
        );
        // One class: NE undefined.
        let mut acc = MetricsAccumulator::default();
        acc.push(&[0.5], &[1.0]);
        assert!(acc.finish().ne.is_nan());
    }
}
