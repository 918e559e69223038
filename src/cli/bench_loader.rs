//! `ember bench loader`: decoded-batch throughput of the Parquet loader.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use super::arch::TableArgs;
use super::data::LoaderArgs;
use super::Progress;

#[derive(Args, Clone, Debug)]
pub struct LoaderBenchArgs {
    /// Parquet files or directories.
    #[arg(long, required = true, num_args = 1..)]
    pub data: Vec<PathBuf>,
    #[arg(long, default_value_t = 2048)]
    pub mini_batch_size: usize,
    #[arg(long, default_value_t = 1)]
    pub epochs: u64,
    #[command(flatten)]
    pub tables: TableArgs,
    #[command(flatten)]
    pub loader: LoaderArgs,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct LoaderReport {
    pub run: super::run_info::RunInfo,
    pub rows: u64,
    /// Categorical ids in all (a row has one per scalar feature, any number per multi-hot one).
    pub ids: u64,
    pub batches: u64,
    pub seconds: f64,
    pub rows_per_s: f64,
    /// Megabytes (1e6) per second of decoded batches: dense and labels as
    /// f32, ids as i64, one i32 length per bag.
    pub mb_per_s: f64,
    pub loader_threads: usize,
    pub mini_batch_size: usize,
}

impl std::fmt::Display for LoaderReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rows in {} batches, {:.2} s: {:.0} rows/s, {:.1} MB/s decoded ({} decoding threads)",
            self.rows,
            self.batches,
            self.seconds,
            self.rows_per_s,
            self.mb_per_s,
            self.loader_threads
        )
    }
}

pub fn run(args: &LoaderBenchArgs) -> anyhow::Result<LoaderReport> {
    let shape = || Ok((1, args.tables.rows()?));
    let spec = match args.loader.spec(&shape)? {
        Some(spec) => spec,
        None => args.loader.criteo(&args.tables.tables()?),
    };
    let loader = args.loader.open(&args.data, spec, args.mini_batch_size)?;
    let total: u64 = (0..args.epochs).map(|e| loader.batches_per_epoch(e)).sum();
    let progress = Progress::new(total, "loader", args.json);
    let (mut rows, mut ids, mut bytes, mut batches) = (0u64, 0u64, 0u64, 0u64);
    let start = Instant::now();
    for epoch in 0..args.epochs {
        for batch in loader.epoch(epoch, 0) {
            let batch = batch?;
            rows += batch.size() as u64;
            ids += batch.sparse.values().len() as u64;
            bytes += batch.bytes() as u64;
            batches += 1;
            progress.inc();
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    progress.finish();
    Ok(LoaderReport {
        run: super::run_info::RunInfo::now(),
        rows,
        ids,
        batches,
        seconds,
        rows_per_s: rows as f64 / seconds.max(1e-9),
        mb_per_s: bytes as f64 / 1e6 / seconds.max(1e-9),
        loader_threads: args.loader.loader_threads,
        mini_batch_size: args.mini_batch_size,
    })
}
