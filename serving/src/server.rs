//! The server's core, shared by its two front ends (HTTP/REST in
//! [`http`](crate::http), gRPC in [`grpc`](crate::grpc)): the model's
//! inputs, the [`Batcher`] whose thread runs the model, the metrics and the
//! checkpoint watcher. A request is admitted (or shed), read and decoded on
//! tokio's blocking threads, queued, scored, and counted once.

use std::future::Future;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use crate::batcher::{BatchOptions, Batcher, Scored};
use crate::inputs::{Inputs, Samples};
use crate::metrics::{Failure, Metrics};
use crate::model::ServedModel;
use crate::outputs::{Column, OutputSpec};
use crate::protocol::{flag, InferRequest, ServerMetadata};
use crate::reload::{watch, ReloadOptions};
use crate::ServeError;

/// How the server takes requests.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The largest request body (HTTP: larger is 413) or message (gRPC),
    /// in bytes.
    pub max_request_bytes: usize,
    /// How requests are batched and how many are held.
    pub batching: BatchOptions,
    /// Where new checkpoints appear (`None`: no hot reload).
    pub reload: Option<ReloadOptions>,
}

impl Default for ServeOptions {
    /// 64 MiB requests, the default batching, no reload.
    fn default() -> Self {
        Self {
            max_request_bytes: 64 << 20,
            batching: BatchOptions::default(),
            reload: None,
        }
    }
}

/// A running model: what the HTTP and gRPC front ends share. Its batching
/// thread (and checkpoint watcher) stop once it and every front end made
/// from it are dropped.
#[derive(Clone)]
pub struct Server(pub(crate) Arc<Shared>);

/// What the front ends' handlers share.
pub(crate) struct Shared {
    pub(crate) inputs: Arc<Inputs>,
    pub(crate) batcher: Arc<Batcher>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) max_request_bytes: usize,
    /// Dropped with the server: the checkpoint watcher then stops.
    _stop_watching: Option<mpsc::Sender<()>>,
}

/// What a request asks for besides its inputs.
pub(crate) struct Asked {
    pub(crate) id: Option<String>,
    /// Each output asked for (an index into [`Inputs::outputs`]), and whether as
    /// binary data (HTTP's binary tensor data extension).
    pub(crate) outputs: Vec<(usize, bool)>,
    pub(crate) timeout: Option<Duration>,
}

impl Server {
    /// Starts `model`'s batching thread (and, with `options.reload`, its
    /// checkpoint watcher).
    pub fn start(model: ServedModel, options: &ServeOptions) -> Result<Self, ServeError> {
        let inputs = Arc::new(model.inputs);
        let metrics = Arc::new(Metrics::new(inputs.name()));
        let batcher = Batcher::start(
            model.instances,
            Arc::clone(&inputs),
            options.batching,
            Arc::clone(&metrics),
        )?;
        let batcher = Arc::new(batcher);
        let stop_watching = match &options.reload {
            None => None,
            Some(reload) => {
                let (stop, stopped) = mpsc::channel();
                let (reload, inputs, batcher) =
                    (reload.clone(), Arc::clone(&inputs), Arc::clone(&batcher));
                std::thread::Builder::new()
                    .name("ember-reload".into())
                    .spawn(move || watch(reload, inputs, batcher, stopped))?;
                Some(stop)
            }
        };
        Ok(Self(Arc::new(Shared {
            inputs,
            batcher,
            metrics,
            max_request_bytes: options.max_request_bytes,
            _stop_watching: stop_watching,
        })))
    }
}

impl Shared {
    /// Checks the model named `name` at `version` (`None`: the one
    /// serving) is served here, or says why not (404); the version serving.
    pub(crate) fn find(&self, name: &str, version: Option<&str>) -> Result<u64, ServeError> {
        let serving = self.batcher.version();
        if name != self.inputs.name() {
            return Err(ServeError::NotFound(format!(
                "model '{name}' is not served here (this server serves '{}')",
                self.inputs.name()
            )));
        }
        match version {
            Some(v) if v != serving.to_string() => Err(ServeError::NotFound(format!(
                "model '{name}' has no version '{v}' (it serves version {serving})"
            ))),
            _ => Ok(serving),
        }
    }

    /// One inference request, answered and counted: admitted (or shed),
    /// `read` off the async threads (a panic there fails this request
    /// only), queued and scored.
    pub(crate) async fn infer(
        &self,
        name: &str,
        version: Option<&str>,
        read: impl FnOnce(&Inputs) -> Result<(Samples, Asked), ServeError> + Send + 'static,
    ) -> Result<(Asked, Scored), ServeError> {
        let arrived = Instant::now();
        let answer = self.run(name, version, read, arrived).await;
        let m = &self.metrics;
        match &answer {
            Ok(_) => {
                let took = arrived.elapsed();
                m.success.inc();
                m.request_us.inc_by(took.as_micros() as u64);
                m.request_seconds.observe(took.as_secs_f64());
            }
            Err(ServeError::BadRequest(_) | ServeError::NotFound(_)) => {
                m.failed(Failure::BadRequest)
            }
            // Counted where they were shed, timed out or cancelled.
            Err(ServeError::Unavailable(_)) => {}
            Err(_) => m.failed(Failure::Backend),
        }
        answer
    }

    async fn run(
        &self,
        name: &str,
        version: Option<&str>,
        read: impl FnOnce(&Inputs) -> Result<(Samples, Asked), ServeError> + Send + 'static,
        arrived: Instant,
    ) -> Result<(Asked, Scored), ServeError> {
        self.find(name, version)?;
        let _held = self.batcher.admit()?;
        let inputs = Arc::clone(&self.inputs);
        let (samples, asked) = match tokio::task::spawn_blocking(move || read(&inputs)).await {
            Ok(read) => read?,
            Err(_) => {
                return Err(ServeError::Internal(
                    "reading the request panicked; the server goes on".into(),
                ))
            }
        };
        let scored = self.batcher.submit(samples, arrived, asked.timeout).await;
        let scored =
            scored.map_err(|_| ServeError::Internal("the batching thread stopped".into()))??;
        Ok((asked, scored))
    }
}

/// What `request` asks for besides its inputs: its id, the outputs (each
/// once, none of the extensions Ember does not serve) and Triton's
/// `timeout` parameter (microseconds).
pub(crate) fn asked(inputs: &Inputs, request: &InferRequest) -> Result<Asked, ServeError> {
    let bad = |m: String| ServeError::BadRequest(m);
    let all_binary = flag(&request.parameters, "binary_data_output").unwrap_or(false);
    let names: Vec<&str> = inputs.outputs().iter().map(|o| o.name).collect();
    let outputs: Vec<(usize, bool)> = match &request.outputs {
        None => (0..names.len()).map(|o| (o, all_binary)).collect(),
        Some(outputs) => outputs
            .iter()
            .map(|o| {
                let at = names.iter().position(|n| *n == o.name).ok_or_else(|| {
                    bad(format!(
                        "output '{}' is not an output of model '{}' (its outputs: {})",
                        o.name,
                        inputs.name(),
                        names.join(", ")
                    ))
                })?;
                if (o.parameters.as_ref()).is_some_and(|p| p.contains_key("classification")) {
                    return Err(bad(format!(
                        "output '{}': the classification extension is not served here",
                        o.name
                    )));
                }
                Ok((at, flag(&o.parameters, "binary_data").unwrap_or(all_binary)))
            })
            .collect::<Result<_, ServeError>>()?,
    };
    for (i, (at, _)) in outputs.iter().enumerate() {
        if outputs[..i].iter().any(|(other, _)| other == at) {
            return Err(bad(format!("output '{}' is asked for twice", names[*at])));
        }
    }
    let timeout = match request.parameters.as_ref().and_then(|p| p.get("timeout")) {
        None => None,
        Some(v) => Some(Duration::from_micros(v.as_u64().ok_or_else(|| {
            bad(format!("parameter timeout {v}: expected microseconds"))
        })?)),
    };
    Ok(Asked {
        id: request.id.clone(),
        outputs,
        timeout,
    })
}

/// The server's metadata, for both front ends.
pub(crate) fn server_metadata() -> ServerMetadata {
    ServerMetadata {
        name: "ember".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        extensions: vec!["binary_tensor_data".into()],
    }
}

/// The outputs `asked` for, from a request's columns: each one's spec and
/// values.
pub(crate) fn asked_columns<'a>(
    inputs: &'a Inputs,
    asked: &'a Asked,
    columns: &'a [Column],
) -> impl Iterator<Item = (&'a OutputSpec, &'a Column, bool)> {
    (asked.outputs.iter()).map(|&(at, binary)| (&inputs.outputs()[at], &columns[at], binary))
}

/// How many samples a column of `output` holds.
pub(crate) fn samples_of(output: &OutputSpec, column: &Column) -> usize {
    column.len() / output.width().max(1)
}

/// Serves `model` over HTTP on `http` and, given a listener, over gRPC on
/// `grpc`, until `shutdown` completes; then both stop taking connections,
/// let the requests in flight finish, and the batching thread stops.
pub async fn serve(
    http: TcpListener,
    grpc: Option<TcpListener>,
    model: ServedModel,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let server = Server::start(model, &options)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let until_stopped = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    let http = axum::serve(http_incoming(http), server.http())
        .with_graceful_shutdown(until_stopped(stopped.clone()));
    let http = async { http.await.map_err(ServeError::Io) };
    let Some(grpc) = grpc else {
        return http.await;
    };
    let grpc = tonic::transport::Server::builder()
        .add_service(server.grpc())
        .serve_with_incoming_shutdown(grpc_incoming(grpc), until_stopped(stopped));
    let grpc = async {
        grpc.await
            .map_err(|e| ServeError::Io(std::io::Error::other(e)))
    };
    tokio::try_join!(http, grpc).map(|_| ())
}

// No Nagle on either front end: a response's last small write must not
// wait for the client's delayed ACK (40 ms on Linux: it was the p99 of an
// empty model at low load). Triton's sockets set TCP_NODELAY too.

/// HTTP's connections, accepted with TCP_NODELAY.
fn http_incoming(
    listener: TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    })
}

/// gRPC's connections, accepted with TCP_NODELAY.
fn grpc_incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;
    use tonic::codegen::tokio_stream::StreamExt;

    async fn loopback() -> (TcpListener, std::net::SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        (listener, address)
    }

    #[tokio::test]
    async fn both_front_ends_accept_connections_without_nagle() {
        let (listener, address) = loopback().await;
        let mut http = http_incoming(listener);
        let _client = tokio::net::TcpStream::connect(address).await.unwrap();
        let (accepted, _) = http.accept().await;
        assert!(accepted.nodelay().unwrap(), "HTTP");

        let (listener, address) = loopback().await;
        let mut grpc = grpc_incoming(listener);
        let _client = tokio::net::TcpStream::connect(address).await.unwrap();
        let accepted = grpc.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap(), "gRPC");
    }
}
