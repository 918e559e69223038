//! DLRM's pairwise dot interaction (TorchRec `InteractionArch`).

use crate::backend::DenseBackend;
use crate::error::check_shape;
use crate::real::Real;
use crate::tensor::Tensor;

/// `[dense, <combined_i, combined_j> for i < j]` over `combined = [dense, sparse_0..]`.
/// Caches its inputs for the backward and reuses all buffers.
#[derive(Clone, Debug)]
pub struct DotInteraction<T> {
    num_sparse: usize,
    dim: usize,
    dense: Tensor<T>,
    sparse: Tensor<T>,
    out: Tensor<T>,
    ddense: Tensor<T>,
    dsparse: Tensor<T>,
}

impl<T: Real> DotInteraction<T> {
    /// `num_sparse` pooled embeddings (F) of dimension `dim` (D, also the dense arch's output).
    /// # Panics
    /// When `dim` is 0 (there is nothing to take dot products of).
    pub fn new(num_sparse: usize, dim: usize) -> Self {
        assert!(
            dim > 0,
            "DotInteraction::new: the embedding dim must be at least 1"
        );
        DotInteraction {
            num_sparse,
            dim,
            dense: Tensor::default(),
            sparse: Tensor::default(),
            out: Tensor::default(),
            ddense: Tensor::default(),
            dsparse: Tensor::default(),
        }
    }

    /// `D + F(F+1)/2`.
    pub fn output_dim(&self) -> usize {
        self.dim + self.num_sparse * (self.num_sparse + 1) / 2
    }

    /// `dense` is `[n, D]`, `sparse` is `[n, F * D]` (feature-major, as a KeyedTensor).
    pub fn forward(
        &mut self,
        be: &dyn DenseBackend<T>,
        dense: &Tensor<T>,
        sparse: &Tensor<T>,
    ) -> &Tensor<T> {
        check_shape(
            dense.cols() == self.dim
                && sparse.cols() == self.num_sparse * self.dim
                && dense.rows() == sparse.rows(),
            "DotInteraction::forward",
            || {
                format!(
                    "dense {} and sparse {}, want [n, {}] and [n, {}]",
                    dense.dims(),
                    sparse.dims(),
                    self.dim,
                    self.num_sparse * self.dim
                )
            },
        );
        be.copy(&mut self.dense, dense);
        be.copy(&mut self.sparse, sparse);
        be.dot_interaction_forward(&self.dense, &self.sparse, &mut self.out);
        &self.out
    }

    /// The gradient of the sparse input from the last backward.
    pub fn dsparse(&self) -> &Tensor<T> {
        &self.dsparse
    }

    /// As [`DotInteraction::dsparse`], to rescale it (data-parallel training).
    pub fn dsparse_mut(&mut self) -> &mut Tensor<T> {
        &mut self.dsparse
    }

    /// From the gradient of the output, returns `(ddense, dsparse)`.
    pub fn backward(
        &mut self,
        be: &dyn DenseBackend<T>,
        dout: &Tensor<T>,
    ) -> (&Tensor<T>, &Tensor<T>) {
        be.dot_interaction_backward(
            &self.dense,
            &self.sparse,
            dout,
            &mut self.ddense,
            &mut self.dsparse,
        );
        (&self.ddense, &self.dsparse)
    }
}
