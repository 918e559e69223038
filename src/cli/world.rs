//! Multi-process runs: `mpirun -np N ember bench dlrm|train ...`. Each
//! process is one rank and runs one device of the sharding plan; rank 0
//! alone prints. Started any other way, ember is one process.

use std::sync::Arc;
use std::time::Duration;

use ember_sharding::Collective;

/// The environment variables MPI launchers set (Open MPI's; MPICH's Hydra).
const SIZE_VARS: [&str; 2] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];

/// How long a rank waits for a peer's message before it stops the job:
/// `EMBER_PEER_TIMEOUT` seconds, 120 by default.
const TIMEOUT_VAR: &str = "EMBER_PEER_TIMEOUT";

/// This process's place in the job: alone, or one rank of several.
pub struct Launch {
    ranks: Option<Ranks>,
}

pub struct Ranks {
    pub rank: usize,
    pub size: usize,
    pub comm: Arc<dyn Collective>,
    /// Keeps MPI initialized; finalizes it when dropped.
    _mpi: ember_sharding::mpi::MpiWorld,
}

impl Launch {
    /// One process, or MPI initialized when a launcher started several.
    pub fn from_env() -> anyhow::Result<Self> {
        let size = SIZE_VARS
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .map(|s| {
                s.parse::<usize>().map_err(|_| {
                    anyhow::anyhow!("the MPI launcher's world size '{s}' is not a number")
                })
            })
            .transpose()?;
        Ok(Self {
            ranks: match size {
                None | Some(0 | 1) => None,
                Some(n) => Some(Ranks::init(n)?),
            },
        })
    }

    pub fn ranks(&self) -> Option<&Ranks> {
        self.ranks.as_ref()
    }

    /// Rank 0, or the only process: the one that prints.
    pub fn is_root(&self) -> bool {
        self.ranks.as_ref().is_none_or(|r| r.rank == 0)
    }

    pub fn world_size(&self) -> usize {
        self.ranks.as_ref().map_or(1, |r| r.size)
    }

    /// This process's rank (0 alone).
    pub fn rank(&self) -> usize {
        self.ranks.as_ref().map_or(0, |r| r.rank)
    }

    /// Refuses commands that do not run across ranks.
    pub fn single_process_only(&self, command: &str) -> anyhow::Result<()> {
        match &self.ranks {
            Some(r) => anyhow::bail!(
                "`ember {command}` runs in one process, not as one of {} MPI ranks (under mpirun: `bench dlrm` and `train`)",
                r.size
            ),
            None => Ok(()),
        }
    }

    /// Runs `f` (building or loading shards, writing a checkpoint: work whose
    /// length differs between ranks) with exchanges waiting up to
    /// `EMBER_SETUP_TIMEOUT` seconds (an hour by default) instead of the peer
    /// timeout, and ends it with a barrier so every rank leaves it together.
    pub fn patiently<R>(&self, f: impl FnOnce() -> anyhow::Result<R>) -> anyhow::Result<R> {
        ember_sharding::collective::patiently(self.world(), setup_timeout()?, f)
    }

    /// The world's collective, under mpirun.
    pub fn world(&self) -> Option<&Arc<dyn Collective>> {
        self.ranks.as_ref().map(|r| &r.comm)
    }

    /// After an error on this rank: stops every rank of the job (they would
    /// otherwise wait for this one until their timeout). Returns when alone.
    pub fn abort_others(&self) {
        if self.ranks.is_some() {
            ember_sharding::mpi::MpiWorld::abort_job(1);
        }
    }
}

impl Ranks {
    fn init(size: usize) -> anyhow::Result<Self> {
        use anyhow::Context;
        let mpi = ember_sharding::mpi::MpiWorld::init()
            .with_context(|| format!("started as one of {size} MPI ranks"))?;
        anyhow::ensure!(
            mpi.size() == size,
            "the launcher says {size} ranks, MPI says {}",
            mpi.size()
        );
        // A panic must stop the job too, not leave the other ranks waiting.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            ember_sharding::mpi::MpiWorld::abort_job(1);
        }));
        Ok(Self {
            rank: mpi.rank(),
            size,
            comm: Arc::new(mpi.collective(peer_timeout()?)),
            _mpi: mpi,
        })
    }
}

fn peer_timeout() -> anyhow::Result<Duration> {
    seconds(TIMEOUT_VAR, ember_sharding::collective::PEER_TIMEOUT)
}

/// `EMBER_SETUP_TIMEOUT` seconds, an hour by default.
pub fn setup_timeout() -> anyhow::Result<Duration> {
    seconds(
        "EMBER_SETUP_TIMEOUT",
        ember_sharding::collective::SETUP_TIMEOUT,
    )
}

/// A duration in seconds from the environment variable `var`, or `default`.
fn seconds(var: &str, default: Duration) -> anyhow::Result<Duration> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(s) => match s.parse::<f64>() {
            // Capped at a year, which is forever for a wait.
            Ok(secs) if secs > 0.0 && secs.is_finite() => {
                Ok(Duration::from_secs_f64(secs.min(365.0 * 86400.0)))
            }
            _ => anyhow::bail!("{var}='{s}' is not a positive number of seconds"),
        },
    }
}

/// A failure injected for testing failure handling: `EMBER_FAULT=R:S:kill`
/// kills rank R (SIGKILL) when it reaches step S; `R:S:hang` stops it there
/// for good. Unset, nothing happens.
pub struct Fault {
    at: Option<(u64, FaultKind)>,
}

#[derive(Clone, Copy)]
enum FaultKind {
    Kill,
    Hang,
}

const FAULT_VAR: &str = "EMBER_FAULT";

impl Fault {
    pub fn from_env(launch: &Launch) -> anyhow::Result<Self> {
        let Ok(spec) = std::env::var(FAULT_VAR) else {
            return Ok(Self { at: None });
        };
        let bad = || anyhow::anyhow!("{FAULT_VAR}='{spec}': expected RANK:STEP:kill|hang");
        let parts: Vec<&str> = spec.split(':').collect();
        let [rank, step, kind] = parts.as_slice() else {
            return Err(bad());
        };
        let rank: usize = rank.parse().map_err(|_| bad())?;
        let step: u64 = step.parse().map_err(|_| bad())?;
        let kind = match *kind {
            "kill" => FaultKind::Kill,
            "hang" => FaultKind::Hang,
            _ => return Err(bad()),
        };
        let here = launch.rank() == rank;
        Ok(Self {
            at: here.then_some((step, kind)),
        })
    }

    /// Called at the start of every step.
    pub fn at_step(&self, step: u64) {
        match self.at {
            Some((s, FaultKind::Kill)) if s == step => {
                // SAFETY: raising a signal on this process.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            Some((s, FaultKind::Hang)) if s == step => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            _ => {}
        }
    }
}
