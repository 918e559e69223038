//! Collectives between devices. One handle per device (rank); every rank
//! calls each collective in the same order. Backends: [`InProcess`] (ranks
//! are threads) and, with the `mpi` feature, `crate::mpi::MpiCollective`
//! (ranks are processes).

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

/// How long a rank waits for a peer's message before giving up: a peer that
/// failed stops the others in bounded time instead of hanging them.
pub const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

use crate::ShardingError;

pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// `send[j]` goes to rank `j`; returns what every rank sent to this one,
    /// by source rank. A peer that sends nothing within the backend's
    /// timeout fails the exchange with an error naming it.
    fn all_to_all_v(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, ShardingError>;
    /// Bytes this rank has sent to other ranks so far.
    fn bytes_sent(&self) -> u64;

    /// Element-wise sum over ranks, the same on every rank: each rank gets
    /// every rank's values and sums them in rank order, so the result does
    /// not depend on timing or on the backend's reduction algorithm.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), ShardingError> {
        let mut w = crate::wire::Writer::new();
        w.put(data);
        let parts = self.all_to_all_v(vec![w.0; self.world_size()])?;
        data.fill(0.0);
        for (rank, part) in parts.into_iter().enumerate() {
            let v: Vec<f32> = crate::wire::Reader::new(&part)
                .get()
                .map_err(ShardingError::Collective)?;
            if v.len() != data.len() {
                return Err(ShardingError::Collective(format!(
                    "all-reduce: rank {rank} sent {} values, rank {} has {}",
                    v.len(),
                    self.rank(),
                    data.len()
                )));
            }
            data.iter_mut().zip(v).for_each(|(d, x)| *d += x);
        }
        Ok(())
    }

    /// Every rank's `mine`, by rank.
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, ShardingError> {
        self.all_to_all_v(vec![mine; self.world_size()])
    }

    /// `root`'s `data` on every rank (`data` is ignored elsewhere).
    fn broadcast(&self, root: usize, data: Vec<u8>) -> Result<Vec<u8>, ShardingError> {
        let n = self.world_size();
        let send = match self.rank() == root {
            true => vec![data; n],
            false => vec![Vec::new(); n],
        };
        let mut got = self.all_to_all_v(send)?;
        Ok(std::mem::take(&mut got[root]))
    }

    /// An exchange of empty messages: a stopped rank fails it in bounded
    /// time, where a plain barrier would wait forever.
    fn barrier(&self) -> Result<(), ShardingError> {
        self.all_to_all_v(vec![Vec::new(); self.world_size()])?;
        Ok(())
    }
}

/// One direction between two ranks.
type Channel = (Sender<Vec<u8>>, Receiver<Vec<u8>>);

/// The in-process backend: ranks are threads of one process, messages move
/// through channels (no copy beyond the encoding).
pub struct InProcess {
    rank: usize,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Receiver<Vec<u8>>>,
    bytes_sent: std::sync::atomic::AtomicU64,
}

impl InProcess {
    /// Handles for `n` ranks, to be moved to (or borrowed by) one thread each.
    pub fn group(n: usize) -> Vec<InProcess> {
        // channel[i][j] carries messages from i to j.
        let channels: Vec<Vec<Channel>> = (0..n)
            .map(|_| (0..n).map(|_| unbounded()).collect())
            .collect();
        (0..n)
            .map(|rank| InProcess {
                rank,
                to: (0..n).map(|j| channels[rank][j].0.clone()).collect(),
                from: (0..n).map(|i| channels[i][rank].1.clone()).collect(),
                bytes_sent: 0.into(),
            })
            .collect()
    }
}

fn lost(rank: usize, peer: usize) -> ShardingError {
    ShardingError::Collective(format!(
        "rank {rank}: rank {peer} stopped before the exchange"
    ))
}

impl Collective for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.to.len()
    }

    fn all_to_all_v(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, ShardingError> {
        if send.len() != self.to.len() {
            return Err(ShardingError::Collective(format!(
                "rank {} sent {} messages to {} ranks",
                self.rank,
                send.len(),
                self.to.len()
            )));
        }
        for (j, message) in send.into_iter().enumerate() {
            if j != self.rank {
                let n = message.len() as u64;
                self.bytes_sent
                    .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            }
            self.to[j].send(message).map_err(|_| lost(self.rank, j))?;
        }
        (self.from.iter().enumerate())
            .map(|(i, rx)| match rx.recv_timeout(PEER_TIMEOUT) {
                Ok(m) => Ok(m),
                Err(RecvTimeoutError::Timeout) => Err(ShardingError::Collective(format!(
                    "rank {}: rank {i} sent nothing for {} s",
                    self.rank,
                    PEER_TIMEOUT.as_secs()
                ))),
                Err(RecvTimeoutError::Disconnected) => Err(lost(self.rank, i)),
            })
            .collect()
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(std::sync::atomic::Ordering::Relaxed)
    }
}
