//! Sharding plans: which rows and columns of each table live on which
//! device. A plan is JSON (serde), written by the planner or by hand, and is
//! validated against the tables and the device count before it is used.

use std::ops::Range;

use ember_sparse::{DataType, EmbeddingBagConfig, TableOptimizer};
use serde::{Deserialize, Serialize};

use crate::ShardingError;

/// How a table is split, with TorchRec's names (and jax-tpu-embedding's
/// `id mod N` row split).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardingType {
    /// The whole table on one device.
    TableWise,
    /// Contiguous blocks of rows on several devices (TorchRec).
    RowWise,
    /// Row `id` on device `id mod N`, at local row `id / N` (jax-tpu-embedding).
    RowWiseMod,
    /// Blocks of columns on several devices, every row in each.
    ColumnWise,
    /// Row blocks over the devices of one host.
    TableRowWise,
    /// A full replica on every device; gradients are reduced before the update.
    DataParallel,
}

/// The rows of a table a shard holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RowSplit {
    /// Every row, local row = global row (table-wise, column-wise,
    /// data-parallel).
    All,
    /// Rows `start..end`, local row `id - start` (row-wise, table-row-wise).
    Block {
        /// First global row held.
        start: usize,
        /// One past the last global row held.
        end: usize,
    },
    /// Rows with `id % modulus == residue`, local row `id / modulus`
    /// (row-wise mod).
    Mod {
        /// The ids' remainder this shard holds, `< modulus`.
        residue: usize,
        /// The number of row pieces, `1..=rows` of the table.
        modulus: usize,
    },
    /// A key-value table's ids whose bucket ([`ember_sparse::id_bucket`]
    /// of `buckets`) is in `first_bucket..end_bucket`, in rows
    /// `start..end` of the table (local row `row - start`) under a map of
    /// the shard's own (row-wise by buckets).
    Buckets {
        /// First row of the table held.
        start: usize,
        /// One past the last row held.
        end: usize,
        /// First bucket whose ids the shard holds.
        first_bucket: usize,
        /// One past the last.
        end_bucket: usize,
        /// The table's buckets (its `KvConfig::buckets`).
        buckets: usize,
    },
}

impl RowSplit {
    /// The local row of global row `id`, if this shard holds it.
    #[inline]
    pub fn local(&self, id: usize) -> Option<usize> {
        match *self {
            RowSplit::All => Some(id),
            RowSplit::Block { start, end } | RowSplit::Buckets { start, end, .. } => {
                (start..end).contains(&id).then(|| id - start)
            }
            RowSplit::Mod { residue, modulus } => (id % modulus == residue).then(|| id / modulus),
        }
    }

    /// What the shard is sent for input id `id`, if it holds it: its local
    /// row; a key-value shard, the raw id itself (its map finds the row).
    #[inline]
    pub fn route(&self, id: i64) -> Option<i64> {
        match *self {
            RowSplit::Buckets {
                first_bucket,
                end_bucket,
                buckets,
                ..
            } => (first_bucket..end_bucket)
                .contains(&ember_sparse::id_bucket(id as u64, buckets))
                .then_some(id),
            _ => self.local(id as usize).map(|l| l as i64),
        }
    }

    /// A key-value shard's rows of its table, its buckets, and the table's
    /// buckets; `None` for another split.
    pub fn buckets(&self) -> Option<(Range<usize>, Range<usize>, usize)> {
        match *self {
            RowSplit::Buckets {
                start,
                end,
                first_bucket,
                end_bucket,
                buckets,
            } => Some((start..end, first_bucket..end_bucket, buckets)),
            _ => None,
        }
    }

    /// The global row of local row `local`.
    #[inline]
    pub fn global(&self, local: usize) -> usize {
        match *self {
            RowSplit::All => local,
            RowSplit::Block { start, .. } | RowSplit::Buckets { start, .. } => start + local,
            RowSplit::Mod { residue, modulus } => residue + local * modulus,
        }
    }

    /// Rows held, of a table of `rows` rows.
    pub fn count(&self, rows: usize) -> usize {
        match *self {
            RowSplit::All => rows,
            RowSplit::Block { start, end } | RowSplit::Buckets { start, end, .. } => {
                end.min(rows).saturating_sub(start)
            }
            RowSplit::Mod { residue, modulus } if residue < rows && modulus > 0 => {
                (rows - residue).div_ceil(modulus)
            }
            RowSplit::Mod { .. } => 0,
        }
    }
}

/// One piece of a table on one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shard {
    /// The device holding it, `0..num_devices` of the plan.
    pub device: usize,
    /// Which of the table's rows it holds.
    pub rows: RowSplit,
    /// Columns `[start, end)`.
    pub columns: [usize; 2],
}

impl Shard {
    /// [`columns`](Self::columns) as a range.
    pub fn column_range(&self) -> Range<usize> {
        self.columns[0]..self.columns[1]
    }
}

/// How one table is sharded: its sharding type and its shards.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TablePlan {
    /// The table's name (`EmbeddingBagConfig::name`).
    pub table: String,
    /// The sharding type the shards follow.
    pub sharding: ShardingType,
    /// The pieces, together covering every row and column once (a full
    /// replica per device for data-parallel).
    pub shards: Vec<Shard>,
    /// On the disk tier: each shard's rows in a file on its device, behind
    /// a cache of its share of this many rows of the table (see
    /// [`shard_tier`](crate::shard_tier)); `None` (or absent): in memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_rows: Option<usize>,
}

/// Near-equal blocks of `0..n` in `parts` pieces (the first ones one longer).
pub fn blocks(n: usize, parts: usize) -> Vec<Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts).map(|k| block(n, parts, k)).collect()
}

/// Block `k` of `0..n` cut into `parts` near-equal blocks (empty ones when
/// `parts > n`).
pub(crate) fn block(n: usize, parts: usize, k: usize) -> Range<usize> {
    let at = |k: usize| (n as u128 * k as u128 / parts as u128) as usize;
    at(k)..at(k + 1)
}

impl TablePlan {
    fn new(table: &EmbeddingBagConfig, sharding: ShardingType, shards: Vec<Shard>) -> Self {
        Self {
            table: table.name.clone(),
            sharding,
            shards,
            cache_rows: None,
        }
    }

    /// Table-wise: the whole table on `device`.
    pub fn table_wise(t: &EmbeddingBagConfig, device: usize) -> Self {
        let shard = Shard {
            device,
            rows: RowSplit::All,
            columns: [0, t.embedding_dim],
        };
        Self::new(t, ShardingType::TableWise, vec![shard])
    }

    /// Row blocks over `devices`, in order, near-equal (fewer blocks than
    /// devices when the table has fewer rows); `sharding` is
    /// [`RowWise`](ShardingType::RowWise) or
    /// [`TableRowWise`](ShardingType::TableRowWise) (the devices of one host).
    pub fn row_wise(t: &EmbeddingBagConfig, devices: &[usize], sharding: ShardingType) -> Self {
        let shards = (blocks(t.num_embeddings, devices.len())
            .into_iter()
            .zip(devices))
        .map(|(r, &device)| Shard {
            device,
            rows: RowSplit::Block {
                start: r.start,
                end: r.end,
            },
            columns: [0, t.embedding_dim],
        })
        .collect();
        Self::new(t, sharding, shards)
    }

    /// Row-wise mod: row `id` on `devices[id % N]` (`N` the device count,
    /// at most the table's rows).
    pub fn row_wise_mod(t: &EmbeddingBagConfig, devices: &[usize]) -> Self {
        let modulus = devices.len().clamp(1, t.num_embeddings.max(1));
        let shards = (0..modulus)
            .map(|residue| Shard {
                device: devices[residue],
                rows: RowSplit::Mod { residue, modulus },
                columns: [0, t.embedding_dim],
            })
            .collect();
        Self::new(t, ShardingType::RowWiseMod, shards)
    }

    /// Row-wise by buckets, for a key-value table: near-equal blocks of its
    /// id buckets over `devices` (fewer when it has fewer buckets), each
    /// shard the same share of its rows (all but the fallback; each shard
    /// has a zero fallback of its own).
    pub fn row_wise_buckets(t: &EmbeddingBagConfig, devices: &[usize]) -> Self {
        let of = t.kv.as_ref().map_or(1, |kv| kv.buckets()).max(1);
        let capacity = t.num_embeddings.saturating_sub(1);
        let shards = (blocks(of, devices.len()).into_iter().zip(devices))
            .map(|(b, &device)| {
                let row = |bucket: usize| (capacity as u128 * bucket as u128 / of as u128) as usize;
                Shard {
                    device,
                    rows: RowSplit::Buckets {
                        start: row(b.start),
                        end: row(b.end),
                        first_bucket: b.start,
                        end_bucket: b.end,
                        buckets: of,
                    },
                    columns: [0, t.embedding_dim],
                }
            })
            .collect();
        Self::new(t, ShardingType::RowWise, shards)
    }

    /// Column-wise: near-equal column blocks over `devices`, each with every
    /// row (fewer blocks than devices when the table has fewer columns).
    pub fn column_wise(t: &EmbeddingBagConfig, devices: &[usize]) -> Self {
        let shards = (blocks(t.embedding_dim, devices.len())
            .into_iter()
            .zip(devices))
        .map(|(c, &device)| Shard {
            device,
            rows: RowSplit::All,
            columns: [c.start, c.end],
        })
        .collect();
        Self::new(t, ShardingType::ColumnWise, shards)
    }

    /// Data-parallel: a full replica on each of devices `0..num_devices`.
    pub fn data_parallel(t: &EmbeddingBagConfig, num_devices: usize) -> Self {
        let shards = (0..num_devices)
            .map(|device| Shard {
                device,
                rows: RowSplit::All,
                columns: [0, t.embedding_dim],
            })
            .collect();
        Self::new(t, ShardingType::DataParallel, shards)
    }
}

/// The most devices a plan may name (each is a thread and a set of channels).
pub const MAX_DEVICES: usize = 4096;

/// Where every table lives, as TorchRec's `ShardingPlan`: one [`TablePlan`]
/// per table, over `num_devices` devices. Made by the planner
/// ([`plan`](crate::plan())) or read from JSON (hand-written or edited), and
/// checked with [`validate`](Self::validate) before use.
///
/// ```
/// use ember_sharding::{PlannerOptions, ShardingPlan, Topology};
/// use ember_sparse::{EmbeddingBagConfig, TableOptimizer};
///
/// let tables = [
///     EmbeddingBagConfig::new("users", 1000, 16, &["user_id"]),
///     EmbeddingBagConfig::new("items", 500, 8, &["item_id"]),
/// ];
/// let options = PlannerOptions {
///     batch_size: 64,
///     pooling_factor: 2.0,
///     optimizer: TableOptimizer::sgd(0.1),
///     sharding: None,
///     disk_tier: None,
/// };
/// // Two devices of 1 GiB each.
/// let topology = Topology::uniform(2, 1 << 30);
/// let (sharding_plan, _stats) = ember_sharding::plan(&tables, &topology, &options)?;
/// assert_eq!(sharding_plan.num_devices, 2);
/// assert!(sharding_plan.table("users").is_some());
/// sharding_plan.validate(&tables, &options.optimizer)?;
///
/// // A plan is JSON, and reads back equal.
/// let json = serde_json::to_string(&sharding_plan).unwrap();
/// let back: ShardingPlan = serde_json::from_str(&json).unwrap();
/// assert_eq!(back, sharding_plan);
/// assert_eq!(ShardingPlan::from_json(&sharding_plan.to_json())?, sharding_plan);
/// # Ok::<(), ember_sharding::ShardingError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardingPlan {
    /// The number of devices the plan places tables on, `1..=`[`MAX_DEVICES`].
    pub num_devices: usize,
    /// One plan per table, in any order; each table exactly once.
    pub tables: Vec<TablePlan>,
}

impl ShardingPlan {
    /// The disk tier of each of `tables` the plan puts there (its
    /// [`cache_rows`](TablePlan::cache_rows)), its files in `dir`, its
    /// cache under `policy`; `None` for a table in memory: the tiers to
    /// build the model with.
    pub fn disk_tiers(
        &self,
        tables: &[EmbeddingBagConfig],
        dir: &std::path::Path,
        policy: ember_sparse::CachePolicy,
    ) -> Vec<Option<ember_sparse::DiskTierConfig>> {
        (tables.iter())
            .map(|t| {
                let rows = self.table(&t.name)?.cache_rows?;
                Some(ember_sparse::DiskTierConfig {
                    dir: dir.to_path_buf(),
                    cache_rows: rows,
                    policy,
                })
            })
            .collect()
    }

    /// Whether the plan puts any table on the disk tier.
    pub fn uses_disk_tier(&self) -> bool {
        self.tables.iter().any(|t| t.cache_rows.is_some())
    }

    /// The plan of the table called `name`, if it is in the plan.
    pub fn table(&self, name: &str) -> Option<&TablePlan> {
        self.tables.iter().find(|t| t.table == name)
    }

    /// Parses a plan from JSON (unknown fields are refused); fails with
    /// [`ShardingError::Plan`]. Does not [`validate`](Self::validate) it.
    pub fn from_json(text: &str) -> Result<Self, ShardingError> {
        serde_json::from_str(text).map_err(|e| ShardingError::Plan(format!("not a plan: {e}")))
    }

    /// The plan as pretty-printed JSON, as [`from_json`](Self::from_json)
    /// reads it.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan serialises")
    }

    /// Checks that the plan places every row and column of every table
    /// exactly once (every device once for data-parallel), on devices that
    /// exist, and that the optimizer can run on the split.
    pub fn validate(
        &self,
        tables: &[EmbeddingBagConfig],
        optimizer: &TableOptimizer,
    ) -> Result<(), ShardingError> {
        let fail = |m: String| Err(ShardingError::Plan(m));
        if self.num_devices == 0 || self.num_devices > MAX_DEVICES {
            return fail(format!(
                "a plan needs 1 to {MAX_DEVICES} devices, not {}",
                self.num_devices
            ));
        }
        for p in &self.tables {
            if !tables.iter().any(|t| t.name == p.table) {
                return fail(format!("table '{}' is not in the model", p.table));
            }
            if self.tables.iter().filter(|q| q.table == p.table).count() > 1 {
                return fail(format!("table '{}' is planned twice", p.table));
            }
        }
        for t in tables {
            let Some(p) = self.table(&t.name) else {
                return fail(format!("table '{}' is missing from the plan", t.name));
            };
            validate_table(t, p, self.num_devices, optimizer)
                .map_err(|m| ShardingError::Plan(format!("table '{}': {m}", t.name)))?;
        }
        Ok(())
    }
}

/// Why a table of `dtype` trained with `optimizer` cannot be split by
/// columns, if it cannot.
pub(crate) fn column_split_refused(
    optimizer: &TableOptimizer,
    dtype: DataType,
) -> Option<&'static str> {
    if dtype.column_bytes().is_none() {
        return Some(
            "a quantized row shares one scale across its columns, so its columns cannot be split; use table-wise, row-wise, table-row-wise or data-parallel sharding",
        );
    }
    matches!(optimizer, TableOptimizer::RowWiseAdagrad { .. }).then_some(
        "row-wise Adagrad keeps one state per row, which a column split would break into one per column shard (a different optimizer); use table-wise or row-wise sharding, or another optimizer",
    )
}

fn validate_table(
    t: &EmbeddingBagConfig,
    p: &TablePlan,
    devices: usize,
    optimizer: &TableOptimizer,
) -> Result<(), String> {
    if p.shards.is_empty() {
        return Err("no shards".into());
    }
    if let Some(kv) = &t.kv {
        return validate_kv(t, kv, p, devices);
    }
    if (p.shards.iter()).any(|s| matches!(s.rows, RowSplit::Buckets { .. })) {
        return Err(
            "rows of kind buckets split a key-value table's ids; this table is not one".into(),
        );
    }
    if let Some(rows) = p.cache_rows {
        if p.sharding == ShardingType::DataParallel {
            return Err("a data-parallel table cannot be on the disk tier (cache_rows)".into());
        }
        if rows < ember_sparse::CACHE_WAYS {
            return Err(format!(
                "cache_rows {rows} is below one cache set of {}",
                ember_sparse::CACHE_WAYS
            ));
        }
    }
    for s in &p.shards {
        if s.device >= devices {
            return Err(format!(
                "device {} does not exist ({devices} devices)",
                s.device
            ));
        }
        let [c0, c1] = s.columns;
        if c0 >= c1 || c1 > t.embedding_dim {
            return Err(format!(
                "columns {c0}..{c1} are not a non-empty range within 0..{}",
                t.embedding_dim
            ));
        }
        if let RowSplit::Mod { residue, modulus } = s.rows {
            // A modulus above the rows would leave shards empty (and size
            // the coverage check by a hand-written number).
            if modulus == 0 || residue >= modulus || modulus > t.num_embeddings {
                return Err(format!(
                    "residue {residue} of modulus {modulus} (the modulus must be 1..={} rows)",
                    t.num_embeddings
                ));
            }
        }
        if s.rows.count(t.num_embeddings) == 0 {
            return Err(format!(
                "a shard on device {} holds no rows ({:?})",
                s.device, s.rows
            ));
        }
        if let RowSplit::Block { start, end } = s.rows {
            if end > t.num_embeddings || start >= end {
                return Err(format!(
                    "rows {start}..{end} are not within 0..{}",
                    t.num_embeddings
                ));
            }
        }
    }
    if p.sharding == ShardingType::DataParallel {
        let mut seen = vec![false; devices];
        for s in &p.shards {
            if s.rows != RowSplit::All
                || s.columns != [0, t.embedding_dim]
                || std::mem::replace(&mut seen[s.device], true)
            {
                return Err("data-parallel needs one full replica on each device".into());
            }
        }
        if seen.contains(&false) {
            return Err("data-parallel needs one full replica on each device".into());
        }
        return Ok(());
    }
    // Column ranges partition 0..dim; within each, row pieces partition the rows.
    let mut columns: Vec<[usize; 2]> = p.shards.iter().map(|s| s.columns).collect();
    columns.sort_unstable();
    columns.dedup();
    let mut next = 0;
    for c in &columns {
        if c[0] != next {
            return Err(if c[0] < next {
                format!("column ranges overlap at column {}", c[0])
            } else {
                format!("columns {next}..{} are on no device", c[0])
            });
        }
        next = c[1];
    }
    if next != t.embedding_dim {
        return Err(format!(
            "columns {next}..{} are on no device",
            t.embedding_dim
        ));
    }
    if columns.len() > 1 {
        if let Some(why) = column_split_refused(optimizer, t.data_type) {
            return Err(why.into());
        }
    }
    for c in &columns {
        let pieces: Vec<RowSplit> = p
            .shards
            .iter()
            .filter(|s| s.columns == *c)
            .map(|s| s.rows)
            .collect();
        check_rows(&pieces, t.num_embeddings)
            .map_err(|m| format!("columns {}..{}: {m}", c[0], c[1]))?;
    }
    Ok(())
}

/// A key-value table is table-wise (its map whole on one device) or
/// row-wise by buckets: shards of every column whose bucket ranges and
/// row blocks each cover the table's buckets and rows (all but the
/// fallback) once, in the same order, with a zero fallback (a shared
/// learned row cannot be shared by shards).
pub(crate) fn validate_kv(
    t: &EmbeddingBagConfig,
    kv: &ember_sparse::KvConfig,
    p: &TablePlan,
    devices: usize,
) -> Result<(), String> {
    if let Some(s) = p.shards.iter().find(|s| s.device >= devices) {
        return Err(format!(
            "device {} does not exist ({devices} devices)",
            s.device
        ));
    }
    if let Some(s) = p.shards.iter().find(|s| s.columns != [0, t.embedding_dim]) {
        return Err(format!(
            "a key-value table's shards hold every column, not {}..{}",
            s.columns[0], s.columns[1]
        ));
    }
    if p.cache_rows.is_some_and(|r| r < ember_sparse::CACHE_WAYS) {
        return Err(format!(
            "cache_rows is below one cache set of {}",
            ember_sparse::CACHE_WAYS
        ));
    }
    let kind = |k: ShardingType| serde_json::to_value(k).map_or(String::new(), |v| v.to_string());
    match p.sharding {
        ShardingType::TableWise if p.shards.len() == 1 && p.shards[0].rows == RowSplit::All => {
            Ok(())
        }
        ShardingType::RowWise => {
            if kv.fallback != ember_sparse::Fallback::Zeros {
                return Err("a shared fallback row cannot be split over shards: shard a key-value table with one row-wise by buckets only with the zeros fallback, or table-wise".into());
            }
            let (of, capacity) = (kv.buckets(), t.num_embeddings.saturating_sub(1));
            let (mut next_row, mut next_bucket) = (0, 0);
            for s in &p.shards {
                let RowSplit::Buckets {
                    start,
                    end,
                    first_bucket,
                    end_bucket,
                    buckets,
                } = s.rows
                else {
                    return Err("a key-value table is split row-wise by buckets (rows of kind buckets)".into());
                };
                if buckets != of {
                    return Err(format!("{buckets} buckets, not the table's {of}"));
                }
                if (start, first_bucket) != (next_row, next_bucket) || end <= start || end_bucket <= first_bucket {
                    return Err(format!(
                        "shards must follow each other, each with rows and buckets: rows {start}..{end} and buckets {first_bucket}..{end_bucket} after rows ..{next_row} and buckets ..{next_bucket}"
                    ));
                }
                (next_row, next_bucket) = (end, end_bucket);
            }
            if (next_row, next_bucket) != (capacity, of) {
                return Err(format!(
                    "the shards hold rows ..{next_row} and buckets ..{next_bucket}, not the table's {capacity} rows (all but the fallback) and {of} buckets"
                ));
            }
            Ok(())
        }
        ShardingType::TableWise => Err(
            "a key-value table sharded table-wise is one shard of every row (its map whole on one device)".into(),
        ),
        k => Err(format!(
            "a key-value table is sharded table-wise (its map whole on one device) or row-wise by buckets, not {}",
            kind(k)
        )),
    }
}

/// The pieces must hold every row exactly once.
fn check_rows(pieces: &[RowSplit], rows: usize) -> Result<(), String> {
    match pieces {
        [RowSplit::All] => Ok(()),
        _ if pieces.contains(&RowSplit::All) => {
            Err("a full-row shard overlaps another shard".into())
        }
        [RowSplit::Mod { modulus, .. }, ..] => {
            let m = *modulus;
            if pieces.len() != m {
                return Err(format!("{} row pieces for modulus {m}", pieces.len()));
            }
            let mut seen = vec![false; m];
            for r in pieces {
                match *r {
                    RowSplit::Mod { residue, modulus } if modulus == m => {
                        if std::mem::replace(&mut seen[residue], true) {
                            return Err(format!("residue {residue} mod {m} is on two devices"));
                        }
                    }
                    _ => return Err("row pieces mix split kinds or moduli".into()),
                }
            }
            match seen.iter().position(|s| !s) {
                Some(r) => Err(format!("rows with id mod {m} = {r} are on no device")),
                None => Ok(()),
            }
        }
        _ => {
            let mut ranges = Vec::new();
            for r in pieces {
                match *r {
                    RowSplit::Block { start, end } => ranges.push((start, end)),
                    _ => return Err("row pieces mix split kinds".into()),
                }
            }
            ranges.sort_unstable();
            let mut next = 0;
            for (start, end) in ranges {
                if start < next {
                    return Err(format!("rows {start}..{next} are on two devices"));
                }
                if start > next {
                    return Err(format!("rows {next}..{start} are on no device"));
                }
                next = end;
            }
            if next != rows {
                return Err(format!("rows {next}..{rows} are on no device"));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> EmbeddingBagConfig {
        EmbeddingBagConfig::new("t", 10, 4, &["f"])
    }

    fn plan(p: TablePlan) -> Result<(), ShardingError> {
        ShardingPlan {
            num_devices: 3,
            tables: vec![p],
        }
        .validate(&[table()], &TableOptimizer::sgd(0.1))
    }

    #[test]
    fn builders_make_valid_plans() {
        let t = table();
        plan(TablePlan::table_wise(&t, 2)).unwrap();
        plan(TablePlan::row_wise(&t, &[0, 1, 2], ShardingType::RowWise)).unwrap();
        plan(TablePlan::row_wise_mod(&t, &[0, 1, 2])).unwrap();
        plan(TablePlan::column_wise(&t, &[0, 1, 2])).unwrap();
        plan(TablePlan::data_parallel(&t, 3)).unwrap();
        let m = RowSplit::Mod {
            residue: 1,
            modulus: 3,
        };
        assert_eq!(m.count(10), 3); // 1, 4, 7
        assert_eq!(m.local(7), Some(2));
        assert_eq!(m.global(2), 7);
    }

    #[test]
    fn a_key_value_table_is_sharded_table_wise_or_by_buckets() {
        let kv = EmbeddingBagConfig {
            kv: Some(ember_sparse::KvConfig::default()),
            ..table()
        };
        let plan = |p: TablePlan| ShardingPlan {
            num_devices: 2,
            tables: vec![p],
        };
        let opt = TableOptimizer::sgd(0.1);
        let ok = plan(TablePlan::table_wise(&kv, 1));
        ok.validate(std::slice::from_ref(&kv), &opt).unwrap();
        let rows = plan(TablePlan::row_wise(&kv, &[0, 1], ShardingType::RowWise));
        let err = rows
            .validate(std::slice::from_ref(&kv), &opt)
            .unwrap_err()
            .to_string();
        assert!(err.contains("split row-wise by buckets"), "{err}");
        let columns = plan(TablePlan::column_wise(&kv, &[0, 1]));
        let err = columns.validate(&[kv], &opt).unwrap_err().to_string();
        assert!(err.contains("hold every column"), "{err}");
    }

    #[test]
    fn a_key_value_table_split_by_buckets_covers_its_rows_and_buckets_once() {
        let kv = |fallback| EmbeddingBagConfig {
            kv: Some(ember_sparse::KvConfig {
                buckets: Some(8),
                fallback,
                ..Default::default()
            }),
            ..table()
        };
        let zeros = kv(ember_sparse::Fallback::Zeros);
        let check = |t: &EmbeddingBagConfig, p: TablePlan| {
            let plan = ShardingPlan {
                num_devices: 3,
                tables: vec![p],
            };
            plan.validate(std::slice::from_ref(t), &TableOptimizer::sgd(0.1))
                .map_err(|e| e.to_string())
        };
        let good = TablePlan::row_wise_buckets(&zeros, &[2, 0, 1]);
        assert_eq!(good.shards.len(), 3);
        // 9 rows of the 10 (the last is the fallback), 8 buckets.
        assert_eq!(
            good.shards[0].rows,
            RowSplit::Buckets {
                start: 0,
                end: 2,
                first_bucket: 0,
                end_bucket: 2,
                buckets: 8
            }
        );
        check(&zeros, good.clone()).unwrap();
        let edit = |f: &dyn Fn(&mut RowSplit)| {
            let mut p = good.clone();
            f(&mut p.shards[1].rows);
            check(&zeros, p).unwrap_err()
        };
        let set = |what: usize, v: usize| {
            move |r: &mut RowSplit| {
                if let RowSplit::Buckets {
                    start,
                    first_bucket,
                    buckets,
                    ..
                } = r
                {
                    *[start, first_bucket, buckets][what] = v;
                }
            }
        };
        assert!(edit(&set(0, 3)).contains("must follow each other"));
        assert!(edit(&set(1, 3)).contains("must follow each other"));
        assert!(edit(&set(2, 16)).contains("16 buckets, not the table's 8"));
        let shared = kv(ember_sparse::Fallback::SharedRow);
        let p = TablePlan::row_wise_buckets(&shared, &[0, 1]);
        assert!(check(&shared, p)
            .unwrap_err()
            .contains("shared fallback row"));
        // Buckets split key-value tables only.
        let mut p = TablePlan::row_wise(&table(), &[0, 1], ShardingType::RowWise);
        p.shards[0].rows = good.shards[0].rows;
        assert!(check(&table(), p).unwrap_err().contains("not one"));
    }

    #[test]
    fn hand_edited_mistakes_are_named() {
        let t = table();
        let err = |p: TablePlan| plan(p).unwrap_err().to_string();
        let mut p = TablePlan::row_wise(&t, &[0, 1], ShardingType::RowWise);
        p.shards[1].rows = RowSplit::Block { start: 4, end: 10 };
        assert!(err(p).contains("rows 4..5 are on two devices"));
        let mut p = TablePlan::row_wise(&t, &[0, 1], ShardingType::RowWise);
        p.shards[1].rows = RowSplit::Block { start: 6, end: 10 };
        assert!(err(p).contains("rows 5..6 are on no device"));
        let mut p = TablePlan::table_wise(&t, 0);
        p.shards[0].device = 7;
        assert!(err(p).contains("device 7 does not exist"));
        let e = ShardingPlan {
            num_devices: 3,
            tables: vec![],
        }
        .validate(&[table()], &TableOptimizer::sgd(0.1))
        .unwrap_err();
        assert!(e.to_string().contains("table 't' is missing"));
        for (residue, modulus) in [(0, 0), (0, 1 << 40), (3, 2)] {
            let mut p = TablePlan::row_wise_mod(&t, &[0, 1]);
            p.shards[0].rows = RowSplit::Mod { residue, modulus };
            assert!(err(p).contains("modulus"), "{residue} mod {modulus}");
        }
        let too_many = ShardingPlan {
            num_devices: usize::MAX,
            tables: vec![TablePlan::table_wise(&t, 0)],
        };
        assert!(too_many
            .validate(&[table()], &TableOptimizer::sgd(0.1))
            .is_err());
        let cw = ShardingPlan {
            num_devices: 3,
            tables: vec![TablePlan::column_wise(&t, &[0, 1])],
        };
        let e = cw
            .validate(&[table()], &TableOptimizer::rowwise_adagrad(0.1))
            .unwrap_err();
        assert!(e.to_string().contains("row-wise Adagrad"));
    }
}
