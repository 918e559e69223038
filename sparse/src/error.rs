use thiserror::Error;

/// Everything that can be wrong with sparse inputs or table configurations.
/// Each variant names the key, sample, index or table at fault.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SparseError {
    /// A length passed to `from_lengths` is below zero.
    #[error("negative length {length} at position {index} (key '{key}', sample {sample})")]
    NegativeLength {
        /// The key whose bag has the bad length (empty for a [`JaggedTensor`](crate::JaggedTensor)).
        key: String,
        /// The sample of that bag within its key.
        sample: usize,
        /// Position of the bad entry in the `lengths` slice.
        index: usize,
        /// The negative length itself.
        length: i64,
    },
    /// An offset passed to `from_offsets` is below the one before it.
    #[error("offsets are not monotonic: offsets[{index}] = {value} is below offsets[{}] = {previous}", index - 1)]
    NonMonotonicOffsets {
        /// Position of the decreasing offset (always at least 1).
        index: usize,
        /// `offsets[index]`.
        value: i64,
        /// `offsets[index - 1]`, which is larger than `value`.
        previous: i64,
    },
    /// The first offset passed to `from_offsets` is not 0 (the value it is).
    #[error("offsets must start at 0, got {0}")]
    OffsetsNotStartingAtZero(i64),
    /// The lengths do not add up to the number of values (or the last offset
    /// is not `values.len()`; an empty offsets slice counts as a sum of 0).
    #[error("lengths sum to {sum} but there are {values} values")]
    LengthSumMismatch {
        /// Sum of the lengths, or the last offset.
        sum: i64,
        /// Number of values given.
        values: usize,
    },
    /// A [`KeyedJaggedTensor`](crate::KeyedJaggedTensor)'s bag count (lengths,
    /// or offsets minus one) is not a multiple of its number of keys, so there
    /// is no common batch size; also when there are bags but no keys, or no
    /// offsets at all.
    #[error("{lengths} lengths cannot be split evenly over {keys} keys")]
    LengthsNotDivisible {
        /// Number of bags given.
        lengths: usize,
        /// Number of keys given.
        keys: usize,
    },
    /// Per-value weights were given, but not exactly one per value.
    #[error("{weights} weights given for {values} values")]
    WeightsMismatch {
        /// Number of weights given.
        weights: usize,
        /// Number of values given.
        values: usize,
    },
    /// [`KeyedTensor::new`](crate::KeyedTensor::new) got a different number
    /// of keys and lengths, or values that do not fill whole rows; the string
    /// says which.
    #[error("keyed tensor: {0}")]
    KeyedTensorShape(String),
    /// A key appears twice in the keys of a keyed (jagged) tensor.
    #[error("duplicate key '{0}'")]
    DuplicateKey(String),
    /// A key asked of a keyed jagged tensor is not among its keys.
    #[error("key '{key}' is not in the KeyedJaggedTensor (its keys: {keys:?})")]
    KeyNotFound {
        /// The key asked for.
        key: String,
        /// The tensor's keys.
        keys: Vec<String>,
    },
    /// A split of a keyed jagged tensor's keys does not add up to them.
    #[error("split into {segments:?} keys, but the KeyedJaggedTensor has {keys}")]
    SplitMismatch {
        /// Keys per part, as asked.
        segments: Vec<usize>,
        /// The tensor's number of keys.
        keys: usize,
    },
    /// A feature that a table serves is not among the input's keys.
    #[error("feature '{0}' is missing from the input")]
    MissingFeature(String),
    /// Two table configurations list the same feature name.
    #[error("feature '{feature}' is served by both table '{first}' and table '{second}'")]
    FeatureServedTwice {
        /// The feature listed twice.
        feature: String,
        /// The first table that lists it.
        first: String,
        /// The later table that lists it again.
        second: String,
    },
    /// An id in the input is negative or not below its table's
    /// `num_embeddings`; found by the forward and backward passes.
    #[error(
        "id {id} out of range for table '{table}' ({rows} rows), feature '{feature}', sample {sample}"
    )]
    IdOutOfRange {
        /// The table the id was looked up in.
        table: String,
        /// The feature whose bag holds the id.
        feature: String,
        /// The sample whose bag holds the id.
        sample: usize,
        /// The offending id.
        id: i64,
        /// Number of rows of the table (`num_embeddings`).
        rows: usize,
    },
    /// A table configuration is unusable: no rows, a zero dim, too large for
    /// memory, no features, a feature listed twice, an inverted init range, or
    /// a name shared with another table.
    #[error("table '{table}': {reason}")]
    InvalidConfig {
        /// Name of the table at fault.
        table: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The gradient given to `backward_update` is not `[batch, width]`.
    #[error("gradient has shape [{rows}, {cols}], expected [{expected_rows}, {expected_cols}]")]
    GradShape {
        /// Rows the gradient would have at the expected width (`len / cols`,
        /// rounded down).
        rows: usize,
        /// The expected width, used to count `rows`.
        cols: usize,
        /// The batch size `B` of the input.
        expected_rows: usize,
        /// The output width: the sum of the features' dims.
        expected_cols: usize,
    },
    /// The optimizer's hyper-parameters are rejected by
    /// [`TableOptimizer::validate`](crate::TableOptimizer::validate) (the
    /// message it gave).
    #[error("invalid optimizer: {0}")]
    InvalidOptimizer(String),
    /// Allocating a table's weights or optimizer state failed.
    #[error("could not allocate {bytes} bytes for table '{table}'")]
    Allocation {
        /// The table being built.
        table: String,
        /// Size of the allocation that failed.
        bytes: usize,
    },
    /// An [`IdDistribution`](crate::IdDistribution) cannot draw ids (what
    /// is wrong with it).
    #[error("id distribution: {0}")]
    IdDistribution(String),
    /// A disk-tier table's file could not be created, read or written
    /// (a full disk among them).
    #[error("table '{table}': {reason} ({path})")]
    Disk {
        /// The table whose file it is.
        table: String,
        /// The file.
        path: std::path::PathBuf,
        /// What failed, with the system's message.
        reason: String,
    },
    /// A batch needs more rows of one cache set at once than the set holds.
    #[error(
        "table '{table}': a batch's rows do not fit its disk-tier cache of {cache_rows} rows \
         (16 of them fell in one set); give the cache more rows"
    )]
    CacheFull {
        /// The table.
        table: String,
        /// Rows of its cache.
        cache_rows: usize,
    },
    /// A forward over disk-tier or key-value tables was given a batch
    /// that [`prefetch`](crate::EmbeddingBagCollection::prefetch) did not
    /// stage.
    #[error("table '{table}' is on the disk tier or keyed by raw id: prefetch() the batch before its forward")]
    NotPrefetched {
        /// The first disk-tier table.
        table: String,
    },
    /// A key-value table's saved map that disagrees with itself or with
    /// the table (a key twice, a row out of range, a header past the step).
    #[error("key-value table '{table}': {reason}")]
    KvState {
        /// The table.
        table: String,
        /// What is wrong, naming the id or row.
        reason: String,
    },
}
