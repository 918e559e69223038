//! Per-sample matrix products of jagged tensors (FBGEMM's
//! `jagged_dense_bmm` and `jagged_jagged_bmm`), forward and backward. Each
//! sample's product is one GEMM on its own rows; samples run in parallel.

use rayon::prelude::*;

use super::gemm::{gemm, View};
use super::{check, parallel, Jagged};
use crate::real::Real;
use crate::tensor::Tensor;

/// Sequence `b`'s length.
fn seq_len<T: Real>(x: &Jagged<T>, b: usize) -> usize {
    x.offsets()[b + 1] - x.offsets()[b]
}

/// Runs `f(b, item)` over `items`, in parallel when `work` is worth it.
fn for_each<I: Send>(items: Vec<I>, work: usize, f: impl Fn(usize, I) + Sync + Send) {
    match parallel(work) {
        true => items.into_par_iter().enumerate().for_each(|(b, i)| f(b, i)),
        false => items.into_iter().enumerate().for_each(|(b, i)| f(b, i)),
    }
}

/// `z_b = x_b · y_b` for each sample: `x` jagged `[total, n]`, `y` dense
/// `[batch * n, m]` (sample `b`'s `n x m` block in rows `b * n..`); `z`
/// jagged `[total, m]`.
pub fn jagged_dense_bmm<T: Real>(x: &Jagged<T>, y: &Tensor<T>) -> Jagged<T> {
    let (n, m) = (x.dim(), y.cols());
    check(y.rows() == x.batch() * n, "jagged_dense_bmm", || {
        format!("y has {} rows, not {} samples x {n}", y.rows(), x.batch())
    });
    let mut z = Jagged::zeros_like(x, m);
    let work = x.total_len() * n * m;
    for_each(z.segments_mut(), work, |b, zb| {
        let l = seq_len(x, b);
        let yb = &y.data()[b * n * m..(b + 1) * n * m];
        gemm(
            View::rows(x.segment(b), l, n),
            View::rows(yb, n, m),
            zb,
            m,
            false,
        );
    });
    z
}

/// The gradients of [`jagged_dense_bmm`]'s `x` and `y` from `dz`'s:
/// `dx_b = dz_b · y_bᵀ`, `dy_b = x_bᵀ · dz_b`.
pub fn jagged_dense_bmm_backward<T: Real>(
    x: &Jagged<T>,
    y: &Tensor<T>,
    dz: &Jagged<T>,
) -> (Jagged<T>, Tensor<T>) {
    let (n, m) = (x.dim(), y.cols());
    check(
        dz.offsets() == x.offsets() && dz.dim() == m && y.rows() == x.batch() * n,
        "jagged_dense_bmm_backward",
        || "dz must have x's offsets and y's columns".into(),
    );
    let mut dx = Jagged::zeros_like(x, n);
    let work = x.total_len() * n * m;
    for_each(dx.segments_mut(), work, |b, dxb| {
        let l = seq_len(x, b);
        let yb = &y.data()[b * n * m..(b + 1) * n * m];
        gemm(
            View::rows(dz.segment(b), l, m),
            View::rows(yb, n, m).t(),
            dxb,
            n,
            false,
        );
    });
    let mut dy = Tensor::zeros(x.batch() * n, m);
    let blocks: Vec<&mut [T]> = match n * m {
        0 => Vec::new(),
        size => dy.data_mut().chunks_mut(size).collect(),
    };
    for_each(blocks, work, |b, dyb| {
        let l = seq_len(x, b);
        gemm(
            View::rows(x.segment(b), l, n).t(),
            View::rows(dz.segment(b), l, m),
            dyb,
            m,
            false,
        );
    });
    (dx, dy)
}

/// `z_b = x_bᵀ · y_b` for each sample: `x` jagged `[total, n]` and `y`
/// jagged `[total, m]` of the same offsets; `z` dense `[batch * n, m]`
/// (zeros for an empty sequence).
pub fn jagged_jagged_bmm<T: Real>(x: &Jagged<T>, y: &Jagged<T>) -> Tensor<T> {
    let (n, m) = (x.dim(), y.dim());
    check(x.offsets() == y.offsets(), "jagged_jagged_bmm", || {
        "x and y must have the same offsets".into()
    });
    let mut z = Tensor::zeros(x.batch() * n, m);
    let blocks: Vec<&mut [T]> = match n * m {
        0 => Vec::new(),
        size => z.data_mut().chunks_mut(size).collect(),
    };
    for_each(blocks, x.total_len() * n * m, |b, zb| {
        let l = seq_len(x, b);
        gemm(
            View::rows(x.segment(b), l, n).t(),
            View::rows(y.segment(b), l, m),
            zb,
            m,
            false,
        );
    });
    z
}

/// The gradients of [`jagged_jagged_bmm`]'s `x` and `y` from `dz`'s:
/// `dx_b = y_b · dz_bᵀ`, `dy_b = x_b · dz_b`.
pub fn jagged_jagged_bmm_backward<T: Real>(
    x: &Jagged<T>,
    y: &Jagged<T>,
    dz: &Tensor<T>,
) -> (Jagged<T>, Jagged<T>) {
    let (n, m) = (x.dim(), y.dim());
    check(
        x.offsets() == y.offsets() && dz.rows() == x.batch() * n && dz.cols() == m,
        "jagged_jagged_bmm_backward",
        || format!("dz must be [{} x {n}, {m}]", x.batch()),
    );
    let work = x.total_len() * n * m;
    let dz_block = |b: usize| &dz.data()[b * n * m..(b + 1) * n * m];
    let mut dx = Jagged::zeros_like(x, n);
    for_each(dx.segments_mut(), work, |b, dxb| {
        let l = seq_len(x, b);
        gemm(
            View::rows(y.segment(b), l, m),
            View::rows(dz_block(b), n, m).t(),
            dxb,
            n,
            false,
        );
    });
    let mut dy = Jagged::zeros_like(y, m);
    for_each(dy.segments_mut(), work, |b, dyb| {
        let l = seq_len(x, b);
        gemm(
            View::rows(x.segment(b), l, n),
            View::rows(dz_block(b), n, m),
            dyb,
            m,
            false,
        );
    });
    (dx, dy)
}
