//! Checkpoints: one safetensors file, memory-mapped on load, with the tensor
//! names and shapes of TorchRec's DLRM `state_dict`:
//!
//! ```text
//! sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight   [rows, dim]
//! dense_arch.model._mlp.<i>._linear.{weight [out, in], bias [out]}
//! over_arch.model.0._mlp.<i>._linear.{weight, bias}   every top layer but the last
//! over_arch.model.1.{weight, bias}                    the last top layer
//! inter_arch.crossnet.W_kernels.<l> [in, rank], V_kernels.<l> [rank, in], bias.<l> [in]
//! ```
//!
//! Optimizer state sits beside the weights under `optimizer.<weight name
//! without .weight>.<state>`, with FBGEMM's names for the tables
//! (`momentum1`: row-wise Adagrad `[rows]`, Adagrad `[rows, dim]`, Adam's
//! first moment `[rows, dim]`; `momentum2`: Adam's second moment) and
//! torch's for the dense parameters (`sum` for Adagrad, `exp_avg` and
//! `exp_avg_sq` for Adam), e.g. `optimizer.dense_arch.model._mlp.0._linear.weight.exp_avg`.
//! The metadata holds the architecture (`ember.config`, JSON), both
//! optimizers, their step counts and the training position, so `eval` and
//! `predict` need no flags. A file without Ember's metadata (TorchRec's
//! `safetensors.torch.save_file(model.state_dict(), path)`) loads too: the
//! architecture is inferred from the names and shapes.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use ember_dense::{DenseOptimizerConfig, HasParams};
use ember_sharding::RowSplit;
use ember_sparse::{EmbeddingBagConfig, TableOptimizer};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorView, View};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};

use crate::dlrm::{bottom_linear_prefix, top_linear_prefix};
use crate::{Dlrm, DlrmConfig, InteractionType, ModelError};

mod rows;
mod set;
mod state;
pub use set::{remove_set, save_set, INDEX_FILE};
pub use state::{StateDict, StateFile};

/// The file a one-process checkpoint is written to in its directory.
pub const CHECKPOINT_FILE: &str = "model.safetensors";

/// The checkpoint to resume from in `dir`: one file, or the set the ranks
/// of a world wrote; the newer when both are there (a crash between
/// writing one and removing the other). On a world, rank 0 decides for
/// every rank (all ranks call this together).
pub fn latest(
    dir: &Path,
    world: Option<&std::sync::Arc<dyn ember_sharding::Collective>>,
) -> Result<Option<PathBuf>, ModelError> {
    let choose = || {
        let modified = |p: PathBuf| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p));
        [dir.join(INDEX_FILE), dir.join(CHECKPOINT_FILE)]
            .into_iter()
            .filter_map(modified)
            .max_by_key(|(t, _)| *t)
            .map(|(_, p)| p)
    };
    let Some(comm) = world else {
        return Ok(choose());
    };
    let mine = match comm.rank() {
        0 => choose().map_or(Vec::new(), |p| {
            p.to_string_lossy().into_owned().into_bytes()
        }),
        _ => Vec::new(),
    };
    let chosen = comm.broadcast(0, mine)?;
    let chosen = String::from_utf8_lossy(&chosen).into_owned();
    Ok((!chosen.is_empty()).then(|| PathBuf::from(chosen)))
}

/// The prefix of DLRM's table tensors (TorchRec's `EmbeddingBagCollection` in `sparse_arch`).
pub const TABLE_PREFIX: &str = "sparse_arch.embedding_bag_collection.embedding_bags.";
/// The prefix of optimizer-state tensors: a table's state is named
/// `optimizer.<table name without .weight>.<state>` (FBGEMM's `momentum1`,
/// `momentum2`), a dense parameter's `optimizer.<parameter>.<state>`
/// (torch's `sum`, `exp_avg`, `exp_avg_sq`).
pub const OPTIMIZER_PREFIX: &str = "optimizer.";

const META_CONFIG: &str = "ember.config";
const META_TABLE_OPTIMIZER: &str = "ember.table_optimizer";
const META_DENSE_OPTIMIZER: &str = "ember.dense_optimizer";
const META_SPARSE_STEP: &str = "ember.sparse_step";
const META_DENSE_STEPS: &str = "ember.dense_steps";
const META_TRAIN_STATE: &str = "ember.train_state";

/// Where training stood when a checkpoint was written.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainState {
    /// The epoch in progress (0-based).
    pub epoch: u64,
    /// Batches of that epoch already trained on.
    pub batches_in_epoch: u64,
    /// Training steps in all.
    pub steps: u64,
    /// The batch size and shuffling seed the position counts in.
    pub batch_size: u64,
    /// The seed the row groups were shuffled with (`None`: not shuffled).
    pub shuffle_seed: Option<u64>,
    /// How the batches were made, which a resumed run must repeat.
    #[serde(default)]
    pub drop_last: bool,
    /// How raw dense values became model inputs (`None`: not recorded).
    #[serde(default)]
    pub dense_transform: Option<ember_dataloader::DenseTransform>,
    /// How raw ids became table rows (`None`: not recorded).
    #[serde(default)]
    pub id_transform: Option<ember_dataloader::IdTransform>,
    /// `Dataset::fingerprint` of the training data (0: not recorded).
    #[serde(default)]
    pub data_fingerprint: u64,
    /// Ranks the position counts in (each read its own row groups); 0 for
    /// checkpoints from before ranks, which ran in one process.
    #[serde(default)]
    pub world_size: u64,
}

/// Name of table `t`'s weight.
pub fn table_weight_name(table: &str) -> String {
    format!("{}.weight", table_base_name(table))
}

/// A DLRM table's TorchRec name, to which `.weight` and the optimizer
/// state's suffixes are added.
fn table_base_name(table: &str) -> String {
    format!("{TABLE_PREFIX}{table}")
}

/// Names and shapes of the dense parameters of `config`.
pub fn dense_shapes(config: &DlrmConfig) -> BTreeMap<String, Vec<usize>> {
    let mut shapes = BTreeMap::new();
    let mut linear = |prefix: String, inp: usize, out: usize| {
        shapes.insert(format!("{prefix}weight"), vec![out, inp]);
        shapes.insert(format!("{prefix}bias"), vec![out]);
    };
    for (i, w) in config.bottom_mlp.windows(2).enumerate() {
        linear(bottom_linear_prefix(i), w[0], w[1]);
    }
    let top = config.top_mlp_sizes();
    for (i, w) in top.windows(2).enumerate() {
        linear(top_linear_prefix(i, top.len() - 1), w[0], w[1]);
    }
    if let InteractionType::Dcn { layers, rank } = config.interaction {
        let n = (config.num_sparse_features() + 1) * config.embedding_dim();
        for l in 0..layers {
            let p = "inter_arch.crossnet.";
            shapes.insert(format!("{p}W_kernels.{l}"), vec![n, rank]);
            shapes.insert(format!("{p}V_kernels.{l}"), vec![rank, n]);
            shapes.insert(format!("{p}bias.{l}"), vec![n]);
        }
    }
    shapes
}

/// An f32 tensor to write, borrowed where it can be.
struct F32Tensor<'a> {
    shape: Vec<usize>,
    data: Cow<'a, [f32]>,
}

impl View for F32Tensor<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(f32_bytes(&self.data))
    }
    fn data_len(&self) -> usize {
        self.data.len() * 4
    }
}

/// The bytes of `x` in safetensors' (little-endian) layout.
fn f32_bytes(x: &[f32]) -> &[u8] {
    #[cfg(not(target_endian = "little"))]
    compile_error!("checkpoints are written by reinterpreting f32 memory as little-endian");
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the
    // length covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

fn json<T: Serialize>(v: &T) -> String {
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
        let part = TablePart {
            weights: table.weights(),
            state: table.optimizer_state(),
            rows: table.num_embeddings(),
            dim: table.dim(),
        };
        table_tensors(
            &table_base_name(table.name()),
            &part,
            &table_opt,
            &mut tensors,
        );
    }
    write_file(tensors, meta, path)
}

pub(crate) fn fail_at(path: &Path, message: String) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        tensor: None,
        message,
    }
}

/// The metadata every checkpoint carries: architecture, optimizers, steps
/// and the training position.
fn metadata(model: &Dlrm, train: Option<&TrainState>) -> HashMap<String, String> {
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
    ]);
    if let Some(t) = train {
        meta.insert(META_TRAIN_STATE.into(), json(t));
    }
    meta
}

/// The dense parameters and their optimizer state (copied: they are small).
fn dense_tensors(model: &mut Dlrm) -> Result<Vec<(String, F32Tensor<'static>)>, String> {
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
        tensors.push((
            name,
            F32Tensor {
                shape,
                data: Cow::Owned(value),
            },
        ));
    }
    for (name, _, m, v) in dense_state {
        let shape = shapes.get(&name).cloned().unwrap_or_default();
        let (m_name, v_name) = match dense_opt {
            DenseOptimizerConfig::Adam { .. } => ("exp_avg", "exp_avg_sq"),
            _ => ("", "sum"),
        };
        for (state, data) in [(m_name, m), (v_name, v)] {
            if !data.is_empty() {
                let data = Cow::Owned(data);
                let shape = shape.clone();
                tensors.push((
                    format!("{OPTIMIZER_PREFIX}{name}.{state}"),
                    F32Tensor { shape, data },
                ));
            }
        }
    }
    Ok(tensors)
}

/// A table, or the rows and columns of it one shard holds: `rows` x `dim`
/// weights and the optimizer state in the collection's layout.
struct TablePart<'a> {
    weights: &'a [f32],
    state: &'a [f32],
    rows: usize,
    dim: usize,
}

/// The weight and optimizer-state tensors of `part`, under `base` (the
/// table's TorchRec name, without `.weight`).
fn table_tensors<'a>(
    base: &str,
    part: &TablePart<'a>,
    table_opt: &TableOptimizer,
    tensors: &mut Vec<(String, F32Tensor<'a>)>,
) {
    let (rows, dim, state) = (part.rows, part.dim, part.state);
    tensors.push((
        format!("{base}.weight"),
        F32Tensor {
            shape: vec![rows, dim],
            data: Cow::Borrowed(part.weights),
        },
    ));
    let opt_name = |s: &str| format!("{OPTIMIZER_PREFIX}{base}.{s}");
    match table_opt {
        TableOptimizer::None | TableOptimizer::Sgd { .. } => {}
        TableOptimizer::RowWiseAdagrad { .. } => tensors.push((
            opt_name("momentum1"),
            F32Tensor {
                shape: vec![rows],
                data: Cow::Borrowed(state),
            },
        )),
        TableOptimizer::Adagrad { .. } => tensors.push((
            opt_name("momentum1"),
            F32Tensor {
                shape: vec![rows, dim],
                data: Cow::Borrowed(state),
            },
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
                    F32Tensor {
                        shape: vec![rows, dim],
                        data: Cow::Owned(half(k)),
                    },
                ));
            }
        }
    }
}

/// Writes a safetensors file atomically (temporary file, fsync, rename).
fn write_file(
    tensors: Vec<(String, F32Tensor<'_>)>,
    meta: HashMap<String, String>,
    path: &Path,
) -> Result<(), ModelError> {
    let fail = |m: String| fail_at(path, m);
    let name = path
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    let temp = path.with_file_name(format!(".{name}.tmp"));
    let result = (|| {
        safetensors::serialize_to_file(tensors, Some(meta), &temp)
            .map_err(|e| fail(e.to_string()))?;
        File::open(&temp)
            .and_then(|f| f.sync_all())
            .map_err(|e| fail(e.to_string()))?;
        ember_dataloader::writer::commit(&temp, path).map_err(|e| fail(e.to_string()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

/// A checkpoint (one file, or a set of files with an index), mapped and checked.
///
/// [`Checkpoint::open`] reads the architecture and checks every tensor's
/// presence, dtype and shape up front; models are then built from it with
/// the saved weights ([`inference_model`](Checkpoint::inference_model),
/// [`model`](Checkpoint::model), [`model_on_rank`](Checkpoint::model_on_rank)).
///
/// # Example
///
/// Save a small DLRM, open the file and serve it:
///
/// ```
/// use ember_dense::{DenseOptimizerConfig, NativeBackend};
/// use ember_models::{Checkpoint, DataGeneration, Dlrm, DlrmConfig, InteractionType,
///     SyntheticConfig, SyntheticData};
/// use ember_sparse::TableOptimizer;
///
/// let config = DlrmConfig {
///     tables: DlrmConfig::criteo_tables(&[100, 200], 8),
///     bottom_mlp: vec![4, 8],
///     top_mlp: vec![8, 1],
///     interaction: InteractionType::Dot,
/// };
/// let mut model = Dlrm::new(config.clone(), TableOptimizer::rowwise_adagrad(0.05),
///     DenseOptimizerConfig::sgd(0.1), 7)?;
/// let data = SyntheticData::new(SyntheticConfig::for_model(&config, DataGeneration::Learnable, 3, 7))?;
/// let be = NativeBackend::new(1);
/// model.train_step(&be, &data.batch(0, 32))?;
///
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join(ember_models::checkpoint::CHECKPOINT_FILE);
/// ember_models::checkpoint::save(&mut model, &path, None)?;
///
/// let ckpt = Checkpoint::open(&path)?;
/// assert_eq!(ckpt.config(), &config);
/// let mut served = ckpt.inference_model()?;
/// let batch = data.batch(1, 16);
/// let want = model.predict(&be, &batch)?.to_vec();
/// assert_eq!(served.predict(&be, &batch)?, &want[..]);
///
/// drop(ckpt); // unmaps the file
/// dir.close()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Checkpoint {
    path: PathBuf,
    source: Source,
    config: DlrmConfig,
    table_optimizer: Option<TableOptimizer>,
    dense_optimizer: Option<DenseOptimizerConfig>,
    sparse_step: u64,
    dense_steps: u64,
    train_state: Option<TrainState>,
}

/// Where the tensors are.
enum Source {
    File(Mmap),
    /// A set: the index and its files (by name, in `dir`).
    Set {
        dir: PathBuf,
        index: set::Index,
        files: HashMap<String, Mmap>,
    },
}

fn map(path: &Path) -> Result<Mmap, ModelError> {
    let file = File::open(path).map_err(|e| fail_at(path, e.to_string()))?;
    // SAFETY: the map is read-only; a file changed under a running
    // process is outside what a checkpoint reader can defend against.
    unsafe { Mmap::map(&file) }.map_err(|e| fail_at(path, e.to_string()))
}

impl Checkpoint {
    /// Maps `path` (a safetensors file; or a set's index, or a directory
    /// holding one), reads the architecture (from the metadata, or inferred
    /// from TorchRec names) and checks every tensor it needs: present, f32,
    /// and of the right shape.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let fail = |tensor: Option<&str>, message: String| ModelError::Checkpoint {
            path: path.to_path_buf(),
            tensor: tensor.map(str::to_string),
            message,
        };
        let index_path = match path.is_dir() {
            true => Some(path.join(INDEX_FILE)),
            false => (path.to_string_lossy().ends_with(".index.json")).then(|| path.to_path_buf()),
        };
        let (source, meta, path) = match index_path {
            Some(index_path) => {
                let index = set::read_index(&index_path)?;
                let dir = index_path.parent().unwrap_or(Path::new(".")).to_path_buf();
                let mut files = HashMap::new();
                let names = (index.weight_map.values())
                    .chain(index.pieces.values().flatten().map(|p| &p.file));
                for name in names {
                    if !files.contains_key(name) {
                        files.insert(name.clone(), map(&dir.join(name))?);
                    }
                }
                let meta = index.metadata.clone();
                (Source::Set { dir, index, files }, meta, index_path)
            }
            None => {
                let mmap = map(path)?;
                let (_, header) = SafeTensors::read_metadata(&mmap)
                    .map_err(|e| fail(None, format!("not a safetensors file: {e}")))?;
                let meta = header.metadata().clone().unwrap_or_default();
                (Source::File(mmap), meta, path.to_path_buf())
            }
        };
        let path = path.as_path();
        let config: DlrmConfig = match (meta_value(&meta, META_CONFIG, path)?, &source) {
            (Some(c), _) => c,
            (None, Source::File(mmap)) => {
                let tensors = SafeTensors::deserialize(mmap)
                    .map_err(|e| fail(None, format!("not a safetensors file: {e}")))?;
                infer_config(&tensors).map_err(|m| fail(None, m))?
            }
            (None, Source::Set { .. }) => {
                return Err(fail(None, format!("the index has no '{META_CONFIG}'")))
            }
        };
        config.validate().map_err(|e| fail(None, e.to_string()))?;
        let checkpoint = Self {
            path: path.to_path_buf(),
            config,
            table_optimizer: meta_value(&meta, META_TABLE_OPTIMIZER, path)?,
            dense_optimizer: meta_value(&meta, META_DENSE_OPTIMIZER, path)?,
            sparse_step: meta_value(&meta, META_SPARSE_STEP, path)?.unwrap_or(0),
            dense_steps: meta_value(&meta, META_DENSE_STEPS, path)?.unwrap_or(0),
            train_state: meta_value(&meta, META_TRAIN_STATE, path)?,
            source,
        };
        for (name, shape) in checkpoint.expected_tensors() {
            checkpoint.check(&name, &shape)?;
        }
        Ok(checkpoint)
    }

    /// The file it was read from (for a set: its index).
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The architecture: from the metadata, or inferred from the TorchRec
    /// names and shapes.
    pub fn config(&self) -> &DlrmConfig {
        &self.config
    }
    /// The table optimizer it was trained with (`None` for a TorchRec file).
    pub fn table_optimizer(&self) -> Option<TableOptimizer> {
        self.table_optimizer
    }
    /// The dense optimizer it was trained with (`None` for a TorchRec file).
    pub fn dense_optimizer(&self) -> Option<DenseOptimizerConfig> {
        self.dense_optimizer
    }
    /// Where training stood when it was written (`None` when not recorded).
    pub fn train_state(&self) -> Option<&TrainState> {
        self.train_state.as_ref()
    }

    fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut names: Vec<_> = (self.config.tables.iter())
            .map(|t| {
                (
                    table_weight_name(&t.name),
                    vec![t.num_embeddings, t.embedding_dim],
                )
            })
            .collect();
        names.extend(dense_shapes(&self.config));
        names
    }

    /// Checks the named tensor's presence, dtype and shape without reading
    /// its data (for a split tensor: each piece's, and that they add up).
    fn check(&self, name: &str, shape: &[usize]) -> Result<(), ModelError> {
        let Source::Set { index, files, .. } = &self.source else {
            return self.view(name, shape, |_| ());
        };
        let Some(pieces) = index.pieces.get(name) else {
            return self.view(name, shape, |_| ());
        };
        let fail = |message: String| ModelError::Checkpoint {
            path: self.path.clone(),
            tensor: Some(name.to_string()),
            message,
        };
        let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let mut values = 0;
        for p in pieces {
            let want: Vec<usize> = match shape.len() {
                1 => vec![p.rows.count(rows)],
                _ => vec![
                    p.rows.count(rows),
                    p.columns[1].saturating_sub(p.columns[0]),
                ],
            };
            file_view(&files[&p.file], &p.tensor, Some(&want), |_| ())
                .map_err(|m| fail(format!("{}: {m}", p.file)))?;
            values += want.iter().product::<usize>();
        }
        if values != rows * cols {
            return Err(fail(format!(
                "the pieces hold {values} of {} values",
                rows * cols
            )));
        }
        Ok(())
    }

    /// The named tensor as f32 values, checked for dtype and shape.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.view(name, shape, f32s)
    }

    /// `read` applied to the named tensor's bytes, after the checks (a
    /// tensor split over a set's files is put together first).
    fn view<R>(
        &self,
        name: &str,
        shape: &[usize],
        read: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ModelError> {
        let fail = |path: &Path, message: String| ModelError::Checkpoint {
            path: path.to_path_buf(),
            tensor: Some(name.to_string()),
            message,
        };
        match &self.source {
            Source::File(mmap) => file_view(mmap, name, Some(shape), read)
                .map(|(r, _)| r)
                .map_err(|m| fail(&self.path, m)),
            Source::Set { dir, index, files } => {
                if let Some(file) = index.weight_map.get(name) {
                    return file_view(&files[file], name, Some(shape), read)
                        .map(|(r, _)| r)
                        .map_err(|m| fail(&dir.join(file), m));
                }
                let cols = shape.get(1).copied().unwrap_or(1);
                let values = self.rows_of(name, shape, RowSplit::All, 0..cols)?;
                Ok(read(f32_bytes(&values)))
            }
        }
    }

    /// A model for inference: the saved weights, no optimizer.
    pub fn inference_model(&self) -> Result<Dlrm, ModelError> {
        self.model(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
    }

    /// The model with the saved weights and the given optimizers; the saved
    /// optimizer state and step counts are restored where the saved
    /// optimizer is of the same kind (so training resumes exactly).
    pub fn model(
        &self,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
    ) -> Result<Dlrm, ModelError> {
        let mut model = Dlrm::new(self.config.clone(), table_optimizer, dense_optimizer, 0)?;
        let same_table_opt = self.same_table_optimizer(&table_optimizer);
        let ebc = model
            .sparse_arch_mut()
            .local_mut()
            .expect("a new model holds its tables in one collection");
        for table in ebc.tables_mut() {
            let config = table.config().clone();
            let all = (RowSplit::All, 0..config.embedding_dim);
            self.read_table(&config, all, (table_optimizer, same_table_opt), table)?;
        }
        if same_table_opt {
            ebc.set_step(self.sparse_step);
        }
        self.restore_dense(&mut model, dense_optimizer)?;
        Ok(model)
    }

    /// The saved table optimizer is of `table_optimizer`'s kind, so its
    /// state and step count carry over.
    fn same_table_optimizer(&self, table_optimizer: &TableOptimizer) -> bool {
        self.table_optimizer
            .is_some_and(|o| same_kind(&o, table_optimizer))
    }

    /// The dense parameters, and the dense optimizer's state when it is of
    /// the saved kind.
    fn restore_dense(
        &self,
        model: &mut Dlrm,
        dense_optimizer: DenseOptimizerConfig,
    ) -> Result<(), ModelError> {
        let shapes = dense_shapes(&self.config);
        for p in model.dense_arch_mut().params() {
            let w = self.tensor(&p.name, &shapes[&p.name])?;
            p.value.copy_from_slice(&w);
        }
        let same_dense_opt = self.dense_optimizer.is_some_and(|o| {
            std::mem::discriminant(&o) == std::mem::discriminant(&dense_optimizer)
        });
        if same_dense_opt && self.dense_steps > 0 {
            let (m_name, v_name) = match dense_optimizer {
                DenseOptimizerConfig::Adam { .. } => (Some("exp_avg"), Some("exp_avg_sq")),
                DenseOptimizerConfig::Adagrad { .. } => (None, Some("sum")),
                DenseOptimizerConfig::Sgd { .. } => (None, None),
            };
            let mut state = Vec::new();
            for p in model.dense_arch_mut().params() {
                let shape = &shapes[&p.name];
                let load = |s: Option<&str>| match s {
                    Some(s) => self.tensor(&format!("{OPTIMIZER_PREFIX}{}.{s}", p.name), shape),
                    None => Ok(Vec::new()),
                };
                state.push((p.name.clone(), p.value.len(), load(m_name)?, load(v_name)?));
            }
            model
                .dense_optimizer_mut()
                .set_state(self.dense_steps, state);
        }
        Ok(())
    }
}

/// `read` applied to a tensor of one mapped file, after checking its dtype
/// and (when given) its shape; with no shape to check, the tensor's shape
/// comes back with the result.
fn file_view<R>(
    mmap: &Mmap,
    name: &str,
    shape: Option<&[usize]>,
    read: impl FnOnce(&[u8]) -> R,
) -> Result<(R, Vec<usize>), String> {
    let tensors = SafeTensors::deserialize(mmap).map_err(|e| e.to_string())?;
    let view: TensorView = tensors.tensor(name).map_err(|_| "missing".to_string())?;
    if view.dtype() != Dtype::F32 {
        return Err(format!("dtype {:?}, expected F32", view.dtype()));
    }
    if let Some(shape) = shape {
        if view.shape() != shape {
            return Err(format!("shape {:?}, expected {shape:?}", view.shape()));
        }
    }
    Ok((read(view.data()), view.shape().to_vec()))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    (bytes.chunks_exact(4))
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A JSON value of the metadata, if present.
fn meta_value<T: serde::de::DeserializeOwned>(
    meta: &HashMap<String, String>,
    key: &str,
    path: &Path,
) -> Result<Option<T>, ModelError> {
    (meta.get(key).map(|s| serde_json::from_str(s)))
        .transpose()
        .map_err(|e| ModelError::Checkpoint {
            path: path.to_path_buf(),
            tensor: None,
            message: format!("metadata '{key}': {e}"),
        })
}

fn same_kind(a: &TableOptimizer, b: &TableOptimizer) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

/// Orders `t_cat_2` before `t_cat_10`: digit runs compare as numbers.
fn natural_key(s: &str) -> Vec<(String, u64)> {
    let mut key = Vec::new();
    let mut text = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            let mut n = c.to_digit(10).unwrap_or(0) as u64;
            while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                n = n.saturating_mul(10).saturating_add(d as u64);
                chars.next();
            }
            key.push((std::mem::take(&mut text), n));
        } else {
            text.push(c);
        }
    }
    key.push((text, u64::MAX));
    key
}

/// The architecture of a TorchRec DLRM `state_dict` from its names and shapes.
fn infer_config(tensors: &SafeTensors) -> Result<DlrmConfig, String> {
    let shape = |name: &str| tensors.tensor(name).ok().map(|t| t.shape().to_vec());
    let mut tables: Vec<(String, Vec<usize>)> = (tensors.names().into_iter())
        .filter_map(|n| {
            let table = n.strip_prefix(TABLE_PREFIX)?.strip_suffix(".weight")?;
            Some((table.to_string(), shape(n)?))
        })
        .collect();
    if tables.is_empty() {
        return Err(format!(
            "no Ember metadata and no {TABLE_PREFIX}<table>.weight tensors: not a DLRM checkpoint"
        ));
    }
    tables.sort_by_key(|(t, _)| natural_key(t));
    let tables = (tables.into_iter())
        .map(|(name, s)| match s[..] {
            [rows, dim] => {
                let feature = name.strip_prefix("t_").unwrap_or(&name).to_string();
                Ok(EmbeddingBagConfig::new(&name, rows, dim, &[&feature]))
            }
            _ => Err(format!(
                "tensor '{}': shape {s:?}, expected [rows, dim]",
                table_weight_name(&name)
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    // An MLP's sizes from consecutive `<prefix><i>._linear.weight` [out, in].
    let mlp = |prefix: &str| -> Vec<[usize; 2]> {
        (0..)
            .map_while(|i| shape(&format!("{prefix}{i}._linear.weight")))
            .filter_map(|s| <[usize; 2]>::try_from(s).ok())
            .collect()
    };
    let bottom = mlp("dense_arch.model._mlp.");
    let Some(first) = bottom.first() else {
        return Err("no dense_arch.model._mlp.0._linear.weight tensor".into());
    };
    let mut bottom_mlp = vec![first[1]];
    bottom_mlp.extend(bottom.iter().map(|s| s[0]));
    let mut top_mlp: Vec<usize> = mlp("over_arch.model.0._mlp.")
        .iter()
        .map(|s| s[0])
        .collect();
    match shape("over_arch.model.1.weight").as_deref() {
        Some(&[out, _]) => top_mlp.push(out),
        _ => return Err("no over_arch.model.1.weight [1, in] tensor".into()),
    }
    let layers = (0..)
        .take_while(|l| shape(&format!("inter_arch.crossnet.W_kernels.{l}")).is_some())
        .count();
    let interaction = match shape("inter_arch.crossnet.W_kernels.0").as_deref() {
        Some(&[_, rank]) => InteractionType::Dcn { layers, rank },
        _ => InteractionType::Dot,
    };
    Ok(DlrmConfig {
        tables,
        bottom_mlp,
        top_mlp,
        interaction,
    })
}
