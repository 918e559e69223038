//! TorchRec's `LowRankCrossNet`, the cross network of DCN-v2.

use crate::backend::DenseBackend;
use crate::error::check_shape;
use crate::init::Initializer;
use crate::param::{HasParams, Param};
use crate::real::Real;
use crate::tensor::Tensor;

/// `x_{l+1} = x0 ⊙ (W_l (V_l x_l) + b_l) + x_l` for `l = 0..layers`, with `W_l` `[in, rank]`
/// and `V_l` `[rank, in]` (the low-rank factorization of DCN-v2's full `[in, in]` kernel).
///
/// Caches `x_l`, `V_l x_l` and `W_l V_l x_l` per layer for the backward and reuses them.
#[derive(Clone, Debug)]
pub struct LowRankCrossNet<T> {
    /// `W_l` per layer, `[in, rank]` (TorchRec `W_kernels`).
    pub w_kernels: Vec<Tensor<T>>,
    /// `V_l` per layer, `[rank, in]` (TorchRec `V_kernels`).
    pub v_kernels: Vec<Tensor<T>>,
    /// `b_l` per layer, `in` values (TorchRec `bias`).
    pub bias: Vec<Vec<T>>,
    /// Gradient of each `W_l`, `[in, rank]`; overwritten by every backward.
    pub w_grads: Vec<Tensor<T>>,
    /// Gradient of each `V_l`, `[rank, in]`; overwritten by every backward.
    pub v_grads: Vec<Tensor<T>>,
    /// Gradient of each `b_l`, `in` values; overwritten by every backward.
    pub bias_grads: Vec<Vec<T>>,
    in_features: usize,
    rank: usize,
    /// `xs[0]` is the input, `xs[l + 1]` the output of layer `l`.
    xs: Vec<Tensor<T>>,
    /// `vs[l] = x_l · V_lᵀ`, `[n, rank]`.
    vs: Vec<Tensor<T>>,
    /// `hs[l] = vs[l] · W_lᵀ`, `[n, in]`.
    hs: Vec<Tensor<T>>,
    g: Tensor<T>,
    dh: Tensor<T>,
    dv: Tensor<T>,
    dx0: Tensor<T>,
}

impl<T: Real> LowRankCrossNet<T> {
    /// Initialized like TorchRec: every `W` then every `V` xavier-normal, biases zero.
    pub fn new(in_features: usize, num_layers: usize, rank: usize, seed: u64) -> Self {
        let mut init = Initializer::new(seed);
        let w_kernels: Vec<Tensor<T>> = (0..num_layers)
            .map(|_| init.xavier_normal(in_features, rank))
            .collect();
        let v_kernels: Vec<Tensor<T>> = (0..num_layers)
            .map(|_| init.xavier_normal(rank, in_features))
            .collect();
        LowRankCrossNet {
            w_grads: vec![Tensor::zeros(in_features, rank); num_layers],
            v_grads: vec![Tensor::zeros(rank, in_features); num_layers],
            bias: vec![vec![T::ZERO; in_features]; num_layers],
            bias_grads: vec![vec![T::ZERO; in_features]; num_layers],
            w_kernels,
            v_kernels,
            in_features,
            rank,
            xs: vec![Tensor::default(); num_layers + 1],
            vs: vec![Tensor::default(); num_layers],
            hs: vec![Tensor::default(); num_layers],
            g: Tensor::default(),
            dh: Tensor::default(),
            dv: Tensor::default(),
            dx0: Tensor::default(),
        }
    }

    /// Width of the input, and of every layer's output (a cross layer keeps the width).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Number of cross layers.
    pub fn num_layers(&self) -> usize {
        self.w_kernels.len()
    }

    /// Rank of each layer's factorization `W_l V_l`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Runs every cross layer on `x0` (`[n, in]`).
    pub fn forward(&mut self, be: &dyn DenseBackend<T>, x0: &Tensor<T>) -> &Tensor<T> {
        check_shape(
            x0.cols() == self.in_features,
            "LowRankCrossNet::forward",
            || {
                format!(
                    "input {} but the cross net takes {} columns",
                    x0.dims(),
                    self.in_features
                )
            },
        );
        be.copy(&mut self.xs[0], x0);
        for l in 0..self.num_layers() {
            let (done, rest) = self.xs.split_at_mut(l + 1);
            be.matmul(
                &done[l],
                false,
                &self.v_kernels[l],
                true,
                T::ONE,
                T::ZERO,
                &mut self.vs[l],
            );
            be.matmul(
                &self.vs[l],
                false,
                &self.w_kernels[l],
                true,
                T::ONE,
                T::ZERO,
                &mut self.hs[l],
            );
            be.cross_combine_forward(&done[0], &self.hs[l], &self.bias[l], &done[l], &mut rest[0]);
        }
        &self.xs[self.num_layers()]
    }

    /// Back-propagates `dy` (gradient of the last forward's output), overwriting the parameter
    /// gradients; returns the gradient with respect to the input.
    pub fn backward(&mut self, be: &dyn DenseBackend<T>, dy: &Tensor<T>) -> &Tensor<T> {
        let layers = self.num_layers();
        check_shape(
            dy.shape() == self.xs[layers].shape(),
            "LowRankCrossNet::backward",
            || {
                format!(
                    "dy {} but the last forward's output is {}",
                    dy.dims(),
                    self.xs[layers].dims()
                )
            },
        );
        // `g` follows the x_l chain; `dx0` collects the direct x0 ⊙ (h + b) paths.
        be.copy(&mut self.g, dy);
        be.zeros(&mut self.dx0, dy.rows(), dy.cols());
        let x0 = &self.xs[0];
        for l in (0..layers).rev() {
            be.cross_combine_backward(
                x0,
                &self.hs[l],
                &self.bias[l],
                &self.g,
                &mut self.dh,
                &mut self.bias_grads[l],
                &mut self.dx0,
            );
            // h = v · Wᵀ
            be.matmul(
                &self.dh,
                true,
                &self.vs[l],
                false,
                T::ONE,
                T::ZERO,
                &mut self.w_grads[l],
            );
            be.matmul(
                &self.dh,
                false,
                &self.w_kernels[l],
                false,
                T::ONE,
                T::ZERO,
                &mut self.dv,
            );
            // v = x_l · Vᵀ; the identity path of x_{l+1} = .. + x_l is already in g.
            be.matmul(
                &self.dv,
                true,
                &self.xs[l],
                false,
                T::ONE,
                T::ZERO,
                &mut self.v_grads[l],
            );
            be.matmul(
                &self.dv,
                false,
                &self.v_kernels[l],
                false,
                T::ONE,
                T::ONE,
                &mut self.g,
            );
        }
        be.add_assign(&mut self.dx0, &self.g);
        &self.dx0
    }
}

impl<T: Real> HasParams<T> for LowRankCrossNet<T> {
    /// `W_kernels.{l}`, `V_kernels.{l}`, `bias.{l}`, as TorchRec's `ParameterList`s name them.
    fn params(&mut self) -> Vec<Param<'_, T>> {
        let mut out = Vec::with_capacity(3 * self.num_layers());
        for (l, (w, g)) in self.w_kernels.iter_mut().zip(&mut self.w_grads).enumerate() {
            let shape = [w.rows(), w.cols()];
            out.push(
                Param::new(format!("W_kernels.{l}"), w.data_mut(), g.data_mut()).with_shape(&shape),
            );
        }
        for (l, (v, g)) in self.v_kernels.iter_mut().zip(&mut self.v_grads).enumerate() {
            let shape = [v.rows(), v.cols()];
            out.push(
                Param::new(format!("V_kernels.{l}"), v.data_mut(), g.data_mut()).with_shape(&shape),
            );
        }
        for (l, (b, g)) in self.bias.iter_mut().zip(&mut self.bias_grads).enumerate() {
            out.push(Param::new(
                format!("bias.{l}"),
                b.as_mut_slice(),
                g.as_mut_slice(),
            ));
        }
        out
    }
}

impl<T: Real> crate::Module<T> for LowRankCrossNet<T> {
    fn forward(&mut self, be: &dyn DenseBackend<T>, x: &Tensor<T>) -> &Tensor<T> {
        LowRankCrossNet::forward(self, be, x)
    }

    fn backward(&mut self, be: &dyn DenseBackend<T>, dy: &Tensor<T>) -> &Tensor<T> {
        LowRankCrossNet::backward(self, be, dy)
    }

    fn output(&self) -> &Tensor<T> {
        &self.xs[self.num_layers()]
    }

    fn input_grad(&self) -> &Tensor<T> {
        &self.dx0
    }

    fn param_views(&self) -> Vec<crate::ParamView<'_, T>> {
        fn tensor<T: Real>(name: String, t: &Tensor<T>) -> crate::ParamView<'_, T> {
            crate::ParamView {
                name,
                shape: vec![t.rows(), t.cols()],
                value: t.data(),
            }
        }
        let mut out: Vec<_> = (self.w_kernels.iter().enumerate())
            .map(|(l, w)| tensor(format!("W_kernels.{l}"), w))
            .collect();
        out.extend(
            (self.v_kernels.iter().enumerate()).map(|(l, v)| tensor(format!("V_kernels.{l}"), v)),
        );
        out.extend(
            (self.bias.iter().enumerate()).map(|(l, b)| crate::ParamView {
                name: format!("bias.{l}"),
                shape: vec![b.len()],
                value: b.as_slice(),
            }),
        );
        out
    }
}
