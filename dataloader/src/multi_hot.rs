//! MLPerf DLRMv2's one-hot to multi-hot expansion, as the reference's
//! `multi_hot.py` makes it: for each feature, a table of `rows` lists, row
//! `i` being `i` and then `size - 1` ids drawn once, uniform below `rows`,
//! from NumPy's legacy generator seeded 0 (MT19937, `randint`'s masked
//! rejection), the features in order from one stream; a one-hot id `v`
//! becomes the list of row `v mod rows`. The same seed gives every
//! process the same lists.

use rand_mt::Mt;

use crate::error::DataError;

/// Each feature's expansion table.
#[derive(Clone, Debug)]
pub struct MultiHot {
    sizes: Vec<usize>,
    rows: Vec<u64>,
    /// `extra[f]`: feature `f`'s drawn ids, `size - 1` a row, row-major.
    extra: Vec<Vec<u32>>,
}

impl MultiHot {
    /// The reference's tables for features of `sizes` ids a bag and
    /// `rows` rows (its `--multi_hot_sizes` and
    /// `--num_embeddings_per_feature`). Fails on lengths that differ, a
    /// size or row count of 0, rows past 2^32, or tables that do not fit
    /// in memory (their bytes named).
    pub fn mlperf(sizes: &[usize], rows: &[u64]) -> Result<Self, DataError> {
        let bad = |m: String| Err(DataError::MultiHot(m));
        if sizes.len() != rows.len() {
            return bad(format!("{} sizes for {} tables", sizes.len(), rows.len()));
        }
        if let Some(f) = sizes.iter().position(|&s| s == 0) {
            return bad(format!("feature {f}: a bag of 0 ids"));
        }
        // The reference's tables are int32 (`.int()`): ids below 2^31.
        if let Some(f) = rows.iter().position(|&r| r == 0 || r > 1 << 31) {
            return bad(format!("feature {f}: {} rows, not 1 to 2^31", rows[f]));
        }
        let mut mt = Mt::new(0);
        let mut extra = Vec::with_capacity(sizes.len());
        for (f, (&size, &n)) in sizes.iter().zip(rows).enumerate() {
            let count = (n as usize).saturating_mul(size - 1);
            let mut ids: Vec<u32> = Vec::new();
            if ids.try_reserve_exact(count).is_err() {
                return bad(format!(
                    "feature {f}: its table of {n} rows of {} drawn ids ({} bytes) does not fit in memory",
                    size - 1,
                    count.saturating_mul(4)
                ));
            }
            ids.extend((0..count).map(|_| bounded(&mut mt, n - 1)));
            extra.push(ids);
        }
        Ok(Self {
            sizes: sizes.to_vec(),
            rows: rows.to_vec(),
            extra,
        })
    }

    /// The sizes and rows, as a marker records them.
    pub fn describe(&self) -> String {
        let join = |v: Vec<String>| v.join(",");
        format!(
            "multi-hot sizes {} over rows {}",
            join(self.sizes.iter().map(|s| s.to_string()).collect()),
            join(self.rows.iter().map(|r| r.to_string()).collect())
        )
    }

    /// Bytes the tables of `sizes` and `rows` take (4 a drawn id).
    pub fn bytes(sizes: &[usize], rows: &[u64]) -> u64 {
        (sizes.iter().zip(rows))
            .map(|(&s, &r)| {
                r.saturating_mul(s.saturating_sub(1) as u64)
                    .saturating_mul(4)
            })
            .sum()
    }

    /// Each feature's ids a bag.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Feature `f`'s bag for the one-hot id `raw`: row `raw mod rows`, then
    /// that row's drawn ids, into `out` (cleared first).
    pub fn expand(&self, f: usize, raw: i64, out: &mut Vec<i64>) {
        let row = raw.rem_euclid(self.rows[f] as i64);
        let k = self.sizes[f] - 1;
        out.clear();
        out.push(row);
        let at = row as usize * k;
        out.extend(self.extra[f][at..at + k].iter().map(|&id| id as i64));
    }
}

/// NumPy's legacy `randint(0, rng + 1)` for one value: 32-bit draws masked
/// to the smallest all-ones above `rng`, rejected past it (no draw at all
/// when `rng` is 0).
fn bounded(mt: &mut Mt, rng: u64) -> u32 {
    if rng == 0 {
        return 0;
    }
    let rng = rng as u32;
    let mask = u32::MAX >> rng.leading_zeros();
    loop {
        let v = mt.next_u32() & mask;
        if v <= rng {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `np.random.seed(0); np.random.randint(0, 10, size=(10, 2))`'s first
    /// six values, and a table of one row (no draws) that leaves the
    /// stream where it was.
    #[test]
    fn numpy_legacy_draws() {
        let m = MultiHot::mlperf(&[3, 1, 2], &[10, 4, 1]).unwrap();
        assert_eq!(&m.extra[0][..6], &[5, 0, 3, 3, 7, 9]);
        let mut out = Vec::new();
        m.expand(0, 12, &mut out);
        assert_eq!(out, [2, 7, 9]);
        m.expand(1, -1, &mut out);
        assert_eq!(out, [3]);
        m.expand(2, 5, &mut out);
        assert_eq!(out, [0, 0]);
    }
}
