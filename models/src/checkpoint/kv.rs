//! Key-value tables in checkpoints: beside a table's rows, the map that
//! says which id each row holds (ids, headers and counts per row, the free
//! rows, the admission sketch) and a metadata entry with where the index
//! stands, so a loaded table finds every id in the row it trained.

use std::borrow::Cow;
use std::collections::HashMap;

use ember_sparse::{EmbeddingTable, KvPosition, KvState};
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};

use super::delta::DELTA_PREFIX;
use super::read::{meta_value, Checkpoint};
use super::store::TensorStore;
use super::write::{json, Data, Tensor};
use crate::ModelError;

/// The metadata key of a key-value table's [`SavedKv`].
fn meta_key(table: &str) -> String {
    format!("ember.kv.{table}")
}

/// What a key-value table's metadata entry holds.
#[derive(Serialize, Deserialize)]
struct SavedKv {
    /// Length of the free-rows tensor.
    free_rows: usize,
    #[serde(flatten)]
    position: KvPosition,
}

/// The tensors of the map, named under the table's `base`.
fn names(base: &str) -> [String; 5] {
    ["ids", "last_seen", "counts", "free", "sketch"].map(|n| format!("{base}.kv.{n}"))
}

fn tensor<'a>(dtype: Dtype, len: usize, bytes: Vec<u8>) -> Tensor<'a> {
    Tensor {
        dtype,
        shape: vec![len],
        data: Data::Bytes(Cow::Owned(bytes)),
    }
}

fn le_u32(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Adds a key-value table's map (nothing for another table), saved as
/// table `name` (a shard's local table goes by its table's).
pub(super) fn add_kv_tensors(
    name: &str,
    table: &EmbeddingTable,
    tensors: &mut Vec<(String, Tensor<'_>)>,
    meta: &mut HashMap<String, String>,
) {
    if let Some(state) = table.kv_state() {
        let base = super::names::table_base_name(name);
        add_state(names(&base), name, state, tensors, meta);
    }
}

/// Adds a delta's part of a key-value table's map ([`EmbeddingTable::kv_delta`]):
/// the changed rows' ids and headers under `delta.`, the rest as in a full file.
pub(super) fn add_kv_delta(
    base: &str,
    table: &str,
    state: KvState,
    tensors: &mut Vec<(String, Tensor<'_>)>,
    meta: &mut HashMap<String, String>,
) {
    add_state(delta_names(base), table, state, tensors, meta);
}

/// A delta's names: the rows' parts under `delta.`.
fn delta_names(base: &str) -> [String; 5] {
    let mut names = names(base);
    for n in &mut names[..3] {
        n.insert_str(0, DELTA_PREFIX);
    }
    names
}

fn add_state(
    [ids, last_seen, counts, free, sketch]: [String; 5],
    table: &str,
    state: KvState,
    tensors: &mut Vec<(String, Tensor<'_>)>,
    meta: &mut HashMap<String, String>,
) {
    let rows = state.ids.len();
    let id_bytes = state.ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    tensors.push((ids, tensor(Dtype::U64, rows, id_bytes)));
    tensors.push((
        last_seen,
        tensor(Dtype::U32, rows, le_u32(&state.last_seen)),
    ));
    tensors.push((counts, tensor(Dtype::U32, rows, le_u32(&state.counts))));
    let free_rows = state.free.len();
    tensors.push((free, tensor(Dtype::U32, free_rows, le_u32(&state.free))));
    if !state.sketch.is_empty() {
        let n = state.sketch.len();
        tensors.push((sketch, tensor(Dtype::U32, n, le_u32(&state.sketch))));
    }
    let saved = SavedKv {
        free_rows,
        position: state.position,
    };
    meta.insert(meta_key(table), json(&saved));
}

impl Checkpoint {
    /// Loads saved table `name`'s map into `local` (a key-value table, or
    /// the shard that holds it whole), checked whole.
    pub(super) fn read_kv(&self, name: &str, local: &mut EmbeddingTable) -> Result<(), ModelError> {
        let rows = local.num_embeddings() - 1;
        let base = super::names::table_base_name(name);
        let state = read_state(self.store.as_ref(), (names(&base), name), local, rows)?;
        (local.load_kv_state(state)).map_err(|e| ModelError::Checkpoint {
            path: self.path().to_path_buf(),
            tensor: None,
            message: e.to_string(),
        })
    }
}

/// A delta's part of table `base`'s map, of `held` rows (its changed
/// rows below the fallback row).
pub(super) fn read_kv_delta(
    delta: &dyn TensorStore,
    base: &str,
    local: &EmbeddingTable,
    held: usize,
) -> Result<KvState, ModelError> {
    read_state(delta, (delta_names(base), local.name()), local, held)
}

/// Table `table`'s map: its tensors of `rows` rows, and its metadata
/// entry, from `store`.
fn read_state(
    store: &dyn TensorStore,
    ([ids, last_seen, counts, free, sketch], table): ([String; 5], &str),
    local: &EmbeddingTable,
    rows: usize,
) -> Result<KvState, ModelError> {
    let path = store.path();
    let key = meta_key(table);
    let saved: SavedKv =
        meta_value(store.metadata(), &key, path)?.ok_or_else(|| ModelError::Checkpoint {
            path: path.to_path_buf(),
            tensor: None,
            message: format!("no '{key}': the key-value table's map is missing"),
        })?;
    let read = |name: &str, dtype: Dtype, len: usize| -> Result<Vec<u8>, ModelError> {
        let mut out = Vec::new();
        store.view(name, dtype, &[len], &mut |b| out = b.to_vec())?;
        Ok(out)
    };
    let u32s = |b: Vec<u8>| -> Vec<u32> {
        let word = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        b.chunks_exact(4).map(word).collect()
    };
    let id_bytes = read(&ids, Dtype::U64, rows)?;
    let mut word = [0u8; 8];
    let ids = (id_bytes.chunks_exact(8))
        .map(|c| {
            word.copy_from_slice(c);
            u64::from_le_bytes(word)
        })
        .collect();
    let sketch = match local.kv_sketch_len() {
        0 => Vec::new(),
        n => u32s(read(&sketch, Dtype::U32, n)?),
    };
    Ok(KvState {
        ids,
        last_seen: u32s(read(&last_seen, Dtype::U32, rows)?),
        counts: u32s(read(&counts, Dtype::U32, rows)?),
        free: u32s(read(&free, Dtype::U32, saved.free_rows)?),
        sketch,
        position: saved.position,
    })
}
