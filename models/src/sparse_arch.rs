//! The model's embedding tables: one local collection, or one sharded over
//! devices. Checkpoints always see the unsharded layout.

use std::ops::Deref;

use ember_sharding::{InputRouter, RoutedInput, ShardedEmbeddingBagCollection, ShardingPlan};
use ember_sparse::{EmbeddingBagCollection, KeyedJaggedTensor, KeyedTensor, TableOptimizer};

use crate::ModelError;

// One per model: the size difference of the variants costs nothing.
/// A DLRM's embedding tables (TorchRec's `sparse_arch`): pooled lookups
/// forward, the fused optimizer's update backward, either way placed.
#[allow(clippy::large_enum_variant)]
pub enum SparseArch {
    /// Every table whole in one collection of this process.
    Local(EmbeddingBagCollection),
    /// The tables sharded over devices (threads, or the ranks of a world)
    /// by a plan.
    Sharded(ShardedEmbeddingBagCollection),
}

/// The tables in the unsharded layout: borrowed when local, gathered from
/// the devices when sharded.
pub enum Unsharded<'a> {
    /// The local collection itself.
    Borrowed(&'a EmbeddingBagCollection),
    /// A collection put together from the shards.
    Gathered(EmbeddingBagCollection),
}

impl Deref for Unsharded<'_> {
    type Target = EmbeddingBagCollection;
    fn deref(&self) -> &EmbeddingBagCollection {
        match self {
            Unsharded::Borrowed(e) => e,
            Unsharded::Gathered(e) => e,
        }
    }
}

impl SparseArch {
    /// Pooled lookup of `kjt` into `out` (reused: no allocation once grown
    /// to the batch), `[batch, F * D]` with the features in output order.
    /// Fails on an unknown or missing feature or an id out of range.
    pub fn forward_into(
        &mut self,
        kjt: &KeyedJaggedTensor,
        out: &mut KeyedTensor,
    ) -> Result<(), ModelError> {
        match self {
            SparseArch::Local(e) => {
                // Disk-tier tables' rows into their caches (nothing in RAM).
                e.prefetch(kjt)?;
                Ok(e.forward_into(kjt, out)?)
            }
            SparseArch::Sharded(s) => Ok(s.forward_into(kjt, out)?),
        }
    }

    /// [`forward_into`](Self::forward_into) of a sharded batch whose input
    /// dist `routed` ran ahead (by [`input_router`](Self::input_router)).
    pub fn forward_routed(
        &mut self,
        kjt: &KeyedJaggedTensor,
        routed: RoutedInput,
        out: &mut KeyedTensor,
    ) -> Result<(), ModelError> {
        match self {
            SparseArch::Local(_) => Err(crate::Unsupported::ForeignRoutedInput.into()),
            SparseArch::Sharded(s) => Ok(s.forward_routed(kjt, routed, out)?),
        }
    }

    /// Training or inference for the tables' staging: key-value tables
    /// admit new ids only in training.
    pub fn set_training(&mut self, training: bool) {
        match self {
            SparseArch::Local(e) => e.set_training(training),
            SparseArch::Sharded(s) => s.set_training(training),
        }
    }

    /// A router of the input dist, to run it ahead on another thread
    /// (`None` when local, or on ranks whose collective has no second channel).
    pub fn input_router(&self) -> Option<InputRouter> {
        self.sharded()?.input_router()
    }

    /// Backward of the last [`forward_into`](Self::forward_into) on the same
    /// `kjt`, with the table optimizer applied in the scatter. `grad` is the
    /// loss's gradient of the pooled output, `[batch, F * D]` row-major.
    pub fn backward_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        grad: &[f32],
    ) -> Result<(), ModelError> {
        match self {
            SparseArch::Local(e) => Ok(e.backward_update(kjt, grad)?),
            SparseArch::Sharded(s) => Ok(s.backward_update(kjt, grad)?),
        }
    }

    /// An output tensor with the right keys and widths for `batch` samples.
    pub fn new_output(&self, batch: usize) -> KeyedTensor {
        match self {
            SparseArch::Local(e) => e.new_output(batch),
            SparseArch::Sharded(s) => s.new_output(batch),
        }
    }

    /// Bytes of weights and optimizer state (on all devices).
    pub fn bytes(&self) -> usize {
        match self {
            SparseArch::Local(e) => e.bytes(),
            SparseArch::Sharded(s) => s.bytes(),
        }
    }

    /// The table optimizer fused into the backward.
    pub fn optimizer(&self) -> TableOptimizer {
        match self {
            SparseArch::Local(e) => *e.optimizer(),
            SparseArch::Sharded(s) => *s.optimizer(),
        }
    }

    /// Sets the learning rate and weight decay of the next backward
    /// updates ([`ember_sparse::TableStepSettings`]).
    pub fn set_step_settings(
        &mut self,
        settings: ember_sparse::TableStepSettings,
    ) -> Result<(), ModelError> {
        match self {
            SparseArch::Local(e) => Ok(e.set_step_settings(settings)?),
            SparseArch::Sharded(s) => Ok(s.set_step_settings(settings)?),
        }
    }

    /// Backward updates applied so far (Adam's bias-correction step).
    pub fn step(&self) -> u64 {
        match self {
            SparseArch::Local(e) => e.step(),
            SparseArch::Sharded(s) => s.step(),
        }
    }

    /// The seed of the stochastic rounding of fp16/bf16 tables.
    pub fn rounding_seed(&self) -> u64 {
        match self {
            SparseArch::Local(e) => e.rounding_seed(),
            SparseArch::Sharded(s) => s.rounding_seed(),
        }
    }

    /// Sets the seed of the stochastic rounding (a resumed run's, from its
    /// checkpoint).
    pub fn set_rounding_seed(&mut self, seed: u64) {
        match self {
            SparseArch::Local(e) => e.set_rounding_seed(seed),
            SparseArch::Sharded(s) => s.set_rounding_seed(seed),
        }
    }

    /// The sharded collection (`None` when local).
    pub fn sharded(&self) -> Option<&ShardedEmbeddingBagCollection> {
        match self {
            SparseArch::Local(_) => None,
            SparseArch::Sharded(s) => Some(s),
        }
    }

    /// The tables in the unsharded layout, as checkpoints see them: the
    /// local collection (disk-tier tables as they are: read them with
    /// `read_stored_rows`), or the shards gathered into a new one (a copy
    /// of every table).
    pub fn unsharded(&self) -> Result<Unsharded<'_>, ModelError> {
        Ok(match self {
            SparseArch::Local(e) => Unsharded::Borrowed(e),
            SparseArch::Sharded(s) => Unsharded::Gathered(s.to_collection()?),
        })
    }

    /// A read-ahead of the disk-tier tables' rows, to run for the next
    /// batch while this one computes (`None`: no disk-tier table, or sharded).
    pub fn read_ahead(&self) -> Option<ember_sparse::ReadAhead> {
        self.local()?.read_ahead()
    }

    /// Each table's disk tier (`None`: in RAM), as the model was built
    /// with it: a sharded table's, not its shards'.
    pub fn disk_tiers(&self) -> Vec<Option<ember_sparse::DiskTierConfig>> {
        match self {
            SparseArch::Local(e) => e.tables().iter().map(|t| t.disk_tier()).collect(),
            SparseArch::Sharded(s) => s.disk_tiers().to_vec(),
        }
    }

    /// The local collection (`None` when sharded).
    pub fn local(&self) -> Option<&EmbeddingBagCollection> {
        match self {
            SparseArch::Local(e) => Some(e),
            SparseArch::Sharded(_) => None,
        }
    }

    /// The local collection (`None` when sharded).
    pub fn local_mut(&mut self) -> Option<&mut EmbeddingBagCollection> {
        match self {
            SparseArch::Local(e) => Some(e),
            SparseArch::Sharded(_) => None,
        }
    }

    /// Re-places the tables by `plan` (`None`: back into one collection).
    /// Weights, optimizer state and step move exactly.
    pub fn reshard(&mut self, plan: Option<ShardingPlan>) -> Result<(), ModelError> {
        // Build the new placement first: a plan that fails leaves the tables as they were.
        let next = match (&*self, plan) {
            (SparseArch::Local(e), Some(plan)) => {
                SparseArch::Sharded(ShardedEmbeddingBagCollection::from_collection(e, plan)?)
            }
            (SparseArch::Sharded(s), Some(plan)) => SparseArch::Sharded(
                ShardedEmbeddingBagCollection::from_collection(&s.to_collection()?, plan)?,
            ),
            (SparseArch::Sharded(s), None) => SparseArch::Local(s.to_collection()?),
            (SparseArch::Local(_), None) => return Ok(()),
        };
        *self = next;
        Ok(())
    }
}
