//! The build of a sharded collection from a plan: its layout (slots and
//! routes), and the devices of this process with their local tables
//! filled from a shard source.

use std::sync::Arc;

use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, KeyedTensor, PoolingType, TableOptimizer, TablePart,
};

use super::codec::Bags;
use super::layout::{local_name, Layout, Route, Slot};
use super::source::ShardSource;
use super::stages::{Device, DeviceRoutes};
use super::{Exec, ShardedEmbeddingBagCollection, ShardingStats};
use crate::plan::{RowSplit, ShardingPlan, ShardingType};
use crate::ShardingError;

/// A device's local tables: each with the table and shard it holds.
type LocalTables = Vec<(EmbeddingBagConfig, usize, usize)>;

impl ShardedEmbeddingBagCollection {
    pub(super) fn build(
        configs: Vec<EmbeddingBagConfig>,
        optimizer: TableOptimizer,
        step: u64,
        source: &dyn ShardSource,
        plan: ShardingPlan,
        exec: Exec,
    ) -> Result<Self, ShardingError> {
        plan.validate(&configs, &optimizer)?;
        let n = plan.num_devices;
        let (slots, width) = slots_of(&configs, &plan);
        let (routes, local_tables) = routes_of(&configs, &plan, &slots);
        let mut devices = Vec::with_capacity(n);
        for (d, tables) in local_tables.into_iter().enumerate() {
            let here = match &exec {
                Exec::Threads(_) => true,
                Exec::Rank(comm) => comm.rank() == d,
            };
            if here {
                let whole = (
                    configs.as_slice(),
                    &plan,
                    slots.as_slice(),
                    routes.as_slice(),
                );
                devices.push(device(d, tables, whole, (source, optimizer, step))?);
            }
        }
        let layout = Layout {
            any_split_mean: slots.iter().any(|s| s.split_mean),
            slots,
            routes,
            width,
            pool: Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(rayon::current_num_threads())
                    .build()
                    .map_err(|e| ShardingError::Collective(format!("a device thread pool: {e}")))?,
            ),
        };
        let tiers = (0..configs.len()).map(|t| source.disk_tier(t)).collect();
        Ok(Self {
            configs,
            plan,
            optimizer,
            layout: Arc::new(layout),
            devices,
            exec,
            bytes_before: vec![0; n],
            routed_bytes: vec![0; n],
            last_forward: None,
            owners: Vec::new(),
            tiers,
            makers: Vec::new(),
            step,
            rounding_seed: 0,
            stats: ShardingStats {
                lookups: vec![0; n],
                bytes_sent: vec![0; n],
                ..Default::default()
            },
        })
    }
}

/// Whether the plan splits table `c`'s rows over shards. A table whose
/// shards hold every row keeps its pooling on each shard (a shard sees
/// whole bags); a row-split one sums on shards.
fn row_split(plan: &ShardingPlan, c: &EmbeddingBagConfig) -> bool {
    let p = plan.table(&c.name).expect("validated");
    p.shards.iter().any(|s| s.rows != RowSplit::All)
}

/// The output features in order, and the output's width.
fn slots_of(configs: &[EmbeddingBagConfig], plan: &ShardingPlan) -> (Vec<Slot>, usize) {
    let mut slots = Vec::new();
    let mut offset = 0;
    for (t, c) in configs.iter().enumerate() {
        for f in &c.feature_names {
            slots.push(Slot {
                feature: f.clone(),
                table: t,
                offset,
                split_mean: c.pooling == PoolingType::Mean && row_split(plan, c),
            });
            offset += c.embedding_dim;
        }
    }
    (slots, offset)
}

/// Every (feature, shard) route, and each device's local tables.
fn routes_of(
    configs: &[EmbeddingBagConfig],
    plan: &ShardingPlan,
    slots: &[Slot],
) -> (Vec<Route>, Vec<LocalTables>) {
    let mut routes = Vec::new();
    let mut local_tables: Vec<LocalTables> = vec![Vec::new(); plan.num_devices];
    for (t, c) in configs.iter().enumerate() {
        let p = plan.table(&c.name).expect("validated");
        for (k, shard) in p.shards.iter().enumerate() {
            let features: Vec<String> = c.feature_names.iter().map(|f| local_name(f, k)).collect();
            let pooling = match row_split(plan, c) {
                true => PoolingType::Sum,
                false => c.pooling,
            };
            // A key-value shard of buckets has a fallback row of its own.
            let fallback = matches!(shard.rows, RowSplit::Buckets { .. }) as usize;
            // The whole table's init range, not one of the shard's rows
            // (a key-value shard draws its new ids' rows from it); the
            // table's own config otherwise (its type, its map).
            let (lo, hi) = c.init_range();
            let cfg = EmbeddingBagConfig {
                name: local_name(&c.name, k),
                num_embeddings: shard.rows.count(c.num_embeddings) + fallback,
                embedding_dim: shard.columns[1] - shard.columns[0],
                feature_names: features,
                pooling,
                weight_init_min: Some(lo),
                weight_init_max: Some(hi),
                ..c.clone()
            };
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
    (routes, local_tables)
}

/// Device `d` of this process: its routes, and its local tables (if it
/// holds any) filled from `source`.
fn device(
    d: usize,
    tables: LocalTables,
    (configs, plan, slots, routes): (&[EmbeddingBagConfig], &ShardingPlan, &[Slot], &[Route]),
    (source, optimizer, step): (&dyn ShardSource, TableOptimizer, u64),
) -> Result<Device, ShardingError> {
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
        let cfgs: Vec<EmbeddingBagConfig> = tables.iter().map(|(c, _, _)| c.clone()).collect();
        let tiers = (tables.iter())
            .map(|(cfg, t, _)| {
                let Some(tier) = source.disk_tier(*t) else {
                    return Ok(None);
                };
                let p = plan.table(&configs[*t].name).expect("validated");
                if p.sharding == ShardingType::DataParallel {
                    return Err(ShardingError::Plan(format!(
                        "table '{}' is on the disk tier: it cannot be data-parallel \
                         (a replica on every device); shard it another way",
                        configs[*t].name
                    )));
                }
                let rows = (configs[*t].num_embeddings, cfg.num_embeddings);
                Ok(Some(super::source::shard_tier(&tier, rows.0, rows.1)))
            })
            .collect::<Result<Vec<_>, ShardingError>>()?;
        // Zeros: every table is filled from the source below.
        let mut local = EmbeddingBagCollection::zeroed_with_disk_tiers(cfgs, optimizer, tiers)?;
        for ((_, t, k), table) in tables.iter().zip(local.tables_mut()) {
            let shard = &plan.table(&configs[*t].name).expect("validated").shards[*k];
            source.fill(*t, &configs[*t], shard, table)?;
            table.set_part(part_of(*t, shard));
        }
        local.set_step(step);
        Some(local)
    };
    let pooled = ebc_local.as_ref().map_or_else(
        || KeyedTensor::zeros(vec![], vec![], 0),
        |e| e.new_output(0),
    );
    Ok(Device {
        received: vec![vec![Bags::default(); plan.num_devices]; my_routes.len()],
        routing: DeviceRoutes {
            routes: my_routes,
            keys,
            has_tables: ebc_local.is_some(),
        },
        ebc: ebc_local,
        pooled,
        local_grad: Vec::new(),
        kjt: None,
    })
}

/// Where shard `shard` of table `t` sits in the whole table, for
/// stochastic rounding by global position.
fn part_of(t: usize, shard: &crate::plan::Shard) -> TablePart {
    let (first_row, row_step) = match shard.rows {
        RowSplit::All => (0, 1),
        RowSplit::Block { start, .. } | RowSplit::Buckets { start, .. } => (start as u64, 1),
        RowSplit::Mod { residue, modulus } => (residue as u64, modulus as u64),
    };
    TablePart {
        table: t as u64,
        first_row,
        row_step,
        first_column: shard.columns[0] as u64,
    }
}
