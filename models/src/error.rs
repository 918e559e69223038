use ember_dense::DenseError;
use ember_sparse::SparseError;
use thiserror::Error;

/// Everything that can go wrong building, stepping, saving or loading a
/// model. The message says what and where; wrapped errors of the other
/// crates pass through unchanged.
#[derive(Debug, Error)]
pub enum ModelError {
    /// An embedding table operation failed: a malformed sparse batch, a
    /// table's feature missing from the batch, an id out of a table's
    /// range, or an invalid table configuration.
    #[error(transparent)]
    Sparse(#[from] SparseError),
    /// A [`DlrmConfig`](crate::DlrmConfig) that describes no valid DLRM
    /// (which way: the payload).
    #[error("invalid model configuration: {0}")]
    Architecture(#[from] crate::dlrm::ArchitectureError),
    /// A model [`Dlrm::builder`](crate::Dlrm::builder) cannot make as
    /// asked (which way: the payload).
    #[error(transparent)]
    Build(#[from] crate::dlrm::BuildError),
    /// A dense operation failed: a buffer that does not fit its shape,
    /// operands of disagreeing shapes, or an optimizer stepped with other
    /// parameters than its state was made for.
    #[error(transparent)]
    Dense(#[from] DenseError),
    /// An invalid [`DlrmConfig`](crate::DlrmConfig) or
    /// [`SyntheticConfig`](crate::SyntheticConfig) (see
    /// [`DlrmConfig::validate`](crate::DlrmConfig::validate)), or an
    /// operation the model's setup does not allow (e.g. resharding or the
    /// compiled step on a rank of a world).
    #[error("invalid model configuration: {0}")]
    Config(String),
    /// A run that needs more memory than the machine has, by its
    /// [`MemoryEstimate`](crate::MemoryEstimate) (the message gives it by part).
    #[error("{0}")]
    Memory(String),
    /// A batch that does not fit the model (which way: the payload).
    #[error("batch does not fit the model: {0}")]
    Batch(#[from] BatchError),
    /// A checkpoint that cannot be read or does not fit; names the tensor
    /// when one is at fault.
    #[error("{}: {}{message}", path.display(), tensor.as_ref().map_or(String::new(), |t| format!("tensor '{t}': ")))]
    Checkpoint {
        /// The file (or index) at fault.
        path: std::path::PathBuf,
        /// The tensor at fault, when one is (e.g. missing, wrong dtype or shape).
        tensor: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// `--mode debug`: the first NaN or infinity of a step, where it appeared.
    #[error("{value} in {what} at {location}")]
    NonFinite {
        /// The buffer it is in: a layer's output (by its TorchRec name), the
        /// loss, a feature's pooled embeddings or a parameter's gradient.
        what: String,
        /// `sample S, column C` for activations, `element I` for parameter gradients.
        location: String,
        /// The offending value (NaN, `inf` or `-inf`).
        value: f32,
    },
    /// The model's outputs (logits) held NaN or infinities: the model
    /// diverged, or was fed inputs it never saw.
    #[error("{count} of {rows} model outputs are not finite (the first, row {first_row} of the data, is {value}): the model diverged")]
    NonFiniteOutputs {
        /// How many outputs were not finite.
        count: u64,
        /// Outputs in all.
        rows: u64,
        /// The row (0-based, in data order) of the first.
        first_row: u64,
        /// Its value.
        value: f32,
    },
    /// Sharding failed: an invalid topology or plan, tables that do not fit
    /// the devices, or an exchange between devices or ranks that failed.
    #[error(transparent)]
    Sharding(#[from] ember_sharding::ShardingError),
    /// The data loader failed: a file that cannot be read, is not Parquet,
    /// or has a missing or invalid column.
    #[error(transparent)]
    Data(#[from] ember_dataloader::DataError),
    /// The PJRT plugin failed (loading it, compiling or running a program).
    #[error(transparent)]
    Pjrt(Box<ember_dense::pjrt::PjrtError>),
}

/// How a batch does not fit the model ([`ModelError::Batch`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum BatchError {
    /// Dense features of another shape than `[samples, num_dense]`.
    #[error("dense features are [{rows}, {cols}], expected [{samples}, {num_dense}]")]
    DenseShape {
        /// The dense tensor's rows.
        rows: usize,
        /// Its columns.
        cols: usize,
        /// The batch's samples (its labels).
        samples: usize,
        /// The model's dense features.
        num_dense: usize,
    },
    /// Sparse features for another number of samples than the labels.
    #[error("sparse features hold {sparse} samples, the labels {labels}")]
    SparseSamples {
        /// The KeyedJaggedTensor's stride.
        sparse: usize,
        /// The labels.
        labels: usize,
    },
    /// A batch size the compiled step was not made for.
    #[error("the compiled step takes batches of {compiled}, not {got}")]
    CompiledSize {
        /// The size it was compiled for.
        compiled: usize,
        /// The batch's.
        got: usize,
    },
    /// Evaluation data with no rows: metrics of nothing are undefined.
    #[error("no examples to evaluate: the evaluation data holds no rows")]
    NoRows,
}
