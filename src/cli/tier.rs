//! `--disk-dir DIR --cache-memory SIZE|P%`: tables on the disk tier, their
//! caches sized from one budget (`bench embedding`, `bench dlrm`, `train`).

use std::path::PathBuf;

use clap::Args;
use ember_dataloader::lock::DirLock;
use ember_sharding::{DiskTierModel, ShardingPlan};
use ember_sparse::{CachePolicy, DiskTierConfig, EmbeddingBagConfig, TableOptimizer, CACHE_WAYS};

/// A disk-tier cache holds at least this many batches' ids: a batch's rows
/// then fill a set of 16 only by a rare chance (about 2 of them a set).
pub const CACHE_BATCHES: usize = 8;

#[derive(Args, Clone, Debug, Default)]
pub struct TierArgs {
    /// Put every table on the disk tier (sharded: those the plan cannot fit
    /// in memory): its rows and optimizer state in a file in this directory
    /// (removed at the end), behind a cache
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// The disk tier's caches, all tables together: bytes (`4GiB`) or a
    /// share of the tables' bytes (`25%`) [default: 25%]
    #[arg(long, requires = "disk_dir")]
    pub cache_memory: Option<String>,
    /// Which cached row a miss replaces: `lru` (FBGEMM's default) or `lfu`
    /// (a lookup count per table row, 4 bytes each, in memory)
    #[arg(long, default_value = "lru", requires = "disk_dir")]
    pub cache_policy: CachePolicy,
}

impl TierArgs {
    /// One tier per table (all `None` without --disk-dir): each table's
    /// cache its share of the budget by bytes, in whole sets of
    /// [`CACHE_WAYS`] rows. A table whose cache would not hold
    /// `CACHE_BATCHES` times the `batch_ids` a batch looks up in it stays in
    /// RAM (as FBGEMM caches only large tables): its sets would overflow.
    pub fn tiers(
        &self,
        tables: &[EmbeddingBagConfig],
        optimizer: &TableOptimizer,
        batch_ids: usize,
    ) -> anyhow::Result<Vec<Option<DiskTierConfig>>> {
        let Some(dir) = &self.disk_dir else {
            return Ok(vec![None; tables.len()]);
        };
        let share = self.cache_share(tables, optimizer)?;
        Ok(tables
            .iter()
            .map(|t| {
                let rows = (t.num_embeddings as f64 * share) as usize / CACHE_WAYS * CACHE_WAYS;
                (rows >= (CACHE_BATCHES * batch_ids).max(CACHE_WAYS)).then(|| DiskTierConfig {
                    dir: dir.clone(),
                    cache_rows: rows,
                    policy: self.cache_policy,
                })
            })
            .collect())
    }

    /// The tiers of a run: under a `plan`, the tables it puts on the disk
    /// tier (which needs --disk-dir); without one, [`tiers`](Self::tiers).
    pub fn tiers_for(
        &self,
        plan: Option<&ShardingPlan>,
        tables: &[EmbeddingBagConfig],
        optimizer: &TableOptimizer,
        batch_ids: usize,
    ) -> anyhow::Result<Vec<Option<DiskTierConfig>>> {
        let Some(plan) = plan else {
            return self.tiers(tables, optimizer, batch_ids);
        };
        match (
            &self.disk_dir,
            plan.tables.iter().find(|t| t.cache_rows.is_some()),
        ) {
            (Some(dir), _) => Ok(plan.disk_tiers(tables, dir, self.cache_policy)),
            (None, Some(t)) => anyhow::bail!(
                "the plan puts table '{}' on the disk tier: give --disk-dir for its files",
                t.table
            ),
            (None, None) => Ok(vec![None; tables.len()]),
        }
    }

    /// What the planner assumes of the disk tier with these flags (`None`
    /// without --disk-dir): the caches' share of the tables, at least
    /// `CACHE_BATCHES` times the `batch_ids` of a table, misses at the
    /// disk's rate, ids of Zipf exponent `zipf_alpha`.
    pub fn planner_model(
        &self,
        tables: &[EmbeddingBagConfig],
        optimizer: &TableOptimizer,
        batch_ids: usize,
        zipf_alpha: f64,
    ) -> anyhow::Result<Option<DiskTierModel>> {
        if self.disk_dir.is_none() {
            return Ok(None);
        }
        Ok(Some(DiskTierModel {
            cache_share: self.cache_share(tables, optimizer)?,
            min_cache_rows: CACHE_BATCHES * batch_ids,
            reads_per_s: ember_sharding::DEFAULT_DISK_READS_PER_S,
            zipf_alpha,
            policy: self.cache_policy,
        }))
    }

    /// --cache-memory as a share of `tables`' bytes (rows and state).
    fn cache_share(
        &self,
        tables: &[EmbeddingBagConfig],
        optimizer: &TableOptimizer,
    ) -> anyhow::Result<f64> {
        let record = |t: &EmbeddingBagConfig| {
            let row = t.data_type.row_bytes(t.embedding_dim).unwrap_or(usize::MAX) as f64;
            row + 4.0 * optimizer.state_floats_per_row(t.embedding_dim) as f64
        };
        let total: f64 = tables
            .iter()
            .map(|t| record(t) * t.num_embeddings as f64)
            .sum();
        let text = self.cache_memory.as_deref().unwrap_or("25%");
        Ok(match text.strip_suffix('%') {
            Some(p) => {
                p.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|p| *p > 0.0 && *p <= 100.0)
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "--cache-memory {text}: a share is above 0% and at most 100%"
                        )
                    })?
                    / 100.0
            }
            None => {
                let bytes = ember_sharding::topology::parse_bytes(text)
                    .map_err(|e| anyhow::anyhow!("--cache-memory: {e}"))?;
                (bytes as f64 / total.max(1.0)).min(1.0)
            }
        })
    }
}

impl TierArgs {
    /// With --disk-dir, which tables `tiers` put on the disk tier and which
    /// stay in RAM, and why, as one line for the run's output; an error
    /// when --disk-dir was given and (without a `plan` choosing) no table
    /// can go there: its caches would be too small to hold
    /// `CACHE_BATCHES` batches of `batch_ids`.
    pub fn placement(
        &self,
        plan: Option<&ShardingPlan>,
        tables: &[EmbeddingBagConfig],
        tiers: &[Option<DiskTierConfig>],
        batch_ids: usize,
    ) -> anyhow::Result<Option<String>> {
        let Some(dir) = &self.disk_dir else {
            return Ok(None);
        };
        let need = (CACHE_BATCHES * batch_ids).max(CACHE_WAYS);
        let names = |on_disk: bool| -> Vec<&str> {
            (tables.iter().zip(tiers))
                .filter(|(_, t)| t.is_some() == on_disk)
                .map(|(c, _)| c.name.as_str())
                .collect()
        };
        let (disk, ram) = (names(true), names(false));
        let cache = self.cache_memory.as_deref().unwrap_or("25%");
        if disk.is_empty() && plan.is_none() {
            anyhow::bail!(
                "--disk-dir {}: no table goes to the disk tier: with --cache-memory {cache}, every table's cache would hold fewer than the {need} rows it needs ({CACHE_BATCHES} batches of {batch_ids} ids; a smaller cache overflows its sets); give more --cache-memory, or leave --disk-dir out",
                dir.display()
            );
        }
        let why = match plan {
            Some(_) => "the plan fits them in memory".to_string(),
            None => format!(
                "with --cache-memory {cache} their caches would hold fewer than {need} rows"
            ),
        };
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
            line += &format!("; in RAM: {} ({}), as {why}", ram.len(), list(&ram));
        }
        Ok(Some(line))
    }

    /// Takes --disk-dir (if given) for this run: makes it, locks it (one
    /// run per directory; `root`: this process is the one that locks, rank
    /// 0 under mpirun, whose ranks share it) and removes the table files
    /// killed runs left there. Returns the lock, to hold for the run, and a
    /// line saying what was reclaimed, if anything.
    pub fn take_dir(
        &self,
        root: bool,
        what: &str,
    ) -> anyhow::Result<(Option<DirLock>, Option<String>)> {
        let Some(dir) = &self.disk_dir else {
            return Ok((None, None));
        };
        use anyhow::Context;
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        if !root {
            return Ok((None, None));
        }
        let lock = DirLock::acquire(dir, what).context("--disk-dir")?;
        let reclaimed = ember_sparse::reclaim_row_files(dir).with_context(|| {
            format!("--disk-dir {}: removing killed runs' files", dir.display())
        })?;
        let line = (!reclaimed.is_empty()).then(|| {
            let bytes: u64 = reclaimed.iter().map(|(_, b)| b).sum();
            format!(
                "--disk-dir {}: removed {} table file(s) of killed runs ({:.1} MB)",
                dir.display(),
                reclaimed.len(),
                bytes as f64 / 1e6
            )
        });
        Ok((Some(lock), line))
    }
}

/// `config` as it sits in memory: a disk-tier table is its cache.
pub fn resident(
    config: &ember_models::DlrmConfig,
    tiers: &[Option<DiskTierConfig>],
) -> ember_models::DlrmConfig {
    let mut resident = config.clone();
    for (t, tier) in resident.tables.iter_mut().zip(tiers) {
        if let Some(tier) = tier {
            t.num_embeddings = t.num_embeddings.min(tier.cache_rows);
        }
    }
    resident
}

/// The disk tier's figures over a run (`--json`'s `disk_tier`).
#[derive(Debug, serde::Serialize)]
pub struct TierReport {
    /// Bytes of the model's tables in memory (a disk-tier table's: its
    /// cache's and its bookkeeping).
    pub cache_bytes: u64,
    /// The caches' policy: `lru` or `lfu`.
    pub cache_policy: String,
    /// Share of lookups the caches served.
    pub hit_rate: f64,
    /// The best hit rate any cache could have had: misses only of rows
    /// looked up for the first time.
    pub hit_rate_bound: f64,
    pub bytes_read_per_step: f64,
    pub bytes_written_per_step: f64,
}

impl TierReport {
    /// `model`'s caches (a rank's: its shards') over its `steps` steps;
    /// `None` with no table on the disk tier.
    pub fn of(model: &ember_models::Dlrm, steps: f64) -> Option<Self> {
        let arch = model.sparse_arch();
        let tables: Vec<&ember_sparse::EmbeddingTable> = match arch.sharded() {
            Some(s) => s.local_shards().into_iter().map(|l| l.data).collect(),
            None => arch.local()?.tables().iter().collect(),
        };
        if !tables.iter().any(|t| t.is_on_disk()) {
            return None;
        }
        let policy = tables.iter().find_map(|t| t.disk_tier()).map(|c| c.policy);
        let totals = totals(tables.into_iter());
        let steps = steps.max(1.0);
        Some(Self {
            cache_bytes: model.sparse_arch().bytes() as u64,
            cache_policy: policy.unwrap_or_default().to_string(),
            hit_rate: totals.hit_rate(),
            hit_rate_bound: totals.hit_rate_bound(),
            bytes_read_per_step: totals.bytes_read as f64 / steps,
            bytes_written_per_step: totals.bytes_written as f64 / steps,
        })
    }
}

impl std::fmt::Display for TierReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "disk tier: caches {:.2} GiB ({}), hit rate {:.1}% (at most {:.1}%: first lookups), {:.2} MB read and {:.2} MB written per step",
            self.cache_bytes as f64 / (1u64 << 30) as f64,
            self.cache_policy,
            self.hit_rate * 100.0,
            self.hit_rate_bound * 100.0,
            self.bytes_read_per_step / 1e6,
            self.bytes_written_per_step / 1e6
        )
    }
}

/// The disk tier's figures, summed over `tables`' disk-tier tables.
pub fn totals<'a>(
    tables: impl Iterator<Item = &'a ember_sparse::EmbeddingTable>,
) -> ember_sparse::TierStats {
    tables.filter_map(|t| t.tier_stats()).sum()
}
