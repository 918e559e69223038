//! Where a [`Trainer`](super::Trainer)'s batches come from: the
//! [`TrainData`] contract and its sources (the Parquet loader, batches in
//! memory, synthetic batches).

use crate::{Batch, ModelError, SyntheticData, TrainState};

/// A source of batches, epoch by epoch. Batch `k` of an epoch must be the
/// same whenever it is asked for: that is what makes a resumed run equal
/// the run that never stopped. The [`Trainer`](crate::Trainer) takes an epoch's batches on
/// its pipeline thread, so the data is shared (`Sync`) and the epoch's
/// iterator moves there (`Send`).
pub trait TrainData: Sync {
    /// Batches in epoch `epoch` (on a rank of a world: this rank's).
    fn batches_per_epoch(&self, epoch: u64) -> u64;

    /// The batches of epoch `epoch`, from batch `skip` on.
    fn epoch(
        &self,
        epoch: u64,
        skip: u64,
    ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_>;

    /// Identifies the data, so that a resumed run can refuse other data
    /// (0: unknown, never refused).
    fn fingerprint(&self) -> u64 {
        0
    }

    /// How the batches are made, as a fresh run's [`TrainState`] records
    /// it (global batch size, shuffling seed, last batch dropped, the
    /// transforms, fingerprint, ranks): the checkpoints of a run on this
    /// data carry it, and a resume on data made otherwise is refused.
    /// `TrainState::default()`: not known.
    fn start_state(&self) -> TrainState {
        TrainState::default()
    }

    /// The dataset spec the batches are read with, if any: the model
    /// records it ([`Model::record_dataset_spec`](crate::Model::record_dataset_spec)) for its checkpoints.
    fn dataset_spec(&self) -> Option<&ember_dataloader::DatasetSpec> {
        None
    }
}

impl TrainData for ember_dataloader::Loader {
    fn batches_per_epoch(&self, epoch: u64) -> u64 {
        ember_dataloader::Loader::batches_per_epoch(self, epoch)
    }

    fn epoch(
        &self,
        epoch: u64,
        skip: u64,
    ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_> {
        let batches = ember_dataloader::Loader::epoch(self, epoch, skip);
        Box::new(batches.map(|b| Ok(b?)))
    }

    fn fingerprint(&self) -> u64 {
        self.dataset().fingerprint()
    }

    fn start_state(&self) -> TrainState {
        let c = self.config();
        let world = c.world_size.max(1);
        TrainState {
            batch_size: c.batch_size.saturating_mul(world) as u64,
            shuffle_seed: c.shuffle_seed,
            drop_last: c.drop_last,
            dense_transform: Some(c.spec.dense_transform),
            id_transform: Some(c.spec.id_transform),
            data_fingerprint: self.dataset().fingerprint(),
            world_size: world as u64,
            ..TrainState::default()
        }
    }

    fn dataset_spec(&self) -> Option<&ember_dataloader::DatasetSpec> {
        Some(&self.config().spec)
    }
}

/// Batches held in memory (a user's own data); every epoch yields them
/// all, in order.
pub struct InMemory(pub Vec<Batch>);

impl TrainData for InMemory {
    fn batches_per_epoch(&self, _: u64) -> u64 {
        self.0.len() as u64
    }

    fn start_state(&self) -> TrainState {
        TrainState {
            batch_size: self.0.first().map_or(0, |b| b.size() as u64),
            ..TrainState::default()
        }
    }

    fn epoch(
        &self,
        _: u64,
        skip: u64,
    ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_> {
        Box::new(self.0.iter().skip(skip as usize).cloned().map(Ok))
    }
}

/// Synthetic batches made as they are asked for: batch `i` of epoch `e` is
/// `data.batch(first + e * batches + i, size)`, every one new (cycling a few
/// would let a model memorise random labels). On rank `r` of `world_size`,
/// its block of each global batch.
pub struct SyntheticBatches {
    /// The generator.
    pub data: SyntheticData,
    /// The index of the first batch (to keep test batches apart).
    pub first: u64,
    /// Batches per epoch.
    pub batches: u64,
    /// The global batch size.
    pub size: usize,
    /// This process's rank and the world's size (0 and 1 alone).
    pub rank: usize,
    /// See `rank`.
    pub world_size: usize,
}

impl TrainData for SyntheticBatches {
    fn batches_per_epoch(&self, _: u64) -> u64 {
        self.batches
    }

    fn start_state(&self) -> TrainState {
        TrainState {
            batch_size: self.size as u64,
            world_size: self.world_size.max(1) as u64,
            ..TrainState::default()
        }
    }

    fn epoch(
        &self,
        epoch: u64,
        skip: u64,
    ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_> {
        let base = self.first + epoch * self.batches;
        let (r, w) = (self.rank, self.world_size.max(1));
        Box::new((skip..self.batches).map(move |i| {
            let b = self.data.batch(base + i, self.size);
            Ok(match w {
                1 => b,
                _ => b.select(b.size() * r / w..b.size() * (r + 1) / w),
            })
        }))
    }
}
