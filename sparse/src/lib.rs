//! ember-sparse: the "SparseCore" side of Ember.
//!
//! Jagged inputs ([`KeyedJaggedTensor`]), embedding tables
//! ([`EmbeddingBagCollection`]) with pooled gather lookups, and backward
//! scatters with the optimizer ([`TableOptimizer`]) fused in. Memory-bound
//! work: rows are contiguous, large tables sit on huge pages, and lookups
//! prefetch rows ahead of use. Parallelism comes from the caller's rayon pool.

mod collection;
mod config;
mod dtype;
mod error;
mod ids;
mod jagged;
mod kv;
mod optimizer;
pub mod rng;
pub mod roofline;
mod rows;
mod simd;
pub mod storage;
mod tier;

/// The half-precision types a [`KeyedTensor`] may hold (the `half` crate's).
pub use ::half::{bf16, f16};
pub use collection::{
    initial_rows, EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig, EmbeddingTable,
    JaggedEmbeddings, RowMaker, TablePart,
};
pub use config::{EmbeddingBagConfig, PoolingType};
pub use dtype::{DataType, MX_GROUP};
pub use error::SparseError;
pub use ids::{IdDistribution, IdSampler};
pub use jagged::{JaggedTensor, KeyedJaggedTensor, KeyedTensor, PooledValue};
pub use kv::{
    id_bucket, kv_slice, merge_shards, Admission, Eviction, Fallback, KvConfig, KvPosition,
    KvShard, KvSlice, KvState, KvStats, KvView, DEFAULT_BUCKETS, DEFAULT_EVICTION_WINDOW,
    DEFAULT_SCAN_PER_BATCH, MAX_SKETCH_WIDTH,
};
pub use optimizer::{TableOptimizer, TableStepSettings};
pub use tier::{
    disk_tier_file_bytes, reclaim_row_files, CachePolicy, DiskTierConfig, MakeRow, ReadAhead,
    TierStats, CACHE_WAYS,
};
