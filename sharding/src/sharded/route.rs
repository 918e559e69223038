//! The input dist on its own: routing a batch's ids to the devices that own
//! their rows reads no table, so it can run on another thread while the
//! previous batch computes (TorchRec's TrainPipelineSparseDist). An
//! [`InputRouter`] does it over its own exchanges, and the collection's
//! [`forward_routed`](ShardedEmbeddingBagCollection::forward_routed) takes
//! the result; [`forward_into`](ShardedEmbeddingBagCollection::forward_into)
//! is the two in a row, so both orders compute the same bits.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ember_sparse::{EmbeddingBagConfig, KeyedJaggedTensor, SparseError};

use super::layout::Layout;
use super::stages::{device_input_dist, on_threads, DeviceInput, DeviceRoutes};
use super::ShardedEmbeddingBagCollection;
use crate::collective::{Collective, InProcess};
use crate::ShardingError;

/// A batch's input dist, made by [`InputRouter::route`] (or inline by the
/// forward), for one forward of that batch.
pub struct RoutedInput {
    /// Samples, ids and a hash of the batch's ids: the forward checks that
    /// it is given the batch this was routed from.
    stride: usize,
    ids: usize,
    fingerprint: u64,
    /// The layout it was routed by (its address): a collection takes only
    /// its own routers' inputs.
    layout: usize,
    pub(super) owners: Vec<Range<usize>>,
    pub(super) devices: Vec<DeviceInput>,
    /// The slowest device's time.
    pub(super) time: Duration,
    /// Bytes each local device sent on the router's own exchanges.
    pub(super) bytes: Vec<u64>,
}

impl RoutedInput {
    /// How long the input dist took (the slowest device).
    pub fn time(&self) -> Duration {
        self.time
    }

    /// Whether it was routed from `kjt` by `layout`.
    pub(super) fn is_of(&self, kjt: &KeyedJaggedTensor, layout: &Arc<Layout>) -> bool {
        self.layout == Arc::as_ptr(layout) as usize
            && (self.stride, self.ids, self.fingerprint)
                == (kjt.stride(), kjt.values().len(), fingerprint(kjt))
    }
}

/// A hash of the bags' lengths and ids.
fn fingerprint(kjt: &KeyedJaggedTensor) -> u64 {
    let mix = |h: u64, x: u64| (h ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    let h = kjt.offsets().iter().fold(0, |h, &o| mix(h, o as u64));
    kjt.values().iter().fold(h, |h, &v| mix(h, v as u64))
}

/// The exchanges a routing runs on.
pub(super) enum Comms<'a> {
    /// One endpoint per device, all in this process.
    Threads(&'a [InProcess]),
    /// This process's rank.
    Rank(&'a dyn Collective),
}

/// Every device's samples in global positions: blocks of this batch, or of
/// the ranks' batches in rank order (their sizes exchanged).
pub(super) fn owners(comms: &Comms, b: usize) -> Result<Vec<Range<usize>>, ShardingError> {
    match comms {
        Comms::Threads(c) => Ok((0..c.len())
            .map(|d| crate::plan::block(b, c.len(), d))
            .collect()),
        Comms::Rank(comm) => {
            let mut start = 0;
            Ok((comm.all_gather_u64(b as u64)?.into_iter())
                .map(|n| {
                    start += n as usize;
                    start - n as usize..start
                })
                .collect())
        }
    }
}

/// For each slot of `layout`, its key's index in `kjt` (keys no table
/// serves are ignored, as by the local collection).
pub(super) fn key_indices(
    layout: &Layout,
    kjt: &KeyedJaggedTensor,
) -> Result<Vec<usize>, SparseError> {
    (layout.slots.iter())
        .map(|s| {
            kjt.key_index(&s.feature)
                .ok_or_else(|| SparseError::MissingFeature(s.feature.clone()))
        })
        .collect()
}

/// [`key_indices`], after checking every id against its table.
pub(super) fn check_input(
    layout: &Layout,
    configs: &[EmbeddingBagConfig],
    kjt: &KeyedJaggedTensor,
) -> Result<Vec<usize>, SparseError> {
    let keys = key_indices(layout, kjt)?;
    let b = kjt.stride();
    for (slot, &k) in layout.slots.iter().zip(&keys) {
        let c = &configs[slot.table];
        if c.kv.is_some() {
            // Raw ids: the owner's map finds their rows.
            continue;
        }
        let offsets = &kjt.offsets()[k * b..=(k + 1) * b];
        for sample in 0..b {
            for &id in &kjt.values()[offsets[sample]..offsets[sample + 1]] {
                if id < 0 || id as usize >= c.num_embeddings {
                    return Err(SparseError::IdOutOfRange {
                        table: c.name.clone(),
                        feature: slot.feature.clone(),
                        sample,
                        id,
                        rows: c.num_embeddings,
                    });
                }
            }
        }
    }
    Ok(keys)
}

/// The input dist of `kjt` for the devices `locals` (the first of them
/// global device `first`), over `comms`.
pub(super) fn route_on(
    layout: &Arc<Layout>,
    configs: &[EmbeddingBagConfig],
    locals: &[&DeviceRoutes],
    first: usize,
    comms: Comms,
    kjt: &KeyedJaggedTensor,
) -> Result<RoutedInput, ShardingError> {
    let keys = check_input(layout, configs, kjt)?;
    let owners = owners(&comms, kjt.stride())?;
    let ctx = layout.context(kjt, &keys, &owners, owners[first].start);
    let timed = |d: &DeviceRoutes, comm: &dyn Collective| {
        let t = Instant::now();
        device_input_dist(&ctx, &d.routes, &d.keys, d.has_tables, comm).map(|r| (r, t.elapsed()))
    };
    let results: Vec<Result<(DeviceInput, Duration), ShardingError>> = match comms {
        Comms::Threads(c) => on_threads(locals.iter().zip(c).collect(), |(d, comm)| timed(d, comm)),
        Comms::Rank(comm) => vec![timed(locals[0], comm)],
    };
    let mut devices = Vec::with_capacity(results.len());
    let mut time = Duration::ZERO;
    for r in results {
        let (input, t) = r?;
        devices.push(input);
        time = time.max(t);
    }
    Ok(RoutedInput {
        stride: kjt.stride(),
        ids: kjt.values().len(),
        // Set by a router, whose input a forward must check is this batch's.
        fingerprint: 0,
        layout: Arc::as_ptr(layout) as usize,
        owners,
        bytes: vec![0; devices.len()],
        devices,
        time,
    })
}

/// Routes batches for one [`ShardedEmbeddingBagCollection`] on exchanges of
/// its own, so it can run on another thread while the collection computes
/// (made by [`ShardedEmbeddingBagCollection::input_router`]). Batches must
/// be routed in the order the collection's forwards take them, and on a
/// world every rank routes the same number of batches.
pub struct InputRouter {
    layout: Arc<Layout>,
    configs: Vec<EmbeddingBagConfig>,
    locals: Vec<DeviceRoutes>,
    first: usize,
    comms: RouterComms,
}

enum RouterComms {
    /// A group of its own; replaced after a failed exchange.
    Threads(Mutex<Vec<InProcess>>),
    /// A channel of the world of its own.
    Rank(Arc<dyn Collective>),
}

impl InputRouter {
    /// The input dist of `kjt`: ids checked, routed to their devices,
    /// deduplicated there and made each device's input.
    pub fn route(&self, kjt: &KeyedJaggedTensor) -> Result<RoutedInput, ShardingError> {
        let locals: Vec<&DeviceRoutes> = self.locals.iter().collect();
        let run = |comms| {
            let mut routed =
                route_on(&self.layout, &self.configs, &locals, self.first, comms, kjt)?;
            routed.fingerprint = fingerprint(kjt);
            Ok::<_, ShardingError>(routed)
        };
        match &self.comms {
            RouterComms::Threads(group) => {
                let mut group = group.lock().unwrap_or_else(|e| e.into_inner());
                let before: Vec<u64> = group.iter().map(|c| c.bytes_sent()).collect();
                match run(Comms::Threads(&group)) {
                    Ok(mut routed) => {
                        for ((b, c), before) in
                            routed.bytes.iter_mut().zip(group.iter()).zip(before)
                        {
                            *b = c.bytes_sent() - before;
                        }
                        Ok(routed)
                    }
                    Err(e) => {
                        // Messages of the aborted exchange must not reach the next one.
                        *group = InProcess::group(group.len());
                        Err(e)
                    }
                }
            }
            // A rank's channel counts its bytes with the world's.
            RouterComms::Rank(comm) => run(Comms::Rank(comm.as_ref())),
        }
    }
}

impl ShardedEmbeddingBagCollection {
    /// A router of this collection's batches on exchanges of its own, to run
    /// the input dist of the next batch while this one computes. On a rank,
    /// only where the world's collective opens a second channel
    /// ([`Collective::channel`]); every rank calls this together.
    pub fn input_router(&self) -> Option<InputRouter> {
        let comms = match &self.exec {
            super::Exec::Threads(c) => RouterComms::Threads(Mutex::new(InProcess::group(c.len()))),
            super::Exec::Rank(comm) => RouterComms::Rank(comm.channel()?),
        };
        Some(InputRouter {
            layout: self.layout.clone(),
            configs: self.configs.clone(),
            locals: self.devices.iter().map(|d| d.routing.clone()).collect(),
            first: self.local_offset_device(),
            comms,
        })
    }
}
