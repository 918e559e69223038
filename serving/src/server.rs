//! The HTTP server: KServe v2's health, metadata and inference endpoints
//! and Prometheus's `/metrics`, on tokio and axum. A request is read and
//! decoded on tokio's blocking threads, then queued for the
//! [`Batcher`], whose thread runs the model; a
//! checkpoint watcher swaps new models in. Every error is the protocol's
//! JSON error object.

use std::future::Future;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::net::TcpListener;

use crate::batcher::{BatchOptions, Batcher};
use crate::inputs::{Inputs, Samples, OUTPUTS};
use crate::metrics::{Failure, Metrics, CONTENT_TYPE};
use crate::model::ServedModel;
use crate::protocol::{
    encode_response, flag, parse_request, ErrorBody, InferResponse, ResponseOutput, ServerMetadata,
    HEADER_LENGTH,
};
use crate::reload::{watch, ReloadOptions};
use crate::ServeError;

/// How the server takes requests.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The largest request body, in bytes (larger: 413).
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

/// What the handlers share.
struct Shared {
    inputs: Arc<Inputs>,
    batcher: Arc<Batcher>,
    metrics: Arc<Metrics>,
    /// Dropped with the router: the checkpoint watcher then stops.
    _stop_watching: Option<mpsc::Sender<()>>,
}

type Served = Arc<Shared>;

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let status = match &self {
            ServeError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ServeError::NotFound(_) => StatusCode::NOT_FOUND,
            ServeError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        error_response(status, self.to_string())
    }
}

fn error_response(status: StatusCode, error: String) -> Response {
    (status, Json(ErrorBody { error })).into_response()
}

/// The routes of KServe v2 and `/metrics` over `model`, its batching
/// thread started (and its checkpoint watched, with `options.reload`).
/// The thread stops once the router and its clones are dropped.
pub fn router(model: ServedModel, options: &ServeOptions) -> Result<Router, ServeError> {
    let inputs = Arc::new(model.inputs);
    let metrics = Arc::new(Metrics::new(inputs.name()));
    let batcher = Batcher::start(
        model.scorer,
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
    let shared = Arc::new(Shared {
        inputs,
        batcher,
        metrics,
        _stop_watching: stop_watching,
    });
    Ok(Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route("/v2/models/{name}", get(model_metadata))
        .route(
            "/v2/models/{name}/versions/{version}",
            get(model_version_metadata),
        )
        .route("/v2/models/{name}/ready", get(model_ready))
        .route(
            "/v2/models/{name}/versions/{version}/ready",
            get(model_version_ready),
        )
        .route("/v2/models/{name}/infer", post(infer))
        .route(
            "/v2/models/{name}/versions/{version}/infer",
            post(infer_version),
        )
        .route("/metrics", get(metrics_text))
        .fallback(|| async {
            ServeError::NotFound("no such endpoint (KServe v2's are under /v2)".into())
        })
        .layer(axum::middleware::map_response(json_errors))
        .layer(DefaultBodyLimit::max(options.max_request_bytes))
        .with_state(shared))
}

/// Serves `model` on `listener` until `shutdown` completes; then stops
/// taking connections, lets the requests in flight finish and stops the
/// batching thread.
pub async fn serve(
    listener: TcpListener,
    model: ServedModel,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let router = router(model, &options)?;
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(ServeError::Io)
}

/// Errors axum answers itself (a body over the limit, a wrong method) as
/// the protocol's JSON error object, as every other error is.
async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = (response.headers().get(header::CONTENT_TYPE))
        .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), 64 << 10)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let error = match text.is_empty() {
        true => status.canonical_reason().unwrap_or("error").to_string(),
        false => text,
    };
    error_response(status, error)
}

async fn server_metadata() -> Json<ServerMetadata> {
    Json(ServerMetadata {
        name: "ember".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        extensions: vec!["binary_tensor_data".into()],
    })
}

async fn metrics_text(State(s): State<Served>) -> Response {
    let headers = [(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE))];
    (headers, s.metrics.render()).into_response()
}

/// Checks the model named `name` at `version` (`None`: the one serving)
/// is served here, or says why not (404).
fn find(s: &Shared, name: &str, version: Option<&str>) -> Result<u64, ServeError> {
    let serving = s.batcher.version();
    if name != s.inputs.name() {
        return Err(ServeError::NotFound(format!(
            "model '{name}' is not served here (this server serves '{}')",
            s.inputs.name()
        )));
    }
    match version {
        Some(v) if v != serving.to_string() => Err(ServeError::NotFound(format!(
            "model '{name}' has no version '{v}' (it serves version {serving})"
        ))),
        _ => Ok(serving),
    }
}

async fn model_metadata(State(s): State<Served>, Path(name): Path<String>) -> Response {
    metadata(&s, &name, None)
}

async fn model_version_metadata(
    State(s): State<Served>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    metadata(&s, &name, Some(&version))
}

fn metadata(s: &Shared, name: &str, version: Option<&str>) -> Response {
    match find(s, name, version) {
        Ok(serving) => {
            let mut metadata = s.inputs.metadata().clone();
            metadata.versions = vec![serving.to_string()];
            Json(metadata).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn model_ready(State(s): State<Served>, Path(name): Path<String>) -> Response {
    find(&s, &name, None)
        .map(|_| StatusCode::OK)
        .into_response()
}

async fn model_version_ready(
    State(s): State<Served>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    find(&s, &name, Some(&version))
        .map(|_| StatusCode::OK)
        .into_response()
}

async fn infer(
    State(s): State<Served>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    infer_at(s, name, None, headers, body).await
}

async fn infer_version(
    State(s): State<Served>,
    Path((name, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    infer_at(s, name, Some(version), headers, body).await
}

/// One inference request, answered and counted.
async fn infer_at(
    s: Served,
    name: String,
    version: Option<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let arrived = Instant::now();
    match answer(&s, name, version, headers, body, arrived).await {
        Ok(response) => {
            let took = arrived.elapsed();
            s.metrics.success.inc();
            s.metrics.request_us.inc_by(took.as_micros() as u64);
            s.metrics.request_seconds.observe(took.as_secs_f64());
            response
        }
        Err(e) => {
            match &e {
                ServeError::BadRequest(_) | ServeError::NotFound(_) => {
                    s.metrics.failed(Failure::BadRequest)
                }
                // Counted where they were shed, timed out or cancelled.
                ServeError::Unavailable(_) => {}
                _ => s.metrics.failed(Failure::Backend),
            }
            e.into_response()
        }
    }
}

/// What a request asks for besides its inputs.
struct Asked {
    id: Option<String>,
    /// Each output asked for, and whether as binary data.
    outputs: Vec<(usize, bool)>,
    timeout: Option<Duration>,
}

async fn answer(
    s: &Served,
    name: String,
    version: Option<String>,
    headers: HeaderMap,
    body: Bytes,
    arrived: Instant,
) -> Result<Response, ServeError> {
    find(s, &name, version.as_deref())?;
    let _held = s.batcher.admit()?;
    if let Some(coding) = headers.get(header::CONTENT_ENCODING) {
        if coding.as_bytes() != b"identity" {
            return Err(ServeError::BadRequest(format!(
                "Content-Encoding {coding:?}: this server takes uncompressed bodies"
            )));
        }
    }
    let header_length = match headers.get(HEADER_LENGTH) {
        None => None,
        Some(v) => match v.to_str().ok().and_then(|t| t.trim().parse::<usize>().ok()) {
            Some(n) => Some(n),
            None => {
                return Err(ServeError::BadRequest(format!(
                    "Inference-Header-Content-Length {v:?} is not a byte count"
                )))
            }
        },
    };
    // Parsing and decoding run off the async threads; a panic in them
    // fails this request only.
    let inputs = Arc::clone(&s.inputs);
    let decoded = tokio::task::spawn_blocking(move || read(&inputs, &body, header_length)).await;
    let (samples, asked) = match decoded {
        Ok(decoded) => decoded?,
        Err(_) => {
            return Err(ServeError::Internal(
                "reading the request panicked; the server goes on".into(),
            ))
        }
    };
    let scored = s.batcher.submit(samples, arrived, asked.timeout).await;
    let scored =
        scored.map_err(|_| ServeError::Internal("the batching thread stopped".into()))??;
    Ok(respond(&s.inputs, asked, scored.logits, scored.version))
}

/// A request's samples and what else it asks for.
fn read(
    inputs: &Inputs,
    body: &[u8],
    header_length: Option<usize>,
) -> Result<(Samples, Asked), ServeError> {
    let parsed = parse_request(body, header_length)?;
    let request = &parsed.request;
    let bad = |m: String| ServeError::BadRequest(m);
    let all_binary = flag(&request.parameters, "binary_data_output").unwrap_or(false);
    let outputs: Vec<(usize, bool)> = match &request.outputs {
        None => (0..OUTPUTS.len()).map(|o| (o, all_binary)).collect(),
        Some(outputs) => outputs
            .iter()
            .map(|o| {
                let at = OUTPUTS.iter().position(|n| *n == o.name).ok_or_else(|| {
                    bad(format!(
                        "output '{}' is not an output of model '{}' (its outputs: {})",
                        o.name,
                        inputs.name(),
                        OUTPUTS.join(", ")
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
            return Err(bad(format!("output '{}' is asked for twice", OUTPUTS[*at])));
        }
    }
    // Triton's per-request timeout, in microseconds.
    let timeout = match request.parameters.as_ref().and_then(|p| p.get("timeout")) {
        None => None,
        Some(v) => Some(Duration::from_micros(v.as_u64().ok_or_else(|| {
            bad(format!("parameter timeout {v}: expected microseconds"))
        })?)),
    };
    let samples = inputs.decode(&parsed)?;
    let asked = Asked {
        id: request.id.clone(),
        outputs,
        timeout,
    };
    Ok((samples, asked))
}

/// The response to a request: the outputs it asked for, each as JSON or
/// binary data.
fn respond(inputs: &Inputs, asked: Asked, logits: Vec<f32>, version: u64) -> Response {
    let probabilities: Vec<f32> = (logits.iter())
        .map(|&z| ember_dataloader::writer::probability(z))
        .collect();
    let columns = [logits, probabilities];
    let mut outputs = Vec::new();
    let mut binary = Vec::new();
    for (at, as_binary) in asked.outputs {
        let values = &columns[at];
        binary.push(as_binary.then(|| values.iter().flat_map(|v| v.to_le_bytes()).collect()));
        outputs.push(ResponseOutput {
            name: OUTPUTS[at].into(),
            shape: vec![values.len() as i64],
            datatype: "FP32".into(),
            parameters: None,
            data: (!as_binary).then(|| values.clone()),
        });
    }
    let response = InferResponse {
        model_name: inputs.name().to_string(),
        model_version: Some(version.to_string()),
        id: asked.id,
        outputs,
    };
    let (body, json_length) = encode_response(response, binary);
    let mut response = (StatusCode::OK, Body::from(body)).into_response();
    let h = response.headers_mut();
    match json_length {
        Some(n) => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            h.insert(HEADER_LENGTH, HeaderValue::from(n));
        }
        None => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
    }
    response
}
