//! Writing checkpoints: DLRM's tensors and metadata, gathered (borrowed
//! where they can be) and written to one safetensors file atomically.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use ember_dataloader::atomic::AtomicFile;
use ember_dense::{DenseOptimizerConfig, HasParams};
use ember_sparse::{DataType, EmbeddingTable, TableOptimizer};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use serde::Serialize;

use super::names::{dense_shapes, table_base_name, weight_layout};
use super::{
    TrainState, META_CONFIG, META_CRC32, META_DENSE_OPTIMIZER, META_DENSE_STEPS,
    META_ROUNDING_SEED, META_SPARSE_STEP, META_TABLE_OPTIMIZER, META_TRAIN_STATE, OPTIMIZER_PREFIX,
};
use crate::{Dlrm, ModelError};

/// A tensor to write (little-endian bytes of its dtype), borrowed where it can be.
pub(super) struct Tensor<'a> {
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) data: Cow<'a, [u8]>,
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
            data,
        }
    }
}

/// The bytes of `x` in safetensors' (little-endian) layout.
pub(super) fn f32_bytes(x: &[f32]) -> &[u8] {
    #[cfg(not(target_endian = "little"))]
    compile_error!("checkpoints are written by reinterpreting f32 memory as little-endian");
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the
    // length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

pub(super) fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("plain data serialises")
}

/// Writes `model` (weights and optimizer state) to `path` atomically:
/// a temporary file in the same directory, fsynced, then renamed.
pub fn save(model: &mut Dlrm, path: &Path, train: Option<&TrainState>) -> Result<(), ModelError> {
    let meta = metadata(model, train);
    let mut tensors = dense_tensors(model).map_err(|m| fail_at(path, m))?;
    let table_opt = model.sparse_arch().optimizer();
    let unsharded = model.sparse_arch().unsharded()?;
    for table in unsharded.tables() {
        table_tensors(
            &table_base_name(table.name()),
            &SavedTable::of(table),
            &table_opt,
            &mut tensors,
        );
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
/// rows of `dtype` (their bytes) and the optimizer state in the
/// collection's layout.
pub(super) struct SavedTable<'a> {
    pub(super) dtype: DataType,
    pub(super) rows_bytes: &'a [u8],
    pub(super) state: &'a [f32],
    pub(super) rows: usize,
    pub(super) dim: usize,
}

impl<'a> SavedTable<'a> {
    /// All of `table`, borrowed.
    pub(super) fn of(table: &'a EmbeddingTable) -> Self {
        Self {
            dtype: table.data_type(),
            rows_bytes: table.row_bytes(),
            state: table.optimizer_state(),
            rows: table.num_embeddings(),
            dim: table.dim(),
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
    let (rows, dim, state) = (part.rows, part.dim, part.state);
    let (dtype, shape) = weight_layout(part.dtype, rows, dim);
    tensors.push((
        format!("{base}.weight"),
        Tensor {
            dtype,
            shape,
            data: Cow::Borrowed(part.rows_bytes),
        },
    ));
    let opt_name = |s: &str| format!("{OPTIMIZER_PREFIX}{base}.{s}");
    match table_opt {
        TableOptimizer::None | TableOptimizer::Sgd { .. } => {}
        TableOptimizer::RowWiseAdagrad { .. } => tensors.push((
            opt_name("momentum1"),
            Tensor::f32(vec![rows], Cow::Borrowed(state)),
        )),
        TableOptimizer::Adagrad { .. } => tensors.push((
            opt_name("momentum1"),
            Tensor::f32(vec![rows, dim], Cow::Borrowed(state)),
        )),
        TableOptimizer::Adam { .. } => {
            // Kept as [m | v] per row; saved as two tensors.
            let half = |k: usize| -> Vec<f32> {
                state
                    .chunks_exact(2 * dim.max(1))
                    .flat_map(|r| &r[k * dim..(k + 1) * dim])
                    .copied()
                    .collect()
            };
            for (k, s) in ["momentum1", "momentum2"].iter().enumerate() {
                tensors.push((
                    opt_name(s),
                    Tensor::f32(vec![rows, dim], Cow::Owned(half(k))),
                ));
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
/// 0600 that a killed run leaves behind unrecognised.
pub(super) fn write_file(
    mut tensors: Vec<(String, Tensor<'_>)>,
    mut meta: HashMap<String, String>,
    path: &Path,
) -> Result<(), ModelError> {
    use std::io::Write;
    let fail = |m: String| fail_at(path, m);
    // The crate's order: by descending dtype alignment, then name.
    tensors.sort_by(|(a, x), (b, y)| y.dtype.cmp(&x.dtype).then(a.cmp(b)));
    let mut sums: BTreeMap<&str, String> = (tensors.iter())
        .map(|(n, t)| (n.as_str(), format!("{:08x}", crc32fast::hash(&t.data))))
        .collect();
    let meta_sum = format!("{:08x}", metadata_crc(&meta));
    sums.insert(METADATA_SUM, meta_sum);
    meta.insert(META_CRC32.into(), json(&sums));
    let mut offset = 0;
    let infos = (tensors.iter())
        .map(|(name, t)| {
            let info = TensorInfo {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data_offsets: (offset, offset + t.data.len()),
            };
            offset += t.data.len();
            (name.clone(), info)
        })
        .collect();
    let header = Metadata::new(Some(meta), infos).map_err(|e| fail(e.to_string()))?;
    let mut header = serde_json::to_vec(&header).map_err(|e| fail(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    // The crate's readers refuse larger headers (its MAX_HEADER_SIZE).
    if header.len() > 100_000_000 {
        return Err(fail(format!(
            "a header of {} bytes (tensor names and metadata): readers take at most 100 MB",
            header.len()
        )));
    }

    let mut out = AtomicFile::create(path).map_err(|e| fail(e.to_string()))?;
    let temp = out.temp().to_path_buf();
    let written = (|| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, out.file());
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for (_, t) in &tensors {
            w.write_all(&t.data)?;
        }
        w.flush()
    })();
    written.map_err(|e| fail(ember_dataloader::DataError::from_io(&temp, e).to_string()))?;
    out.commit().map_err(|e| fail(e.to_string()))?;
    Ok(())
}
