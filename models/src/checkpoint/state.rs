//! Checkpoints of any model: its state as named tensors in one safetensors
//! file ([`StateDict`] out, [`StateFile`] in), in the naming scheme DLRM's
//! checkpoints use, so a user's model built from Ember's parts saves and
//! restores them the way DLRM does:
//!
//! ```text
//! <prefix>embedding_bags.<table>.weight                     [rows, dim]
//! optimizer.<prefix>embedding_bags.<table>.momentum1|2      FBGEMM's table state
//! <param name>                                              dense parameters, torch shapes
//! optimizer.<param name>.exp_avg|exp_avg_sq|sum             torch's dense optimizer state
//! ```
//!
//! Step counts (the tables' and each dense optimizer's) and the training
//! position travel in the metadata.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ember_dense::{DenseOptimizer, DenseOptimizerConfig, Module, Param};
use ember_sharding::RowSplit;
use ember_sparse::{EmbeddingBagCollection, EmbeddingCollection, EmbeddingTable, TableOptimizer};
use memmap2::Mmap;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

use super::kv::{add_kv_named, map_names, read_map, ReadBytes};
use super::names::weight_layout;
use super::read::meta_value;
use super::store::{f32s, file_view, map, Checksums};
use super::valid::{check_rows, check_values, Allowed};
use super::write::{fail_at, json, table_tensors, write_file, SavedTable, Tensor};
use super::{TrainState, CHECKPOINT_FILE, META_TRAIN_STATE, OPTIMIZER_PREFIX};
use crate::ModelError;

/// A model's state on its way to a file: named f32 tensors (borrowed where
/// they can be) and metadata.
#[derive(Default)]
pub struct StateDict<'a> {
    tensors: Vec<(String, Tensor<'a>)>,
    metadata: HashMap<String, String>,
}

/// The metadata key of the step count of the tables under `prefix`.
fn table_step_key(prefix: &str) -> String {
    format!("ember.table_step.{prefix}")
}

/// The metadata key of the step count of the dense optimizer under `prefix`.
fn dense_steps_key(prefix: &str) -> String {
    format!("ember.dense_steps.{prefix}")
}

/// torch's names of a dense optimizer's two state tensors (empty: unused).
fn dense_state_names(config: &DenseOptimizerConfig) -> [&'static str; 2] {
    match config {
        DenseOptimizerConfig::Adam { .. } => ["exp_avg", "exp_avg_sq"],
        DenseOptimizerConfig::Adagrad { .. } => ["", "sum"],
        DenseOptimizerConfig::Sgd { .. } => ["", ""],
    }
}

impl<'a> StateDict<'a> {
    /// An empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one tensor; `data` holds `shape`'s product of values.
    pub fn push(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        data: impl Into<Cow<'a, [f32]>>,
    ) -> &mut Self {
        let data = data.into();
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        let shape = shape.to_vec();
        self.tensors.push((name.into(), Tensor::f32(shape, data)));
        self
    }

    /// Adds a metadata entry (a string; JSON for structured values).
    pub fn metadata(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// Adds dense parameters (copied) under `prefix` + their names, in their
    /// shapes.
    pub fn add_params(&mut self, prefix: &str, params: Vec<Param<'_, f32>>) -> &mut Self {
        for p in params {
            self.push(format!("{prefix}{}", p.name), &p.shape, p.value.to_vec());
        }
        self
    }

    /// Adds dense parameters (copied) and `optimizer`'s state for them, as
    /// [`add_params`](Self::add_params) and
    /// [`add_dense_optimizer`](Self::add_dense_optimizer) from one list;
    /// [`StateFile::load_trained`] reads both back.
    pub fn add_trained(
        &mut self,
        prefix: &str,
        optimizer: &DenseOptimizer<f32>,
        params: Vec<Param<'_, f32>>,
    ) -> &mut Self {
        for p in &params {
            self.push(format!("{prefix}{}", p.name), &p.shape, p.value.to_vec());
        }
        self.add_dense_optimizer(prefix, optimizer, params)
    }

    /// Adds a module's parameters (borrowed, not copied) under `prefix` +
    /// their names, in their shapes.
    pub fn add_module<M: Module<f32> + ?Sized>(
        &mut self,
        prefix: &str,
        module: &'a M,
    ) -> &mut Self {
        for p in module.param_views() {
            self.push(format!("{prefix}{}", p.name), &p.shape, p.value);
        }
        self
    }

    /// Adds a dense optimizer's state for the parameters it updates, under
    /// `optimizer.<prefix><name>.<state>`, and its step count.
    pub fn add_dense_optimizer(
        &mut self,
        prefix: &str,
        optimizer: &DenseOptimizer<f32>,
        params: Vec<Param<'_, f32>>,
    ) -> &mut Self {
        let shapes: HashMap<String, Vec<usize>> =
            params.into_iter().map(|p| (p.name, p.shape)).collect();
        let names = dense_state_names(&optimizer.config());
        for (name, len, m, v) in optimizer.state() {
            let shape = shapes.get(name).cloned().unwrap_or(vec![len]);
            for (state, data) in names.iter().zip([m, v]) {
                if !state.is_empty() && !data.is_empty() {
                    let key = format!("{OPTIMIZER_PREFIX}{prefix}{name}.{state}");
                    self.push(key, &shape, data.to_vec());
                }
            }
        }
        self.metadata(dense_steps_key(prefix), optimizer.steps().to_string())
    }

    /// Adds every table of `ebc` (weights borrowed) and its optimizer state
    /// under `<prefix>embedding_bags.<table>`, and the tables' step count.
    pub fn add_collection(&mut self, prefix: &str, ebc: &'a EmbeddingBagCollection) -> &mut Self {
        let tables = (ebc.tables(), ebc.optimizer(), ebc.step());
        self.add_tables(&format!("{prefix}embedding_bags."), prefix, tables)
    }

    /// Adds every table of an [`EmbeddingCollection`] and its optimizer
    /// state under `<prefix>embeddings.<table>` (TorchRec's names for an
    /// `EmbeddingCollection`), and the tables' step count.
    pub fn add_embedding_collection(
        &mut self,
        prefix: &str,
        ec: &'a EmbeddingCollection,
    ) -> &mut Self {
        let tables = (ec.tables(), ec.optimizer(), ec.step());
        self.add_tables(&format!("{prefix}embeddings."), prefix, tables)
    }

    /// Tables under `<names><table>`, their step count under `prefix`.
    fn add_tables(
        &mut self,
        names: &str,
        prefix: &str,
        (tables, optimizer, step): (&'a [EmbeddingTable], &TableOptimizer, u64),
    ) -> &mut Self {
        for table in tables {
            let name = format!("{names}{}", table.name());
            table_tensors(&name, &SavedTable::of(table), optimizer, &mut self.tensors);
            // A key-value table's map beside it, keyed by its full name.
            add_kv_named((&name, &name), table, &mut self.tensors, &mut self.metadata);
        }
        self.metadata(table_step_key(prefix), step.to_string())
    }

    /// Writes the state into `dir` (made if missing) as its one-process
    /// checkpoint file, [`CHECKPOINT_FILE`]; returns the file's path. What a
    /// [`Model::save_checkpoint`](crate::Model::save_checkpoint) of a user's model does.
    pub fn save_in(self, dir: &Path, train: Option<&TrainState>) -> Result<PathBuf, ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| fail_at(dir, e.to_string()))?;
        let path = dir.join(CHECKPOINT_FILE);
        self.save(&path, train)?;
        Ok(path)
    }

    /// Writes the state (and the training position, when given) to `path`
    /// atomically: a temporary file, fsynced, then renamed.
    pub fn save(mut self, path: &Path, train: Option<&TrainState>) -> Result<(), ModelError> {
        self.metadata.insert("format".into(), "pt".into());
        if let Some(t) = train {
            self.metadata.insert(META_TRAIN_STATE.into(), json(t));
        }
        write_file(self.tensors, self.metadata, path).map(|_| ())
    }
}

/// A state written by [`StateDict::save`] (or any safetensors file of f32
/// tensors), memory-mapped; tensors are read by name and checked for shape.
pub struct StateFile {
    path: PathBuf,
    mmap: Mmap,
    metadata: HashMap<String, String>,
    checksums: Checksums,
}

impl StateFile {
    /// Maps `path` and reads its metadata.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let mmap = map(path)?;
        let (_, header) = SafeTensors::read_metadata(&mmap)
            .map_err(|e| fail_at(path, format!("not a safetensors file: {e}")))?;
        let metadata = header.metadata().clone().unwrap_or_default();
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            checksums: Checksums::of(&header, path)?,
            metadata,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata entry.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    /// Where training stood when the file was written, if it says.
    pub fn train_state(&self) -> Result<Option<TrainState>, ModelError> {
        meta_value(&self.metadata, META_TRAIN_STATE, &self.path)
    }

    /// The named tensor's values as f32: an F32 tensor as it is, an F16
    /// or BF16 one (an fp16 or bf16 table's weight) widened exactly. It
    /// must have `shape`; any values (a user's tensor may hold infinities
    /// on purpose).
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let dtype = match SafeTensors::deserialize(&self.mmap).map(|t| t.tensor(name)) {
            Ok(Ok(view)) => view.dtype(),
            _ => Dtype::F32,
        };
        let bytes = match dtype {
            Dtype::F16 | Dtype::BF16 => self.bytes(name, dtype, shape)?,
            _ => return self.bytes(name, Dtype::F32, shape).map(|b| f32s(&b)),
        };
        let halves = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]));
        Ok(match dtype {
            Dtype::F16 => halves
                .map(|h| ember_sparse::f16::from_bits(h).to_f32())
                .collect(),
            _ => halves
                .map(|h| ember_sparse::bf16::from_bits(h).to_f32())
                .collect(),
        })
    }

    /// [`tensor`](Self::tensor) of parameters or optimizer state, whose
    /// values must be `allowed`.
    fn checked(
        &self,
        name: &str,
        shape: &[usize],
        allowed: Allowed,
    ) -> Result<Vec<f32>, ModelError> {
        let values = f32s(&self.bytes(name, Dtype::F32, shape)?);
        let width = shape.get(1).copied().unwrap_or(1);
        check_values(&values, width, (RowSplit::All, 0), allowed)
            .map_err(|message| self.fail_on(name, message))?;
        Ok(values)
    }

    fn fail_on(&self, name: &str, message: String) -> ModelError {
        ModelError::Checkpoint {
            path: self.path.clone(),
            tensor: Some(name.to_string()),
            message,
        }
    }

    /// The named tensor's bytes, which must be of `dtype` and `shape`.
    fn bytes(&self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<Vec<u8>, ModelError> {
        file_view(
            &self.mmap,
            name,
            dtype,
            Some(shape),
            Some(&self.checksums),
            |b| b.to_vec(),
        )
        .map(|(v, _)| v)
        .map_err(|message| self.fail_on(name, message))
    }

    /// A step count saved in the metadata (0 when absent).
    fn steps(&self, key: &str) -> Result<u64, ModelError> {
        Ok(meta_value(&self.metadata, key, &self.path)?.unwrap_or(0))
    }

    /// Reads dense parameters saved by [`StateDict::add_params`] into `params`.
    pub fn load_params(&self, prefix: &str, params: Vec<Param<'_, f32>>) -> Result<(), ModelError> {
        for p in params {
            let values = self.checked(&format!("{prefix}{}", p.name), &p.shape, Allowed::Finite)?;
            p.value.copy_from_slice(&values);
        }
        Ok(())
    }

    /// Reads dense parameters and their optimizer's state saved by
    /// [`StateDict::add_trained`].
    pub fn load_trained(
        &self,
        prefix: &str,
        optimizer: &mut DenseOptimizer<f32>,
        mut params: Vec<Param<'_, f32>>,
    ) -> Result<(), ModelError> {
        for p in &mut params {
            let values = self.checked(&format!("{prefix}{}", p.name), &p.shape, Allowed::Finite)?;
            p.value.copy_from_slice(&values);
        }
        self.load_dense_optimizer(prefix, optimizer, params)
    }

    /// Restores a dense optimizer saved by [`StateDict::add_dense_optimizer`]
    /// for `params` (nothing before its first step).
    pub fn load_dense_optimizer(
        &self,
        prefix: &str,
        optimizer: &mut DenseOptimizer<f32>,
        params: Vec<Param<'_, f32>>,
    ) -> Result<(), ModelError> {
        let steps = self.steps(&dense_steps_key(prefix))?;
        if steps == 0 {
            return Ok(());
        }
        let names = dense_state_names(&optimizer.config());
        let mut state = Vec::with_capacity(params.len());
        for p in params {
            let load = |s: &str, allowed| match s.is_empty() {
                true => Ok(Vec::new()),
                false => self.checked(
                    &format!("{OPTIMIZER_PREFIX}{prefix}{}.{s}", p.name),
                    &p.shape,
                    allowed,
                ),
            };
            state.push((
                p.name.clone(),
                p.value.len(),
                load(names[0], Allowed::Finite)?,
                load(names[1], Allowed::NonNegative)?,
            ));
        }
        optimizer.set_state(steps, state);
        Ok(())
    }

    /// Reads the tables saved by [`StateDict::add_collection`] into `ebc`:
    /// weights, and the optimizer state and step count when the saved
    /// optimizer is of the collection's kind. Tables of any type and tier
    /// load: the weights go from the mapped file to the table a piece of
    /// rows at a time (a disk-tier table's to its file), so they are never
    /// copied whole.
    pub fn load_collection(
        &self,
        prefix: &str,
        ebc: &mut EmbeddingBagCollection,
    ) -> Result<(), ModelError> {
        let optimizer = *ebc.optimizer();
        let names = format!("{prefix}embedding_bags.");
        self.load_tables(&names, ebc.tables_mut(), optimizer)?;
        ebc.set_step(self.steps(&table_step_key(prefix))?);
        Ok(())
    }

    /// Reads the tables saved by [`StateDict::add_embedding_collection`]
    /// into `ec`, as [`load_collection`](Self::load_collection) does.
    pub fn load_embedding_collection(
        &self,
        prefix: &str,
        ec: &mut EmbeddingCollection,
    ) -> Result<(), ModelError> {
        let optimizer = *ec.optimizer();
        let names = format!("{prefix}embeddings.");
        self.load_tables(&names, ec.tables_mut(), optimizer)?;
        ec.set_step(self.steps(&table_step_key(prefix))?);
        Ok(())
    }

    /// Tables saved under `<names><table>`, with `optimizer`'s state.
    fn load_tables(
        &self,
        names: &str,
        tables: &mut [EmbeddingTable],
        optimizer: TableOptimizer,
    ) -> Result<(), ModelError> {
        for table in tables {
            // A key-value table's map, read (and checked) first, loaded
            // once its rows are.
            let map = match table.is_key_value() {
                true => {
                    let name = format!("{names}{}", table.name());
                    let read = |n: &str, dtype, len| self.bytes(n, dtype, &[len]);
                    let from = (&read as &ReadBytes, &self.metadata, self.path.as_path());
                    let sizes = (table.num_embeddings() - 1, table.kv_sketch_len());
                    Some((read_map(from, (map_names(&name), &name), sizes)?, name))
                }
                false => None,
            };
            let (rows, dim) = (table.num_embeddings(), table.dim());
            let name = format!("{names}{}", table.name());
            let (dtype, shape) = weight_layout(table.data_type(), rows, dim);
            let weight = format!("{name}.weight");
            let state = |s: &str, shape: &[usize], allowed| {
                self.checked(&format!("{OPTIMIZER_PREFIX}{name}.{s}"), shape, allowed)
            };
            let sums = Allowed::NonNegative;
            let restored = match optimizer {
                TableOptimizer::None | TableOptimizer::Sgd { .. } => Vec::new(),
                TableOptimizer::RowWiseAdagrad { .. } => state("momentum1", &[rows], sums)?,
                TableOptimizer::Adagrad { .. } => state("momentum1", &[rows, dim], sums)?,
                TableOptimizer::Adam { .. } => {
                    let (m, v) = (
                        state("momentum1", &[rows, dim], Allowed::Finite)?,
                        state("momentum2", &[rows, dim], sums)?,
                    );
                    (m.chunks_exact(dim.max(1)).zip(v.chunks_exact(dim.max(1))))
                        .flat_map(|(m, v)| m.iter().chain(v))
                        .copied()
                        .collect()
                }
            };
            let (stride, per_row) = (table.bytes_per_row(), table.state_floats_per_row());
            // About 8 MiB of rows a piece.
            let piece = ((8 << 20) / stride.max(1)).max(1);
            let write = |w: &[u8]| -> Result<(), ModelError> {
                check_rows(table.data_type(), w, dim, (RowSplit::All, 0))
                    .map_err(|m| self.fail_on(&weight, m))?;
                for first in (0..rows).step_by(piece) {
                    let n = piece.min(rows - first);
                    let state = match restored.is_empty() {
                        true => &[][..],
                        false => &restored[first * per_row..(first + n) * per_row],
                    };
                    let bytes = &w[first * stride..(first + n) * stride];
                    (table.write_stored_rows(first, bytes, state))
                        .map_err(|e| self.fail_on(&weight, e.to_string()))?;
                }
                Ok(())
            };
            let sums = Some(&self.checksums);
            file_view(&self.mmap, &weight, dtype, Some(&shape), sums, write)
                .map_err(|m| self.fail_on(&weight, m))?
                .0?;
            if let Some((state, name)) = map {
                (table.load_kv_state(state)).map_err(|e| self.fail_on(&name, e.to_string()))?;
            }
        }
        Ok(())
    }
}
