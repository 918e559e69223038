//! `--disk-dir DIR --cache-memory SIZE|P%`: tables on the disk tier, their
//! caches sized from one budget (`bench embedding`, `bench dlrm`, `train`).

use std::path::PathBuf;

use clap::Args;
use ember_models::disk_tier::DiskTierError;
use ember_models::{CacheBudget, DiskTierOptions, ModelError};
use ember_sparse::CachePolicy;

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
    /// The disk tier these flags ask for (`None` without --disk-dir).
    pub fn options(&self) -> anyhow::Result<Option<DiskTierOptions>> {
        let Some(dir) = &self.disk_dir else {
            return Ok(None);
        };
        let cache = match &self.cache_memory {
            None => CacheBudget::default(),
            Some(text) => text
                .parse()
                .map_err(|e| anyhow::anyhow!("--cache-memory: {e}"))?,
        };
        Ok(Some(DiskTierOptions {
            dir: dir.clone(),
            cache,
            policy: self.cache_policy,
        }))
    }

    /// A builder's error in these flags' words: which flag sets what the
    /// disk tier could not do.
    pub fn explain(&self, e: ModelError) -> anyhow::Error {
        match e {
            ModelError::DiskTier(e @ DiskTierError::NoTableFits { .. }) => {
                anyhow::anyhow!("--disk-dir/--cache-memory: {e}")
            }
            ModelError::DiskTier(e @ DiskTierError::PlanWithoutDir { .. }) => {
                anyhow::anyhow!("{e}: give --disk-dir")
            }
            ModelError::DiskTier(e) => anyhow::anyhow!("--disk-dir: {e}"),
            e => e.into(),
        }
    }
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
    /// Bytes of the disk-tier tables' files (records, headers and the
    /// log's room to clean).
    pub disk_bytes: u64,
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
        let disk_bytes = (tables.iter().filter(|t| t.is_on_disk()))
            .map(|t| {
                let record = t.bytes_per_row() + 4 * t.state_floats_per_row();
                ember_sparse::disk_tier_file_bytes(t.num_embeddings() as u64, record as u64)
            })
            .sum();
        let totals = totals(tables.into_iter());
        let steps = steps.max(1.0);
        Some(Self {
            cache_bytes: model.sparse_arch().bytes() as u64,
            cache_policy: policy.unwrap_or_default().to_string(),
            hit_rate: totals.hit_rate(),
            hit_rate_bound: totals.hit_rate_bound(),
            bytes_read_per_step: totals.bytes_read as f64 / steps,
            bytes_written_per_step: totals.bytes_written as f64 / steps,
            disk_bytes,
        })
    }
}

impl std::fmt::Display for TierReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "disk tier: files {:.2} GiB, in memory {:.2} GiB ({}), hit rate {:.1}% (at most {:.1}%: first lookups), {:.2} MB read and {:.2} MB written per step",
            self.disk_bytes as f64 / (1u64 << 30) as f64,
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
