//! The MPI backend of [`Collective`]: ranks are processes started by
//! `mpirun`, one per device.
//!
//! The exchange is non-blocking point to point (`MPI_Isend`, then matched
//! probes and receives), polled against a deadline. MPI's own collectives
//! would block forever on a rank that hangs; polling lets a rank give up
//! after the timeout with an error naming the ranks it is missing, and the
//! caller then aborts the whole job (`MPI_Abort`).

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::StaticScope;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;

use crate::collective::Collective;
use crate::ShardingError;

/// Every exchange of a channel uses its tag: all ranks call its
/// collectives in the same order, and MPI keeps messages between two ranks
/// in order. The world's collective has this one; channels the next ones.
const TAG: i32 = 7;

/// An MPI world: keep it alive for as long as MPI is used; dropping it
/// finalizes MPI.
pub struct MpiWorld {
    universe: mpi::environment::Universe,
}

impl MpiWorld {
    /// Initializes MPI (once per process). Exchanges run on worker threads,
    /// one at a time (`MpiCollective`'s lock), so MPI must allow serialized
    /// calls from any thread.
    pub fn init() -> Result<Self, ShardingError> {
        let (universe, level) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| ShardingError::Mpi("MPI was already initialized".into()))?;
        if level < Threading::Serialized {
            return Err(ShardingError::Mpi(format!(
                "this MPI library offers thread level {level:?}; Ember needs Serialized"
            )));
        }
        Ok(Self { universe })
    }

    /// Stops every rank of the job (`MPI_Abort`), after an error or a panic
    /// on this one; callable from anywhere once MPI is initialized.
    pub fn abort_job(code: i32) -> ! {
        mpi::topology::SimpleCommunicator::world().abort(code)
    }

    /// This process's rank in `MPI_COMM_WORLD`, `0..size()`.
    pub fn rank(&self) -> usize {
        self.universe.world().rank() as usize
    }

    /// The number of ranks (processes) in `MPI_COMM_WORLD`.
    pub fn size(&self) -> usize {
        self.universe.world().size() as usize
    }

    /// The collective over all ranks, with `timeout` per exchange.
    pub fn collective(&self, timeout: Duration) -> MpiCollective {
        MpiCollective {
            world: Arc::new(Mutex::new(World(self.universe.world()))),
            tag: TAG,
            next_tag: Arc::new(AtomicI32::new(TAG + 1)),
            rank: self.rank(),
            size: self.size(),
            timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
            bytes_sent: Arc::new(AtomicU64::new(0)),
        }
    }
}

/// The [`Collective`] over an MPI world, made by [`MpiWorld::collective`]:
/// MPI calls are serialized by a lock (taken per call, so the exchanges of
/// two channels on two threads interleave), and an exchange gives up after
/// the timeout (set there, changed with [`Collective::set_timeout`]) with an
/// error naming the silent ranks.
pub struct MpiCollective {
    world: Arc<Mutex<World>>,
    /// This channel's tag, and the next free one (shared by all channels).
    tag: i32,
    next_tag: Arc<AtomicI32>,
    rank: usize,
    size: usize,
    timeout_ms: AtomicU64,
    /// Shared by the channels: a rank's bytes are all its channels'.
    bytes_sent: Arc<AtomicU64>,
}

/// The world's communicator, used only under its lock.
struct World(SimpleCommunicator);

// SAFETY: the communicator is a handle; every use goes through the mutex, and
// MPI was initialized for serialized calls from any thread.
unsafe impl Send for World {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl Sync for World {}

/// A send in flight; its buffer is leaked to MPI until the send completes.
struct Sending {
    peer: usize,
    request: mpi::request::Request<'static, [u8], StaticScope>,
    buffer: *mut [u8],
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_to_all_v(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, ShardingError> {
        let (me, n) = (self.rank, self.size);
        if send.len() != n {
            return Err(ShardingError::Collective(format!(
                "rank {me} sent {} messages to {n} ranks",
                send.len()
            )));
        }
        let lock = || self.world.lock().unwrap_or_else(|e| e.into_inner());
        let timeout = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
        let deadline = Instant::now() + timeout;
        let mut received: Vec<Option<Vec<u8>>> = vec![None; n];
        let mut sending = Vec::with_capacity(n);
        for (peer, message) in send.into_iter().enumerate() {
            if peer == me {
                received[me] = Some(message);
                continue;
            }
            self.bytes_sent
                .fetch_add(message.len() as u64, Ordering::Relaxed);
            let buffer: &'static mut [u8] = Box::leak(message.into_boxed_slice());
            let buffer_ptr: *mut [u8] = buffer;
            // SAFETY: the buffer is leaked, so it outlives the request; it is
            // freed only after the request completes (below).
            let request = lock()
                .0
                .process_at_rank(peer as i32)
                .immediate_send_with_tag(StaticScope, unsafe { &*buffer_ptr }, self.tag);
            sending.push(Sending {
                peer,
                request,
                buffer: buffer_ptr,
            });
        }
        let mut waiting: Vec<usize> = (0..n).filter(|&r| r != me).collect();
        let mut polls = 0u32;
        while !waiting.is_empty() || !sending.is_empty() {
            let world = lock();
            waiting.retain(|&src| {
                match world
                    .0
                    .process_at_rank(src as i32)
                    .immediate_matched_probe_with_tag(self.tag)
                {
                    Some(probed) => {
                        received[src] = Some(probed.matched_receive_vec::<u8>().0);
                        false
                    }
                    None => true,
                }
            });
            sending = (sending.into_iter())
                .filter_map(|s| match s.request.test() {
                    Ok(_) => {
                        // SAFETY: the send is complete; MPI no longer reads the buffer.
                        drop(unsafe { Box::from_raw(s.buffer) });
                        None
                    }
                    Err(request) => Some(Sending { request, ..s }),
                })
                .collect();
            drop(world);
            if waiting.is_empty() && sending.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                let mut silent: Vec<usize> = waiting.clone();
                silent.extend(sending.iter().map(|s| s.peer));
                silent.sort_unstable();
                silent.dedup();
                // MPI may still read these buffers: leak them with their
                // requests (the job is about to be aborted).
                for s in sending {
                    std::mem::forget(s.request);
                }
                return Err(ShardingError::PeerTimeout {
                    rank: me,
                    peers: silent,
                    seconds: timeout.as_secs_f64(),
                });
            }
            // Spin briefly, then sleep: ranks may share cores with the ones
            // still computing.
            polls += 1;
            if polls > 100 {
                std::thread::sleep(Duration::from_micros(100));
            } else {
                std::thread::yield_now();
            }
        }
        Ok(received
            .into_iter()
            .map(|m| m.expect("every rank's message arrived"))
            .collect())
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn timeout(&self) -> Option<Duration> {
        Some(Duration::from_millis(
            self.timeout_ms.load(Ordering::Relaxed),
        ))
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    fn channel(&self) -> Option<Arc<dyn Collective>> {
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        Some(Arc::new(MpiCollective {
            world: self.world.clone(),
            tag,
            next_tag: self.next_tag.clone(),
            rank: self.rank,
            size: self.size,
            timeout_ms: AtomicU64::new(self.timeout_ms.load(Ordering::Relaxed)),
            bytes_sent: self.bytes_sent.clone(),
        }))
    }
}
