//! Kernels of the dot interaction, per block of samples.
//!
//! The work per sample is small (27 vectors of 16 for Criteo), so it is dominated by loop
//! overhead unless the vector length is a compile-time constant: the common DLRM embedding
//! dims (powers of two, 8 to 128) get kernels with fixed-size arrays that unroll into
//! registers, and other dims a generic loop. On x86-64 the kernels are also compiled for
//! AVX2 and picked at run time, as the crate itself targets baseline x86-64 (SSE2).

use crate::real::Real;
use crate::tensor::Tensor;

/// Writes the interaction of samples `r0..` into `out`, a block of whole output rows.
pub(super) fn forward_rows<T: Real>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    r0: usize,
    out: &mut [T],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, the only feature the wrapper is compiled for.
        return unsafe { forward_rows_avx2(dense, sparse, r0, out) };
    }
    forward_rows_any(dense, sparse, r0, out)
}

/// Writes the gradients of samples `r0..` into blocks of whole rows of `ddense` and `dsparse`.
pub(super) fn backward_rows<T: Real>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    dout: &Tensor<T>,
    r0: usize,
    ddense: &mut [T],
    dsparse: &mut [T],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: as in `forward_rows`.
        return unsafe { backward_rows_avx2(dense, sparse, dout, r0, ddense, dsparse) };
    }
    backward_rows_any(dense, sparse, dout, r0, ddense, dsparse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn forward_rows_avx2<T: Real>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    r0: usize,
    out: &mut [T],
) {
    forward_rows_any(dense, sparse, r0, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn backward_rows_avx2<T: Real>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    dout: &Tensor<T>,
    r0: usize,
    ddense: &mut [T],
    dsparse: &mut [T],
) {
    backward_rows_any(dense, sparse, dout, r0, ddense, dsparse)
}

#[inline(always)]
fn forward_rows_any<T: Real>(dense: &Tensor<T>, sparse: &Tensor<T>, r0: usize, out: &mut [T]) {
    match dense.cols() {
        8 => forward_fixed::<T, 8>(dense, sparse, r0, out),
        16 => forward_fixed::<T, 16>(dense, sparse, r0, out),
        32 => forward_fixed::<T, 32>(dense, sparse, r0, out),
        64 => forward_fixed::<T, 64>(dense, sparse, r0, out),
        128 => forward_fixed::<T, 128>(dense, sparse, r0, out),
        _ => forward_dyn(dense, sparse, r0, out),
    }
}

#[inline(always)]
fn backward_rows_any<T: Real>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    dout: &Tensor<T>,
    r0: usize,
    ddense: &mut [T],
    dsparse: &mut [T],
) {
    let d = dense.cols();
    if sparse.cols() == 0 {
        // No pairs: the output is the dense vector itself.
        for (i, dd) in ddense.chunks_exact_mut(d).enumerate() {
            dd.copy_from_slice(&dout.row(r0 + i)[..d]);
        }
        return;
    }
    match d {
        8 => backward_fixed::<T, 8>(dense, sparse, dout, r0, ddense, dsparse),
        16 => backward_fixed::<T, 16>(dense, sparse, dout, r0, ddense, dsparse),
        32 => backward_fixed::<T, 32>(dense, sparse, dout, r0, ddense, dsparse),
        64 => backward_fixed::<T, 64>(dense, sparse, dout, r0, ddense, dsparse),
        128 => backward_fixed::<T, 128>(dense, sparse, dout, r0, ddense, dsparse),
        _ => backward_dyn(dense, sparse, dout, r0, ddense, dsparse),
    }
}

/// Dot product of two power-of-two-length arrays, summed as a balanced tree (vectorizes
/// without reassociating, so results do not depend on the instruction set).
#[inline(always)]
fn dot_fixed<T: Real, const D: usize>(a: &[T; D], b: &[T; D]) -> T {
    let mut p = [T::ZERO; D];
    for l in 0..D {
        p[l] = a[l] * b[l];
    }
    let mut w = D;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            p[l] += p[l + w];
        }
    }
    p[0]
}

#[inline(always)]
fn axpy_fixed<T: Real, const D: usize>(acc: &mut [T; D], a: T, x: &[T; D]) {
    for l in 0..D {
        acc[l] += a * x[l];
    }
}

#[inline(always)]
fn forward_fixed<T: Real, const D: usize>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    r0: usize,
    out: &mut [T],
) {
    let f = sparse.cols() / D;
    let out_cols = D + f * (f + 1) / 2;
    for (i, o) in out.chunks_exact_mut(out_cols).enumerate() {
        let r = r0 + i;
        let dv: &[T; D] = dense.row(r).try_into().expect("dense row of D");
        let (sv, _) = sparse.row(r).as_chunks::<D>();
        let (head, mut rest) = o.split_at_mut(D);
        head.copy_from_slice(dv);
        // Pairs in row-major order: (dense, sparse_j) for all j, then (sparse_i, sparse_j), i < j.
        for (vi_idx, vi) in std::iter::once(dv).chain(sv).enumerate() {
            let partners = &sv[vi_idx..];
            let (now, later) = rest.split_at_mut(partners.len());
            for (slot, vj) in now.iter_mut().zip(partners) {
                *slot = dot_fixed(vi, vj);
            }
            rest = later;
        }
    }
}

#[inline(always)]
fn backward_fixed<T: Real, const D: usize>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    dout: &Tensor<T>,
    r0: usize,
    ddense: &mut [T],
    dsparse: &mut [T],
) {
    let f = sparse.cols() / D;
    let nv = f + 1;
    for (i, (ddr, dsr)) in ddense
        .chunks_exact_mut(D)
        .zip(dsparse.chunks_exact_mut(f * D))
        .enumerate()
    {
        let r = r0 + i;
        let dv: &[T; D] = dense.row(r).try_into().expect("dense row of D");
        let (sv, _) = sparse.row(r).as_chunks::<D>();
        let (dsv, _) = dsr.as_chunks_mut::<D>();
        let gout = dout.row(r);
        let g = &gout[D..];
        let vector = |j: usize| if j == 0 { dv } else { &sv[j - 1] };
        // d combined_i = Σ_{j≠i} g(i,j) combined_j, g(i,j) at pair_index(nv, i, j).
        for vi in 0..nv {
            let mut acc = [T::ZERO; D];
            if vi == 0 {
                acc.copy_from_slice(&gout[..D]);
            }
            // Partners before vi: pairs (j, vi).
            for j in 0..vi {
                axpy_fixed(&mut acc, g[pair_index(nv, j, vi)], vector(j));
            }
            // Partners after vi: pairs (vi, j) are contiguous.
            let base = pair_index(nv, vi, vi + 1);
            for (&gij, vj) in g[base..base + (nv - 1 - vi)].iter().zip(&sv[vi..]) {
                axpy_fixed(&mut acc, gij, vj);
            }
            if vi == 0 {
                ddr.copy_from_slice(&acc);
            } else {
                dsv[vi - 1] = acc;
            }
        }
    }
}

/// `y += alpha * x`.
#[inline(always)]
fn axpy<T: Real>(y: &mut [T], alpha: T, x: &[T]) {
    for (a, &v) in y.iter_mut().zip(x) {
        *a += alpha * v;
    }
}

/// Dot product with eight independent accumulators, so the compiler can vectorize it.
#[inline(always)]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let mut tail = T::ZERO;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += *x * *y;
    }
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Index of pair `(i, j)`, `i < j`, among the strict upper triangle of an `nv x nv` matrix in
/// row-major order.
#[inline(always)]
fn pair_index(nv: usize, i: usize, j: usize) -> usize {
    i * nv - i * (i + 1) / 2 + (j - i - 1)
}

/// Any dim: one sample at a time.
#[inline(always)]
fn forward_dyn<T: Real>(dense: &Tensor<T>, sparse: &Tensor<T>, r0: usize, out: &mut [T]) {
    let d = dense.cols();
    let nv = sparse.cols() / d + 1;
    let out_cols = d + nv * (nv - 1) / 2;
    for (i, o) in out.chunks_exact_mut(out_cols).enumerate() {
        interact_row(dense.row(r0 + i), sparse.row(r0 + i), d, o);
    }
}

#[inline(always)]
fn backward_dyn<T: Real>(
    dense: &Tensor<T>,
    sparse: &Tensor<T>,
    dout: &Tensor<T>,
    r0: usize,
    ddense: &mut [T],
    dsparse: &mut [T],
) {
    let (d, sc) = (dense.cols(), sparse.cols());
    for (i, (ddr, dsr)) in ddense
        .chunks_exact_mut(d)
        .zip(dsparse.chunks_exact_mut(sc))
        .enumerate()
    {
        let r = r0 + i;
        interact_row_backward(dense.row(r), sparse.row(r), dout.row(r), d, ddr, dsr);
    }
}

#[inline(always)]
fn interact_row<T: Real>(dense: &[T], sparse: &[T], d: usize, out: &mut [T]) {
    out[..d].copy_from_slice(dense);
    let nv = sparse.len() / d + 1;
    let mut k = d;
    for i in 0..nv {
        let vi = if i == 0 {
            dense
        } else {
            &sparse[(i - 1) * d..i * d]
        };
        // Partners j = i+1.. are all sparse vectors, contiguous from sparse vector i.
        let cnt = nv - 1 - i;
        for (o, vj) in out[k..k + cnt]
            .iter_mut()
            .zip(sparse[i * d..].chunks_exact(d))
        {
            *o = dot(vi, vj);
        }
        k += cnt;
    }
}

#[inline(always)]
fn interact_row_backward<T: Real>(
    dense: &[T],
    sparse: &[T],
    dout: &[T],
    d: usize,
    ddense: &mut [T],
    dsparse: &mut [T],
) {
    let nv = sparse.len() / d + 1;
    let g = &dout[d..];
    // d combined_i = Σ_{j≠i} g(i,j) combined_j; the dense vector also gets its pass-through.
    ddense.copy_from_slice(&dout[..d]);
    for (jj, cj) in sparse.chunks_exact(d).enumerate() {
        axpy(ddense, g[pair_index(nv, 0, jj + 1)], cj);
    }
    for (ii, dsi) in dsparse.chunks_exact_mut(d).enumerate() {
        let i = ii + 1;
        let g0i = g[pair_index(nv, 0, i)];
        for (o, &x) in dsi.iter_mut().zip(dense) {
            *o = g0i * x;
        }
        for (jj, cj) in sparse.chunks_exact(d).enumerate() {
            let j = jj + 1;
            if j != i {
                axpy(dsi, g[pair_index(nv, i.min(j), i.max(j))], cj);
            }
        }
    }
}
