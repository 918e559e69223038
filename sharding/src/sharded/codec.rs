//! The bag codec: a route's bags (local ids, deduplicated or not, and weights)
//! encoded for and decoded from the wire, and received bags made a local KJT.

use std::ops::Range;

use ember_sparse::KeyedJaggedTensor;

use super::layout::{Context, Route};
use crate::wire::{Reader, Writer};
use crate::ShardingError;

/// The bags of one route from one source device (local ids).
#[derive(Clone, Debug, Default)]
pub(super) struct Bags {
    lengths: Vec<u32>,
    values: Vec<i64>,
    weights: Vec<f32>,
}

pub(super) fn wire_err(e: String) -> ShardingError {
    ShardingError::Collective(format!("malformed message: {e}"))
}

/// The bags of `route` for the samples of `samples`, in local ids.
pub(super) fn encode_bags(
    ctx: &Context,
    route: &Route,
    samples: Range<usize>,
    w: &mut Writer,
    dedup: bool,
) {
    let mut lengths = Vec::with_capacity(samples.len());
    let mut ids = Vec::new();
    let mut weights = Vec::new();
    let split_mean = ctx.slots[route.slot].split_mean;
    for s in samples {
        let (bag, bag_w) = ctx.bag(route.slot, s);
        // As the unsharded backward scales an id: weight x 1/len of the whole bag.
        let bag_scale = match split_mean && !bag.is_empty() {
            true => 1.0 / bag.len() as f32,
            false => 1.0,
        };
        let before = ids.len();
        for (p, &id) in bag.iter().enumerate() {
            if let Some(local) = route.rows.route(id) {
                ids.push(local);
                if ctx.weighted {
                    weights.push(bag_w.map_or(1.0, |bw| bw[p]) * bag_scale);
                }
            }
        }
        lengths.push((ids.len() - before) as u32);
    }
    w.put(&lengths);
    if dedup {
        // Unique ids once, then one index per occurrence.
        let mut index = std::collections::HashMap::with_capacity(ids.len());
        let mut unique = Vec::new();
        let inverse: Vec<u32> = ids
            .iter()
            .map(|&id| {
                *index.entry(id).or_insert_with(|| {
                    unique.push(id);
                    (unique.len() - 1) as u32
                })
            })
            .collect();
        w.put(&unique);
        w.put(&inverse);
    } else {
        w.put(&ids);
        w.put::<u32>(&[]);
    }
    w.put(&weights);
}

pub(super) fn decode_bags(r: &mut Reader) -> Result<Bags, ShardingError> {
    let lengths: Vec<u32> = r.get().map_err(wire_err)?;
    let unique: Vec<i64> = r.get().map_err(wire_err)?;
    let inverse: Vec<u32> = r.get().map_err(wire_err)?;
    let weights: Vec<f32> = r.get().map_err(wire_err)?;
    let values = if inverse.is_empty() {
        unique
    } else {
        inverse
            .iter()
            .map(|&i| {
                unique
                    .get(i as usize)
                    .copied()
                    .ok_or_else(|| wire_err("index past the unique ids".into()))
            })
            .collect::<Result<_, _>>()?
    };
    Ok(Bags {
        lengths,
        values,
        weights,
    })
}

/// The local KJT of a device from the bags it holds, over the whole batch.
pub(super) fn local_kjt(
    received: &[Vec<Bags>],
    keys: &[String],
    owners: &[Range<usize>],
    weighted: bool,
) -> Result<KeyedJaggedTensor, ShardingError> {
    let mut lengths = Vec::new();
    let mut values = Vec::new();
    let mut weights = Vec::new();
    for per_src in received {
        for (bags, o) in per_src.iter().zip(owners) {
            if bags.lengths.is_empty() {
                lengths.extend(std::iter::repeat_n(0i64, o.len()));
            } else {
                lengths.extend(bags.lengths.iter().map(|&l| l as i64));
                values.extend_from_slice(&bags.values);
                if weighted {
                    weights.extend_from_slice(&bags.weights);
                }
            }
        }
    }
    Ok(KeyedJaggedTensor::from_lengths(
        keys.to_vec(),
        values,
        &lengths,
        weighted.then_some(weights),
    )?)
}
