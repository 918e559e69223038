//! ember-models: DLRM and DLRM-DCNv2 assembled from the sparse and dense
//! crates, the training and evaluation steps, metrics and synthetic data.

pub mod checkpoint;
pub mod compiled;
mod data;
mod dlrm;
mod error;
mod metrics;
pub mod sparse_arch;
mod train;

pub use checkpoint::{Checkpoint, TrainState};
pub use compiled::CompiledDenseStep;
pub use data::{Batch, DataGeneration, SyntheticConfig, SyntheticData};
pub use dlrm::{DenseArch, Dlrm, DlrmConfig, InteractionType, PhaseTimes, StepOutput};
pub use error::ModelError;
pub use metrics::{roc_auc, Metrics, MetricsAccumulator};
pub use sparse_arch::SparseArch;
pub use train::{evaluate, Evaluation};
