//! `--disk-dir DIR --cache-memory SIZE|P%`: tables on the disk tier, their
//! caches sized from one budget (`bench embedding`, `bench dlrm`).

use std::path::PathBuf;

use clap::Args;
use ember_sparse::{DiskTierConfig, EmbeddingBagConfig, TableOptimizer, CACHE_WAYS};

/// A disk-tier cache holds at least this many batches' ids: a batch's rows
/// then fill a set of 16 only by a rare chance (about 2 of them a set).
pub const CACHE_BATCHES: usize = 8;

#[derive(Args, Clone, Debug, Default)]
pub struct TierArgs {
    /// Put every table on the disk tier: its rows and optimizer state in a
    /// file in this directory (removed at the end), behind a cache
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// The disk tier's caches, all tables together: bytes (`4GiB`) or a
    /// share of the tables' bytes (`25%`) [default: 25%]
    #[arg(long, requires = "disk_dir")]
    pub cache_memory: Option<String>,
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
        let record = |t: &EmbeddingBagConfig| {
            let row = t.data_type.row_bytes(t.embedding_dim).unwrap_or(usize::MAX) as f64;
            row + 4.0 * optimizer.state_floats_per_row(t.embedding_dim) as f64
        };
        let total: f64 = tables
            .iter()
            .map(|t| record(t) * t.num_embeddings as f64)
            .sum();
        let text = self.cache_memory.as_deref().unwrap_or("25%");
        let share = match text.strip_suffix('%') {
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
        };
        Ok(tables
            .iter()
            .map(|t| {
                let rows = (t.num_embeddings as f64 * share) as usize / CACHE_WAYS * CACHE_WAYS;
                (rows >= (CACHE_BATCHES * batch_ids).max(CACHE_WAYS)).then(|| DiskTierConfig {
                    dir: dir.clone(),
                    cache_rows: rows,
                })
            })
            .collect())
    }
}

/// The disk tier's figures, summed over `tables`' disk-tier tables.
pub fn totals<'a>(
    tables: impl Iterator<Item = &'a ember_sparse::EmbeddingTable>,
) -> ember_sparse::TierStats {
    tables.filter_map(|t| t.tier_stats()).sum()
}
