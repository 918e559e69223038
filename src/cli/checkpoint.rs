//! `ember checkpoint`: work on a run's checkpoint directory. `compact`
//! folds a chain of delta checkpoints into one full file; `inspect` says
//! what a checkpoint holds, its key-value tables' figures with it.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand};
use serde::Serialize;

use ember_models::checkpoint::{compact, CompactSummary};

#[derive(Subcommand)]
pub enum CheckpointCommand {
    /// Fold a directory's delta checkpoints into its full checkpoint
    /// (model.safetensors, written atomically), then remove them.
    Compact(CompactArgs),
    /// What a checkpoint holds (a file, a set's index, a run's directory,
    /// a delta: the chain up to it): its files, position, tables, and each
    /// key-value table's figures, from the metadata (no table is loaded).
    Inspect(InspectArgs),
}

#[derive(Args, Clone, Debug)]
pub struct InspectArgs {
    /// The checkpoint: a file, a set's index or a directory.
    pub path: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One table of an inspected checkpoint.
#[derive(Debug, Serialize)]
pub struct TableInfo {
    pub table: String,
    pub rows: usize,
    pub dim: usize,
    pub dtype: ember_sparse::DataType,
    /// A key-value table's figures as saved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_value: Option<ember_sparse::KvStats>,
}

#[derive(Debug, Serialize)]
pub struct InspectReport {
    pub path: PathBuf,
    pub files: Vec<PathBuf>,
    pub deltas: usize,
    /// Training steps, if the checkpoint records where training stood.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    pub tables: Vec<TableInfo>,
}

pub fn run_inspect(args: &InspectArgs) -> anyhow::Result<InspectReport> {
    let ckpt = ember_models::Checkpoint::open(&args.path)?;
    let mut kv = ckpt.kv_stats()?.into_iter();
    let mut next_kv = kv.next();
    let tables = (ckpt.config().tables.iter())
        .map(|t| {
            let key_value = match &next_kv {
                Some((name, _)) if *name == t.name => {
                    std::mem::replace(&mut next_kv, kv.next()).map(|(_, s)| s)
                }
                _ => None,
            };
            TableInfo {
                table: t.name.clone(),
                rows: t.num_embeddings,
                dim: t.embedding_dim,
                dtype: t.data_type,
                key_value,
            }
        })
        .collect();
    Ok(InspectReport {
        path: args.path.clone(),
        files: ckpt.files(),
        deltas: ckpt.delta_count(),
        steps: ckpt.train_state().map(|t| t.steps),
        tables,
    })
}

impl std::fmt::Display for InspectReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} file(s), {} delta(s)",
            self.path.display(),
            self.files.len(),
            self.deltas
        )?;
        if let Some(steps) = self.steps {
            write!(f, ", {steps} training steps")?;
        }
        for t in &self.tables {
            write!(
                f,
                "\n  {}: {} rows x {}, {}",
                t.table, t.rows, t.dim, t.dtype
            )?;
            if let Some(s) = &t.key_value {
                write!(
                    f,
                    "; key-value: {} of {} rows held, {} ids seen, {} admitted, {} rejected, {} without room, {} evicted, {} fallback reads",
                    s.occupancy, s.capacity, s.seen, s.admitted, s.rejected, s.full, s.evicted, s.fallback_reads
                )?;
            }
        }
        Ok(())
    }
}

#[derive(Args, Clone, Debug)]
pub struct CompactArgs {
    /// The run's checkpoint directory (its --checkpoint-dir).
    pub dir: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct CompactReport {
    #[serde(flatten)]
    pub summary: CompactSummary,
    pub seconds: f64,
}

pub fn run_compact(args: &CompactArgs) -> anyhow::Result<CompactReport> {
    let start = Instant::now();
    let summary = compact(&args.dir)?;
    Ok(CompactReport {
        summary,
        seconds: start.elapsed().as_secs_f64(),
    })
}

impl std::fmt::Display for CompactReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.summary;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "{} deltas folded into {} ({:.1} MiB; the chain was {:.1} MiB) in {:.1} s",
            s.deltas,
            s.path.display(),
            mib(s.bytes_after),
            mib(s.bytes_before),
            self.seconds
        )
    }
}
