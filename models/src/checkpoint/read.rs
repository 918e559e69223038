//! Reading checkpoints: [`Checkpoint`] opens one file, a set or in-memory
//! bytes through a [`TensorStore`], checks it and builds models from it.

use std::collections::HashMap;
use std::path::Path;

use ember_dataloader::DatasetSpec;
use ember_dense::{DenseOptimizerConfig, HasParams};
use ember_sharding::RowSplit;
use ember_sparse::{DataType, EmbeddingBagCollection, TableOptimizer};
use safetensors::tensor::Dtype;

use super::chain::{Chain, ChainHead};
use super::names::{dense_shapes, infer_config, table_weight_name, weight_layout};
use super::store::{f32s, InMemory, MappedFile, SetStore, TensorStore};
use super::valid::{check_values, Allowed};
use super::{
    TrainState, CHECKPOINT_FILE, INDEX_FILE, META_CONFIG, META_DATASET_SPEC, META_DENSE_OPTIMIZER,
    META_DENSE_STEPS, META_ROUNDING_SEED, META_SPARSE_STEP, META_TABLE_OPTIMIZER, META_TRAIN_STATE,
    OPTIMIZER_PREFIX,
};
use crate::sparse_arch::SparseArch;
use crate::{Dlrm, DlrmConfig, ModelError};

/// A checkpoint (one file, or a set of files with an index), mapped and checked.
///
/// [`Checkpoint::open`] reads the architecture and checks every tensor's
/// presence, dtype and shape up front; models are then built from it with
/// the saved weights ([`inference_model`](Checkpoint::inference_model), or
/// any placement through [`builder`](Checkpoint::builder)).
///
/// # Example
///
/// Save a small DLRM, open the file and serve it:
///
/// ```
/// use ember_dense::DenseOptimizerConfig;
/// use ember_models::{Backend, Checkpoint, DataGeneration, Dlrm, DlrmConfig, ExecMode,
///     InteractionType, Model, SyntheticConfig, SyntheticData};
/// use ember_sparse::TableOptimizer;
///
/// let config = DlrmConfig {
///     tables: DlrmConfig::criteo_tables(&[100, 200], 8),
///     bottom_mlp: vec![4, 8],
///     top_mlp: vec![8, 1],
///     interaction: InteractionType::Dot,
/// };
/// let mut model = Dlrm::builder(config.clone())
///     .optimizers(TableOptimizer::rowwise_adagrad(0.05), DenseOptimizerConfig::sgd(0.1))
///     .seed(7)
///     .build()?;
/// let data = SyntheticData::new(SyntheticConfig::for_model(&config, DataGeneration::Learnable, 3, 7))?;
/// let be = Backend::native();
/// model.train_step(&be, &data.batch(0, 32), ExecMode::Strict)?;
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
    /// Where the tensors are.
    pub(super) store: Box<dyn TensorStore>,
    pub(super) config: DlrmConfig,
    pub(super) table_optimizer: Option<TableOptimizer>,
    pub(super) dense_optimizer: Option<DenseOptimizerConfig>,
    pub(super) sparse_step: u64,
    pub(super) dense_steps: u64,
    pub(super) train_state: Option<TrainState>,
    pub(super) rounding_seed: u64,
    /// The dataset spec the model was trained on (`None`: not recorded).
    pub(super) dataset_spec: Option<DatasetSpec>,
    /// Each table's data type in the file (`config` holds the type the
    /// models get, which [`cast_tables`](Checkpoint::cast_tables) may change).
    pub(super) stored: Vec<DataType>,
    /// The delta checkpoints read over the full file, in order (the
    /// metadata and dense weights are the last one's).
    pub(super) deltas: Vec<Box<dyn TensorStore>>,
    /// The chain a model built from here continues (a full file or a
    /// delta in its directory).
    pub(super) chain_head: Option<ChainHead>,
}

impl Checkpoint {
    /// Maps `path` and reads the architecture (from the metadata, or
    /// inferred from TorchRec names), checking every tensor of the full
    /// file it needs: present, of its dtype and of the right shape. `path`
    /// is a safetensors file (`model.safetensors`: that file alone); a
    /// set's index; a delta checkpoint (its chain read up to it, over its
    /// full file: a delta's table tensors are checked as the model is
    /// built); or a directory holding any of them, as a run's
    /// `--checkpoint-dir`: its [`latest`](super::latest) state.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = match path.is_dir() {
            // A run's checkpoint directory: its newer checkpoint, a set or a chain.
            true => super::latest(path, None)?.ok_or_else(|| {
                super::fail_at(
                    path,
                    format!("no checkpoint in this directory (looked for {INDEX_FILE} and {CHECKPOINT_FILE})"),
                )
            })?,
            false => path.to_path_buf(),
        };
        if file.to_string_lossy().ends_with(".index.json") {
            return Self::from_store(Box::new(SetStore::open(&file)?), Vec::new(), path);
        }
        // `model.safetensors` alone has the parent "".
        let dir = (file.parent())
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let Some(sequence) = super::chain::delta_sequence(name) else {
            // A full file alone; the head of a chain when it is a run's.
            let store = MappedFile::open(&file)?;
            let identity = super::chain::identity(store.metadata());
            let mut checkpoint = Self::from_store(Box::new(store), Vec::new(), path)?;
            checkpoint.chain_head =
                identity
                    .filter(|_| name == CHECKPOINT_FILE)
                    .map(|id| ChainHead {
                        dir: dir.to_path_buf(),
                        base: id,
                        tail: id,
                        sequence: 0,
                    });
            return Ok(checkpoint);
        };
        let mut chain = Chain::read(dir, Some(sequence))?.ok_or_else(|| {
            super::fail_at(
                &file,
                format!("a delta checkpoint without its full file {CHECKPOINT_FILE} beside it"),
            )
        })?;
        if chain.deltas.len() < sequence as usize {
            return Err(super::fail_at(
                &file,
                format!(
                    "not in the delta chain of {}: it builds on another full checkpoint",
                    chain.base.display()
                ),
            ));
        }
        chain.deltas.truncate(sequence as usize);
        let head = chain.head(dir);
        let deltas = (chain.deltas.into_iter())
            .map(|(f, _)| Box::new(f) as Box<dyn TensorStore>)
            .collect();
        let mut checkpoint =
            Self::from_store(Box::new(MappedFile::open(&chain.base)?), deltas, path)?;
        checkpoint.chain_head = Some(head);
        Ok(checkpoint)
    }

    /// [`Checkpoint::open`] for a single file's bytes already in memory
    /// (fetched from object storage, embedded in a binary): the same
    /// checks and the same models, with `name` in errors in place of a
    /// path, and [`path`](Checkpoint::path) returning it.
    ///
    /// ```
    /// # use ember_models::Checkpoint;
    /// let error = Checkpoint::from_bytes(b"not safetensors".to_vec(), "upload").err().unwrap();
    /// assert!(error.to_string().contains("upload"));
    /// ```
    pub fn from_bytes(bytes: Vec<u8>, name: &str) -> Result<Self, ModelError> {
        let name = Path::new(name);
        Self::from_store(Box::new(InMemory::new(bytes, name)?), Vec::new(), name)
    }

    /// Reads the architecture and checks every tensor it needs; `opened` is
    /// what the caller named (a set's directory, say), for errors before
    /// the tensors are looked at.
    fn from_store(
        store: Box<dyn TensorStore>,
        deltas: Vec<Box<dyn TensorStore>>,
        opened: &Path,
    ) -> Result<Self, ModelError> {
        let fail = |message: String| ModelError::Checkpoint {
            path: opened.to_path_buf(),
            tensor: None,
            message,
        };
        // The chain's last file says where it stands.
        let last = deltas.last().unwrap_or(&store);
        let (meta, path) = (last.metadata(), last.path());
        let config: DlrmConfig = match (meta_value(meta, META_CONFIG, path)?, store.shapes()) {
            (Some(c), _) => c,
            (None, Some(shapes)) => infer_config(shapes).map_err(fail)?,
            // A set's index lists no shapes.
            (None, None) => return Err(fail(format!("the index has no '{META_CONFIG}'"))),
        };
        config.validate().map_err(|e| fail(e.to_string()))?;
        let chain = deltas.iter().map(AsRef::as_ref).chain([store.as_ref()]);
        for file in chain.filter(|_| !deltas.is_empty()) {
            let other: Option<DlrmConfig> = meta_value(file.metadata(), META_CONFIG, file.path())?;
            if other.as_ref() != Some(&config) {
                return Err(super::fail_at(
                    file.path(),
                    "holds another architecture than the rest of its delta chain".into(),
                ));
            }
        }
        let stored = config.tables.iter().map(|t| t.data_type).collect();
        let checkpoint = Self {
            config,
            table_optimizer: meta_value(meta, META_TABLE_OPTIMIZER, path)?,
            dense_optimizer: meta_value(meta, META_DENSE_OPTIMIZER, path)?,
            sparse_step: meta_value(meta, META_SPARSE_STEP, path)?.unwrap_or(0),
            dense_steps: meta_value(meta, META_DENSE_STEPS, path)?.unwrap_or(0),
            train_state: meta_value(meta, META_TRAIN_STATE, path)?,
            rounding_seed: meta_value(meta, META_ROUNDING_SEED, path)?.unwrap_or(0),
            dataset_spec: meta_value(meta, META_DATASET_SPEC, path)?,
            stored,
            store,
            deltas,
            chain_head: None,
        };
        let (tables, dense) = checkpoint.expected_tensors();
        for (name, dtype, shape) in tables {
            checkpoint.store.check(&name, dtype, &shape)?;
        }
        for (name, dtype, shape) in dense {
            checkpoint.dense_store().check(&name, dtype, &shape)?;
        }
        Ok(checkpoint)
    }

    /// Makes the models built from here hold every table in `dtype`, the
    /// saved rows converted as they are read (to the nearest value, or
    /// quantized); returns the tables whose type this changes, with their
    /// saved type. A quantized type makes inference models (no table
    /// optimizer). The file is not touched.
    pub fn cast_tables(&mut self, dtype: DataType) -> Vec<(String, DataType)> {
        let mut changed = Vec::new();
        for (table, &saved) in self.config.tables.iter_mut().zip(&self.stored) {
            if saved != dtype {
                changed.push((table.name.clone(), saved));
            }
            table.data_type = dtype;
        }
        changed
    }

    /// The file it was read from (for a set: its index).
    pub fn path(&self) -> &Path {
        self.store.path()
    }

    /// Every file it reads: the one file, or a set's index and each rank's
    /// file. A command writing beside a checkpoint refuses to write any of
    /// them ([`ember_dataloader::atomic::same_file`]).
    pub fn files(&self) -> Vec<std::path::PathBuf> {
        let mut files = self.store.files();
        files.extend(self.deltas.iter().flat_map(|d| d.files()));
        files
    }

    /// The file whose state this is: the last delta of a chain, else
    /// [`path`](Self::path).
    pub fn last_file(&self) -> &Path {
        self.dense_store().path()
    }

    /// Delta checkpoints read over the full file (0: one file, or a set).
    pub fn delta_count(&self) -> usize {
        self.deltas.len()
    }
    /// The architecture: from the metadata, or inferred from the TorchRec
    /// names and shapes.
    pub fn config(&self) -> &DlrmConfig {
        &self.config
    }
    /// Refuses to train on from a checkpoint written for inference (by
    /// [`quantize`](crate::checkpoint::quantize) or a model without a table optimizer: no
    /// optimizer state to go on with; or with tables of a type that does
    /// not train).
    pub fn check_trainable(&self) -> Result<(), ModelError> {
        let refuse = |why: String| {
            let path = self.path().to_path_buf();
            Err(crate::Unsupported::InferenceCheckpoint { path, why }.into())
        };
        if matches!(self.table_optimizer, Some(TableOptimizer::None)) {
            return refuse("it holds no optimizer state to go on with".into());
        }
        match self
            .config
            .tables
            .iter()
            .find(|t| !t.data_type.is_trainable())
        {
            Some(t) => refuse(format!(
                "table '{}' is {}, which does not train",
                t.name, t.data_type
            )),
            None => Ok(()),
        }
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

    /// The dataset spec of the data the model was trained on, as recorded
    /// (`None`: a file from before specs were recorded, or TorchRec's).
    pub fn dataset_spec(&self) -> Option<&DatasetSpec> {
        self.dataset_spec.as_ref()
    }

    /// How the model reads its inputs, as far as the file records it: the
    /// recorded [`dataset_spec`](Self::dataset_spec); else, for a file that
    /// recorded only its transforms, Criteo's columns with those; `None`
    /// when nothing is recorded (TorchRec's files). Read data for this
    /// model with it (`LoaderConfig::new(batch, spec)`): another transform
    /// would feed the model inputs it never saw.
    pub fn recorded_inputs(&self) -> Option<DatasetSpec> {
        if let Some(spec) = &self.dataset_spec {
            return Some(spec.clone());
        }
        let state = self.train_state.as_ref()?;
        if state.dense_transform.is_none() && state.id_transform.is_none() {
            return None;
        }
        let mut spec = DatasetSpec::criteo(&self.config.tables);
        spec.dense_transform = state.dense_transform.unwrap_or_default();
        spec.id_transform = state.id_transform.unwrap_or_default();
        Some(spec)
    }

    /// The spec to read this model's data with: the
    /// [`recorded_inputs`](Self::recorded_inputs), or Criteo's columns
    /// with the default transforms when nothing is recorded.
    pub fn input_spec(&self) -> DatasetSpec {
        (self.recorded_inputs()).unwrap_or_else(|| DatasetSpec::criteo(&self.config.tables))
    }

    /// A loader of `data` (Parquet files or directories) in batches of
    /// `batch_size`, in order, read as the model was trained to read its
    /// inputs ([`input_spec`](Self::input_spec)): what evaluation and
    /// prediction from a checkpoint use.
    pub fn loader(
        &self,
        data: &[std::path::PathBuf],
        batch_size: usize,
    ) -> Result<ember_dataloader::Loader, ModelError> {
        let config = ember_dataloader::LoaderConfig::new(batch_size, self.input_spec());
        Ok(ember_dataloader::Loader::open(data, config)?)
    }

    /// Every tensor the model needs, with its dtype and shape: the tables
    /// (in their saved types) and the dense parameters.
    fn expected_tensors(&self) -> (Vec<Expected>, Vec<Expected>) {
        let tables = (self.config.tables.iter().zip(&self.stored))
            .map(|(t, &dtype)| {
                let (dtype, shape) = weight_layout(dtype, t.num_embeddings, t.embedding_dim);
                (table_weight_name(&t.name), dtype, shape)
            })
            .collect();
        let dense = (dense_shapes(&self.config).into_iter())
            .map(|(name, shape)| (name, Dtype::F32, shape))
            .collect();
        (tables, dense)
    }

    /// Where the dense weights are: the chain's last file.
    fn dense_store(&self) -> &dyn TensorStore {
        self.deltas.last().unwrap_or(&self.store).as_ref()
    }

    /// The named tensor as f32 values, checked for dtype (F32), shape and
    /// the values it may hold.
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        allowed: Allowed,
    ) -> Result<Vec<f32>, ModelError> {
        let (mut values, mut read) = (Vec::new(), false);
        let store = self.dense_store();
        store.view(name, Dtype::F32, shape, &mut |bytes| {
            values = f32s(bytes);
            read = true;
        })?;
        debug_assert!(read, "a store applies the reader once when it succeeds");
        let width = shape.get(1).copied().unwrap_or(1);
        check_values(&values, width, (RowSplit::All, 0), allowed).map_err(|message| {
            ModelError::Checkpoint {
                path: store.path().to_path_buf(),
                tensor: Some(name.to_string()),
                message,
            }
        })?;
        Ok(values)
    }

    /// A model for inference: the saved weights, no optimizer.
    pub fn inference_model(&self) -> Result<Dlrm, ModelError> {
        self.model(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
    }

    /// The model with the saved weights and the given optimizers; the saved
    /// optimizer state and step counts are restored where the saved
    /// optimizer is of the same kind (so training resumes exactly).
    pub(crate) fn model(
        &self,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
    ) -> Result<Dlrm, ModelError> {
        self.model_with_disk_tiers(table_optimizer, dense_optimizer, Vec::new())
    }

    /// [`model`](Self::model), with the tables whose entry of `tiers` is
    /// `Some` on the disk tier: their rows
    /// and optimizer state are streamed from the checkpoint into their
    /// files a piece at a time (from one file or a set's pieces), so a
    /// table larger than memory loads in a bounded one.
    pub(crate) fn model_with_disk_tiers(
        &self,
        table_optimizer: TableOptimizer,
        dense_optimizer: DenseOptimizerConfig,
        tiers: Vec<Option<ember_sparse::DiskTierConfig>>,
    ) -> Result<Dlrm, ModelError> {
        // Zeroed, not drawn: every table is read in below (a disk-tier
        // table's file is then written once).
        let tables = EmbeddingBagCollection::zeroed_with_disk_tiers(
            self.config.tables.clone(),
            table_optimizer,
            tiers,
        )?;
        let mut model = Dlrm::with_tables(
            self.config.clone(),
            SparseArch::Local(tables),
            dense_optimizer,
            0,
        )?;
        let same_table_opt = self.same_table_optimizer(&table_optimizer);
        let ebc = model
            .sparse_arch_mut()
            .local_mut()
            .expect("a new model holds its tables in one collection");
        for (t, table) in ebc.tables_mut().iter_mut().enumerate() {
            let config = table.config().clone();
            let all = (RowSplit::All, 0..config.embedding_dim);
            self.read_table(t, all, (table_optimizer, same_table_opt), table)?;
        }
        self.apply_deltas(ebc, table_optimizer, same_table_opt)?;
        if same_table_opt {
            ebc.set_step(self.sparse_step);
        }
        ebc.set_rounding_seed(self.rounding_seed);
        self.restore_dense(&mut model, dense_optimizer)?;
        model.set_dataset_spec(self.dataset_spec.clone());
        // Deltas go on from here only for the tables as saved: neither
        // cast nor under another optimizer (a delta's metadata would not
        // match the chain's files).
        let as_saved =
            (self.config.tables.iter().zip(&self.stored)).all(|(t, &s)| t.data_type == s);
        model.set_chain_head(
            self.chain_head
                .clone()
                .filter(|_| as_saved && same_table_opt),
        );
        Ok(model)
    }

    /// The saved table optimizer is of `table_optimizer`'s kind, so its
    /// state and step count carry over.
    pub(super) fn same_table_optimizer(&self, table_optimizer: &TableOptimizer) -> bool {
        self.table_optimizer
            .is_some_and(|o| same_kind(&o, table_optimizer))
    }

    /// The dense parameters, and the dense optimizer's state when it is of
    /// the saved kind.
    pub(super) fn restore_dense(
        &self,
        model: &mut Dlrm,
        dense_optimizer: DenseOptimizerConfig,
    ) -> Result<(), ModelError> {
        let shapes = dense_shapes(&self.config);
        for p in model.dense_arch_mut().params() {
            let w = self.tensor(&p.name, &shapes[&p.name], Allowed::Finite)?;
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
                let load = |s: Option<&str>, allowed| match s {
                    Some(s) => {
                        let name = format!("{OPTIMIZER_PREFIX}{}.{s}", p.name);
                        self.tensor(&name, shape, allowed)
                    }
                    None => Ok(Vec::new()),
                };
                let m = load(m_name, Allowed::Finite)?;
                let v = load(v_name, Allowed::NonNegative)?;
                state.push((p.name.clone(), p.value.len(), m, v));
            }
            model
                .dense_optimizer_mut()
                .set_state(self.dense_steps, state);
        }
        Ok(())
    }
}

/// A tensor's name, dtype and shape, as a checkpoint must hold it.
type Expected = (String, Dtype, Vec<usize>);

/// A JSON value of the metadata, if present.
pub(super) fn meta_value<T: serde::de::DeserializeOwned>(
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

/// The checkpoint a run resumes from in `dir` ([`latest`](super::latest), opened), if
/// there is one (see [`Checkpoint::check_trainable`] before training on
/// it). On a world, every rank calls this together.
pub fn resume(
    dir: &Path,
    world: Option<&std::sync::Arc<dyn ember_sharding::Collective>>,
) -> Result<Option<Checkpoint>, ModelError> {
    let Some(path) = super::latest(dir, world)? else {
        return Ok(None);
    };
    Checkpoint::open(&path).map(Some)
}
