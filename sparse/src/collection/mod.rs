//! `EmbeddingBagCollection`: tables, the pooled forward lookup and the backward
//! scatter with the optimizer fused in. This file holds the table and collection
//! types, their construction and accessors, and the helpers the kernels share.

use crate::kv::KvIndex;
use crate::optimizer::{OptimizerState, TableStepSettings};
use crate::rows::TableRows;
use crate::{
    DataType, DiskTierConfig, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PooledValue,
    SparseError, TableOptimizer, TierStats,
};

/// Calls `kernel::<D, F>(args)` with the dim as a compile-time `D` where a
/// fixed-dim kernel exists (16, 32, 64, 128), else `kernel::<0, F>(args)`;
/// both passes use it.
macro_rules! with_fixed_dim {
    ($dim:expr, $kernel:ident::<$f:ty>($($arg:expr),* $(,)?)) => {
        match $dim {
            16 => $kernel::<16, $f>($($arg),*),
            32 => $kernel::<32, $f>($($arg),*),
            64 => $kernel::<64, $f>($($arg),*),
            128 => $kernel::<128, $f>($($arg),*),
            _ => $kernel::<0, $f>($($arg),*),
        }
    };
}

mod backward;
mod changed;
mod forward;
mod init;
mod keyed;
mod order;
mod sequence;
mod staging;
mod store;

use backward::BackwardScratch;
use changed::ChangedRows;
use init::new_table;
pub use init::{initial_rows, RowMaker};
pub use sequence::{EmbeddingCollection, EmbeddingConfig, JaggedEmbeddings};
use store::TableStore;

/// One table: its storage (its rows, in its data type, and their
/// optimizer state: in memory, or on the disk tier behind a cache) and
/// scratch for the backward pass.
#[derive(Debug)]
pub struct EmbeddingTable {
    config: EmbeddingBagConfig,
    store: Box<dyn TableStore>,
    part: TablePart,
    scratch: BackwardScratch,
    /// A key-value table's map from raw ids to rows.
    kv: Option<KvIndex>,
    /// Rows training changed since a checkpoint last took them.
    changed: ChangedRows,
}

/// Where a table's rows sit in the whole table they are part of: a shard's
/// local row `l` is global row `first_row + l * row_step`, its column `c`
/// global column `first_column + c`. Stochastic rounding draws by global
/// position, so a sharded table rounds exactly as the unsharded one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TablePart {
    /// The whole table's position among its collection's tables.
    pub table: u64,
    /// Global row of local row 0.
    pub first_row: u64,
    /// Global rows between consecutive local rows.
    pub row_step: u64,
    /// Global column of local column 0.
    pub first_column: u64,
}

impl TablePart {
    /// A whole table at position `table`.
    pub fn whole(table: u64) -> Self {
        Self {
            table,
            first_row: 0,
            row_step: 1,
            first_column: 0,
        }
    }
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
    /// Columns per row (`config().embedding_dim`).
    pub fn dim(&self) -> usize {
        self.config.embedding_dim
    }
    /// The rows' data type (`config().data_type`).
    pub fn data_type(&self) -> DataType {
        self.rows().dtype()
    }
    /// The rows the kernels address: the table's, or its cache's slots.
    pub(crate) fn rows(&self) -> &TableRows {
        self.store.resident().0
    }
    /// All rows of a fp32 table, row-major `[num_embeddings, dim]`.
    ///
    /// # Panics
    /// When the table is not fp32 or is on the disk tier: read any table
    /// with [`read_row`](Self::read_row) (or [`row_bytes`](Self::row_bytes)
    /// in RAM).
    pub fn weights(&self) -> &[f32] {
        self.assert_in_ram("weights");
        self.rows()
            .as_f32()
            .expect("weights(): the table is not fp32")
    }
    /// All rows of a fp32 table, mutable (to load a checkpoint or a shard's rows).
    ///
    /// # Panics
    /// When the table is not fp32 or is on the disk tier (see
    /// [`write_row`](Self::write_row)).
    pub fn weights_mut(&mut self) -> &mut [f32] {
        self.assert_in_ram("weights_mut");
        (self.store.parts_mut().0)
            .as_f32_mut()
            .expect("weights_mut(): the table is not fp32")
    }
    /// Row `id` of a fp32 table: `dim` floats.
    ///
    /// # Panics
    /// When `id >= num_embeddings()`, or the table is not fp32 or is on the
    /// disk tier.
    pub fn row(&self, id: usize) -> &[f32] {
        let d = self.dim();
        &self.weights()[id * d..(id + 1) * d]
    }
    /// Row `id`'s values as fp32, in any data type: exactly the values the
    /// forward pools.
    ///
    /// # Panics
    /// When `id >= num_embeddings()`, `out.len() != dim()`, or a disk-tier
    /// table's file cannot be read (see [`try_read_row`](Self::try_read_row)).
    pub fn read_row(&self, id: usize, out: &mut [f32]) {
        if let Err(e) = self.try_read_row(id, out) {
            panic!("{e}");
        }
    }
    /// [`read_row`](Self::read_row), with a failed read of a disk-tier
    /// table's file as [`SparseError::Disk`].
    ///
    /// # Panics
    /// When `id >= num_embeddings()` or `out.len() != dim()`.
    pub fn try_read_row(&self, id: usize, out: &mut [f32]) -> Result<(), SparseError> {
        assert!(id < self.num_embeddings(), "read_row: no row {id}");
        assert_eq!(
            out.len(),
            self.dim(),
            "read_row: a row of {} values",
            self.dim()
        );
        self.store.read_row(&self.config.name, id, out)
    }
    /// Sets row `id` to `values`, rounded to the nearest value of the data
    /// type (quantized, for the quantized types).
    ///
    /// # Panics
    /// When `id >= num_embeddings()`, `values.len() != dim()`, or a
    /// disk-tier table's file cannot be written.
    pub fn write_row(&mut self, id: usize, values: &[f32]) {
        assert!(id < self.config.num_embeddings, "write_row: no row {id}");
        assert_eq!(
            values.len(),
            self.dim(),
            "write_row: a row of {} values",
            self.dim()
        );
        if let Err(e) = self.store.write_row(&self.config.name, id, values) {
            panic!("{e}");
        }
    }
    /// Rows `first..first + n` as stored (`n` rows of
    /// [`bytes_per_row`](Self::bytes_per_row) bytes in `rows`, the
    /// [`row_bytes`](Self::row_bytes) layout) and their optimizer state
    /// (`n` x [`state_floats_per_row`](Self::state_floats_per_row) floats in
    /// `state`), in RAM or on the disk tier (its file, with the cache's
    /// newer rows over it): how a caller streams a table of any size, a
    /// piece at a time (checkpoints). Fails with [`SparseError::Disk`] when
    /// the file cannot be read.
    ///
    /// # Panics
    /// When `rows` is not whole rows, `state` does not match it, or the
    /// rows run past the table.
    pub fn read_stored_rows(
        &self,
        first: usize,
        rows: &mut [u8],
        state: &mut [f32],
    ) -> Result<(), SparseError> {
        self.stored_range("read_stored_rows", first, rows, state);
        self.store
            .read_stored(&self.config.name, first, rows, state)
    }
    /// Sets rows `first..first + n` as stored, and their optimizer state,
    /// laid out as [`read_stored_rows`](Self::read_stored_rows) gives them:
    /// a table of any size loaded a piece at a time. A disk-tier table's
    /// rows go to its file (and to its cache where cached). Fails with
    /// [`SparseError::Disk`] when the file cannot be written.
    ///
    /// # Panics
    /// As `read_stored_rows`.
    pub fn write_stored_rows(
        &mut self,
        first: usize,
        rows: &[u8],
        state: &[f32],
    ) -> Result<(), SparseError> {
        self.stored_range("write_stored_rows", first, rows, state);
        self.store
            .write_stored(&self.config.name, first, rows, state)
    }
    /// Checks a stored range's buffers.
    fn stored_range(&self, what: &str, first: usize, rows: &[u8], state: &[f32]) {
        let (stride, per_row) = (self.bytes_per_row(), self.state_floats_per_row());
        let n = rows.len() / stride.max(1);
        assert_eq!(n * stride, rows.len(), "{what}: not whole rows");
        assert_eq!(n * per_row, state.len(), "{what}: state of other rows");
        assert!(first + n <= self.num_embeddings(), "{what}: past the table");
    }
    /// Optimizer state floats of each row (0 for SGD; see
    /// [`optimizer_state`](Self::optimizer_state)).
    pub fn state_floats_per_row(&self) -> usize {
        self.store.resident().1.floats_per_row()
    }
    /// Bytes per row: [`DataType::row_bytes`] of the dim.
    pub fn bytes_per_row(&self) -> usize {
        self.rows().stride()
    }
    /// The rows as stored, row-major, [`DataType::row_bytes`] each (the
    /// layouts are documented there); native byte order.
    ///
    /// # Panics
    /// When the table is on the disk tier (read it row by row).
    pub fn row_bytes(&self) -> &[u8] {
        self.assert_in_ram("row_bytes");
        self.rows().bytes()
    }
    /// The rows as stored, mutable (to load them in their own type).
    ///
    /// # Panics
    /// When the table is on the disk tier.
    pub fn row_bytes_mut(&mut self) -> &mut [u8] {
        self.assert_in_ram("row_bytes_mut");
        self.store.parts_mut().0.bytes_mut()
    }
    fn assert_in_ram(&self, what: &str) {
        assert!(
            self.store.tier().is_none(),
            "{what}(): table '{}' is on the disk tier",
            self.config.name
        );
    }
    /// Whether the table lives on the disk tier.
    pub fn is_on_disk(&self) -> bool {
        self.store.tier().is_some()
    }
    /// A disk-tier table's file.
    pub fn disk_path(&self) -> Option<&std::path::Path> {
        self.store.tier().map(|t| t.path())
    }
    /// A disk-tier table's directory and cache size: the tier to build
    /// the table on again (from a checkpoint, say).
    pub fn disk_tier(&self) -> Option<DiskTierConfig> {
        self.store.tier().map(|t| t.config())
    }
    /// A disk-tier table's cache figures since it was built.
    pub fn tier_stats(&self) -> Option<TierStats> {
        self.store.tier().map(|t| t.stats())
    }
    /// Makes a disk-tier table's rows not stored in its file with `make`
    /// (as a new table's are from its seed), for a table built empty and
    /// not looked up yet (nothing for a table in RAM).
    /// `waits`: making a row may wait for the disk (rows read in place).
    pub(crate) fn set_row_maker(
        &mut self,
        waits: bool,
        make: std::sync::Arc<crate::tier::MakeRow>,
    ) {
        if let (_, _, Some(tier)) = self.store.parts_mut() {
            match waits {
                true => tier.set_reader(make),
                false => tier.set_maker(make),
            }
        }
    }
    /// Reads a disk-tier table's rows with `read(row, bytes)` (the row's
    /// bytes in the table's type) where its file holds none, instead of
    /// copying them to its file first: a table built empty for inference
    /// (no optimizer; no row stored or looked up yet) whose rows lie in
    /// another file, a checkpoint's tensor mapped in place. Rows written
    /// later (a delta's, a key-value table's fallback) go to its file as
    /// ever, and are read from there. The other file must not change
    /// while the table reads it (a mapped file cut short is a SIGBUS).
    pub fn read_rows_in_place(
        &mut self,
        read: std::sync::Arc<crate::MakeRow>,
    ) -> Result<(), SparseError> {
        let name = self.config.name.clone();
        let refuse = |reason: &str| {
            Err(SparseError::InvalidConfig {
                table: name.clone(),
                reason: format!("rows read in place: {reason}"),
            })
        };
        let (_, _, tier) = self.store.parts_mut();
        match tier {
            None => refuse("the table is not on the disk tier"),
            Some(t) if t.trains() => refuse("the table trains (its rows change)"),
            Some(t) if !t.untouched() || t.maker().is_some() => {
                refuse("the table's rows are made or looked up already")
            }
            Some(t) => {
                t.set_reader(read);
                Ok(())
            }
        }
    }
    /// Rows the kernels address: the table's, or its cache's slots.
    pub(crate) fn resident_rows(&self) -> usize {
        self.rows().bytes().len() / self.rows().stride()
    }
    /// Writes a disk-tier table's changed cached rows to its file (nothing
    /// for a table in RAM).
    pub fn flush(&mut self) -> Result<(), SparseError> {
        self.store.flush(&self.config.name)
    }
    /// Where this table's rows sit in the table they are part of.
    pub fn part(&self) -> TablePart {
        self.part
    }
    /// Places this table's rows in a larger table (a shard's), so that
    /// stochastic rounding draws as the whole table would.
    pub fn set_part(&mut self, part: TablePart) {
        self.part = part;
    }
    /// Optimizer state, row-major `[num_embeddings, state floats per row]`
    /// (row-wise Adagrad: 1; Adagrad: dim; Adam: `[m | v]`, 2 x dim).
    ///
    /// # Panics
    /// When the table is on the disk tier.
    pub fn optimizer_state(&self) -> &[f32] {
        self.assert_in_ram("optimizer_state");
        self.store.resident().1.as_slice()
    }
    /// Optimizer state, mutable; laid out as
    /// [`optimizer_state`](Self::optimizer_state).
    ///
    /// # Panics
    /// When the table is on the disk tier.
    pub fn optimizer_state_mut(&mut self) -> &mut [f32] {
        self.assert_in_ram("optimizer_state_mut");
        self.store.parts_mut().1.as_mut_slice()
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

    /// Bytes of rows plus optimizer state in memory (a disk-tier table's:
    /// its cache's, and the cache's bookkeeping: LFU's counts, a bit a row;
    /// a key-value table's: its map, headers and sketch too).
    pub fn bytes(&self) -> usize {
        let (rows, state) = self.store.resident();
        let kept = self.store.tier().map_or(0, |t| t.bookkeeping_bytes());
        rows.bytes().len() + std::mem::size_of_val(state.as_slice()) + kept + self.kv_bytes()
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
    /// A schedule's learning rate and the weight decay of the next steps.
    step_settings: TableStepSettings,
    step: u64,
    /// Seeds the stochastic rounding of fp16/bf16 rows.
    rounding_seed: u64,
    /// The batch `prefetch` staged for the disk-tier and key-value tables.
    staged: Option<Box<staging::Staged>>,
    /// Whether staging admits new ids to key-value tables.
    training: bool,
    /// Whether large tables' one-hot features pool in id order: timed on
    /// the first forwards.
    order: order::OrderTuner,
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
    /// a quantized table is given an optimizer ([`SparseError::InvalidConfig`]:
    /// those are for inference, with [`TableOptimizer::None`]), or a table
    /// cannot be allocated ([`SparseError::Allocation`]).
    ///
    /// fp16 and bf16 rows are updated with stochastic rounding seeded by
    /// `seed` too (see [`set_rounding_seed`](Self::set_rounding_seed)).
    pub fn new(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        seed: u64,
    ) -> Result<Self, SparseError> {
        Self::with_disk_tiers(configs, optimizer, seed, Vec::new())
    }

    /// [`new`](Self::new), with each table whose entry of `tiers` is
    /// `Some` on the disk tier: its rows and optimizer state in a file in
    /// that directory, initialised exactly as in RAM (streamed, so the
    /// table need not fit in memory), behind a cache of that many rows
    /// (see [`DiskTierConfig`]). `tiers` is empty (all in RAM) or one per
    /// config. Forward passes over disk-tier tables need their batch
    /// [`prefetch`](Self::prefetch)ed first. Fails as `new` does, and with
    /// [`SparseError::Disk`] when a file cannot be created or written.
    pub fn with_disk_tiers(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        seed: u64,
        tiers: Vec<Option<DiskTierConfig>>,
    ) -> Result<Self, SparseError> {
        let mut collection = Self::build(configs, optimizer, Some(seed), tiers)?;
        collection.rounding_seed = seed;
        Ok(collection)
    }

    /// Tables of zeros, for a caller that fills them (the shards of a rank).
    pub fn zeroed(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
    ) -> Result<Self, SparseError> {
        Self::zeroed_with_disk_tiers(configs, optimizer, Vec::new())
    }

    /// [`zeroed`](Self::zeroed), with tables on the disk tier as in
    /// [`with_disk_tiers`](Self::with_disk_tiers) (their files of zeros).
    pub fn zeroed_with_disk_tiers(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        tiers: Vec<Option<DiskTierConfig>>,
    ) -> Result<Self, SparseError> {
        Self::build(configs, optimizer, None, tiers)
    }

    fn build(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        seed: Option<u64>,
        mut tiers: Vec<Option<DiskTierConfig>>,
    ) -> Result<Self, SparseError> {
        if tiers.is_empty() {
            tiers = vec![None; configs.len()];
        }
        if tiers.len() != configs.len() {
            return Err(SparseError::InvalidConfig {
                table: configs.first().map_or_else(String::new, |c| c.name.clone()),
                reason: format!(
                    "{} disk tiers given for {} tables",
                    tiers.len(),
                    configs.len()
                ),
            });
        }
        optimizer
            .validate()
            .map_err(SparseError::InvalidOptimizer)?;
        let mut slots: Vec<FeatureSlot> = Vec::new();
        let mut column = 0;
        for (t, config) in configs.iter().enumerate() {
            config.validate()?;
            if !config.data_type.is_trainable() && !matches!(optimizer, TableOptimizer::None) {
                return Err(SparseError::InvalidConfig {
                    table: config.name.clone(),
                    reason: format!(
                        "{} tables are for inference: build them with no optimizer \
                         (TableOptimizer::None), or train in fp32, fp16 or bf16",
                        config.data_type
                    ),
                });
            }
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
            .zip(tiers)
            .enumerate()
            .map(|(t, (config, tier))| new_table(config, &optimizer, seed, t as u64, tier.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            tables,
            slots,
            width: column,
            optimizer,
            step_settings: TableStepSettings::default(),
            step: 0,
            rounding_seed: 0,
            staged: None,
            training: true,
            order: order::OrderTuner::default(),
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
    /// Replaces the optimizer fused into the backward pass, with fresh
    /// (zero) state for every table and the step count back at 0 (Adam's
    /// bias correction counts from the new optimizer's first step), as a
    /// new optimizer starts in TorchRec's `apply_optimizer_in_backward`.
    /// Fails, leaving the collection as it was, when the optimizer is
    /// invalid, a quantized table would train, the state cannot be
    /// allocated, a table is on the disk tier and either optimizer keeps
    /// state (its file is laid out for the optimizer it was built with), or
    /// a key-value table has trained (its rows' headers record steps).
    pub fn set_optimizer(&mut self, optimizer: TableOptimizer) -> Result<(), SparseError> {
        optimizer
            .validate()
            .map_err(SparseError::InvalidOptimizer)?;
        let mut states = Vec::with_capacity(self.tables.len());
        for table in &self.tables {
            let (dim, name) = (table.dim(), table.name().to_string());
            if !table.data_type().is_trainable() && !matches!(optimizer, TableOptimizer::None) {
                return Err(SparseError::InvalidConfig {
                    table: name,
                    reason: format!(
                        "{} tables are for inference: they take no optimizer",
                        table.data_type()
                    ),
                });
            }
            if table.config().kv.is_some() && self.step > 0 {
                return Err(SparseError::InvalidConfig {
                    table: name,
                    reason: "a key-value table's rows record the steps they were seen at: \
                             choose the optimizer before training"
                        .into(),
                });
            }
            let per_row = optimizer.state_floats_per_row(dim);
            let unreserved = table.store.tier().is_some_and(|t| !t.trains());
            if unreserved && !matches!(optimizer, TableOptimizer::None) {
                return Err(SparseError::InvalidConfig {
                    table: name,
                    reason: "on the disk tier, it was built for inference (its file's space                              is not reserved, its rows may be read in place): build the                              collection with the optimizer it will train with"
                        .into(),
                });
            }
            if table.is_on_disk() && per_row + self.optimizer.state_floats_per_row(dim) > 0 {
                return Err(SparseError::InvalidConfig {
                    table: name,
                    reason: format!(
                        "on the disk tier, its file holds the state of {:?}: build the \
                         collection with the optimizer it will train with",
                        self.optimizer
                    ),
                });
            }
            let (rows, _) = table.store.resident();
            let rows = rows.bytes().len() / rows.stride().max(1);
            let state =
                OptimizerState::new(&optimizer, rows, dim).ok_or(SparseError::Allocation {
                    table: name,
                    bytes: per_row.saturating_mul(rows).saturating_mul(4),
                })?;
            states.push(state);
        }
        for (table, state) in self.tables.iter_mut().zip(states) {
            *table.store.parts_mut().1 = state;
        }
        self.optimizer = optimizer;
        self.step_settings = TableStepSettings::default();
        self.step = 0;
        Ok(())
    }
    /// The learning rate and weight decay of the next backward updates
    /// (the default: the optimizer's own rate, no decay).
    pub fn step_settings(&self) -> TableStepSettings {
        self.step_settings
    }
    /// Sets the learning rate a schedule gives the next backward updates
    /// and FBGEMM's L2 table weight decay; the optimizer's configuration
    /// and state stay as they are. Fails on a rate or decay that is not a
    /// finite number `>= 0`, or a decay the optimizer does not take
    /// ([`TableStepSettings::validate`]). [`set_optimizer`](Self::set_optimizer)
    /// puts the default back.
    pub fn set_step_settings(&mut self, settings: TableStepSettings) -> Result<(), SparseError> {
        settings
            .validate(&self.optimizer)
            .map_err(SparseError::InvalidOptimizer)?;
        self.step_settings = settings;
        Ok(())
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
    /// The seed of the stochastic rounding of fp16/bf16 rows: `new`'s seed,
    /// 0 for [`zeroed`](Self::zeroed) tables.
    pub fn rounding_seed(&self) -> u64 {
        self.rounding_seed
    }
    /// Sets the seed of the stochastic rounding. An update's rounding draws
    /// depend only on this seed, the step, and each value's place in its
    /// whole table ([`TablePart`]), so runs repeat bit for bit.
    pub fn set_rounding_seed(&mut self, seed: u64) {
        self.rounding_seed = seed;
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

    /// Values in one sample's pooled output: every feature's dim.
    pub fn width(&self) -> usize {
        self.width
    }

    /// An output tensor of the right keys and widths for `batch` samples.
    pub fn new_output(&self, batch: usize) -> KeyedTensor {
        self.new_output_of(batch)
    }

    /// [`new_output`](Self::new_output) with values of type `T`: fp32, or
    /// fp16 or bf16 for inference (see [`forward_into`](Self::forward_into)).
    pub fn new_output_of<T: PooledValue>(&self, batch: usize) -> KeyedTensor<T> {
        KeyedTensor::zeros(self.feature_names(), self.feature_dims(), batch)
    }

    /// For each output slot, the index of its key in `kjt`. Keys no table
    /// serves are ignored, as TorchRec's collections do: one batch can feed
    /// several collections.
    fn resolve_keys(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, SparseError> {
        self.slots
            .iter()
            .map(|s| {
                kjt.key_index(&s.name)
                    .ok_or_else(|| SparseError::MissingFeature(s.name.clone()))
            })
            .collect()
    }
}

/// A raw pointer shared across the tasks of one pass, each of which writes a
/// disjoint part of the buffer (rows of a table; blocks of the output).
struct SharedMut<T = f32>(*mut T);
// SAFETY: see apply_segments and gather_feature: tasks write disjoint parts.
unsafe impl<T> Send for SharedMut<T> {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl<T> Sync for SharedMut<T> {}
impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// # Safety
    /// `offset` must lie inside the buffer the pointer came from.
    unsafe fn at(self, offset: usize) -> *mut T {
        self.0.add(offset)
    }
}

#[inline(always)]
fn add_scaled_row(out: &mut [f32], scale: f32, row: &[f32]) {
    for (o, r) in out.iter_mut().zip(row) {
        *o += scale * r;
    }
}
