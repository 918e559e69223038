//! Key-value tables: rows found by the raw 64-bit id through a map, with
//! admission, eviction and a fallback row (TorchRec's managed-collision
//! and KV tables, DeepRec's EmbeddingVariable). [`KvConfig`] says how a
//! table behaves; the collection's staging rewrites each batch's ids as
//! rows through the table's index, so every kernel, data type and
//! optimizer works on them unchanged.

mod config;
mod index;
mod shards;
mod sketch;
#[cfg(test)]
mod tests;

pub use config::{
    Admission, Eviction, Fallback, KvConfig, DEFAULT_BUCKETS, DEFAULT_EVICTION_WINDOW,
    DEFAULT_SCAN_PER_BATCH, MAX_SKETCH_WIDTH,
};
pub(crate) use index::{Fresh, KvIndex};
pub use index::{KvPosition, KvState, KvStats, KvView};
pub(crate) use shards::slice;
pub use shards::{id_bucket, kv_slice, merge_shards, KvShard, KvSlice};
