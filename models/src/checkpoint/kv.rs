//! Key-value tables in checkpoints: beside a table's rows, the map that
//! says which id each row holds (ids, headers and counts per row, the free
//! rows, the admission sketch) and a metadata entry with where the index
//! stands, so a loaded table finds every id in the row it trained.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

use ember_sharding::RowSplit;
use ember_sparse::{
    kv_slice, EmbeddingTable, KvPosition, KvShard, KvState, KvStats, KvView, TableOptimizer,
};
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};

use super::delta::DELTA_PREFIX;
use super::read::{meta_value, Checkpoint};
use super::store::TensorStore;
use super::write::{json, plain_bytes, Data, Tensor};
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

/// A 1-D tensor of `len` values of `dtype`, its bytes borrowed or owned.
fn tensor_1d(dtype: Dtype, len: usize, bytes: Cow<'_, [u8]>) -> Tensor<'_> {
    Tensor {
        dtype,
        shape: vec![len],
        data: Data::Bytes(bytes),
    }
}

/// Adds a key-value table's map (nothing for another table), saved as
/// table `name` (a shard's local table goes by its table's), borrowed
/// from the map as it is written: never copied.
pub(super) fn add_kv_tensors<'a>(
    name: &str,
    table: &'a EmbeddingTable,
    tensors: &mut Vec<(String, Tensor<'a>)>,
    meta: &mut HashMap<String, String>,
) {
    let base = super::names::table_base_name(name);
    add_kv_named((&base, name), table, tensors, meta);
}

/// [`add_kv_tensors`] under tensor names `base.kv.*` and the metadata key
/// of `key` (a user's state: its tables' full names).
pub(super) fn add_kv_named<'a>(
    (base, key): (&str, &str),
    table: &'a EmbeddingTable,
    tensors: &mut Vec<(String, Tensor<'a>)>,
    meta: &mut HashMap<String, String>,
) {
    if let Some(view) = table.kv_view() {
        let bytes = |x: &'a [u8]| Cow::Borrowed(x);
        add_state(names(base), key, (view, &bytes), tensors, meta);
    }
}

/// The tensor names of a map saved under `base`, and its metadata key's
/// table name.
pub(super) fn map_names(base: &str) -> [String; 5] {
    names(base)
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
    let owned = |x: &[u8]| Cow::Owned(x.to_vec());
    add_state(
        delta_names(base),
        table,
        (state.view(), &owned),
        tensors,
        meta,
    );
}

/// A delta's names: the rows' parts under `delta.`.
fn delta_names(base: &str) -> [String; 5] {
    let mut names = names(base);
    for n in &mut names[..3] {
        n.insert_str(0, DELTA_PREFIX);
    }
    names
}

/// How a map's bytes become a tensor's: borrowed or copied.
type MakeBytes<'a, 'v> = dyn Fn(&'v [u8]) -> Cow<'a, [u8]>;

/// Adds a map's tensors, their bytes as `bytes` makes them of the map's
/// (borrowed from the table, or copied from a state made for the file).
fn add_state<'a, 'v>(
    [ids, last_seen, counts, free, sketch]: [String; 5],
    table: &str,
    (view, bytes): (KvView<'v>, &MakeBytes<'a, 'v>),
    tensors: &mut Vec<(String, Tensor<'a>)>,
    meta: &mut HashMap<String, String>,
) {
    let rows = view.ids.len();
    let part = |values: &'v [u32]| bytes(plain_bytes(values));
    tensors.push((
        ids,
        tensor_1d(Dtype::U64, rows, bytes(plain_bytes(view.ids))),
    ));
    tensors.push((last_seen, tensor_1d(Dtype::U32, rows, part(view.last_seen))));
    tensors.push((counts, tensor_1d(Dtype::U32, rows, part(view.counts))));
    let free_rows = view.free.len();
    tensors.push((free, tensor_1d(Dtype::U32, free_rows, part(view.free))));
    if !view.sketch.is_empty() {
        let n = view.sketch.len();
        tensors.push((sketch, tensor_1d(Dtype::U32, n, part(view.sketch))));
    }
    let saved = SavedKv {
        free_rows,
        position: view.position,
    };
    meta.insert(meta_key(table), json(&saved));
}

/// Tensors by name, to be written.
type Named<'a> = Vec<(String, Tensor<'a>)>;

/// The metadata key of shard `k` of a key-value table sharded by buckets.
fn shard_key(table: &str, k: usize) -> String {
    format!("{}#{k}", meta_key(table))
}

/// What a bucket shard's metadata entry holds.
#[derive(Serialize, Deserialize)]
struct SavedShard {
    /// The table's rows it holds.
    rows: [usize; 2],
    /// The buckets of its ids.
    buckets: [usize; 2],
    free_rows: usize,
    #[serde(flatten)]
    position: KvPosition,
}

/// A key-value shard of buckets (shard `k` of table `table`, rows
/// `rows`) as a set saves it: its ids, headers and counts into `pieces`
/// (row-aligned: saved as pieces of the table's, as its rows are), its
/// free rows (its own row numbers) and sketch into `whole` under names of
/// the shard's own, and its metadata entry.
pub(super) fn add_kv_shard<'a>(
    (table, k, rows): (&str, usize, [usize; 2]),
    buckets: [usize; 2],
    view: KvView<'a>,
    (pieces, whole): (&mut Named<'a>, &mut Named<'a>),
    meta: &mut HashMap<String, String>,
) {
    let base = super::names::table_base_name(table);
    let [ids, last_seen, counts, free, sketch] = names(&base);
    let n = view.ids.len();
    let u32s = |v: &'a [u32]| Cow::Borrowed(plain_bytes(v));
    pieces.push((
        ids,
        tensor_1d(Dtype::U64, n, Cow::Borrowed(plain_bytes(view.ids))),
    ));
    pieces.push((last_seen, tensor_1d(Dtype::U32, n, u32s(view.last_seen))));
    pieces.push((counts, tensor_1d(Dtype::U32, n, u32s(view.counts))));
    let free_rows = view.free.len();
    whole.push((
        format!("{free}#{k}"),
        tensor_1d(Dtype::U32, free_rows, u32s(view.free)),
    ));
    if !view.sketch.is_empty() {
        let len = view.sketch.len();
        whole.push((
            format!("{sketch}#{k}"),
            tensor_1d(Dtype::U32, len, u32s(view.sketch)),
        ));
    }
    let saved = SavedShard {
        rows,
        buckets,
        free_rows,
        position: view.position,
    };
    meta.insert(shard_key(table, k), json(&saved));
}

impl Checkpoint {
    /// Each key-value table's figures as saved (ids seen, admitted,
    /// rejected, evicted, occupancy, fallback reads: its shards' summed),
    /// from the metadata alone (the last file of a chain), in table order.
    pub fn kv_stats(&self) -> Result<Vec<(String, KvStats)>, ModelError> {
        let store = self.deltas.last().unwrap_or(&self.store);
        let (meta, path) = (store.metadata(), store.path());
        let mut out = Vec::new();
        for t in self.config.tables.iter().filter(|t| t.kv.is_some()) {
            let mut stats = KvStats::default();
            match meta_value::<SavedKv>(meta, &meta_key(&t.name), path)? {
                Some(saved) => stats = saved.position.stats,
                None => {
                    let mut k = 0;
                    while let Some(s) =
                        meta_value::<SavedShard>(meta, &shard_key(&t.name, k), path)?
                    {
                        stats.add(&s.position.stats);
                        k += 1;
                    }
                }
            }
            out.push((t.name.clone(), stats));
        }
        Ok(out)
    }

    /// Saved table `name`'s map as its shards ([`KvShard`]): one over its
    /// `capacity` rows and `of` buckets, or those of a set written by a
    /// table sharded by buckets.
    /// Only the saved shard of `want` (rows, buckets) is read when there
    /// is one: a shard on its own plan reads its own map.
    fn saved_kv(
        &self,
        name: &str,
        (capacity, of): (usize, usize),
        want: (&Range<usize>, &Range<usize>),
        local: &EmbeddingTable,
    ) -> Result<Vec<KvShard>, ModelError> {
        let store = self.store.as_ref();
        let base = super::names::table_base_name(name);
        if store.metadata().contains_key(&meta_key(name)) {
            let state = read_state(store, (names(&base), name), local, capacity)?;
            return Ok(vec![KvShard {
                rows: 0..capacity,
                buckets: 0..of,
                state,
            }]);
        }
        let [ids, last_seen, counts, free, sketch] = names(&base);
        let path = store.path();
        let mut metas = Vec::new();
        while let Some(saved) =
            meta_value::<SavedShard>(store.metadata(), &shard_key(name, metas.len()), path)?
        {
            metas.push(saved);
        }
        let same = |s: &SavedShard| (s.rows[0]..s.rows[1], s.buckets[0]..s.buckets[1]);
        let exact = metas
            .iter()
            .position(|s| same(s) == (want.0.clone(), want.1.clone()));
        let mut shards = Vec::new();
        for (k, saved) in metas.into_iter().enumerate() {
            if exact.is_some_and(|e| e != k) {
                continue;
            }
            let [start, end] = saved.rows;
            if start > end || end > capacity {
                return Err(ModelError::Checkpoint {
                    path: path.to_path_buf(),
                    tensor: None,
                    message: format!("{}: rows {start}..{end} of {capacity}", shard_key(name, k)),
                });
            }
            let split = RowSplit::Block { start, end };
            let rows = |name: &str, dtype| store.rows_bytes(name, dtype, &[capacity], split, 0..1);
            let whole = |name: String, len: usize| -> Result<Vec<u32>, ModelError> {
                let mut out = Vec::new();
                store.view(&name, Dtype::U32, &[len], &mut |b| out = u32s(b))?;
                Ok(out)
            };
            let sketch = match local.kv_sketch_len() {
                0 => Vec::new(),
                n => whole(format!("{sketch}#{k}"), n)?,
            };
            shards.push(KvShard {
                rows: start..end,
                buckets: saved.buckets[0]..saved.buckets[1],
                state: KvState {
                    ids: u64s(&rows(&ids, Dtype::U64)?),
                    last_seen: u32s(&rows(&last_seen, Dtype::U32)?),
                    counts: u32s(&rows(&counts, Dtype::U32)?),
                    free: whole(format!("{free}#{k}"), saved.free_rows)?,
                    sketch,
                    position: saved.position,
                },
            });
        }
        if shards.is_empty() {
            return Err(ModelError::Checkpoint {
                path: path.to_path_buf(),
                tensor: None,
                message: format!(
                    "no '{}': the key-value table's map is missing",
                    meta_key(name)
                ),
            });
        }
        Ok(shards)
    }

    /// Fills `local`, the key-value table (or shard: `split`) of saved
    /// table `t`, with its map and the rows it takes with their optimizer
    /// state (when `restore`): the saved map whole, or (saved or loaded
    /// sharded by buckets another way) its ids of the shard's buckets,
    /// gathered into its first rows ([`kv_slice`]).
    pub(super) fn read_kv_table(
        &self,
        t: usize,
        split: RowSplit,
        (optimizer, restore): (TableOptimizer, bool),
        local: &mut EmbeddingTable,
    ) -> Result<(), ModelError> {
        let config = &self.config.tables[t];
        let of = config.kv.as_ref().map_or(1, |kv| kv.buckets());
        let capacity = config.num_embeddings - 1;

        let fail = |message: String| ModelError::Checkpoint {
            path: self.path().to_path_buf(),
            tensor: None,
            message: format!("table '{}': {message}", config.name),
        };
        let (rows, buckets, _) = split.buckets().unwrap_or((0..capacity, 0..of, of));
        let saved = self.saved_kv(&config.name, (capacity, of), (&rows, &buckets), local)?;
        let whole = (split == RowSplit::All)
            .then(|| {
                saved
                    .iter()
                    .find(|s| s.rows == rows && s.buckets == buckets)
            })
            .flatten();
        if let Some(whole) = whole {
            // The saved table and map as they are (a disk-tier table streamed).
            let state = whole.state.clone();
            drop(saved);
            let from = (self.store.as_ref(), "");
            let all = (RowSplit::All, 0..config.embedding_dim);
            self.read_table_from(from, t, all, (optimizer, restore), local)?;
            return local.load_kv_state(state).map_err(|e| fail(e.to_string()));
        }
        let eviction = config.kv.as_ref().map(|k| k.eviction).unwrap_or_default();
        let slice = kv_slice(&saved, rows, buckets, (of, eviction));
        drop(saved);
        self.read_listed(t, &slice.from_rows, (optimizer, restore), local)?;
        local
            .load_kv_state(slice.state)
            .map_err(|e| fail(e.to_string()))
    }
}

fn u32s(b: &[u8]) -> Vec<u32> {
    let word = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    b.chunks_exact(4).map(word).collect()
}

fn u64s(b: &[u8]) -> Vec<u64> {
    let mut word = [0u8; 8];
    (b.chunks_exact(8))
        .map(|c| {
            word.copy_from_slice(c);
            u64::from_le_bytes(word)
        })
        .collect()
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
    names: ([String; 5], &str),
    local: &EmbeddingTable,
    rows: usize,
) -> Result<KvState, ModelError> {
    let read = |name: &str, dtype: Dtype, len: usize| -> Result<Vec<u8>, ModelError> {
        let mut out = Vec::new();
        store.view(name, dtype, &[len], &mut |b| out = b.to_vec())?;
        Ok(out)
    };
    let from = (&read as &ReadBytes, store.metadata(), store.path());
    read_map(from, names, (rows, local.kv_sketch_len()))
}

/// How a map's tensor is read: its bytes, by name, dtype and length.
pub(super) type ReadBytes<'r> = dyn Fn(&str, Dtype, usize) -> Result<Vec<u8>, ModelError> + 'r;

/// A map of `rows` rows (a sketch of `sketch_len` counters) saved under
/// `names` and the metadata key of `table`, read with `read` from a file
/// of metadata `meta` at `path`.
pub(super) fn read_map(
    (read, meta, path): (&ReadBytes, &HashMap<String, String>, &std::path::Path),
    ([ids, last_seen, counts, free, sketch], table): ([String; 5], &str),
    (rows, sketch_len): (usize, usize),
) -> Result<KvState, ModelError> {
    let key = meta_key(table);
    let saved: SavedKv = meta_value(meta, &key, path)?.ok_or_else(|| ModelError::Checkpoint {
        path: path.to_path_buf(),
        tensor: None,
        message: format!("no '{key}': the key-value table's map is missing"),
    })?;
    let sketch = match sketch_len {
        0 => Vec::new(),
        n => u32s(&read(&sketch, Dtype::U32, n)?),
    };
    Ok(KvState {
        ids: u64s(&read(&ids, Dtype::U64, rows)?),
        last_seen: u32s(&read(&last_seen, Dtype::U32, rows)?),
        counts: u32s(&read(&counts, Dtype::U32, rows)?),
        free: u32s(&read(&free, Dtype::U32, saved.free_rows)?),
        sketch,
        position: saved.position,
    })
}
