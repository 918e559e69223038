//! The model's embedding tables: one local collection, or one sharded over
//! devices. Checkpoints always see the unsharded layout.

use std::ops::Deref;

use ember_sharding::{ShardedEmbeddingBagCollection, ShardingPlan};
use ember_sparse::{EmbeddingBagCollection, KeyedJaggedTensor, KeyedTensor, TableOptimizer};

use crate::ModelError;

// One per model: the size difference of the variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum SparseArch {
    Local(EmbeddingBagCollection),
    Sharded(ShardedEmbeddingBagCollection),
}

/// The tables in the unsharded layout: borrowed when local, gathered from
/// the devices when sharded.
pub enum Unsharded<'a> {
    Borrowed(&'a EmbeddingBagCollection),
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
    pub fn forward_into(
        &mut self,
        kjt: &KeyedJaggedTensor,
        out: &mut KeyedTensor,
    ) -> Result<(), ModelError> {
        match self {
            SparseArch::Local(e) => Ok(e.forward_into(kjt, out)?),
            SparseArch::Sharded(s) => Ok(s.forward_into(kjt, out)?),
        }
    }

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

    pub fn optimizer(&self) -> TableOptimizer {
        match self {
            SparseArch::Local(e) => *e.optimizer(),
            SparseArch::Sharded(s) => *s.optimizer(),
        }
    }

    pub fn step(&self) -> u64 {
        match self {
            SparseArch::Local(e) => e.step(),
            SparseArch::Sharded(s) => s.step(),
        }
    }

    pub fn sharded(&self) -> Option<&ShardedEmbeddingBagCollection> {
        match self {
            SparseArch::Local(_) => None,
            SparseArch::Sharded(s) => Some(s),
        }
    }

    pub fn unsharded(&self) -> Result<Unsharded<'_>, ModelError> {
        Ok(match self {
            SparseArch::Local(e) => Unsharded::Borrowed(e),
            SparseArch::Sharded(s) => Unsharded::Gathered(s.to_collection()?),
        })
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
