use clap::{Parser, Subcommand};

use ember::cli::ingest::{self, IngestCommand, IngestReport};
use ember::cli::{bench_dlrm, bench_embedding, bench_loader, devices, serve, sharding, train};

/// Ember: train and benchmark recommendation models (DLRM and kin).
#[derive(Parser)]
#[command(name = "ember", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmarks.
    #[command(subcommand)]
    Bench(Bench),
    /// Convert data into Ember's Parquet schema.
    #[command(subcommand)]
    Ingest(IngestCommand),
    /// Train a DLRM on Parquet data.
    Train(train::TrainArgs),
    /// AUC, log loss and accuracy of a checkpoint on Parquet data.
    Eval(serve::ServeArgs),
    /// Write a checkpoint's predictions for Parquet data to a Parquet file.
    Predict(serve::PredictArgs),
    /// Place the tables on devices and write the sharding plan (JSON).
    Plan(sharding::PlanArgs),
    /// The PJRT plugin's platform and devices.
    Devices(devices::DevicesArgs),
}

// Parsed once per process: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Bench {
    /// Train a DLRM on synthetic data; flags follow dlrm_s_pytorch.py.
    Dlrm(bench_dlrm::DlrmArgs),
    /// The embedding kernels alone, like FBGEMM's TBE benchmark.
    Embedding(bench_embedding::EmbeddingArgs),
    /// Decoded-batch throughput of the Parquet loader.
    Loader(bench_loader::LoaderBenchArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(Bench::Dlrm(args)) => print(&bench_dlrm::run(&args)?, args.json),
        Command::Bench(Bench::Embedding(args)) => print(&bench_embedding::run(&args)?, args.json),
        Command::Bench(Bench::Loader(args)) => print(&bench_loader::run(&args)?, args.json),
        Command::Ingest(IngestCommand::Criteo(args)) => {
            print(&IngestReport(ingest::criteo(&args)?), args.json)
        }
        Command::Ingest(IngestCommand::Synthetic(args)) => {
            print(&ingest::synthetic(&args)?, args.json)
        }
        Command::Train(args) => print(&train::run(&args)?, args.json),
        Command::Eval(args) => print(&serve::eval(&args)?, args.json),
        Command::Predict(args) => print(&serve::predict(&args)?, args.serve.json),
        Command::Plan(args) => print(&sharding::run_plan(&args)?, args.json),
        Command::Devices(args) => print(&devices::run(&args)?, args.json),
    }
}

fn print<R: serde::Serialize + std::fmt::Display>(report: &R, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}
