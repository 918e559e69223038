//! The HTTP server: KServe v2's health, metadata and inference endpoints
//! over one [`ServedModel`], on tokio and axum. Inference runs on tokio's
//! blocking threads, one request at a time on the model; a request that
//! panics fails alone and the server goes on.

use std::future::Future;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::net::TcpListener;

use crate::model::{ServedModel, OUTPUTS};
use crate::protocol::{
    encode_response, flag, parse_request, ErrorBody, InferResponse, ModelMetadata, ResponseOutput,
    ServerMetadata, HEADER_LENGTH,
};
use crate::ServeError;

/// How the server takes requests.
#[derive(Clone, Copy, Debug)]
pub struct ServeOptions {
    /// The largest request body, in bytes (larger: 413).
    pub max_request_bytes: usize,
}

impl Default for ServeOptions {
    /// 64 MiB requests.
    fn default() -> Self {
        Self {
            max_request_bytes: 64 << 20,
        }
    }
}

/// What the handlers share.
struct Shared {
    model: Mutex<ServedModel>,
    name: String,
    /// The model's metadata, read without waiting for an inference.
    metadata: ModelMetadata,
}

type Served = Arc<Shared>;

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let status = match &self {
            ServeError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ServeError::NotFound(_) => StatusCode::NOT_FOUND,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let body = ErrorBody {
            error: self.to_string(),
        };
        (status, Json(body)).into_response()
    }
}

/// The routes of KServe v2 over `model`.
pub fn router(model: ServedModel, options: ServeOptions) -> Router {
    let shared = Arc::new(Shared {
        name: model.name().to_string(),
        metadata: model.metadata().clone(),
        model: Mutex::new(model),
    });
    Router::new()
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
        .layer(DefaultBodyLimit::max(options.max_request_bytes))
        .with_state(shared)
}

/// Serves `model` on `listener` until `shutdown` completes; then stops
/// taking connections and lets the requests in flight finish.
pub async fn serve(
    listener: TcpListener,
    model: ServedModel,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    axum::serve(listener, router(model, options))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(ServeError::Io)
}

async fn server_metadata() -> Json<ServerMetadata> {
    Json(ServerMetadata {
        name: "ember".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        extensions: vec!["binary_tensor_data".into()],
    })
}

/// The model named `name` at `version` (`None`: any), or a 404.
fn find<'a>(
    shared: &'a Shared,
    name: &str,
    version: Option<&str>,
) -> Result<&'a Shared, ServeError> {
    if name != shared.name {
        return Err(ServeError::NotFound(format!(
            "model '{name}' is not served here (this server serves '{}')",
            shared.name
        )));
    }
    match version {
        Some(v) if v != "1" => Err(ServeError::NotFound(format!(
            "model '{name}' has no version '{v}' (it serves version 1)"
        ))),
        _ => Ok(shared),
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
        Ok(s) => Json(&s.metadata).into_response(),
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

async fn infer_at(
    s: Served,
    name: String,
    version: Option<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(e) = find(&s, &name, version.as_deref()) {
        return e.into_response();
    }
    let header_length = match headers.get(HEADER_LENGTH) {
        None => None,
        Some(v) => match v.to_str().ok().and_then(|t| t.trim().parse::<usize>().ok()) {
            Some(n) => Some(n),
            None => {
                return ServeError::BadRequest(format!(
                    "Inference-Header-Content-Length {v:?} is not a byte count"
                ))
                .into_response()
            }
        },
    };
    // The model's work runs off the async threads; a panic in it fails
    // this request only.
    let done = tokio::task::spawn_blocking(move || answer(&s, &body, header_length)).await;
    let (body, json_length) = match done {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => return e.into_response(),
        Err(e) => {
            let why = if e.is_panic() {
                "panicked"
            } else {
                "was cancelled"
            };
            return ServeError::Internal(format!("the inference {why}; the server goes on"))
                .into_response();
        }
    };
    let mut response = (StatusCode::OK, body).into_response();
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

/// One request's response body (and its JSON object's length when binary
/// data follows).
fn answer(
    s: &Shared,
    body: &[u8],
    header_length: Option<usize>,
) -> Result<(Vec<u8>, Option<usize>), ServeError> {
    let parsed = parse_request(body, header_length)?;
    let request = &parsed.request;
    let all_binary = flag(&request.parameters, "binary_data_output").unwrap_or(false);
    // The outputs asked for, each as binary or JSON.
    let wanted: Vec<(usize, bool)> = match &request.outputs {
        None => (0..OUTPUTS.len()).map(|o| (o, all_binary)).collect(),
        Some(outputs) => outputs
            .iter()
            .map(|o| {
                let at = OUTPUTS.iter().position(|n| *n == o.name).ok_or_else(|| {
                    ServeError::BadRequest(format!(
                        "output '{}' is not an output of model '{}' (its outputs: {})",
                        o.name,
                        s.name,
                        OUTPUTS.join(", ")
                    ))
                })?;
                Ok((at, flag(&o.parameters, "binary_data").unwrap_or(all_binary)))
            })
            .collect::<Result<_, ServeError>>()?,
    };
    let logits = {
        let mut model = s.model.lock().unwrap_or_else(|p| p.into_inner());
        let batch = model.batch(&parsed)?;
        model.infer(&batch)?
    };
    let probabilities: Vec<f32> = logits.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect();
    let columns = [logits, probabilities];
    let mut outputs = Vec::new();
    let mut binary = Vec::new();
    for (at, as_binary) in wanted {
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
        model_name: s.name.clone(),
        model_version: Some("1".into()),
        id: request.id.clone(),
        outputs,
    };
    Ok(encode_response(response, binary))
}
