//! Online serving: a checkpoint's model behind the Open Inference Protocol
//! (KServe v2, the protocol Triton speaks), so that Triton's and KServe's
//! clients (`tritonclient`) ask it for scores unchanged.
//!
//! - [`protocol`]: the protocol's JSON objects and its binary tensor data
//!   extension.
//! - [`tensor`]: a request's input tensors decoded and checked.
//! - [`inputs`]: [`Inputs`], what a model's requests hold and how their raw
//!   features become the model's (as `ember predict` reads them).
//! - [`histories`]: a sequence model's requests (user histories) and its
//!   outputs (top items, or candidates' logits).
//! - [`outputs`]: [`OutputSpec`], a model's outputs, and the [`Column`]s
//!   a [`Scorer`] gives, split back into requests.
//! - [`model`]: [`ServedModel`], a checkpoint's DLRM, DCNv2, SASRec or
//!   HSTU (or a [`Scorer`] of one's own) with its inputs.
//! - [`batcher`]: dynamic batching across requests, deadlines, load
//!   shedding and the swap of a new model.
//! - [`reload`]: a checkpoint watched and reloaded as it changes.
//! - [`metrics`]: Prometheus's text format, under Triton's names.
//! - [`server`]: [`Server`], what the front ends share (a request admitted,
//!   read, queued, scored and counted), and [`serve`] to run them until a
//!   shutdown signal.
//! - [`http`]: the HTTP/REST endpoints and `/metrics`, on axum.
//! - [`grpc`]: the gRPC service, on tonic.
//!
//! ```no_run
//! use ember_serving::{serve, ModelOptions, ServeOptions, ServedModel};
//!
//! # async fn run() -> Result<(), ember_serving::ServeError> {
//! let model = ServedModel::open("ckpt/".as_ref(), "dlrm", &ModelOptions::default())?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8000").await?;
//! serve(listener, None, model, ServeOptions::default(), async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await
//! # }
//! ```

pub mod batcher;
pub mod grpc;
pub mod histories;
pub mod http;
pub mod inputs;
pub mod metrics;
pub mod model;
pub mod outputs;
pub mod protocol;
pub mod reload;
pub mod server;
pub mod tensor;

pub use batcher::BatchOptions;
pub use http::router;
pub use inputs::{Inputs, Limits};
pub use model::{ModelOptions, Scorer, ServedModel};
pub use outputs::{Column, OutputSpec};
pub use reload::ReloadOptions;
pub use server::{serve, ServeOptions, Server};

/// Why serving failed, or why a request did.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The request is malformed (HTTP 400), naming the input and why.
    #[error("{0}")]
    BadRequest(String),
    /// No such model or version (HTTP 404).
    #[error("{0}")]
    NotFound(String),
    /// The server holds as many requests as it takes, or the request's
    /// deadline passed before its batch ran (HTTP 503).
    #[error("{0}")]
    Unavailable(String),
    /// The model failed on a well-formed request (HTTP 500).
    #[error("{0}")]
    Internal(String),
    /// The server's options do not work.
    #[error("{0}")]
    Config(String),
    /// The checkpoint or the model.
    #[error(transparent)]
    Model(#[from] ember_models::ModelError),
    /// The checkpoint's dataset spec.
    #[error(transparent)]
    Data(#[from] ember_dataloader::DataError),
    /// The network.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
