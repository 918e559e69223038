//! The route layout: the output features (slots), their (feature, shard)
//! routes to the owning devices, the per-call context the device stages
//! share, and the build of a collection from a plan into that layout.

use std::ops::Range;
use std::sync::Arc;

use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, PoolingType,
    TableOptimizer, TablePart,
};

use super::codec::Bags;
use super::route::DeviceRoutes;
use super::source::ShardSource;
use super::stages::Device;
use super::{Exec, ShardedEmbeddingBagCollection, ShardingStats};
use crate::plan::{RowSplit, ShardingPlan, ShardingType};
use crate::ShardingError;

/// One output feature of the whole collection.
#[derive(Clone, Debug)]
pub(super) struct Slot {
    pub(super) feature: String,
    pub(super) table: usize,
    /// Column of the feature's pooled vector in an output row.
    pub(super) offset: usize,
    /// Mean pooling over a row-split table: each shard sees only part of a
    /// bag, so the mean's 1/len travels as a per-id weight (computed as the
    /// unsharded kernel computes its scale) and shards sum.
    pub(super) split_mean: bool,
}

/// One (feature, shard): what a device looks up for a feature.
#[derive(Clone, Debug)]
pub(super) struct Route {
    pub(super) slot: usize,
    /// The shard's index in its table's plan.
    shard: usize,
    pub(super) device: usize,
    pub(super) rows: RowSplit,
    pub(super) columns: Range<usize>,
    pub(super) data_parallel: bool,
}

/// What every device reads and none changes: the features, the routes, and
/// the pool the kernels run in.
pub(super) struct Layout {
    pub(super) slots: Vec<Slot>,
    pub(super) routes: Vec<Route>,
    /// Width of an output row.
    pub(super) width: usize,
    /// Some feature is a row-split mean (its 1/len travels as weights).
    any_split_mean: bool,
    /// The pool the collection was made in. Only kernels run there: a device
    /// body blocks on its peers, which would starve a pool with fewer
    /// threads than devices, so device bodies are plain threads.
    pub(super) pool: Arc<rayon::ThreadPool>,
}

impl Layout {
    /// The view of one call's input that the device stages share.
    pub(super) fn context<'a>(
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

/// Where shard `shard` of table `t` sits in the whole table, for
/// stochastic rounding by global position.
fn part_of(t: usize, shard: &crate::plan::Shard) -> TablePart {
    let (first_row, row_step) = match shard.rows {
        RowSplit::All => (0, 1),
        RowSplit::Block { start, .. } => (start as u64, 1),
        RowSplit::Mod { residue, modulus } => (residue as u64, modulus as u64),
    };
    TablePart {
        table: t as u64,
        first_row,
        row_step,
        first_column: shard.columns[0] as u64,
    }
}

pub(super) fn local_name(name: &str, shard: usize) -> String {
    format!("{name}#{shard}")
}

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
                .with_pooling(pooling)
                .with_data_type(c.data_type);
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
                let mut local =
                    EmbeddingBagCollection::zeroed_with_disk_tiers(cfgs, optimizer, tiers)?;
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
            devices.push(Device {
                received: vec![vec![Bags::default(); n]; my_routes.len()],
                routing: DeviceRoutes {
                    routes: my_routes,
                    keys,
                    has_tables: ebc_local.is_some(),
                },
                ebc: ebc_local,
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

pub(super) struct Context<'a> {
    layout: &'a Layout,
    kjt: &'a KeyedJaggedTensor,
    keys: &'a [usize],
    /// Every device's samples, in global positions.
    pub(super) owners: &'a [Range<usize>],
    /// The global position of `kjt`'s first sample (0 unless on a rank).
    pub(super) offset: usize,
    /// The local bags carry weights: the input's, or a row-split mean's 1/len.
    pub(super) weighted: bool,
}

impl std::ops::Deref for Context<'_> {
    type Target = Layout;
    fn deref(&self) -> &Layout {
        self.layout
    }
}

impl Context<'_> {
    /// The ids (and weights) of `slot`'s bag of global sample `sample`.
    pub(super) fn bag(&self, slot: usize, sample: usize) -> (&[i64], Option<&[f32]>) {
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
    pub(super) fn forward_sends(&self, r: usize, src: usize) -> bool {
        !self.routes[r].data_parallel || self.routes[r].device == src
    }
}
