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
}
