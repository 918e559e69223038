//! The native backend: matrix products through `gemm`, everything else as plain Rust loops
//! that rayon splits into row blocks when a batch is big enough to pay for it.
//!
//! Why `gemm` (0.19, with its `x86-v4` feature): on the DLRM shapes it beats `matrixmultiply`
//! on every product but one small one, by 2-3x when K is tiny (the bottom MLP's K = 13), and
//! it picks AVX2+FMA or AVX-512 kernels at run time (`benches/matmul.rs` has the numbers).
//! Its `Parallelism::Rayon` runs inside the caller's rayon pool.

mod interaction;

use gemm::Parallelism;
use rayon::prelude::*;

use crate::backend::{Activation, DenseBackend};
use crate::error::check_shape;
use crate::real::Real;
use crate::tensor::Tensor;

/// Elementwise work (elements times per-element cost) below which an op stays on one thread:
/// a rayon fork/join costs a few microseconds, about what 32k simple element updates take.
const PAR_MIN_WORK: usize = 1 << 15;
/// Smallest piece of work handed to one rayon task.
const TASK_MIN_WORK: usize = 1 << 13;
/// `m * n * k` below which a product runs on one thread (`gemm`'s own cut-off is 48·48·256
/// per block, this keeps tiny products from touching the pool at all).
const PAR_GEMM_MIN_WORK: usize = 1 << 19;
/// Columns summed together by one task of the column-sum reduction.
const COL_BLOCK: usize = 64;
/// Row partitions of the column-sum reduction for narrow outputs; fixed so that the
/// summation order, hence the result, does not depend on scheduling.
const ROW_PARTS: usize = 16;

/// Rust kernels on the CPU. Runs inside the caller's current rayon pool; `threads` is how many
/// of its threads an op may use (the CLI's `--threads`).
#[derive(Clone, Debug)]
pub struct NativeBackend {
    threads: usize,
}

impl NativeBackend {
    /// `threads` is clamped to at least 1.
    pub fn new(threads: usize) -> Self {
        NativeBackend {
            threads: threads.max(1),
        }
    }

    /// How many threads of the current rayon pool one op may use (at least 1).
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn parallel(&self, work: usize) -> bool {
        self.threads > 1 && work >= PAR_MIN_WORK
    }

    /// Rows per task: about four tasks per thread for balance, but never tiny tasks.
    fn rows_per_task(&self, rows: usize, row_work: usize) -> usize {
        let by_threads = rows.div_ceil(self.threads * 4);
        let by_size = TASK_MIN_WORK.div_ceil(row_work.max(1));
        by_threads.max(by_size).max(1)
    }

    /// Calls `f(first_row, block)` on blocks of whole rows of `data` (`cols` per row), in
    /// parallel when `rows * cols * cost` is worth it.
    fn for_row_blocks<T: Real>(
        &self,
        data: &mut [T],
        cols: usize,
        cost: usize,
        f: impl Fn(usize, &mut [T]) + Sync + Send,
    ) {
        if cols == 0 || data.is_empty() {
            return;
        }
        let rows = data.len() / cols;
        if self.parallel(data.len() * cost) {
            let rb = self.rows_per_task(rows, cols * cost);
            data.par_chunks_mut(rb * cols)
                .enumerate()
                .for_each(|(i, blk)| f(i * rb, blk));
        } else {
            f(0, data);
        }
    }

    /// Like [`Self::for_row_blocks`] over two row-aligned buffers (`a_cols` and `b_cols` per
    /// row); `cost` is per row.
    #[allow(clippy::too_many_arguments)]
    fn for_row_blocks2<T: Real>(
        &self,
        rows: usize,
        a: &mut [T],
        a_cols: usize,
        b: &mut [T],
        b_cols: usize,
        cost: usize,
        f: impl Fn(usize, &mut [T], &mut [T]) + Sync + Send,
    ) {
        if rows == 0 {
            return;
        }
        if self.parallel(rows * cost) && a_cols > 0 && b_cols > 0 {
            let rb = self.rows_per_task(rows, cost);
            a.par_chunks_mut(rb * a_cols)
                .zip(b.par_chunks_mut(rb * b_cols))
                .enumerate()
                .for_each(|(i, (ab, bb))| f(i * rb, ab, bb));
        } else {
            f(0, a, b);
        }
    }

    /// `out[c] = Σ_r data[r, c]`. Deterministic for a given thread count.
    fn col_sums<T: Real>(&self, data: &[T], cols: usize, out: &mut [T]) {
        out.fill(T::ZERO);
        if cols == 0 || data.is_empty() {
            return;
        }
        if !self.parallel(data.len()) {
            for row in data.chunks_exact(cols) {
                add_into(out, row);
            }
        } else if cols >= COL_BLOCK * self.threads {
            // Wide: each task owns a block of columns and walks all rows.
            out.par_chunks_mut(COL_BLOCK)
                .enumerate()
                .for_each(|(bi, o)| {
                    let c0 = bi * COL_BLOCK;
                    for row in data.chunks_exact(cols) {
                        add_into(o, &row[c0..c0 + o.len()]);
                    }
                });
        } else {
            // Narrow: split rows into fixed partitions, sum each, then add the partials in order.
            let rows = data.len() / cols;
            let part_rows = rows.div_ceil(ROW_PARTS);
            for (bi, o) in out.chunks_mut(COL_BLOCK).enumerate() {
                let (c0, w) = (bi * COL_BLOCK, o.len());
                let mut parts = [[T::ZERO; COL_BLOCK]; ROW_PARTS];
                parts
                    .par_iter_mut()
                    .zip(data.par_chunks(part_rows * cols))
                    .for_each(|(acc, blk)| {
                        for row in blk.chunks_exact(cols) {
                            add_into(&mut acc[..w], &row[c0..c0 + w]);
                        }
                    });
                for p in &parts {
                    add_into(o, &p[..w]);
                }
            }
        }
    }

    /// `c = alpha * a * b + beta * c` on strided views; `c` is contiguous row-major
    /// `[a.rows, b.cols]` and is not read when `beta == 0`.
    fn gemm<T: Real>(&self, a: Operand<'_, T>, b: Operand<'_, T>, alpha: T, beta: T, c: &mut [T]) {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        // The raw-pointer call below relies on these: each view's buffer holds exactly
        // rows x cols elements (the Tensor invariant), and the shapes chain.
        let spans = |x: &Operand<'_, T>| x.rows.checked_mul(x.cols) == Some(x.data.len());
        assert!(
            spans(&a) && spans(&b) && b.rows == k && m.checked_mul(n) == Some(c.len()),
            "gemm: internal shape error"
        );
        if m == 0 || n == 0 {
            return;
        }
        let read_dst = beta != T::ZERO;
        if k == 0 {
            if read_dst {
                c.iter_mut().for_each(|v| *v *= beta);
            } else {
                c.fill(T::ZERO);
            }
            return;
        }
        let par = if self.threads > 1 && m.saturating_mul(n).saturating_mul(k) >= PAR_GEMM_MIN_WORK
        {
            Parallelism::Rayon(self.threads)
        } else {
            Parallelism::None
        };
        // SAFETY: every view spans exactly its buffer (asserted above; strides derived from
        // the shapes), `c` is an exclusive borrow of m*n elements with row stride n, and the
        // shared views cannot alias it. `T` is f32 or f64 (sealed `Real`), which gemm supports.
        // gemm's own convention is dst = alpha·dst + beta·lhs·rhs, hence the swapped scalars.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                read_dst,
                a.data.as_ptr(),
                a.cs,
                a.rs,
                b.data.as_ptr(),
                b.cs,
                b.rs,
                beta,
                alpha,
                false,
                false,
                false,
                par,
            );
        }
    }
}

/// A tensor, possibly transposed, as gemm sees it: shape and strides over the row-major buffer.
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
}

fn operand<T: Real>(t: &Tensor<T>, trans: bool) -> Operand<'_, T> {
    let ld = t.cols() as isize;
    if trans {
        Operand {
            data: t.data(),
            rows: t.cols(),
            cols: t.rows(),
            rs: 1,
            cs: ld,
        }
    } else {
        Operand {
            data: t.data(),
            rows: t.rows(),
            cols: t.cols(),
            rs: ld,
            cs: 1,
        }
    }
}

#[inline(always)]
fn add_into<T: Real>(acc: &mut [T], x: &[T]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

#[inline(always)]
fn sigmoid<T: Real>(z: T) -> T {
    T::ONE / (T::ONE + (-z).exp())
}

/// `row += b` then the activation, over every row of `blk`.
fn bias_act<T: Real>(blk: &mut [T], b: &[T], act: Activation) {
    let rows = blk.chunks_exact_mut(b.len());
    match act {
        Activation::None => rows.for_each(|row| add_into(row, b)),
        Activation::Relu => rows.for_each(|row| {
            for (v, &bb) in row.iter_mut().zip(b) {
                let z = *v + bb;
                // `z < 0` rather than `max`, so a NaN propagates like torch's relu.
                *v = if z < T::ZERO { T::ZERO } else { z };
            }
        }),
        Activation::Sigmoid => rows.for_each(|row| {
            for (v, &bb) in row.iter_mut().zip(b) {
                *v = sigmoid(*v + bb);
            }
        }),
    }
}

impl<T: Real> DenseBackend<T> for NativeBackend {
    fn name(&self) -> &'static str {
        "native"
    }

    fn matmul(
        &self,
        a: &Tensor<T>,
        trans_a: bool,
        b: &Tensor<T>,
        trans_b: bool,
        alpha: T,
        beta: T,
        c: &mut Tensor<T>,
    ) {
        let (oa, ob) = (operand(a, trans_a), operand(b, trans_b));
        check_shape(oa.cols == ob.rows, "matmul", || {
            format!(
                "op(a) = a{}{} does not chain with op(b) = b{}{}",
                a.dims(),
                if trans_a { "ᵀ" } else { "" },
                b.dims(),
                if trans_b { "ᵀ" } else { "" }
            )
        });
        if beta == T::ZERO {
            c.resize(oa.rows, ob.cols);
        } else {
            check_shape(c.shape() == (oa.rows, ob.cols), "matmul", || {
                format!(
                    "c is {} but the product is [{}, {}] (beta != 0, so c is read)",
                    c.dims(),
                    oa.rows,
                    ob.cols
                )
            });
        }
        self.gemm(oa, ob, alpha, beta, c.data_mut());
    }

    fn linear_forward(
        &self,
        x: &Tensor<T>,
        w: &Tensor<T>,
        b: &[T],
        act: Activation,
        y: &mut Tensor<T>,
    ) {
        check_shape(
            x.cols() == w.cols() && b.len() == w.rows(),
            "linear_forward",
            || format!("x {}, weight {}, bias [{}]", x.dims(), w.dims(), b.len()),
        );
        let out = w.rows();
        y.resize(x.rows(), out);
        self.gemm(
            operand(x, false),
            operand(w, true),
            T::ONE,
            T::ZERO,
            y.data_mut(),
        );
        let cost = if act == Activation::Sigmoid { 16 } else { 1 };
        self.for_row_blocks(y.data_mut(), out, cost, |_, blk| bias_act(blk, b, act));
    }

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
    ) {
        let (n, out) = (x.rows(), w.rows());
        check_shape(
            x.cols() == w.cols()
                && y.shape() == (n, out)
                && dy.shape() == (n, out)
                && db.len() == out,
            "linear_backward",
            || {
                format!(
                    "x {}, weight {}, y {}, dy {}, db [{}]",
                    x.dims(),
                    w.dims(),
                    y.dims(),
                    dy.dims(),
                    db.len()
                )
            },
        );
        let yd = y.data();
        match act {
            Activation::None => {}
            Activation::Relu => self.for_row_blocks(dy.data_mut(), out, 1, |r0, blk| {
                let ys = &yd[r0 * out..r0 * out + blk.len()];
                for (g, &yv) in blk.iter_mut().zip(ys) {
                    *g = if yv > T::ZERO { *g } else { T::ZERO };
                }
            }),
            Activation::Sigmoid => self.for_row_blocks(dy.data_mut(), out, 1, |r0, blk| {
                let ys = &yd[r0 * out..r0 * out + blk.len()];
                for (g, &yv) in blk.iter_mut().zip(ys) {
                    *g = *g * yv * (T::ONE - yv);
                }
            }),
        }
        self.col_sums(dy.data(), out, db);
        dw.resize(out, x.cols());
        self.gemm(
            operand(dy, true),
            operand(x, false),
            T::ONE,
            T::ZERO,
            dw.data_mut(),
        );
        if let Some(dx) = dx {
            dx.resize(n, x.cols());
            self.gemm(
                operand(dy, false),
                operand(w, false),
                T::ONE,
                T::ZERO,
                dx.data_mut(),
            );
        }
    }

    fn dot_interaction_forward(&self, dense: &Tensor<T>, sparse: &Tensor<T>, out: &mut Tensor<T>) {
        let (n, d) = dense.shape();
        check_shape(
            d > 0 && sparse.rows() == n && sparse.cols().is_multiple_of(d),
            "dot_interaction_forward",
            || {
                format!(
                    "dense {} and sparse {} (want [n, F * D] with D = dense cols > 0)",
                    dense.dims(),
                    sparse.dims()
                )
            },
        );
        let nv = sparse.cols() / d + 1;
        let out_cols = d + nv * (nv - 1) / 2;
        out.resize(n, out_cols);
        self.for_row_blocks(out.data_mut(), out_cols, d, |r0, blk| {
            interaction::forward_rows(dense, sparse, r0, blk);
        });
    }

    fn dot_interaction_backward(
        &self,
        dense: &Tensor<T>,
        sparse: &Tensor<T>,
        dout: &Tensor<T>,
        ddense: &mut Tensor<T>,
        dsparse: &mut Tensor<T>,
    ) {
        let (n, d) = dense.shape();
        let ok = d > 0 && sparse.rows() == n && sparse.cols().is_multiple_of(d);
        let nv = if ok { sparse.cols() / d + 1 } else { 0 };
        check_shape(
            ok && dout.shape() == (n, d + nv * (nv - 1) / 2),
            "dot_interaction_backward",
            || {
                format!(
                    "dense {}, sparse {}, dout {}",
                    dense.dims(),
                    sparse.dims(),
                    dout.dims()
                )
            },
        );
        ddense.resize(n, d);
        dsparse.resize(n, sparse.cols());
        let sc = sparse.cols();
        self.for_row_blocks2(
            n,
            ddense.data_mut(),
            d,
            dsparse.data_mut(),
            sc,
            nv * nv * d,
            |r0, dd, ds| interaction::backward_rows(dense, sparse, dout, r0, dd, ds),
        );
    }

    fn cross_combine_forward(
        &self,
        x0: &Tensor<T>,
        h: &Tensor<T>,
        b: &[T],
        xl: &Tensor<T>,
        out: &mut Tensor<T>,
    ) {
        let cols = x0.cols();
        check_shape(
            h.shape() == x0.shape() && xl.shape() == x0.shape() && b.len() == cols,
            "cross_combine_forward",
            || {
                format!(
                    "x0 {}, h {}, bias [{}], xl {}",
                    x0.dims(),
                    h.dims(),
                    b.len(),
                    xl.dims()
                )
            },
        );
        out.resize(x0.rows(), cols);
        self.for_row_blocks(out.data_mut(), cols, 1, |r0, blk| {
            for (i, o) in blk.chunks_exact_mut(cols).enumerate() {
                let r = r0 + i;
                let (x0r, hr, xlr) = (x0.row(r), h.row(r), xl.row(r));
                for c in 0..cols {
                    o[c] = x0r[c] * (hr[c] + b[c]) + xlr[c];
                }
            }
        });
    }

    fn cross_combine_backward(
        &self,
        x0: &Tensor<T>,
        h: &Tensor<T>,
        b: &[T],
        dout: &Tensor<T>,
        dh: &mut Tensor<T>,
        db: &mut [T],
        dx0: &mut Tensor<T>,
    ) {
        let (n, cols) = x0.shape();
        check_shape(
            h.shape() == (n, cols)
                && dout.shape() == (n, cols)
                && dx0.shape() == (n, cols)
                && b.len() == cols
                && db.len() == cols,
            "cross_combine_backward",
            || {
                format!(
                    "x0 {}, h {}, bias [{}], dout {}, db [{}], dx0 {}",
                    x0.dims(),
                    h.dims(),
                    b.len(),
                    dout.dims(),
                    db.len(),
                    dx0.dims()
                )
            },
        );
        dh.resize(n, cols);
        self.for_row_blocks2(
            n,
            dh.data_mut(),
            cols,
            dx0.data_mut(),
            cols,
            cols,
            |r0, dhb, dxb| {
                for (i, (dhr, dxr)) in dhb
                    .chunks_exact_mut(cols)
                    .zip(dxb.chunks_exact_mut(cols))
                    .enumerate()
                {
                    let r = r0 + i;
                    let (x0r, hr, gr) = (x0.row(r), h.row(r), dout.row(r));
                    for c in 0..cols {
                        dhr[c] = gr[c] * x0r[c];
                        dxr[c] += gr[c] * (hr[c] + b[c]);
                    }
                }
            },
        );
        self.col_sums(dh.data(), cols, db);
    }

    fn add_assign(&self, y: &mut Tensor<T>, x: &Tensor<T>) {
        check_shape(y.shape() == x.shape(), "add_assign", || {
            format!("y {} and x {}", y.dims(), x.dims())
        });
        let cols = y.cols();
        let xd = x.data();
        self.for_row_blocks(y.data_mut(), cols, 1, |r0, blk| {
            add_into(blk, &xd[r0 * cols..r0 * cols + blk.len()]);
        });
    }

    fn bce_with_logits(&self, logits: &[T], labels: &[T], dlogits: &mut Tensor<T>, loss: &mut T) {
        dlogits.resize(logits.len(), 1);
        *loss = bce_with_logits(logits, labels, dlogits.data_mut());
    }

    fn copy(&self, dst: &mut Tensor<T>, src: &Tensor<T>) {
        dst.copy_from(src);
    }

    fn zeros(&self, t: &mut Tensor<T>, rows: usize, cols: usize) {
        t.resize(rows, cols);
        t.fill(T::ZERO);
    }

    fn concat_columns(&self, a: &Tensor<T>, b: &Tensor<T>, out: &mut Tensor<T>) {
        check_shape(a.rows() == b.rows(), "concat_columns", || {
            format!("a {} and b {} differ in rows", a.dims(), b.dims())
        });
        out.concat_columns_of(a, b);
    }

    fn split_columns(&self, x: &Tensor<T>, cols_a: usize, a: &mut Tensor<T>, b: &mut Tensor<T>) {
        check_shape(cols_a <= x.cols(), "split_columns", || {
            format!("{cols_a} columns of x {}", x.dims())
        });
        x.split_columns_into(cols_a, a, b);
    }
}

/// Mean BCE with logits; writes the gradient.
fn bce_with_logits<T: Real>(logits: &[T], labels: &[T], dlogits: &mut [T]) -> T {
    check_shape(
        logits.len() == labels.len() && dlogits.len() == logits.len(),
        "bce_with_logits",
        || {
            format!(
                "logits [{}], labels [{}], dlogits [{}]",
                logits.len(),
                labels.len(),
                dlogits.len()
            )
        },
    );
    let n = logits.len();
    if n == 0 {
        return T::ZERO;
    }
    let inv_n = T::from_f64(1.0 / n as f64);
    let mut sum = 0.0f64;
    for ((&z, &y), g) in logits.iter().zip(labels).zip(dlogits.iter_mut()) {
        // loss = max(z, 0) - z·y + ln(1 + e^{-|z|}); e^{-|z|} never overflows.
        let e = (-z.abs()).exp();
        sum += (z.max(T::ZERO) - z * y + e.ln_1p()).to_f64();
        let p = if z >= T::ZERO {
            T::ONE / (T::ONE + e)
        } else {
            e / (T::ONE + e)
        };
        *g = (p - y) * inv_n;
    }
    T::from_f64(sum / n as f64)
}
