//! The sharded collection. Each device (a thread here) owns an ordinary
//! `EmbeddingBagCollection` of its shards; a step runs in three stages, each
//! ending in one all-to-all-v:
//!
//! ```text
//! forward:  input dist   each device sends the ids of its own samples to the
//!                        devices owning their rows (unique ids + indices)
//!           lookup       owners pool their shards' rows (partial sums for
//!                        row splits) with the fused kernels
//!           output dist  pooled slices go back to the samples' devices,
//!                        summed (row splits) or placed (column splits)
//! backward: grad dist    gradient slices go to the owners; data-parallel
//!                        replicas get every device's bags and gradients
//!           update       owners run the fused backward on their shards
//! ```
//! Two ways to run: every device a thread of this process (`from_collection`:
//! the input is the whole batch, samples owned in contiguous blocks, device
//! d: `B*d/N..B*(d+1)/N`, and the output is the whole batch's), or this
//! process one rank of a multi-process world holding its own device only
//! (`from_collection_on_rank`: the input is this rank's samples, blocks in
//! rank order, and the output is theirs).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingTable, KeyedJaggedTensor, KeyedTensor,
    PoolingType, SparseError, TableOptimizer,
};
use serde::Serialize;

use crate::collective::{Collective, InProcess};
use crate::plan::{RowSplit, Shard, ShardingPlan, ShardingType};
use crate::wire::{Reader, Writer};
use crate::ShardingError;

/// One output feature of the whole collection.
#[derive(Clone, Debug)]
struct Slot {
    feature: String,
    table: usize,
    /// Column of the feature's pooled vector in an output row.
    offset: usize,
    /// Mean pooling over a row-split table: each shard sees only part of a
    /// bag, so the mean's 1/len travels as a per-id weight (computed as the
    /// unsharded kernel computes its scale) and shards sum.
    split_mean: bool,
}

/// One (feature, shard): what a device looks up for a feature.
#[derive(Clone, Debug)]
struct Route {
    slot: usize,
    /// The shard's index in its table's plan.
    shard: usize,
    device: usize,
    rows: RowSplit,
    columns: Range<usize>,
    data_parallel: bool,
}

/// The bags of one route from one source device (local ids).
#[derive(Clone, Debug, Default)]
struct Bags {
    lengths: Vec<u32>,
    values: Vec<i64>,
    weights: Vec<f32>,
}

struct Device {
    /// This device's shards, `None` when it holds none.
    ebc: Option<EmbeddingBagCollection>,
    /// Global indices of the routes on this device, in local output order.
    routes: Vec<usize>,
    keys: Vec<String>,
    /// `received[i][src]`: route i's bags from device src (kept for the backward).
    received: Vec<Vec<Bags>>,
    /// The forward's input to `ebc`, built from `received`, reused by the
    /// backward unless data-parallel bags arrived with the gradients.
    kjt: Option<KeyedJaggedTensor>,
    pooled: KeyedTensor,
    local_grad: Vec<f32>,
}

/// One shard of a table as this process holds it.
pub struct LocalShard<'a> {
    /// The (global) table's name.
    pub table: &'a str,
    /// The shard's position in the table's plan.
    pub index: usize,
    /// Which rows and columns of the table.
    pub shard: &'a crate::plan::Shard,
    /// Its rows (local order) and optimizer state.
    pub data: &'a EmbeddingTable,
}

/// Counters of the sharded execution, summed over calls (stage times are
/// the slowest device's per call).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardingStats {
    /// Backward updates run by this collection (since it was made).
    pub steps: u64,
    /// Ids looked up by each device.
    pub lookups: Vec<u64>,
    /// Bytes each device sent to other devices.
    pub bytes_sent: Vec<u64>,
    /// Forward: sending ids to the devices owning their rows.
    pub input_dist: Duration,
    /// Forward: the owners' pooled lookups.
    pub lookup: Duration,
    /// Forward: sending pooled slices back to the samples' devices.
    pub output_dist: Duration,
    /// Backward: sending gradient slices to the owners.
    pub grad_dist: Duration,
    /// Backward: the owners' fused optimizer updates.
    pub update: Duration,
}

/// Times of one device in one call.
#[derive(Clone, Copy, Default)]
struct StageTimes([Duration; 3]);

/// An `EmbeddingBagCollection` split over devices by a [`ShardingPlan`];
/// results equal the unsharded collection's up to summation order.
pub struct ShardedEmbeddingBagCollection {
    configs: Vec<EmbeddingBagConfig>,
    plan: ShardingPlan,
    optimizer: TableOptimizer,
    layout: Layout,
    /// The devices this process runs (all, or its rank's one).
    devices: Vec<Device>,
    exec: Exec,
    step: u64,
    stats: ShardingStats,
    /// Bytes sent through collectives replaced after a failed exchange.
    bytes_before: Vec<u64>,
    /// Batch size and id count of the last forward: a backward must match it.
    last_forward: Option<(usize, usize)>,
    /// Every device's samples in the last forward (global positions).
    owners: Vec<Range<usize>>,
}

enum Exec {
    /// Every device in this process, one thread each.
    Threads(Vec<InProcess>),
    /// This process is rank `rank()` of a multi-process world.
    Rank(Arc<dyn Collective>),
}

/// What every device reads and none changes: the features, the routes, and
/// the pool the kernels run in.
struct Layout {
    slots: Vec<Slot>,
    routes: Vec<Route>,
    /// Width of an output row.
    width: usize,
    /// Some feature is a row-split mean (its 1/len travels as weights).
    any_split_mean: bool,
    /// The pool the collection was made in. Only kernels run there: a device
    /// body blocks on its peers, which would starve a pool with fewer
    /// threads than devices, so device bodies are plain threads.
    pool: Arc<rayon::ThreadPool>,
}

impl Layout {
    /// The view of one call's input that the device stages share.
    fn context<'a>(
        &'a self,
        kjt: &'a KeyedJaggedTensor,
        keys: &'a [usize],
        owners: &'a [Range<usize>],
        offset: usize,
    ) -> Context<'a> {
        Context {
            layout: self,
            kjt,
            keys,
            owners,
            offset,
            weighted: kjt.weights().is_some() || self.any_split_mean,
        }
    }
}

fn local_name(name: &str, shard: usize) -> String {
    format!("{name}#{shard}")
}

impl ShardedEmbeddingBagCollection {
    /// Splits `ebc` (weights, optimizer state and step) by `plan`, every
    /// device a thread of this process.
    pub fn from_collection(
        ebc: &EmbeddingBagCollection,
        plan: ShardingPlan,
    ) -> Result<Self, ShardingError> {
        let n = plan.num_devices;
        let (configs, optimizer) = layout_of(ebc);
        let exec = Exec::Threads(InProcess::group(n));
        Self::build(configs, optimizer, ebc.step(), ebc, plan, exec)
    }

    /// The shards of device `comm.rank()` only, filled from `source`: this
    /// process is that rank of a world of `plan.num_devices` processes, each
    /// making the same call. Only this rank's shards are ever in memory.
    pub fn on_rank(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        step: u64,
        source: &dyn ShardSource,
        plan: ShardingPlan,
        comm: Arc<dyn Collective>,
    ) -> Result<Self, ShardingError> {
        if comm.world_size() != plan.num_devices {
            return Err(ShardingError::Plan(format!(
                "the plan has {} devices for {} ranks: each rank runs one device",
                plan.num_devices,
                comm.world_size()
            )));
        }
        Self::build(configs, optimizer, step, source, plan, Exec::Rank(comm))
    }

    /// The shards of device `comm.rank()` only: this process is that rank of
    /// a world of `plan.num_devices` processes, each making the same call.
    pub fn from_collection_on_rank(
        ebc: &EmbeddingBagCollection,
        plan: ShardingPlan,
        comm: Arc<dyn Collective>,
    ) -> Result<Self, ShardingError> {
        let (configs, optimizer) = layout_of(ebc);
        Self::on_rank(configs, optimizer, ebc.step(), ebc, plan, comm)
    }

    fn build(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        step: u64,
        source: &dyn ShardSource,
        plan: ShardingPlan,
        exec: Exec,
    ) -> Result<Self, ShardingError> {
        plan.validate(&configs, &optimizer)?;
        let n = plan.num_devices;
        let mut slots = Vec::new();
        let mut offset = 0;
        // A table whose shards hold every row keeps its pooling on each
        // shard (a shard sees whole bags); a row-split one sums on shards.
        let row_split = |c: &EmbeddingBagConfig| {
            let p = plan.table(&c.name).expect("validated");
            p.shards.iter().any(|s| s.rows != RowSplit::All)
        };
        for (t, c) in configs.iter().enumerate() {
            for f in &c.feature_names {
                slots.push(Slot {
                    feature: f.clone(),
                    table: t,
                    offset,
                    split_mean: c.pooling == PoolingType::Mean && row_split(c),
                });
                offset += c.embedding_dim;
            }
        }
        let mut routes = Vec::new();
        let mut local_tables: Vec<Vec<(EmbeddingBagConfig, usize, usize)>> = vec![Vec::new(); n];
        for (t, c) in configs.iter().enumerate() {
            let p = plan.table(&c.name).expect("validated");
            for (k, shard) in p.shards.iter().enumerate() {
                let features: Vec<String> =
                    c.feature_names.iter().map(|f| local_name(f, k)).collect();
                let feature_refs: Vec<&str> = features.iter().map(String::as_str).collect();
                let pooling = match row_split(c) {
                    true => PoolingType::Sum,
                    false => c.pooling,
                };
                let cfg = EmbeddingBagConfig::new(
                    &local_name(&c.name, k),
                    shard.rows.count(c.num_embeddings),
                    shard.columns[1] - shard.columns[0],
                    &feature_refs,
                )
                .with_pooling(pooling);
                local_tables[shard.device].push((cfg, t, k));
                for (i, _) in slots.iter().enumerate().filter(|(_, s)| s.table == t) {
                    routes.push(Route {
                        slot: i,
                        shard: k,
                        device: shard.device,
                        rows: shard.rows,
                        columns: shard.column_range(),
                        data_parallel: p.sharding == ShardingType::DataParallel,
                    });
                }
            }
        }
        let mut devices = Vec::with_capacity(n);
        let here = |d: usize| match &exec {
            Exec::Threads(_) => true,
            Exec::Rank(comm) => comm.rank() == d,
        };
        for (d, tables) in local_tables.into_iter().enumerate() {
            if !here(d) {
                continue;
            }
            let my_routes: Vec<usize> = (0..routes.len())
                .filter(|&r| routes[r].device == d)
                .collect();
            let keys: Vec<String> = my_routes
                .iter()
                .map(|&r| local_name(&slots[routes[r].slot].feature, routes[r].shard))
                .collect();
            let ebc_local = if tables.is_empty() {
                None
            } else {
                let cfgs: Vec<EmbeddingBagConfig> =
                    tables.iter().map(|(c, _, _)| c.clone()).collect();
                // Zeros: every table is filled from the source below.
                let mut local = EmbeddingBagCollection::zeroed(cfgs, optimizer)?;
                for ((_, t, k), table) in tables.iter().zip(local.tables_mut()) {
                    let shard = &plan.table(&configs[*t].name).expect("validated").shards[*k];
                    source.fill(*t, &configs[*t], shard, table)?;
                }
                local.set_step(step);
                Some(local)
            };
            let pooled = ebc_local.as_ref().map_or_else(
                || KeyedTensor::zeros(vec![], vec![], 0),
                |e| e.new_output(0),
            );
            devices.push(Device {
                ebc: ebc_local,
                received: vec![vec![Bags::default(); n]; my_routes.len()],
                routes: my_routes,
                keys,
                pooled,
                local_grad: Vec::new(),
                kjt: None,
            });
        }
        let layout = Layout {
            any_split_mean: slots.iter().any(|s| s.split_mean),
            slots,
            routes,
            width: offset,
            pool: Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(rayon::current_num_threads())
                    .build()
                    .map_err(|e| ShardingError::Collective(format!("a device thread pool: {e}")))?,
            ),
        };
        Ok(Self {
            configs,
            plan,
            optimizer,
            layout,
            devices,
            exec,
            bytes_before: vec![0; n],
            last_forward: None,
            owners: Vec::new(),
            step,
            stats: ShardingStats {
                lookups: vec![0; n],
                bytes_sent: vec![0; n],
                ..Default::default()
            },
        })
    }

    /// The unsharded collection: every shard's rows and state gathered back
    /// (data-parallel tables from device 0's replica). On a rank, every rank
    /// must call this together: the shards travel to every rank.
    pub fn to_collection(&self) -> Result<EmbeddingBagCollection, ShardingError> {
        // Zeroed, not initialised: the shards below cover every row and state float.
        let mut ebc = EmbeddingBagCollection::zeroed(self.configs.clone(), self.optimizer)?;
        // (table, shard index, shard) of every shard that is gathered.
        let wanted: Vec<(usize, usize, &crate::plan::Shard)> = (self.configs.iter().enumerate())
            .flat_map(|(t, c)| {
                let p = self.plan.table(&c.name).expect("validated");
                let dp = p.sharding == ShardingType::DataParallel;
                (p.shards.iter().enumerate())
                    .filter(move |(_, s)| !dp || s.device == 0)
                    .map(move |(k, s)| (t, k, s))
            })
            .collect();
        let local = |t: usize, k: usize, device: usize| {
            let d = self.device_index(device).expect("a shard of this process");
            (self.devices[d].ebc.as_ref())
                .and_then(|e| e.table(&local_name(&self.configs[t].name, k)))
                .expect("every shard has a local table")
        };
        match &self.exec {
            Exec::Threads(_) => {
                for &(t, k, shard) in &wanted {
                    let l = local(t, k, shard.device);
                    let rows = (l.weights(), l.optimizer_state(), l.num_embeddings());
                    copy_rows_back(rows, &mut ebc.tables_mut()[t], shard, &self.optimizer);
                }
            }
            Exec::Rank(comm) => {
                let me = comm.rank();
                let mut w = Writer::new();
                for &(t, k, _) in wanted.iter().filter(|(_, _, s)| s.device == me) {
                    let l = local(t, k, me);
                    w.put(l.weights());
                    w.put(l.optimizer_state());
                }
                let parts = comm.all_gather(w.0)?;
                let mut readers: Vec<Reader> = parts.iter().map(|p| Reader::new(p)).collect();
                for &(t, k, shard) in &wanted {
                    let r = &mut readers[shard.device];
                    let weights: Vec<f32> = r.get().map_err(wire_err)?;
                    let state: Vec<f32> = r.get().map_err(wire_err)?;
                    let rows = shard.rows.count(self.configs[t].num_embeddings);
                    if weights.len() != rows * shard.column_range().len() {
                        return Err(wire_err(format!(
                            "rank {}: shard {k} of table '{}' has {} values",
                            shard.device,
                            self.configs[t].name,
                            weights.len()
                        )));
                    }
                    copy_rows_back(
                        (&weights, &state, rows),
                        &mut ebc.tables_mut()[t],
                        shard,
                        &self.optimizer,
                    );
                }
            }
        }
        ebc.set_step(self.step);
        Ok(ebc)
    }

    /// The shards this process holds and saves: every shard of its devices
    /// but the data-parallel replicas of devices other than 0 (device 0's
    /// replica stands for the table).
    pub fn local_shards(&self) -> Vec<LocalShard<'_>> {
        let mut out = Vec::new();
        for c in &self.configs {
            let p = self.plan.table(&c.name).expect("validated");
            for (k, shard) in p.shards.iter().enumerate() {
                let dp_replica = p.sharding == ShardingType::DataParallel && shard.device != 0;
                let Some(d) = self.device_index(shard.device) else {
                    continue;
                };
                if dp_replica {
                    continue;
                }
                let table = (self.devices[d].ebc.as_ref())
                    .and_then(|e| e.table(&local_name(&c.name, k)))
                    .expect("every shard has a local table");
                out.push(LocalShard {
                    table: &c.name,
                    index: k,
                    shard,
                    data: table,
                });
            }
        }
        out
    }

    /// The global index of `devices[0]`.
    fn local_offset_device(&self) -> usize {
        match &self.exec {
            Exec::Threads(_) => 0,
            Exec::Rank(comm) => comm.rank(),
        }
    }

    /// Index in `devices` of global device `device`, when this process runs it.
    fn device_index(&self, device: usize) -> Option<usize> {
        (device.checked_sub(self.local_offset_device())).filter(|&i| i < self.devices.len())
    }

    /// The (validated) plan the collection is split by.
    pub fn plan(&self) -> &ShardingPlan {
        &self.plan
    }
    /// The optimizer fused into the backward on every shard.
    pub fn optimizer(&self) -> &TableOptimizer {
        &self.optimizer
    }
    /// The optimizer's step count: the source collection's at creation, plus
    /// one per [`backward_update`](Self::backward_update) that updated.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Counters per device; on a rank, only its own device's are filled.
    pub fn stats(&self) -> ShardingStats {
        let mut s = self.stats.clone();
        match &self.exec {
            Exec::Threads(comms) => {
                s.bytes_sent = (comms.iter().zip(&self.bytes_before))
                    .map(|(c, before)| c.bytes_sent() + before)
                    .collect();
            }
            Exec::Rank(comm) => s.bytes_sent[comm.rank()] = comm.bytes_sent(),
        }
        s
    }
    /// The plan's device count (all devices, also on a rank).
    pub fn num_devices(&self) -> usize {
        self.plan.num_devices
    }
    /// Bytes of weights and optimizer state on each device (on a rank, 0
    /// for the other ranks' devices).
    pub fn device_bytes(&self) -> Vec<usize> {
        (0..self.plan.num_devices)
            .map(|d| {
                self.device_index(d)
                    .and_then(|i| self.devices[i].ebc.as_ref())
                    .map_or(0, |e| e.bytes())
            })
            .collect()
    }
    /// Bytes of weights and optimizer state on this process's devices, the
    /// sum of [`device_bytes`](Self::device_bytes) (data-parallel replicas
    /// counted once per device).
    pub fn bytes(&self) -> usize {
        self.device_bytes().iter().sum()
    }
    /// The output's features, in output order (tables in order, each
    /// table's features in order), as the unsharded collection's.
    pub fn feature_names(&self) -> Vec<String> {
        self.layout
            .slots
            .iter()
            .map(|s| s.feature.clone())
            .collect()
    }
    /// Width of each output feature (its table's `embedding_dim`), in the
    /// order of [`feature_names`](Self::feature_names).
    pub fn feature_dims(&self) -> Vec<usize> {
        self.layout
            .slots
            .iter()
            .map(|s| self.configs[s.table].embedding_dim)
            .collect()
    }
    /// A zeroed output of `batch` samples with this collection's features,
    /// for [`forward_into`](Self::forward_into).
    pub fn new_output(&self, batch: usize) -> KeyedTensor {
        KeyedTensor::zeros(self.feature_names(), self.feature_dims(), batch)
    }

    /// Fresh channels after a failed exchange, so no stale message reaches
    /// the next one; the bytes counted so far are kept.
    /// (A rank's failed exchange ends the job instead.)
    fn reset_comms(&mut self) {
        if let Exec::Threads(comms) = &mut self.exec {
            for (before, c) in self.bytes_before.iter_mut().zip(comms.iter()) {
                *before += c.bytes_sent();
            }
            *comms = InProcess::group(self.plan.num_devices);
        }
    }

    /// Every device's samples, in global positions: blocks of this batch,
    /// or of the ranks' batches in rank order (their sizes exchanged).
    fn owners(&self, b: usize) -> Result<Vec<Range<usize>>, ShardingError> {
        match &self.exec {
            Exec::Threads(_) => Ok(blocks_exact(b, self.plan.num_devices)),
            Exec::Rank(comm) => {
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

    /// Where this process's input starts among the global samples.
    fn local_offset(&self, owners: &[Range<usize>]) -> usize {
        owners[self.local_offset_device()].start
    }

    /// For each slot, its key's index in `kjt`, after checking every id.
    fn check_input(&self, kjt: &KeyedJaggedTensor) -> Result<Vec<usize>, SparseError> {
        if let Some(k) = kjt
            .keys()
            .iter()
            .find(|k| !self.layout.slots.iter().any(|s| &s.feature == *k))
        {
            return Err(SparseError::UnknownFeature(k.clone()));
        }
        let keys = (self.layout.slots.iter())
            .map(|s| {
                kjt.key_index(&s.feature)
                    .ok_or_else(|| SparseError::MissingFeature(s.feature.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let b = kjt.stride();
        for (slot, &k) in self.layout.slots.iter().zip(&keys) {
            let c = &self.configs[slot.table];
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

    /// Pooled lookup of every feature, the whole batch's output in `out`.
    pub fn forward_into(
        &mut self,
        kjt: &KeyedJaggedTensor,
        out: &mut KeyedTensor,
    ) -> Result<(), ShardingError> {
        self.last_forward = None;
        let keys = self.check_input(kjt)?;
        let b = kjt.stride();
        if out.batch() != b || out.width() != self.layout.width {
            *out = self.new_output(b);
        }
        let owners = self.owners(b)?;
        let offset = self.local_offset(&owners);
        let ctx = self.layout.context(kjt, &keys, &owners, offset);
        let results = match &self.exec {
            Exec::Threads(comms) => {
                let mut chunks = Vec::with_capacity(owners.len());
                let mut rest = out.values_mut();
                for o in &owners {
                    let (mine, tail) = rest.split_at_mut(o.len() * self.layout.width);
                    chunks.push(mine);
                    rest = tail;
                }
                on_devices(&mut self.devices, comms, chunks, |dev, comm, chunk| {
                    device_forward(&ctx, dev, comm, chunk)
                })
            }
            Exec::Rank(comm) => vec![device_forward(
                &ctx,
                &mut self.devices[0],
                comm.as_ref(),
                out.values_mut(),
            )],
        };
        if results.iter().any(Result::is_err) {
            // Messages of the aborted exchange must not reach the next one.
            self.reset_comms();
        }
        let mut worst = StageTimes::default();
        let first = self.local_offset_device();
        for (d, r) in results.into_iter().enumerate() {
            let (times, lookups) = r?;
            self.stats.lookups[first + d] += lookups;
            for i in 0..3 {
                worst.0[i] = worst.0[i].max(times.0[i]);
            }
        }
        self.stats.input_dist += worst.0[0];
        self.stats.lookup += worst.0[1];
        self.stats.output_dist += worst.0[2];
        self.last_forward = Some((b, kjt.values().len()));
        self.owners = owners;
        Ok(())
    }

    /// [`forward_into`](Self::forward_into) a new output.
    pub fn forward(&mut self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor, ShardingError> {
        let mut out = self.new_output(kjt.stride());
        self.forward_into(kjt, &mut out)?;
        Ok(out)
    }

    /// Backward of the last [`forward_into`](Self::forward_into) for the same
    /// input: gradients routed to the owners, the optimizer fused there.
    pub fn backward_update(
        &mut self,
        kjt: &KeyedJaggedTensor,
        grad: &[f32],
    ) -> Result<(), ShardingError> {
        let keys = self.check_input(kjt)?;
        let b = kjt.stride();
        // Devices reuse the bags of the forward: the backward must be of that batch.
        if self.last_forward != Some((b, kjt.values().len())) {
            return Err(ShardingError::Collective(format!(
                "backward of a batch of {b} samples and {} ids, but the last forward was {}",
                kjt.values().len(),
                self.last_forward.map_or("none".into(), |(fb, fi)| format!(
                    "{fb} samples and {fi} ids"
                ))
            )));
        }
        if grad.len() != b * self.layout.width {
            return Err(SparseError::GradShape {
                rows: grad.len() / self.layout.width.max(1),
                cols: self.layout.width,
                expected_rows: b,
                expected_cols: self.layout.width,
            }
            .into());
        }
        if matches!(self.optimizer, TableOptimizer::None) {
            return Ok(());
        }
        let owners = std::mem::take(&mut self.owners);
        let offset = self.local_offset(&owners);
        let ctx = self.layout.context(kjt, &keys, &owners, offset);
        let results = match &self.exec {
            Exec::Threads(comms) => {
                let n = owners.len();
                on_devices(&mut self.devices, comms, vec![(); n], |dev, comm, ()| {
                    device_backward(&ctx, dev, comm, grad)
                })
            }
            Exec::Rank(comm) => vec![device_backward(
                &ctx,
                &mut self.devices[0],
                comm.as_ref(),
                grad,
            )],
        };
        self.owners = owners;
        if results.iter().any(Result::is_err) {
            self.reset_comms();
        }
        let mut worst = StageTimes::default();
        for r in results {
            let t = r?;
            for i in 0..2 {
                worst.0[i] = worst.0[i].max(t.0[i]);
            }
        }
        self.stats.grad_dist += worst.0[0];
        self.stats.update += worst.0[1];
        self.stats.steps += 1;
        self.step += 1;
        Ok(())
    }
}

/// Runs `body` once per device, each on its own plain thread (a device
/// blocks on its peers, so devices must all run at once).
fn on_devices<R: Send, X: Send>(
    devices: &mut [Device],
    comms: &[InProcess],
    extra: Vec<X>,
    body: impl Fn(&mut Device, &dyn Collective, X) -> Result<R, ShardingError> + Sync,
) -> Vec<Result<R, ShardingError>> {
    std::thread::scope(|scope| {
        let body = &body;
        let handles: Vec<_> = (devices.iter_mut().zip(comms).zip(extra))
            .map(|((dev, comm), x)| scope.spawn(move || body(dev, comm, x)))
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

/// `blocks`, but always `n` ranges (empty ones when the batch is smaller).
fn blocks_exact(b: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|d| crate::plan::block(b, n, d)).collect()
}

struct Context<'a> {
    layout: &'a Layout,
    kjt: &'a KeyedJaggedTensor,
    keys: &'a [usize],
    /// Every device's samples, in global positions.
    owners: &'a [Range<usize>],
    /// The global position of `kjt`'s first sample (0 unless on a rank).
    offset: usize,
    /// The local bags carry weights: the input's, or a row-split mean's 1/len.
    weighted: bool,
}

impl std::ops::Deref for Context<'_> {
    type Target = Layout;
    fn deref(&self) -> &Layout {
        self.layout
    }
}

impl Context<'_> {
    /// The ids (and weights) of `slot`'s bag of global sample `sample`.
    fn bag(&self, slot: usize, sample: usize) -> (&[i64], Option<&[f32]>) {
        let sample = sample - self.offset;
        let b = self.kjt.stride();
        let k = self.keys[slot];
        let (s, e) = (
            self.kjt.offsets()[k * b + sample],
            self.kjt.offsets()[k * b + sample + 1],
        );
        (
            &self.kjt.values()[s..e],
            self.kjt.weights().map(|w| &w[s..e]),
        )
    }

    /// Does route `r` carry bags from device `src` in the forward?
    fn forward_sends(&self, r: usize, src: usize) -> bool {
        !self.routes[r].data_parallel || self.routes[r].device == src
    }
}

fn wire_err(e: String) -> ShardingError {
    ShardingError::Collective(format!("malformed message: {e}"))
}

/// The bags of `route` for the samples of `samples`, in local ids.
fn encode_bags(ctx: &Context, route: &Route, samples: Range<usize>, w: &mut Writer, dedup: bool) {
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
            if let Some(local) = route.rows.local(id as usize) {
                ids.push(local as i64);
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

fn decode_bags(r: &mut Reader) -> Result<Bags, ShardingError> {
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
fn local_kjt(
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

fn device_forward(
    ctx: &Context,
    dev: &mut Device,
    comm: &dyn Collective,
    out: &mut [f32],
) -> Result<(StageTimes, u64), ShardingError> {
    let me = comm.rank();
    let n = comm.world_size();
    let mine = ctx.owners[me].clone();
    let mut times = StageTimes::default();

    // Input dist.
    let t = Instant::now();
    let mut msgs: Vec<Writer> = (0..n).map(|_| Writer::new()).collect();
    for (r, route) in ctx.routes.iter().enumerate() {
        if ctx.forward_sends(r, me) {
            encode_bags(ctx, route, mine.clone(), &mut msgs[route.device], true);
        }
    }
    let received = comm.all_to_all_v(msgs.into_iter().map(|w| w.0).collect())?;
    for (src, msg) in received.iter().enumerate() {
        let mut reader = Reader::new(msg);
        for (i, &r) in dev.routes.iter().enumerate() {
            dev.received[i][src] = if ctx.forward_sends(r, src) {
                decode_bags(&mut reader)?
            } else {
                Bags::default()
            };
        }
    }
    times.0[0] = t.elapsed();

    // Lookup.
    let t = Instant::now();
    let mut lookups = 0;
    if let Some(ebc) = &mut dev.ebc {
        let kjt = local_kjt(&dev.received, &dev.keys, ctx.owners, ctx.weighted)?;
        lookups = kjt.values().len() as u64;
        ctx.pool
            .install(|| ebc.forward_into(&kjt, &mut dev.pooled))?;
        dev.kjt = Some(kjt);
    }
    times.0[1] = t.elapsed();

    // Output dist: each source gets its samples' rows of every route here.
    let t = Instant::now();
    let mut msgs: Vec<Writer> = (0..n).map(|_| Writer::new()).collect();
    for (src, w) in msgs.iter_mut().enumerate() {
        for (i, &r) in dev.routes.iter().enumerate() {
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

fn device_backward(
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
        for (i, &r) in dev.routes.iter().enumerate() {
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
                &dev.keys,
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

fn layout_of(ebc: &EmbeddingBagCollection) -> (Vec<EmbeddingBagConfig>, TableOptimizer) {
    let configs = ebc.tables().iter().map(|t| t.config().clone()).collect();
    (configs, *ebc.optimizer())
}

/// Where the rows (and optimizer state) of the shards come from when a
/// sharded collection is made.
pub trait ShardSource {
    /// Fills `local`, the local table of `shard` of table `t` (`config`),
    /// with its rows in local order and their optimizer state.
    fn fill(
        &self,
        t: usize,
        config: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError>;
}

/// An unsharded collection's tables.
impl ShardSource for EmbeddingBagCollection {
    fn fill(
        &self,
        t: usize,
        _: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError> {
        let opt = self.optimizer();
        copy_rows(
            &self.tables()[t],
            local,
            shard.rows,
            shard.column_range(),
            opt,
        );
        Ok(())
    }
}

/// The initial rows a new collection seeded with `seed` would hold (the
/// optimizer state starts as a new table's).
pub struct InitialRows {
    /// The seed the unsharded collection would be made with.
    pub seed: u64,
}

impl ShardSource for InitialRows {
    fn fill(
        &self,
        t: usize,
        config: &EmbeddingBagConfig,
        shard: &Shard,
        local: &mut EmbeddingTable,
    ) -> Result<(), ShardingError> {
        let rows = match shard.rows {
            RowSplit::Block { start, end } => start..end,
            RowSplit::All | RowSplit::Mod { .. } => 0..config.num_embeddings,
        };
        ember_sparse::initial_rows(
            config,
            self.seed,
            t as u64,
            rows,
            |g| shard.rows.local(g),
            shard.column_range(),
            local.weights_mut(),
        );
        Ok(())
    }
}

/// Copies a shard's rows and optimizer state from the global table.
fn copy_rows(
    global: &EmbeddingTable,
    local: &mut EmbeddingTable,
    rows: RowSplit,
    cols: Range<usize>,
    opt: &TableOptimizer,
) {
    let (dim, lc) = (global.dim(), cols.len());
    let (gs, ls) = (opt.state_floats_per_row(dim), opt.state_floats_per_row(lc));
    let map = state_map(opt, dim, cols.clone());
    for lr in 0..local.num_embeddings() {
        let gr = rows.global(lr);
        local.weights_mut()[lr * lc..(lr + 1) * lc]
            .copy_from_slice(&global.weights()[gr * dim + cols.start..gr * dim + cols.end]);
        for &(l, g) in &map {
            local.optimizer_state_mut()[lr * ls + l] = global.optimizer_state()[gr * gs + g];
        }
    }
}

/// Copies a shard's rows and optimizer state (`(weights, state, rows)` of
/// its local table) back into the global table.
fn copy_rows_back(
    (weights, state, num_rows): (&[f32], &[f32], usize),
    global: &mut EmbeddingTable,
    shard: &crate::plan::Shard,
    opt: &TableOptimizer,
) {
    let (rows, cols) = (shard.rows, shard.column_range());
    let (dim, lc) = (global.dim(), cols.len());
    let (gs, ls) = (opt.state_floats_per_row(dim), opt.state_floats_per_row(lc));
    let map = state_map(opt, dim, cols.clone());
    for lr in 0..num_rows {
        let gr = rows.global(lr);
        global.weights_mut()[gr * dim + cols.start..gr * dim + cols.end]
            .copy_from_slice(&weights[lr * lc..(lr + 1) * lc]);
        for &(l, g) in &map {
            global.optimizer_state_mut()[gr * gs + g] = state[lr * ls + l];
        }
    }
}

/// (local, global) positions of a row's state floats for a column range.
fn state_map(opt: &TableOptimizer, dim: usize, cols: Range<usize>) -> Vec<(usize, usize)> {
    let lc = cols.len();
    match opt {
        TableOptimizer::None | TableOptimizer::Sgd { .. } => vec![],
        TableOptimizer::RowWiseAdagrad { .. } => vec![(0, 0)],
        TableOptimizer::Adagrad { .. } => cols.enumerate().collect(),
        TableOptimizer::Adam { .. } => cols
            .clone()
            .enumerate()
            .chain(cols.enumerate().map(|(l, g)| (lc + l, dim + g)))
            .collect(),
    }
}
