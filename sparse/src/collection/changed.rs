//! Which rows of a table training has changed since the last time they
//! were taken: what a delta checkpoint writes.
//!
//! A row counts as changed when a backward updated it, or when a key-value
//! table gave it to a new id, looked it up in training (its header moved)
//! or gave it up. Rows set directly (`write_row`, `row_bytes_mut`, loading)
//! are not counted: after those, save a full checkpoint.

use super::{EmbeddingBagCollection, EmbeddingTable};

/// One bit a row, made on the first mark (a table never trained costs
/// nothing).
#[derive(Clone, Debug, Default)]
pub(super) struct ChangedRows {
    words: Vec<u64>,
}

impl ChangedRows {
    /// Marks row `row` of a table of `rows` rows.
    pub(super) fn mark(&mut self, rows: usize, row: usize) {
        if self.words.is_empty() {
            self.words = vec![0; rows.div_ceil(64)];
        }
        self.words[row / 64] |= 1 << (row % 64);
    }

    /// The marked rows, ascending.
    fn rows(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (w, &word) in self.words.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                out.push(w as u64 * 64 + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        }
        out
    }

    /// How many rows are marked.
    fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    fn clear(&mut self) {
        self.words.fill(0);
    }
}

impl EmbeddingTable {
    /// The rows training changed since [`clear_changed`](Self::clear_changed)
    /// (or since the table was made), ascending: updated by a backward, or
    /// (key-value tables) given to a new id, looked up in training or given
    /// up. Rows set directly are not counted.
    pub fn changed_rows(&self) -> Vec<u64> {
        self.changed.rows()
    }

    /// How many rows [`changed_rows`](Self::changed_rows) would list.
    pub fn changed_count(&self) -> usize {
        self.changed.count()
    }

    /// Forgets which rows changed (a checkpoint now holds them).
    pub fn clear_changed(&mut self) {
        self.changed.clear();
    }

    /// Marks row `row` changed.
    pub(super) fn mark_changed(&mut self, row: usize) {
        let rows = self.num_embeddings();
        self.changed.mark(rows, row);
    }
}

impl EmbeddingBagCollection {
    /// [`EmbeddingTable::clear_changed`] for every table.
    pub fn clear_changed(&mut self) {
        self.tables
            .iter_mut()
            .for_each(EmbeddingTable::clear_changed);
    }
}

#[cfg(test)]
mod tests {
    use super::ChangedRows;

    #[test]
    fn marks_read_back_in_order_and_clear() {
        let mut c = ChangedRows::default();
        assert!(c.rows().is_empty());
        for r in [129, 0, 63, 64, 129] {
            c.mark(130, r);
        }
        assert_eq!(c.rows(), vec![0, 63, 64, 129]);
        assert_eq!(c.count(), 4);
        c.clear();
        assert!(c.rows().is_empty());
    }
}
