//! Collectives between devices. One handle per device (rank); every rank
//! calls each collective in the same order. Backends: [`InProcess`] (ranks
//! are threads) and, with the `mpi` feature, `crate::mpi::MpiCollective`
//! (ranks are processes).

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;

/// How long a rank waits for a peer's message before giving up: a peer that
/// failed stops the others in bounded time instead of hanging them.
pub const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

use crate::{wire, ShardingError};

/// The collectives one rank (device) takes part in: the one required
/// operation is [`all_to_all_v`](Collective::all_to_all_v); all-reduce,
/// all-gather, broadcast and barrier are built on it. Every rank of a world
/// must call the same collectives in the same order.
pub trait Collective: Send + Sync {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of ranks in the world (one per device).
    fn world_size(&self) -> usize;
    /// `send[j]` goes to rank `j`; returns what every rank sent to this one,
    /// by source rank. A peer that sends nothing within the backend's
    /// timeout fails the exchange with an error naming it.
    fn all_to_all_v(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, ShardingError>;
    /// Bytes this rank has sent to other ranks so far.
    fn bytes_sent(&self) -> u64;

    /// How long an exchange waits for a peer, where the backend sets it.
    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// Sets that wait: longer around phases where ranks wait for each other
    /// for good reason (building or loading shards, writing a checkpoint).
    fn set_timeout(&self, _: std::time::Duration) {}

    /// A second collective over the same ranks whose messages never mix
    /// with this one's, for exchanges run from another thread at the same
    /// time (the input dist of the next batch). Every rank opens its
    /// channels in the same order. `None`: the backend has none.
    fn channel(&self) -> Option<Arc<dyn Collective>> {
        None
    }

    /// Element-wise sum over ranks, the same bits on every rank. A
    /// reduce-scatter then an all-gather, as a ring all-reduce moves data
    /// (each rank sends 2(N-1)/N of the values): rank `r` sums chunk `r` of
    /// every rank's values in rank order, so the result depends neither on
    /// timing nor on the backend, and sends it to all.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<(), ShardingError> {
        let (n, me) = (self.world_size(), self.rank());
        let len = data.len();
        let chunk = |r: usize| crate::plan::block(len, n, r);
        let read = |rank: usize, b: &[u8], out: &mut [f32]| -> Result<(), ShardingError> {
            if wire::copy_from_bytes(b, out) {
                return Ok(());
            }
            Err(ShardingError::Collective(format!(
                "all-reduce: rank {rank} sent {} bytes for {} values",
                b.len(),
                out.len()
            )))
        };
        let parts = self.all_to_all_v((0..n).map(|r| wire::to_bytes(&data[chunk(r)])).collect())?;
        let mine = chunk(me);
        let (mut sum, mut values) = (vec![0f32; mine.len()], vec![0f32; mine.len()]);
        for (rank, part) in parts.iter().enumerate() {
            read(rank, part, &mut values)?;
            for (s, x) in sum.iter_mut().zip(&values) {
                *s += x;
            }
        }
        let all = self.all_gather(wire::to_bytes(&sum))?;
        for (rank, part) in all.iter().enumerate() {
            read(rank, part, &mut data[chunk(rank)])?;
        }
        Ok(())
    }

    /// Every rank's `mine`, by rank.
    fn all_gather(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, ShardingError> {
        self.all_to_all_v(vec![mine; self.world_size()])
    }

    /// Every rank's `mine` (a count, a size), by rank.
    fn all_gather_u64(&self, mine: u64) -> Result<Vec<u64>, ShardingError> {
        (self
            .all_gather(mine.to_le_bytes().to_vec())?
            .iter()
            .enumerate())
        .map(|(rank, b)| {
            <[u8; 8]>::try_from(b.as_slice())
                .map(u64::from_le_bytes)
                .map_err(|_| {
                    ShardingError::Collective(format!(
                        "rank {rank} sent {} bytes for one number",
                        b.len()
                    ))
                })
        })
        .collect()
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

/// Runs `f` (building or loading shards, writing a checkpoint: work whose
/// length differs between ranks) with the world's exchanges waiting up to
/// `timeout` instead of the peer timeout, and ends it with a barrier so
/// every rank leaves it together. Without a world, just runs `f`.
pub fn patiently<R, E: From<ShardingError>>(
    world: Option<&std::sync::Arc<dyn Collective>>,
    timeout: std::time::Duration,
    f: impl FnOnce() -> Result<R, E>,
) -> Result<R, E> {
    let Some(comm) = world else {
        return f();
    };
    let usual = comm.timeout();
    comm.set_timeout(timeout);
    let result = f().and_then(|v| {
        comm.barrier()?;
        Ok(v)
    });
    if let Some(t) = usual {
        comm.set_timeout(t);
    }
    result
}

/// How long [`patiently`] waits by default: an hour.
pub const SETUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

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
    ShardingError::PeerStopped { rank, peer }
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
                Err(RecvTimeoutError::Timeout) => Err(ShardingError::PeerTimeout {
                    rank: self.rank,
                    peers: vec![i],
                    seconds: PEER_TIMEOUT.as_secs_f64(),
                }),
                Err(RecvTimeoutError::Disconnected) => Err(lost(self.rank, i)),
            })
            .collect()
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank a thread: `body(rank, handle)` on each, results by rank.
    fn on_ranks<R: Send>(n: usize, body: impl Fn(&InProcess) -> R + Sync) -> Vec<R> {
        let group = InProcess::group(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = group.iter().map(|g| s.spawn(|| body(g))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        for n in 1..=5 {
            // Lengths below, at and above the rank count (empty chunks too).
            for len in [0, 1, 3, 7, 64] {
                let value = |rank: usize, i: usize| (rank * 131 + i) as f32 * 0.1 + 1e-3;
                let got = on_ranks(n, |g| {
                    let mut v: Vec<f32> = (0..len).map(|i| value(g.rank(), i)).collect();
                    g.all_reduce_sum(&mut v).unwrap();
                    v
                });
                let want: Vec<f32> = (0..len)
                    .map(|i| (0..n).fold(0.0f32, |s, r| s + value(r, i)))
                    .collect();
                for v in &got {
                    assert_eq!(v, &want, "{n} ranks, {len} values");
                }
            }
        }
    }

    #[test]
    fn broadcast_and_gather_reach_every_rank() {
        let got = on_ranks(3, |g| {
            let b = g.broadcast(1, vec![g.rank() as u8; 2]).unwrap();
            let all = g.all_gather(vec![g.rank() as u8]).unwrap();
            (b, all)
        });
        for (b, all) in got {
            assert_eq!(b, vec![1, 1]);
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        }
    }

    #[test]
    fn a_stopped_peer_is_a_typed_error_naming_both_ranks() {
        let mut group = InProcess::group(3);
        drop(group.remove(2));
        let err = group[0].all_to_all_v(vec![Vec::new(); 3]).unwrap_err();
        assert_eq!(err, ShardingError::PeerStopped { rank: 0, peer: 2 });
        assert!(err.to_string().contains("rank 0: rank 2 stopped"), "{err}");
        let timeout = ShardingError::PeerTimeout {
            rank: 0,
            peers: vec![1, 3],
            seconds: 2.0,
        };
        assert!(
            timeout
                .to_string()
                .contains("rank 1, 3 did not exchange for 2 s"),
            "{timeout}"
        );
    }
}
