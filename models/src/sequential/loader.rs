//! Histories into training batches, shuffled each epoch and bucketed by
//! length: users are shuffled, then each window of `bucket_batches`
//! batches is sorted by length before it is cut, so a batch holds
//! histories of like length and the padded work of a batch (its longest
//! history times its users: what a padded kernel pays, and what jagged
//! kernels' load balance suffers from) stays near its real tokens. The
//! window's batches are then shuffled among themselves, so lengths do not
//! climb through an epoch. Batch `k` of epoch `e` is a function of the
//! seed, `e` and `k`: a resumed run reads the batches the run that never
//! stopped read.

use ember_sparse::rng::Rng;

use super::histories::{history_batches, UserHistory};
use crate::{Batch, ModelError, TrainData, TrainState};

/// User histories as [`TrainData`] (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct HistoryLoader {
    users: Vec<UserHistory>,
    batch_size: usize,
    max_len: usize,
    seed: Option<u64>,
    bucket_batches: usize,
}

impl HistoryLoader {
    /// Batches of `batch_size` users' most recent `max_len` items (users of
    /// fewer than 2 items left out: nothing to predict), in order and
    /// unbucketed until [`shuffled`](Self::shuffled) and
    /// [`bucketed`](Self::bucketed) say otherwise.
    pub fn new(users: Vec<UserHistory>, batch_size: usize, max_len: usize) -> Self {
        Self {
            users: users.into_iter().filter(|u| u.items.len() >= 2).collect(),
            batch_size: batch_size.max(1),
            max_len,
            seed: None,
            bucket_batches: 1,
        }
    }

    /// Users in a new order each epoch, drawn from `seed`.
    pub fn shuffled(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Sort windows of `batches` batches by length before cutting them
    /// (1: no bucketing).
    pub fn bucketed(mut self, batches: usize) -> Self {
        self.bucket_batches = batches.max(1);
        self
    }

    /// The users of epoch `epoch`'s batches, batch by batch.
    pub fn epoch_users(&self, epoch: u64) -> Vec<Vec<usize>> {
        let mut order: Vec<usize> = (0..self.users.len()).collect();
        let mut rng = self
            .seed
            .map(|s| Rng::new(s ^ epoch.wrapping_mul(0x9e37_79b9)));
        if let Some(rng) = rng.as_mut() {
            shuffle(&mut order, rng);
        }
        let len = |u: usize| self.users[u].items.len().min(self.max_len);
        let mut batches = Vec::with_capacity(self.users.len().div_ceil(self.batch_size));
        for window in order.chunks_mut(self.batch_size.saturating_mul(self.bucket_batches)) {
            if self.bucket_batches > 1 {
                window.sort_by_key(|&u| len(u));
            }
            let mut cut: Vec<Vec<usize>> = window
                .chunks(self.batch_size)
                .map(<[usize]>::to_vec)
                .collect();
            if let (Some(rng), true) = (rng.as_mut(), self.bucket_batches > 1) {
                shuffle(&mut cut, rng);
            }
            batches.extend(cut);
        }
        batches
    }

    /// The users (2 items or more).
    pub fn users(&self) -> &[UserHistory] {
        &self.users
    }

    /// Tokens a padded kernel would read over an epoch (each batch's
    /// longest history times its users) against the real ones.
    pub fn padded_and_real_tokens(&self, epoch: u64) -> (u64, u64) {
        let len = |u: usize| self.users[u].items.len().min(self.max_len) as u64;
        self.epoch_users(epoch)
            .iter()
            .fold((0, 0), |(p, r), batch| {
                let longest = batch.iter().map(|&u| len(u)).max().unwrap_or(0);
                let real: u64 = batch.iter().map(|&u| len(u)).sum();
                (p + longest * batch.len() as u64, r + real)
            })
    }
}

fn shuffle<T>(v: &mut [T], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
}

impl TrainData for HistoryLoader {
    fn batches_per_epoch(&self, _: u64) -> u64 {
        self.users.len().div_ceil(self.batch_size) as u64
    }

    fn epoch(
        &self,
        epoch: u64,
        skip: u64,
    ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_> {
        let batches = self.epoch_users(epoch);
        Box::new(batches.into_iter().skip(skip as usize).map(move |users| {
            let chunk: Vec<UserHistory> = users.iter().map(|&u| self.users[u].clone()).collect();
            let mut one = history_batches(&chunk, chunk.len(), self.max_len)?;
            Ok(one.pop().expect("a batch of users with 2 items or more"))
        }))
    }

    fn start_state(&self) -> TrainState {
        TrainState {
            batch_size: self.batch_size as u64,
            shuffle_seed: self.seed,
            ..TrainState::default()
        }
    }
}
