use ember_dense::DenseError;
use ember_sparse::SparseError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Sparse(#[from] SparseError),
    #[error(transparent)]
    Dense(#[from] DenseError),
    #[error("invalid model configuration: {0}")]
    Config(String),
    #[error("batch does not fit the model: {0}")]
    Batch(String),
    /// A checkpoint that cannot be read or does not fit; names the tensor
    /// when one is at fault.
    #[error("{}: {}{message}", path.display(), tensor.as_ref().map_or(String::new(), |t| format!("tensor '{t}': ")))]
    Checkpoint {
        path: std::path::PathBuf,
        tensor: Option<String>,
        message: String,
    },
    /// `--mode debug`: the first NaN or infinity of a step, where it appeared.
    #[error("{value} in {what} at {location}")]
    NonFinite {
        what: String,
        /// `sample S, column C` for activations, `element I` for parameter gradients.
        location: String,
        value: f32,
    },
    #[error(transparent)]
    Sharding(#[from] ember_sharding::ShardingError),
    #[error(transparent)]
    Data(#[from] ember_dataloader::DataError),
    /// The PJRT plugin failed (loading it, compiling or running a program).
    #[error(transparent)]
    Pjrt(Box<ember_dense::pjrt::PjrtError>),
}
