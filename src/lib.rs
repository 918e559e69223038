//! Ember: a Rust engine for training and serving recommendation models.
//!
//! This facade re-exports the member crates and holds the `ember` command
//! line's subcommands, so they can be driven from code and tests too.
//!
//! - [`sparse`]: jagged inputs, embedding bag tables, fused-optimizer lookups.
//! - [`dense`]: dense tensors, layers and backends.
//! - [`models`]: DLRM, DLRM-DCNv2, metrics and synthetic data.

pub use ember_dense as dense;
pub use ember_models as models;
pub use ember_sparse as sparse;

pub mod cli;
