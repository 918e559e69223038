//! Delta checkpoints: after a full checkpoint in a directory, a delta holds
//! only what training changed since the file before it: each table's
//! changed rows (row numbers, values, optimizer state, and a key-value
//! table's ids and headers of them with its free rows, sketch and
//! position), the dense weights and their optimizer state, and the
//! metadata of a full file. A chain read in order is bitwise the state a
//! full save would have written ([`Checkpoint::open`] on the directory or
//! on a delta reads it); [`compact`] folds it into one full file.
//!
//! A delta's table tensors (`delta.` before a full file's names):
//!
//! ```text
//! delta.<table>.rows                    U64 [n]   the changed rows, ascending
//! delta.<table>.weight                  [n, dim]  their values (the table's type)
//! delta.optimizer.<table>.momentum1|2   [n] or [n, dim]
//! delta.<table>.kv.{ids,last_seen,counts} [k]     of the n rows below the fallback row
//! <table>.kv.{free,sketch}, metadata ember.kv.<name>   whole, as in a full file
//! ```
//!
//! where `<table>` is `sparse_arch.embedding_bag_collection.embedding_bags.<name>`.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use ember_sparse::{EmbeddingBagCollection, EmbeddingTable, TableOptimizer};
use safetensors::tensor::Dtype;

use super::chain::{hex, remove_deltas, Chain, ChainHead, DeltaLink, META_DELTA};
use super::kv::{add_kv_delta, read_kv_delta};
use super::names::{table_base_name, weight_layout};
use super::read::Checkpoint;
use super::rows::state_tensors;
use super::store::{f32s, TensorStore};
use super::valid::{check_rows, check_values};
use super::write::{dense_tensors, metadata, table_tensors, write_file, Data, SavedTable, Tensor};
use super::{fail_at, TrainState};
use crate::{Dlrm, ModelError};

/// What a delta's table tensors' names begin with.
pub(super) const DELTA_PREFIX: &str = "delta.";

/// Writes a delta checkpoint of `model` into `dir`: what training changed
/// since the model last saved its checkpoint there (or was loaded from
/// that directory's chain), as the next file of the chain. Fails, saying
/// why, when there is no such chain to build on: save a full checkpoint
/// first ([`Model::save_checkpoint`](crate::Model::save_checkpoint)).
pub fn save_delta(
    model: &mut Dlrm,
    dir: &Path,
    train: Option<&TrainState>,
) -> Result<PathBuf, ModelError> {
    if let Err(why) = delta_head(model, dir) {
        return Err(fail_at(
            dir,
            format!("no delta: {why}: save a full checkpoint first"),
        ));
    }
    write_delta(model, dir, train)?.ok_or_else(|| fail_at(dir, "no delta written".into()))
}

/// [`save_delta`], or `None` when `dir` holds no chain this model's
/// changes count from (see [`delta_head`]): the caller saves a full
/// checkpoint. A model whose file is inside the chain (loaded from an
/// earlier delta, or from the full file alone) forks it there: the later
/// deltas are removed first.
pub(crate) fn write_delta(
    model: &mut Dlrm,
    dir: &Path,
    train: Option<&TrainState>,
) -> Result<Option<PathBuf>, ModelError> {
    let Ok(head) = delta_head(model, dir) else {
        return Ok(None);
    };
    let sequence = head.sequence + 1;
    let path = dir.join(super::chain::delta_file_name(sequence));
    let mut meta = metadata(model, train);
    let mut tensors = dense_tensors(model).map_err(|m| fail_at(&path, m))?;
    let optimizer = model.sparse_arch().optimizer();
    let ebc = model.sparse_arch().local().expect("checked above");
    let changed = changed_rows(ebc);
    let mut whole_tables = Vec::new();
    for (table, changed) in ebc.tables().iter().zip(&changed) {
        match changed {
            Some(rows) => add_table_delta(table, rows, &optimizer, &mut tensors, &mut meta),
            None => {
                add_whole_table(table, &optimizer, &mut tensors, &mut meta);
                whole_tables.push(table.name().to_string());
            }
        }
    }
    let link = DeltaLink {
        sequence,
        base: hex(head.base),
        parent: hex(head.tail),
        whole_tables,
    };
    meta.insert(META_DELTA.into(), super::write::json(&link));
    // A crash after this leaves the chain up to the model's head: whole.
    remove_deltas(dir, head.sequence)?;
    let identity = write_file(tensors, meta, &path)?;
    let ebc = model.sparse_arch_mut().local_mut().expect("checked above");
    ebc.clear_changed();
    model.set_chain_head(Some(ChainHead {
        tail: identity,
        sequence,
        ..head
    }));
    Ok(Some(path))
}

/// The head of `dir`'s chain a delta of `model` builds on, or why there
/// is none: the model saved no full file there and was not loaded from
/// its chain as saved (tables cast, another optimizer); it is sharded;
/// the chain cannot be read; or the chain no longer holds the model's
/// file (another model's full file replaced it).
fn delta_head(model: &Dlrm, dir: &Path) -> Result<ChainHead, String> {
    if model.world().is_some() || model.sparse_arch().local().is_none() {
        return Err("a sharded model's checkpoints are full".into());
    }
    let Some(head) = model.chain_head().filter(|h| h.dir == dir).cloned() else {
        return Err(
            "this model saved no full checkpoint here, and was not loaded from this \
             directory's chain as saved (same table dtypes and optimizer)"
                .into(),
        );
    };
    // The directory's chain must hold the model's head: its last file, or
    // (a model loaded from an earlier delta) a file the chain goes on
    // from, where the new delta forks it.
    let chain = match Chain::read(dir, Some(head.sequence)) {
        Ok(Some(chain)) => chain,
        Ok(None) => return Err(format!("{} is gone", super::CHECKPOINT_FILE)),
        Err(e) => return Err(format!("the chain cannot be read ({e})")),
    };
    let at_head = match head.sequence as usize {
        0 => Some(chain.base_identity),
        k => chain.deltas.get(k - 1).map(|(_, id)| *id),
    };
    if chain.base_identity != head.base || at_head != Some(head.tail) {
        return Err(format!(
            "the chain no longer holds the file this model saved or was loaded from \
             (delta {} of full file {}); another model's checkpoint replaced it",
            head.sequence,
            hex(head.base)
        ));
    }
    Ok(head)
}

/// Every table's changed rows (ascending); `None` for a table better
/// written whole: listing its changed rows (8 bytes each) would cost more
/// than writing the rows that did not change. The rows themselves are
/// streamed from where they are stored as the delta is written.
fn changed_rows(ebc: &EmbeddingBagCollection) -> Vec<Option<Vec<u64>>> {
    let whole = |table: &EmbeddingTable| {
        let (stride, per_row) = (table.bytes_per_row(), table.state_floats_per_row());
        // A key-value table's rows carry their id and header too.
        let row = stride + 4 * per_row + if table.is_key_value() { 16 } else { 0 };
        let changed = table.changed_count();
        (table.num_embeddings() - changed) * row <= 8 * changed
    };
    (ebc.tables().iter())
        .map(|t| (!whole(t)).then(|| t.changed_rows()))
        .collect()
}

/// The delta tensors of one table's changed `rows`.
fn add_table_delta<'a>(
    table: &'a EmbeddingTable,
    rows: &'a [u64],
    optimizer: &TableOptimizer,
    tensors: &mut Vec<(String, Tensor<'a>)>,
    meta: &mut std::collections::HashMap<String, String>,
) {
    let base = table_base_name(table.name());
    let row_numbers: Vec<u8> = rows.iter().flat_map(|r| r.to_le_bytes()).collect();
    tensors.push((
        format!("{DELTA_PREFIX}{base}.rows"),
        Tensor {
            dtype: Dtype::U64,
            shape: vec![rows.len()],
            data: Data::Bytes(Cow::Owned(row_numbers)),
        },
    ));
    let mut own = Vec::new();
    table_tensors(&base, &SavedTable::listed(table, rows), optimizer, &mut own);
    tensors.extend(
        own.into_iter()
            .map(|(name, t)| (format!("{DELTA_PREFIX}{name}"), t)),
    );
    if let Some(kv) = table.kv_delta(rows) {
        add_kv_delta(&base, table.name(), kv, tensors, meta);
    }
}

/// The delta tensors of a table written whole: a full file's, under `delta.`.
fn add_whole_table<'a>(
    table: &'a EmbeddingTable,
    optimizer: &TableOptimizer,
    tensors: &mut Vec<(String, Tensor<'a>)>,
    meta: &mut std::collections::HashMap<String, String>,
) {
    let base = table_base_name(table.name());
    let mut own = Vec::new();
    table_tensors(&base, &SavedTable::of(table), optimizer, &mut own);
    tensors.extend(
        own.into_iter()
            .map(|(name, t)| (format!("{DELTA_PREFIX}{name}"), t)),
    );
    if let Some(kv) = table.kv_state() {
        add_kv_delta(&base, table.name(), kv, tensors, meta);
    }
}

impl Checkpoint {
    /// Reads each delta of the chain over `ebc`'s tables (built from the
    /// full file), in order; a table's optimizer state is restored when
    /// `restore` (the saved optimizer is of the model's kind).
    pub(super) fn apply_deltas(
        &self,
        ebc: &mut EmbeddingBagCollection,
        optimizer: TableOptimizer,
        restore: bool,
    ) -> Result<(), ModelError> {
        for delta in &self.deltas {
            let link: DeltaLink =
                super::read::meta_value(delta.metadata(), META_DELTA, delta.path())?
                    .ok_or_else(|| fail_at(delta.path(), format!("no '{META_DELTA}'")))?;
            for (t, table) in ebc.tables_mut().iter_mut().enumerate() {
                let opt = (optimizer, restore);
                match link.whole_tables.contains(&self.config.tables[t].name) {
                    true => self.apply_whole_table(delta.as_ref(), t, opt, table)?,
                    false => self.apply_table_delta(delta.as_ref(), t, opt, table)?,
                }
            }
        }
        Ok(())
    }

    /// A delta's table written whole, read over `local`.
    fn apply_whole_table(
        &self,
        delta: &dyn TensorStore,
        t: usize,
        opt: (TableOptimizer, bool),
        local: &mut EmbeddingTable,
    ) -> Result<(), ModelError> {
        let all = (ember_sharding::RowSplit::All, 0..local.dim());
        self.read_table_from((delta, DELTA_PREFIX), t, all, opt, local)?;
        if !local.is_key_value() {
            return Ok(());
        }
        let base = table_base_name(local.name());
        let kv = read_kv_delta(delta, &base, local, local.num_embeddings() - 1)?;
        local.load_kv_state(kv).map_err(|e| ModelError::Checkpoint {
            path: delta.path().to_path_buf(),
            tensor: Some(format!("{DELTA_PREFIX}{base}.kv.ids")),
            message: e.to_string(),
        })
    }

    /// One delta's rows of table `t`, written over `local`.
    fn apply_table_delta(
        &self,
        delta: &dyn TensorStore,
        t: usize,
        (optimizer, restore): (TableOptimizer, bool),
        local: &mut EmbeddingTable,
    ) -> Result<(), ModelError> {
        let config = &self.config.tables[t];
        let (dim, saved) = (config.embedding_dim, self.stored[t]);
        let base = table_base_name(&config.name);
        let fail = |tensor: &str, message: String| ModelError::Checkpoint {
            path: delta.path().to_path_buf(),
            tensor: Some(tensor.to_string()),
            message,
        };
        let rows_name = format!("{DELTA_PREFIX}{base}.rows");
        let n = match delta.shapes().and_then(|s| s.get(&rows_name)) {
            Some(shape) if shape.len() == 1 => shape[0],
            _ => return Err(fail(&rows_name, "missing, or not a list of rows".into())),
        };
        let mut rows = Vec::with_capacity(n);
        delta.view(&rows_name, Dtype::U64, &[n], &mut |b| {
            rows.extend(
                b.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))),
            )
        })?;
        let table_rows = local.num_embeddings() as u64;
        if let Some(bad) = (rows.windows(2).find(|w| w[1] <= w[0]).map(|w| w[1]))
            .or_else(|| rows.iter().copied().find(|&r| r >= table_rows))
        {
            return Err(fail(
                &rows_name,
                format!(
                    "row {bad} of table '{}' is out of order, listed twice or past its {table_rows} rows",
                    config.name
                ),
            ));
        }
        let weight = format!("{DELTA_PREFIX}{base}.weight");
        let (dtype, shape) = weight_layout(saved, n, dim);
        let mut bytes = Vec::new();
        delta.view(&weight, dtype, &shape, &mut |b| bytes = b.to_vec())?;
        check_rows(saved, &bytes, dim, (ember_sharding::RowSplit::All, 0))
            .map_err(|m| fail(&weight, m))?;
        let saved_stride = saved.row_bytes(dim).unwrap_or(1).max(1);
        let (stride, per_row, local_type) = (
            local.bytes_per_row(),
            local.state_floats_per_row(),
            local.data_type(),
        );
        let mut local_bytes = vec![0u8; n * stride];
        let mut values = vec![0f32; dim];
        for (src, dst) in bytes
            .chunks_exact(saved_stride)
            .zip(local_bytes.chunks_exact_mut(stride.max(1)))
        {
            match local_type == saved {
                true => dst.copy_from_slice(src),
                false => {
                    saved.decode_row(src, &mut values);
                    local_type.encode_row(&values, dst);
                }
            }
        }
        // Each state tensor's columns side by side in a row, as the
        // collection keeps them; zero when the state is not restored.
        let mut state = vec![0f32; n * per_row];
        if restore {
            let mut column = 0;
            for st in state_tensors(&config.name, optimizer, (n, dim), 0..dim) {
                let name = format!("{DELTA_PREFIX}{}", st.name);
                let mut values = Vec::new();
                delta.view(&name, Dtype::F32, &st.shape, &mut |b| values = f32s(b))?;
                let width = st.shape.get(1).copied().unwrap_or(1);
                check_values(
                    &values,
                    width,
                    (ember_sharding::RowSplit::All, 0),
                    st.allowed,
                )
                .map_err(|m| fail(&name, m))?;
                for (r, v) in values.chunks_exact(width).enumerate() {
                    state[r * per_row + column..][..width].copy_from_slice(v);
                }
                column += width;
            }
        }
        if local.is_key_value() {
            let fallback = local.num_embeddings() as u64 - 1;
            let held = rows.iter().filter(|&&r| r < fallback).count();
            let kv = read_kv_delta(delta, &base, local, held)?;
            local
                .apply_kv_delta(&rows, kv)
                .map_err(|e| fail(&format!("{DELTA_PREFIX}{base}.kv.ids"), e.to_string()))?;
        }
        let mut k = 0;
        for run in rows.chunk_by(|a, b| *b == a + 1) {
            let len = run.len();
            local
                .write_stored_rows(
                    run[0] as usize,
                    &local_bytes[k * stride..(k + len) * stride],
                    &state[k * per_row..(k + len) * per_row],
                )
                .map_err(|e| fail(&weight, e.to_string()))?;
            k += len;
        }
        Ok(())
    }
}

/// What [`compact`] did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CompactSummary {
    /// The full file written.
    pub path: PathBuf,
    /// Deltas folded into it.
    pub deltas: usize,
    /// Bytes of the chain's files before.
    pub bytes_before: u64,
    /// Bytes of the full file written.
    pub bytes_after: u64,
}

/// Folds the chain of delta checkpoints in `dir` into one full file
/// (`model.safetensors`, written atomically), then removes the deltas:
/// the state the chain holds, with its optimizer state and position, as
/// a full save of it would be. The tables are read into memory. The
/// directory is taken while it runs, as a training run takes it.
pub fn compact(dir: &Path) -> Result<CompactSummary, ModelError> {
    if !dir.is_dir() {
        return Err(fail_at(
            dir,
            "not a directory: name a run's checkpoint directory".into(),
        ));
    }
    // One writer of the directory: not while a run trains there.
    let _lock = ember_dataloader::lock::DirLock::acquire(dir, "ember checkpoint compact")?;
    let chain = Chain::read(dir, None)?.ok_or_else(|| {
        fail_at(
            dir,
            format!("no {} here to compact", super::CHECKPOINT_FILE),
        )
    })?;
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let bytes_before = size(&chain.base)
        + (chain.deltas.iter())
            .map(|(f, _)| size(f.path()))
            .sum::<u64>();
    let deltas = chain.deltas.len();
    let path = chain.base.clone();
    let train;
    let mut model = {
        let checkpoint = Checkpoint::open(&chain.tail())?;
        drop(chain);
        train = checkpoint.train_state().cloned();
        let table = checkpoint.table_optimizer().unwrap_or(TableOptimizer::None);
        let dense = checkpoint
            .dense_optimizer()
            .unwrap_or(ember_dense::DenseOptimizerConfig::sgd(0.0));
        checkpoint.model(table, dense)?
    };
    super::write::save_full(&mut model, &path, train.as_ref())?;
    // Best effort: the new full file holds the chain, and deltas left
    // name the old one, so reads ignore them and the next save removes them.
    let _ = remove_deltas(dir, 0);
    Ok(CompactSummary {
        bytes_after: size(&path),
        path,
        deltas,
        bytes_before,
    })
}
