//! A checkpoint that every rank writes in parallel, laid out as large
//! Hugging Face checkpoints are: one safetensors file per rank and an index.
//!
//! ```text
//! model-s<steps>-<stamp>-<rank+1>-of-<ranks>.safetensors   the table shards the rank holds, in the
//!                                                  shard's own shape: a whole table under its
//!                                                  TorchRec name, a shard under the name and
//!                                                  `#<shard>`; rank 0's also the dense part
//! model.safetensors.index.json                     written last by rank 0: the commit point;
//!                                                  the files of the set before stay, older go
//! {"metadata":   {...as in a single file...},
//!  "weight_map": {"<tensor>": "<file>"},           tensors one file holds whole
//!  "pieces":     {"<tensor>": [{"file", "tensor", "rows", "columns"}]}}   split tensors: which
//!                                                  rows (all, a block, id mod N, a key-value
//!                                                  shard's block) and columns
//! ```
//!
//! Any number of ranks or devices reads it back: the pieces are placed into
//! whole tensors, and the reader shards them by its own plan. A key-value
//! shard of buckets also writes its map: ids, headers and counts as pieces,
//! `kv.free#<shard>` and `kv.sketch#<shard>` whole, its position in the
//! index's metadata (`ember.kv.<table>#<shard>`); the last one the table's
//! fallback row (`#<shard>.fallback`). A reader takes a saved shard's map
//! whole on the same split, or its buckets' ids from every saved shard.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ember_sharding::RowSplit;
use serde::{Deserialize, Serialize};

use super::kv::{add_kv_shard, add_kv_tensors};
use super::names::table_base_name;
use super::write::{dense_tensors, fail_at, metadata, table_tensors, write_file, SavedTable};
use super::TrainState;
use crate::{Dlrm, ModelError};

/// The index of a set in its directory, written last (the commit point).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Index {
    pub metadata: HashMap<String, String>,
    pub weight_map: BTreeMap<String, String>,
    #[serde(default)]
    pub pieces: BTreeMap<String, Vec<Piece>>,
}

/// Part of a tensor: its rows and columns, in one file under the name
/// `tensor` (the tensor's name and `#` the shard's index: a device may hold
/// several shards of one table).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Piece {
    pub file: String,
    #[serde(default)]
    pub tensor: String,
    pub rows: RowSplit,
    pub columns: [usize; 2],
}

/// What a rank reports to rank 0 about its file.
#[derive(Serialize, Deserialize)]
struct Written {
    file: String,
    /// Tensors the file holds whole.
    whole: Vec<String>,
    pieces: Vec<(String, Piece)>,
    /// Metadata of its tables for the index (key-value tables' positions).
    meta: HashMap<String, String>,
}

/// Writes this rank's file of the set in `dir` and, on rank 0, the index
/// naming every rank's file; returns the index's path. Every rank of the
/// model's world calls this together; it returns once the index is written.
/// A model sharded over one process's devices (no world) writes a set of
/// one file holding every shard: how its disk-tier shards are saved, each
/// streamed, never gathered into memory, and its key-value shards of
/// buckets, each with its own map.
pub fn save_set(
    model: &mut Dlrm,
    dir: &Path,
    train: Option<&TrainState>,
) -> Result<PathBuf, ModelError> {
    let comm = model.world().cloned();
    let (rank, size) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
    let steps = train.map_or(model.dense_optimizer().steps(), |t| t.steps);
    // A name no earlier set used (two saves can be of one step), from rank 0.
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let stamp = match &comm {
        Some(comm) => comm.all_gather_u64(stamp)?[0],
        None => stamp,
    };
    let file = format!(
        "model-s{steps}-{stamp:016x}-{:05}-of-{size:05}.safetensors",
        rank + 1
    );
    let path = dir.join(&file);
    let meta = metadata(model, train);
    // A key-value shard of buckets saves its block's rows, and the last
    // one the table's fallback row too (its own, zero as every shard's):
    // these local rows, listed.
    let blocks: Vec<[Vec<u64>; 2]> = (model.sparse_arch().sharded())
        .map(|s| s.local_shards())
        .unwrap_or_default()
        .iter()
        .map(|l| match l.shard.rows.buckets() {
            Some((rows, _, _)) => {
                let n = rows.len() as u64;
                [(0..n).collect(), vec![n]]
            }
            None => [Vec::new(), Vec::new()],
        })
        .collect();
    let mut tensors = match rank {
        0 => dense_tensors(model).map_err(|m| fail_at(&path, m))?,
        _ => Vec::new(),
    };
    let mut written = Written {
        file: file.clone(),
        whole: tensors.iter().map(|(n, _)| n.clone()).collect(),
        pieces: Vec::new(),
        meta: HashMap::new(),
    };
    let table_opt = model.sparse_arch().optimizer();
    let config = model.config().clone();
    let sharded = (model.sparse_arch().sharded()).ok_or(crate::Unsupported::SetOfUnsharded)?;
    for (local, [block, fallback]) in sharded.local_shards().into_iter().zip(&blocks) {
        let buckets =
            (local.shard.rows.buckets()).map(|(r, b, _)| ([r.start, r.end], [b.start, b.end]));
        let part = match buckets {
            Some(_) => SavedTable::listed(local.data, block),
            None => SavedTable::of(local.data),
        };
        let Some(table) = config.tables.iter().find(|t| t.name == local.table) else {
            continue;
        };
        let dim = table.embedding_dim;
        let whole = local.shard.rows == RowSplit::All && local.shard.columns == [0, dim];
        // A quantized weight's columns are its row bytes (never split).
        let weight_columns = match part.dtype.column_bytes() {
            Some(_) => local.shard.columns,
            None => [0, part.dtype.row_bytes(dim).unwrap_or(0)],
        };
        let base = table_base_name(local.table);
        let before = tensors.len();
        table_tensors(&base, &part, &table_opt, &mut tensors);
        // A key-value table's map: whole (table-wise), or a shard's.
        let mut kv_whole = Vec::new();
        match (buckets, local.data.kv_view()) {
            (Some((rows, ids)), Some(view)) => {
                let shard = (local.table, local.index, rows);
                let out = (&mut tensors, &mut kv_whole);
                add_kv_shard(shard, ids, view, out, &mut written.meta);
            }
            _ => add_kv_tensors(local.table, local.data, &mut tensors, &mut written.meta),
        }
        let columns = (weight_columns, local.shard.columns);
        if whole {
            written
                .whole
                .extend(tensors[before..].iter().map(|(n, _)| n.clone()));
        } else {
            let piece = (format!("#{}", local.index), local.shard.rows);
            add_pieces(&mut tensors[before..], &mut written, piece, columns);
        }
        if let Some(([_, end], _)) = buckets.filter(|([_, end], _)| end + 1 == table.num_embeddings)
        {
            let before = tensors.len();
            let row = SavedTable::listed(local.data, fallback);
            table_tensors(&base, &row, &table_opt, &mut tensors);
            let rows = RowSplit::Block {
                start: end,
                end: end + 1,
            };
            let piece = (format!("#{}.fallback", local.index), rows);
            add_pieces(&mut tensors[before..], &mut written, piece, columns);
        }
        written
            .whole
            .extend(kv_whole.iter().map(|(n, _)| n.clone()));
        tensors.extend(kv_whole);
    }
    let file_meta = match rank {
        0 => meta.clone(),
        _ => HashMap::from([("format".to_string(), "pt".to_string())]),
    };
    write_file(tensors, file_meta, &path)?;
    let json = serde_json::to_vec(&written).expect("serialisable");
    let all = match &comm {
        Some(comm) => comm.all_gather(json)?,
        None => vec![json],
    };
    let index_path = dir.join(INDEX_FILE);
    if rank == 0 {
        let mut index = Index {
            metadata: meta,
            weight_map: BTreeMap::new(),
            pieces: BTreeMap::new(),
        };
        let mut files = Vec::new();
        for (r, bytes) in all.iter().enumerate() {
            let w: Written = serde_json::from_slice(bytes)
                .map_err(|e| fail_at(&index_path, format!("rank {r}'s file list: {e}")))?;
            for name in w.whole {
                index.weight_map.insert(name, w.file.clone());
            }
            index.metadata.extend(w.meta);
            for (name, piece) in w.pieces {
                index.pieces.entry(name).or_default().push(piece);
            }
            files.push(w.file);
        }
        // The set the old index names stays one more write, for a reader
        // (an `eval` of the last checkpoint) that read the old index just
        // before and has yet to map its files.
        if let Ok(previous) = read_index(&index_path) {
            files.extend(previous.weight_map.into_values());
            files.extend(previous.pieces.into_values().flatten().map(|p| p.file));
        }
        let text = serde_json::to_vec_pretty(&index).expect("serialisable");
        ember_dataloader::atomic::write_atomic(&index_path, &text)
            .map_err(|e| fail_at(&index_path, e.to_string()))?;
        remove_stale(dir, &files);
    }
    if let Some(comm) = &comm {
        comm.barrier()?;
    }
    Ok(index_path)
}

/// Names `tensors` as pieces of their tensors in `written`'s file: each
/// renamed with `suffix`, holding `rows` and the columns of `columns`
/// (the weight's, the others').
fn add_pieces(
    tensors: &mut [(String, super::write::Tensor<'_>)],
    written: &mut Written,
    (suffix, rows): (String, RowSplit),
    (weight_columns, columns): ([usize; 2], [usize; 2]),
) {
    for (name, _) in tensors {
        let key = format!("{name}{suffix}");
        let columns = match name.ends_with(".weight") {
            true => weight_columns,
            false => columns,
        };
        let piece = Piece {
            file: written.file.clone(),
            tensor: key.clone(),
            rows,
            columns,
        };
        written.pieces.push((std::mem::replace(name, key), piece));
    }
}

/// Removes the set in `dir`: its index first, so no half set is ever read.
pub fn remove_set(dir: &Path) {
    if std::fs::remove_file(dir.join(INDEX_FILE)).is_ok() {
        remove_stale(dir, &[]);
    }
}

/// Files of older sets: those `keep` does not name.
fn remove_stale(dir: &Path, keep: &[String]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = name.starts_with("model-s") && name.ends_with(".safetensors");
        if ours && !keep.contains(&name) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The parts of an index's tensors and the files they are in.
pub(super) fn read_index(path: &Path) -> Result<Index, ModelError> {
    let text = std::fs::read(path).map_err(|e| fail_at(path, e.to_string()))?;
    let mut index: Index = serde_json::from_slice(&text)
        .map_err(|e| fail_at(path, format!("not a checkpoint index: {e}")))?;
    // A piece without its own name in the file goes by the tensor's.
    for (name, pieces) in &mut index.pieces {
        for p in pieces.iter_mut().filter(|p| p.tensor.is_empty()) {
            p.tensor = name.clone();
        }
    }
    Ok(index)
}
