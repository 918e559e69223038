//! Ember: a Rust engine for training and serving recommendation models.
//!
//! This facade re-exports the member crates and holds the `ember` command
//! line's subcommands, so they can be driven from code and tests too.
//!
//! - [`sparse`]: jagged inputs, embedding bag tables, fused-optimizer lookups.
//! - [`dense`]: dense tensors, layers and backends.
//! - [`models`]: DLRM, DLRM-DCNv2, metrics and synthetic data.
//!
//! ```
//! use ember::sparse::{EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, TableOptimizer};
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

pub use ember_dense as dense;
pub use ember_models as models;
pub use ember_sparse as sparse;

pub mod cli;
