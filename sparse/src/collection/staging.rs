//! Staging a batch for disk-tier tables: their ids looked up in each
//! table's cache (misses read from its file) and rewritten as cache slots,
//! so that the kernels run on the cache as on a table in RAM; and for
//! key-value tables, their raw ids rewritten as rows (`keyed.rs`). Other
//! tables in RAM are left alone: their ids are their rows.

use rayon::prelude::*;

use super::{EmbeddingBagCollection, EmbeddingTable};
use crate::tier::{transfer, Miss, SlotPointers, Stage, Transfer};
use crate::{KeyedJaggedTensor, ReadAhead, SparseError};

/// A batch as staged by [`EmbeddingBagCollection::prefetch`]: the input, and
/// the same bags with disk-tier and key-value ids rewritten as slots.
#[derive(Debug)]
pub(super) struct Staged {
    input: KeyedJaggedTensor,
    slots: KeyedJaggedTensor,
}

impl Staged {
    /// The batch with disk-tier ids as slots.
    pub(super) fn slots(&self) -> &KeyedJaggedTensor {
        &self.slots
    }
}

impl EmbeddingBagCollection {
    /// Whether any table lives on the disk tier.
    pub fn has_disk_tier(&self) -> bool {
        self.tables.iter().any(|t| t.is_on_disk())
    }

    /// The first table whose ids staging rewrites (on the disk tier, or
    /// key-value), if any.
    fn first_staged(&self) -> Option<&EmbeddingTable> {
        (self.tables.iter()).find(|t| t.is_on_disk() || t.is_key_value())
    }

    /// A [`ReadAhead`] of the disk-tier tables, to run on another thread
    /// for the next batch while this one computes; `None` when every table
    /// is in RAM.
    pub fn read_ahead(&self) -> Option<ReadAhead> {
        let features: Vec<_> = self
            .slots
            .iter()
            .filter_map(|slot| {
                let table = &self.tables[slot.table];
                // A key-value table's ids are rows only once its map (on
                // this thread) has staged them.
                if table.is_key_value() {
                    return None;
                }
                let tier = table.store.tier()?;
                Some((
                    slot.name.clone(),
                    tier.shared(),
                    table.num_embeddings() as u64,
                ))
            })
            .collect();
        (!features.is_empty()).then_some(ReadAhead { features })
    }

    /// Brings the rows of `kjt`'s ids into the caches of the disk-tier
    /// tables (reading misses from their files, many reads in flight), for
    /// the [`forward`](Self::forward) of this batch, as FBGEMM's
    /// `prefetch`; finds key-value tables' ids in their maps (in training,
    /// admitting new ones). Does nothing when every table is in RAM and
    /// keyed by row. Ids are checked here ([`SparseError::IdOutOfRange`]);
    /// a failed read or write is [`SparseError::Disk`], naming the table
    /// and file.
    pub fn prefetch(&mut self, kjt: &KeyedJaggedTensor) -> Result<(), SparseError> {
        if self.first_staged().is_none() {
            return Ok(());
        }
        self.staged = None;
        let slots = self.stage_all(kjt, Stage::Lookup, self.training)?;
        self.staged = Some(Box::new(Staged {
            input: kjt.clone(),
            slots,
        }));
        Ok(())
    }

    /// The input the kernels read for `kjt`'s forward: `kjt` itself, or
    /// with disk-tier or key-value tables the slots `prefetch` staged it as.
    pub(super) fn forward_input<'a>(
        &'a self,
        kjt: &'a KeyedJaggedTensor,
    ) -> Result<&'a KeyedJaggedTensor, SparseError> {
        let Some(first) = self.first_staged() else {
            return Ok(kjt);
        };
        match &self.staged {
            Some(staged) if staged.input == *kjt => Ok(&staged.slots),
            _ => Err(SparseError::NotPrefetched {
                table: first.name().to_string(),
            }),
        }
    }

    /// The staged batch the backward of `kjt` reads, its disk-tier rows
    /// marked changed: the one `prefetch` staged, or (for another batch)
    /// `kjt` staged now, its missing rows read first. `None` when no
    /// table is staged. The caller puts it back in `staged` when done.
    pub(super) fn update_input(
        &mut self,
        kjt: &KeyedJaggedTensor,
    ) -> Result<Option<Box<Staged>>, SparseError> {
        if self.first_staged().is_none() {
            return Ok(None);
        }
        let staged = match self.staged.take() {
            Some(staged) if staged.input == *kjt => {
                let keys = self.resolve_keys(kjt)?;
                for (slot, &k) in self.slots.iter().zip(&keys) {
                    if let (_, _, Some(tier)) = self.tables[slot.table].store.parts_mut() {
                        let slots = &staged.slots.values()[kjt.key_range(k)];
                        tier.mark_changed(slots);
                    }
                }
                staged
            }
            _ => Box::new(Staged {
                input: kjt.clone(),
                slots: self.stage_all(kjt, Stage::Update, true)?,
            }),
        };
        Ok(Some(staged))
    }

    /// Puts back the batch [`update_input`](Self::update_input) took.
    pub(super) fn restore_staged(&mut self, staged: Option<Box<Staged>>) {
        if staged.is_some() {
            self.staged = staged;
        }
    }

    /// `kjt` with each key-value table's ids rewritten as its rows, then
    /// each disk-tier table's as its cache slots.
    fn stage_all(
        &mut self,
        kjt: &KeyedJaggedTensor,
        stage: Stage,
        training: bool,
    ) -> Result<KeyedJaggedTensor, SparseError> {
        let rows = match self.has_key_value() {
            true => std::borrow::Cow::Owned(self.stage_kv(kjt, training)?),
            false => std::borrow::Cow::Borrowed(kjt),
        };
        match self.has_disk_tier() {
            true => self.stage(&rows, stage),
            false => Ok(rows.into_owned()),
        }
    }

    /// `kjt` with each disk-tier table's ids rewritten as its cache slots:
    /// every table's slots assigned (in parallel), then every table's
    /// misses read at once.
    fn stage(
        &mut self,
        kjt: &KeyedJaggedTensor,
        stage: Stage,
    ) -> Result<KeyedJaggedTensor, SparseError> {
        let keys = self.resolve_keys(kjt)?;
        let slots = &self.slots;
        let mut work: Vec<TableStage<'_>> = self
            .tables
            .iter_mut()
            .enumerate()
            .filter(|(_, table)| table.is_on_disk())
            .map(|(t, table)| {
                let ranges = slots
                    .iter()
                    .zip(&keys)
                    .filter(|(slot, _)| slot.table == t)
                    .map(|(_, &k)| kjt.key_range(k))
                    .collect();
                TableStage {
                    table,
                    ranges,
                    ids: Vec::new(),
                    misses: Vec::new(),
                }
            })
            .collect();
        // Every table's slots, then (if any table refused the batch) every
        // table's undone: a refused batch leaves every cache as it was.
        let assigned: Vec<Result<(), SparseError>> = work
            .par_iter_mut()
            .map(
                |TableStage {
                     table,
                     ranges,
                     ids,
                     misses,
                 }| {
                    for range in ranges.iter() {
                        for p in range.clone() {
                            let id = kjt.values()[p];
                            if id < 0 || id as u64 >= table.num_embeddings() as u64 {
                                let k = (0..kjt.keys().len())
                                    .find(|&k| kjt.key_range(k).contains(&p))
                                    .expect("a value lies in some key's range");
                                return Err(table.id_error(
                                    &kjt.keys()[k],
                                    sample_of(kjt, k, p),
                                    id,
                                ));
                            }
                            ids.push(id);
                        }
                    }
                    let name = &table.config.name;
                    let (_, _, tier) = table.store.parts_mut();
                    let tier = tier.expect("a disk-tier table");
                    *misses = tier.assign(name, ids, stage)?;
                    Ok(())
                },
            )
            .collect();
        if let Some(Err(e)) = assigned.iter().find(|r| r.is_err()) {
            let e = e.clone();
            for (w, ok) in work.iter_mut().zip(&assigned) {
                if ok.is_ok() {
                    disk_tier(w.table).undo(&w.misses);
                }
            }
            return Err(e);
        }
        for w in &mut work {
            disk_tier(w.table).commit(&w.misses, stage);
        }
        let transfers: Vec<Transfer<'_>> = work
            .iter_mut()
            .map(|TableStage { table, misses, .. }| {
                let table = &mut **table;
                let (rows, state, tier) = table.store.parts_mut();
                Transfer {
                    table: &table.config.name,
                    slots: SlotPointers::new(rows, state),
                    tier: tier.expect("a disk-tier table"),
                    misses,
                }
            })
            .collect();
        let result = transfer(&transfers);
        drop(transfers);
        let mut values = kjt.values().to_vec();
        for TableStage {
            table,
            ranges,
            ids,
            misses,
        } in &mut work
        {
            let (_, _, tier) = table.store.parts_mut();
            tier.expect("a disk-tier table")
                .settle(misses, result.is_ok());
            let mut staged = ids.iter();
            for range in ranges.iter() {
                for v in &mut values[range.clone()] {
                    *v = *staged.next().expect("one slot per id");
                }
            }
        }
        result?;
        Ok(kjt.with_values(values))
    }
}

/// One disk-tier table's part of staging a batch: its features' value
/// ranges, its ids (checked, then rewritten as slots) and its misses.
struct TableStage<'a> {
    table: &'a mut EmbeddingTable,
    ranges: Vec<std::ops::Range<usize>>,
    ids: Vec<i64>,
    misses: Vec<Miss>,
}

/// The sample whose bag of key `k` holds value `p`.
fn sample_of(kjt: &KeyedJaggedTensor, k: usize, p: usize) -> usize {
    let b = kjt.stride();
    let ends = &kjt.offsets()[k * b + 1..=(k + 1) * b];
    ends.partition_point(|&end| end <= p)
}

/// The tier of a table known to be on the disk tier.
fn disk_tier(table: &mut EmbeddingTable) -> &mut crate::tier::DiskTier {
    table.store.parts_mut().2.expect("a disk-tier table")
}
