//! Named views of parameters and their gradients, for optimizers and checkpoints.

/// One parameter tensor, flattened, with its gradient. Names follow TorchRec's `state_dict`
/// names relative to the module that owns the parameter.
pub struct Param<'a, T> {
    pub name: String,
    pub value: &'a mut [T],
    /// Mutable so that data-parallel training can replace it with the sum
    /// over ranks before the update.
    pub grad: &'a mut [T],
}

impl<'a, T> Param<'a, T> {
    pub fn new(name: impl Into<String>, value: &'a mut [T], grad: &'a mut [T]) -> Self {
        Param {
            name: name.into(),
            value,
            grad,
        }
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
    fn params(&mut self) -> Vec<Param<'_, T>>;
}
