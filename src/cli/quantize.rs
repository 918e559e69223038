//! `ember quantize`: a checkpoint's tables converted to another data type,
//! written as a new checkpoint for `eval`, `predict` and `serve`; or a
//! new model of an architecture's shape written straight in that type
//! (for a model too large to hold twice, as MLPerf DLRMv2's tables here).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use ember_dataloader::lock::DirLock;
use serde::Serialize;

use ember_models::checkpoint::{quantize, quantize_new, QuantizeSummary};
use ember_sparse::DataType;

#[derive(Args, Clone, Debug)]
pub struct QuantizeArgs {
    /// The checkpoint to convert (a file, or a set's directory or index).
    #[arg(long, required_unless_present = "preset", conflicts_with = "preset")]
    pub checkpoint: Option<PathBuf>,
    /// Instead of a checkpoint, a new model of this shape (with the other
    /// architecture flags), its rows drawn from --seed, untrained: for
    /// sizing and serving a model too large to hold twice.
    #[command(flatten)]
    pub arch: super::arch::ArchArgs,
    /// Seeds a new model's rows (with --preset).
    #[arg(long, default_value_t = 1, requires = "preset")]
    pub seed: u64,
    /// A new model's tables on the disk tier (with --preset): each row is
    /// drawn and written a piece at a time, none held in memory.
    #[command(flatten)]
    pub tier: super::tier::TierArgs,
    /// The tables' new type: int8, int4, fp8 or mxfp4 (quantized, for
    /// inference), or fp16, bf16, fp32.
    #[arg(long, value_parser = super::parse_data_type)]
    pub dtype: DataType,
    /// The checkpoint to write (a file; written atomically).
    #[arg(long)]
    pub output: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct QuantizeReport {
    /// The checkpoint converted (none for a new model).
    pub checkpoint: Option<PathBuf>,
    pub output: PathBuf,
    #[serde(flatten)]
    pub summary: QuantizeSummary,
    pub seconds: f64,
}

pub fn run(args: &QuantizeArgs) -> anyhow::Result<QuantizeReport> {
    let start = Instant::now();
    let new_only: Vec<&str> = (args.arch.given_architecture_flags().into_iter())
        .chain(args.arch.table_dtype.is_some().then_some("--table-dtype"))
        .chain(args.tier.disk_dir.is_some().then_some("--disk-dir"))
        .collect();
    if args.checkpoint.is_some() {
        anyhow::ensure!(
            new_only.is_empty(),
            "--checkpoint takes its architecture from the file: {} apply to a new model (--preset)",
            new_only.join(", ")
        );
    } else {
        anyhow::ensure!(
            args.arch.table_dtype.is_none(),
            "--table-dtype: a new model's tables are written in --dtype"
        );
    }
    // One writer of the output's directory (a training run's, say).
    let _lock = DirLock::for_file(&args.output, "ember quantize").context("--output")?;
    let summary = match &args.checkpoint {
        Some(checkpoint) => quantize(checkpoint, args.dtype, &args.output)?,
        None => {
            let (config, _, _) = args.arch.resolve()?;
            let tier = args.tier.options()?;
            quantize_new(&config, args.seed, args.dtype, tier, &args.output)
                .map_err(|e| args.tier.explain(e))?
        }
    };
    Ok(QuantizeReport {
        checkpoint: args.checkpoint.clone(),
        output: args.output.clone(),
        summary,
        seconds: start.elapsed().as_secs_f64(),
    })
}

impl std::fmt::Display for QuantizeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.summary;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let from = match &self.checkpoint {
            Some(c) => c.display().to_string(),
            None => "a new model".into(),
        };
        write!(
            f,
            "{} tables of {} converted to {} ({:.1} MiB of rows, was {:.1} MiB) in {:.1} s: {}",
            s.converted.len(),
            from,
            s.data_type,
            mib(s.table_bytes_after),
            mib(s.table_bytes_before),
            self.seconds,
            self.output.display()
        )
    }
}
