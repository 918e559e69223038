//! Named views of parameters and their gradients, for optimizers and checkpoints.

/// One parameter tensor, flattened, with its gradient. Names follow TorchRec's `state_dict`
/// names relative to the module that owns the parameter.
pub struct Param<'a, T> {
    /// The name, e.g. `_mlp.0._linear.weight`.
    pub name: String,
    /// The tensor's shape as torch has it (e.g. `[out, in]` for a linear
    /// weight); `[len]` unless the module says otherwise.
    pub shape: Vec<usize>,
    /// The values, row-major.
    pub value: &'a mut [T],
    /// Mutable so that data-parallel training can replace it with the sum
    /// over ranks before the update.
    pub grad: &'a mut [T],
}

impl<'a, T> Param<'a, T> {
    /// A flat parameter of shape `[value.len()]`.
    pub fn new(name: impl Into<String>, value: &'a mut [T], grad: &'a mut [T]) -> Self {
        Param {
            name: name.into(),
            shape: vec![value.len()],
            value,
            grad,
        }
    }

    /// The same parameter with the given shape (which holds its values).
    pub fn with_shape(mut self, shape: &[usize]) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), self.value.len());
        self.shape = shape.to_vec();
        self
    }

    /// Prepends `prefix` to the name: a model names its submodules' parameters this way
    /// (e.g. `"dense_arch.model."`).
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        self.name.insert_str(0, prefix);
        self
    }
}

/// A module with trainable parameters. The order of the returned list is stable, which is
/// what optimizer state is keyed by.
pub trait HasParams<T> {
    /// Every parameter with its gradient, in a fixed order.
    fn params(&mut self) -> Vec<Param<'_, T>>;
}
