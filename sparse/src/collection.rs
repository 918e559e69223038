//! `EmbeddingBagCollection`: tables, the pooled forward lookup and the backward
//! scatter with the optimizer fused in.
//!
//! Forward: tasks pool bags while prefetching rows a few ids ahead (random
//! gathers are latency-bound; keeping several misses in flight is what
//! reaches the memory system's throughput). With many ids per bag, a task is
//! (feature, block of samples), in feature order, so each thread works
//! through one table at a time and its rows stay within the TLB's reach;
//! with few, the output is as big as the reads, and a task is a block of
//! samples written row after row.
//!
//! Backward: per table, the (id, sample, feature) triples of the batch are
//! sorted by id, so equal ids form one segment; a segment's gradient is summed
//! once and applied once, which is exactly the update of the summed gradient.
//! Segments are disjoint rows, so they are updated in parallel.

use rayon::prelude::*;

use crate::optimizer::{update_row, OptimizerState, StepFactors};
use crate::simd::multiversion;
use crate::storage::{prefetch, prefetch_every, AlignedBuffer};
use crate::{
    EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType, SparseError, TableOptimizer,
};

/// Bags average at least this many ids: the forward is multi-hot (feature-
/// major tasks, sparser prefetch hints); below, one-hot-like (sample-major).
const MULTI_HOT_IDS_PER_BAG: usize = 3;
/// Samples per feature-major task (of one feature): 26 features x 8 blocks at
/// batch 2048 balance two threads with little per-task overhead.
const SAMPLES_PER_TASK: usize = 256;
/// Samples per sample-major task (all features): 32 tasks at batch 2048.
const SAMPLE_MAJOR_SAMPLES: usize = 64;
/// Distance, in ids, at which rows are prefetched ahead of use.
const PREFETCH_DISTANCE: usize = 12;
/// Rows initialised per independently seeded chunk (keeps init reproducible
/// whatever the thread count).
const INIT_CHUNK_ROWS: usize = 4096;
/// Backward segments per parallel task.
const SEGMENTS_PER_TASK: usize = 512;
/// Distance, in distinct ids, at which the backward prefetches rows and state.
const UPDATE_PREFETCH_DISTANCE: usize = 8;

/// One table: its rows, its optimizer state and scratch for the backward pass.
#[derive(Debug)]
pub struct EmbeddingTable {
    config: EmbeddingBagConfig,
    weights: AlignedBuffer,
    state: OptimizerState,
    scratch: BackwardScratch,
}

#[derive(Debug, Default)]
struct BackwardScratch {
    entries: Vec<Entry>,
    segment_starts: Vec<usize>,
}

/// One occurrence of an id in a batch: where its gradient comes from.
#[derive(Clone, Copy, Debug)]
struct Entry {
    id: u64,
    sample: u32,
    column: u32,
    scale: f32,
}

impl EmbeddingTable {
    pub fn config(&self) -> &EmbeddingBagConfig {
        &self.config
    }
    pub fn name(&self) -> &str {
        &self.config.name
    }
    pub fn num_embeddings(&self) -> usize {
        self.config.num_embeddings
    }
    pub fn dim(&self) -> usize {
        self.config.embedding_dim
    }
    /// All rows, row-major `[num_embeddings, dim]`.
    pub fn weights(&self) -> &[f32] {
        self.weights.as_slice()
    }
    pub fn weights_mut(&mut self) -> &mut [f32] {
        self.weights.as_mut_slice()
    }
    pub fn row(&self, id: usize) -> &[f32] {
        let d = self.dim();
        &self.weights()[id * d..(id + 1) * d]
    }
    /// Optimizer state, row-major `[num_embeddings, state floats per row]`
    /// (row-wise Adagrad: 1; Adagrad: dim; Adam: `[m | v]`, 2 x dim).
    pub fn optimizer_state(&self) -> &[f32] {
        self.state.as_slice()
    }
    pub fn optimizer_state_mut(&mut self) -> &mut [f32] {
        self.state.as_mut_slice()
    }
    /// The error for `id`, found in `feature`'s bag of `sample`.
    fn id_error(&self, feature: &str, sample: usize, id: i64) -> SparseError {
        SparseError::IdOutOfRange {
            table: self.config.name.clone(),
            feature: feature.to_string(),
            sample,
            id,
            rows: self.num_embeddings(),
        }
    }

    #[inline(always)]
    fn prefetch_row(&self, id: i64, step: usize) {
        let dim = self.dim();
        let row = self
            .weights
            .as_ptr()
            .wrapping_add((id as usize).wrapping_mul(dim));
        prefetch_every(row, dim * 4, step);
    }

    /// Bytes of weights plus optimizer state.
    pub fn bytes(&self) -> usize {
        (self.weights.len() + self.state.as_slice().len()) * std::mem::size_of::<f32>()
    }
}

/// Where a feature's pooled vector goes.
#[derive(Clone, Debug)]
struct FeatureSlot {
    name: String,
    table: usize,
    column: usize,
}

/// A set of embedding tables looked up by named features, producing one
/// pooled vector per (sample, feature), like TorchRec's `EmbeddingBagCollection`
/// with a fused optimizer (FBGEMM TBE).
#[derive(Debug)]
pub struct EmbeddingBagCollection {
    tables: Vec<EmbeddingTable>,
    slots: Vec<FeatureSlot>,
    /// Sum of the features' dims: the width of an output row.
    width: usize,
    optimizer: TableOptimizer,
    step: u64,
}

impl EmbeddingBagCollection {
    /// Creates and initialises the tables (uniform in each table's
    /// `init_range`, reproducible from `seed` whatever the thread count), and
    /// allocates the optimizer's state.
    pub fn new(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        seed: u64,
    ) -> Result<Self, SparseError> {
        Self::build(configs, optimizer, Some(seed))
    }

    /// Tables of zeros, for a caller that fills them (the shards of a rank).
    pub fn zeroed(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
    ) -> Result<Self, SparseError> {
        Self::build(configs, optimizer, None)
    }

    fn build(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        seed: Option<u64>,
    ) -> Result<Self, SparseError> {
        optimizer
            .validate()
            .map_err(SparseError::InvalidOptimizer)?;
        let mut slots: Vec<FeatureSlot> = Vec::new();
        let mut column = 0;
        for (t, config) in configs.iter().enumerate() {
            config.validate()?;
            if configs[..t].iter().any(|c| c.name == config.name) {
                return Err(SparseError::InvalidConfig {
                    table: config.name.clone(),
                    reason: "two tables have this name".into(),
                });
            }
            for feature in &config.feature_names {
                if config
                    .feature_names
                    .iter()
                    .filter(|f| *f == feature)
                    .count()
                    > 1
                {
                    return Err(SparseError::InvalidConfig {
                        table: config.name.clone(),
                        reason: format!("feature '{feature}' is listed twice"),
                    });
                }
                if let Some(other) = slots.iter().find(|s| &s.name == feature) {
                    return Err(SparseError::FeatureServedTwice {
                        feature: feature.clone(),
                        first: configs[other.table].name.clone(),
                        second: config.name.clone(),
                    });
                }
                slots.push(FeatureSlot {
                    name: feature.clone(),
                    table: t,
                    column,
                });
                column += config.embedding_dim;
            }
        }
        let tables = configs
            .into_iter()
            .enumerate()
            .map(|(t, config)| new_table(config, &optimizer, seed, t as u64))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            tables,
            slots,
            width: column,
            optimizer,
            step: 0,
        })
    }

    pub fn tables(&self) -> &[EmbeddingTable] {
        &self.tables
    }
    pub fn tables_mut(&mut self) -> &mut [EmbeddingTable] {
        &mut self.tables
    }
    pub fn table(&self, name: &str) -> Option<&EmbeddingTable> {
        self.tables.iter().find(|t| t.name() == name)
    }
    pub fn optimizer(&self) -> &TableOptimizer {
        &self.optimizer
    }
    /// Number of backward updates applied so far (Adam's bias-correction step).
    pub fn step(&self) -> u64 {
        self.step
    }
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }
    /// Output feature names, in output order (tables' order, then each table's features).
    pub fn feature_names(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.name.clone()).collect()
    }
    /// Width of each feature's pooled vector, in output order.
    pub fn feature_dims(&self) -> Vec<usize> {
        self.slots
            .iter()
            .map(|s| self.tables[s.table].dim())
            .collect()
    }
    /// Bytes of all weights plus optimizer state.
    pub fn bytes(&self) -> usize {
        self.tables.iter().map(|t| t.bytes()).sum()
    }

    /// An output tensor of the right keys and widths for `batch` samples.
    pub fn new_output(&self, batch: usize) -> KeyedTensor {
        KeyedTensor::zeros(self.feature_names(), self.feature_dims(), batch)
    }

    /// Pooled lookup of every feature.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor, SparseError> {
        let mut out = self.new_output(kjt.stride());
        self.forward_into(kjt, &mut out)?;
        Ok(out)
    }

    /// Pooled lookup into a reused output (no allocation once `out` has grown
    /// to the batch). Every id is bounds-checked; a bad one is reported (with
    /// several, which one depends on task timing).
    pub fn forward_into(
        &self,
        kjt: &KeyedJaggedTensor,
        out: &mut KeyedTensor,
    ) -> Result<(), SparseError> {
        let keys = self.resolve_keys(kjt)?;
        let batch = kjt.stride();
        let same_layout = out.keys().len() == self.slots.len()
            && self
                .slots
                .iter()
                .zip(out.keys())
                .zip(out.length_per_key())
                .all(|((slot, key), &len)| {
                    &slot.name == key && self.tables[slot.table].dim() == len
                });
        if !same_layout {
            *out = self.new_output(batch);
        }
        out.set_batch(batch);
        let width = out.width();
        if width == 0 || batch == 0 {
            return Ok(());
        }
        let job = ForwardJob {
            tables: &self.tables,
            slots: &self.slots,
            keys: &keys,
            kjt,
            width,
            out: SharedMut(out.values_mut().as_mut_ptr()),
            // Hint every other line once bags average 3 ids or more.
            prefetch_step: if kjt.values().len()
                >= MULTI_HOT_IDS_PER_BAG * kjt.offsets().len().saturating_sub(1)
            {
                128
            } else {
                64
            },
        };
        if kjt.values().len() < MULTI_HOT_IDS_PER_BAG * kjt.offsets().len().saturating_sub(1) {
            // Few ids per bag: the output is as large as the rows read, so
            // write it row after row (measured: sample-major 24-27 M ids/s
            // against 12-20 for feature-major, one id per bag).
            return out
                .values_mut()
                .par_chunks_mut(SAMPLE_MAJOR_SAMPLES * width)
                .enumerate()
                .try_for_each(|(task, block)| {
                    pool_samples(&job, task * SAMPLE_MAJOR_SAMPLES, block)
                });
        }
        // Many ids per bag: reads dominate.
        // Tasks are (feature, block of samples), feature-major: rayon hands
        // each thread a contiguous run of tasks, so a thread works through one
        // table at a time and its rows stay within the TLB's reach. Walking
        // all tables per sample instead cost up to 20% in page walks.
        let blocks = batch.div_ceil(SAMPLES_PER_TASK);
        (0..self.slots.len() * blocks)
            .into_par_iter()
            .try_for_each(|task| pool_task(&job, task / blocks, (task % blocks) * SAMPLES_PER_TASK))
    }

    /// Backward pass of [`forward`](Self::forward) for the same input, with
    /// the optimizer applied inside the scatter. `grad` is the gradient of the
    /// loss with respect to the pooled output, `[batch, width]` row-major.
    pub fn backward_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        grad: &[f32],
    ) -> Result<(), SparseError> {
        let keys = self.resolve_keys(kjt)?;
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
        // Every id is checked before any table changes, so an error leaves
        // the tables and the step count as they were.
        let slots = &self.slots;
        self.tables
            .par_iter_mut()
            .enumerate()
            .try_for_each(|(t, table)| {
                let features = slots.iter().zip(&keys).filter(|(slot, _)| slot.table == t);
                table.collect_entries(features, kjt)
            })?;
        self.step += 1;
        let optimizer = self.optimizer;
        let factors = StepFactors::at(&optimizer, self.step);
        self.tables
            .par_iter_mut()
            .for_each(|table| table.apply_segments(&optimizer, factors, grad, width));
        Ok(())
    }

    /// For each output slot, the index of its key in `kjt`; every key of `kjt`
    /// must be served by some table.
    fn resolve_keys(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, SparseError> {
        if let Some(unknown) = kjt
            .keys()
            .iter()
            .find(|k| !self.slots.iter().any(|s| &s.name == *k))
        {
            return Err(SparseError::UnknownFeature(unknown.clone()));
        }
        self.slots
            .iter()
            .map(|s| {
                kjt.key_index(&s.name)
                    .ok_or_else(|| SparseError::MissingFeature(s.name.clone()))
            })
            .collect()
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
        let rows = self.num_embeddings() as u64;
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
        entries.sort_unstable_by_key(|e| (e.id, e.sample, e.column));
        let starts = &mut self.scratch.segment_starts;
        starts.clear();
        for (i, e) in entries.iter().enumerate() {
            if i == 0 || entries[i - 1].id != e.id {
                starts.push(i);
            }
        }
        starts.push(entries.len());
        Ok(())
    }

    /// Sums each segment's gradient and applies the optimizer to its row.
    fn apply_segments(
        &mut self,
        optimizer: &TableOptimizer,
        factors: StepFactors,
        grad: &[f32],
        width: usize,
    ) {
        // The unsafe row writes below rely on these sizes.
        let rows = self.config.num_embeddings;
        assert_eq!(self.weights.len(), rows * self.config.embedding_dim);
        assert_eq!(
            self.state.as_slice().len(),
            rows * self.state.floats_per_row()
        );
        let job = UpdateJob {
            optimizer,
            factors,
            entries: &self.scratch.entries,
            starts: &self.scratch.segment_starts,
            grad,
            width,
            dim: self.config.embedding_dim,
            per_row: self.state.floats_per_row(),
            weights: SharedMut(self.weights.as_mut_slice().as_mut_ptr()),
            state: SharedMut(self.state.base_ptr()),
        };
        let segments = job.starts.len() - 1;
        (0..segments.div_ceil(SEGMENTS_PER_TASK))
            .into_par_iter()
            .for_each(|task| {
                let first = task * SEGMENTS_PER_TASK;
                let mut summed = vec![0.0f32; job.dim];
                update_task(
                    &job,
                    first,
                    (first + SEGMENTS_PER_TASK).min(segments),
                    &mut summed,
                );
            });
    }
}

/// Calls `pool::<D>(args)` with the dim as a compile-time `D` where a
/// fixed-dim kernel exists (16, 32, 64, 128), else `pool::<0>(args)`.
macro_rules! with_fixed_dim {
    ($dim:expr, $pool:ident($($arg:expr),* $(,)?)) => {
        match $dim {
            16 => $pool::<16>($($arg),*),
            32 => $pool::<32>($($arg),*),
            64 => $pool::<64>($($arg),*),
            128 => $pool::<128>($($arg),*),
            _ => $pool::<0>($($arg),*),
        }
    };
}

/// What every forward task reads.
struct ForwardJob<'a> {
    tables: &'a [EmbeddingTable],
    slots: &'a [FeatureSlot],
    /// Input key index of each slot.
    keys: &'a [usize],
    kjt: &'a KeyedJaggedTensor,
    width: usize,
    /// The output, `[batch, width]`; tasks write disjoint (rows, columns).
    out: SharedMut,
    /// Bytes between prefetch hints within a row (see `prefetch_every`).
    prefetch_step: usize,
}

multiversion!(fn pool_task(job: &ForwardJob<'_>, slot: usize, first: usize) -> Result<(), SparseError> = pool_task_body);

/// Pools feature `slot` for samples `first..first + SAMPLES_PER_TASK` (or
/// to the batch's end). The feature's ids are contiguous in the input, so the
/// prefetch runs `PREFETCH_DISTANCE` ids ahead over them across bags.
#[inline(always)]
fn pool_task_body(job: &ForwardJob<'_>, slot: usize, first: usize) -> Result<(), SparseError> {
    let batch = job.kjt.stride();
    let samples = SAMPLES_PER_TASK.min(batch - first);
    let feature = &job.slots[slot];
    let table = &job.tables[feature.table];
    let dim = table.dim();
    let key = job.keys[slot];
    let bags = &job.kjt.offsets()[key * batch + first..=key * batch + first + samples];
    // The feature's ids are contiguous across blocks: prefetch past this
    // block's end into the next block's ids, which this thread most likely
    // pools next, so the prefetch stream never restarts cold.
    let prefetch_end = job.kjt.offsets()[(key + 1) * batch];
    for (s, bag) in bags.windows(2).enumerate() {
        // SAFETY: the output holds batch x width floats; this task alone
        // writes the `dim` columns of `feature` in its samples' rows.
        let out = unsafe {
            std::slice::from_raw_parts_mut(
                job.out.at((first + s) * job.width + feature.column),
                dim,
            )
        };
        with_fixed_dim!(
            dim,
            pool_bag(job, table, (bag[0], bag[1]), prefetch_end, out)
        )
        .map_err(|id| table.id_error(&feature.name, first + s, id))?;
    }
    Ok(())
}

/// Pools the bag `values[start..end]` of `table` into `out`, prefetching the
/// row `PREFETCH_DISTANCE` ids ahead (up to `prefetch_end`); returns a bad
/// id as the error.
///
/// `D > 0` is the dim known at compile time: the sum then lives in registers
/// (8 AVX-512 registers for D = 128) and `out` is written once, as FBGEMM's
/// JIT kernels do. `D = 0` handles any dim, summing in `out` itself.
#[inline(always)]
fn pool_bag<const D: usize>(
    job: &ForwardJob<'_>,
    table: &EmbeddingTable,
    (start, end): (usize, usize),
    prefetch_end: usize,
    out: &mut [f32],
) -> Result<(), i64> {
    let values = job.kjt.values();
    let weights = job.kjt.weights();
    let rows = table.num_embeddings() as u64;
    let mut acc = [0.0f32; D];
    for p in start..end {
        if p + PREFETCH_DISTANCE < prefetch_end {
            table.prefetch_row(values[p + PREFETCH_DISTANCE], job.prefetch_step);
        }
        let id = values[p];
        if id < 0 || id as u64 >= rows {
            return Err(id);
        }
        let w = weights.map_or(1.0, |w| w[p]);
        accumulate(&mut acc, out, table.row(id as usize), w, p == start);
    }
    finish_bag(table, &acc, end - start, out);
    Ok(())
}

multiversion!(fn pool_samples(job: &ForwardJob<'_>, first: usize, block: &mut [f32]) -> Result<(), SparseError> = pool_samples_body);

/// Sample-major forward task: pools every feature for the samples of
/// `block` (which starts at sample `first`), sample by sample, so each
/// sample's output row is written front to back (sequential stores the
/// hardware streams well). A second
/// cursor walks the same (sample, feature, id) order `PREFETCH_DISTANCE` ids
/// ahead and prefetches those rows, across bag and feature boundaries, so the
/// stream of outstanding misses never drains, even with one id per bag.
#[inline(always)]
fn pool_samples_body(
    job: &ForwardJob<'_>,
    first: usize,
    block: &mut [f32],
) -> Result<(), SparseError> {
    let width = job.width;
    let samples = block.len() / width;
    let values = job.kjt.values();
    let weights = job.kjt.weights();
    let mut ahead = LookupCursor::new(job, first, samples);
    for _ in 0..PREFETCH_DISTANCE {
        if let Some((table, id)) = ahead.next() {
            table.prefetch_row(id, job.prefetch_step);
        }
    }
    for s in 0..samples {
        for (i, slot) in job.slots.iter().enumerate() {
            let table = &job.tables[slot.table];
            let dim = table.dim();
            let bag = job.bag(i, first + s);
            let out = &mut block[s * width + slot.column..s * width + slot.column + dim];
            with_fixed_dim!(
                dim,
                pool_bag_cursor(table, bag, values, weights, &mut ahead, out)
            )
            .map_err(|id| table.id_error(&slot.name, first + s, id))?;
        }
    }
    Ok(())
}

/// [`pool_bag`] with the prefetch stream of a sample-major task: advances the
/// cursor one id per id read. (Sharing one body with `pool_bag` through a
/// prefetch closure was measured 25% slower at one id per bag.)
#[inline(always)]
fn pool_bag_cursor<const D: usize>(
    table: &EmbeddingTable,
    (start, end): (usize, usize),
    values: &[i64],
    weights: Option<&[f32]>,
    ahead: &mut LookupCursor<'_>,
    out: &mut [f32],
) -> Result<(), i64> {
    let step = ahead.job.prefetch_step;
    let rows = table.num_embeddings() as u64;
    let mut acc = [0.0f32; D];
    for p in start..end {
        if let Some((next_table, id)) = ahead.next() {
            next_table.prefetch_row(id, step);
        }
        let id = values[p];
        if id < 0 || id as u64 >= rows {
            return Err(id);
        }
        let w = weights.map_or(1.0, |w| w[p]);
        accumulate(&mut acc, out, table.row(id as usize), w, p == start);
    }
    finish_bag(table, &acc, end - start, out);
    Ok(())
}

impl ForwardJob<'_> {
    /// The value range of slot `i`'s bag for sample `sample`.
    #[inline(always)]
    fn bag(&self, i: usize, sample: usize) -> (usize, usize) {
        let at = self.keys[i] * self.kjt.stride() + sample;
        let offsets = self.kjt.offsets();
        (offsets[at], offsets[at + 1])
    }
}

/// Walks a task's ids in the order the forward kernel reads them:
/// sample by sample, feature by feature, id by id.
struct LookupCursor<'a> {
    job: &'a ForwardJob<'a>,
    first: usize,
    samples: usize,
    sample: usize,
    slot: usize,
    pos: usize,
    end: usize,
}

impl<'a> LookupCursor<'a> {
    fn new(job: &'a ForwardJob<'a>, first: usize, samples: usize) -> Self {
        let (pos, end) = if samples > 0 && !job.slots.is_empty() {
            job.bag(0, first)
        } else {
            (0, 0)
        };
        Self {
            job,
            first,
            samples,
            sample: 0,
            slot: 0,
            pos,
            end,
        }
    }

    /// The next (table, id), or `None` past the task's last id.
    #[inline(always)]
    fn next(&mut self) -> Option<(&'a EmbeddingTable, i64)> {
        while self.pos == self.end {
            self.slot += 1;
            if self.slot == self.job.slots.len() {
                self.slot = 0;
                self.sample += 1;
            }
            if self.sample >= self.samples {
                return None;
            }
            (self.pos, self.end) = self.job.bag(self.slot, self.first + self.sample);
        }
        let id = self.job.kjt.values()[self.pos];
        self.pos += 1;
        Some((&self.job.tables[self.job.slots[self.slot].table], id))
    }
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
    weights: SharedMut,
    state: SharedMut,
}

multiversion!(fn update_task(job: &UpdateJob<'_>, first: usize, last: usize, summed: &mut [f32]) -> () = update_task_body);

/// Segments `first..last`: sum each one's gradient, update its row.
#[inline(always)]
fn update_task_body(job: &UpdateJob<'_>, first: usize, last: usize, summed: &mut [f32]) {
    let (dim, per_row) = (job.dim, job.per_row);
    for seg in first..last {
        // Rows, their state and their gradient rows are all random reads:
        // start them a few segments ahead.
        if let Some(&ahead) = job.starts.get(seg + UPDATE_PREFETCH_DISTANCE) {
            if let Some(e) = job.entries.get(ahead) {
                let id = e.id as usize;
                prefetch(job.weights.0.wrapping_add(id * dim), dim * 4);
                prefetch(job.state.0.wrapping_add(id * per_row), per_row * 4);
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
        let (row, row_state) = unsafe {
            (
                std::slice::from_raw_parts_mut(job.weights.at(id * dim), dim),
                if per_row == 0 {
                    &mut [][..]
                } else {
                    std::slice::from_raw_parts_mut(job.state.at(id * per_row), per_row)
                },
            )
        };
        update_row(job.optimizer, job.factors, row, summed, row_state);
    }
}

/// Adds `w * row` to a bag's running sum: in `acc` when the dim is a
/// compile-time `D > 0`, else in `out` (whose first row initialises it).
#[inline(always)]
fn accumulate<const D: usize>(
    acc: &mut [f32; D],
    out: &mut [f32],
    row: &[f32],
    w: f32,
    first: bool,
) {
    if D > 0 {
        let row: &[f32; D] = row.try_into().expect("D is the table's dim");
        for d in 0..D {
            acc[d] += w * row[d];
        }
    } else if first {
        // The first row initialises the sum: no zero-fill pass.
        out.iter_mut().zip(row).for_each(|(o, r)| *o = w * r);
    } else {
        add_scaled_row(out, w, row);
    }
}

/// Writes a bag of `len` ids' sum to `out` (zeros for an empty bag) and
/// applies mean pooling.
#[inline(always)]
fn finish_bag<const D: usize>(table: &EmbeddingTable, acc: &[f32; D], len: usize, out: &mut [f32]) {
    if D > 0 {
        out.copy_from_slice(acc);
    } else if len == 0 {
        out.fill(0.0);
    }
    if table.config.pooling == PoolingType::Mean && len > 0 {
        let inv = 1.0 / len as f32;
        out.iter_mut().for_each(|x| *x *= inv);
    }
}

/// A raw pointer shared across the tasks of one pass, each of which writes a
/// disjoint part of the buffer (rows of a table; blocks of the output).
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: see apply_segments and pool_task_body: tasks write disjoint parts.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// # Safety
    /// `offset` must lie inside the buffer the pointer came from.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        self.0.add(offset)
    }
}

#[inline(always)]
fn add_scaled_row(out: &mut [f32], scale: f32, row: &[f32]) {
    for (o, r) in out.iter_mut().zip(row) {
        *o += scale * r;
    }
}

/// Part of a table's initial weights, exactly as [`EmbeddingBagCollection::new`]
/// with `seed` initialises the table at position `index`: every global row
/// in `rows` that `local` maps to a local row `l` has its columns `cols`
/// written to `out[l * cols.len()..]`. Only the chunks holding `rows` are
/// drawn, so a shard is initialised without the rest of its table in memory.
pub fn initial_rows(
    config: &EmbeddingBagConfig,
    seed: u64,
    index: u64,
    rows: std::ops::Range<usize>,
    local: impl Fn(usize) -> Option<usize> + Sync,
    cols: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let (lo, hi) = config.init_range();
    let dim = config.embedding_dim;
    let lc = cols.len();
    let end = rows.end.min(config.num_embeddings);
    let chunks: Vec<usize> =
        (rows.start / INIT_CHUNK_ROWS..end.div_ceil(INIT_CHUNK_ROWS)).collect();
    // Chunks are drawn in parallel, in groups of about 64 MiB of draws, and
    // their wanted rows copied out in order.
    let group = ((64 << 20) / (INIT_CHUNK_ROWS * dim.max(1) * 4)).max(1);
    for group in chunks.chunks(group) {
        let drawn: Vec<(Vec<usize>, Vec<f32>)> = group
            .par_iter()
            .map(|&chunk| {
                let first = chunk * INIT_CHUNK_ROWS;
                let n = INIT_CHUNK_ROWS.min(config.num_embeddings - first);
                let mut rng = crate::rng::Rng::new(crate::rng::mix(&[seed, index, chunk as u64]));
                let mut values = vec![0f32; n * dim];
                for x in &mut values {
                    *x = lo + (hi - lo) * rng.next_f32();
                }
                // The wanted rows' columns, packed, and where they go.
                let (mut locals, mut kept) = (Vec::new(), Vec::new());
                for r in first.max(rows.start)..(first + n).min(end) {
                    if let Some(l) = local(r) {
                        locals.push(l);
                        kept.extend_from_slice(&values[(r - first) * dim..][cols.clone()]);
                    }
                }
                (locals, kept)
            })
            .collect();
        for (locals, kept) in drawn {
            for (l, row) in locals.into_iter().zip(kept.chunks_exact(lc.max(1))) {
                out[l * lc..(l + 1) * lc].copy_from_slice(row);
            }
        }
    }
}

/// A table initialised from `seed` (zeros without one).
fn new_table(
    config: EmbeddingBagConfig,
    optimizer: &TableOptimizer,
    seed: Option<u64>,
    index: u64,
) -> Result<EmbeddingTable, SparseError> {
    let (lo, hi) = config.init_range();
    let dim = config.embedding_dim;
    // validate() checked that this product fits.
    let len = config.num_embeddings * dim;
    let alloc_error = |bytes| SparseError::Allocation {
        table: config.name.clone(),
        bytes,
    };
    let weights = AlignedBuffer::new(len, |w| {
        let Some(seed) = seed else { return };
        w.par_chunks_mut(INIT_CHUNK_ROWS * dim)
            .enumerate()
            .for_each(|(chunk, rows)| {
                let mut rng = crate::rng::Rng::new(crate::rng::mix(&[seed, index, chunk as u64]));
                for x in rows {
                    *x = lo + (hi - lo) * rng.next_f32();
                }
            })
    })
    .ok_or_else(|| alloc_error(len * 4))?;
    let state = OptimizerState::new(optimizer, config.num_embeddings, dim).ok_or_else(|| {
        alloc_error(optimizer.state_floats_per_row(dim) * config.num_embeddings * 4)
    })?;
    Ok(EmbeddingTable {
        config,
        weights,
        state,
        scratch: BackwardScratch::default(),
    })
}
