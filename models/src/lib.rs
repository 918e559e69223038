//! ember-models: DLRM and DLRM-DCNv2 assembled from the sparse and dense
//! crates, the training and evaluation steps, metrics and synthetic data.
//!
//! - [`Dlrm`] is the model, in TorchRec's structure (`sparse_arch` →
//!   `dense_arch` → `inter_arch` → `over_arch`), its architecture a
//!   [`DlrmConfig`] with a dot ([`InteractionType::Dot`], DLRM) or low-rank
//!   cross network ([`InteractionType::Dcn`], DLRM-DCNv2) interaction. Its
//!   tables live in one collection or sharded over devices or the ranks of a
//!   world ([`SparseArch`]).
//! - The [`Model`] trait is what the training loop needs of a model: a
//!   training step in an [`ExecMode`] on a [`Backend`], `predict`, and saving
//!   and loading checkpoints. [`Dlrm`] implements it; so can a user's model.
//! - [`Trainer`] runs the loop over any [`TrainData`] (the Parquet
//!   loader, [`SyntheticBatches`], [`InMemory`] batches): epochs and step
//!   limits, evaluation and checkpoint cadence, exact resumption, reporting
//!   [`TrainEvent`]s. [`evaluate`] and [`Metrics`] (AUC, log loss,
//!   accuracy) score a model on its own.
//! - [`checkpoint`]s are safetensors files with the tensor names of TorchRec's
//!   DLRM `state_dict` plus the optimizer state and the architecture in the
//!   metadata; [`Checkpoint`] opens one (or a set written by the ranks of a
//!   world, or a plain TorchRec file) and builds models from it.
//! - [`SyntheticData`] makes reproducible batches ([`Batch`]), random or
//!   learnable.
//! - [`MemoryEstimate`] says what a run needs in memory before it is built,
//!   so a configuration that cannot fit is refused instead of aborting.
//! - [`sequential`]: user histories read as sequences: HSTU for retrieval,
//!   synthetic histories, HR@k and NDCG@k.
//! - [`disk_tier`] sizes tables' caches on the disk tier from one budget
//!   ([`DiskTierOptions`]); [`Dlrm::builder`] plans, places, checks memory
//!   and takes the disk tier's directory in one call.

mod backend;
pub mod checkpoint;
pub mod compiled;
mod data;
pub mod disk_tier;
mod dlrm;
mod drifting;
mod error;
mod evaluate;
pub mod memory;
mod metrics;
pub mod mllog;
mod model;
mod schedule;
pub mod sequential;
pub mod sparse_arch;
pub mod tensorboard;
mod trainer;

pub use backend::{Backend, ExecMode};
pub use checkpoint::{Checkpoint, TrainState};
pub use compiled::CompiledDenseStep;
pub use data::{Batch, DataGeneration, SyntheticConfig, SyntheticData};
pub use disk_tier::{CacheBudget, DiskTierOptions};
pub use dlrm::{
    ArchitectureError, BatchShape, BuildError, DenseArch, Dlrm, DlrmBuilder, DlrmConfig,
    InteractionType, PhaseTimes, StepOutput, DEFAULT_DENSE_OPTIMIZER, DEFAULT_TABLE_OPTIMIZER,
};
pub use drifting::{DriftingConfig, DriftingData};
pub use error::{BatchError, ModelError, SyntheticError, Unsupported};
pub use evaluate::{evaluate, evaluate_data, Evaluation, OutputCheck};
pub use memory::{available_memory, MemoryEstimate, OutOfMemory, RunShape};
pub use metrics::{roc_auc, Metrics, MetricsAccumulator};
pub use model::{DataParallel, InputDist, Model, Routed};
pub use schedule::{LrSchedule, Optimization};
pub use sparse_arch::SparseArch;
pub use trainer::{
    FitOptions, InMemory, SyntheticBatches, TrainData, TrainError, TrainEvent, TrainSummary,
    Trainer, TrainerConfig,
};
