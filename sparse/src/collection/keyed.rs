//! Key-value tables in a collection: a batch's raw ids rewritten as rows
//! through each table's [`KvIndex`] when the batch is staged, rows given
//! to new ids made afresh, and the zero fallback row kept at zero.

use std::cell::RefCell;

use rayon::prelude::*;

use super::init::draw_row;
use super::{EmbeddingBagCollection, EmbeddingTable};
use crate::kv::{Fallback, Fresh, KvIndex, KvState, KvStats};
use crate::{KeyedJaggedTensor, SparseError};

/// Mixed into the seed of a row made for a new id, so that its draw is
/// apart from the draws of the table's initial rows.
const FRESH_ROW_TAG: u64 = 0x6b76_5f72_6f77;

impl EmbeddingTable {
    /// Builds the key-value index a config asks for, over every row but
    /// the last (the fallback, zeroed when the fallback is zeros).
    pub(super) fn attach_kv(&mut self, seed: u64) -> Result<(), SparseError> {
        let Some(kv) = self.config.kv.clone() else {
            return Ok(());
        };
        let capacity = self.num_embeddings() - 1;
        self.kv = Some(KvIndex::new(kv, capacity, seed));
        self.reset_fallback()
    }

    /// Whether rows are found by the raw id through a map.
    pub fn is_key_value(&self) -> bool {
        self.kv.is_some()
    }

    /// A key-value table's figures since it was first built.
    pub fn kv_stats(&self) -> Option<KvStats> {
        self.kv.as_ref().map(KvIndex::stats)
    }

    /// The row a key-value table holds `id` in, if any.
    pub fn kv_row_of(&self, id: u64) -> Option<usize> {
        self.kv.as_ref()?.row_of(id).map(|r| r as usize)
    }

    /// The id a key-value table's row `row` holds, if any (never the
    /// fallback row).
    pub fn kv_id_of(&self, row: usize) -> Option<u64> {
        let kv = self.kv.as_ref()?;
        (row < kv.fallback_row()).then(|| kv.id_of(row)).flatten()
    }

    /// A key-value table's map as saved (checkpoints).
    pub fn kv_state(&self) -> Option<KvState> {
        self.kv.as_ref().map(KvIndex::state)
    }

    /// [`kv_state`](Self::kv_state) borrowed: no copy of the map.
    pub fn kv_view(&self) -> Option<crate::KvView<'_>> {
        self.kv.as_ref().map(KvIndex::view)
    }

    /// The part of this key-value table's map a shard of its rows `rows`
    /// holding `buckets` of `of` takes ([`kv_slice`](crate::kv_slice), the
    /// table one saved shard, under its own eviction policy), read from
    /// the map in place; `None` for another table.
    pub fn kv_slice(
        &self,
        rows: std::ops::Range<usize>,
        buckets: std::ops::Range<usize>,
        of: usize,
    ) -> Option<crate::KvSlice> {
        let kv = self.kv.as_ref()?;
        let view = kv.view();
        let whole = [(0..view.ids.len(), 0..of, view)];
        let eviction = kv.config().eviction;
        Some(crate::kv::slice(&whole, rows, buckets, (of, eviction)))
    }

    /// Replaces a key-value table's map with a saved one, checked whole
    /// first (one row per id, free rows free, no header after the map's
    /// clock); nothing changes on an error, which names the id or row at
    /// fault ([`SparseError::KvState`]).
    ///
    /// # Panics
    /// When the table is not a key-value table.
    pub fn load_kv_state(&mut self, state: KvState) -> Result<(), SparseError> {
        let name = self.config.name.clone();
        let kv = self
            .kv
            .as_mut()
            .expect("load_kv_state: not a key-value table");
        kv.restore(state).map_err(|reason| SparseError::KvState {
            table: name,
            reason,
        })
    }

    /// A key-value table's map as a delta checkpoint saves it: of `rows`
    /// (ascending, the table's changed rows) the ids, headers and counts
    /// of those below the fallback row, in order; the free rows, sketch
    /// and position whole.
    pub fn kv_delta(&self, rows: &[u64]) -> Option<KvState> {
        self.kv.as_ref().map(|kv| kv.delta(rows))
    }

    /// Applies a [`kv_delta`](Self::kv_delta) of `rows` over this table's
    /// map in place, checked first (nothing changes on an error, which
    /// names the id or row at fault; [`SparseError::KvState`]).
    ///
    /// # Panics
    /// When the table is not a key-value table.
    pub fn apply_kv_delta(&mut self, rows: &[u64], delta: KvState) -> Result<(), SparseError> {
        let name = self.config.name.clone();
        let kv = self
            .kv
            .as_mut()
            .expect("apply_kv_delta: not a key-value table");
        kv.apply_delta(rows, delta)
            .map_err(|reason| SparseError::KvState {
                table: name,
                reason,
            })
    }

    /// Counters of a key-value table's admission sketch (0 without one).
    pub fn kv_sketch_len(&self) -> usize {
        self.kv.as_ref().map_or(0, KvIndex::sketch_len)
    }

    /// Bytes of a key-value table's map, headers and sketch.
    pub fn kv_bytes(&self) -> usize {
        self.kv.as_ref().map_or(0, KvIndex::bytes)
    }

    /// Rewrites this table's ids as rows (see [`KvIndex::assign`]) and
    /// makes the rows given to new ids.
    fn assign_rows(&mut self, ids: &mut [i64], training: bool) -> Result<(), SparseError> {
        let dim = self.dim();
        let Self { store, kv, .. } = self;
        let Some(kv) = kv.as_mut() else {
            return Ok(());
        };
        // L2-norm eviction reads the candidates' rows: a table in RAM's
        // (the disk tier refuses that policy when built).
        let rows = store.resident().0;
        let buffer = RefCell::new(vec![0f32; dim]);
        let norm = |r: usize| {
            let mut b = buffer.borrow_mut();
            rows.read_row(r, &mut b);
            b.iter().map(|v| v * v).sum::<f32>().sqrt()
        };
        let fresh = kv.assign(ids, training, &norm);
        let given_up = kv.take_given_up();
        if training {
            // Headers moved: every row looked up, and every row given up.
            let fallback = kv.fallback_row() as i64;
            let looked_up = ids.iter().filter(|&&r| r != fallback);
            for r in looked_up
                .map(|&r| r as usize)
                .chain(given_up.iter().map(|&r| r as usize))
            {
                self.mark_changed(r);
            }
        }
        self.renew(fresh)
    }

    /// Rows given to new ids: drawn from the seed and the id (so a new
    /// id's row does not depend on where it lands) with zero optimizer
    /// state, written as stored (a disk-tier table's to its file, a run of
    /// consecutive rows at a time: rows never used are given in order).
    fn renew(&mut self, mut fresh: Vec<Fresh>) -> Result<(), SparseError> {
        if fresh.is_empty() {
            return Ok(());
        }
        fresh.sort_unstable_by_key(|f| f.row);
        let (range, dim, index) = (self.config.init_range(), self.dim(), self.part.table);
        let seed = self.kv.as_ref().map_or(0, KvIndex::seed);
        let (stride, per_row, dtype) = (
            self.bytes_per_row(),
            self.state_floats_per_row(),
            self.data_type(),
        );
        let mut values = vec![0f32; dim];
        let (mut bytes, mut state) = (Vec::new(), Vec::new());
        for run in fresh.chunk_by(|a, b| b.row == a.row + 1) {
            bytes.resize(run.len() * stride, 0);
            state.clear();
            state.resize(run.len() * per_row, 0.0);
            for (f, out) in run.iter().zip(bytes.chunks_exact_mut(stride)) {
                draw_row(range, [seed ^ FRESH_ROW_TAG, index, f.id], &mut values);
                dtype.encode_row(&values, out);
            }
            let first = run[0].row as usize;
            (self.store).write_stored(&self.config.name, first, &bytes, &state)?;
        }
        Ok(())
    }

    /// Sets a zero fallback row (and its state) back to zero after an
    /// update moved it.
    pub(super) fn reset_fallback(&mut self) -> Result<(), SparseError> {
        let Some(kv) = &self.kv else {
            return Ok(());
        };
        if kv.config().fallback != Fallback::Zeros {
            return Ok(());
        }
        let r = kv.fallback_row();
        let mut bytes = vec![0u8; self.bytes_per_row()];
        self.data_type()
            .encode_row(&vec![0.0; self.dim()], &mut bytes);
        let state = vec![0.0; self.state_floats_per_row()];
        (self.store).write_stored(&self.config.name, r, &bytes, &state)
    }
}

impl EmbeddingBagCollection {
    /// Whether any table is a key-value table.
    pub fn has_key_value(&self) -> bool {
        self.tables.iter().any(|t| t.kv.is_some())
    }

    /// Training (the default) or inference: in training, staging admits
    /// new ids to key-value tables and updates their rows' headers; in
    /// inference, it only reads (new ids read the fallback).
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    /// Whether staging admits new ids (see [`set_training`](Self::set_training)).
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// `kjt` with every key-value table's ids rewritten as its rows;
    /// `training` as [`set_training`](Self::set_training).
    pub(super) fn stage_kv(
        &mut self,
        kjt: &KeyedJaggedTensor,
        training: bool,
    ) -> Result<KeyedJaggedTensor, SparseError> {
        let keys = self.resolve_keys(kjt)?;
        let slots = &self.slots;
        let mut values = kjt.values().to_vec();
        // Each table's ids packed together, rewritten in parallel.
        let mut work: Vec<KvStage<'_>> = (self.tables.iter_mut().enumerate())
            .filter(|(_, table)| table.kv.is_some())
            .map(|(t, table)| {
                let ranges: Vec<_> = (slots.iter().zip(&keys))
                    .filter(|(slot, _)| slot.table == t)
                    .map(|(_, &k)| kjt.key_range(k))
                    .collect();
                let ids = ranges
                    .iter()
                    .flat_map(|r| values[r.clone()].to_vec())
                    .collect();
                KvStage { table, ranges, ids }
            })
            .collect();
        (work.par_iter_mut()).try_for_each(|w| w.table.assign_rows(&mut w.ids, training))?;
        for w in &work {
            let mut rows = w.ids.iter();
            for r in &w.ranges {
                for v in &mut values[r.clone()] {
                    *v = *rows.next().expect("one row per id");
                }
            }
        }
        Ok(kjt.with_values(values))
    }
}

/// One key-value table's part of staging a batch: its features' value
/// ranges, and their ids (rewritten as rows).
struct KvStage<'a> {
    table: &'a mut EmbeddingTable,
    ranges: Vec<std::ops::Range<usize>>,
    ids: Vec<i64>,
}
