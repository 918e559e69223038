//! Unpooled lookups: TorchRec's `EmbeddingCollection`, which returns every
//! id's row (a user's history read as a sequence) instead of one pooled
//! vector per bag. It shares the bag collection's tables, data types,
//! disk tier and fused backward: an id's gradient row is the gradient of
//! its own output row, and equal ids in a batch are still merged into one
//! update.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::backward::Entry;
use super::{EmbeddingBagCollection, EmbeddingTable};
use crate::{
    DataType, DiskTierConfig, EmbeddingBagConfig, KeyedJaggedTensor, KvConfig, SparseError,
    TableOptimizer, TableStepSettings,
};

/// One table of an [`EmbeddingCollection`] and the features that read it
/// (TorchRec's `EmbeddingConfig`: no pooling).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingConfig {
    /// Table name; unique within a collection.
    pub name: String,
    /// Number of rows (the id range is `0..num_embeddings`).
    pub num_embeddings: usize,
    /// Floats per row; every table of a collection has the same.
    pub embedding_dim: usize,
    /// Features that read this table (an item table shared by the history
    /// and the candidate, say).
    pub feature_names: Vec<String>,
    /// Lower end of the uniform initialisation range (TorchRec's default
    /// -sqrt(1/num_embeddings) when absent).
    #[serde(default)]
    pub weight_init_min: Option<f32>,
    /// Upper end (+sqrt(1/num_embeddings) when absent).
    #[serde(default)]
    pub weight_init_max: Option<f32>,
    /// The rows' data type (`fp32` when absent).
    #[serde(default)]
    pub data_type: DataType,
    /// Rows found by the raw 64-bit id through a map, as a bag
    /// collection's key-value tables ([`KvConfig`]); `None`: ids are rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvConfig>,
}

impl EmbeddingConfig {
    /// A table `name` of `num_embeddings` rows of `embedding_dim` floats,
    /// read by `features`, fp32, with the default init range.
    pub fn new(name: &str, num_embeddings: usize, embedding_dim: usize, features: &[&str]) -> Self {
        let bag = EmbeddingBagConfig::new(name, num_embeddings, embedding_dim, features);
        Self {
            name: bag.name,
            num_embeddings,
            embedding_dim,
            feature_names: bag.feature_names,
            weight_init_min: None,
            weight_init_max: None,
            data_type: DataType::Fp32,
            kv: None,
        }
    }

    /// The same table with rows of `data_type`.
    pub fn with_data_type(mut self, data_type: DataType) -> Self {
        self.data_type = data_type;
        self
    }

    /// The table as a bag collection holds it (sum pooling): what the
    /// planner and sharding plans take.
    pub fn bag_config(&self) -> EmbeddingBagConfig {
        EmbeddingBagConfig {
            name: self.name.clone(),
            num_embeddings: self.num_embeddings,
            embedding_dim: self.embedding_dim,
            feature_names: self.feature_names.clone(),
            pooling: crate::PoolingType::Sum,
            weight_init_min: self.weight_init_min,
            weight_init_max: self.weight_init_max,
            data_type: self.data_type,
            kv: self.kv.clone(),
        }
    }
}

/// The rows an [`EmbeddingCollection`] looked up: for each of its features
/// (in [`keys`](Self::keys) order), each sample's ids' rows in order, all in
/// one `[rows, dim]` buffer. TorchRec returns a `JaggedTensor` per feature;
/// [`feature`](Self::feature) gives that view without a copy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JaggedEmbeddings {
    keys: Vec<String>,
    stride: usize,
    dim: usize,
    /// Row offsets: feature `f`'s sample `s` is rows
    /// `offsets[f * stride + s]..offsets[f * stride + s + 1]`.
    offsets: Vec<usize>,
    values: Vec<f32>,
}

impl JaggedEmbeddings {
    /// Rows in this layout from their parts (a sharded collection's
    /// output): `offsets` has `keys.len() * stride + 1` non-decreasing
    /// entries from 0, the last `values.len() / dim`.
    pub fn from_parts(
        keys: Vec<String>,
        stride: usize,
        dim: usize,
        offsets: Vec<usize>,
        values: Vec<f32>,
    ) -> Result<Self, SparseError> {
        let fits = offsets.len() == keys.len() * stride + 1
            && offsets.first() == Some(&0)
            && offsets.windows(2).all(|w| w[0] <= w[1])
            && offsets.last().map(|&o| o * dim) == Some(values.len());
        if !fits {
            return Err(SparseError::KeyedTensorShape(format!(
                "jagged rows: {} offsets for {} keys of {stride} samples, {} values of dim {dim}",
                offsets.len(),
                keys.len(),
                values.len()
            )));
        }
        Ok(Self {
            keys,
            stride,
            dim,
            offsets,
            values,
        })
    }

    /// The features, in order.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }

    /// Samples in the batch.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Floats per row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Every row, `[rows, dim]` row-major.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The offsets of every (feature, sample)'s rows, `keys * stride + 1`.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Its parts, without a copy: the dim, the offsets and the values
    /// (the layout of [`from_parts`](Self::from_parts)).
    pub fn into_parts(self) -> (usize, Vec<usize>, Vec<f32>) {
        (self.dim, self.offsets, self.values)
    }

    /// Feature `key`'s rows (`[len, dim]`) and its samples' offsets into
    /// them (`stride + 1`, from 0), or `None` when it is not a key.
    pub fn feature(&self, key: &str) -> Option<(&[f32], Vec<usize>)> {
        let f = self.keys.iter().position(|k| k == key)?;
        let offsets = &self.offsets[f * self.stride..=(f + 1) * self.stride];
        let rows = &self.values[offsets[0] * self.dim..offsets[self.stride] * self.dim];
        Some((rows, offsets.iter().map(|o| o - offsets[0]).collect()))
    }
}

/// Embedding tables read unpooled, as TorchRec's `EmbeddingCollection`:
/// each id's row is returned in its place in the sequence
/// ([`JaggedEmbeddings`]), and [`backward_update`](Self::backward_update)
/// takes a gradient row per id with the optimizer fused (equal ids merged).
/// Every table has the same dim (as TorchRec requires). Tables may be
/// fp32, fp16 or bf16 for training, quantized for inference, and on the
/// disk tier.
///
/// ```
/// use ember_sparse::{EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, TableOptimizer};
///
/// // One item table read by a history and by the candidate.
/// let items = EmbeddingConfig::new("items", 100, 4, &["history", "candidate"]);
/// let mut ec = EmbeddingCollection::new(vec![items], TableOptimizer::sgd(0.1), 7)?;
/// // Two users: histories [3, 5, 3] and [9]; candidates [5] and [1].
/// let kjt = KeyedJaggedTensor::from_lengths(
///     vec!["history".into(), "candidate".into()],
///     vec![3, 5, 3, 9, 5, 1],
///     &[3, 1, 1, 1],
///     None,
/// )?;
/// let out = ec.forward(&kjt)?;
/// let (history, offsets) = out.feature("history").unwrap();
/// assert_eq!(offsets, [0, 3, 4]);
/// assert_eq!(&history[4..8], ec.tables()[0].row(5)); // user 0's second item
///
/// // One gradient row per id; id 3's two rows are summed into one update.
/// let grad = vec![1.0f32; out.values().len()];
/// let before = ec.tables()[0].row(3)[0];
/// ec.backward_update(&kjt, &grad)?;
/// assert!((ec.tables()[0].row(3)[0] - (before - 0.2)).abs() < 1e-6);
/// # Ok::<(), ember_sparse::SparseError>(())
/// ```
#[derive(Debug)]
pub struct EmbeddingCollection {
    bags: EmbeddingBagCollection,
    configs: Vec<EmbeddingConfig>,
    dim: usize,
}

impl EmbeddingCollection {
    /// Creates and initialises the tables as
    /// [`EmbeddingBagCollection::new`] does (the same rows for the same
    /// seed); fails as it does, and when the tables' dims differ.
    pub fn new(
        configs: Vec<EmbeddingConfig>,
        optimizer: TableOptimizer,
        seed: u64,
    ) -> Result<Self, SparseError> {
        Self::with_disk_tiers(configs, optimizer, seed, Vec::new())
    }

    /// [`new`](Self::new), with the tables whose entry of `tiers` is `Some`
    /// on the disk tier (see [`EmbeddingBagCollection::with_disk_tiers`]);
    /// their batches need a [`prefetch`](Self::prefetch) before the forward.
    pub fn with_disk_tiers(
        configs: Vec<EmbeddingConfig>,
        optimizer: TableOptimizer,
        seed: u64,
        tiers: Vec<Option<DiskTierConfig>>,
    ) -> Result<Self, SparseError> {
        let dim = configs.first().map_or(0, |c| c.embedding_dim);
        if let Some(c) = configs.iter().find(|c| c.embedding_dim != dim) {
            return Err(SparseError::InvalidConfig {
                table: c.name.clone(),
                reason: format!(
                    "its dim is {}, the first table's {dim}: an embedding collection's tables share one dim",
                    c.embedding_dim
                ),
            });
        }
        let bags = configs.iter().map(EmbeddingConfig::bag_config).collect();
        Ok(Self {
            bags: EmbeddingBagCollection::with_disk_tiers(bags, optimizer, seed, tiers)?,
            configs,
            dim,
        })
    }

    /// The tables' configs.
    pub fn configs(&self) -> &[EmbeddingConfig] {
        &self.configs
    }

    /// The tables (rows, optimizer state, disk tier).
    pub fn tables(&self) -> &[EmbeddingTable] {
        self.bags.tables()
    }

    /// The tables, writable (loading a checkpoint).
    pub fn tables_mut(&mut self) -> &mut [EmbeddingTable] {
        self.bags.tables_mut()
    }

    /// Floats per row, the same for every table.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The features, in output order (tables' order, then each table's).
    pub fn feature_names(&self) -> Vec<String> {
        self.bags.feature_names()
    }

    /// The optimizer fused into the backward.
    pub fn optimizer(&self) -> &TableOptimizer {
        self.bags.optimizer()
    }

    /// Backward steps taken (the optimizer's step count).
    pub fn step(&self) -> u64 {
        self.bags.step()
    }

    /// Sets the step count (resuming from a checkpoint).
    pub fn set_step(&mut self, step: u64) {
        self.bags.set_step(step)
    }

    /// Bytes of rows and optimizer state in memory.
    pub fn bytes(&self) -> usize {
        self.bags.bytes()
    }

    /// Brings the disk-tier tables' rows of `kjt` into their caches and
    /// finds key-value tables' raw ids in their maps (in training,
    /// admitting new ones), for its forward (nothing when every table is
    /// in RAM and keyed by row).
    pub fn prefetch(&mut self, kjt: &KeyedJaggedTensor) -> Result<(), SparseError> {
        self.bags.prefetch(kjt)
    }

    /// Replaces the optimizer fused into the backward, as
    /// [`EmbeddingBagCollection::set_optimizer`] does (fresh state, the
    /// step count at 0), failing as it does.
    pub fn set_optimizer(&mut self, optimizer: TableOptimizer) -> Result<(), SparseError> {
        self.bags.set_optimizer(optimizer)
    }

    /// The learning rate and weight decay of the next backward updates, as
    /// [`EmbeddingBagCollection::set_step_settings`] sets them.
    pub fn set_step_settings(&mut self, settings: TableStepSettings) -> Result<(), SparseError> {
        self.bags.set_step_settings(settings)
    }

    /// Training (the default) or inference, for key-value tables' staging
    /// (see [`EmbeddingBagCollection::set_training`]).
    pub fn set_training(&mut self, training: bool) {
        self.bags.set_training(training);
    }

    /// Every id's row of every feature of the collection in `kjt` (keys it
    /// does not serve are ignored); ids must be in range.
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<JaggedEmbeddings, SparseError> {
        let mut out = JaggedEmbeddings::default();
        self.forward_into(kjt, &mut out)?;
        Ok(out)
    }

    /// [`forward`](Self::forward) into a reused output.
    pub fn forward_into(
        &self,
        kjt: &KeyedJaggedTensor,
        out: &mut JaggedEmbeddings,
    ) -> Result<(), SparseError> {
        let input = self.bags.forward_input(kjt)?;
        let keys = self.bags.resolve_keys(input)?;
        let b = kjt.stride();
        out.keys = self.feature_names();
        out.stride = b;
        out.dim = self.dim;
        out.offsets.clear();
        out.offsets.push(0);
        for &k in &keys {
            let o = &kjt.offsets()[k * b..=(k + 1) * b];
            let last = out.offsets[out.offsets.len() - 1];
            out.offsets.extend(o[1..].iter().map(|x| x - o[0] + last));
        }
        let rows = out.offsets[out.offsets.len() - 1];
        out.values.resize(rows * self.dim, 0.0);
        let mut rest = &mut out.values[..];
        for (slot, &k) in self.bags.slots.iter().zip(&keys) {
            let range = input.key_range(k);
            let (mine, after) = rest.split_at_mut(range.len() * self.dim);
            rest = after;
            let table = &self.bags.tables[slot.table];
            gather(table, &input.values()[range.clone()], mine, self.dim).map_err(|p| {
                let sample = sample_of(kjt, k, range.start + p);
                table.id_error(&slot.name, sample, kjt.values()[range.start + p])
            })?;
        }
        Ok(())
    }

    /// The backward of [`forward`](Self::forward) on the same `kjt`, with
    /// the optimizer applied in the scatter: `grad` is the gradient of the
    /// loss with respect to the forward's values (`[rows, dim]`, the same
    /// layout). Equal ids get one update with their summed gradient. Every
    /// id is checked before any row changes.
    pub fn backward_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        grad: &[f32],
    ) -> Result<(), SparseError> {
        let keys = self.bags.resolve_keys(kjt)?;
        let ranges: Vec<std::ops::Range<usize>> = keys.iter().map(|&k| kjt.key_range(k)).collect();
        let rows: usize = ranges.iter().map(|r| r.len()).sum();
        if grad.len() != rows * self.dim {
            return Err(SparseError::GradShape {
                rows: grad.len() / self.dim.max(1),
                cols: self.dim,
                expected_rows: rows,
                expected_cols: self.dim,
            });
        }
        if matches!(self.bags.optimizer, TableOptimizer::None) {
            return Ok(());
        }
        let staged = self.bags.update_input(kjt)?;
        let input = staged.as_ref().map_or(kjt, |s| s.slots());
        // Each feature's first output row, and the slots in order.
        let firsts: Vec<usize> = (ranges.iter())
            .scan(0, |row, r| {
                let first = *row;
                *row += r.len();
                Some(first)
            })
            .collect();
        let slots = std::mem::take(&mut self.bags.slots);
        let collect = |t: usize, table: &mut EmbeddingTable| {
            let rows = table.resident_rows() as u64;
            table.scratch.entries.clear();
            for (((slot, &k), range), &first) in slots.iter().zip(&keys).zip(&ranges).zip(&firsts) {
                if slot.table != t {
                    continue;
                }
                for (i, &id) in input.values()[range.clone()].iter().enumerate() {
                    if id < 0 || id as u64 >= rows {
                        let sample = sample_of(kjt, k, range.start + i);
                        return Err(table.id_error(
                            &slot.name,
                            sample,
                            kjt.values()[range.start + i],
                        ));
                    }
                    table.scratch.entries.push(Entry {
                        id: id as u64,
                        sample: (first + i) as u32,
                        column: 0,
                        scale: 1.0,
                    });
                }
            }
            table.segment_entries();
            Ok(())
        };
        let result = self.bags.step_tables(grad, self.dim, collect);
        self.bags.slots = slots;
        self.bags.restore_staged(staged);
        result
    }
}

/// Each of `ids`' rows of `table` (resident: a disk-tier table's cache
/// slots) into `out`, `dim` apart; an id out of range is an error naming
/// its position.
fn gather(table: &EmbeddingTable, ids: &[i64], out: &mut [f32], dim: usize) -> Result<(), usize> {
    let rows = table.resident_rows() as i64;
    if let Some(p) = ids.iter().position(|&id| id < 0 || id >= rows) {
        return Err(p);
    }
    let (resident, _) = table.store.resident();
    let read = |(row, &id): (&mut [f32], &i64)| resident.read_row(id as usize, row);
    if dim == 0 {
        return Ok(());
    }
    match ids.len() * dim >= 1 << 14 {
        true => out.par_chunks_mut(dim).zip(ids).for_each(read),
        false => out.chunks_mut(dim).zip(ids).for_each(read),
    }
    Ok(())
}

/// The sample of value `p` of key `k` in `kjt`.
fn sample_of(kjt: &KeyedJaggedTensor, k: usize, p: usize) -> usize {
    let b = kjt.stride();
    let offsets = &kjt.offsets()[k * b..=(k + 1) * b];
    offsets.partition_point(|&o| o <= p).saturating_sub(1)
}
