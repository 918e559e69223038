//! Tables on the disk tier, sized from one cache budget: which tables go
//! there, how many rows each cache holds, what the planner assumes of them,
//! and the directory their files live in (one run per directory, files of
//! killed runs reclaimed). [`DlrmBuilder::disk_tier`](crate::DlrmBuilder::disk_tier)
//! does all of it; the parts are public for programs that build
//! collections themselves.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use ember_dataloader::lock::DirLock;
use ember_sharding::{DiskTierModel, ShardingPlan};
use ember_sparse::{CachePolicy, DiskTierConfig, EmbeddingBagConfig, TableOptimizer, CACHE_WAYS};

/// A disk-tier cache holds at least this many batches' ids: a batch's rows
/// then fill a set of 16 only by a rare chance (about 2 of them a set).
pub const CACHE_BATCHES: usize = 8;

/// The disk tier's caches, all tables together.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CacheBudget {
    /// A share (above 0, at most 1) of the tables' bytes, rows and state.
    Share(f64),
    /// Bytes.
    Bytes(u64),
}

impl Default for CacheBudget {
    /// A quarter of the tables' bytes.
    fn default() -> Self {
        Self::Share(0.25)
    }
}

impl fmt::Display for CacheBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Rounded: 0.07 * 100 is 7.000000000000001.
            Self::Share(s) => write!(f, "{}%", (s * 1e8).round() / 1e6),
            Self::Bytes(b) => write!(f, "{b} bytes"),
        }
    }
}

impl FromStr for CacheBudget {
    type Err = String;

    /// `25%` (a share) or bytes with an optional unit (`4GiB`, `512MB`).
    fn from_str(text: &str) -> Result<Self, String> {
        match text.strip_suffix('%') {
            Some(p) => p
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|p| *p > 0.0 && *p <= 100.0)
                .map(|p| Self::Share(p / 100.0))
                .ok_or_else(|| format!("{text}: a share is above 0% and at most 100%")),
            None => ember_sharding::topology::parse_bytes(text).map(Self::Bytes),
        }
    }
}

/// Where the disk tier's files go and how big its caches are.
#[derive(Clone, Debug, PartialEq)]
pub struct DiskTierOptions {
    /// The directory of the tables' files (made if missing; one run at a
    /// time; the files are removed when the tables drop).
    pub dir: PathBuf,
    /// The caches' budget, shared by the tables by their bytes.
    pub cache: CacheBudget,
    /// Which cached row a miss replaces.
    pub policy: CachePolicy,
}

impl DiskTierOptions {
    /// Files in `dir`, caches of a quarter of the tables, LRU (FBGEMM's default).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            cache: CacheBudget::default(),
            policy: CachePolicy::default(),
        }
    }

    /// One tier per table: each table's cache its share of the budget by
    /// bytes, in whole sets of [`CACHE_WAYS`] rows. A table whose cache
    /// would not hold [`CACHE_BATCHES`] times the `batch_ids` a batch looks
    /// up in it stays in RAM (`None`; FBGEMM too caches only large tables):
    /// its sets would overflow. So does a key-value table with L2-norm
    /// eviction, which reads every candidate's row (a disk read each).
    pub fn tiers(
        &self,
        tables: &[EmbeddingBagConfig],
        optimizer: &TableOptimizer,
        batch_ids: usize,
    ) -> Vec<Option<DiskTierConfig>> {
        let share = self.cache_share(tables, optimizer);
        (tables.iter())
            .map(|t| {
                let rows = (t.num_embeddings as f64 * share) as usize / CACHE_WAYS * CACHE_WAYS;
                // L2-norm eviction reads candidates' rows: those tables stay in RAM.
                let l2 =
                    (t.kv.as_ref()).is_some_and(|k| k.eviction == ember_sparse::Eviction::L2Norm);
                let fits = rows >= min_cache_rows(batch_ids) && !l2;
                fits.then(|| DiskTierConfig {
                    dir: self.dir.clone(),
                    cache_rows: rows,
                    policy: self.policy,
                })
            })
            .collect()
    }

    /// What the planner assumes of this tier: the caches' share of the
    /// tables, at least [`CACHE_BATCHES`] times the `batch_ids` of a table,
    /// misses at the disk's rate, ids of Zipf exponent `zipf_alpha`.
    pub fn planner_model(
        &self,
        tables: &[EmbeddingBagConfig],
        optimizer: &TableOptimizer,
        batch_ids: usize,
        zipf_alpha: f64,
    ) -> DiskTierModel {
        DiskTierModel {
            cache_share: self.cache_share(tables, optimizer),
            min_cache_rows: min_cache_rows(batch_ids),
            reads_per_s: ember_sharding::DEFAULT_DISK_READS_PER_S,
            zipf_alpha,
            policy: self.policy,
        }
    }

    /// The budget as a share of `tables`' bytes (rows and state), at most 1.
    pub fn cache_share(&self, tables: &[EmbeddingBagConfig], optimizer: &TableOptimizer) -> f64 {
        match self.cache {
            CacheBudget::Share(s) => s,
            CacheBudget::Bytes(bytes) => {
                let record = |t: &EmbeddingBagConfig| {
                    let row = t.data_type.row_bytes(t.embedding_dim).unwrap_or(usize::MAX);
                    row as f64 + 4.0 * optimizer.state_floats_per_row(t.embedding_dim) as f64
                };
                let total: f64 = (tables.iter())
                    .map(|t| record(t) * t.num_embeddings as f64)
                    .sum();
                (bytes as f64 / total.max(1.0)).min(1.0)
            }
        }
    }

    /// Takes the directory for one run: makes it, locks it (`what` names
    /// the run to one that finds it taken) and removes the table files
    /// killed runs left there, returned with their sizes.
    pub fn take_dir(&self, what: &str) -> Result<TakenDir, DiskTierError> {
        let lock = DirLock::acquire(&self.dir, what)?;
        let reclaimed = ember_sparse::reclaim_row_files(&self.dir)
            .map_err(self.io("removing killed runs' files"))?;
        Ok(TakenDir { lock, reclaimed })
    }
}

impl DiskTierOptions {
    /// Makes the directory (as a rank that shares it with the one that
    /// takes it does).
    pub fn make_dir(&self) -> Result<(), DiskTierError> {
        std::fs::create_dir_all(&self.dir).map_err(self.io("making it"))
    }

    fn io(&self, doing: &'static str) -> impl FnOnce(std::io::Error) -> DiskTierError + '_ {
        move |source| DiskTierError::Io {
            dir: self.dir.clone(),
            doing,
            source,
        }
    }
}

/// The smallest cache a batch of `batch_ids` ids does not overflow.
fn min_cache_rows(batch_ids: usize) -> usize {
    (CACHE_BATCHES * batch_ids).max(CACHE_WAYS)
}

/// A disk-tier directory held by this run ([`DiskTierOptions::take_dir`]).
#[derive(Debug)]
pub struct TakenDir {
    /// The directory's lock, released when dropped.
    pub lock: DirLock,
    /// The files of killed runs removed, with their sizes in bytes.
    pub reclaimed: Vec<(PathBuf, u64)>,
}

impl TakenDir {
    /// A line saying what was reclaimed, if anything.
    pub fn reclaimed_line(&self) -> Option<String> {
        (!self.reclaimed.is_empty()).then(|| {
            let bytes: u64 = self.reclaimed.iter().map(|(_, b)| b).sum();
            format!(
                "disk tier in {}: removed {} table file(s) of killed runs ({:.1} MB)",
                parent(&self.lock).display(),
                self.reclaimed.len(),
                bytes as f64 / 1e6
            )
        })
    }
}

/// The directory a lock holds.
fn parent(lock: &DirLock) -> &Path {
    lock.path().parent().unwrap_or(lock.path())
}

/// The tiers of a model: under a `plan`, the tables it puts on the disk
/// tier (which needs `options`); without one, [`DiskTierOptions::tiers`]
/// (all in RAM without `options`).
pub fn tiers_for(
    options: Option<&DiskTierOptions>,
    plan: Option<&ShardingPlan>,
    tables: &[EmbeddingBagConfig],
    optimizer: &TableOptimizer,
    batch_ids: usize,
) -> Result<Vec<Option<DiskTierConfig>>, DiskTierError> {
    let tiers = match (options, plan) {
        (None, Some(plan)) => match plan.tables.iter().find(|t| t.cache_rows.is_some()) {
            Some(t) => {
                let table = t.table.clone();
                return Err(DiskTierError::PlanWithoutDir { table });
            }
            None => vec![None; tables.len()],
        },
        (None, None) => vec![None; tables.len()],
        (Some(o), Some(plan)) => plan.disk_tiers(tables, &o.dir, o.policy),
        (Some(o), None) => o.tiers(tables, optimizer, batch_ids),
    };
    if let (Some(o), None) = (options, plan) {
        if tiers.iter().all(Option::is_none) {
            return Err(DiskTierError::NoTableFits {
                dir: o.dir.clone(),
                cache: o.cache,
                need: min_cache_rows(batch_ids),
                batch_ids,
            });
        }
    }
    Ok(tiers)
}

/// Which of `tables` `tiers` put on the disk tier of `dir` and which stay
/// in RAM, and why (`planned`: a plan chose), as one line for a run's output.
pub fn placement_line(
    dir: &Path,
    planned: bool,
    tables: &[EmbeddingBagConfig],
    tiers: &[Option<DiskTierConfig>],
) -> String {
    let names = |on_disk: bool| -> Vec<&str> {
        (tables.iter().zip(tiers))
            .filter(|(_, t)| t.is_some() == on_disk)
            .map(|(c, _)| c.name.as_str())
            .collect()
    };
    let (disk, ram) = (names(true), names(false));
    let list = |n: &[&str]| match n.len() {
        0..=6 => n.join(", "),
        k => format!("{}, and {} more", n[..5].join(", "), k - 5),
    };
    let mut line = format!(
        "disk tier in {}: {} of {} tables ({})",
        dir.display(),
        disk.len(),
        tables.len(),
        list(&disk)
    );
    if !ram.is_empty() {
        let why = match planned {
            true => "the plan fits them in memory",
            false => "their caches would not hold enough batches of ids (or they evict by L2 norm)",
        };
        line += &format!("; in RAM: {} ({}), as {why}", ram.len(), list(&ram));
    }
    line
}

/// What the disk tier cannot do as asked ([`ModelError::DiskTier`](crate::ModelError::DiskTier)).
#[derive(Debug, thiserror::Error)]
pub enum DiskTierError {
    /// No table's cache would hold the rows a batch needs.
    #[error(
        "disk tier in {}: no table goes to the disk tier: with a cache budget of {cache}, every table's cache would hold fewer than the {need} rows it needs ({CACHE_BATCHES} batches of {batch_ids} ids; a smaller cache overflows its sets), or the table is key-value with L2-norm eviction (kept in RAM: it reads every candidate's row); give a larger budget, or no disk tier",
        dir.display()
    )]
    NoTableFits {
        /// The directory.
        dir: PathBuf,
        /// The budget.
        cache: CacheBudget,
        /// The rows a cache needs.
        need: usize,
        /// The ids one batch looks up in a table.
        batch_ids: usize,
    },
    /// The plan puts a table on the disk tier and no directory was given.
    #[error(
        "the plan puts table '{table}' on the disk tier, and no directory was given for its files"
    )]
    PlanWithoutDir {
        /// The table.
        table: String,
    },
    /// The directory cannot be made or locked, or another run holds it.
    #[error(transparent)]
    Dir(#[from] ember_dataloader::DataError),
    /// The directory cannot be made, or files of killed runs removed.
    #[error("disk tier in {}: {doing}: {source}", dir.display())]
    Io {
        /// The directory.
        dir: PathBuf,
        /// What failed.
        doing: &'static str,
        /// Why.
        source: std::io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_as_shares_or_bytes() {
        assert_eq!("25%".parse(), Ok(CacheBudget::Share(0.25)));
        assert_eq!("1KiB".parse(), Ok(CacheBudget::Bytes(1024)));
        for bad in ["0%", "101%", "x%", "1KiB?"] {
            assert!(bad.parse::<CacheBudget>().is_err(), "{bad}");
        }
    }

    #[test]
    fn small_tables_stay_in_ram_and_none_fitting_is_refused() {
        let tables = crate::DlrmConfig::criteo_tables(&[100_000, 100], 4);
        let opt = TableOptimizer::rowwise_adagrad(0.1);
        let tier = DiskTierOptions::new("/tmp/unused");
        let tiers = tiers_for(Some(&tier), None, &tables, &opt, 64).unwrap();
        assert_eq!(tiers[0].as_ref().map(|t| t.cache_rows), Some(24_992));
        assert!(tiers[1].is_none(), "a 25-row cache overflows");
        let line = placement_line(&tier.dir, false, &tables, &tiers);
        assert!(
            line.contains("1 of 2 tables (t_cat_0); in RAM: 1 (t_cat_1)"),
            "{line}"
        );

        let err = tiers_for(Some(&tier), None, &tables, &opt, 10_000).unwrap_err();
        assert!(err.to_string().contains("80000 rows"), "{err}");
    }
}
