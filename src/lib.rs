//! Ember: a Rust engine for training and serving recommendation models.
//!
//! This facade re-exports the member crates and a [`prelude`] with the
//! types a user meets first. Everything the `ember` command line does goes
//! through this API; the command line's own code (the default `cli`
//! feature) is not part of it.
//!
//! - [`sparse`]: jagged inputs, embedding bag tables (fp32, fp16, bf16 for
//!   training; int8, int4, fp8, mxfp4 for inference), fused-optimizer lookups.
//! - [`dense`]: dense tensors, layers and backends (native, PJRT).
//! - [`sharding`]: topology, the planner, sharding plans, collectives and
//!   sharded execution.
//! - [`dataloader`]: Criteo ingestion into Parquet and the pipelined loader.
//! - [`models`]: DLRM, DLRM-DCNv2, the [`Model`](models::Model) contract, the
//!   [`Trainer`](models::Trainer), checkpoints, metrics and synthetic data.
//!
//! A library build without the command line's dependencies:
//! `ember = { version = "0.1", default-features = false }`.
//!
//! ```
//! use ember::prelude::*;
//!
//! let tables = vec![EmbeddingBagConfig::new("t_cat_0", 1000, 16, &["cat_0"])];
//! let mut ebc = EmbeddingBagCollection::new(tables, TableOptimizer::rowwise_adagrad(0.01), 42)?;
//! // Two samples: bag [3, 7] and bag [1].
//! let kjt = KeyedJaggedTensor::from_lengths(vec!["cat_0".into()], vec![3, 7, 1], &[2, 1], None)?;
//! let pooled = ebc.forward(&kjt)?; // KeyedTensor [2, 16]
//! assert_eq!((pooled.batch(), pooled.width()), (2, 16));
//! let grad = vec![0.1f32; 2 * 16]; // d loss / d pooled
//! ebc.backward_update(&kjt, &grad)?; // row-wise Adagrad applied in the scatter
//! # Ok::<(), ember::sparse::SparseError>(())
//! ```

pub use ember_dataloader as dataloader;
pub use ember_dense as dense;
pub use ember_models as models;
/// Online serving over the Open Inference Protocol (the `serving` feature).
#[cfg(feature = "serving")]
pub use ember_serving as serving;
pub use ember_sharding as sharding;
pub use ember_sparse as sparse;

/// The `ember` command line's subcommands (feature `cli`): flags and
/// printing over the library, public only for the `ember` binary.
#[cfg(feature = "cli")]
#[doc(hidden)]
#[allow(missing_docs)]
pub mod cli;

/// The types a user needs first: `use ember::prelude::*;`.
pub mod prelude {
    pub use ember_dataloader::{
        Dataset, DatasetSpec, DenseColumn, DenseTransform, IdTransform, Loader, LoaderConfig,
        SparseColumn,
    };
    pub use ember_dense::{
        Activation, DenseBackend, DenseOptimizer, DenseOptimizerConfig, HasParams, Jagged, Linear,
        Mlp, Module, NativeBackend, Param, Sequential, Tensor,
    };
    pub use ember_models::checkpoint::{StateDict, StateFile};
    pub use ember_models::{
        evaluate, Backend, Batch, BatchShape, CacheBudget, Checkpoint, DataGeneration,
        DataParallel, DiskTierOptions, Dlrm, DlrmBuilder, DlrmConfig, ExecMode, FitOptions,
        InMemory, InteractionType, Metrics, Model, ModelError, OutputCheck, StepOutput,
        SyntheticBatches, SyntheticConfig, SyntheticData, TrainData, TrainError, TrainEvent,
        TrainState, TrainSummary, Trainer, TrainerConfig, Unsupported,
    };
    pub use ember_sharding::{
        Collective, InProcess, PlannerOptions, ShardedEmbeddingBagCollection, ShardingPlan,
        ShardingType, Topology,
    };
    pub use ember_sparse::{
        DataType, DiskTierConfig, EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
        EmbeddingConfig, JaggedEmbeddings, JaggedTensor, KeyedJaggedTensor, KeyedTensor,
        PoolingType, TableOptimizer,
    };
}

/// The Rust snippets of the README and of the docs book, compiled and run
/// as doc tests (`cargo test --doc`); `tests/docs.rs` checks that every
/// page of the book is listed here.
#[cfg(doctest)]
pub mod book {
    #[doc = include_str!("../README.md")]
    pub struct Readme;
    #[doc = include_str!("../docs/src/README.md")]
    pub struct BookIntro;
    #[doc = include_str!("../docs/src/architecture.md")]
    pub struct Architecture;
    #[doc = include_str!("../docs/src/benchmarks/README.md")]
    pub struct BenchmarksReadme;
    #[doc = include_str!("../docs/src/design-notes.md")]
    pub struct DesignNotes;
    #[doc = include_str!("../docs/src/formats/checkpoints.md")]
    pub struct FormatsCheckpoints;
    #[doc = include_str!("../docs/src/formats/dataset-spec.md")]
    pub struct FormatsDatasetSpec;
    #[doc = include_str!("../docs/src/formats/parquet.md")]
    pub struct FormatsParquet;
    #[doc = include_str!("../docs/src/formats/synthetic.md")]
    pub struct FormatsSynthetic;
    #[doc = include_str!("../docs/src/getting-started/benchmark.md")]
    pub struct GettingStartedBenchmark;
    #[doc = include_str!("../docs/src/getting-started/criteo-tutorial.md")]
    pub struct GettingStartedCriteoTutorial;
    #[doc = include_str!("../docs/src/getting-started/ingest.md")]
    pub struct GettingStartedIngest;
    #[doc = include_str!("../docs/src/getting-started/library.md")]
    pub struct GettingStartedLibrary;
    #[doc = include_str!("../docs/src/getting-started/python.md")]
    pub struct GettingStartedPython;
    #[doc = include_str!("../docs/src/guides/disk-tier.md")]
    pub struct GuidesDiskTier;
    #[doc = include_str!("../docs/src/guides/key-value-tables.md")]
    pub struct GuidesKeyValueTables;
    #[doc = include_str!("../docs/src/guides/pjrt.md")]
    pub struct GuidesPjrt;
    #[doc = include_str!("../docs/src/guides/precision.md")]
    pub struct GuidesPrecision;
    #[doc = include_str!("../docs/src/guides/reliability.md")]
    pub struct GuidesReliability;
    #[doc = include_str!("../docs/src/guides/sequences.md")]
    pub struct GuidesSequences;
    #[doc = include_str!("../docs/src/guides/serving.md")]
    pub struct GuidesServing;
    #[doc = include_str!("../docs/src/guides/sharding.md")]
    pub struct GuidesSharding;
    #[doc = include_str!("../docs/src/guides/tables-and-kjt.md")]
    pub struct GuidesTablesAndKjt;
    #[doc = include_str!("../docs/src/guides/trainer.md")]
    pub struct GuidesTrainer;
    #[doc = include_str!("../docs/src/testing.md")]
    pub struct Testing;
}
