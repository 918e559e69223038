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
    /// An invalid [`SyntheticConfig`](crate::SyntheticConfig) (which way:
    /// the payload).
    #[error("invalid synthetic data: {0}")]
    Synthetic(#[from] SyntheticError),
    /// An operation the model, its setup or its backend does not allow
    /// (which: the payload).
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    /// A run that needs more memory than the machine has, by its
    /// [`MemoryEstimate`](crate::MemoryEstimate).
    #[error(transparent)]
    Memory(#[from] crate::memory::OutOfMemory),
    /// The disk tier cannot be set up as asked (which way: the payload).
    #[error(transparent)]
    DiskTier(#[from] crate::disk_tier::DiskTierError),
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
    /// A learning-rate schedule, weight decay or clipping norm no run can
    /// use (which: the message).
    #[error("{0}")]
    InvalidOptimization(String),
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
    /// User histories that cannot make a batch (which way: the message).
    #[error("{0}")]
    Histories(String),
}

/// An operation the model, its setup or its backend does not allow
/// ([`ModelError::Unsupported`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Unsupported {
    /// A mode that needs the PJRT backend on another one.
    #[error("mode {0} compiles the dense step with PJRT: it needs the pjrt dense backend")]
    ModeNeedsPjrt(crate::ExecMode),
    /// A mode a model does not run (named by the model, with those it runs).
    #[error("{model} runs {runs}, not {mode}")]
    Mode {
        /// The model.
        model: &'static str,
        /// The modes it runs.
        runs: &'static str,
        /// The mode asked for.
        mode: crate::ExecMode,
    },
    /// Learning-rate schedules, weight decay or clipping on a model that
    /// does not take them.
    #[error("{model} takes no learning-rate schedule, weight decay or gradient clipping")]
    Optimization {
        /// The model's type.
        model: &'static str,
    },
    /// Weight decay or gradient clipping in the compiled step.
    #[error("the compiled step takes learning-rate schedules, not weight decay or gradient clipping: use strict, debug or defer-fuse")]
    CompiledOptimization,
    /// The compiled step on a rank of a world.
    #[error("the compiled step runs in one process; on ranks use strict, debug or defer-fuse")]
    CompiledOnRanks,
    /// Resharding a rank's model in place.
    #[error("a model that is one rank of a world cannot be resharded in place")]
    ReshardOnRank,
    /// Loading a checkpoint into a rank's model in place.
    #[error("a rank's model is built from its checkpoint (Checkpoint::builder with a plan and the world), not loaded in place")]
    LoadOnRank,
    /// A routed input made by another model's input dist, or for tables
    /// that are not sharded.
    #[error("a routed input of another model's input dist, or for tables that are not sharded")]
    ForeignRoutedInput,
    /// Writing a set of shard files from a model whose tables are not
    /// sharded.
    #[error("a set holds sharded tables")]
    SetOfUnsharded,
    /// A model whose scores are not one per sample (a ranking model scores
    /// each candidate for each task): `predict` is refused.
    #[error("{model} scores {what}, not one logit per sample: use {instead}")]
    NotPerSample {
        /// The model.
        model: &'static str,
        /// What it scores.
        what: &'static str,
        /// What to call instead.
        instead: &'static str,
    },
    /// A model that implements neither `state_dict` nor `save_checkpoint`
    /// (nor their loading halves).
    #[error(
        "this model implements neither state_dict nor save_checkpoint (nor their load halves)"
    )]
    NoStateDict,
    /// Training on from a checkpoint written for inference.
    #[error("{} was written for inference: {why}; resume from the training run's checkpoint", path.display())]
    InferenceCheckpoint {
        /// The checkpoint.
        path: std::path::PathBuf,
        /// What it lacks.
        why: String,
    },
}

/// What is wrong with a [`SyntheticConfig`](crate::SyntheticConfig)
/// ([`ModelError::Synthetic`]).
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SyntheticError {
    /// A feature whose table has 0 rows.
    #[error("feature '{0}' has a table of 0 rows")]
    EmptyTable(String),
    /// Per-feature bag sizes not one per feature.
    #[error("{given} per-feature bag sizes for {features} features")]
    BagSizes {
        /// Bag sizes given.
        given: usize,
        /// Features.
        features: usize,
    },
    /// A bag size of 0.
    #[error("indices per lookup must be at least 1")]
    EmptyBags,
    /// [`SyntheticHistories`](crate::sequential::SyntheticHistories) out
    /// of range (which field: the message).
    #[error("synthetic histories: {0}")]
    Histories(String),
    /// [`DriftingConfig`](crate::DriftingConfig) out of range.
    #[error("drifting data: {0}")]
    Drift(&'static str),
}
