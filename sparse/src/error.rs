use thiserror::Error;

/// Everything that can be wrong with sparse inputs or table configurations.
/// Each variant names the key, sample, index or table at fault.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SparseError {
    #[error("negative length {length} at position {index} (key '{key}', sample {sample})")]
    NegativeLength {
        key: String,
        sample: usize,
        index: usize,
        length: i64,
    },
    #[error("offsets are not monotonic: offsets[{index}] = {value} is below offsets[{}] = {previous}", index - 1)]
    NonMonotonicOffsets {
        index: usize,
        value: i64,
        previous: i64,
    },
    #[error("offsets must start at 0, got {0}")]
    OffsetsNotStartingAtZero(i64),
    #[error("lengths sum to {sum} but there are {values} values")]
    LengthSumMismatch { sum: i64, values: usize },
    #[error("{lengths} lengths cannot be split evenly over {keys} keys")]
    LengthsNotDivisible { lengths: usize, keys: usize },
    #[error("{weights} weights given for {values} values")]
    WeightsMismatch { weights: usize, values: usize },
    #[error("keyed tensor: {0}")]
    KeyedTensorShape(String),
    #[error("duplicate key '{0}'")]
    DuplicateKey(String),
    #[error("no table serves feature '{0}'")]
    UnknownFeature(String),
    #[error("feature '{0}' is missing from the input")]
    MissingFeature(String),
    #[error("feature '{feature}' is served by both table '{first}' and table '{second}'")]
    FeatureServedTwice {
        feature: String,
        first: String,
        second: String,
    },
    #[error(
        "id {id} out of range for table '{table}' ({rows} rows), feature '{feature}', sample {sample}"
    )]
    IdOutOfRange {
        table: String,
        feature: String,
        sample: usize,
        id: i64,
        rows: usize,
    },
    #[error("table '{table}': {reason}")]
    InvalidConfig { table: String, reason: String },
    #[error("gradient has shape [{rows}, {cols}], expected [{expected_rows}, {expected_cols}]")]
    GradShape {
        rows: usize,
        cols: usize,
        expected_rows: usize,
        expected_cols: usize,
    },
    #[error("invalid optimizer: {0}")]
    InvalidOptimizer(String),
    #[error("could not allocate {bytes} bytes for table '{table}'")]
    Allocation { table: String, bytes: usize },
}
