//! The `ember` command line: flags, parsed by clap, over the library.

use clap::{Parser, Subcommand};

use ember::cli::ingest::{self, IngestCommand, IngestReport};
use ember::cli::world::Launch;
use ember::cli::{
    bench_dlrm, bench_embedding, bench_hstu, bench_loader, bench_stream, checkpoint, devices, docs,
    eval, ingest_sequences, plan, plot, plot_latency, quantize, serve, train, train_sequence,
};

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
    /// Train a DLRM on Parquet data, or a sequence model (`--model`) on user histories.
    Train(Box<train::TrainArgs>),
    /// AUC, log loss and accuracy of a checkpoint on Parquet data.
    Eval(eval::EvalArgs),
    /// Write a checkpoint's predictions for Parquet data to a Parquet file.
    Predict(eval::PredictArgs),
    Serve(serve::ServeArgs),
    /// Draw training runs' loss, AUC and NE against the step (PNG) from
    /// their JSON-lines logs (`ember train --json`), overlaid.
    Plot(plot::PlotArgs),
    /// Draw latency percentiles against offered load (PNG) from load tests' JSON.
    PlotLatency(plot_latency::PlotLatencyArgs),
    /// Convert a checkpoint's tables to another data type (int8, int4, fp8,
    /// mxfp4 for inference; fp16, bf16, fp32).
    Quantize(quantize::QuantizeArgs),
    /// Work on a run's checkpoints (compact a chain of deltas, inspect one).
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// Place the tables on devices and write the sharding plan (JSON).
    Plan(plan::PlanArgs),
    /// The PJRT plugin's platform and devices.
    Devices(devices::DevicesArgs),
    /// Write (or --check) the docs book's generated pages.
    #[command(hide = true)]
    Docs(docs::DocsArgs),
}

// Parsed once per process: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Bench {
    /// Train a DLRM on synthetic data; flags follow dlrm_s_pytorch.py.
    Dlrm(Box<bench_dlrm::DlrmArgs>),
    /// The embedding kernels alone, like FBGEMM's TBE benchmark.
    Embedding(bench_embedding::EmbeddingArgs),
    /// Decoded-batch throughput of the Parquet loader.
    Loader(bench_loader::LoaderBenchArgs),
    /// HSTU training steps on synthetic user histories (jagged, and
    /// against padded with --padded).
    Hstu(bench_hstu::HstuArgs),
    /// A DLRM trained on a stream of windows of drifting raw-id data, each
    /// window evaluated before it is trained on.
    Stream(bench_stream::StreamArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let launch = match Launch::from_env() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("Error: {e:?}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match run(cli, &launch) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            match launch.ranks() {
                Some(r) => eprintln!("Error (rank {} of {}): {e:?}", r.rank, r.size),
                None => eprintln!("Error: {e:?}"),
            }
            launch.abort_others();
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, launch: &Launch) -> anyhow::Result<()> {
    match cli.command {
        Command::Bench(Bench::Dlrm(args)) => {
            print(&bench_dlrm::run(&args, launch)?, args.json, launch)
        }
        Command::Train(args) => match args.sequence.model {
            Some(kind) => {
                launch.single_process_only("train --model")?;
                print(&train_sequence::run(&args, kind)?, args.json, launch)
            }
            None => print(&train::run(&args, launch)?, args.json, launch),
        },
        command => {
            launch.single_process_only(command.name())?;
            match command {
                Command::Bench(Bench::Embedding(args)) => {
                    print(&bench_embedding::run(&args)?, args.json, launch)
                }
                Command::Bench(Bench::Loader(args)) => {
                    print(&bench_loader::run(&args)?, args.json, launch)
                }
                Command::Bench(Bench::Hstu(args)) => {
                    print(&bench_hstu::run(&args)?, args.json, launch)
                }
                Command::Bench(Bench::Stream(args)) => {
                    print(&bench_stream::run(&args)?, args.json, launch)
                }
                Command::Ingest(IngestCommand::Criteo(args)) => {
                    print(&IngestReport(ingest::criteo(&args)?), args.json, launch)
                }
                Command::Ingest(IngestCommand::Synthetic(args)) => {
                    print(&ingest::synthetic(&args)?, args.json, launch)
                }
                Command::Ingest(IngestCommand::Sequences(args)) => {
                    print(&ingest_sequences::sequences(&args)?, args.json, launch)
                }
                Command::Ingest(IngestCommand::SyntheticHistories(args)) => print(
                    &ingest_sequences::synthetic_histories(&args)?,
                    args.json,
                    launch,
                ),
                Command::Eval(args) => print(&eval::eval(&args)?, args.json, launch),
                Command::Predict(args) => print(&eval::predict(&args)?, args.eval.json, launch),
                Command::Serve(args) => print(&serve::run(&args)?, args.json, launch),
                Command::Plot(args) => print(&plot::run(&args)?, args.json, launch),
                Command::PlotLatency(args) => print(&plot_latency::run(&args)?, args.json, launch),
                Command::Quantize(args) => print(&quantize::run(&args)?, args.json, launch),
                Command::Checkpoint(checkpoint::CheckpointCommand::Compact(args)) => {
                    print(&checkpoint::run_compact(&args)?, args.json, launch)
                }
                Command::Checkpoint(checkpoint::CheckpointCommand::Inspect(args)) => {
                    print(&checkpoint::run_inspect(&args)?, args.json, launch)
                }
                Command::Plan(args) => print(&plan::run_plan(&args)?, args.json, launch),
                Command::Devices(args) => print(&devices::run(&args)?, args.json, launch),
                Command::Docs(args) => {
                    let pages = docs::run(&args, <Cli as clap::CommandFactory>::command())?;
                    for page in pages {
                        let verb = if args.check { "up to date" } else { "written" };
                        println!("{}: {verb}", page.display());
                    }
                    Ok(())
                }
                Command::Bench(Bench::Dlrm(_)) | Command::Train(_) => unreachable!("matched above"),
            }
        }
    }
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Bench(Bench::Dlrm(_)) => "bench dlrm",
            Command::Bench(Bench::Embedding(_)) => "bench embedding",
            Command::Bench(Bench::Loader(_)) => "bench loader",
            Command::Bench(Bench::Hstu(_)) => "bench hstu",
            Command::Bench(Bench::Stream(_)) => "bench stream",
            Command::Ingest(_) => "ingest",
            Command::Train(_) => "train",
            Command::Eval(_) => "eval",
            Command::Predict(_) => "predict",
            Command::Serve(_) => "serve",
            Command::Plot(_) => "plot",
            Command::PlotLatency(_) => "plot-latency",
            Command::Quantize(_) => "quantize",
            Command::Checkpoint(_) => "checkpoint",
            Command::Plan(_) => "plan",
            Command::Devices(_) => "devices",
            Command::Docs(_) => "docs",
        }
    }
}

/// A report: JSON with `--json`, text otherwise; printed by rank 0 only (or
/// the only process).
fn print<R: serde::Serialize + std::fmt::Display>(
    report: &R,
    json: bool,
    launch: &Launch,
) -> anyhow::Result<()> {
    if !launch.is_root() {
        return Ok(());
    }
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        println!("{report}");
    }
    Ok(())
}
