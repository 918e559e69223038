//! `backward_update`: occurrences sorted by id, duplicates merged into
//! segments, and the parallel scatter with the optimizer fused in.
//!
//! Backward: per table, the (id, sample, feature) triples of the batch are
//! sorted by id, so equal ids form one segment; a segment's gradient is summed
//! once and applied once, which is exactly the update of the summed gradient.
//! Segments are disjoint rows, so they are updated in parallel.

use rayon::prelude::*;

use super::{add_scaled_row, EmbeddingBagCollection, EmbeddingTable, FeatureSlot, SharedMut};
use crate::optimizer::{update_row, StepFactors};
use crate::rows::{decode_with, TrainFormat};
use crate::simd::multiversion;
use crate::storage::prefetch;
use crate::{DataType, KeyedJaggedTensor, PoolingType, SparseError, TableOptimizer};

/// Backward segments per parallel task.
const SEGMENTS_PER_TASK: usize = 512;
/// Distance, in distinct ids, at which the backward prefetches rows and state.
const UPDATE_PREFETCH_DISTANCE: usize = 8;

#[derive(Debug, Default)]
pub(super) struct BackwardScratch {
    pub(super) entries: Vec<Entry>,
    segment_starts: Vec<usize>,
}

/// One occurrence of an id in a batch: where its gradient comes from.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    /// The row.
    pub(super) id: u64,
    /// The gradient's row (a sample; unpooled, the id's output row).
    pub(super) sample: u32,
    /// The gradient's first column in that row.
    pub(super) column: u32,
    /// What the gradient is scaled by (mean pooling, per-id weights).
    pub(super) scale: f32,
}

impl EmbeddingBagCollection {
    /// Backward pass of [`forward`](Self::forward) for the same input, with
    /// the optimizer applied inside the scatter. `grad` is the gradient of the
    /// loss with respect to the pooled output, `[batch, width]` row-major.
    ///
    /// Equal ids in a batch get one update with their summed gradient (mean
    /// pooling and per-id weights scale each occurrence). Every id is checked
    /// before any row changes, so an error leaves the tables and
    /// [`step`](Self::step) as they were. With [`TableOptimizer::None`] it
    /// only checks the keys and the gradient's shape.
    pub fn backward_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        grad: &[f32],
    ) -> Result<(), SparseError> {
        self.resolve_keys(kjt)?;
        let batch = kjt.stride();
        let width = self.width;
        if grad.len() != batch * width {
            return Err(SparseError::GradShape {
                rows: grad.len() / width.max(1),
                cols: width,
                expected_rows: batch,
                expected_cols: width,
            });
        }
        if matches!(self.optimizer, TableOptimizer::None) {
            return Ok(());
        }
        // Disk-tier tables update their cache's slots: the batch as staged.
        let staged = self.update_input(kjt)?;
        let result = self.update_tables(staged.as_ref().map_or(kjt, |s| s.slots()), grad);
        self.restore_staged(staged);
        result
    }

    /// The backward of a batch whose ids address the tables' resident rows.
    fn update_tables(&mut self, kjt: &KeyedJaggedTensor, grad: &[f32]) -> Result<(), SparseError> {
        let keys = self.resolve_keys(kjt)?;
        let width = self.width;
        // Lent out while the tables step (no copy), back on every path.
        let slots = std::mem::take(&mut self.slots);
        let collect = |t: usize, table: &mut EmbeddingTable| {
            let features = slots.iter().zip(&keys).filter(|(slot, _)| slot.table == t);
            table.collect_entries(features, kjt)
        };
        let result = self.step_tables(grad, width, collect);
        self.slots = slots;
        result
    }

    /// One optimizer step of every table: `collect(t, table)` gathers table
    /// `t`'s occurrences (every id checked before any table changes, so an
    /// error leaves the tables and the step count as they were), whose
    /// gradient rows lie `width` apart in `grad`.
    pub(super) fn step_tables(
        &mut self,
        grad: &[f32],
        width: usize,
        collect: impl Fn(usize, &mut EmbeddingTable) -> Result<(), SparseError> + Sync,
    ) -> Result<(), SparseError> {
        self.tables
            .par_iter_mut()
            .enumerate()
            .try_for_each(|(t, table)| collect(t, table))?;
        self.step += 1;
        let optimizer = self.optimizer;
        let factors = StepFactors::at(&optimizer, self.step, self.step_settings);
        let rounding = RoundingStep {
            seed: self.rounding_seed,
            step: self.step,
        };
        self.tables.par_iter_mut().try_for_each(|table| {
            table.apply_segments(&optimizer, factors, rounding, grad, width);
            table.reset_fallback()
        })
    }
}

impl EmbeddingTable {
    /// Gathers every occurrence of this table's ids in the batch, sorted by
    /// (id, sample, column) so segments and their summation order are fixed.
    fn collect_entries<'a>(
        &mut self,
        features: impl Iterator<Item = (&'a FeatureSlot, &'a usize)>,
        kjt: &KeyedJaggedTensor,
    ) -> Result<(), SparseError> {
        let rows = self.resident_rows() as u64;
        let mean = self.config.pooling == PoolingType::Mean;
        let entries = &mut self.scratch.entries;
        entries.clear();
        let batch = kjt.stride();
        for (slot, &k) in features {
            let offsets = &kjt.offsets()[k * batch..=(k + 1) * batch];
            for sample in 0..batch {
                let (start, end) = (offsets[sample], offsets[sample + 1]);
                let bag_scale = if mean && end > start {
                    1.0 / (end - start) as f32
                } else {
                    1.0
                };
                for p in start..end {
                    let id = kjt.values()[p];
                    if id < 0 || id as u64 >= rows {
                        return Err(self.id_error(&slot.name, sample, id));
                    }
                    let weight = kjt.weights().map_or(1.0, |w| w[p]);
                    entries.push(Entry {
                        id: id as u64,
                        sample: sample as u32,
                        column: slot.column as u32,
                        scale: weight * bag_scale,
                    });
                }
            }
        }
        self.segment_entries();
        Ok(())
    }

    /// Sorts the collected occurrences by (id, sample, column) and marks
    /// where each id's segment starts.
    pub(super) fn segment_entries(&mut self) {
        let entries = &mut self.scratch.entries;
        entries.sort_unstable_by_key(|e| (e.id, e.sample, e.column));
        let starts = &mut self.scratch.segment_starts;
        starts.clear();
        for (i, e) in entries.iter().enumerate() {
            if i == 0 || entries[i - 1].id != e.id {
                starts.push(i);
            }
        }
        starts.push(entries.len());
    }

    /// Sums each segment's gradient and applies the optimizer to its row.
    fn apply_segments(
        &mut self,
        optimizer: &TableOptimizer,
        factors: StepFactors,
        rounding: RoundingStep,
        grad: &[f32],
        width: usize,
    ) {
        // The unsafe row writes below rely on these sizes.
        let rows = self.resident_rows();
        let table_rows_total = self.num_embeddings();
        let (table_rows, state, tier) = self.store.parts_mut();
        let stride = table_rows.stride();
        assert_eq!(table_rows.bytes().len(), rows * stride);
        let per_row = state.floats_per_row();
        assert_eq!(state.as_slice().len(), rows * per_row);
        let dtype = table_rows.dtype();
        let (rows_at, state_at) = (table_rows.bytes_mut().as_mut_ptr(), state.base_ptr());
        let job = UpdateJob {
            optimizer,
            factors,
            entries: &self.scratch.entries,
            starts: &self.scratch.segment_starts,
            grad,
            width,
            dim: self.config.embedding_dim,
            per_row,
            stride,
            rows: SharedMut(rows_at),
            state: SharedMut(state_at),
            // One key per table and step; each row's is one hash more.
            step_key: crate::rng::mix(&[rounding.seed, self.part.table, rounding.step]),
            part: self.part,
            slot_ids: tier.map(|t| &*t).map(|t| t.slot_ids()),
        };
        let segments = job.starts.len() - 1;
        (0..segments.div_ceil(SEGMENTS_PER_TASK))
            .into_par_iter()
            .for_each(|task| {
                let first = task * SEGMENTS_PER_TASK;
                let last = (first + SEGMENTS_PER_TASK).min(segments);
                // The summed gradient, then (for rows not in fp32) the row itself.
                let mut scratch = vec![0.0f32; 2 * job.dim];
                match dtype {
                    DataType::Fp32 => update_fp32(&job, first, last, &mut scratch),
                    DataType::Fp16 => update_fp16(&job, first, last, &mut scratch),
                    DataType::Bf16 => update_bf16(&job, first, last, &mut scratch),
                    // The collection refuses an optimizer for quantized tables.
                    _ => unreachable!("{dtype} tables take no optimizer"),
                }
            });
        // The rows this step changed, by row (a disk-tier slot's row id).
        for &s in &job.starts[..segments] {
            let slot = job.entries[s].id as usize;
            let row = job.slot_ids.map_or(slot, |ids| {
                ids[slot].load(std::sync::atomic::Ordering::Relaxed) as usize
            });
            self.changed.mark(table_rows_total, row);
        }
    }
}

/// What the stochastic rounding of one backward draws from.
#[derive(Clone, Copy)]
struct RoundingStep {
    seed: u64,
    step: u64,
}

/// What every backward task of one table reads.
struct UpdateJob<'a> {
    optimizer: &'a TableOptimizer,
    factors: StepFactors,
    entries: &'a [Entry],
    starts: &'a [usize],
    grad: &'a [f32],
    width: usize,
    dim: usize,
    per_row: usize,
    /// Bytes per row.
    stride: usize,
    rows: SharedMut<u8>,
    state: SharedMut,
    /// The stochastic rounding's key for this table and step.
    step_key: u64,
    part: super::TablePart,
    /// A disk-tier table's rows are cache slots: the id each one holds.
    slot_ids: Option<&'a [std::sync::atomic::AtomicU32]>,
}

multiversion!(fn update_fp32(job: &UpdateJob<'_>, first: usize, last: usize, scratch: &mut [f32]) -> () = update_format::<crate::rows::Fp32>);
multiversion!(fn update_fp16(job: &UpdateJob<'_>, first: usize, last: usize, scratch: &mut [f32]) -> () = update_format::<crate::rows::Fp16Simd>, baseline update_format::<crate::rows::Fp16>);
multiversion!(fn update_bf16(job: &UpdateJob<'_>, first: usize, last: usize, scratch: &mut [f32]) -> () = update_format::<crate::rows::Bf16>);

/// [`update_task_body`] for rows of format `F`, at the table's dim.
#[inline(always)]
fn update_format<F: TrainFormat>(
    job: &UpdateJob<'_>,
    first: usize,
    last: usize,
    scratch: &mut [f32],
) {
    with_fixed_dim!(job.dim, update_task_body::<F>(job, first, last, scratch));
}

/// Segments `first..last`: sum each one's gradient, update its row. A fp32
/// row is updated where it lies; a fp16/bf16 row is read as fp32, updated,
/// and written back stochastically rounded, drawing by the row's and each
/// column's global position (see [`TablePart`](super::TablePart)).
///
/// `D > 0` is the dim at compile time (with the row's bytes), so the
/// decode, update and rounding loops have constant lengths; `D = 0` is any.
#[inline(always)]
fn update_task_body<const D: usize, F: TrainFormat>(
    job: &UpdateJob<'_>,
    first: usize,
    last: usize,
    scratch: &mut [f32],
) {
    let dim = if D > 0 { D } else { job.dim };
    let stride = crate::rows::fixed_stride::<F, D>(job.stride);
    let per_row = job.per_row;
    let (summed, decoded) = scratch.split_at_mut(dim);
    let decoded = &mut decoded[..dim];
    for seg in first..last {
        // Rows, their state and their gradient rows are all random reads:
        // start them a few segments ahead.
        if let Some(&ahead) = job.starts.get(seg + UPDATE_PREFETCH_DISTANCE) {
            if let Some(e) = job.entries.get(ahead) {
                let id = e.id as usize;
                prefetch(job.rows.0.wrapping_add(id * stride), stride);
                prefetch(job.state.0.wrapping_add(id * per_row), per_row * 4);
                if let Some(ids) = job.slot_ids {
                    // A disk-tier slot's row id, for the rounding's draw.
                    prefetch(ids.as_ptr().wrapping_add(id), 4);
                }
                let at = e.sample as usize * job.width + e.column as usize;
                prefetch(job.grad.as_ptr().wrapping_add(at), dim * 4);
            }
        }
        let occurrences = &job.entries[job.starts[seg]..job.starts[seg + 1]];
        summed.fill(0.0);
        for e in occurrences {
            let at = e.sample as usize * job.width + e.column as usize;
            add_scaled_row(summed, e.scale, &job.grad[at..at + dim]);
        }
        let id = occurrences[0].id as usize;
        // SAFETY: ids are bounds-checked in collect_entries and each segment
        // holds a distinct id, so every task writes rows (and state rows) no
        // other task touches.
        let (bytes, row_state) = unsafe {
            (
                std::slice::from_raw_parts_mut(job.rows.at(id * stride), stride),
                if per_row == 0 {
                    &mut [][..]
                } else {
                    std::slice::from_raw_parts_mut(job.state.at(id * per_row), per_row)
                },
            )
        };
        if F::IN_PLACE {
            // fp32: the bytes are the row's floats (64-byte aligned table, 4-byte rows).
            let row: &mut [f32] = bytemuck::cast_slice_mut(bytes);
            update_row(job.optimizer, job.factors, row, summed, row_state);
        } else {
            decode_with::<F>(bytes, decoded);
            update_row(job.optimizer, job.factors, decoded, summed, row_state);
            let part = job.part;
            let local = job.slot_ids.map_or(id as u64, |ids| {
                u64::from(ids[id].load(std::sync::atomic::Ordering::Relaxed))
            });
            let global_row = part.first_row + local * part.row_step;
            let key = crate::rng::splitmix(job.step_key ^ global_row);
            // SAFETY: as above, this task alone owns the row's bytes.
            unsafe { F::store(bytes.as_mut_ptr(), decoded, key, part.first_column) };
        }
    }
}
