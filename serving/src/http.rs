//! The HTTP/REST front end: KServe v2's health, metadata and inference
//! endpoints and Prometheus's `/metrics`, on axum. Every error is the
//! protocol's JSON error object, axum's own refusals included.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::inputs::{Inputs, Samples};
use crate::metrics::CONTENT_TYPE;
use crate::model::ServedModel;
use crate::outputs::Column;
use crate::protocol::{
    encode_response, parse_request, ErrorBody, InferResponse, ResponseOutput, HEADER_LENGTH,
};
use crate::server::{
    asked, asked_columns, samples_of, server_metadata, Asked, ServeOptions, Server, Shared,
};
use crate::ServeError;

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

/// The routes of KServe v2 and `/metrics` over a model started with
/// [`Server::start`]; its thread stops once the router and its clones are
/// dropped.
pub fn router(model: ServedModel, options: &ServeOptions) -> Result<Router, ServeError> {
    Ok(Server::start(model, options)?.http())
}

impl Server {
    /// The HTTP/REST routes of KServe v2 and `/metrics`.
    pub fn http(&self) -> Router {
        Router::new()
            .route("/v2", get(|| async { Json(server_metadata()) }))
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
            .layer(DefaultBodyLimit::max(self.0.max_request_bytes))
            .with_state(Arc::clone(&self.0))
    }
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

async fn metrics_text(State(s): State<Served>) -> Response {
    let headers = [(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE))];
    (headers, s.metrics.render()).into_response()
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
    match s.find(name, version) {
        Ok(serving) => {
            let mut metadata = s.inputs.metadata().clone();
            metadata.versions = vec![serving.to_string()];
            Json(metadata).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn model_ready(State(s): State<Served>, Path(name): Path<String>) -> Response {
    (s.find(&name, None).map(|_| StatusCode::OK)).into_response()
}

async fn model_version_ready(
    State(s): State<Served>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    (s.find(&name, Some(&version)).map(|_| StatusCode::OK)).into_response()
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
    let read = move |inputs: &Inputs| read(inputs, &headers, &body);
    match s.infer(&name, version.as_deref(), read).await {
        Ok((asked, scored)) => respond(&s.inputs, asked, scored.columns, scored.version),
        Err(e) => e.into_response(),
    }
}

/// A request's samples and what else it asks for, from its headers and body.
fn read(inputs: &Inputs, headers: &HeaderMap, body: &[u8]) -> Result<(Samples, Asked), ServeError> {
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
    let parsed = parse_request(body, header_length)?;
    let asked = asked(inputs, &parsed.request)?;
    Ok((inputs.decode(&parsed)?, asked))
}

/// The response to a request: the outputs it asked for, each as JSON or
/// binary data.
fn respond(inputs: &Inputs, asked: Asked, columns: Vec<Column>, version: u64) -> Response {
    let mut outputs = Vec::new();
    let mut binary = Vec::new();
    for (output, values, as_binary) in asked_columns(inputs, &asked, &columns) {
        binary.push(as_binary.then(|| values.le_bytes()));
        outputs.push(ResponseOutput {
            name: output.name.into(),
            shape: output.shape(samples_of(output, values)),
            datatype: output.datatype().into(),
            parameters: None,
            data: (!as_binary).then(|| values.data()),
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
    let content_type = match json_length {
        Some(n) => {
            h.insert(HEADER_LENGTH, HeaderValue::from(n));
            "application/octet-stream"
        }
        None => "application/json",
    };
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
