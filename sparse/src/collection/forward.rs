//! The pooled forward lookup: `forward`, `forward_into` and their block
//! kernel (id checks, prefetching gather, pooling), with its task and scratch.
//!
//! Forward: a task is a block of samples. It first checks every id of the
//! block and resolves it to its row's address, then pools feature by feature
//! with nothing else in the loop, prefetching rows a few ids ahead. Random
//! gathers are latency-bound: what reaches the memory system's throughput is
//! keeping many rows in flight, and a lean loop lets the core run further
//! ahead.

use std::time::Instant;

use rayon::prelude::*;

use super::{EmbeddingBagCollection, EmbeddingTable, FeatureSlot, SharedMut};
use crate::rows::{narrow_to_bf16, narrow_to_f16, with_format, RowFormat};
use crate::simd::multiversion;
use crate::storage::prefetch_every;
use crate::{DataType, KeyedJaggedTensor, KeyedTensor, PooledValue, PoolingType, SparseError};

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
/// Distance, in bags, at which output rows are fetched before they are
/// written, for rows of at least `OUT_PREFETCH_MIN_DIM` floats (measured at
/// dim 128, one id per bag: 2, 4, 8 and 16 bags ahead gave 11.0, 12.6, 15.5
/// and 13.7 M ids/s for int8 rows).
const OUT_PREFETCH_BAGS: usize = 8;
/// Tasks per thread the features pooled in id order are cut into, at
/// least (see [`one_hot_part`]).
const ONE_HOT_TASKS_PER_THREAD: usize = 4;
/// One-hot features of tables of at least this many bytes may pool in id
/// order ([`pool_one_hot`]), where the collection's timing finds it faster
/// ([`OrderTuner`](super::order::OrderTuner)). Measured on a Zen 3 (26 tables, dim 128, one
/// id per bag, batch 2048, 2 threads), id order against sample order:
/// int8 rows, 1M a table (136 MB), 1.42x (fp16 output 1.43x); 100k (13.6
/// MB), 0.81x; fp32 rows, 1M (512 MB), 1.02x; 100k (51 MB), 1.11x; the
/// kaggle DLRM step (6.4 MB tables), 0.97x.
const ID_ORDER_MIN_BYTES: usize = 64 << 20;
/// Shorter output rows are left as they were (not measured: the kaggle
/// shape's output, dim 16, is 3.4 MB and mostly stays in cache).
const OUT_PREFETCH_MIN_DIM: usize = 64;

impl EmbeddingBagCollection {
    /// Pooled lookup of every feature: a new `[B, width]` output, `B` being
    /// `kjt.stride()`. Every table's feature must be in `kjt` (in any
    /// order; keys no table serves are ignored); ids must be in range.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor, SparseError> {
        let mut out = self.new_output(kjt.stride());
        self.forward_into(kjt, &mut out)?;
        Ok(out)
    }

    /// Pooled lookup into a reused output (no allocation once `out` has grown
    /// to the batch). Every id is bounds-checked; a bad one is reported (with
    /// several, which one depends on task timing).
    ///
    /// `out` holds fp32, or for inference fp16 or bf16 ([`PooledValue`]):
    /// each pooled value is then the nearest of its type to the fp32 sum,
    /// and the forward writes half the bytes (its bound with one id per bag
    /// and wide rows). The backward takes fp32 gradients whatever the type.
    pub fn forward_into<T: PooledValue>(
        &self,
        kjt: &KeyedJaggedTensor,
        out: &mut KeyedTensor<T>,
    ) -> Result<(), SparseError> {
        self.forward_ordered(kjt, out, None)
    }

    /// [`forward_into`](Self::forward_into), pooling in id order every
    /// one-hot feature whose rows take at least `id_order_min_bytes` (a
    /// parameter so tests can send every feature either way; `None`: large
    /// tables' features in the order the collection's timing chose).
    fn forward_ordered<T: PooledValue>(
        &self,
        kjt: &KeyedJaggedTensor,
        out: &mut KeyedTensor<T>,
        id_order_min_bytes: Option<usize>,
    ) -> Result<(), SparseError> {
        let kjt = self.forward_input(kjt)?;
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
            *out = self.new_output_of(batch);
        }
        out.set_batch(batch);
        match id_order_min_bytes {
            Some(min_bytes) => self
                .pool(kjt, &keys, out.values_mut(), min_bytes, false)
                .map(drop),
            None => self.pool_tuned(kjt, &keys, out.values_mut()),
        }
    }

    /// The pooled lookup written straight into `out`, the `[B, width]`
    /// row-major values a [`forward`](Self::forward) would return (no
    /// keyed tensor, no copy): for a dense layer's input tensor, say.
    /// `out` must hold exactly `kjt.stride() * width()` values.
    ///
    /// ```
    /// # use ember_sparse::*;
    /// let ebc = EmbeddingBagCollection::new(
    ///     vec![EmbeddingBagConfig::new("t", 10, 4, &["f"])], TableOptimizer::None, 1)?;
    /// let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![3, 7, 1], &[2, 1], None)?;
    /// let mut out = vec![0.0f32; 2 * 4];
    /// ebc.forward_into_slice(&kjt, &mut out)?;
    /// assert_eq!(out, ebc.forward(&kjt)?.values());
    /// # Ok::<(), SparseError>(())
    /// ```
    pub fn forward_into_slice<T: PooledValue>(
        &self,
        kjt: &KeyedJaggedTensor,
        out: &mut [T],
    ) -> Result<(), SparseError> {
        let kjt = self.forward_input(kjt)?;
        let keys = self.resolve_keys(kjt)?;
        let want = kjt.stride() * self.width;
        if out.len() != want {
            return Err(SparseError::KeyedTensorShape(format!(
                "an output of {} values for {} samples of width {} ({want})",
                out.len(),
                kjt.stride(),
                self.width
            )));
        }
        self.pool_tuned(kjt, &keys, out)
    }

    /// [`pool`](Self::pool), the large tables' one-hot features in the
    /// order the collection's [`OrderTuner`](super::order::OrderTuner) gives, timed while it chooses.
    fn pool_tuned<T: PooledValue>(
        &self,
        kjt: &KeyedJaggedTensor,
        keys: &[usize],
        out: &mut [T],
    ) -> Result<(), SparseError> {
        let trial = self.order.next();
        let min_bytes = match trial.id_order {
            true => ID_ORDER_MIN_BYTES,
            false => usize::MAX,
        };
        let start = Instant::now();
        let choosing = self.order.chosen().is_none();
        let could = self.pool(kjt, keys, out, min_bytes, choosing)?;
        // Only a forward that could pool in id order tells the orders apart.
        if could && !kjt.values().is_empty() {
            let per_id = start.elapsed().as_secs_f64() / kjt.values().len() as f64;
            self.order.record(trial, per_id);
        }
        Ok(())
    }

    /// Whether the one-hot features of large tables pool in id order, as
    /// this collection's timing of its first forwards chose (`None`: not
    /// chosen yet). Either order gives the same sums; the faster depends
    /// on the machine.
    pub fn pools_in_id_order(&self) -> Option<bool> {
        self.order.chosen()
    }

    /// Pools `kjt` (its slots' keys at `keys`) into `out`, `[B, width]`.
    /// With `probe`, says whether any feature could pool in id order (at
    /// [`ID_ORDER_MIN_BYTES`]), whether it did or not.
    fn pool<T: PooledValue>(
        &self,
        kjt: &KeyedJaggedTensor,
        keys: &[usize],
        out: &mut [T],
        id_order_min_bytes: usize,
        probe: bool,
    ) -> Result<bool, SparseError> {
        let batch = kjt.stride();
        let width = self.width;
        if width == 0 || batch == 0 {
            return Ok(false);
        }
        debug_assert_eq!(out.len(), batch * width);
        let mut job = ForwardJob {
            tables: &self.tables,
            slots: &self.slots,
            keys,
            kjt,
            width,
            out: SharedMut(out.as_mut_ptr() as *mut u8),
            out_type: T::DTYPE,
            value_bytes: std::mem::size_of::<T>(),
            // Hint every other line once bags average 3 ids or more.
            prefetch_step: if kjt.values().len()
                >= MULTI_HOT_IDS_PER_BAG * kjt.offsets().len().saturating_sub(1)
            {
                128
            } else {
                64
            },
            in_id_order: Vec::new(),
        };
        job.in_id_order = (0..self.slots.len())
            .map(|i| job.pools_in_id_order(i, batch, id_order_min_bytes))
            .collect();
        let could = probe
            && (0..self.slots.len()).any(|i| job.pools_in_id_order(i, batch, ID_ORDER_MIN_BYTES));
        // Tasks: blocks of samples over the features pooled in sample order
        // (none when every feature is pooled in id order), then parts of
        // the features pooled in id order.
        let ordered: Vec<usize> = (0..self.slots.len())
            .filter(|&i| job.in_id_order[i])
            .collect();
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
        let blocks = if ordered.len() < self.slots.len() {
            batch.div_ceil(block)
        } else {
            0
        };
        let part = one_hot_part(ordered.len(), batch);
        let parts = batch.div_ceil(part);
        (0..blocks + ordered.len() * parts)
            .into_par_iter()
            .try_for_each(|task| {
                BLOCK_SCRATCH.with_borrow_mut(|scratch| match task.checked_sub(blocks) {
                    None => {
                        let first = task * block;
                        pool_block(&job, first, block.min(batch - first), scratch)
                    }
                    Some(t) => {
                        let first = t % parts * part;
                        let samples = first..(first + part).min(batch);
                        pool_one_hot(&job, ordered[t / parts], samples, scratch)
                    }
                })
            })?;
        Ok(could)
    }
}

/// What every forward task reads.
struct ForwardJob<'a> {
    tables: &'a [EmbeddingTable],
    slots: &'a [FeatureSlot],
    /// Input key index of each slot.
    keys: &'a [usize],
    kjt: &'a KeyedJaggedTensor,
    width: usize,
    /// The output, `[batch, width]` values of `out_type`; tasks write
    /// disjoint (rows, columns).
    out: SharedMut<u8>,
    /// fp32, fp16 or bf16 ([`PooledValue`]), chosen as each bag is written
    /// (a branch every bag takes the same way): the gather loops stay one
    /// per row format and dim, whatever the output.
    out_type: DataType,
    value_bytes: usize,
    /// Bytes between prefetch hints within a row (see `prefetch_every`).
    prefetch_step: usize,
    /// Per slot: pooled by [`pool_one_hot`] (in id order), not by the
    /// blocks.
    in_id_order: Vec<bool>,
}

/// A forward task's scratch, kept per thread so the forward allocates
/// nothing once warm.
#[derive(Default)]
struct BlockScratch {
    /// Row addresses of the block (see `pool_block`).
    rows: Vec<*const u8>,
    /// A bag's running sum at a dim with no fixed-dim kernel.
    sum: Vec<f32>,
    /// The one-hot forward's (id, sample) keys (see `pool_one_hot`).
    keys: Vec<u64>,
}

thread_local! {
    static BLOCK_SCRATCH: std::cell::RefCell<BlockScratch> = std::cell::RefCell::new(BlockScratch::default());
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
    scratch: &mut BlockScratch,
) -> Result<(), SparseError> {
    let rows = &mut scratch.rows;
    rows.clear();
    let values = job.kjt.values();
    for (i, slot) in job.slots.iter().enumerate() {
        if job.in_id_order[i] {
            continue;
        }
        let table = &job.tables[slot.table];
        // A disk-tier table's ids are its cache's slots by now.
        let resident = table.rows();
        let (num_rows, stride) = (table.resident_rows() as u64, resident.stride());
        let base = resident.as_ptr();
        // A feature's bags for consecutive samples are contiguous in `values`.
        let (start, end) = (job.bag(i, first).0, job.bag(i, first + samples - 1).1);
        for (p, &id) in (start..end).zip(&values[start..end]) {
            if id < 0 || id as u64 >= num_rows {
                return Err(table.id_error(&slot.name, job.sample_of(i, first, samples, p), id));
            }
            // In bounds: the id was checked just above.
            rows.push(base.wrapping_add(id as usize * stride));
        }
    }
    gather_block(job, first, samples, rows, &mut scratch.sum);
    Ok(())
}

/// Samples per task of the features pooled in id order: a feature's
/// whole batch, so that its rows are visited in id order over all of it,
/// or a share of it when there are too few such features to give each
/// thread [`ONE_HOT_TASKS_PER_THREAD`] tasks.
fn one_hot_part(features: usize, batch: usize) -> usize {
    let tasks = ONE_HOT_TASKS_PER_THREAD * rayon::current_num_threads();
    batch.div_ceil(tasks.div_ceil(features.max(1))).max(1)
}

/// Forward task of a feature pooled in id order (every bag one id, as
/// Criteo's features): its bags for `samples`, their rows visited in id
/// order, each pooled row written to its sample's place. Where reaching a
/// new row of a large table costs more than its bytes (its page's
/// translation), rows in id order lie near the last one: see
/// [`ID_ORDER_MIN_BYTES`]. Sums are the block path's bit for bit (one row
/// times its weight; the mean of one is itself).
fn pool_one_hot(
    job: &ForwardJob<'_>,
    i: usize,
    samples: std::ops::Range<usize>,
    scratch: &mut BlockScratch,
) -> Result<(), SparseError> {
    let slot = &job.slots[i];
    let table = &job.tables[slot.table];
    // A disk-tier table's ids are its cache's slots by now.
    let resident = table.rows();
    let (num_rows, stride) = (table.resident_rows() as u64, resident.stride());
    let base = resident.as_ptr();
    let start = job.bag(i, samples.start).0;
    let values = &job.kjt.values()[start..start + samples.len()];
    // (id, sample) in one word, sorted by id: is_one_hot checked that ids
    // fit in 32 bits.
    let keys = &mut scratch.keys;
    keys.clear();
    for (s, &id) in samples.clone().zip(values) {
        if id < 0 || id as u64 >= num_rows {
            return Err(table.id_error(&slot.name, s, id));
        }
        keys.push(((id as u64) << 32) | s as u64);
    }
    keys.sort_unstable();
    let rows = &mut scratch.rows;
    rows.clear();
    // In bounds: every id was checked above.
    rows.extend(
        keys.iter()
            .map(|&k| base.wrapping_add((k >> 32) as usize * stride)),
    );
    gather_one_hot(job, i, rows, keys, &mut scratch.sum);
    Ok(())
}

multiversion!(fn gather_one_hot(job: &ForwardJob<'_>, i: usize, rows: &[*const u8], keys: &[u64], sum: &mut Vec<f32>) -> () = gather_one_hot_body::<true>, baseline gather_one_hot_body::<false>);

/// The gather of [`pool_one_hot`], with the kernel of the feature's row
/// format (fp16 by F16C when `F16C`, as [`gather_block_body`]).
#[inline(always)]
fn gather_one_hot_body<const F16C: bool>(
    job: &ForwardJob<'_>,
    i: usize,
    rows: &[*const u8],
    keys: &[u64],
    sum: &mut Vec<f32>,
) {
    let table = &job.tables[job.slots[i].table];
    let bag = Bag { f16c: F16C, sum };
    with_format!(
        kernel F16C,
        table.data_type(),
        one_hot_format(job, i, rows, keys, bag)
    );
}

/// [`one_hot_feature`] for rows of format `F`, at the feature's dim.
#[inline(always)]
fn one_hot_format<F: RowFormat>(
    job: &ForwardJob<'_>,
    i: usize,
    rows: &[*const u8],
    keys: &[u64],
    bag: Bag<'_>,
) {
    let dim = job.tables[job.slots[i].table].dim();
    with_fixed_dim!(dim, one_hot_feature::<F>(job, i, rows, keys, bag));
}

/// Pools feature `i`'s one-id bags in the order of `rows` (`keys[k]`'s
/// low 32 bits are row `k`'s sample), prefetching rows and output rows
/// ahead as [`gather_feature`] does.
#[inline(always)]
fn one_hot_feature<const D: usize, F: RowFormat>(
    job: &ForwardJob<'_>,
    i: usize,
    rows: &[*const u8],
    keys: &[u64],
    bag: Bag<'_>,
) {
    let (slot, table, dim, stride) = job.feature::<D, F>(i);
    let weights = job.kjt.weights();
    let Bag { f16c, sum } = bag;
    sum.resize(if D > 0 { 0 } else { dim }, 0.0);
    let sample = |k: usize| keys[k] as u32 as usize;
    // Every bag holds one id: sample s's is value `first + s`.
    let first = job.bag(i, 0).0;
    for (k, &row) in rows.iter().enumerate() {
        // Output rows are written out of order: each is fetched ahead.
        if D >= OUT_PREFETCH_MIN_DIM && k + OUT_PREFETCH_BAGS < rows.len() {
            job.prefetch_output(slot.column, sample(k + OUT_PREFETCH_BAGS), dim);
        }
        if let Some(&ahead) = rows.get(k + PREFETCH_DISTANCE) {
            prefetch_every(ahead, stride, job.prefetch_step);
        }
        let s = sample(k);
        let w = weights.map_or(1.0, |w| w[first + s]);
        let mut acc = [0.0f32; D];
        // SAFETY: pool_one_hot resolved `row` from a checked id of this
        // table: a whole row of `dim` columns in format F.
        unsafe { accumulate::<D, F>(&mut acc, sum, row, w, true) };
        let sum: &mut [f32] = if D > 0 { &mut acc } else { sum };
        finish_sum(table, sum, 1);
        // SAFETY: this task alone writes this feature's columns of its
        // samples.
        unsafe { job.store_bag(slot.column, s, sum, f16c) };
    }
}

multiversion!(fn gather_block(job: &ForwardJob<'_>, first: usize, samples: usize, rows: &[*const u8], sum: &mut Vec<f32>) -> () = gather_block_body::<true>, baseline gather_block_body::<false>);

/// The gather of [`pool_block`]: `rows` holds the block's rows in the order
/// they are pooled, and the row `PREFETCH_DISTANCE` entries ahead is
/// prefetched, across bags and features; each feature pools with the
/// kernel of its rows' format and dim (fp16 by F16C when `F16C`, in the
/// builds that have it, which narrow an fp16 output by F16C too).
#[inline(always)]
fn gather_block_body<const F16C: bool>(
    job: &ForwardJob<'_>,
    first: usize,
    samples: usize,
    rows: &[*const u8],
    sum: &mut Vec<f32>,
) {
    let mut next = 0;
    for i in (0..job.slots.len()).filter(|&i| !job.in_id_order[i]) {
        let table = &job.tables[job.slots[i].table];
        let samples = first..first + samples;
        let bag = Bag {
            f16c: F16C,
            sum: &mut *sum,
        };
        with_format!(
            kernel F16C,
            table.data_type(),
            gather_format(job, i, samples, rows, &mut next, bag)
        );
    }
}

/// What a feature's gather needs besides the job: whether this build has
/// F16C, and the sum's scratch for dims with no fixed-dim kernel.
struct Bag<'a> {
    f16c: bool,
    sum: &'a mut Vec<f32>,
}

/// [`gather_feature`] for rows of format `F`, at the feature's dim.
#[inline(always)]
fn gather_format<F: RowFormat>(
    job: &ForwardJob<'_>,
    i: usize,
    samples: std::ops::Range<usize>,
    rows: &[*const u8],
    next: &mut usize,
    bag: Bag<'_>,
) {
    let dim = job.tables[job.slots[i].table].dim();
    with_fixed_dim!(dim, gather_feature::<F>(job, i, samples, rows, next, bag));
}

/// Pools feature `i` for `samples` from `rows[*next..]`, advancing `next`;
/// rows are in format `F`, decoded value by value as they are summed.
///
/// `D > 0` is the dim known at compile time: the sum then lives in registers
/// (8 AVX-512 registers for D = 128) and `out` is written once, as FBGEMM's
/// JIT kernels do. `D = 0` handles any dim, summing in `bag.sum`.
#[inline(always)]
fn gather_feature<const D: usize, F: RowFormat>(
    job: &ForwardJob<'_>,
    i: usize,
    samples: std::ops::Range<usize>,
    rows: &[*const u8],
    next: &mut usize,
    bag: Bag<'_>,
) {
    let (slot, table, dim, stride) = job.feature::<D, F>(i);
    let weights = job.kjt.weights();
    let end_sample = samples.end;
    let Bag { f16c, sum } = bag;
    sum.resize(if D > 0 { 0 } else { dim }, 0.0);
    for s in samples {
        if D >= OUT_PREFETCH_MIN_DIM && s + OUT_PREFETCH_BAGS < end_sample {
            job.prefetch_output(slot.column, s + OUT_PREFETCH_BAGS, dim);
        }
        let (start, end) = job.bag(i, s);
        let mut acc = [0.0f32; D];
        for p in start..end {
            // Ahead may lie in the next feature's table, of another dim: the
            // hint then covers a little more or less of that row, harmlessly.
            if let Some(&ahead) = rows.get(*next + PREFETCH_DISTANCE) {
                prefetch_every(ahead, stride, job.prefetch_step);
            }
            let row = rows[*next];
            *next += 1;
            let w = weights.map_or(1.0, |w| w[p]);
            // SAFETY: pool_block resolved this entry from a checked id of
            // this table: a whole row of `dim` columns in format F.
            unsafe { accumulate::<D, F>(&mut acc, sum, row, w, p == start) };
        }
        let sum: &mut [f32] = if D > 0 { &mut acc } else { sum };
        finish_sum(table, sum, end - start);
        // SAFETY: this task alone writes its samples' rows.
        unsafe { job.store_bag(slot.column, s, sum, f16c) };
    }
}

impl ForwardJob<'_> {
    /// Slot `i`, its table, and the dim and row stride the kernel for rows
    /// of format `F` at dim `D` uses.
    #[inline(always)]
    fn feature<const D: usize, F: RowFormat>(
        &self,
        i: usize,
    ) -> (&FeatureSlot, &EmbeddingTable, usize, usize) {
        let slot = &self.slots[i];
        let table = &self.tables[slot.table];
        // D > 0 is the table's dim (with_fixed_dim chose it): as a constant,
        // the output row's length is known and its store inlined (a memcpy
        // call per bag otherwise: measured 1.6x slower at dim 128).
        let dim = if D > 0 { D } else { table.dim() };
        // A constant too, for the prefetch: one register less in the loop.
        let stride = crate::rows::fixed_stride::<F, D>(table.rows().stride());
        (slot, table, dim, stride)
    }

    /// Fetches the output row of `sample` at `column` (`dim` values) before
    /// it is written: a store to a line not in cache waits for it, and
    /// stalls the gather. A hint only: the address is within the output,
    /// and a prefetch never faults.
    #[inline(always)]
    fn prefetch_output(&self, column: usize, sample: usize, dim: usize) {
        let at = (sample * self.width + column) * self.value_bytes;
        let ahead = self.out.0.wrapping_add(at) as *const u8;
        prefetch_every(ahead, dim * self.value_bytes, 64);
    }

    /// Writes a bag's pooled `sum` as the output row of `sample` at
    /// `column`.
    ///
    /// # Safety
    /// `sample < batch` and `column + sum.len() <= width`; no other task
    /// writes these values.
    #[inline(always)]
    unsafe fn store_bag(&self, column: usize, sample: usize, sum: &[f32], f16c: bool) {
        let out = self
            .out
            .at((sample * self.width + column) * self.value_bytes);
        store_pooled(sum, out, self.out_type, f16c);
    }

    /// Whether slot `i` is pooled in id order: every bag holds one id, of
    /// a table whose rows (those it addresses: a disk tier's cache) take
    /// at least `min_bytes`, with ids of 32 bits (the keys of
    /// [`pool_one_hot`]).
    fn pools_in_id_order(&self, i: usize, batch: usize, min_bytes: usize) -> bool {
        let at = self.keys[i] * self.kjt.stride();
        let table = &self.tables[self.slots[i].table];
        table.rows().bytes().len() >= min_bytes
            && table.resident_rows() <= u32::MAX as usize
            && self.kjt.offsets()[at..=at + batch]
                .windows(2)
                .all(|w| w[1] - w[0] == 1)
    }

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

/// Adds `w * row` to a bag's running sum: in `acc` when the dim is a
/// compile-time `D > 0`, else in `out` (whose first row initialises it).
///
/// # Safety
/// `row` is a whole row of `D` columns in format `F` when `D > 0`, else of
/// `out.len()`.
#[inline(always)]
unsafe fn accumulate<const D: usize, F: RowFormat>(
    acc: &mut [f32; D],
    out: &mut [f32],
    row: *const u8,
    w: f32,
    first: bool,
) {
    if D > 0 {
        return F::add_row(acc, row, w);
    }
    let dim = out.len();
    let h = F::header(row, dim);
    if first {
        // The first row initialises the sum: no zero-fill pass.
        for (d, o) in out.iter_mut().enumerate() {
            *o = w * F::value(row, h, dim, d);
        }
    } else {
        for (d, o) in out.iter_mut().enumerate() {
            *o += w * F::value(row, h, dim, d);
        }
    }
}

/// Finishes a bag of `len` ids' sum: zeros for an empty bag (whose sum
/// scratch holds another bag's), divided by `len` for mean pooling.
#[inline(always)]
fn finish_sum(table: &EmbeddingTable, sum: &mut [f32], len: usize) {
    if len == 0 {
        sum.fill(0.0);
    } else if table.config.pooling == PoolingType::Mean {
        let inv = 1.0 / len as f32;
        sum.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Writes a bag's pooled `sum` at `out` as values of `out_type`, the
/// narrow types rounded to the nearest (fp16 by F16C when `f16c`).
///
/// # Safety
/// `out` holds `sum.len()` values of `out_type` (a [`PooledValue`]'s),
/// written by no one else;
/// `f16c` only in the kernel builds that enable F16C.
#[inline(always)]
unsafe fn store_pooled(sum: &[f32], out: *mut u8, out_type: DataType, f16c: bool) {
    match out_type {
        DataType::Fp16 if f16c => narrow_to_f16::<true>(sum, out as *mut u16),
        DataType::Fp16 => narrow_to_f16::<false>(sum, out as *mut u16),
        DataType::Bf16 => narrow_to_bf16(sum, out as *mut u16),
        // Fp32: PooledValue admits no other type.
        _ => std::ptr::copy_nonoverlapping(sum.as_ptr(), out as *mut f32, sum.len()),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::rng::Rng;
    use crate::{
        bf16, f16, DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor,
        KeyedTensor, PooledValue, PoolingType, TableOptimizer,
    };

    /// Forward into a `T` output, every one-hot feature pooled in id order
    /// (`true`) or every feature by blocks.
    fn pooled<T: PooledValue>(
        ebc: &EmbeddingBagCollection,
        kjt: &KeyedJaggedTensor,
        in_id_order: bool,
    ) -> Result<Vec<u32>, crate::SparseError>
    where
        f32: From<T>,
    {
        let mut out: KeyedTensor<T> = ebc.new_output_of(0);
        let min_bytes = if in_id_order { 0 } else { usize::MAX };
        ebc.forward_ordered(kjt, &mut out, Some(min_bytes))?;
        // Widened exactly, so equal bits mean equal values of T.
        Ok(out
            .values()
            .iter()
            .map(|&v| f32::from(v).to_bits())
            .collect())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Pooled in id order, every type of row and output, any dim, sum
        /// or mean, weighted or not, one-hot features beside multi-hot
        /// ones: the same bits as pooled by blocks, and a bad id names the
        /// same sample.
        #[test]
        fn id_order_pools_as_the_blocks(
            tables in prop::collection::vec(
                (prop_oneof![1usize..9, 300usize..900], prop_oneof![1usize..40, Just(16), Just(64), Just(128)], 0usize..7, any::<bool>(), any::<bool>()),
                1..7,
            ),
            batch in prop_oneof![1usize..6, 60usize..300],
            weighted in any::<bool>(),
            seed in any::<u64>(),
            bad in any::<bool>(),
        ) {
            let mut rng = Rng::new(seed);
            let (mut configs, mut keys, mut lengths, mut values) = (vec![], vec![], vec![], vec![]);
            for (t, &(rows, dim, dtype, mean, one_hot)) in tables.iter().enumerate() {
                let pooling = if mean { PoolingType::Mean } else { PoolingType::Sum };
                let key = format!("f{t}");
                configs.push(
                    EmbeddingBagConfig::new(&format!("t{t}"), rows, dim, &[&key])
                        .with_pooling(pooling)
                        .with_data_type(DataType::ALL[dtype]),
                );
                keys.push(key);
                for _ in 0..batch {
                    let len = if one_hot { 1 } else { rng.below(4) as i64 };
                    lengths.push(len);
                    values.extend((0..len).map(|_| rng.below(rows as u64) as i64));
                }
            }
            if bad && !values.is_empty() {
                let at = rng.below(values.len() as u64) as usize;
                values[at] = 1 << 20;
            }
            let weights = weighted.then(|| values.iter().map(|_| rng.next_f32() * 2.0 - 0.5).collect());
            let kjt = KeyedJaggedTensor::from_lengths(keys, values, &lengths, weights).unwrap();
            let ebc = EmbeddingBagCollection::new(configs, TableOptimizer::None, seed).unwrap();
            prop_assert_eq!(pooled::<f32>(&ebc, &kjt, true), pooled::<f32>(&ebc, &kjt, false));
            prop_assert_eq!(pooled::<f16>(&ebc, &kjt, true), pooled::<f16>(&ebc, &kjt, false));
            prop_assert_eq!(pooled::<bf16>(&ebc, &kjt, true), pooled::<bf16>(&ebc, &kjt, false));
        }
    }
}
