//! `ember checkpoint`: work on a run's checkpoint directory. `compact`
//! folds a chain of delta checkpoints into one full file.

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
