//! TorchRec's `MLP`: a stack of `Perceptron`s (Linear + activation).

use crate::backend::{Activation, DenseBackend};
use crate::error::check_shape;
use crate::init::Initializer;
use crate::layers::linear::Linear;
use crate::param::{HasParams, Param};
use crate::real::Real;
use crate::tensor::Tensor;

/// Linear layers with ReLU between them and a chosen activation after the last one.
///
/// Keeps the input, every layer's output and every gradient in buffers that are reused from
/// step to step (none of them reallocates once the batch size is steady).
///
/// ```
/// use ember_dense::{Activation, HasParams, Mlp, NativeBackend, Tensor};
///
/// let be = NativeBackend::new(1);
/// // 4 inputs, one hidden layer of 8, 2 outputs.
/// let mut mlp = Mlp::<f32>::new(&[4, 8, 2], Activation::None, 42);
/// let x = Tensor::from_fn(3, 4, |r, c| (r * 4 + c) as f32 * 0.1); // a batch of 3
///
/// let y = mlp.forward(&be, &x);
/// assert_eq!(y.shape(), (3, 2));
///
/// let dy = Tensor::from_fn(3, 2, |_, _| 1.0);
/// let dx = mlp.backward(&be, &dy, true).unwrap();
/// assert_eq!(dx.shape(), (3, 4));
/// assert_eq!(mlp.params().len(), 4); // weight and bias of each layer
/// ```
#[derive(Clone, Debug)]
pub struct Mlp<T> {
    layers: Vec<Linear<T>>,
    input: Tensor<T>,
    outputs: Vec<Tensor<T>>,
    grads: Vec<Tensor<T>>,
    dx: Tensor<T>,
}

impl<T: Real> Mlp<T> {
    /// `sizes = [in, h1, ..., out]` (at least two entries). Every layer but the last uses ReLU;
    /// the last uses `final_activation` (TorchRec: ReLU for DLRM's bottom MLP, none for the
    /// over arch's final layer). Layers draw from one stream seeded by `seed`, in order.
    pub fn new(sizes: &[usize], final_activation: Activation, seed: u64) -> Self {
        assert!(
            sizes.len() >= 2,
            "Mlp::new: sizes {sizes:?} needs an input and an output size"
        );
        let mut init = Initializer::new(seed);
        let n = sizes.len() - 1;
        let layers: Vec<Linear<T>> = (0..n)
            .map(|i| {
                let act = if i + 1 == n {
                    final_activation
                } else {
                    Activation::Relu
                };
                Linear::from_init(sizes[i], sizes[i + 1], act, &mut init)
            })
            .collect();
        Mlp {
            layers,
            input: Tensor::default(),
            outputs: vec![Tensor::default(); n],
            grads: vec![Tensor::default(); n],
            dx: Tensor::default(),
        }
    }

    /// The linear layers, input side first.
    pub fn layers(&self) -> &[Linear<T>] {
        &self.layers
    }

    /// The linear layers, mutable (to set weights, or rescale gradients).
    pub fn layers_mut(&mut self) -> &mut [Linear<T>] {
        &mut self.layers
    }

    /// `[in, h1, ..., out]`.
    pub fn sizes(&self) -> Vec<usize> {
        let mut s = vec![self.layers[0].in_features()];
        s.extend(self.layers.iter().map(|l| l.out_features()));
        s
    }

    /// The last forward's input, and each layer's output.
    pub fn activations(&self) -> (&Tensor<T>, &[Tensor<T>]) {
        (&self.input, &self.outputs)
    }

    /// The last forward's output.
    pub fn output(&self) -> &Tensor<T> {
        self.outputs.last().expect("an Mlp has at least one layer")
    }

    /// Runs every layer on `x` (`[n, in]`), caching what the backward needs.
    pub fn forward(&mut self, be: &dyn DenseBackend<T>, x: &Tensor<T>) -> &Tensor<T> {
        check_shape(
            x.cols() == self.layers[0].in_features(),
            "Mlp::forward",
            || {
                format!(
                    "input {} but the MLP {:?} takes {} columns",
                    x.dims(),
                    self.sizes(),
                    self.layers[0].in_features()
                )
            },
        );
        be.copy(&mut self.input, x);
        for i in 0..self.layers.len() {
            let (done, rest) = self.outputs.split_at_mut(i);
            let x = if i == 0 { &self.input } else { &done[i - 1] };
            self.layers[i].forward(be, x, &mut rest[0]);
        }
        self.output()
    }

    /// Back-propagates `dy` (gradient of the last forward's output). Overwrites every layer's
    /// parameter gradients; returns the gradient with respect to the input when `want_dx`.
    pub fn backward(
        &mut self,
        be: &dyn DenseBackend<T>,
        dy: &Tensor<T>,
        want_dx: bool,
    ) -> Option<&Tensor<T>> {
        let last = self.layers.len() - 1;
        check_shape(
            dy.shape() == self.outputs[last].shape(),
            "Mlp::backward",
            || {
                format!(
                    "dy {} but the last forward's output is {}",
                    dy.dims(),
                    self.outputs[last].dims()
                )
            },
        );
        be.copy(&mut self.grads[last], dy);
        for i in (0..=last).rev() {
            let (below, here) = self.grads.split_at_mut(i);
            let x = if i == 0 {
                &self.input
            } else {
                &self.outputs[i - 1]
            };
            let dx = if i > 0 {
                Some(&mut below[i - 1])
            } else if want_dx {
                Some(&mut self.dx)
            } else {
                None
            };
            self.layers[i].backward(be, x, &self.outputs[i], &mut here[0], dx);
        }
        want_dx.then_some(&self.dx)
    }
}

impl<T: Real> HasParams<T> for Mlp<T> {
    /// `_mlp.{i}._linear.weight` and `.bias`, as in TorchRec's `MLP` state dict.
    fn params(&mut self) -> Vec<Param<'_, T>> {
        self.layers
            .iter_mut()
            .enumerate()
            .flat_map(|(i, l)| {
                let prefix = format!("_mlp.{i}._linear.");
                l.params().into_iter().map(move |p| p.with_prefix(&prefix))
            })
            .collect()
    }
}

impl<T: Real> crate::Module<T> for Mlp<T> {
    fn forward(&mut self, be: &dyn DenseBackend<T>, x: &Tensor<T>) -> &Tensor<T> {
        Mlp::forward(self, be, x)
    }

    fn backward(&mut self, be: &dyn DenseBackend<T>, dy: &Tensor<T>) -> &Tensor<T> {
        Mlp::backward(self, be, dy, true).expect("asked for the input gradient")
    }

    fn output(&self) -> &Tensor<T> {
        Mlp::output(self)
    }

    fn input_grad(&self) -> &Tensor<T> {
        &self.dx
    }

    fn param_views(&self) -> Vec<crate::ParamView<'_, T>> {
        (self.layers.iter().enumerate())
            .flat_map(|(i, l)| {
                let prefix = format!("_mlp.{i}._linear.");
                l.param_views()
                    .into_iter()
                    .map(move |p| p.with_prefix(&prefix))
            })
            .collect()
    }
}
