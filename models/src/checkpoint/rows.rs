//! A rank's shards read straight from a checkpoint (one file, a set or bytes
//! in memory): each rank reads the rows and columns of its own shards and
//! nothing else is kept, so a model too large for one process resumes on many.

use std::ops::Range;
use std::sync::Arc;

use ember_dense::DenseOptimizerConfig;
use ember_sharding::{Collective, RowSplit, Shard, ShardSource, ShardingError, ShardingPlan};
use ember_sparse::{EmbeddingBagConfig, EmbeddingTable, TableOptimizer};

use super::valid::{check_rows, check_values, Allowed};
use super::{table_weight_name, weight_layout, Checkpoint, OPTIMIZER_PREFIX, TABLE_PREFIX};
use crate::{Dlrm, ModelError};

impl Checkpoint {
    /// [`Checkpoint::model`] as rank `comm.rank()` of a world under `plan`:
    /// the rank reads only its shards' rows (and their optimizer state).
    pub fn model_on_rank(
        &self,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
        plan: ShardingPlan,
        comm: Arc<dyn Collective>,
    ) -> Result<Dlrm, ModelError> {
        let restore = self.same_table_optimizer(&table_optimizer);
        let source = ShardRows {
            checkpoint: self,
            optimizer: table_optimizer,
            restore,
        };
        let step = if restore { self.sparse_step } else { 0 };
        let tables = (table_optimizer, step, &source as &dyn ShardSource);
        let mut model = Dlrm::on_rank(self.config.clone(), tables, dense_optimizer, 0, plan, comm)?;
        model
            .sparse_arch_mut()
            .set_rounding_seed(self.rounding_seed);
        self.restore_dense(&mut model, dense_optimizer)?;
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
        let config = &self.config.tables[t];
        let (rows, dim, saved) = (config.num_embeddings, config.embedding_dim, self.stored[t]);
        let name = table_weight_name(&config.name);
        let (dtype, shape) = weight_layout(saved, rows, dim);
        // Quantized rows are read whole (plans never split their columns).
        let columns = match saved.column_bytes() {
            Some(_) => cols.clone(),
            None => 0..shape[1],
        };
        let bytes = self
            .store
            .rows_bytes(&name, dtype, &shape, split, columns.clone())?;
        let fail_on = |message: String| ModelError::Checkpoint {
            path: self.path().to_path_buf(),
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
        let name = |s: &str| format!("{OPTIMIZER_PREFIX}{TABLE_PREFIX}{}.{s}", config.name);
        let read = |s: &str, shape: &[usize], cols: Range<usize>, allowed| {
            let values = self.store.rows_of(&name(s), shape, split, cols.clone())?;
            check_values(&values, cols.len(), (split, cols.start), allowed).map_err(|message| {
                ModelError::Checkpoint {
                    path: self.path().to_path_buf(),
                    tensor: Some(name(s)),
                    message,
                }
            })?;
            Ok::<_, ModelError>(values)
        };
        let sums = Allowed::NonNegative;
        let state = match optimizer {
            TableOptimizer::None | TableOptimizer::Sgd { .. } => return Ok(()),
            TableOptimizer::RowWiseAdagrad { .. } => read("momentum1", &[rows], 0..1, sums)?,
            TableOptimizer::Adagrad { .. } => read("momentum1", &[rows, dim], cols, sums)?,
            TableOptimizer::Adam { .. } => {
                // FBGEMM keeps both moments of a row together: [m | v].
                let lc = cols.len().max(1);
                let m = read("momentum1", &[rows, dim], cols.clone(), Allowed::Finite)?;
                let v = read("momentum2", &[rows, dim], cols, sums)?;
                (m.chunks_exact(lc).zip(v.chunks_exact(lc)))
                    .flat_map(|(m, v)| m.iter().chain(v))
                    .copied()
                    .collect()
            }
        };
        local.optimizer_state_mut().copy_from_slice(&state);
        Ok(())
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
