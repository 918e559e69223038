//! Layers: parameters plus the buffers their forward and backward reuse from step to step.
//! The math itself is delegated to a [`crate::DenseBackend`].

pub(crate) mod attention;
pub mod crossnet;
pub mod hstu;
pub mod interaction;
pub mod linear;
pub mod loss;
pub mod mha;
pub mod mlp;
pub mod module;
pub mod norm;
