//! The dense backend contract: every dense computation of a layer goes through it.
//!
//! The ops are coarse on purpose (bias and activation fused into the linear layer, the whole
//! pairwise interaction as one op) so that a compiler backend (PJRT/StableHLO) can implement the
//! same trait without seeing loops. The trait is object safe: layers take `&dyn DenseBackend<T>`.
//!
//! Conventions shared by every op:
//! - Outputs that an op overwrites are resized by the op (reusing their allocation), so callers
//!   may pass buffers of any shape; outputs that an op accumulates into must already have the
//!   right shape.
//! - Shape mismatches are programming errors: the op panics with a message naming itself and
//!   the shapes (see [`crate::DenseError`]).
//! - [`crate::conformance::run_all`] checks an implementation against plain reference loops.

use crate::real::Real;
use crate::tensor::Tensor;

/// The activation fused after a linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Activation {
    /// Identity: `y = z` (no activation, e.g. the over arch's last layer producing logits).
    None,
    /// `y = max(z, 0)`, torch `nn.ReLU`.
    Relu,
    /// `y = 1 / (1 + e^-z)`, torch `nn.Sigmoid`.
    Sigmoid,
}

/// Dense math for the layers of this crate. See the module docs for the conventions.
pub trait DenseBackend<T: Real>: Send + Sync {
    /// A short name for logs ("native", "pjrt").
    fn name(&self) -> &'static str;

    /// `c = alpha * op(a) * op(b) + beta * c`, where `op` transposes when its flag is set.
    ///
    /// When `beta == 0`, `c` is not read (it may hold NaN) and is resized to the product's
    /// shape; otherwise it must already have that shape.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        a: &Tensor<T>,
        trans_a: bool,
        b: &Tensor<T>,
        trans_b: bool,
        alpha: T,
        beta: T,
        c: &mut Tensor<T>,
    );

    /// `y[n, out] = act(x[n, in] · w[out, in]ᵀ + b)`, bias and activation fused. `y` is resized.
    fn linear_forward(
        &self,
        x: &Tensor<T>,
        w: &Tensor<T>,
        b: &[T],
        act: Activation,
        y: &mut Tensor<T>,
    );

    /// Backward of [`DenseBackend::linear_forward`]. `y` is the activated output and `dy` the
    /// gradient with respect to it; `dy` is turned in place into the pre-activation gradient
    /// `dz`. Writes `dw = dzᵀ · x` (resized to `[out, in]`), `db = Σ_rows dz` (`db.len() == out`)
    /// and, when given, `dx = dz · w` (resized to `[n, in]`).
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &self,
        x: &Tensor<T>,
        w: &Tensor<T>,
        y: &Tensor<T>,
        act: Activation,
        dy: &mut Tensor<T>,
        dw: &mut Tensor<T>,
        db: &mut [T],
        dx: Option<&mut Tensor<T>>,
    );

    /// DLRM dot interaction in TorchRec `InteractionArch` order. Per sample, the `F + 1` vectors
    /// of dim `D` are `combined = [dense, sparse_0, .., sparse_{F-1}]` (`dense` is `[n, D]`,
    /// `sparse` is `[n, F * D]`); `out = [dense, <combined_i, combined_j> for i < j row-major]`,
    /// `D + F(F+1)/2` columns. `out` is resized.
    fn dot_interaction_forward(&self, dense: &Tensor<T>, sparse: &Tensor<T>, out: &mut Tensor<T>);

    /// Backward of [`DenseBackend::dot_interaction_forward`]: from `dout` writes `ddense`
    /// (`[n, D]`) and `dsparse` (`[n, F * D]`), both resized.
    fn dot_interaction_backward(
        &self,
        dense: &Tensor<T>,
        sparse: &Tensor<T>,
        dout: &Tensor<T>,
        ddense: &mut Tensor<T>,
        dsparse: &mut Tensor<T>,
    );

    /// One cross layer's elementwise part: `out = x0 ⊙ (h + b) + xl`, `b` broadcast over rows.
    /// `out` is resized.
    fn cross_combine_forward(
        &self,
        x0: &Tensor<T>,
        h: &Tensor<T>,
        b: &[T],
        xl: &Tensor<T>,
        out: &mut Tensor<T>,
    );

    /// Backward of [`DenseBackend::cross_combine_forward`] given `dout`: writes `dh = dout ⊙ x0`
    /// (resized), `db = Σ_rows dh`, and accumulates `dx0 += dout ⊙ (h + b)` (accumulated because
    /// `x0` feeds every layer; `dx0` must have `x0`'s shape). The identity path `dxl = dout` is
    /// left to the caller.
    #[allow(clippy::too_many_arguments)]
    fn cross_combine_backward(
        &self,
        x0: &Tensor<T>,
        h: &Tensor<T>,
        b: &[T],
        dout: &Tensor<T>,
        dh: &mut Tensor<T>,
        db: &mut [T],
        dx0: &mut Tensor<T>,
    );

    /// `y += x` elementwise (residual gradient paths); shapes must match.
    fn add_assign(&self, y: &mut Tensor<T>, x: &Tensor<T>);

    /// Mean binary cross-entropy of `sigmoid(logits)` against `labels`, computed stably on the
    /// logits. Writes `dlogits = (sigmoid(z) - y) / n`, resized to `[n, 1]`, and the mean loss
    /// into `loss` (an output like any other, so a deferring backend need not stop for it).
    fn bce_with_logits(&self, logits: &[T], labels: &[T], dlogits: &mut Tensor<T>, loss: &mut T);

    /// `dst` becomes a copy of `src` (shape and values).
    fn copy(&self, dst: &mut Tensor<T>, src: &Tensor<T>);

    /// `t` becomes `[rows, cols]` of zeros.
    fn zeros(&self, t: &mut Tensor<T>, rows: usize, cols: usize);

    /// `out = [a, b]` side by side (`a` and `b` have the same rows). `out` is resized.
    fn concat_columns(&self, a: &Tensor<T>, b: &Tensor<T>, out: &mut Tensor<T>);

    /// Inverse of [`DenseBackend::concat_columns`]: the first `cols_a` columns of `x` go to `a`,
    /// the rest to `b`; both are resized.
    fn split_columns(&self, x: &Tensor<T>, cols_a: usize, a: &mut Tensor<T>, b: &mut Tensor<T>);

    /// Runs a dense op of the caller's own (one Ember does not ship, such as
    /// DeepFM's factorization-machine interaction) on the host: `op` reads
    /// its input tensors and writes its outputs in place. An eager backend
    /// (native; PJRT outside a fused window) runs it at once, its inputs
    /// already written. Inside a fused window ([`DenseBackend::fused`]) the
    /// inputs are not written yet, so a backend that defers ops panics,
    /// naming `name`: run such models in strict or debug mode there (or
    /// lower the op to StableHLO yourself, as `ember_dense::pjrt::lower`
    /// does Ember's own).
    fn host_op(&self, name: &str, op: &mut dyn FnMut()) {
        let _ = name;
        op()
    }

    /// Runs `body` as one window: a backend may record the ops `body` issues and run them
    /// fused when it returns, writing every output then (`--mode defer-fuse`). An eager
    /// backend just runs `body`. A panic in `body` discards the window.
    ///
    /// # Safety
    /// Until this returns, outputs of the ops inside `body` may still be unwritten: the
    /// backend knows tensors by their addresses and writes outputs at the end. So every
    /// tensor or slice given to an op in `body` must outlive this call, and inside `body` the
    /// host must neither read, write, resize nor move one, except through this backend's ops.
    unsafe fn fused(&self, body: &mut dyn FnMut()) {
        body()
    }
}
