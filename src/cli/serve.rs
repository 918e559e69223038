//! `ember serve`: a checkpoint's model (DLRM, DCNv2, SASRec or HSTU) over
//! the Open Inference Protocol (KServe v2, HTTP/REST with JSON and binary
//! tensors, and gRPC), so that Triton's clients ask it for scores;
//! requests batched dynamically, the checkpoint reloaded as it changes,
//! metrics for Prometheus; until SIGTERM or Ctrl-C, which let the
//! requests in flight finish.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use ember_serving::reload::identity;
use ember_serving::{
    serve, BatchOptions, Limits, ModelOptions, ReloadOptions, ServeOptions, ServedModel,
};

/// Serve a checkpoint's model over the Open Inference Protocol (KServe v2,
/// HTTP and gRPC), as Triton's clients speak it, until SIGTERM or Ctrl-C.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// A checkpoint (a file, a set's index, or a run's --checkpoint-dir,
    /// whose newest checkpoint serves).
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
    /// The gRPC port (Triton's flag and default; 0: any free port).
    #[arg(long, default_value_t = 8001)]
    pub grpc_port: u16,
    /// Serve gRPC too (Triton's flag).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub allow_grpc: bool,
    /// Samples a request, and a batch of requests, may hold.
    #[arg(long, default_value_t = 4096)]
    pub max_batch_size: usize,
    /// How long the oldest queued request waits for others to join its
    /// batch, in microseconds (Triton's max_queue_delay_microseconds; 0:
    /// a batch is what queued while the one before ran).
    #[arg(long, default_value_t = 0)]
    pub max_queue_delay_us: u64,
    /// Inference requests held at once (being read, queued or computed);
    /// one more gets 503.
    #[arg(long, default_value_t = 1024)]
    pub max_queue_size: usize,
    /// A request's deadline, in microseconds, when it gives none (Triton's
    /// `timeout` parameter): one still queued then gets 503 [default: none].
    #[arg(long)]
    pub default_timeout_us: Option<u64>,
    /// Ids of one feature a request may hold [default: 64 a sample].
    #[arg(long)]
    pub max_ids_per_feature: Option<usize>,
    /// The largest request body, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_request_bytes: usize,
    /// Look for a new checkpoint every this many seconds, and serve it once
    /// it loads and passes its checks (Triton's flag; 0: never).
    #[arg(long, default_value_t = 0)]
    pub repository_poll_secs: u64,
    /// Answer with a model that computes nothing (every logit 0), to
    /// measure the server's own cost.
    #[arg(long)]
    pub empty_model: bool,
    /// Tables on the disk tier: a checkpoint larger than memory is served
    /// from files, streamed in a piece at a time.
    #[command(flatten)]
    pub tier: super::tier::TierArgs,
    /// Threads of the model's lookups and layers, shared out among its
    /// instances [default: every core].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Copies of the model that run batches side by side, each on its
    /// share of --threads (Triton's instance_group count). Each holds its
    /// own tables; the disk tier serves one.
    #[arg(long, default_value_t = 1)]
    pub instances: usize,
    /// Items a retrieval model (SASRec, HSTU retrieval) answers each
    /// history with, best first (as `predict --top-k`).
    #[arg(long, default_value_t = 10)]
    pub top_k: usize,
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
    anyhow::ensure!(
        args.max_queue_size > 0,
        "--max-queue-size must be at least 1"
    );
    let model_options = ModelOptions {
        limits,
        disk_tier: args.tier.options()?,
        instances: args.instances,
        top_k: args.top_k,
    };
    let poll = Duration::from_secs(args.repository_poll_secs);
    let (reload, model) = super::with_threads(args.threads, || -> anyhow::Result<_> {
        let at = |e| {
            anyhow::Error::new(e).context(format!("--checkpoint {}", args.checkpoint.display()))
        };
        // Read before the model: a checkpoint written meanwhile is reloaded.
        let serving = identity(&args.checkpoint).map_err(at)?;
        let mut first = ember_serving::reload::for_version(&model_options, 1);
        if args.empty_model {
            first.instances = 1; // its inputs are all the empty model needs
        }
        let model = ServedModel::open(&args.checkpoint, &args.model_name, &first).map_err(at)?;
        let model = match args.empty_model {
            true => ServedModel::empty(model.inputs, args.instances),
            false => model,
        };
        let reload = (!poll.is_zero() && !args.empty_model).then(|| ReloadOptions {
            checkpoint: args.checkpoint.clone(),
            poll,
            model: model_options.clone(),
            serving,
        });
        Ok((reload, model))
    })??;
    let options = ServeOptions {
        max_request_bytes: args.max_request_bytes,
        batching: BatchOptions {
            max_queue_delay: Duration::from_micros(args.max_queue_delay_us),
            max_queue_size: args.max_queue_size,
            default_timeout: args.default_timeout_us.map(Duration::from_micros),
            threads: args.threads,
        },
        reload,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host, args.http_port))
            .await
            .with_context(|| format!("--host {} --http-port {}", args.host, args.http_port))?;
        let address = listener.local_addr()?.to_string();
        let grpc = match args.allow_grpc {
            false => None,
            true => Some(
                tokio::net::TcpListener::bind((args.host, args.grpc_port))
                    .await
                    .with_context(|| {
                        format!("--host {} --grpc-port {}", args.host, args.grpc_port)
                    })?,
            ),
        };
        let grpc_address = match &grpc {
            Some(grpc) => format!(" and grpc://{}", grpc.local_addr()?),
            None => String::new(),
        };
        // Tests and scripts read the ports from this line.
        eprintln!(
            "serving model '{}' on http://{address}/v2{grpc_address}",
            args.model_name
        );
        serve(listener, grpc, model, options, stop_signal()).await?;
        Ok(ServeReport {
            event: "summary",
            model: args.model_name.clone(),
            address,
        })
    })
}
