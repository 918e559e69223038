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
        let eps = T::from_f64(self.eps);
        let (weight, bias) = (&self.weight, &self.bias);
        let row = |((xr, (nr, yr)), rs): ((&[T], (&mut [T], &mut [T])), &mut T)| {
            let n = T::from_f64(d as f64);
            let mean = xr.iter().fold(T::ZERO, |s, &v| s + v) / n;
            let var = xr.iter().fold(T::ZERO, |s, &v| s + (v - mean) * (v - mean)) / n;
            let r = T::ONE / (var + eps).sqrt();
            *rs = r;
            for (c, ((&v, o), out)) in xr.iter().zip(nr.iter_mut()).zip(yr.iter_mut()).enumerate() {
                *o = (v - mean) * r;
                *out = match weight.is_empty() {
                    true => *o,
                    false => *o * weight[c] + bias[c],
                };
            }
        };
        if d == 0 {
            return;
        }
        let items = x.data().chunks(d).zip(
            self.normed
                .data_mut()
                .chunks_mut(d)
                .zip(y.data_mut().chunks_mut(d)),
        );
        if rows >= 4 * ROWS_PER_TASK {
            let items: Vec<_> = items.zip(self.rstd.iter_mut()).collect();
            items
                .into_par_iter()
                .with_min_len(ROWS_PER_TASK)
                .for_each(row);
        } else {
            items.zip(self.rstd.iter_mut()).for_each(row);
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
        if !self.weight.is_empty() {
            self.weight_grad.fill(T::ZERO);
            self.bias_grad.fill(T::ZERO);
            for (nr, gr) in self
                .normed
                .data()
                .chunks(d.max(1))
                .zip(dy.data().chunks(d.max(1)))
            {
                for c in 0..d {
                    self.weight_grad[c] += gr[c] * nr[c];
                    self.bias_grad[c] += gr[c];
                }
            }
        }
        if d == 0 {
            return;
        }
        let weight = &self.weight;
        let n = T::from_f64(d as f64);
        // dx = rstd (g - mean(g) - x̂ mean(g x̂)), g = dy * weight.
        let row = |(((nr, gr), &r), out): (((&[T], &[T]), &T), &mut [T])| {
            let g = |c: usize| match weight.is_empty() {
                true => gr[c],
                false => gr[c] * weight[c],
            };
            let (mut sg, mut sgx) = (T::ZERO, T::ZERO);
            for c in 0..d {
                sg += g(c);
                sgx += g(c) * nr[c];
            }
            let (mg, mgx) = (sg / n, sgx / n);
            for c in 0..d {
                out[c] = r * (g(c) - mg - nr[c] * mgx);
            }
        };
        let items = (self.normed.data().chunks(d).zip(dy.data().chunks(d)))
            .zip(self.rstd.iter())
            .zip(dx.data_mut().chunks_mut(d));
        if rows >= 4 * ROWS_PER_TASK {
            let items: Vec<_> = items.collect();
            items
                .into_par_iter()
                .with_min_len(ROWS_PER_TASK)
                .for_each(row);
        } else {
            items.for_each(row);
        }
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
