//! `ember quantize`: a checkpoint's tables converted to another data type,
//! written as a new checkpoint for `eval` and `predict`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use ember_dataloader::lock::DirLock;
use serde::Serialize;

use ember_models::checkpoint::{quantize, QuantizeSummary};
use ember_sparse::DataType;

#[derive(Args, Clone, Debug)]
pub struct QuantizeArgs {
    /// The checkpoint to convert (a file, or a set's directory or index).
    #[arg(long)]
    pub checkpoint: PathBuf,
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
    pub checkpoint: PathBuf,
    pub output: PathBuf,
    #[serde(flatten)]
    pub summary: QuantizeSummary,
    pub seconds: f64,
}

pub fn run(args: &QuantizeArgs) -> anyhow::Result<QuantizeReport> {
    let start = Instant::now();
    // One writer of the output's directory (a training run's, say).
    let _lock = DirLock::for_file(&args.output, "ember quantize").context("--output")?;
    let summary = quantize(&args.checkpoint, args.dtype, &args.output)?;
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
        write!(
            f,
            "{} tables of {} converted to {} ({:.1} MiB of rows, was {:.1} MiB) in {:.1} s: {}",
            s.converted.len(),
            self.checkpoint.display(),
            s.data_type,
            mib(s.table_bytes_after),
            mib(s.table_bytes_before),
            self.seconds,
            self.output.display()
        )
    }
}
