//! A rank's shards read straight from a checkpoint (one file, a set or bytes
//! in memory): each rank reads the rows and columns of its own shards and
//! nothing else is kept, so a model too large for one process resumes on many.

use std::ops::Range;
use std::sync::Arc;

use ember_dense::DenseOptimizerConfig;
use ember_sharding::{
    Collective, RowSplit, Shard, ShardSource, ShardingError, ShardingPlan, WithDiskTiers,
};
use ember_sparse::{DiskTierConfig, EmbeddingBagConfig, EmbeddingTable, TableOptimizer};
use safetensors::tensor::Dtype;

use super::store::{f32s, TensorStore};

use super::valid::{check_rows, check_values, Allowed};
use super::{table_weight_name, weight_layout, Checkpoint, OPTIMIZER_PREFIX, TABLE_PREFIX};
use crate::{Dlrm, ModelError};

impl Checkpoint {
    /// The model as rank `comm.rank()` of a world under `plan` (without a
    /// world: every device a thread of this process): the rank reads only
    /// its shards' rows (and their optimizer state).
    /// The tables whose entry of `tiers` is `Some` (or none: empty) go on
    /// the rank's disk tier, streamed from the checkpoint (see
    /// [`ember_sharding::WithDiskTiers`]).
    pub(crate) fn model_on_rank(
        &self,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
        (plan, comm): (ShardingPlan, Option<Arc<dyn Collective>>),
        tiers: Vec<Option<DiskTierConfig>>,
    ) -> Result<Dlrm, ModelError> {
        if !self.deltas.is_empty() {
            return Err(super::fail_at(
                self.path(),
                "a chain of delta checkpoints loads in one process: fold it into one file first (ember checkpoint compact)".into(),
            ));
        }
        let restore = self.same_table_optimizer(&table_optimizer);
        let rows = ShardRows {
            checkpoint: self,
            optimizer: table_optimizer,
            restore,
        };
        let source = WithDiskTiers {
            source: &rows,
            tiers,
        };
        let step = if restore { self.sparse_step } else { 0 };
        let tables = (table_optimizer, step, &source as &dyn ShardSource);
        let mut model = Dlrm::on_rank(self.config.clone(), tables, dense_optimizer, 0, plan, comm)?;
        model
            .sparse_arch_mut()
            .set_rounding_seed(self.rounding_seed);
        self.restore_dense(&mut model, dense_optimizer)?;
        model.set_dataset_spec(self.dataset_spec.clone());
        Ok(model)
    }

    /// Fills `local` with rows `split` and columns `cols` of saved table
    /// `t`, and with their optimizer state (of `optimizer`'s kind) when
    /// `restore`. Rows of the saved type are copied as they are; of another
    /// type (a cast), converted value by value.
    pub(super) fn read_table(
        &self,
        t: usize,
        (split, cols): (RowSplit, Range<usize>),
        (optimizer, restore): (TableOptimizer, bool),
        local: &mut EmbeddingTable,
    ) -> Result<(), ModelError> {
        if local.is_key_value() {
            return self.read_kv_table(t, split, (optimizer, restore), local);
        }
        let from = (self.store.as_ref(), "");
        self.read_table_from(from, t, (split, cols), (optimizer, restore), local)
    }

    /// Saved rows `from_rows` (ascending) of table `t` (every column) into
    /// `local`'s rows from 0, with their optimizer state when `restore`:
    /// a key-value shard's ids gathered from another split. The tensors
    /// are streamed once, a piece at a time, each checksum computed once.
    pub(super) fn read_listed(
        &self,
        t: usize,
        from_rows: &[usize],
        (optimizer, restore): (TableOptimizer, bool),
        local: &mut EmbeddingTable,
    ) -> Result<(), ModelError> {
        let pick = |g: usize| from_rows.binary_search(&g).ok();
        let dim = self.config.tables[t].embedding_dim;
        let from = (self.store.as_ref(), "");
        self.stream_table(from, t, (&pick, 0..dim), (optimizer, restore), local)
    }

    /// [`read_table`](Self::read_table)'s rows and optimizer state (not a
    /// key-value table's map) from `store`, whose tensor names are a full
    /// file's after `prefix` (a delta's whole tables: `delta.`).
    pub(super) fn read_table_from(
        &self,
        (store, prefix): (&dyn TensorStore, &str),
        t: usize,
        (split, cols): (RowSplit, Range<usize>),
        (optimizer, restore): (TableOptimizer, bool),
        local: &mut EmbeddingTable,
    ) -> Result<(), ModelError> {
        let config = &self.config.tables[t];
        let (rows, dim, saved) = (config.num_embeddings, config.embedding_dim, self.stored[t]);
        if local.is_on_disk() {
            let whole = split == RowSplit::All && cols == (0..dim) && prefix.is_empty();
            let inference = matches!(optimizer, TableOptimizer::None) && local.data_type() == saved;
            if whole && inference && self.read_in_place(store, t, local)? {
                return Ok(());
            }
            let from = (store, prefix);
            let pick = |g: usize| split.local(g);
            return self.stream_table(from, t, (&pick, cols), (optimizer, restore), local);
        }
        let name = format!("{prefix}{}", table_weight_name(&config.name));
        let (dtype, shape) = weight_layout(saved, rows, dim);
        // Quantized rows are read whole (plans never split their columns).
        let columns = match saved.column_bytes() {
            Some(_) => cols.clone(),
            None => 0..shape[1],
        };
        let bytes = store.rows_bytes(&name, dtype, &shape, split, columns.clone())?;
        let fail_on = |message: String| ModelError::Checkpoint {
            path: store.path().to_path_buf(),
            tensor: Some(name.clone()),
            message,
        };
        let (width, first_col) = match saved.column_bytes() {
            Some(_) => (cols.len(), cols.start),
            None => (dim, 0),
        };
        check_rows(saved, &bytes, width, (split, first_col)).map_err(fail_on)?;
        if local.data_type() == saved {
            local.row_bytes_mut().copy_from_slice(&bytes);
        } else {
            if saved.column_bytes().is_none() && cols != (0..dim) {
                return Err(fail_on(
                    "a quantized table's columns cannot be split".into(),
                ));
            }
            let stride = bytes.len() / local.num_embeddings().max(1);
            let mut row = vec![0f32; cols.len()];
            for (l, src) in bytes.chunks_exact(stride.max(1)).enumerate() {
                saved.decode_row(src, &mut row);
                local.write_row(l, &row);
            }
        }
        if !restore {
            return Ok(());
        }
        // Each state tensor's kept columns, side by side in a row (FBGEMM
        // keeps both of Adam's moments of a row together: [m | v]).
        let mut states = state_tensors(&config.name, optimizer, (rows, dim), cols);
        states
            .iter_mut()
            .for_each(|st| st.name.insert_str(0, prefix));
        let mut parts = Vec::new();
        for st in &states {
            let values = store.rows_of(&st.name, &st.shape, split, st.kept.clone())?;
            let check = check_values(&values, st.kept.len(), (split, st.kept.start), st.allowed);
            check.map_err(|message| ModelError::Checkpoint {
                path: store.path().to_path_buf(),
                tensor: Some(st.name.clone()),
                message,
            })?;
            parts.push((values, st.kept.len()));
        }
        if parts.is_empty() {
            return Ok(());
        }
        let state: Vec<f32> = (0..local.num_embeddings())
            .flat_map(|r| parts.iter().flat_map(move |(v, w)| &v[r * w..(r + 1) * w]))
            .copied()
            .collect();
        local.optimizer_state_mut().copy_from_slice(&state);
        Ok(())
    }
}

impl Checkpoint {
    /// An inference table on the disk tier reading its rows where they lie
    /// in the checkpoint's mapped file, rather than copied to its own file
    /// (a model larger than memory would otherwise take twice its size on
    /// disk). Its rows are checked (values and checksum) in one streamed
    /// pass first. `false`: the store maps no one file; copy instead.
    fn read_in_place(
        &self,
        store: &dyn TensorStore,
        t: usize,
        local: &mut EmbeddingTable,
    ) -> Result<bool, ModelError> {
        let config = &self.config.tables[t];
        let (rows, dim, saved) = (config.num_embeddings, config.embedding_dim, self.stored[t]);
        let name = table_weight_name(&config.name);
        let (dtype, shape) = weight_layout(saved, rows, dim);
        let Some((map, range)) = store.in_place(&name, dtype, &shape)? else {
            return Ok(false);
        };
        let stride = saved.row_bytes(dim).unwrap_or(1).max(1);
        let fail_on = |message: String| ModelError::Checkpoint {
            path: store.path().to_path_buf(),
            tensor: Some(name.clone()),
            message,
        };
        let piece_rows = ((8 << 20) / stride).max(1);
        store.stream_rows(
            &[(&name, dtype, &shape)],
            piece_rows,
            &mut |first, pieces| {
                let n = pieces[0].len() / stride;
                let split = RowSplit::Block {
                    start: first,
                    end: first + n,
                };
                check_rows(saved, pieces[0], dim, (split, 0)).map_err(fail_on)
            },
        )?;
        // Rows are then read one at a time, at random: a fault must not
        // read ahead (it would read many pages for one row).
        let _ = map.advise_range(memmap2::Advice::Random, range.start, range.len());
        let read = move |row: u64, out: &mut [u8]| {
            out.copy_from_slice(&map[range.start + row as usize * stride..][..stride])
        };
        (local.read_rows_in_place(Arc::new(read))).map_err(|e| fail_on(e.to_string()))?;
        Ok(true)
    }

    /// [`read_table`](Self::read_table) for a disk-tier table (or shard):
    /// the whole tensors streamed a piece of rows at a time, the shard's
    /// rows and columns of each piece written to its file, so the table
    /// never sits in memory. `pick` gives a saved row's local row, if
    /// `local` takes it (ascending with the saved rows).
    fn stream_table(
        &self,
        (store, prefix): (&dyn TensorStore, &str),
        t: usize,
        (pick, cols): (&dyn Fn(usize) -> Option<usize>, Range<usize>),
        (optimizer, restore): (TableOptimizer, bool),
        local: &mut EmbeddingTable,
    ) -> Result<(), ModelError> {
        let config = &self.config.tables[t];
        let (rows, dim, saved) = (config.num_embeddings, config.embedding_dim, self.stored[t]);
        let weight = format!("{prefix}{}", table_weight_name(&config.name));
        let fail_on = |name: &str, message: String| ModelError::Checkpoint {
            path: store.path().to_path_buf(),
            tensor: Some(name.to_string()),
            message,
        };
        let (dtype, shape) = weight_layout(saved, rows, dim);
        let Some(col_bytes) = saved.column_range(dim, cols.clone()) else {
            return Err(fail_on(
                &weight,
                "a quantized table's columns cannot be split".into(),
            ));
        };
        let mut states = match restore {
            true => state_tensors(&config.name, optimizer, (rows, dim), cols.clone()),
            false => Vec::new(),
        };
        states
            .iter_mut()
            .for_each(|st| st.name.insert_str(0, prefix));
        let mut tensors: Vec<(&str, Dtype, &[usize])> = vec![(&weight, dtype, &shape)];
        tensors.extend(
            states
                .iter()
                .map(|st| (st.name.as_str(), Dtype::F32, &st.shape[..])),
        );
        let per_row = local.state_floats_per_row();
        let (stride, local_type) = (local.bytes_per_row(), local.data_type());
        let saved_stride = saved.row_bytes(dim).unwrap_or(1).max(1);
        // About 8 MiB of the tensors' rows a piece.
        let piece_rows = ((8 << 20) / (saved_stride + 4 * 2 * dim).max(1)).max(1);
        let (mut bytes, mut state) = (Vec::new(), Vec::new());
        let mut values = vec![0f32; cols.len()];
        store.stream_rows(&tensors, piece_rows, &mut |first, pieces| {
            let n = pieces[0].len() / saved_stride;
            // The piece's rows this table holds: consecutive local rows.
            let held: Vec<(usize, usize)> = (0..n)
                .filter_map(|r| pick(first + r).map(|l| (r, l)))
                .collect();
            let Some(&(_, first_local)) = held.first() else {
                return Ok(());
            };
            let piece_split = RowSplit::Block {
                start: first,
                end: first + n,
            };
            check_rows(saved, pieces[0], dim, (piece_split, 0)).map_err(|m| fail_on(&weight, m))?;
            bytes.clear();
            state.clear();
            bytes.resize(held.len() * stride, 0);
            state.resize(held.len() * per_row, 0.0);
            for (i, &(r, _)) in held.iter().enumerate() {
                let src = &pieces[0][r * saved_stride..][col_bytes.clone()];
                let dst = &mut bytes[i * stride..(i + 1) * stride];
                match local_type == saved {
                    true => dst.copy_from_slice(src),
                    // A cast: each row converted as it is read.
                    false => {
                        saved.decode_row(src, &mut values);
                        local_type.encode_row(&values, dst);
                    }
                }
            }
            let mut column = 0;
            for (st, piece) in states.iter().zip(&pieces[1..]) {
                let piece = f32s(piece);
                let width = st.shape.get(1).copied().unwrap_or(1);
                let check = check_values(&piece, width, (piece_split, 0), st.allowed);
                check.map_err(|m| fail_on(&st.name, m))?;
                for (i, &(r, _)) in held.iter().enumerate() {
                    let v = &piece[r * width..][st.kept.clone()];
                    state[i * per_row + column..][..v.len()].copy_from_slice(v);
                }
                column += st.kept.len();
            }
            (local.write_stored_rows(first_local, &bytes, &state))
                .map_err(|e| fail_on(&weight, e.to_string()))
        })
    }
}

/// One optimizer-state tensor of a table as a shard reads it.
pub(super) struct StateTensor {
    pub(super) name: String,
    pub(super) shape: Vec<usize>,
    pub(super) allowed: Allowed,
    /// The columns the shard keeps.
    pub(super) kept: Range<usize>,
}

/// The state tensors of table `table` (`rows` x `dim`) under `optimizer`,
/// in the order a row of the collection's state holds them, for a shard
/// of columns `cols`.
pub(super) fn state_tensors(
    table: &str,
    optimizer: TableOptimizer,
    (rows, dim): (usize, usize),
    cols: Range<usize>,
) -> Vec<StateTensor> {
    let tensor = |s: &str, shape: Vec<usize>, allowed, kept| StateTensor {
        name: format!("{OPTIMIZER_PREFIX}{TABLE_PREFIX}{table}.{s}"),
        shape,
        allowed,
        kept,
    };
    let sums = Allowed::NonNegative;
    match optimizer {
        TableOptimizer::None | TableOptimizer::Sgd { .. } => Vec::new(),
        TableOptimizer::RowWiseAdagrad { .. } => vec![tensor("momentum1", vec![rows], sums, 0..1)],
        TableOptimizer::Adagrad { .. } => vec![tensor("momentum1", vec![rows, dim], sums, cols)],
        TableOptimizer::Adam { .. } => vec![
            tensor("momentum1", vec![rows, dim], Allowed::Finite, cols.clone()),
            tensor("momentum2", vec![rows, dim], sums, cols),
        ],
    }
}

/// A checkpoint's rows as the source of a rank's shards.
struct ShardRows<'a> {
    checkpoint: &'a Checkpoint,
    optimizer: TableOptimizer,
    /// The saved optimizer state is of the same kind, so it is restored.
    restore: bool,
}

impl ShardSource for ShardRows<'_> {
    fn fill(
        &self,
        t: usize,
        _: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError> {
        let source = (shard.rows, shard.column_range());
        (self.checkpoint)
            .read_table(t, source, (self.optimizer, self.restore), local)
            .map_err(|e| ShardingError::Source(e.to_string()))
    }
}
