//! The device stages: what a device holds, and what each device thread does
//! per stage of a forward (input dist, lookup, output dist) and a backward.

use std::time::{Duration, Instant};

use ember_sparse::{EmbeddingBagCollection, KeyedJaggedTensor, KeyedTensor};

use super::codec::{decode_bags, encode_bags, local_kjt, wire_err, Bags};
use super::layout::Context;
use crate::collective::{Collective, InProcess};
use crate::wire::{Reader, Writer};
use crate::ShardingError;

/// What a device's input dist needs of it: its routes, their local keys,
/// and whether it holds any shard.
#[derive(Clone)]
pub(super) struct DeviceRoutes {
    pub(super) routes: Vec<usize>,
    pub(super) keys: Vec<String>,
    pub(super) has_tables: bool,
}

pub(super) struct Device {
    /// This device's shards, `None` when it holds none.
    pub(super) ebc: Option<EmbeddingBagCollection>,
    /// Global indices of the routes on this device, in local output order.
    /// What it looks up: global routes, their local keys (shared with its
    /// input routers).
    pub(super) routing: DeviceRoutes,
    /// `received[i][src]`: route i's bags from device src (kept for the backward).
    pub(super) received: Vec<Vec<Bags>>,
    /// The forward's input to `ebc`, built from `received`, reused by the
    /// backward unless data-parallel bags arrived with the gradients.
    pub(super) kjt: Option<KeyedJaggedTensor>,
    pub(super) pooled: KeyedTensor,
    pub(super) local_grad: Vec<f32>,
}

/// Times of one device in one call.
#[derive(Clone, Copy, Default)]
pub(super) struct StageTimes(pub(super) [Duration; 3]);

/// Runs `body` once per item, each on its own plain thread (a device
/// blocks on its peers, so devices must all run at once).
pub(super) fn on_threads<T: Send, R: Send>(
    items: Vec<T>,
    body: impl Fn(T) -> Result<R, ShardingError> + Sync,
) -> Vec<Result<R, ShardingError>> {
    std::thread::scope(|scope| {
        let body = &body;
        let handles: Vec<_> = (items.into_iter())
            .map(|x| scope.spawn(move || body(x)))
            .collect();
        (handles.into_iter())
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(ShardingError::Collective("a device thread panicked".into()))
                })
            })
            .collect()
    })
}

/// [`on_threads`] over the devices, each with its endpoint and its `extra`.
pub(super) fn on_devices<R: Send, X: Send>(
    devices: &mut [Device],
    comms: &[InProcess],
    extra: Vec<X>,
    body: impl Fn(&mut Device, &dyn Collective, X) -> Result<R, ShardingError> + Sync,
) -> Vec<Result<R, ShardingError>> {
    let items = devices.iter_mut().zip(comms).zip(extra).collect();
    on_threads(items, |((dev, comm), x)| body(dev, comm, x))
}

/// A device's part of a batch after the input dist: the bags it received
/// for each of its routes from each device, and its shards' input built
/// from them.
pub(super) struct DeviceInput {
    pub(super) received: Vec<Vec<Bags>>,
    pub(super) kjt: Option<KeyedJaggedTensor>,
}

/// The input dist of device `comm.rank()`, which looks up `routes` (global
/// indices) as the local features `keys`: its samples' ids go to their
/// routes' devices, and it receives the bags of its own routes.
pub(super) fn device_input_dist(
    ctx: &Context,
    routes: &[usize],
    keys: &[String],
    has_tables: bool,
    comm: &dyn Collective,
) -> Result<DeviceInput, ShardingError> {
    let me = comm.rank();
    let n = comm.world_size();
    let mine = ctx.owners[me].clone();
    let mut msgs: Vec<Writer> = (0..n).map(|_| Writer::new()).collect();
    for (r, route) in ctx.routes.iter().enumerate() {
        if ctx.forward_sends(r, me) {
            encode_bags(ctx, route, mine.clone(), &mut msgs[route.device], true);
        }
    }
    let messages = comm.all_to_all_v(msgs.into_iter().map(|w| w.0).collect())?;
    let mut received = vec![vec![Bags::default(); n]; routes.len()];
    for (src, msg) in messages.iter().enumerate() {
        let mut reader = Reader::new(msg);
        for (i, &r) in routes.iter().enumerate() {
            if ctx.forward_sends(r, src) {
                received[i][src] = decode_bags(&mut reader)?;
            }
        }
    }
    let kjt = match has_tables {
        true => Some(local_kjt(&received, keys, ctx.owners, ctx.weighted)?),
        false => None,
    };
    Ok(DeviceInput { received, kjt })
}

/// The lookup and output dist of one device, from its routed input.
pub(super) fn device_forward(
    ctx: &Context,
    dev: &mut Device,
    comm: &dyn Collective,
    out: &mut [f32],
    input: DeviceInput,
) -> Result<(StageTimes, u64), ShardingError> {
    let me = comm.rank();
    let n = comm.world_size();
    let mut times = StageTimes::default();
    dev.received = input.received;

    // Lookup.
    let t = Instant::now();
    let mut lookups = 0;
    if let (Some(ebc), Some(kjt)) = (&mut dev.ebc, input.kjt) {
        lookups = kjt.values().len() as u64;
        // Disk-tier shards bring the batch's rows into their caches first.
        ctx.pool.install(|| {
            ebc.prefetch(&kjt)?;
            ebc.forward_into(&kjt, &mut dev.pooled)
        })?;
        dev.kjt = Some(kjt);
    }
    times.0[1] = t.elapsed();

    // Output dist: each source gets its samples' rows of every route here.
    let t = Instant::now();
    let mut msgs: Vec<Writer> = (0..n).map(|_| Writer::new()).collect();
    for (src, w) in msgs.iter_mut().enumerate() {
        for (i, &r) in dev.routing.routes.iter().enumerate() {
            if ctx.forward_sends(r, src) {
                let rows = ctx.owners[src].clone();
                let total = rows.len() * dev.pooled.length_per_key()[i];
                w.put_parts(total, rows.map(|s| dev.pooled.get(s, i)));
            }
        }
    }
    let received = comm.all_to_all_v(msgs.into_iter().map(|w| w.0).collect())?;
    out.fill(0.0);
    let width = ctx.width;
    for (dst, msg) in received.iter().enumerate() {
        let mut reader = Reader::new(msg);
        for (r, route) in ctx
            .routes
            .iter()
            .enumerate()
            .filter(|(_, rt)| rt.device == dst)
        {
            if !ctx.forward_sends(r, me) {
                continue;
            }
            let part: Vec<f32> = reader.get().map_err(wire_err)?;
            let cols = route.columns.len();
            let at = ctx.slots[route.slot].offset + route.columns.start;
            for (s, row) in part.chunks_exact(cols.max(1)).enumerate() {
                let o = &mut out[s * width + at..s * width + at + cols];
                o.iter_mut().zip(row).for_each(|(o, x)| *o += x);
            }
        }
    }
    times.0[2] = t.elapsed();
    Ok((times, lookups))
}

pub(super) fn device_backward(
    ctx: &Context,
    dev: &mut Device,
    comm: &dyn Collective,
    grad: &[f32],
) -> Result<StageTimes, ShardingError> {
    let me = comm.rank();
    let n = comm.world_size();
    let mine = ctx.owners[me].clone();
    let width = ctx.width;
    let mut times = StageTimes::default();

    // Grad dist: every route's columns of this device's samples' gradient
    // to its owner; data-parallel replicas also get the bags they lack.
    let t = Instant::now();
    let mut msgs: Vec<Writer> = (0..n).map(|_| Writer::new()).collect();
    for route in &ctx.routes {
        let slot = &ctx.slots[route.slot];
        let at = slot.offset + route.columns.start;
        let w = &mut msgs[route.device];
        let cols = route.columns.len();
        let rows = (mine.clone())
            .map(|s| s - ctx.offset)
            .map(|s| &grad[s * width + at..s * width + at + cols]);
        w.put_parts(mine.len() * cols, rows);
        if route.data_parallel && route.device != me {
            encode_bags(ctx, route, mine.clone(), w, false);
        }
    }
    let received = comm.all_to_all_v(msgs.into_iter().map(|w| w.0).collect())?;
    let local_width = dev.pooled.width();
    dev.local_grad.clear();
    let total = ctx.owners.last().map_or(0, |o| o.end);
    dev.local_grad.resize(total * local_width, 0.0);
    let mut more_bags = false;
    for (src, msg) in received.iter().enumerate() {
        let mut reader = Reader::new(msg);
        for (i, &r) in dev.routing.routes.iter().enumerate() {
            let part: Vec<f32> = reader.get().map_err(wire_err)?;
            let cols = ctx.routes[r].columns.len();
            let at = dev.pooled.offset_per_key()[i];
            for (s, row) in ctx.owners[src].clone().zip(part.chunks_exact(cols.max(1))) {
                dev.local_grad[s * local_width + at..s * local_width + at + cols]
                    .copy_from_slice(row);
            }
            if ctx.routes[r].data_parallel && src != me {
                dev.received[i][src] = decode_bags(&mut reader)?;
                more_bags = true;
            }
        }
    }
    times.0[0] = t.elapsed();

    let t = Instant::now();
    if let Some(ebc) = &mut dev.ebc {
        if more_bags || dev.kjt.is_none() {
            dev.kjt = Some(local_kjt(
                &dev.received,
                &dev.routing.keys,
                ctx.owners,
                ctx.weighted,
            )?);
        }
        let kjt = dev.kjt.as_ref().expect("built above or by the forward");
        let grad = &dev.local_grad;
        ctx.pool.install(|| ebc.backward_update(kjt, grad))?;
    }
    times.0[1] = t.elapsed();
    Ok(times)
}
