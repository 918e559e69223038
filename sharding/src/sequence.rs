//! The sharded `EmbeddingCollection`: unpooled lookups (one row per id,
//! TorchRec's `ShardedEmbeddingCollection`) over tables split by rows
//! (table-wise, row-wise, row-wise mod, table-row-wise). One instance per
//! device, each holding its shards as an ordinary [`EmbeddingCollection`]
//! and its own samples' ids; a step is two all-to-alls forward and one
//! backward:
//!
//! ```text
//! forward:  ids out     each id goes to the device owning its row
//!                       (grouped by the owner's shard, in position order)
//!           lookup      owners read their shards' rows (every table dtype)
//!           rows back   whole rows return to the ids' devices and are
//!                       placed at their positions
//! backward: grads out   each position's gradient row goes to the owner
//!           update      owners run the fused backward on their shards:
//!                       equal ids merge into one update, as unsharded
//! ```
//!
//! Unpooled rows are never split by columns: a column-wise or
//! data-parallel plan is refused. A key-value table is table-wise or
//! row-wise by buckets: its raw ids go to their owners, whose maps find
//! (or give) their rows. Owners serve each shard feature by
//! feature, source device by source device: with every device's samples
//! in rank order that is the unsharded collection's order, so equal ids'
//! gradients sum in the same order and a sharded step on fp32 tables
//! holds the same bits as the unsharded step on the whole batch (fp16 and
//! bf16 shards round stochastically from their own seeds: near, not
//! bitwise). Works over any [`Collective`]: threads of this process
//! ([`ShardedEmbeddingCollection::threads`]) or MPI ranks.

use std::collections::HashMap;
use std::sync::Arc;

use ember_sparse::{
    EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, JaggedEmbeddings, KeyedJaggedTensor,
    SparseError, TablePart,
};

use crate::collective::{Collective, InProcess};
use crate::plan::{RowSplit, ShardingPlan, ShardingType};
use crate::wire::{Reader, Writer};
use crate::ShardingError;

/// Where one shard of a table lives.
#[derive(Clone, Copy, Debug)]
struct Place {
    device: usize,
    rows: RowSplit,
    /// Its table's index in the device's local collection.
    local: usize,
    /// The device's slot of the table's first feature (one slot per shard
    /// and feature, so that the owner serves the ids feature by feature,
    /// in the unsharded collection's order).
    first_slot: usize,
}

/// An `EmbeddingCollection`'s tables split over devices by a
/// [`ShardingPlan`] (see the [module docs](self)); this device's part.
pub struct ShardedEmbeddingCollection {
    configs: Vec<EmbeddingConfig>,
    /// Each table's shards.
    places: Vec<Vec<Place>>,
    /// Each feature's table, and its index among the table's features.
    tables_of: HashMap<String, (usize, usize)>,
    /// Slots on each device (the same on every rank).
    slot_counts: Vec<usize>,
    /// This device's shards, feature `s<slot>` of a slot's shard reading
    /// its local table.
    local: EmbeddingCollection,
    collective: Arc<dyn Collective>,
    /// The last forward's routing, for its backward.
    last: Option<Routing>,
}

/// Where each id of a forward went and what this device served.
struct Routing {
    /// Per input position: (owner, slot there, index among the ids this
    /// device sent to that slot).
    positions: Vec<(usize, usize, usize)>,
    /// Per owner: ids sent to each of its slots.
    sent: Vec<Vec<usize>>,
    /// The lookup this device ran for the others (local features, one
    /// sample per source device).
    served: KeyedJaggedTensor,
}

fn local_feature(k: usize) -> String {
    format!("s{k}")
}

impl ShardedEmbeddingCollection {
    /// Every device's part of `source` as `plan` places it, each with an
    /// in-process collective: run device `d`'s part on its own thread, with
    /// the `d`-th block of the batch's samples.
    pub fn threads(
        source: &EmbeddingCollection,
        plan: &ShardingPlan,
    ) -> Result<Vec<Self>, ShardingError> {
        (InProcess::group(plan.num_devices).into_iter())
            .map(|c| Self::on_rank(source, plan, Arc::new(c)))
            .collect()
    }

    /// This rank's part of `source` (its rows and step count; the
    /// optimizer state starts fresh, as `source`'s does before its first
    /// update) as `plan` places it, exchanging over `collective` (one rank
    /// per device of the plan).
    pub fn on_rank(
        source: &EmbeddingCollection,
        plan: &ShardingPlan,
        collective: Arc<dyn Collective>,
    ) -> Result<Self, ShardingError> {
        let configs = source.configs().to_vec();
        let bags: Vec<EmbeddingBagConfig> = configs.iter().map(|c| c.bag_config()).collect();
        plan.validate(&bags, source.optimizer())?;
        if collective.world_size() != plan.num_devices {
            return Err(ShardingError::Plan(format!(
                "the plan has {} devices, the collective {} ranks",
                plan.num_devices,
                collective.world_size()
            )));
        }
        let me = collective.rank();
        let mut places = vec![Vec::new(); configs.len()];
        let mut local_counts = vec![0; plan.num_devices];
        let mut slot_counts = vec![0; plan.num_devices];
        let mut local_configs = Vec::new();
        let mut local_sources = Vec::new();
        for (t, c) in configs.iter().enumerate() {
            let p = (plan.tables.iter().find(|p| p.table == c.name))
                .ok_or_else(|| ShardingError::Plan(format!("table {} has no plan", c.name)))?;
            if matches!(
                p.sharding,
                ShardingType::ColumnWise | ShardingType::DataParallel
            ) {
                return Err(ShardingError::Plan(format!(
                    "table {}: {:?} splits or replicates rows an unpooled lookup returns whole; \
                     shard an embedding collection table-wise or row-wise",
                    c.name, p.sharding
                )));
            }
            for shard in &p.shards {
                let local = local_counts[shard.device];
                local_counts[shard.device] += 1;
                let first_slot = slot_counts[shard.device];
                slot_counts[shard.device] += c.feature_names.len();
                places[t].push(Place {
                    device: shard.device,
                    rows: shard.rows,
                    local,
                    first_slot,
                });
                if shard.device == me {
                    let rows = shard.rows.count(c.num_embeddings);
                    let features: Vec<String> = (first_slot..first_slot + c.feature_names.len())
                        .map(local_feature)
                        .collect();
                    let features: Vec<&str> = features.iter().map(String::as_str).collect();
                    // A key-value shard of buckets has its own fallback row.
                    let fallback = shard.rows.buckets().is_some() as usize;
                    let mut lc = EmbeddingConfig::new(
                        &format!("{}.{local}", c.name),
                        rows + fallback,
                        c.embedding_dim,
                        &features,
                    );
                    lc.data_type = c.data_type;
                    if c.kv.is_some() {
                        // New ids' rows drawn as the whole table draws them.
                        let (lo, hi) = c.bag_config().init_range();
                        (lc.weight_init_min, lc.weight_init_max) = (Some(lo), Some(hi));
                        lc.kv = c.kv.clone();
                    }
                    local_configs.push(lc);
                    local_sources.push((t, shard.rows, rows));
                }
            }
        }
        let mut local = EmbeddingCollection::new(local_configs, *source.optimizer(), 0)?;
        let dim = source.dim();
        let mut row = vec![0.0f32; dim];
        for (k, &(t, split, rows)) in local_sources.iter().enumerate() {
            let (from, to) = (&source.tables()[t], &mut local.tables_mut()[k]);
            if !from.is_key_value() {
                for l in 0..rows {
                    from.try_read_row(split.global(l), &mut row)?;
                    to.write_row(l, &row);
                }
                continue;
            }
            // A key-value table: whole with its map, or its ids of the
            // shard's buckets in its first rows; new ids' rows are drawn
            // by the table's place, as the whole table draws them.
            to.set_part(TablePart {
                table: t as u64,
                first_row: split.global(0) as u64,
                row_step: 1,
                first_column: 0,
            });
            let sliced = (split.buckets()).and_then(|(r, b, of)| from.kv_slice(r, b, of));
            let (from_rows, state) = match sliced {
                Some(slice) => (slice.from_rows, slice.state),
                None => (
                    (0..rows).collect(),
                    from.kv_state().expect("a key-value table"),
                ),
            };
            for (l, &g) in from_rows.iter().enumerate() {
                from.try_read_row(g, &mut row)?;
                to.write_row(l, &row);
            }
            to.load_kv_state(state)?;
        }
        local.set_step(source.step());
        let tables_of = (configs.iter().enumerate())
            .flat_map(|(t, c)| {
                c.feature_names
                    .iter()
                    .enumerate()
                    .map(move |(i, f)| (f.clone(), (t, i)))
            })
            .collect();
        Ok(Self {
            configs,
            places,
            tables_of,
            slot_counts,
            local,
            collective,
            last: None,
        })
    }

    /// The tables, as the unsharded collection has them.
    pub fn configs(&self) -> &[EmbeddingConfig] {
        &self.configs
    }

    /// This device's shards (a local table per shard).
    pub fn local(&self) -> &EmbeddingCollection {
        &self.local
    }

    /// Training (the default) or inference: key-value shards admit new
    /// ids only in training.
    pub fn set_training(&mut self, training: bool) {
        self.local.set_training(training);
    }

    /// The rows of this device's samples' ids (`kjt`: its samples only),
    /// in [`EmbeddingCollection::forward`]'s layout. Every device calls it
    /// together.
    pub fn forward(&mut self, kjt: &KeyedJaggedTensor) -> Result<JaggedEmbeddings, ShardingError> {
        let n = self.collective.world_size();
        let dim = self.configs.first().map_or(0, |c| c.embedding_dim);
        // Route: each id to its owner's local table.
        let mut sent: Vec<Vec<usize>> = self.slot_counts.iter().map(|&k| vec![0; k]).collect();
        let mut ids: Vec<Vec<Vec<i64>>> = self
            .slot_counts
            .iter()
            .map(|&k| vec![Vec::new(); k])
            .collect();
        let mut positions = Vec::with_capacity(kjt.values().len());
        let b = kjt.stride();
        for (k, key) in kjt.keys().iter().enumerate() {
            let (t, fi) = *self
                .tables_of
                .get(key)
                .ok_or_else(|| SparseError::MissingFeature(key.clone()))?;
            let rows = self.configs[t].num_embeddings;
            // A key-value table's raw ids: its owners' maps find the rows.
            let raw = self.configs[t].kv.is_some();
            let offsets = &kjt.offsets()[k * b..=(k + 1) * b];
            for s in 0..b {
                for &id in &kjt.values()[offsets[s]..offsets[s + 1]] {
                    if !raw && (id < 0 || id as usize >= rows) {
                        return Err(SparseError::IdOutOfRange {
                            table: self.configs[t].name.clone(),
                            feature: key.clone(),
                            sample: s,
                            id,
                            rows,
                        }
                        .into());
                    }
                    let place = (self.places[t].iter())
                        .find_map(|p| p.rows.route(id).map(|l| (p, l)))
                        .expect("a validated plan covers every row and bucket");
                    let (p, l) = place;
                    let slot = p.first_slot + fi;
                    positions.push((p.device, slot, sent[p.device][slot]));
                    sent[p.device][slot] += 1;
                    ids[p.device][slot].push(l);
                }
            }
        }
        let send: Vec<Vec<u8>> = (0..n)
            .map(|d| {
                let counts: Vec<i64> = sent[d].iter().map(|&c| c as i64).collect();
                let mut w = Writer::new();
                w.put(&counts);
                w.put(&ids[d].concat());
                w.0
            })
            .collect();
        let received = self.collective.all_to_all_v(send)?;
        // Serve: slot k, sample s = source device s.
        let mine = self.slot_counts[self.collective.rank()];
        let mut lengths = vec![0i64; mine * n];
        let mut served_ids: Vec<Vec<i64>> = vec![Vec::new(); mine];
        for (s, bytes) in received.iter().enumerate() {
            let mut r = Reader::new(bytes);
            let (counts, ids) = (r.get::<i64>(), r.get::<i64>());
            let (counts, ids) = (counts.map_err(garbled(s))?, ids.map_err(garbled(s))?);
            let total: i64 = counts.iter().sum();
            if counts.len() != mine || counts.iter().any(|&c| c < 0) || total != ids.len() as i64 {
                let m = format!(
                    "{} slot counts summing to {total} for {} ids",
                    counts.len(),
                    ids.len()
                );
                return Err(garbled(s)(m));
            }
            let mut at = 0;
            for (k, &count) in counts.iter().enumerate() {
                lengths[k * n + s] = count;
                served_ids[k].extend_from_slice(&ids[at..at + count as usize]);
                at += count as usize;
            }
        }
        let keys: Vec<String> = (0..mine).map(local_feature).collect();
        let served = KeyedJaggedTensor::from_lengths(keys, served_ids.concat(), &lengths, None)?;
        let rows = match mine {
            0 => Vec::new(),
            _ => {
                // Key-value shards look their raw ids up first.
                self.local.prefetch(&served)?;
                self.local.forward(&served)?.values().to_vec()
            }
        };
        // Rows back to each source, slot by slot.
        let mut replies: Vec<Vec<f32>> = vec![Vec::new(); n];
        let mut at = 0;
        for k in 0..mine {
            for (s, reply) in replies.iter_mut().enumerate() {
                let count = lengths[k * n + s] as usize;
                reply.extend_from_slice(&rows[at * dim..(at + count) * dim]);
                at += count;
            }
        }
        let back = exchange_rows(self.collective.as_ref(), replies, &sent, dim)?;
        // Place each position's row.
        let starts = slot_starts(&sent);
        let mut values = vec![0.0f32; positions.len() * dim];
        for (p, &(d, k, j)) in positions.iter().enumerate() {
            let r = starts[d][k] + j;
            values[p * dim..(p + 1) * dim].copy_from_slice(&back[d][r * dim..(r + 1) * dim]);
        }
        self.last = Some(Routing {
            positions,
            sent,
            served,
        });
        let offsets = kjt.offsets().to_vec();
        Ok(JaggedEmbeddings::from_parts(
            kjt.keys().to_vec(),
            b,
            dim,
            offsets,
            values,
        )?)
    }

    /// The backward of the last [`forward`](Self::forward) (`grad`: its
    /// rows' gradients, `[ids, dim]`), with the optimizer fused on the
    /// owners. Every device calls it together.
    pub fn backward_update(&mut self, grad: &[f32]) -> Result<(), ShardingError> {
        let n = self.collective.world_size();
        let last = (self.last.take())
            .ok_or_else(|| ShardingError::Plan("a backward without its forward".into()))?;
        let dim = self.configs.first().map_or(0, |c| c.embedding_dim);
        if grad.len() != last.positions.len() * dim {
            return Err(SparseError::GradShape {
                rows: grad.len() / dim.max(1),
                cols: dim,
                expected_rows: last.positions.len(),
                expected_cols: dim,
            }
            .into());
        }
        let starts = slot_starts(&last.sent);
        let mut out: Vec<Vec<f32>> = (last.sent.iter())
            .map(|c| vec![0.0; c.iter().sum::<usize>() * dim])
            .collect();
        for (p, &(d, k, j)) in last.positions.iter().enumerate() {
            let r = starts[d][k] + j;
            out[d][r * dim..(r + 1) * dim].copy_from_slice(&grad[p * dim..(p + 1) * dim]);
        }
        // What each source sends this device: the rows it served it.
        let mine = self.slot_counts[self.collective.rank()];
        let b = last.served.stride();
        let expected: Vec<Vec<usize>> = (0..n)
            .map(|s| {
                (0..mine)
                    .map(|k| {
                        last.served.offsets()[k * b + s + 1] - last.served.offsets()[k * b + s]
                    })
                    .collect()
            })
            .collect();
        let received = exchange_rows(self.collective.as_ref(), out, &expected, dim)?;
        // Back into the served order: slot k, then source s.
        let mut grads = Vec::with_capacity(last.served.values().len() * dim);
        let mut taken = vec![0usize; n];
        for k in 0..mine {
            for (s, rows) in received.iter().enumerate() {
                let count = last.served.offsets()[k * b + s + 1] - last.served.offsets()[k * b + s];
                grads.extend_from_slice(&rows[taken[s] * dim..(taken[s] + count) * dim]);
                taken[s] += count;
            }
        }
        if mine > 0 {
            self.local.backward_update(&last.served, &grads)?;
        }
        Ok(())
    }

    /// Table `t`'s rows, gathered whole on rank 0 (`[rows, dim]`; `None`
    /// on the other ranks), for checkpoints. Every device calls it
    /// together.
    pub fn gather_table(&self, t: usize) -> Result<Option<Vec<f32>>, ShardingError> {
        if self.configs[t].kv.is_some() {
            return Err(ShardingError::Source(format!(
                "table '{}' is a key-value table: its rows mean nothing without its shards' maps, which are not gathered here",
                self.configs[t].name
            )));
        }
        let n = self.collective.world_size();
        let (config, dim) = (&self.configs[t], self.configs[t].embedding_dim);
        let me = self.collective.rank();
        let mut send: Vec<Vec<f32>> = vec![Vec::new(); n];
        let mut row = vec![0.0f32; dim];
        for p in self.places[t].iter().filter(|p| p.device == me) {
            let table = &self.local.tables()[p.local];
            for l in 0..p.rows.count(config.num_embeddings) {
                table.try_read_row(l, &mut row)?;
                send[0].extend_from_slice(&row);
            }
        }
        // Rank 0 hears each device's shards of the table, in plan order.
        let expected: Vec<Vec<usize>> = (0..n)
            .map(|d| match me {
                0 => (self.places[t].iter())
                    .filter(|p| p.device == d)
                    .map(|p| p.rows.count(config.num_embeddings))
                    .collect(),
                _ => Vec::new(),
            })
            .collect();
        let received = exchange_rows(self.collective.as_ref(), send, &expected, dim)?;
        if me != 0 {
            return Ok(None);
        }
        let mut rows = vec![0.0f32; config.num_embeddings * dim];
        let mut read = vec![0usize; n];
        for p in &self.places[t] {
            for l in 0..p.rows.count(config.num_embeddings) {
                let g = p.rows.global(l);
                let at = read[p.device];
                rows[g * dim..(g + 1) * dim].copy_from_slice(&received[p.device][at..at + dim]);
                read[p.device] += dim;
            }
        }
        Ok(Some(rows))
    }
}

/// An error for a message from rank `source` that does not parse as the
/// plan says it should (another plan, or a truncated message).
fn garbled(source: usize) -> impl Fn(String) -> ShardingError {
    move |m| {
        ShardingError::Collective(format!(
            "a message from rank {source} does not fit the plan: {m}"
        ))
    }
}

/// Each owner's first row of each of its slots, in the rows sent to it.
fn slot_starts(sent: &[Vec<usize>]) -> Vec<Vec<usize>> {
    (sent.iter())
        .map(|c| {
            c.iter()
                .scan(0, |a, &x| {
                    let s = *a;
                    *a += x;
                    Some(s)
                })
                .collect()
        })
        .collect()
}

/// Sends `rows[d]` to each device `d`; returns what each device sent,
/// checked to hold `expected[s]` rows (summed) of `dim` floats from device `s`.
fn exchange_rows(
    collective: &dyn Collective,
    rows: Vec<Vec<f32>>,
    expected: &[Vec<usize>],
    dim: usize,
) -> Result<Vec<Vec<f32>>, ShardingError> {
    let send = (rows.iter())
        .map(|r| {
            let mut w = Writer::new();
            w.put(r);
            w.0
        })
        .collect();
    let received = collective.all_to_all_v(send)?;
    (received.iter().enumerate())
        .map(|(s, bytes)| {
            let got = Reader::new(bytes).get::<f32>().map_err(garbled(s))?;
            let want = expected[s].iter().sum::<usize>() * dim;
            match got.len() == want {
                true => Ok(got),
                false => Err(garbled(s)(format!("{} floats for {want}", got.len()))),
            }
        })
        .collect()
}
