//! ember-dataloader: Criteo click logs into Parquet, and Parquet datasets of
//! any schema back out as training batches.
//!
//! - [`criteo`]: parsing one line of a Criteo display-advertising TSV.
//! - [`schema`]: the Parquet schema Ember writes and reads.
//! - [`atomic`]: files that appear whole or not at all (the one temp-file guard).
//! - [`writer`]: row-group builders and an atomic, file-splitting Parquet sink.
//! - [`ingest`]: the streaming `ember ingest criteo` pass.
//! - [`spec`]: the dataset spec: which columns make a batch, and their tables.
//! - [`transform`]: the named dense and categorical transforms.
//! - [`dataset`]: a validated set of Parquet files and row-group decoding.
//! - [`loader`]: the pipelined, shuffled, rank-sharded batch iterator.
//! - [`sequences`]: user histories: interactions grouped by user into Parquet list columns.
//! - [`list_writer`]: a sequence model's predictions, fixed-size list columns a history.

pub mod atomic;
pub mod criteo;
pub mod dataset;
mod decode;
mod error;
pub mod ingest;
pub mod list_writer;
pub mod loader;
pub mod lock;
pub mod multi_hot;
pub mod schema;
pub mod sequences;
pub mod spec;
mod spill;
pub mod transform;
pub mod vocabulary;
pub mod writer;

pub use dataset::Dataset;
pub use error::DataError;
pub use loader::{Batch, Loader, LoaderConfig};
pub use spec::{DatasetSpec, DenseColumn, SparseColumn};
pub use transform::{DenseTransform, IdTransform};
