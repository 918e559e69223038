//! The contract every one-input layer meets ([`Module`]), so a user composes
//! layers without knowing each one's buffer conventions, and [`Sequential`]
//! to chain them.

use crate::backend::DenseBackend;
use crate::param::{HasParams, Param};
use crate::real::Real;
use crate::tensor::Tensor;

/// A read-only view of one parameter, for saving without `&mut`.
pub struct ParamView<'a, T> {
    /// The name, as [`Param::name`].
    pub name: String,
    /// torch's shape of the tensor (e.g. `[out, in]` for a linear weight).
    pub shape: Vec<usize>,
    /// The values, row-major.
    pub value: &'a [T],
}

impl<'a, T> ParamView<'a, T> {
    /// Prepends `prefix` to the name, as [`Param::with_prefix`].
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        self.name.insert_str(0, prefix);
        self
    }
}

/// A trainable layer with one input and one output, all of its math through
/// a [`DenseBackend`]. `forward` caches what `backward` needs; `backward`
/// overwrites every parameter gradient (for an optimizer to apply through
/// [`HasParams::params`]) and leaves the input's gradient behind.
///
/// ```
/// use ember_dense::{Activation, DenseBackend, LowRankCrossNet, Mlp, Module, NativeBackend, Sequential, Tensor};
///
/// let be = NativeBackend::new(1);
/// // A DCN-v2 style tower: cross net over 8 features, then an MLP to one logit.
/// let mut tower = Sequential::<f32>::new()
///     .push("crossnet.", LowRankCrossNet::new(8, 2, 4, 1))
///     .push("mlp.", Mlp::new(&[8, 16, 1], Activation::None, 2));
/// let x = Tensor::from_vec(3, 8, vec![0.5; 24])?;
/// assert_eq!(tower.forward(&be, &x).shape(), (3, 1));
/// let dy = Tensor::from_vec(3, 1, vec![1.0; 3])?;
/// assert_eq!(tower.backward(&be, &dy).shape(), (3, 8));
/// // Named for saving: 3 tensors per cross layer, 2 per linear layer.
/// assert_eq!(tower.param_views().len(), 2 * 3 + 2 * 2);
/// assert!(tower.param_views()[0].name.starts_with("crossnet.W_kernels"));
/// # Ok::<(), ember_dense::DenseError>(())
/// ```
pub trait Module<T: Real>: HasParams<T> + Send {
    /// The output for `x`, cached with what the backward needs.
    fn forward(&mut self, be: &dyn DenseBackend<T>, x: &Tensor<T>) -> &Tensor<T>;

    /// From the gradient of the last forward's output: fills every
    /// parameter's gradient and returns the input's gradient.
    fn backward(&mut self, be: &dyn DenseBackend<T>, dy: &Tensor<T>) -> &Tensor<T>;

    /// The last forward's output.
    fn output(&self) -> &Tensor<T>;

    /// The last backward's input gradient.
    fn input_grad(&self) -> &Tensor<T>;

    /// Every parameter, read-only, in [`HasParams::params`] order and names.
    fn param_views(&self) -> Vec<ParamView<'_, T>>;
}

/// Modules run one after another, as torch's `nn.Sequential`; the
/// parameters of each are named with the prefix it was pushed with.
pub struct Sequential<T> {
    modules: Vec<(String, Box<dyn Module<T>>)>,
}

impl<T: Real> Default for Sequential<T> {
    fn default() -> Self {
        Self {
            modules: Vec::new(),
        }
    }
}

impl<T: Real> Sequential<T> {
    /// No modules yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `module`, its parameters named `prefix` + their names.
    pub fn push(mut self, prefix: &str, module: impl Module<T> + 'static) -> Self {
        self.modules.push((prefix.to_string(), Box::new(module)));
        self
    }

    /// The modules in order, with their prefixes.
    pub fn modules(&self) -> impl Iterator<Item = (&str, &dyn Module<T>)> {
        (self.modules.iter()).map(|(p, m)| (p.as_str(), m.as_ref()))
    }
}

impl<T: Real> HasParams<T> for Sequential<T> {
    fn params(&mut self) -> Vec<Param<'_, T>> {
        (self.modules.iter_mut())
            .flat_map(|(prefix, m)| {
                let prefix = prefix.clone();
                m.params().into_iter().map(move |p| p.with_prefix(&prefix))
            })
            .collect()
    }
}

impl<T: Real> Module<T> for Sequential<T> {
    /// # Panics
    /// With no modules (a programming error).
    fn forward(&mut self, be: &dyn DenseBackend<T>, x: &Tensor<T>) -> &Tensor<T> {
        for i in 0..self.modules.len() {
            let (done, rest) = self.modules.split_at_mut(i);
            let input = done.last().map_or(x, |(_, m)| m.output());
            rest[0].1.forward(be, input);
        }
        self.output()
    }

    fn backward(&mut self, be: &dyn DenseBackend<T>, dy: &Tensor<T>) -> &Tensor<T> {
        for i in (0..self.modules.len()).rev() {
            let (here, after) = self.modules.split_at_mut(i + 1);
            let grad = after.first().map_or(dy, |(_, m)| m.input_grad());
            here[i].1.backward(be, grad);
        }
        self.input_grad()
    }

    fn output(&self) -> &Tensor<T> {
        let (_, last) = self.modules.last().expect("a Sequential has modules");
        last.output()
    }

    fn input_grad(&self) -> &Tensor<T> {
        let (_, first) = self.modules.first().expect("a Sequential has modules");
        first.input_grad()
    }

    fn param_views(&self) -> Vec<ParamView<'_, T>> {
        (self.modules.iter())
            .flat_map(|(prefix, m)| m.param_views().into_iter().map(|p| p.with_prefix(prefix)))
            .collect()
    }
}
