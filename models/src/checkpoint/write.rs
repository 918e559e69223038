//! Writing checkpoints: DLRM's tensors and metadata, gathered (borrowed
//! where they can be) and written to one safetensors file atomically.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
use std::path::Path;

use ember_dataloader::atomic::AtomicFile;
use ember_dense::{DenseOptimizerConfig, HasParams};
use ember_sparse::{DataType, EmbeddingTable, TableOptimizer};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use serde::Serialize;

use super::kv::add_kv_tensors;
use super::names::{dense_shapes, table_base_name, weight_layout};
use super::{
    TrainState, META_CONFIG, META_CRC32, META_DATASET_SPEC, META_DENSE_OPTIMIZER, META_DENSE_STEPS,
    META_ROUNDING_SEED, META_SPARSE_STEP, META_TABLE_OPTIMIZER, META_TRAIN_STATE, OPTIMIZER_PREFIX,
};
use crate::{Dlrm, ModelError};

/// A tensor to write (little-endian bytes of its dtype), borrowed where it can be.
pub(super) struct Tensor<'a> {
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) data: Data<'a>,
}

/// A tensor's bytes: in memory, or streamed from a table's stored rows (a
/// disk-tier table, never whole in memory; or the rows a delta lists).
pub(super) enum Data<'a> {
    Bytes(Cow<'a, [u8]>),
    Stored {
        table: &'a EmbeddingTable,
        piece: StoredPiece,
        /// The rows, ascending (`None`: all of them).
        rows: Option<&'a [u64]>,
    },
}

/// What of a table's stored rows a streamed tensor holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum StoredPiece {
    /// The rows' bytes.
    Rows,
    /// State floats `start..end` of each row (one of Adam's moments).
    State { start: usize, end: usize },
}

impl Data<'_> {
    fn len(&self) -> usize {
        match self {
            Data::Bytes(b) => b.len(),
            Data::Stored { table, piece, rows } => {
                rows.map_or(table.num_embeddings(), <[u64]>::len)
                    * match *piece {
                        StoredPiece::Rows => table.bytes_per_row(),
                        StoredPiece::State { start, end } => 4 * (end - start),
                    }
            }
        }
    }
}

impl<'a> Tensor<'a> {
    /// An F32 tensor of `values`.
    pub(super) fn f32(shape: Vec<usize>, values: Cow<'a, [f32]>) -> Self {
        let data = match values {
            Cow::Borrowed(v) => Cow::Borrowed(f32_bytes(v)),
            Cow::Owned(v) => Cow::Owned(f32_bytes(&v).to_vec()),
        };
        Self {
            dtype: Dtype::F32,
            shape,
            data: Data::Bytes(data),
        }
    }
}

/// The bytes of `x` in safetensors' (little-endian) layout.
pub(super) fn f32_bytes(x: &[f32]) -> &[u8] {
    plain_bytes(x)
}

/// Numbers whose memory is their little-endian bytes, as saved.
pub(super) trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for u32 {}
impl Plain for u64 {}

/// `x`'s memory as bytes: the little-endian values a checkpoint holds.
pub(super) fn plain_bytes<T: Plain>(x: &[T]) -> &[u8] {
    #[cfg(not(target_endian = "little"))]
    compile_error!("checkpoints are written by reinterpreting memory as little-endian");
    // SAFETY: these number types have no padding and any byte pattern is
    // a valid u8; the length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

pub(super) fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("plain data serialises")
}

/// Writes `model` (weights and optimizer state) to `path` atomically:
/// a temporary file in the same directory, fsynced, then renamed.
pub fn save(model: &mut Dlrm, path: &Path, train: Option<&TrainState>) -> Result<(), ModelError> {
    save_full(model, path, train).map(|_| ())
}

/// [`save`], returning the file's [`identity`](super::chain::identity).
pub(crate) fn save_full(
    model: &mut Dlrm,
    path: &Path,
    train: Option<&TrainState>,
) -> Result<u32, ModelError> {
    let mut meta = metadata(model, train);
    let mut tensors = dense_tensors(model).map_err(|m| fail_at(path, m))?;
    let table_opt = model.sparse_arch().optimizer();
    let unsharded = model.sparse_arch().unsharded()?;
    for table in unsharded.tables() {
        let base = table_base_name(table.name());
        table_tensors(&base, &SavedTable::of(table), &table_opt, &mut tensors);
        add_kv_tensors(table.name(), table, &mut tensors, &mut meta);
    }
    write_file(tensors, meta, path)
}

/// The name under which [`META_CRC32`] holds the checksum of the other
/// metadata entries (the architecture, optimizers, steps): safetensors'
/// own name for the metadata, which no tensor can have.
pub(super) const METADATA_SUM: &str = "__metadata__";

/// The CRC-32 of `meta` without [`META_CRC32`]: its entries in key order,
/// each `key NUL value NUL`.
pub(super) fn metadata_crc(meta: &HashMap<String, String>) -> u32 {
    let mut entries: Vec<(&String, &String)> = meta
        .iter()
        .filter(|(k, _)| k.as_str() != META_CRC32)
        .collect();
    entries.sort();
    let mut h = crc32fast::Hasher::new();
    for (k, v) in entries {
        for part in [k.as_bytes(), b"\0", v.as_bytes(), b"\0"] {
            h.update(part);
        }
    }
    h.finalize()
}

/// A checkpoint error at `path`, about no tensor in particular.
pub(crate) fn fail_at(path: &Path, message: String) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        tensor: None,
        message,
    }
}

/// The metadata every checkpoint carries: architecture, optimizers, steps
/// and the training position.
pub(super) fn metadata(model: &Dlrm, train: Option<&TrainState>) -> HashMap<String, String> {
    let mut meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (META_CONFIG.into(), json(model.config())),
        (
            META_TABLE_OPTIMIZER.into(),
            json(&model.sparse_arch().optimizer()),
        ),
        (
            META_DENSE_OPTIMIZER.into(),
            json(&model.dense_optimizer().config()),
        ),
        (
            META_SPARSE_STEP.into(),
            model.sparse_arch().step().to_string(),
        ),
        (
            META_DENSE_STEPS.into(),
            model.dense_optimizer().steps().to_string(),
        ),
        (
            META_ROUNDING_SEED.into(),
            model.sparse_arch().rounding_seed().to_string(),
        ),
    ]);
    if let Some(t) = train {
        meta.insert(META_TRAIN_STATE.into(), json(t));
    }
    if let Some(spec) = model.dataset_spec() {
        meta.insert(META_DATASET_SPEC.into(), json(spec));
    }
    meta
}

/// The dense parameters and their optimizer state (copied: they are small).
pub(super) fn dense_tensors(model: &mut Dlrm) -> Result<Vec<(String, Tensor<'static>)>, String> {
    let shapes = dense_shapes(model.config());
    let mut tensors = Vec::new();
    let dense_state: Vec<(String, usize, Vec<f32>, Vec<f32>)> = (model.dense_optimizer().state())
        .map(|(n, len, m, v)| (n.to_string(), len, m.to_vec(), v.to_vec()))
        .collect();
    let dense_opt = model.dense_optimizer().config();
    let params: Vec<(String, Vec<f32>)> = (model.dense_arch_mut().params().into_iter())
        .map(|p| (p.name, p.value.to_vec()))
        .collect();
    for (name, value) in params {
        let shape = shapes
            .get(&name)
            .ok_or_else(|| format!("no shape known for parameter {name}"))?
            .clone();
        tensors.push((name, Tensor::f32(shape, Cow::Owned(value))));
    }
    for (name, _, m, v) in dense_state {
        let shape = shapes.get(&name).cloned().unwrap_or_default();
        let (m_name, v_name) = match dense_opt {
            DenseOptimizerConfig::Adam { .. } => ("exp_avg", "exp_avg_sq"),
            _ => ("", "sum"),
        };
        for (state, data) in [(m_name, m), (v_name, v)] {
            if !data.is_empty() {
                tensors.push((
                    format!("{OPTIMIZER_PREFIX}{name}.{state}"),
                    Tensor::f32(shape.clone(), Cow::Owned(data)),
                ));
            }
        }
    }
    Ok(tensors)
}

/// A table, or the rows and columns of it one shard holds: `rows` x `dim`
/// rows of `dtype` and the optimizer state in the collection's layout.
pub(super) struct SavedTable<'a> {
    pub(super) dtype: DataType,
    pub(super) rows: usize,
    pub(super) dim: usize,
    source: Saved<'a>,
}

/// Where a saved table's rows are read from.
enum Saved<'a> {
    /// Rows' bytes and state in memory, borrowed.
    InMemory { rows: &'a [u8], state: &'a [f32] },
    /// Stored rows (all, or those listed), streamed a piece at a time as
    /// they are written.
    Stored(&'a EmbeddingTable, Option<&'a [u64]>),
}

impl<'a> SavedTable<'a> {
    /// The `rows` of `table` (ascending), streamed from where they are
    /// stored as they are written: a delta's changed rows.
    pub(super) fn listed(table: &'a EmbeddingTable, rows: &'a [u64]) -> Self {
        Self {
            dtype: table.data_type(),
            rows: rows.len(),
            dim: table.dim(),
            source: Saved::Stored(table, Some(rows)),
        }
    }

    /// All of `table`: borrowed in RAM, streamed on the disk tier.
    pub(super) fn of(table: &'a EmbeddingTable) -> Self {
        let source = match table.is_on_disk() {
            true => Saved::Stored(table, None),
            false => Saved::InMemory {
                rows: table.row_bytes(),
                state: table.optimizer_state(),
            },
        };
        Self {
            dtype: table.data_type(),
            rows: table.num_embeddings(),
            dim: table.dim(),
            source,
        }
    }
}

/// The weight and optimizer-state tensors of `part`, under `base` (the
/// table's TorchRec name, without `.weight`); the weight in the table's
/// own type (see [`weight_layout`]).
pub(super) fn table_tensors<'a>(
    base: &str,
    part: &SavedTable<'a>,
    table_opt: &TableOptimizer,
    tensors: &mut Vec<(String, Tensor<'a>)>,
) {
    let (rows, dim) = (part.rows, part.dim);
    let (dtype, shape) = weight_layout(part.dtype, rows, dim);
    // A piece of the table: borrowed or copied from memory, or streamed.
    let data = |piece: StoredPiece| match part.source {
        Saved::Stored(table, rows) => Data::Stored { table, piece, rows },
        Saved::InMemory { rows, state } => Data::Bytes(match piece {
            StoredPiece::Rows => Cow::Borrowed(rows),
            StoredPiece::State { start, end } if end - start == state.len() / part.rows.max(1) => {
                Cow::Borrowed(f32_bytes(state))
            }
            StoredPiece::State { start, end } => {
                let per_row = state.len() / part.rows.max(1);
                let half: Vec<f32> = (state.chunks_exact(per_row.max(1)))
                    .flat_map(|r| &r[start..end])
                    .copied()
                    .collect();
                Cow::Owned(f32_bytes(&half).to_vec())
            }
        }),
    };
    let data = &data;
    let f32_tensor = |shape: Vec<usize>, start: usize, end: usize| Tensor {
        dtype: Dtype::F32,
        shape,
        data: data(StoredPiece::State { start, end }),
    };
    tensors.push((
        format!("{base}.weight"),
        Tensor {
            dtype,
            shape,
            data: data(StoredPiece::Rows),
        },
    ));
    let opt_name = |s: &str| format!("{OPTIMIZER_PREFIX}{base}.{s}");
    match table_opt {
        TableOptimizer::None | TableOptimizer::Sgd { .. } => {}
        TableOptimizer::RowWiseAdagrad { .. } => {
            tensors.push((opt_name("momentum1"), f32_tensor(vec![rows], 0, 1)))
        }
        TableOptimizer::Adagrad { .. } => {
            tensors.push((opt_name("momentum1"), f32_tensor(vec![rows, dim], 0, dim)))
        }
        TableOptimizer::Adam { .. } => {
            // Kept as [m | v] per row; saved as two tensors.
            for (k, s) in ["momentum1", "momentum2"].iter().enumerate() {
                let moment = f32_tensor(vec![rows, dim], k * dim, (k + 1) * dim);
                tensors.push((opt_name(s), moment));
            }
        }
    }
}

/// Writes a safetensors file atomically through [`AtomicFile`], with the
/// CRC-32 of every tensor's bytes in the metadata ([`META_CRC32`]).
///
/// The header comes from the safetensors crate (its `Metadata`, so the
/// format is the crate's); the file itself is written here, streaming,
/// because the crate's writer goes through a `.tmpXXXXXX` file of mode
/// 0600 that a killed run leaves behind unrecognised, and needs every
/// tensor in memory. Tensors streamed from a disk-tier table are read a
/// piece at a time (each table once, all its tensors together); their
/// checksums are known only once written, so the header goes in first with
/// zeros for them (of the same length) and again at the end. Returns the
/// file's [`identity`](super::chain::identity).
pub(super) fn write_file(
    mut tensors: Vec<(String, Tensor<'_>)>,
    mut meta: HashMap<String, String>,
    path: &Path,
) -> Result<u32, ModelError> {
    let fail = |m: String| fail_at(path, m);
    // The crate's order: by descending dtype alignment, then name.
    tensors.sort_by(|(a, x), (b, y)| y.dtype.cmp(&x.dtype).then(a.cmp(b)));
    let mut sums: BTreeMap<String, u32> = (tensors.iter())
        .filter_map(|(n, t)| match &t.data {
            Data::Bytes(b) => Some((n.clone(), crc32fast::hash(b))),
            Data::Stored { .. } => None,
        })
        .collect();
    let meta_sum = metadata_crc(&meta);
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    let infos: Vec<(String, TensorInfo)> = (tensors.iter())
        .map(|(name, t)| {
            let info = TensorInfo {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data_offsets: (offset, offset + t.data.len()),
            };
            offsets.push(offset);
            offset += t.data.len();
            (name.clone(), info)
        })
        .collect();
    let mut header = |sums: &BTreeMap<String, u32>| -> Result<Vec<u8>, ModelError> {
        let mut hex: BTreeMap<&str, String> = (tensors.iter())
            .map(|(n, _)| {
                (
                    n.as_str(),
                    format!("{:08x}", sums.get(n).copied().unwrap_or(0)),
                )
            })
            .collect();
        hex.insert(METADATA_SUM, format!("{meta_sum:08x}"));
        meta.insert(META_CRC32.into(), json(&hex));
        let header =
            Metadata::new(Some(meta.clone()), infos.clone()).map_err(|e| fail(e.to_string()))?;
        let mut header = serde_json::to_vec(&header).map_err(|e| fail(e.to_string()))?;
        header.resize(header.len().next_multiple_of(8), b' ');
        Ok(header)
    };
    let first = header(&sums)?;
    // The crate's readers refuse larger headers (its MAX_HEADER_SIZE).
    if first.len() > 100_000_000 {
        return Err(fail(format!(
            "a header of {} bytes (tensor names and metadata): readers take at most 100 MB",
            first.len()
        )));
    }
    let data_start = 8 + first.len() as u64;

    let mut out = AtomicFile::create(path).map_err(|e| fail(e.to_string()))?;
    let temp = out.temp().to_path_buf();
    let io_fail =
        |e: std::io::Error| fail(ember_dataloader::DataError::from_io(&temp, e).to_string());
    let file: &std::fs::File = out.file();
    file.write_all_at(&(first.len() as u64).to_le_bytes(), 0)
        .map_err(io_fail)?;
    file.write_all_at(&first, 8).map_err(io_fail)?;
    // A stream is a table's rows, all or a list: tensors of the same
    // table and rows are streamed together, once.
    let stream_of = |table: &EmbeddingTable, rows: Option<&[u64]>| {
        let rows = rows.map(|r| (r.as_ptr(), r.len()));
        (table as *const EmbeddingTable, rows)
    };
    let mut streamed = Vec::new();
    for (i, (_, t)) in tensors.iter().enumerate() {
        match &t.data {
            Data::Bytes(b) => file
                .write_all_at(b, data_start + offsets[i] as u64)
                .map_err(io_fail)?,
            Data::Stored { table, rows, .. } => {
                let stream = stream_of(table, *rows);
                if streamed.contains(&stream) {
                    continue;
                }
                streamed.push(stream);
                // Every tensor of this stream, at its place in the file.
                let parts: Vec<(usize, StoredPiece)> = (tensors.iter().enumerate())
                    .filter_map(|(j, (_, u))| match &u.data {
                        Data::Stored {
                            table: other,
                            piece,
                            rows: others,
                        } if stream_of(other, *others) == stream => Some((j, *piece)),
                        _ => None,
                    })
                    .collect();
                let at: Vec<u64> = (parts.iter())
                    .map(|&(j, _)| data_start + offsets[j] as u64)
                    .collect();
                let got = stream_table((table, *rows), &parts, &at, file).map_err(|e| match e {
                    Streamed::Read(e) => fail(e.to_string()),
                    Streamed::Write(e) => io_fail(e),
                })?;
                for ((j, _), sum) in parts.iter().zip(got) {
                    sums.insert(tensors[*j].0.clone(), sum);
                }
            }
        }
    }
    if !streamed.is_empty() {
        let last = header(&sums)?;
        if last.len() != first.len() {
            return Err(fail("the header changed length with its checksums".into()));
        }
        file.write_all_at(&last, 8).map_err(io_fail)?;
    }
    out.commit().map_err(|e| fail(e.to_string()))?;
    Ok(super::chain::identity(&meta).expect("the checksums were just written"))
}

/// Why streaming a table's tensors failed.
enum Streamed {
    /// Its rows could not be read (a disk-tier table's file).
    Read(ember_sparse::SparseError),
    /// The checkpoint could not be written.
    Write(std::io::Error),
}

/// Rows of a stored table streamed per piece.
const STREAM_BYTES: usize = 8 << 20;

/// Writes each of `parts` (a piece of `table`'s stored rows: all, or the
/// `listed` ones) at its byte `at` of `file`, reading a piece of rows at
/// a time; returns each part's CRC-32.
fn stream_table(
    (table, listed): (&EmbeddingTable, Option<&[u64]>),
    parts: &[(usize, StoredPiece)],
    at: &[u64],
    file: &std::fs::File,
) -> Result<Vec<u32>, Streamed> {
    let (stride, per_row) = (table.bytes_per_row(), table.state_floats_per_row());
    let chunk = (STREAM_BYTES / (stride + 4 * per_row).max(1)).max(1);
    let (mut rows, mut state) = (vec![0u8; chunk * stride], vec![0f32; chunk * per_row]);
    let mut sums: Vec<crc32fast::Hasher> = parts.iter().map(|_| Default::default()).collect();
    let mut written: Vec<u64> = vec![0; parts.len()];
    let mut out = Vec::new();
    let total = listed.map_or(table.num_embeddings(), <[u64]>::len);
    for first in (0..total).step_by(chunk) {
        let n = chunk.min(total - first);
        let (rows, state) = (&mut rows[..n * stride], &mut state[..n * per_row]);
        match listed {
            None => table.read_stored_rows(first, rows, state),
            Some(listed) => read_listed(table, &listed[first..first + n], rows, state),
        }
        .map_err(Streamed::Read)?;
        for (p, &(_, piece)) in parts.iter().enumerate() {
            let bytes: &[u8] = match piece {
                StoredPiece::Rows => rows,
                StoredPiece::State { start, end } if end - start == per_row => f32_bytes(state),
                StoredPiece::State { start, end } => {
                    out.clear();
                    for r in state.chunks_exact(per_row) {
                        out.extend_from_slice(f32_bytes(&r[start..end]));
                    }
                    &out
                }
            };
            sums[p].update(bytes);
            file.write_all_at(bytes, at[p] + written[p])
                .map_err(Streamed::Write)?;
            written[p] += bytes.len() as u64;
        }
    }
    Ok(sums.into_iter().map(|h| h.finalize()).collect())
}

/// The `listed` rows of `table` (ascending) into `rows` and `state`, a run
/// of consecutive rows at a time.
fn read_listed(
    table: &EmbeddingTable,
    listed: &[u64],
    rows: &mut [u8],
    state: &mut [f32],
) -> Result<(), ember_sparse::SparseError> {
    let (stride, per_row) = (table.bytes_per_row(), table.state_floats_per_row());
    let mut k = 0;
    for run in listed.chunk_by(|a, b| *b == a + 1) {
        let len = run.len();
        table.read_stored_rows(
            run[0] as usize,
            &mut rows[k * stride..(k + len) * stride],
            &mut state[k * per_row..(k + len) * per_row],
        )?;
        k += len;
    }
    Ok(())
}
