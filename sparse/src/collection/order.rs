//! Whether the one-hot features of large tables pool in id order or in
//! sample order, chosen by timing both on a collection's first batches.
//!
//! Id order visits a large table's rows near each other, so their page
//! translations are reused; it writes the pooled rows out of order. Which
//! costs more depends on the machine: id order ran 1.42x sample order on a
//! Zen 3 (int8 rows, 26 tables of 1M, dim 128, one id a bag, 2 threads),
//! and 0.62-0.74x on a Xeon (family 6, model 207) whose tables sat on huge
//! pages. Both give the same sums bit for bit, so the choice is free to be
//! measured.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Untimed forwards first, the orders in turn: a collection's first
/// forwards run several times slower (first touches, caches, clocks).
const WARMUP: usize = 8;
/// Timed forwards of each order before choosing, in the pattern of
/// [`PATTERN`] (a steady drift of the clock then favours neither).
const TRIALS: usize = 6;
/// Whether timed forward `k` pools in id order: ABBA.
const PATTERN: [bool; 4] = [true, false, false, true];

const UNDECIDED: u8 = 0;
const ID_ORDER: u8 = 1;
const SAMPLE_ORDER: u8 = 2;

/// The choice, and the timings it is made from.
#[derive(Debug, Default)]
pub(crate) struct OrderTuner {
    choice: AtomicU8,
    /// Forwards that could pool in id order so far.
    calls: AtomicUsize,
    /// Seconds per id of the timed forwards: id order's, then sample order's.
    trials: Mutex<[Vec<f64>; 2]>,
}

/// How the next forward pools its large one-hot features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Trial {
    /// In id order (else in sample order).
    pub id_order: bool,
    /// Whether to [`record`](OrderTuner::record) its time.
    pub timed: bool,
}

impl OrderTuner {
    /// The order of the next forward: the choice once made; before it,
    /// [`WARMUP`] untimed forwards, then the two timed in [`PATTERN`]
    /// (counting the forwards [`record`](Self::record)ed).
    pub fn next(&self) -> Trial {
        match self.choice.load(Ordering::Relaxed) {
            ID_ORDER => Trial {
                id_order: true,
                timed: false,
            },
            SAMPLE_ORDER => Trial {
                id_order: false,
                timed: false,
            },
            _ => {
                let n = self.calls.load(Ordering::Relaxed);
                match n.checked_sub(WARMUP) {
                    None => Trial {
                        id_order: n.is_multiple_of(2),
                        timed: false,
                    },
                    Some(k) => Trial {
                        id_order: PATTERN[k % PATTERN.len()],
                        timed: true,
                    },
                }
            }
        }
    }

    /// A forward that could pool in id order, and its seconds per id
    /// when timed; chooses once each order has [`TRIALS`]: the lower
    /// median.
    pub fn record(&self, trial: Trial, seconds_per_id: f64) {
        let mut trials = self.trials.lock().unwrap_or_else(|p| p.into_inner());
        self.calls.fetch_add(1, Ordering::Relaxed);
        if !trial.timed {
            return;
        }
        trials[usize::from(!trial.id_order)].push(seconds_per_id);
        if self.choice.load(Ordering::Relaxed) == UNDECIDED
            && trials.iter().all(|t| t.len() >= TRIALS)
        {
            let [id, sample] = &mut *trials;
            let choice = match median(id) <= median(sample) {
                true => ID_ORDER,
                false => SAMPLE_ORDER,
            };
            self.choice.store(choice, Ordering::Relaxed);
        }
    }

    /// The order chosen: `Some(true)` id order, `Some(false)` sample order,
    /// `None` while still timing.
    pub fn chosen(&self) -> Option<bool> {
        match self.choice.load(Ordering::Relaxed) {
            UNDECIDED => None,
            c => Some(c == ID_ORDER),
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (v[(n - 1) / 2] + v[n / 2]) / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Untimed first, then the orders in turn until each has its trials;
    /// the faster (by median, one outlier ignored) is kept from then on.
    #[test]
    fn the_faster_order_is_chosen_after_timing_both() {
        for (id_cost, sample_cost, want) in [(1.0, 2.0, true), (3.0, 2.0, false)] {
            let tuner = OrderTuner::default();
            for n in 0..WARMUP {
                let trial = tuner.next();
                let want_trial = Trial {
                    id_order: n.is_multiple_of(2),
                    timed: false,
                };
                assert_eq!(trial, want_trial);
                // Forwards that could not pool in id order count for nothing.
                assert_eq!(tuner.next(), trial);
                tuner.record(trial, 1.0);
            }
            let mut seen = Vec::new();
            while tuner.chosen().is_none() {
                let trial = tuner.next();
                assert!(trial.timed);
                seen.push(trial.id_order);
                let outlier = seen.len() == 1; // one slow run must not decide
                let cost = if trial.id_order { id_cost } else { sample_cost };
                tuner.record(trial, if outlier { 100.0 } else { cost });
            }
            assert_eq!(seen.len(), 2 * TRIALS);
            assert_eq!(seen.iter().filter(|&&id| id).count(), TRIALS);
            assert_eq!(tuner.chosen(), Some(want));
            for _ in 0..3 {
                assert_eq!(
                    tuner.next(),
                    Trial {
                        id_order: want,
                        timed: false
                    }
                );
            }
        }
    }
}
