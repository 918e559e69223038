//! A count-min sketch: sightings of ids in a fixed number of counters.
//!
//! Written here rather than taken from a crate: it is a few lines, and its
//! hashing must be fixed (the same admissions on every machine, as the
//! plain model in the tests predicts) and its counters reachable for
//! checkpoints, which the crates' (pdatastructs, streaming_algorithms)
//! hashers and private state do not allow.

use crate::rng::splitmix;

/// Rows of counters: each id counts in one counter per row.
pub(crate) const SKETCH_DEPTH: usize = 4;

/// `SKETCH_DEPTH` rows of `width` saturating counters; an id's estimate is
/// its least counter, never below its true count.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CountMinSketch {
    width: usize,
    counters: Vec<u32>,
}

impl CountMinSketch {
    pub(crate) fn new(width: usize) -> Self {
        Self {
            width,
            counters: vec![0; SKETCH_DEPTH * width],
        }
    }

    /// The counter of `id` in row `r`.
    fn cell(&self, id: u64, r: usize) -> usize {
        let h = splitmix(id ^ (r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r * self.width + ((h as u128 * self.width as u128) >> 64) as usize
    }

    /// Counts a sighting of `id`; returns its new estimate.
    pub(crate) fn add(&mut self, id: u64) -> u32 {
        let mut least = u32::MAX;
        for r in 0..SKETCH_DEPTH {
            let c = self.cell(id, r);
            self.counters[c] = self.counters[c].saturating_add(1);
            least = least.min(self.counters[c]);
        }
        least
    }

    /// The counters, row-major `[SKETCH_DEPTH, width]` (to save).
    pub(crate) fn counters(&self) -> &[u32] {
        &self.counters
    }

    /// The counters, mutable (to restore).
    pub(crate) fn counters_mut(&mut self) -> &mut [u32] {
        &mut self.counters
    }

    /// Halves every counter (rounding down): old sightings fade.
    pub(crate) fn halve(&mut self) {
        self.counters.iter_mut().for_each(|c| *c >>= 1);
    }

    /// Bytes of its counters.
    pub(crate) fn bytes(&self) -> usize {
        4 * self.counters.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_are_never_below_the_count() {
        let mut sketch = CountMinSketch::new(64);
        let mut truth = std::collections::HashMap::new();
        for i in 0..2000u64 {
            let id = splitmix(i % 300) % 1000;
            *truth.entry(id).or_insert(0u32) += 1;
            let estimate = sketch.add(id);
            assert!(estimate >= truth[&id], "id {id}");
        }
    }

    #[test]
    fn a_wide_sketch_counts_a_few_ids_exactly() {
        let mut sketch = CountMinSketch::new(1 << 12);
        for k in 1..=5u64 {
            for n in 1..=k {
                assert_eq!(sketch.add(k * 1_000_003), n as u32);
            }
        }
    }
}
