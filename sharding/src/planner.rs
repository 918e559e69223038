//! The planner: enumerates sharding options per table, estimates each
//! option's storage and cost per device, and places tables greedily (largest
//! first): each takes its cheapest option in total cost, on the least loaded
//! devices, among those that leave room for the tables still to place, as
//! TorchRec's EmbeddingShardingPlanner proposes by cost and then partitions.
//! When that strands a table, a second pass balances storage instead.
//!
//! Cost model (per training step, per device):
//! - storage: rows x (the bytes of a row of cols in the table's data type +
//!   optimizer state floats per row x 4 bytes), plus
//!   the pooled output and its gradient for the global batch
//!   (2 x batch x features x cols x 4 bytes);
//! - lookup time: ids hitting the shard x row bytes x 3 (the forward reads a
//!   row; the fused backward reads and writes it) / memory bandwidth.
//!   Ids spread uniformly over rows, so a row block of a fraction `f` of the
//!   rows gets `f` of the ids;
//! - exchange time: the share `(N-1)/N` of the ids (8-byte id + 4-byte
//!   index), pooled rows and gradients that cross devices / device bandwidth;
//!   a data-parallel table instead all-gathers every device's bags and
//!   gradients;
//! - on the disk tier (with [`PlannerOptions::disk_tier`]): a shard keeps
//!   its cache's rows in memory and all its rows on disk, and each miss
//!   (the lookups the cache does not serve, from the ids' Zipf skew) costs
//!   one random read at the disk's rate. A table goes there only when no
//!   in-memory option fits.

use ember_sparse::{EmbeddingBagConfig, TableOptimizer};
use serde::Serialize;

use crate::plan::{column_split_refused, ShardingPlan, ShardingType, TablePlan};
use crate::{ShardingError, Topology};

/// What the planner assumes about training, and what it may choose.
#[derive(Clone, Debug)]
pub struct PlannerOptions {
    /// Global batch size.
    pub batch_size: usize,
    /// Mean ids per bag.
    pub pooling_factor: f64,
    /// The tables' optimizer: sizes the optimizer state stored per row, and
    /// rules out column splits it cannot run on (row-wise Adagrad).
    pub optimizer: TableOptimizer,
    /// Use only this type for every table (`None`: choose per table).
    pub sharding: Option<ShardingType>,
    /// The disk tier (up to each device's
    /// [`disk_bytes`](crate::topology::Device::disk_bytes)): a table that
    /// does not fit in memory goes there, with a cache (`None`: never).
    /// In memory is always cheaper, so a table that fits stays there.
    pub disk_tier: Option<DiskTierModel>,
}

/// What the planner assumes of the disk tier: how much of a table its
/// cache holds, and what a miss costs.
#[derive(Clone, Debug)]
pub struct DiskTierModel {
    /// Share of a disk-tier table's rows its cache holds, in (0, 1].
    pub cache_share: f64,
    /// The fewest rows a cache may hold (its batches' ids must fit): a
    /// table whose share is fewer stays in memory.
    pub min_cache_rows: usize,
    /// Random record reads a second each device's disk serves, many in
    /// flight ([`DEFAULT_DISK_READS_PER_S`]).
    pub reads_per_s: f64,
    /// The ids' skew, for the hit rate: a Zipf exponent (0: uniform).
    pub zipf_alpha: f64,
    /// The caches' policy: LFU keeps a count per row in memory too.
    pub policy: ember_sparse::CachePolicy,
}

/// [`DiskTierModel::reads_per_s`]'s default: the development machine's
/// cloud disk, about 48k random 4 KiB reads/s at queue depth 64.
pub const DEFAULT_DISK_READS_PER_S: f64 = 48_000.0;

impl DiskTierModel {
    /// The share of lookups a cache of the hottest `share` of `rows` rows
    /// serves under Zipf(`zipf_alpha`) ids: `H(share * rows) / H(rows)`,
    /// `H` the generalised harmonic number (an LRU cache holds about the
    /// hottest rows). Uniform ids give `share`.
    pub fn hit_rate(&self, rows: usize) -> f64 {
        let (a, n) = (self.zipf_alpha, rows.max(1) as f64);
        let c = (self.cache_share * n).clamp(1.0, n);
        // Integral approximation of sum_{k=1..n} k^-a, plus Euler's
        // constant for the first terms.
        let h = |n: f64| match a {
            a if a <= 0.0 => n,
            a if (a - 1.0).abs() < 1e-9 => n.ln() + 0.5772,
            a => (n.powf(1.0 - a) - 1.0) / (1.0 - a) + 0.5772,
        };
        (h(c) / h(n)).clamp(0.0, 1.0)
    }
}

/// One device's share of a plan.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceLoad {
    /// Estimated bytes the plan stores here: weights, optimizer state, and
    /// the pooled output and its gradient.
    pub storage_bytes: u64,
    /// The device's memory in bytes (its capacity in the topology).
    pub memory_bytes: u64,
    /// Estimated bytes of disk-tier shards here, on disk.
    pub disk_bytes: u64,
    /// Estimated seconds per step (lookups and exchanges).
    pub cost_s: f64,
    /// `table:sharding` of every shard placed here.
    pub shards: Vec<String>,
}

/// The planner's estimates for a plan, per device.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PlanStats {
    /// Each device's load, by device index.
    pub devices: Vec<DeviceLoad>,
    /// The most loaded device's estimated seconds per step.
    pub max_cost_s: f64,
}

impl std::fmt::Display for PlanStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:>6} {:>12} {:>12} {:>12} {:>12}  shards (+disk: on the disk tier)",
            "device", "storage MiB", "memory MiB", "disk MiB", "est. ms/step"
        )?;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        for (d, l) in self.devices.iter().enumerate() {
            writeln!(
                f,
                "{d:>6} {:>12.1} {:>12.1} {:>12.1} {:>12.3}  {}",
                mib(l.storage_bytes),
                mib(l.memory_bytes),
                mib(l.disk_bytes),
                l.cost_s * 1e3,
                l.shards.join(" ")
            )?;
        }
        write!(
            f,
            "most loaded device: {:.3} ms/step (estimated)",
            self.max_cost_s * 1e3
        )
    }
}

/// What a table plan puts on one device.
#[derive(Clone, Copy, Debug, Default)]
struct Load {
    /// Bytes in memory: rows and state (a disk-tier shard's cache), and
    /// the pooled output and its gradient.
    memory: u64,
    /// Estimated seconds per step.
    cost: f64,
    /// Bytes on the disk tier.
    disk: u64,
}

/// The loads a table plan puts on each device.
fn loads(t: &EmbeddingBagConfig, p: &TablePlan, topo: &Topology, o: &PlannerOptions) -> Vec<Load> {
    let n = topo.num_devices();
    let features = t.feature_names.len() as f64;
    let batch = o.batch_size as f64;
    let ids = batch * o.pooling_factor * features;
    let cross = (n as f64 - 1.0) / n as f64;
    let mut out = vec![Load::default(); n];
    for s in &p.shards {
        let rows = s.rows.count(t.num_embeddings) as u64;
        let cols = (s.columns[1] - s.columns[0]) as u64;
        let state = o.optimizer.state_floats_per_row(cols as usize) as u64;
        let row_bytes = t
            .data_type
            .row_bytes(cols as usize)
            .map_or(u64::MAX, |b| b as u64);
        let record = row_bytes.saturating_add(state * 4);
        let buffers = 2 * o.batch_size as u64 * t.feature_names.len() as u64 * cols * 4;
        // A disk-tier shard keeps its cache's rows in memory, the rest on disk.
        let (in_memory, on_disk, hit_rate) = match (p.cache_rows, &o.disk_tier) {
            (Some(cache), Some(model)) => {
                let tier = ember_sparse::DiskTierConfig {
                    dir: Default::default(),
                    cache_rows: cache,
                    policy: model.policy,
                };
                let cached = crate::shard_tier(&tier, t.num_embeddings, rows as usize).cache_rows;
                let cached = (cached as u64).min(rows);
                (cached, rows, model.hit_rate(t.num_embeddings))
            }
            _ => (rows, 0, 1.0),
        };
        let counts = match &o.disk_tier {
            Some(m) if on_disk > 0 => m.policy.bookkeeping_bytes(on_disk, in_memory),
            _ => 0,
        };
        // A key-value table's map, headers and sketch.
        let kv = t.kv.as_ref().map_or(0, |k| k.bytes(rows as usize));
        let storage = (in_memory.saturating_mul(record))
            .saturating_add(buffers)
            .saturating_add(counts)
            .saturating_add(kv);
        let (hit, exchanged) = if p.sharding == ShardingType::DataParallel {
            let own = ids / n as f64;
            // All-gather of every other device's bags and gradients.
            (
                own,
                cross * (ids * 12.0 + batch * features * cols as f64 * 4.0),
            )
        } else {
            let hit = ids * rows as f64 / t.num_embeddings as f64;
            (
                hit,
                cross * (hit * 12.0 + 2.0 * batch * features * cols as f64 * 4.0),
            )
        };
        let dev = &topo.devices[s.device];
        // A miss reads its record from the disk (its changed row written
        // back about as often).
        let misses = match &o.disk_tier {
            Some(m) if on_disk > 0 => hit * (1.0 - hit_rate) / m.reads_per_s,
            _ => 0.0,
        };
        let cost = hit * row_bytes as f64 * 3.0 / dev.memory_bandwidth
            + exchanged / topo.device_bandwidth
            + misses;
        let load = &mut out[s.device];
        load.memory = load.memory.saturating_add(storage);
        load.cost += cost;
        let file = match on_disk {
            0 => 0,
            rows => ember_sparse::disk_tier_file_bytes(rows, record),
        };
        load.disk = load.disk.saturating_add(file);
    }
    out
}

/// The options considered for a table.
fn options(t: &EmbeddingBagConfig, topo: &Topology, o: &PlannerOptions) -> Vec<TablePlan> {
    let n = topo.num_devices();
    let all: Vec<usize> = (0..n).collect();
    let column_ok = column_split_refused(&o.optimizer, t.data_type).is_none();
    let mut out = Vec::new();
    let want = |k: ShardingType| o.sharding.is_none_or(|s| s == k);
    // A key-value table is table-wise (its map whole on one device), or
    // row-wise by buckets below, whatever sharding the others are given.
    let kv = t.kv.is_some();
    if want(ShardingType::TableWise) || kv {
        out.extend((0..n).map(|d| TablePlan::table_wise(t, d)));
    }
    // Or row-wise by buckets, where each device gets buckets and rows.
    if let Some(k) =
        t.kv.as_ref()
            .filter(|_| want(ShardingType::RowWise) && n > 1)
    {
        let p = TablePlan::row_wise_buckets(t, &all);
        // Not with a shared fallback row, nor a shard without rows.
        if crate::plan::validate_kv(t, k, &p, n).is_ok() {
            out.push(p);
        }
    }
    let want = |k: ShardingType| !kv && want(k);
    if want(ShardingType::RowWise) {
        out.push(TablePlan::row_wise(t, &all, ShardingType::RowWise));
    }
    if o.sharding == Some(ShardingType::RowWiseMod) && !kv {
        out.push(TablePlan::row_wise_mod(t, &all));
    }
    if want(ShardingType::ColumnWise) && column_ok {
        out.push(TablePlan::column_wise(t, &all[..n.min(t.embedding_dim)]));
    }
    if want(ShardingType::TableRowWise) && (topo.num_hosts() > 1 || o.sharding.is_some()) {
        for h in 0..topo.num_hosts() {
            let host: Vec<usize> = topo.host_devices(h).collect();
            out.push(TablePlan::row_wise(t, &host, ShardingType::TableRowWise));
        }
    }
    if want(ShardingType::DataParallel) {
        out.push(TablePlan::data_parallel(t, n));
    }
    // Each option again on the disk tier, where the table's cache would
    // hold its batches' ids.
    if let Some(model) = &o.disk_tier {
        let rows = (t.num_embeddings as f64 * model.cache_share) as usize
            / ember_sparse::CACHE_WAYS
            * ember_sparse::CACHE_WAYS;
        if rows >= model.min_cache_rows.max(ember_sparse::CACHE_WAYS) && rows < t.num_embeddings {
            // L2-norm eviction reads every candidate's row: not on disk.
            let l2 = (t.kv.as_ref()).is_some_and(|k| k.eviction == ember_sparse::Eviction::L2Norm);
            let on_disk: Vec<TablePlan> = (out.iter())
                .filter(|p| p.sharding != ShardingType::DataParallel && !l2)
                .map(|p| TablePlan {
                    cache_rows: Some(rows),
                    ..p.clone()
                })
                .collect();
            out.extend(on_disk);
        }
    }
    out
}

/// An option with its score (lower is better) and per-device loads.
type Candidate = ((f64, f64), TablePlan, Vec<Load>);

/// One greedy pass: tables largest first, each where the score after it is
/// lowest. `storage_first` scores by the fullest device's storage (then
/// cost) instead of the most loaded device's cost (then storage).
fn greedy(
    tables: &[EmbeddingBagConfig],
    topo: &Topology,
    o: &PlannerOptions,
    storage_first: bool,
) -> Greedy {
    let n = topo.num_devices();
    let mut used = vec![Load::default(); n];
    let mut placed: Vec<Option<TablePlan>> = vec![None; tables.len()];
    let mut unplaced = Vec::new();
    // Largest first: the hardest to place go where there is room.
    let mut order: Vec<usize> = (0..tables.len()).collect();
    let size = |t: &EmbeddingBagConfig| t.num_embeddings as u64 * t.embedding_dim as u64;
    order.sort_by_key(|&i| std::cmp::Reverse(size(&tables[i])));
    // The least memory each table can take in all, so that a cheap but
    // memory-hungry choice (a replica everywhere) never starves the tables
    // still to place.
    let least: Vec<u64> = (tables.iter())
        .map(|t| {
            let all = PlannerOptions {
                sharding: None,
                ..o.clone()
            };
            (options(t, topo, &all).iter())
                .map(|p| loads(t, p, topo, o).iter().map(|l| l.memory).sum::<u64>())
                .min()
                .unwrap_or(0)
        })
        .collect();
    let capacity: u64 = topo.devices.iter().map(|d| d.memory_bytes).sum();
    let mut still_needed: u64 = least.iter().sum();
    for i in order {
        still_needed -= least[i];
        let t = &tables[i];
        let mut best: Option<Candidate> = None;
        let mut smallest = u64::MAX;
        for option in options(t, topo, o) {
            let add = loads(t, &option, topo, o);
            smallest = smallest.min(add.iter().map(|a| a.memory).max().unwrap_or(0));
            let fits = (0..n).all(|d| {
                let dev = &topo.devices[d];
                used[d].memory + add[d].memory <= dev.memory_bytes
                    && dev
                        .disk_bytes
                        .is_none_or(|cap| used[d].disk + add[d].disk <= cap)
            });
            let total_used: u64 = (0..n).map(|d| used[d].memory + add[d].memory).sum();
            if !fits || total_used + still_needed > capacity {
                continue;
            }
            let max_cost = (0..n)
                .map(|d| used[d].cost + add[d].cost)
                .fold(0.0, f64::max);
            let max_storage = (0..n)
                .map(|d| used[d].memory + add[d].memory)
                .max()
                .unwrap_or(0) as f64;
            let total_cost: f64 = add.iter().map(|a| a.cost).sum();
            // The cheapest sharding in all, on the least loaded devices (as
            // TorchRec proposes by cost, then partitions greedily).
            let key = match storage_first {
                false => (total_cost, max_cost),
                true => (max_storage, total_cost),
            };
            if best.as_ref().is_none_or(|b| key < b.0) {
                best = Some((key, option, add));
            }
        }
        match best {
            Some((_, option, add)) => {
                for d in 0..n {
                    used[d].memory += add[d].memory;
                    used[d].cost += add[d].cost;
                    used[d].disk += add[d].disk;
                }
                placed[i] = Some(option);
            }
            None => unplaced.push((t.name.clone(), smallest)),
        }
    }
    Greedy {
        placed,
        unplaced,
        used,
    }
}

struct Greedy {
    placed: Vec<Option<TablePlan>>,
    /// Tables that found no room, with their smallest per-device footprint.
    unplaced: Vec<(String, u64)>,
    /// What is placed on each device.
    used: Vec<Load>,
}

/// The planner: places every table on `topo` (see the module docs for the
/// cost model) and returns the plan with its estimated per-device loads.
///
/// Fails with [`ShardingError::Capacity`], listing what is missing, when the
/// tables do not fit the devices' memory; with [`ShardingError::Topology`]
/// for an invalid topology; and with [`ShardingError::Plan`] when
/// column-wise is forced with an optimizer that cannot be split by columns.
///
/// ```
/// use ember_sharding::{plan, PlannerOptions, ShardingError, Topology};
/// use ember_sparse::{EmbeddingBagConfig, TableOptimizer};
///
/// let options = PlannerOptions {
///     batch_size: 32,
///     pooling_factor: 1.0,
///     optimizer: TableOptimizer::sgd(0.1),
///     sharding: None,
///     disk_tier: None,
/// };
/// // 1M rows x 64 columns x 4 bytes = 256 MB of weights, on two devices of
/// // 1 MiB each.
/// let tables = [EmbeddingBagConfig::new("huge", 1_000_000, 64, &["f"])];
/// let err = plan(&tables, &Topology::uniform(2, 1 << 20), &options).unwrap_err();
/// assert!(matches!(&err, ShardingError::Capacity { unplaced, .. } if unplaced[0].0 == "huge"));
/// assert!(err.to_string().contains("'huge' needs at least"));
///
/// // With room, every device's load is estimated.
/// let (_, stats) = plan(&tables, &Topology::uniform(2, 1 << 30), &options)?;
/// assert_eq!(stats.devices.len(), 2);
/// assert!(stats.max_cost_s > 0.0);
/// # Ok::<(), ShardingError>(())
/// ```
pub fn plan(
    tables: &[EmbeddingBagConfig],
    topo: &Topology,
    o: &PlannerOptions,
) -> Result<(ShardingPlan, PlanStats), ShardingError> {
    topo.validate()?;
    // Forced column-wise: say why no option exists, not that nothing fits.
    if o.sharding == Some(ShardingType::ColumnWise) {
        for t in tables {
            if let Some(why) = column_split_refused(&o.optimizer, t.data_type) {
                return Err(ShardingError::Plan(format!("table '{}': {why}", t.name)));
            }
        }
    }
    // Balance cost first; when that strands a table, balance storage.
    let mut attempt = greedy(tables, topo, o, false);
    if !attempt.unplaced.is_empty() {
        attempt = greedy(tables, topo, o, true);
    }
    let Greedy {
        placed,
        unplaced,
        used,
    } = attempt;
    let n = topo.num_devices();
    if !unplaced.is_empty() {
        let need: u64 = unplaced.iter().map(|(_, s)| *s).sum();
        let share = need.div_ceil(n as u64);
        let devices = (0..n)
            .map(|d| {
                let free = topo.devices[d].memory_bytes.saturating_sub(used[d].memory);
                (free, share.saturating_sub(free))
            })
            .collect();
        return Err(ShardingError::Capacity {
            unplaced,
            tables: tables.len(),
            devices,
        });
    }
    let plan = ShardingPlan {
        num_devices: n,
        tables: placed
            .into_iter()
            .map(|p| p.expect("placed or reported"))
            .collect(),
    };
    Ok((plan.clone(), stats(tables, &plan, topo, o)))
}

/// The per-device loads of any plan (a hand-written one too).
pub fn stats(
    tables: &[EmbeddingBagConfig],
    plan: &ShardingPlan,
    topo: &Topology,
    o: &PlannerOptions,
) -> PlanStats {
    let n = topo.num_devices();
    let mut devices: Vec<DeviceLoad> = topo
        .devices
        .iter()
        .map(|d| DeviceLoad {
            memory_bytes: d.memory_bytes,
            ..Default::default()
        })
        .collect();
    for (t, p) in tables
        .iter()
        .filter_map(|t| plan.table(&t.name).map(|p| (t, p)))
    {
        for (d, load) in loads(t, p, topo, o).into_iter().enumerate().take(n) {
            if load.memory > 0 {
                devices[d].storage_bytes += load.memory;
                devices[d].disk_bytes += load.disk;
                devices[d].cost_s += load.cost;
                let kind = serde_json::to_value(p.sharding)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default();
                let tier = if p.cache_rows.is_some() { "+disk" } else { "" };
                devices[d].shards.push(format!("{}:{kind}{tier}", t.name));
            }
        }
    }
    let max_cost_s = devices.iter().map(|d| d.cost_s).fold(0.0, f64::max);
    PlanStats {
        devices,
        max_cost_s,
    }
}
