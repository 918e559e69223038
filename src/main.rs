use clap::{Parser, Subcommand};

use ember::cli::{bench_dlrm, bench_embedding};

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
}

#[derive(Subcommand)]
enum Bench {
    /// Train a DLRM on synthetic data; flags follow dlrm_s_pytorch.py.
    Dlrm(bench_dlrm::DlrmArgs),
    /// The embedding kernels alone, like FBGEMM's TBE benchmark.
    Embedding(bench_embedding::EmbeddingArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(Bench::Dlrm(args)) => print(&bench_dlrm::run(&args)?, args.json),
        Command::Bench(Bench::Embedding(args)) => print(&bench_embedding::run(&args)?, args.json),
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
