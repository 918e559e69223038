//! ember-models: DLRM and DLRM-DCNv2 assembled from the sparse and dense
//! crates, the training and evaluation steps, metrics and synthetic data.

mod backend;
pub mod checkpoint;
pub mod compiled;
mod data;
mod dlrm;
mod error;
mod metrics;
mod model;
pub mod sparse_arch;
mod train;
mod trainer;

pub use backend::{Backend, ExecMode};
pub use checkpoint::{Checkpoint, TrainState};
pub use compiled::CompiledDenseStep;
pub use data::{Batch, DataGeneration, SyntheticConfig, SyntheticData};
pub use dlrm::{DenseArch, Dlrm, DlrmConfig, InteractionType, PhaseTimes, StepOutput};
pub use error::ModelError;
pub use metrics::{roc_auc, Metrics, MetricsAccumulator};
pub use model::{DataParallel, Model};
pub use sparse_arch::SparseArch;
pub use train::{evaluate, evaluate_data, Evaluation};
pub use trainer::{
    InMemory, SyntheticBatches, TrainData, TrainError, TrainEvent, TrainSummary, Trainer,
    TrainerConfig,
};
