//! `ember serve`: a checkpoint's model over the Open Inference Protocol
//! (KServe v2, HTTP/REST with JSON and binary tensors), so that Triton's
//! clients ask it for scores; until SIGTERM or Ctrl-C, which let the
//! requests in flight finish.

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use ember_serving::{serve, Limits, ServeOptions, ServedModel};

/// Serve a checkpoint's model over the Open Inference Protocol (KServe v2,
/// HTTP), as Triton's clients speak it, until SIGTERM or Ctrl-C.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// A checkpoint (a file, a set's index, or a run's --checkpoint-dir).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// The model's name in the protocol's paths (`/v2/models/<name>`).
    #[arg(long, default_value = "dlrm")]
    pub model_name: String,
    /// The address to listen on: loopback unless another is given.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// The HTTP port (Triton's flag and default; 0: any free port).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,
    /// Samples a request may hold.
    #[arg(long, default_value_t = 4096)]
    pub max_batch_size: usize,
    /// Ids of one feature a request may hold [default: 64 a sample].
    #[arg(long)]
    pub max_ids_per_feature: Option<usize>,
    /// The largest request body, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_request_bytes: usize,
    /// Threads of the inference (tokio's blocking pool) and of the
    /// lookups [default: every core].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the report at the stop as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `serve` reports once stopped.
#[derive(Debug, Serialize)]
pub struct ServeReport {
    pub event: &'static str,
    pub model: String,
    pub address: String,
}

impl std::fmt::Display for ServeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stopped serving '{}' on {}", self.model, self.address)
    }
}

/// SIGTERM or Ctrl-C.
async fn stop_signal() {
    let interrupt = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = interrupt => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = interrupt.await;
        }
    }
}

pub fn run(args: &ServeArgs) -> anyhow::Result<ServeReport> {
    let limits = Limits {
        max_batch_size: args.max_batch_size,
        max_ids_per_feature: (args.max_ids_per_feature)
            .unwrap_or(args.max_batch_size.saturating_mul(64)),
    };
    anyhow::ensure!(
        args.max_request_bytes > 0,
        "--max-request-bytes must be at least 1"
    );
    super::with_threads(args.threads, || {
        let model = ServedModel::open(&args.checkpoint, &args.model_name, limits)
            .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("the async runtime")?;
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind((args.host, args.http_port))
                .await
                .with_context(|| format!("--host {} --http-port {}", args.host, args.http_port))?;
            let address = listener.local_addr()?.to_string();
            // Tests and scripts read the port from this line.
            eprintln!("serving model '{}' on http://{address}/v2", args.model_name);
            let options = ServeOptions {
                max_request_bytes: args.max_request_bytes,
            };
            serve(listener, model, options, stop_signal()).await?;
            Ok(ServeReport {
                event: "summary",
                model: args.model_name.clone(),
                address,
            })
        })
    })?
}
