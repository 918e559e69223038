//! The pipelined loader.
//!
//! ```text
//!  epoch units (row groups) ── shuffled by (seed, epoch), then every
//!   │                          world_size-th one from `rank` kept
//!   ├─ unit 0, T, 2T.. ─► decode thread 0 ─► bounded queue 0 ─┐
//!   ├─ unit 1, T+1 ..  ─► decode thread 1 ─► bounded queue 1 ─┼─► batches, in unit order
//!   └─ ...                                                    ┘   (taken round-robin
//!                                                                 by the assembler thread)
//! ```
//! Decoding (Parquet, then the transforms) runs on `threads` threads ahead
//! of the consumer, at most `prefetch` row groups each; one more thread cuts
//! them into finished batches (KeyedJaggedTensor, dense rows, labels), at
//! most `prefetch` ahead, so the consumer only takes them. Taking the queues round-robin keeps the order
//! of batches a pure function of (data, seed, epoch), whatever the timing,
//! so a resumed run sees the same batches as one that never stopped.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver};
use ember_dense::Tensor;
use ember_sparse::rng::{mix, Rng};
use ember_sparse::KeyedJaggedTensor;
use serde::{Deserialize, Serialize};

use ember_sparse::EmbeddingBagConfig;

use crate::dataset::{Chunk, DecodeSpec, Unit};
use crate::spec::DatasetSpec;
use crate::{DataError, Dataset};

/// What a [`Loader`] reads and how: a [`DatasetSpec`] and the batching
/// around it. [`LoaderConfig::criteo`] gives the Criteo schema's columns
/// with the defaults; change fields from there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoaderConfig {
    /// Rows per batch (at least 1); an epoch's last batch may be shorter
    /// unless `drop_last`.
    pub batch_size: usize,
    /// The columns and the tables their features look up.
    pub spec: DatasetSpec,
    /// Shuffle the row groups of every epoch with this seed (`None`: file order).
    pub shuffle_seed: Option<u64>,
    /// Drop an epoch's last batch when it is short.
    pub drop_last: bool,
    /// This process's share of the row groups: those at positions `rank`,
    /// `rank + world_size`, ... of the (shuffled) epoch.
    pub rank: usize,
    /// Number of processes sharing the data (at least 1; `rank` is below it).
    pub world_size: usize,
    /// Decoding threads (batches are assembled on one more).
    pub threads: usize,
    /// Decoded row groups queued ahead, per thread, and finished batches
    /// queued ahead of the consumer.
    pub prefetch: usize,
    /// Read the label column (true by default). Without it (prediction on
    /// unlabelled data), the column need not exist and every label is NaN.
    #[serde(default = "labelled")]
    pub labels: bool,
}

fn labelled() -> bool {
    true
}

/// The most row groups or batches a queue holds ahead: deeper queues only
/// take memory (they have to cover one step's jitter, not an epoch).
pub const MAX_PREFETCH: usize = 1024;

/// The most decoding threads: more than any machine's cores.
pub const MAX_LOADER_THREADS: usize = 1024;

impl LoaderConfig {
    /// Batches of `batch_size` rows of `spec`, in file order, one
    /// decoding thread, nothing dropped.
    pub fn new(batch_size: usize, spec: DatasetSpec) -> Self {
        Self {
            batch_size,
            spec,
            shuffle_seed: None,
            drop_last: false,
            rank: 0,
            world_size: 1,
            threads: 1,
            prefetch: 2,
            labels: true,
        }
    }

    /// The Criteo schema's columns ([`DatasetSpec::criteo`]) for `tables`.
    pub fn criteo(batch_size: usize, tables: &[EmbeddingBagConfig]) -> Self {
        Self::new(batch_size, DatasetSpec::criteo(tables))
    }

    fn validate(&self) -> Result<(), DataError> {
        let fail = |option, value: usize, expected: String| {
            let value = value.to_string();
            Err(DataError::Option {
                option,
                value,
                expected,
            })
        };
        if self.batch_size == 0 {
            return fail("batch size", 0, "must be at least 1".into());
        }
        if self.world_size == 0 || self.rank >= self.world_size {
            let world = format!("must be below the world size, {}", self.world_size);
            return fail("rank", self.rank, world);
        }
        if self.threads == 0 || self.threads > MAX_LOADER_THREADS {
            let range = format!("from 1 to {MAX_LOADER_THREADS}");
            return fail("loader threads (--loader-threads)", self.threads, range);
        }
        if self.prefetch == 0 || self.prefetch > MAX_PREFETCH {
            let range = format!("from 1 to {MAX_PREFETCH}");
            return fail("prefetch depth (--prefetch)", self.prefetch, range);
        }
        self.spec.validate()
    }

    /// The least memory the queues take when full: `prefetch` decoded row
    /// groups per thread (of `rows_per_group` rows) and `prefetch` batches,
    /// counting a row's label, dense values and one id and length per
    /// sparse column.
    pub fn queued_bytes(&self, rows_per_group: usize) -> u64 {
        let row = 4 * (1 + self.spec.dense.len() as u64) + 12 * self.spec.sparse.len() as u64;
        let groups = (self.threads as u64).saturating_mul(rows_per_group as u64);
        let rows = groups.saturating_add(self.batch_size as u64);
        (self.prefetch as u64)
            .saturating_mul(rows)
            .saturating_mul(row)
    }
}

/// One training or evaluation batch: what the loader produces, synthetic
/// data makes and a model steps on.
#[derive(Clone, Debug)]
pub struct Batch {
    /// `[batch, num_dense]` dense features, transformed.
    pub dense: Tensor<f32>,
    /// The ids, one key per [`SparseColumn`](crate::SparseColumn) (its `key()`), one bag per row;
    /// a missing value is an empty bag. Weighted when the spec has weights.
    pub sparse: KeyedJaggedTensor,
    /// One label per row, 0.0 or 1.0 (NaN when read without labels).
    pub labels: Vec<f32>,
}

impl Batch {
    /// Rows in the batch.
    pub fn size(&self) -> usize {
        self.labels.len()
    }

    /// Samples `samples` of the batch (copies): a rank's block of a
    /// global batch.
    ///
    /// # Panics
    /// When `samples` goes past the batch.
    pub fn select(&self, samples: std::ops::Range<usize>) -> Batch {
        let cols = self.dense.cols();
        let dense = self.dense.data()[samples.start * cols..samples.end * cols].to_vec();
        Batch {
            dense: Tensor::from_vec(samples.len(), cols, dense).expect("a block of rows"),
            sparse: self.sparse.select_samples(samples.clone()),
            labels: self.labels[samples].to_vec(),
        }
    }

    /// Bytes of decoded data: dense and labels (f32), ids (i64), and one
    /// length per bag (i32, as TorchRec's KJT holds them).
    pub fn bytes(&self) -> usize {
        4 * (self.dense.data().len() + self.labels.len())
            + 8 * self.sparse.values().len()
            + 4 * self.sparse.weights().map_or(0, |w| w.len())
            + 4 * self.sparse.keys().len() * self.size()
    }
}

/// Batches from a dataset: a [`Dataset`] checked against a [`LoaderConfig`].
/// Each [`epoch`](Loader::epoch) starts its own decoding threads.
///
/// ```
/// use ember_dataloader::schema::{cat_column, NUM_CAT, NUM_INT};
/// use ember_dataloader::writer::{Bag, CriteoBatchBuilder, ParquetSink, SinkOptions};
/// use ember_dataloader::{Loader, LoaderConfig};
/// use ember_sparse::EmbeddingBagConfig;
///
/// // Ten rows in row groups of four, written with the crate's own writer.
/// let dir = tempfile::tempdir()?;
/// let mut builder = CriteoBatchBuilder::new(&[false; NUM_CAT]);
/// let options = SinkOptions {
///     row_group_size: 4,
///     ..SinkOptions::default()
/// };
/// let mut sink = ParquetSink::new(dir.path(), "day_0", builder.schema().clone(), options);
/// for r in 0..10 {
///     builder.push_row((r % 2) as i8, &[Some(r); NUM_INT], |i| match i {
///         0 if r % 3 == 0 => Bag::Missing,
///         _ => Bag::One(r as i64 * 100 + i as i64),
///     });
/// }
/// sink.write(&builder.finish())?;
/// sink.finish()?;
///
/// // Every categorical column as a feature with a table of 1000 rows.
/// let tables: Vec<EmbeddingBagConfig> = (0..NUM_CAT)
///     .map(|i| EmbeddingBagConfig::new(&format!("t_cat_{i}"), 1000, 16, &[&cat_column(i)]))
///     .collect();
/// let loader = Loader::open(&[dir.path().to_path_buf()], LoaderConfig::criteo(4, &tables))?;
/// assert_eq!(loader.dataset().num_rows(), 10);
/// assert_eq!(loader.batches_per_epoch(0), 3);
///
/// let mut rows = 0;
/// for batch in loader.epoch(0, 0) {
///     let batch = batch?;
///     assert_eq!(batch.dense.data().len(), batch.size() * NUM_INT);
///     assert_eq!(batch.sparse.keys().len(), NUM_CAT);
///     rows += batch.size();
/// }
/// assert_eq!(rows, 10);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Loader {
    dataset: Arc<Dataset>,
    config: LoaderConfig,
    spec: Arc<DecodeSpec>,
}

impl Loader {
    /// Checks every file for the configured columns and types.
    pub fn new(dataset: Dataset, config: LoaderConfig) -> Result<Self, DataError> {
        config.validate()?;
        let largest = (dataset.files().iter())
            .flat_map(|f| f.row_group_rows())
            .max()
            .unwrap_or(0);
        let queued = config.queued_bytes(largest);
        if let Some(have) = ember_sparse::storage::available_memory() {
            if queued > have {
                return Err(DataError::QueuesTooLarge {
                    need: queued,
                    available: have,
                    threads: config.threads,
                    prefetch: config.prefetch,
                    largest_row_group: largest,
                });
            }
        }
        let spec = DecodeSpec::new(config.spec.clone())?.with_labels(config.labels);
        spec.check(&dataset)?;
        Ok(Self {
            dataset: Arc::new(dataset),
            config,
            spec: Arc::new(spec),
        })
    }

    /// Opens `inputs` (files or directories) and checks them.
    pub fn open(inputs: &[PathBuf], config: LoaderConfig) -> Result<Self, DataError> {
        Self::new(Dataset::open(inputs)?, config)
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// The files it reads.
    pub fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    /// This rank's row groups of `epoch`, in the order they are read.
    pub fn units(&self, epoch: u64) -> Vec<Unit> {
        let mut units = self.dataset.units();
        if let Some(seed) = self.config.shuffle_seed {
            let mut rng = Rng::new(mix(&[seed, epoch, 0x5_4FF1E]));
            for i in (1..units.len()).rev() {
                units.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        let (rank, world) = (self.config.rank, self.config.world_size);
        (units.into_iter().enumerate())
            .filter(|(i, _)| i % world == rank)
            .map(|(_, u)| u)
            .collect()
    }

    /// Batches of `epoch` (from the metadata: nothing is read).
    pub fn batches_per_epoch(&self, epoch: u64) -> u64 {
        let rows: u64 = self.units(epoch).iter().map(|u| u.rows as u64).sum();
        let b = self.config.batch_size as u64;
        if self.config.drop_last {
            rows / b
        } else {
            rows.div_ceil(b)
        }
    }

    /// The batches of `epoch`, starting after its first `skip` batches
    /// (whole row groups before them are not read at all).
    pub fn epoch(&self, epoch: u64, skip: u64) -> Batches {
        let mut units: VecDeque<Unit> = self.units(epoch).into();
        let mut skip_rows = skip.saturating_mul(self.config.batch_size as u64);
        while let Some(u) = units.front() {
            if (u.rows as u64) > skip_rows {
                break;
            }
            skip_rows -= u.rows as u64;
            units.pop_front();
        }
        let units: Vec<Unit> = units.into();
        let threads = self.config.threads.min(units.len()).max(1);
        let mut receivers = Vec::with_capacity(threads);
        let mut workers = Vec::with_capacity(threads);
        for w in 0..threads {
            let (tx, rx) = bounded(self.config.prefetch);
            let mine: Vec<Unit> = units.iter().skip(w).step_by(threads).copied().collect();
            let (dataset, spec) = (self.dataset.clone(), self.spec.clone());
            workers.push(std::thread::spawn(move || {
                yield_to_the_step();
                for unit in mine {
                    // A panic inside the Parquet reader becomes an error naming the file.
                    let chunk = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        spec.decode(&dataset, unit)
                    }))
                    .unwrap_or_else(|_| {
                        Err(DataError::Parquet {
                            path: dataset.files()[unit.file].path.clone(),
                            message: format!("row group {}: the reader panicked", unit.row_group),
                        })
                    });
                    let failed = chunk.is_err();
                    // A closed queue means the consumer is gone: stop.
                    if tx.send(chunk).is_err() || failed {
                        return;
                    }
                }
            }));
            receivers.push(rx);
        }
        let spec = self.spec.spec();
        let mut assembler = Assembler {
            receivers,
            workers,
            num_units: units.len(),
            next_unit: 0,
            pending: VecDeque::new(),
            first_skip: skip_rows as usize,
            keys: spec.sparse.iter().map(|c| c.key().to_string()).collect(),
            weighted: spec.weighted(),
            num_dense: spec.num_dense(),
            batch_size: self.config.batch_size,
            drop_last: self.config.drop_last,
        };
        // Batches are finished here, off the consumer's thread: it only
        // takes them from the queue.
        let (tx, rx) = bounded(self.config.prefetch);
        let thread = std::thread::spawn(move || {
            yield_to_the_step();
            while let Some(batch) = assembler.next() {
                let failed = batch.is_err();
                if tx.send(batch).is_err() || failed {
                    break;
                }
            }
            assembler.stop();
        });
        Batches {
            rx: Some(rx),
            thread: Some(thread),
        }
    }
}

/// Moves the calling thread to Linux's idle scheduling class, so the
/// loader's threads run in the cycles the training step leaves idle rather
/// than take cores from it; the queued batches absorb their waits.
fn yield_to_the_step() {
    #[cfg(target_os = "linux")]
    // SAFETY: sched_setscheduler with pid 0 changes only the calling
    // thread's policy; a failure leaves it as it was.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
    }
}

/// The batches of one epoch, assembled on their own thread from the
/// decoding threads' row groups; dropping it stops every thread.
pub struct Batches {
    rx: Option<Receiver<Result<Batch, DataError>>>,
    thread: Option<JoinHandle<()>>,
}

impl Iterator for Batches {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        // The assembler ends the queue after the last batch or the first error.
        self.rx.as_ref()?.recv().ok()
    }
}

impl Drop for Batches {
    fn drop(&mut self) {
        // Closing the queue makes the assembler stop at its next send.
        self.rx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Cuts the decoded row groups, taken round-robin, into batches.
struct Assembler {
    receivers: Vec<Receiver<Result<Chunk, DataError>>>,
    workers: Vec<JoinHandle<()>>,
    num_units: usize,
    next_unit: usize,
    /// Decoded chunks not yet fully consumed, with the first unread row.
    pending: VecDeque<(Chunk, usize)>,
    /// Rows to skip in the first chunk (a resumed epoch).
    first_skip: usize,
    keys: Vec<String>,
    weighted: bool,
    num_dense: usize,
    batch_size: usize,
    drop_last: bool,
}

impl Assembler {
    /// Pulls decoded chunks until `want` rows are pending or the epoch ends.
    fn fill(&mut self, want: usize) -> Result<usize, DataError> {
        let mut have: usize = self.pending.iter().map(|(c, at)| c.rows - at).sum();
        while have < want && self.next_unit < self.num_units {
            let rx = &self.receivers[self.next_unit % self.receivers.len()];
            let chunk = rx.recv().map_err(|_| DataError::DecoderStopped)??;
            let at = if self.next_unit == 0 {
                self.first_skip.min(chunk.rows)
            } else {
                0
            };
            self.next_unit += 1;
            have += chunk.rows - at;
            self.pending.push_back((chunk, at));
        }
        Ok(have)
    }

    fn assemble(&mut self, n: usize) -> Result<Batch, DataError> {
        let nd = self.num_dense;
        let mut dense = Vec::with_capacity(n * nd);
        let mut labels = Vec::with_capacity(n);
        // Which rows of which pending chunks make this batch.
        let mut pieces = Vec::new();
        let mut left = n;
        for (i, (chunk, at)) in self.pending.iter().enumerate() {
            if left == 0 {
                break;
            }
            let take = left.min(chunk.rows - at);
            pieces.push((i, *at..*at + take));
            left -= take;
        }
        for (i, rows) in &pieces {
            let chunk = &self.pending[*i].0;
            dense.extend_from_slice(&chunk.dense[rows.start * nd..rows.end * nd]);
            labels.extend_from_slice(&chunk.labels[rows.clone()]);
        }
        let mut lengths = Vec::with_capacity(self.keys.len() * n);
        let mut values = Vec::new();
        let mut weights = Vec::new();
        for f in 0..self.keys.len() {
            for (i, rows) in &pieces {
                let feature = &self.pending[*i].0.features[f];
                let offsets = &feature.offsets[rows.start..=rows.end];
                lengths.extend(offsets.windows(2).map(|w| (w[1] - w[0]) as i64));
                let ids = offsets[0] as usize..offsets[offsets.len() - 1] as usize;
                values.extend_from_slice(&feature.values[ids.clone()]);
                if self.weighted {
                    match feature.weights.is_empty() {
                        // An unweighted feature of a weighted batch: weight 1.
                        true => weights.resize(values.len(), 1.0),
                        false => weights.extend_from_slice(&feature.weights[ids]),
                    }
                }
            }
        }
        // Advance past the rows taken.
        for (i, rows) in pieces.iter().rev() {
            let (chunk, at) = &mut self.pending[*i];
            *at = rows.end;
            if *at == chunk.rows {
                self.pending.remove(*i);
            }
        }
        let weights = self.weighted.then_some(weights);
        let sparse = KeyedJaggedTensor::from_lengths(self.keys.clone(), values, &lengths, weights)?;
        Ok(Batch {
            // The rows taken above, `nd` values each.
            dense: Tensor::from_vec(n, nd, dense).expect("n rows of nd values"),
            sparse,
            labels,
        })
    }

    fn next(&mut self) -> Option<Result<Batch, DataError>> {
        let have = match self.fill(self.batch_size) {
            Ok(have) => have,
            Err(e) => return Some(Err(e)),
        };
        let n = have.min(self.batch_size);
        if n == 0 || (self.drop_last && n < self.batch_size) {
            return None;
        }
        Some(self.assemble(n))
    }

    /// Closes the decoding queues (each thread stops at its next send) and
    /// waits for the threads.
    fn stop(&mut self) {
        self.receivers.clear();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
