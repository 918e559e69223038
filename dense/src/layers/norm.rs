//! Layer normalisation over each row (torch's `nn.LayerNorm` /
//! `F.layer_norm` on the last dimension), forward and backward.

use rayon::prelude::*;

use crate::param::{HasParams, Param};
use crate::real::Real;
use crate::tensor::Tensor;

/// `y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias` over each row
/// (the biased variance, as torch). Without affine parameters, `weight`
/// and `bias` are 1 and 0 and not learned (HSTU's layer norms).
#[derive(Clone, Debug)]
pub struct LayerNorm<T> {
    eps: f64,
    /// `[dim]`, torch's `weight` (empty without affine parameters).
    pub weight: Vec<T>,
    /// `[dim]`, torch's `bias` (empty without affine parameters).
    pub bias: Vec<T>,
    /// `dL/dweight`, overwritten by every backward.
    pub weight_grad: Vec<T>,
    /// `dL/dbias`, overwritten by every backward.
    pub bias_grad: Vec<T>,
    dim: usize,
    /// The forward's normalised input and each row's 1/std, for the backward.
    normed: Tensor<T>,
    rstd: Vec<T>,
}

/// Rows a parallel task takes, at least.
const ROWS_PER_TASK: usize = 64;

impl<T: Real> LayerNorm<T> {
    /// Over rows of `dim`, with `eps`; `affine`: a learned weight (ones)
    /// and bias (zeros), as torch's `elementwise_affine`.
    pub fn new(dim: usize, eps: f64, affine: bool) -> Self {
        let n = if affine { dim } else { 0 };
        Self {
            eps,
            weight: vec![T::ONE; n],
            bias: vec![T::ZERO; n],
            weight_grad: vec![T::ZERO; n],
            bias_grad: vec![T::ZERO; n],
            dim,
            normed: Tensor::zeros(0, dim),
            rstd: Vec::new(),
        }
    }

    /// The row width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Normalises each row of `x` into `y` (resized to `x`'s shape).
    pub fn forward(&mut self, x: &Tensor<T>, y: &mut Tensor<T>) {
        let d = self.dim;
        assert_eq!(
            x.cols(),
            d,
            "LayerNorm::forward: rows of {} columns",
            x.cols()
        );
        let rows = x.rows();
        y.resize(rows, d);
        self.normed.resize(rows, d);
        self.rstd.resize(rows, T::ZERO);
        if d == 0 {
            return;
        }
        let (eps, weight, bias) = (T::from_f64(self.eps), &self.weight, &self.bias);
        let block = |b: usize, (normed, out): (&mut [T], &mut [T]), rstd: &mut [T]| {
            let x = &x.data()[b * ROWS_PER_TASK * d..];
            for (r, rs) in rstd.iter_mut().enumerate() {
                let at = r * d..(r + 1) * d;
                let (xr, nr, yr) = (&x[at.clone()], &mut normed[at.clone()], &mut out[at]);
                *rs = normalize_row(xr, nr, eps);
                affine(nr, yr, weight, bias);
            }
        };
        let chunk = ROWS_PER_TASK * d;
        let parts = (self.normed.data_mut().chunks_mut(chunk)).zip(y.data_mut().chunks_mut(chunk));
        let parts = parts.zip(self.rstd.chunks_mut(ROWS_PER_TASK)).enumerate();
        if rows >= 4 * ROWS_PER_TASK {
            let parts: Vec<_> = parts.collect();
            parts.into_par_iter().for_each(|(b, (o, r))| block(b, o, r));
        } else {
            parts.for_each(|(b, (o, r))| block(b, o, r));
        }
    }

    /// From the output's gradient `dy`, the input's into `dx` (resized),
    /// and the weight's and bias's gradients (overwritten).
    pub fn backward(&mut self, dy: &Tensor<T>, dx: &mut Tensor<T>) {
        let d = self.dim;
        let rows = self.normed.rows();
        assert_eq!(
            dy.shape(),
            (rows, d),
            "LayerNorm::backward: dy of the forward's shape"
        );
        dx.resize(rows, d);
        if d == 0 {
            return;
        }
        if !self.weight.is_empty() {
            self.weight_grad.fill(T::ZERO);
            self.bias_grad.fill(T::ZERO);
            for (nr, gr) in self.normed.data().chunks(d).zip(dy.data().chunks(d)) {
                let grads = self.weight_grad.iter_mut().zip(self.bias_grad.iter_mut());
                for ((gw, gb), (&n, &g)) in grads.zip(nr.iter().zip(gr)) {
                    *gw += g * n;
                    *gb += g;
                }
            }
        }
        let (normed, rstd, weight) = (&self.normed, &self.rstd, &self.weight);
        let block = |b: usize, out: &mut [T]| {
            let first = b * ROWS_PER_TASK;
            for (r, dxr) in out.chunks_mut(d).enumerate() {
                let at = (first + r) * d..(first + r + 1) * d;
                let (nr, gr) = (&normed.data()[at.clone()], &dy.data()[at]);
                backward_row(nr, gr, rstd[first + r], weight, dxr);
            }
        };
        let parts = dx.data_mut().chunks_mut(ROWS_PER_TASK * d).enumerate();
        if rows >= 4 * ROWS_PER_TASK {
            let parts: Vec<_> = parts.collect();
            parts.into_par_iter().for_each(|(b, o)| block(b, o));
        } else {
            parts.for_each(|(b, o)| block(b, o));
        }
    }
}

/// `normed = (x - mean) / sqrt(var + eps)`; returns 1 / sqrt(var + eps).
fn normalize_row<T: Real>(x: &[T], normed: &mut [T], eps: T) -> T {
    let n = T::from_f64(x.len() as f64);
    let mean = x.iter().fold(T::ZERO, |s, &v| s + v) / n;
    let var = x.iter().fold(T::ZERO, |s, &v| s + (v - mean) * (v - mean)) / n;
    let r = T::ONE / (var + eps).sqrt();
    for (o, &v) in normed.iter_mut().zip(x) {
        *o = (v - mean) * r;
    }
    r
}

/// `y = normed * weight + bias` (`normed` without affine parameters).
fn affine<T: Real>(normed: &[T], y: &mut [T], weight: &[T], bias: &[T]) {
    if weight.is_empty() {
        y.copy_from_slice(normed);
        return;
    }
    for (((o, &n), &w), &b) in y.iter_mut().zip(normed).zip(weight).zip(bias) {
        *o = n * w + b;
    }
}

/// `dx = rstd (g - mean(g) - x̂ mean(g x̂))` with `g = dy * weight`.
fn backward_row<T: Real>(normed: &[T], dy: &[T], rstd: T, weight: &[T], dx: &mut [T]) {
    let n = T::from_f64(normed.len() as f64);
    let g = |c: usize| match weight.is_empty() {
        true => dy[c],
        false => dy[c] * weight[c],
    };
    let (mut sg, mut sgx) = (T::ZERO, T::ZERO);
    for (c, &x) in normed.iter().enumerate() {
        sg += g(c);
        sgx += g(c) * x;
    }
    let (mg, mgx) = (sg / n, sgx / n);
    for (c, (o, &x)) in dx.iter_mut().zip(normed).enumerate() {
        *o = rstd * (g(c) - mg - x * mgx);
    }
}

impl<T: Real> HasParams<T> for LayerNorm<T> {
    fn params(&mut self) -> Vec<Param<'_, T>> {
        if self.weight.is_empty() {
            return Vec::new();
        }
        vec![
            Param::new("weight", &mut self.weight, &mut self.weight_grad),
            Param::new("bias", &mut self.bias, &mut self.bias_grad),
        ]
    }
}
