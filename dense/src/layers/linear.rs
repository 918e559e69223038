//! A fully connected layer with a fused activation.

use crate::backend::{Activation, DenseBackend};
use crate::init::Initializer;
use crate::param::{HasParams, Param};
use crate::real::Real;
use crate::tensor::Tensor;

/// `y = act(x · weightᵀ + bias)`, torch `nn.Linear` layout (`weight` is `[out, in]`).
///
/// A `Linear` holds parameters and gradients only; the activations live with the caller
/// (an [`crate::Mlp`] keeps one buffer per layer), so chaining layers copies nothing.
#[derive(Clone, Debug)]
pub struct Linear<T> {
    /// `[out, in]`, as torch's `weight`.
    pub weight: Tensor<T>,
    /// `out` values.
    pub bias: Vec<T>,
    /// `dL/dweight`, `[out, in]`; overwritten by every backward.
    pub weight_grad: Tensor<T>,
    /// `dL/dbias`, `out` values; overwritten by every backward.
    pub bias_grad: Vec<T>,
    activation: Activation,
}

impl<T: Real> Linear<T> {
    /// Initialized like torch's `nn.Linear`: weight and bias `U(-1/sqrt(in), 1/sqrt(in))`.
    pub fn new(in_features: usize, out_features: usize, activation: Activation, seed: u64) -> Self {
        Self::from_init(
            in_features,
            out_features,
            activation,
            &mut Initializer::new(seed),
        )
    }

    /// Like [`Linear::new`], drawing from a shared stream (weight first, then bias).
    pub fn from_init(
        in_features: usize,
        out_features: usize,
        activation: Activation,
        init: &mut Initializer,
    ) -> Self {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let weight = init.uniform_tensor(out_features, in_features, bound);
        let bias = init.uniform_vec(out_features, bound);
        Linear {
            weight,
            bias,
            weight_grad: Tensor::zeros(out_features, in_features),
            bias_grad: vec![T::ZERO; out_features],
            activation,
        }
    }

    /// Input width (`weight.cols()`).
    pub fn in_features(&self) -> usize {
        self.weight.cols()
    }

    /// Output width (`weight.rows()`).
    pub fn out_features(&self) -> usize {
        self.weight.rows()
    }

    /// The activation fused after the affine map.
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// `y = act(x · weightᵀ + bias)`; `y` is resized to `[n, out]`.
    pub fn forward(&self, be: &dyn DenseBackend<T>, x: &Tensor<T>, y: &mut Tensor<T>) {
        be.linear_forward(x, &self.weight, &self.bias, self.activation, y);
    }

    /// Given the forward's `x` and `y` and `dy = dL/dy` (overwritten with the pre-activation
    /// gradient), overwrites `weight_grad` and `bias_grad` and writes `dx` when asked.
    pub fn backward(
        &mut self,
        be: &dyn DenseBackend<T>,
        x: &Tensor<T>,
        y: &Tensor<T>,
        dy: &mut Tensor<T>,
        dx: Option<&mut Tensor<T>>,
    ) {
        be.linear_backward(
            x,
            &self.weight,
            y,
            self.activation,
            dy,
            &mut self.weight_grad,
            &mut self.bias_grad,
            dx,
        );
    }
}

impl<T: Real> HasParams<T> for Linear<T> {
    fn params(&mut self) -> Vec<Param<'_, T>> {
        let shape = [self.weight.rows(), self.weight.cols()];
        vec![
            Param::new(
                "weight",
                self.weight.data_mut(),
                self.weight_grad.data_mut(),
            )
            .with_shape(&shape),
            Param::new("bias", &mut self.bias, &mut self.bias_grad),
        ]
    }
}

impl<T: Real> Linear<T> {
    /// `weight` `[out, in]` and `bias` `[out]`, read-only, as [`HasParams::params`] names them.
    pub fn param_views(&self) -> Vec<crate::ParamView<'_, T>> {
        let view = |name: &str, shape: Vec<usize>, value| crate::ParamView {
            name: name.into(),
            shape,
            value,
        };
        vec![
            view(
                "weight",
                vec![self.weight.rows(), self.weight.cols()],
                self.weight.data(),
            ),
            view("bias", vec![self.bias.len()], &self.bias),
        ]
    }
}
