//! Per-sample matrix products of jagged tensors (FBGEMM's
//! `jagged_dense_bmm` and `jagged_jagged_bmm`), forward and backward. Each
//! sample's product is one GEMM on its own rows; samples run in parallel.

use gemm::Parallelism;
use rayon::prelude::*;

use super::{check, parallel, Jagged};
use crate::real::Real;
use crate::tensor::Tensor;

/// `c` (`m x n`, row-major) = op(a) · op(b), plus `c` when `accumulate`: `a`
/// is `m x k` row-major (`k x m` when `trans_a`), `b` is `k x n` (`n x k`
/// when `trans_b`).
#[allow(clippy::too_many_arguments)]
fn gemm<T: Real>(
    (m, k, n): (usize, usize, usize),
    a: &[T],
    trans_a: bool,
    b: &[T],
    trans_b: bool,
    accumulate: bool,
    c: &mut [T],
) {
    assert!(
        a.len() == m * k && b.len() == k * n && c.len() == m * n,
        "jagged gemm: internal shape error"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(T::ZERO);
        }
        return;
    }
    // (row stride, column stride) of op(a) and op(b) over their buffers.
    let (a_rs, a_cs) = if trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if trans_b { (1, k) } else { (n, 1) };
    // SAFETY: each buffer holds exactly its operand's elements (asserted
    // above) and the strides walk inside it; `c` is an exclusive borrow of
    // m*n elements with row stride n that the shared operands cannot alias.
    // `T` is f32 or f64 (sealed `Real`), which gemm supports. gemm computes
    // dst = alpha·dst + beta·lhs·rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

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
        gemm((l, n, m), x.segment(b), false, yb, false, false, zb);
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
        gemm((l, m, n), dz.segment(b), false, yb, true, false, dxb);
    });
    let mut dy = Tensor::zeros(x.batch() * n, m);
    let blocks: Vec<&mut [T]> = match n * m {
        0 => Vec::new(),
        size => dy.data_mut().chunks_mut(size).collect(),
    };
    for_each(blocks, work, |b, dyb| {
        let l = seq_len(x, b);
        gemm(
            (n, l, m),
            x.segment(b),
            true,
            dz.segment(b),
            false,
            false,
            dyb,
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
            (n, l, m),
            x.segment(b),
            true,
            y.segment(b),
            false,
            false,
            zb,
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
            (l, m, n),
            y.segment(b),
            false,
            dz_block(b),
            true,
            false,
            dxb,
        );
    });
    let mut dy = Jagged::zeros_like(y, m);
    for_each(dy.segments_mut(), work, |b, dyb| {
        let l = seq_len(x, b);
        gemm(
            (l, n, m),
            x.segment(b),
            false,
            dz_block(b),
            false,
            false,
            dyb,
        );
    });
    (dx, dy)
}
