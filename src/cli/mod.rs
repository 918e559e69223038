//! The `ember` subcommands. Each `run` takes parsed arguments and returns a
//! serialisable report; `main` prints it as text or, with `--json`, as one
//! JSON object.

pub mod arch;
pub mod backend;
pub mod bench_dlrm;
pub mod bench_embedding;
pub mod bench_hstu;
pub mod bench_loader;
pub mod bench_stream;
pub mod checkpoint;
pub mod data;
pub mod devices;
pub mod docs;
mod docs_serving;
mod docs_stream;
mod docs_training;
pub mod eval;
pub mod ids;
pub mod ingest;
pub mod ingest_sequences;
pub mod kv;
mod load_test;
pub mod optimization;
pub mod picture;
pub mod place;
pub mod plan;
mod plan_plot;
pub mod plot;
pub mod plot_latency;
mod predict_sequence;
mod progress;
pub mod quantize;
pub mod run_info;
pub mod run_logs;
pub mod serve;
pub mod tier;
pub mod train;
pub mod train_sequence;
pub mod train_stream;
pub mod world;

pub use progress::{peak_rss_bytes, Progress};

/// Runs `f` inside a rayon pool of `threads` threads (all cores when `None`).
/// More compute threads than any machine's cores only cost memory.
pub const MAX_THREADS: usize = 1024;

pub fn with_threads<R: Send>(
    threads: Option<usize>,
    f: impl FnOnce() -> R + Send,
) -> anyhow::Result<R> {
    let threads = threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    anyhow::ensure!(threads >= 1, "--threads must be at least 1");
    anyhow::ensure!(
        threads <= MAX_THREADS,
        "--threads {threads}: at most {MAX_THREADS} (each is an OS thread with its own stack)"
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    Ok(pool.install(f))
}

/// Parses a table data type flag (`fp32`, `fp16`, `bf16`, `int8`, `int4`,
/// `fp8`, `mxfp4`).
pub fn parse_data_type(text: &str) -> Result<ember_sparse::DataType, String> {
    text.parse()
}

/// Parses dash-separated sizes as dlrm_s_pytorch does ("13-512-256").
pub fn parse_sizes(flag: &str, text: &str) -> anyhow::Result<Vec<usize>> {
    text.split('-')
        .map(|s| {
            s.trim().parse::<usize>().map_err(|_| {
                anyhow::anyhow!(
                    "{flag}: '{s}' in '{text}' is not a size (expected e.g. 13-512-256)"
                )
            })
        })
        .collect()
}
