//! The entry points: `ShardedEmbeddingBagCollection`'s constructors, accessors,
//! forward and backward, and the input checks and sample blocks they use.

use std::ops::Range;
use std::sync::Arc;

use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, SparseError,
    TableOptimizer, TableStepSettings,
};

use super::layout::local_name;
use super::route::{check_input, key_indices, route_on, Comms, RoutedInput};
use super::source::{LocalShard, ShardSource};
use super::stages::{device_backward, device_forward, on_devices, DeviceRoutes, StageTimes};
use super::{Exec, ShardedEmbeddingBagCollection, ShardingStats};
use crate::collective::{Collective, InProcess};
use crate::plan::{ShardingPlan, ShardingType};
use crate::ShardingError;

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
        let mut sharded = Self::build(configs, optimizer, ebc.step(), ebc, plan, exec)?;
        sharded.set_rounding_seed(ebc.rounding_seed());
        sharded.makers = ebc.tables().iter().map(|t| t.row_maker()).collect();
        Ok(sharded)
    }

    /// Every device of `plan` a thread of this process, its shards filled
    /// from `source` (the collection's step `step`): only the shards' rows
    /// are read, and a key-value shard takes its own map as `source` has it.
    pub fn from_source(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        step: u64,
        source: &dyn ShardSource,
        plan: ShardingPlan,
    ) -> Result<Self, ShardingError> {
        let exec = Exec::Threads(InProcess::group(plan.num_devices));
        Self::build(configs, optimizer, step, source, plan, exec)
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
        let mut sharded = Self::on_rank(configs, optimizer, ebc.step(), ebc, plan, comm)?;
        sharded.set_rounding_seed(ebc.rounding_seed());
        Ok(sharded)
    }

    /// Each table's disk tier, as the collection was made (`None`: in
    /// RAM); its shards each cache their share (see [`shard_tier`](crate::shard_tier)).
    pub fn disk_tiers(&self) -> &[Option<ember_sparse::DiskTierConfig>] {
        &self.tiers
    }

    /// The seed of the stochastic rounding of fp16/bf16 tables (see
    /// [`EmbeddingBagCollection::set_rounding_seed`]): the source
    /// collection's for `from_collection*`, 0 for `on_rank` until set.
    pub fn rounding_seed(&self) -> u64 {
        self.rounding_seed
    }

    /// Sets the seed of the stochastic rounding on every shard; shards draw
    /// by global position, so they round as the unsharded tables would.
    pub fn set_rounding_seed(&mut self, seed: u64) {
        self.rounding_seed = seed;
        for ebc in self.devices.iter_mut().filter_map(|d| d.ebc.as_mut()) {
            ebc.set_rounding_seed(seed);
        }
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
    pub(super) fn local_offset_device(&self) -> usize {
        match &self.exec {
            Exec::Threads(_) => 0,
            Exec::Rank(comm) => comm.rank(),
        }
    }

    /// Index in `devices` of global device `device`, when this process runs it.
    pub(super) fn device_index(&self, device: usize) -> Option<usize> {
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
    /// Sets the learning rate and weight decay of the next backward updates
    /// on every local shard, as [`EmbeddingBagCollection::set_step_settings`]
    /// does (checked once, so no shard takes what another refused).
    pub fn set_step_settings(&mut self, settings: TableStepSettings) -> Result<(), SparseError> {
        settings
            .validate(&self.optimizer)
            .map_err(SparseError::InvalidOptimizer)?;
        for ebc in self.devices.iter_mut().filter_map(|d| d.ebc.as_mut()) {
            ebc.set_step_settings(settings)?;
        }
        Ok(())
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
                s.bytes_sent = (comms.iter().zip(&self.bytes_before).zip(&self.routed_bytes))
                    .map(|((c, before), routed)| c.bytes_sent() + before + routed)
                    .collect();
            }
            Exec::Rank(comm) => s.bytes_sent[comm.rank()] = comm.bytes_sent(),
        }
        s
    }
    /// Training (the default) or inference for every local shard: in
    /// training, key-value shards admit new ids; in inference they only
    /// read (see [`EmbeddingBagCollection::set_training`](ember_sparse::EmbeddingBagCollection::set_training)).
    pub fn set_training(&mut self, training: bool) {
        for ebc in self.devices.iter_mut().filter_map(|d| d.ebc.as_mut()) {
            ebc.set_training(training);
        }
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

    /// Where this process's input starts among the global samples.
    fn local_offset(&self, owners: &[Range<usize>]) -> usize {
        owners[self.local_offset_device()].start
    }

    /// Pooled lookup of every feature, the whole batch's output in `out`:
    /// the input dist, then [`forward_routed`](Self::forward_routed).
    pub fn forward_into(
        &mut self,
        kjt: &KeyedJaggedTensor,
        out: &mut KeyedTensor,
    ) -> Result<(), ShardingError> {
        self.last_forward = None;
        let comms = match &self.exec {
            Exec::Threads(c) => Comms::Threads(c),
            Exec::Rank(c) => Comms::Rank(c.as_ref()),
        };
        let first = self.local_offset_device();
        let locals: Vec<&DeviceRoutes> = self.devices.iter().map(|d| &d.routing).collect();
        let routed = route_on(&self.layout, &self.configs, &locals, first, comms, kjt);
        match routed {
            Ok(routed) => self.forward_with(kjt, routed, out),
            Err(e) => {
                // Messages of the aborted exchange must not reach the next one.
                self.reset_comms();
                Err(e)
            }
        }
    }

    /// The lookup and output dist of `kjt`, whose input dist `routed` ran
    /// already (by an [`InputRouter`](super::InputRouter) of this collection).
    /// The same bits as [`forward_into`](Self::forward_into).
    pub fn forward_routed(
        &mut self,
        kjt: &KeyedJaggedTensor,
        routed: RoutedInput,
        out: &mut KeyedTensor,
    ) -> Result<(), ShardingError> {
        self.last_forward = None;
        if !routed.is_of(kjt, &self.layout) || routed.devices.len() != self.devices.len() {
            return Err(ShardingError::Collective(
                "forward of a batch other than the one its input dist was routed from, or routed for another collection".into(),
            ));
        }
        self.forward_with(kjt, routed, out)
    }

    /// The lookup and output dist of `kjt` from `routed`, its own input dist
    /// (whose ids were checked there).
    fn forward_with(
        &mut self,
        kjt: &KeyedJaggedTensor,
        routed: RoutedInput,
        out: &mut KeyedTensor,
    ) -> Result<(), ShardingError> {
        let keys = key_indices(&self.layout, kjt)?;
        let b = kjt.stride();
        if out.batch() != b || out.width() != self.layout.width {
            *out = self.new_output(b);
        }
        let RoutedInput {
            owners,
            devices: inputs,
            time,
            bytes,
            ..
        } = routed;
        for (total, b) in self.routed_bytes.iter_mut().zip(bytes) {
            *total += b;
        }
        let offset = self.local_offset(&owners);
        let ctx = self.layout.context(kjt, &keys, &owners, offset);
        let results = match &self.exec {
            Exec::Threads(comms) => {
                let mut chunks = Vec::with_capacity(owners.len());
                let mut rest = out.values_mut();
                for o in &owners {
                    let (mine, tail) = rest.split_at_mut(o.len() * self.layout.width);
                    chunks.push((mine, None));
                    rest = tail;
                }
                for (c, input) in chunks.iter_mut().zip(inputs) {
                    c.1 = Some(input);
                }
                on_devices(
                    &mut self.devices,
                    comms,
                    chunks,
                    |dev, comm, (chunk, input)| {
                        device_forward(&ctx, dev, comm, chunk, input.expect("one input per device"))
                    },
                )
            }
            Exec::Rank(comm) => {
                let input = inputs.into_iter().next().expect("one input per device");
                vec![device_forward(
                    &ctx,
                    &mut self.devices[0],
                    comm.as_ref(),
                    out.values_mut(),
                    input,
                )]
            }
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
            for i in 1..3 {
                worst.0[i] = worst.0[i].max(times.0[i]);
            }
        }
        self.stats.input_dist += time;
        self.stats.lookup += worst.0[1];
        self.stats.output_dist += worst.0[2];
        self.last_forward = Some((b, served_ids(kjt, &keys)));
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
        let keys = check_input(&self.layout, &self.configs, kjt)?;
        let b = kjt.stride();
        // Devices reuse the bags of the forward: the backward must be of that batch.
        let ids = served_ids(kjt, &keys);
        if self.last_forward != Some((b, ids)) {
            return Err(ShardingError::Collective(format!(
                "backward of a batch of {b} samples and {ids} ids, but the last forward was {}",
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

fn layout_of(ebc: &EmbeddingBagCollection) -> (Vec<EmbeddingBagConfig>, TableOptimizer) {
    let configs = ebc.tables().iter().map(|t| t.config().clone()).collect();
    (configs, *ebc.optimizer())
}

/// Ids of the features this collection serves (the batch's other keys are
/// ignored): what a forward and its backward must agree on.
fn served_ids(kjt: &KeyedJaggedTensor, keys: &[usize]) -> usize {
    keys.iter().map(|&k| kjt.key_range(k).len()).sum()
}
