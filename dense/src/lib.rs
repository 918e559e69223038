//! Dense tensors, layers with forward and backward passes, and the backends that run them.
//!
//! - [`Tensor`]: a row-major 2-D buffer, reused across steps.
//! - [`DenseBackend`]: every dense computation, coarse enough for a compiler backend;
//!   [`NativeBackend`] implements it with `gemm` and rayon.
//! - Layers ([`Linear`], [`Mlp`], [`DotInteraction`], [`LowRankCrossNet`], [`BceWithLogits`])
//!   own their parameters, gradients and activation buffers; the math goes through a backend.
//! - [`DenseOptimizer`] updates parameters exposed through [`HasParams`].
//! - [`jagged`]: sequences of rows without padding ([`Jagged`]) and their
//!   operators (padding, softmax, batched products), forward and backward.
//! - [`conformance`]: the test suite every backend must pass.

pub mod backend;
pub mod conformance;
pub mod error;
pub mod init;
pub mod jagged;
pub mod layers;
pub mod native;
pub mod optim;
pub mod param;
pub mod pjrt;
pub mod real;
pub mod tensor;

pub use backend::{Activation, DenseBackend};
pub use error::DenseError;
pub use init::Initializer;
pub use jagged::Jagged;
pub use layers::crossnet::LowRankCrossNet;
pub use layers::hstu::{HstuConfig, HstuInput, HstuLayer};
pub use layers::interaction::DotInteraction;
pub use layers::linear::Linear;
pub use layers::loss::BceWithLogits;
pub use layers::mha::MultiheadAttention;
pub use layers::mlp::Mlp;
pub use layers::module::{Module, ParamView, Sequential};
pub use layers::norm::LayerNorm;
pub use native::NativeBackend;
pub use optim::{clip_grad_norm, DenseOptimizer, DenseOptimizerConfig, WeightDecay};
pub use param::{HasParams, Param};
pub use real::Real;
pub use tensor::Tensor;
