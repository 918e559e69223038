//! `EmbeddingBagCollection`: tables, the pooled forward lookup and the backward
//! scatter with the optimizer fused in.
//!
//! Forward: a task is a block of samples. It first checks every id of the
//! block and resolves it to its row's address, then pools feature by feature
//! with nothing else in the loop, prefetching rows a few ids ahead. Random
//! gathers are latency-bound: what reaches the memory system's throughput is
//! keeping many rows in flight, and a lean loop lets the core run further
//! ahead.
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

/// Bags average at least this many ids: the forward's prefetch hints are
/// sparser (see `prefetch_every`).
const MULTI_HOT_IDS_PER_BAG: usize = 3;
/// Bounds on the samples of a forward task (all features); between them, a
/// batch makes about four tasks per thread. Longer blocks keep a thread on
/// one table longer (measured at one id per bag, batch 2048, two threads:
/// 25 M ids/s with 64 samples, 27-28 with 256 or 512).
const BLOCK_SAMPLES: (usize, usize) = (16, 256);
/// Fewer samples per task when bags are long, so that a task resolves about
/// this many ids at most (1 MiB of row addresses per thread).
const BLOCK_IDS: usize = 1 << 17;
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
    /// The configuration the table was built from.
    pub fn config(&self) -> &EmbeddingBagConfig {
        &self.config
    }
    /// The table's name (`config().name`).
    pub fn name(&self) -> &str {
        &self.config.name
    }
    /// Number of rows.
    pub fn num_embeddings(&self) -> usize {
        self.config.num_embeddings
    }
    /// Floats per row (`config().embedding_dim`).
    pub fn dim(&self) -> usize {
        self.config.embedding_dim
    }
    /// All rows, row-major `[num_embeddings, dim]`.
    pub fn weights(&self) -> &[f32] {
        self.weights.as_slice()
    }
    /// All rows, mutable, row-major `[num_embeddings, dim]` (to load a
    /// checkpoint or a shard's rows).
    pub fn weights_mut(&mut self) -> &mut [f32] {
        self.weights.as_mut_slice()
    }
    /// Row `id`: `dim` floats.
    ///
    /// # Panics
    /// When `id >= num_embeddings()`.
    pub fn row(&self, id: usize) -> &[f32] {
        let d = self.dim();
        &self.weights()[id * d..(id + 1) * d]
    }
    /// Optimizer state, row-major `[num_embeddings, state floats per row]`
    /// (row-wise Adagrad: 1; Adagrad: dim; Adam: `[m | v]`, 2 x dim).
    pub fn optimizer_state(&self) -> &[f32] {
        self.state.as_slice()
    }
    /// Optimizer state, mutable; laid out as
    /// [`optimizer_state`](Self::optimizer_state).
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
///
/// The output of [`forward`](Self::forward) is a [`KeyedTensor`] of
/// `[batch, width]`, one column block per feature in
/// [`feature_names`](Self::feature_names) order; `width` is the sum of the
/// features' dims. [`backward_update`](Self::backward_update) takes the
/// gradient in that layout and applies the optimizer to the rows it touches.
///
/// ```rust
/// use ember_sparse::{
///     EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, SparseError, TableOptimizer,
/// };
///
/// // One table of 10 rows x 4 floats, shared by two features.
/// let configs = vec![EmbeddingBagConfig::new("items", 10, 4, &["item", "last_item"])];
/// let mut ebc = EmbeddingBagCollection::new(configs, TableOptimizer::sgd(0.1), 42)?;
/// assert_eq!(ebc.feature_names(), ["item", "last_item"]);
/// assert_eq!(ebc.feature_dims(), [4, 4]);
///
/// // Batch of 2: "item" bags [1, 2] and [3]; "last_item" bags [3] and [].
/// let kjt = KeyedJaggedTensor::from_lengths(
///     vec!["item".into(), "last_item".into()],
///     vec![1, 2, 3, 3],
///     &[2, 1, 1, 0],
///     None,
/// )?;
/// let pooled = ebc.forward(&kjt)?;
/// assert_eq!((pooled.batch(), pooled.width()), (2, 8)); // [batch, 4 + 4]
///
/// // Sum pooling: sample 0's "item" vector is row 1 + row 2; an empty bag gives zeros.
/// let table = ebc.table("items").unwrap();
/// let sum: Vec<f32> = table.row(1).iter().zip(table.row(2)).map(|(a, b)| a + b).collect();
/// assert_eq!(pooled.get(0, 0), sum.as_slice());
/// assert_eq!(pooled.get(1, 1), [0.0; 4]);
///
/// // Backward with fused SGD: `grad` is d(loss)/d(pooled), [batch, width] row-major.
/// let before = ebc.table("items").unwrap().row(3).to_vec();
/// let grad = vec![1.0f32; 2 * 8];
/// ebc.backward_update(&kjt, &grad)?;
/// assert_eq!(ebc.step(), 1);
/// // Row 3 is in two bags, so its summed gradient is 2 per element: w -= 0.1 * 2.
/// let after = ebc.table("items").unwrap().row(3);
/// for (b, a) in before.iter().zip(after) {
///     assert!((b - 0.2 - a).abs() < 1e-6);
/// }
///
/// // A gradient of the wrong shape, or an id past the table, is an error.
/// assert!(matches!(
///     ebc.backward_update(&kjt, &[0.0; 3]),
///     Err(SparseError::GradShape { .. })
/// ));
/// let bad = KeyedJaggedTensor::from_lengths(
///     vec!["item".into(), "last_item".into()],
///     vec![10],
///     &[1, 0, 0, 0],
///     None,
/// )?;
/// assert!(matches!(ebc.forward(&bad), Err(SparseError::IdOutOfRange { id: 10, .. })));
/// # Ok::<(), SparseError>(())
/// ```
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
    ///
    /// Output features follow the configs' order, then each config's
    /// `feature_names`. Fails when the optimizer or a config is invalid
    /// ([`SparseError::InvalidOptimizer`], [`SparseError::InvalidConfig`]), a
    /// feature is served by two tables ([`SparseError::FeatureServedTwice`]),
    /// or a table cannot be allocated ([`SparseError::Allocation`]).
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

    /// The tables, in config order.
    pub fn tables(&self) -> &[EmbeddingTable] {
        &self.tables
    }
    /// The tables, mutable (to load weights or optimizer state).
    pub fn tables_mut(&mut self) -> &mut [EmbeddingTable] {
        &mut self.tables
    }
    /// The table called `name`, if any.
    pub fn table(&self, name: &str) -> Option<&EmbeddingTable> {
        self.tables.iter().find(|t| t.name() == name)
    }
    /// The optimizer fused into [`backward_update`](Self::backward_update).
    pub fn optimizer(&self) -> &TableOptimizer {
        &self.optimizer
    }
    /// Number of backward updates applied so far (Adam's bias-correction step).
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Sets the step count, e.g. when resuming from a checkpoint, so Adam's
    /// bias correction carries on where it stopped.
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

    /// Pooled lookup of every feature: a new `[B, width]` output, `B` being
    /// `kjt.stride()`. Every key of `kjt` must be served by a table and every
    /// table's feature must be in `kjt` (in any order); ids must be in range.
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
        // Ids resolved before the gather, measured against pooling while
        // walking the offsets (2 threads, batch 2048, 512-byte rows): one id
        // per bag, 26-28 M ids/s against 16-17 sample by sample and 20-22
        // feature by feature; 20 ids per bag, 68-69 against 58 feature by
        // feature.
        let (least, most) = BLOCK_SAMPLES;
        let ids_per_sample = kjt.values().len().div_ceil(batch).max(1);
        let block = batch
            .div_ceil(4 * rayon::current_num_threads())
            .clamp(least, most)
            .min((BLOCK_IDS / ids_per_sample).max(1));
        (0..batch.div_ceil(block))
            .into_par_iter()
            .try_for_each(|b| {
                let first = b * block;
                BLOCK_ROWS
                    .with_borrow_mut(|rows| pool_block(&job, first, block.min(batch - first), rows))
            })
    }

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

thread_local! {
    /// Row addresses of a forward task's block (see `pool_block`), kept per
    /// thread so the forward allocates nothing once warm.
    static BLOCK_ROWS: std::cell::RefCell<Vec<*const f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Forward task: pools every feature for samples
/// `first..first + samples`, feature by feature. It first checks every id of
/// the block and resolves it to its row's address (`rows`, scratch), so the
/// gather loop holds only prefetches, loads, adds and stores: a lean loop
/// lets the core run further ahead, with more rows in flight.
fn pool_block(
    job: &ForwardJob<'_>,
    first: usize,
    samples: usize,
    rows: &mut Vec<*const f32>,
) -> Result<(), SparseError> {
    rows.clear();
    let values = job.kjt.values();
    for (i, slot) in job.slots.iter().enumerate() {
        let table = &job.tables[slot.table];
        let (num_rows, dim) = (table.num_embeddings() as u64, table.dim());
        let base = table.weights().as_ptr();
        // A feature's bags for consecutive samples are contiguous in `values`.
        let (start, end) = (job.bag(i, first).0, job.bag(i, first + samples - 1).1);
        for (p, &id) in (start..end).zip(&values[start..end]) {
            if id < 0 || id as u64 >= num_rows {
                return Err(table.id_error(&slot.name, job.sample_of(i, first, samples, p), id));
            }
            // In bounds: the id was checked just above.
            rows.push(base.wrapping_add(id as usize * dim));
        }
    }
    gather_block(job, first, samples, rows);
    Ok(())
}

multiversion!(fn gather_block(job: &ForwardJob<'_>, first: usize, samples: usize, rows: &[*const f32]) -> () = gather_block_body);

/// The gather of [`pool_block`]: `rows` holds the block's rows in the order
/// they are pooled, and the row `PREFETCH_DISTANCE` entries ahead is
/// prefetched, across bags and features.
#[inline(always)]
fn gather_block_body(job: &ForwardJob<'_>, first: usize, samples: usize, rows: &[*const f32]) {
    let mut next = 0;
    for i in 0..job.slots.len() {
        let dim = job.tables[job.slots[i].table].dim();
        with_fixed_dim!(
            dim,
            gather_feature(job, i, first..first + samples, rows, &mut next)
        );
    }
}

/// Pools feature `i` for `samples` from `rows[*next..]`, advancing `next`.
///
/// `D > 0` is the dim known at compile time: the sum then lives in registers
/// (8 AVX-512 registers for D = 128) and `out` is written once, as FBGEMM's
/// JIT kernels do. `D = 0` handles any dim, summing in `out` itself.
#[inline(always)]
fn gather_feature<const D: usize>(
    job: &ForwardJob<'_>,
    i: usize,
    samples: std::ops::Range<usize>,
    rows: &[*const f32],
    next: &mut usize,
) {
    let slot = &job.slots[i];
    let table = &job.tables[slot.table];
    let dim = table.dim();
    let weights = job.kjt.weights();
    for s in samples {
        let (start, end) = job.bag(i, s);
        // SAFETY: the output holds batch x width floats; this task alone
        // writes its samples' rows.
        let out =
            unsafe { std::slice::from_raw_parts_mut(job.out.at(s * job.width + slot.column), dim) };
        let mut acc = [0.0f32; D];
        for p in start..end {
            // Ahead may lie in the next feature's table, of another dim: the
            // hint then covers a little more or less of that row, harmlessly.
            if let Some(&ahead) = rows.get(*next + PREFETCH_DISTANCE) {
                prefetch_every(ahead, dim * 4, job.prefetch_step);
            }
            // SAFETY: pool_block resolved this entry from a checked id of
            // this table: a whole row of `dim` floats.
            let row = unsafe { std::slice::from_raw_parts(rows[*next], dim) };
            *next += 1;
            let w = weights.map_or(1.0, |w| w[p]);
            accumulate(&mut acc, out, row, w, p == start);
        }
        finish_bag(table, &acc, end - start, out);
    }
}

impl ForwardJob<'_> {
    /// The value range of slot `i`'s bag for sample `sample`.
    #[inline(always)]
    fn bag(&self, i: usize, sample: usize) -> (usize, usize) {
        let at = self.keys[i] * self.kjt.stride() + sample;
        let offsets = self.kjt.offsets();
        (offsets[at], offsets[at + 1])
    }

    /// The sample, among `first..first + samples`, whose bag of slot `i`
    /// holds value `p`.
    fn sample_of(&self, i: usize, first: usize, samples: usize, p: usize) -> usize {
        let at = self.keys[i] * self.kjt.stride() + first;
        let ends = &self.kjt.offsets()[at + 1..=at + samples];
        first + ends.partition_point(|&end| end <= p)
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
// SAFETY: see apply_segments and gather_feature: tasks write disjoint parts.
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
                let mut values = vec![0f32; n * dim];
                draw_chunk((lo, hi), [seed, index, chunk as u64], &mut values);
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

/// The initial values of one chunk of `INIT_CHUNK_ROWS` rows (`seed`, table
/// index, chunk index): the one draw both [`new_table`] and [`initial_rows`]
/// make, so they agree bit for bit.
fn draw_chunk((lo, hi): (f32, f32), key: [u64; 3], out: &mut [f32]) {
    let mut rng = crate::rng::Rng::new(crate::rng::mix(&key));
    for x in out {
        *x = lo + (hi - lo) * rng.next_f32();
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
            .for_each(|(chunk, rows)| draw_chunk((lo, hi), [seed, index, chunk as u64], rows))
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
