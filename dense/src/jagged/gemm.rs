//! One small matrix product on strided views of row-major buffers: what the
//! jagged operators run per sample (and per head), one thread each.

use gemm::Parallelism;

use crate::real::Real;

/// A matrix in a buffer: element `(i, j)` at `i * rs + j * cs`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl<'a, T> View<'a, T> {
    /// Row-major `rows x cols`, contiguous.
    pub(crate) fn rows(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// Columns `first..first + cols` of row-major rows `width` wide.
    pub(crate) fn columns(data: &'a [T], width: usize, first: usize, cols: usize) -> Self {
        let rows = data.len() / width.max(1);
        Self {
            data: &data[first.min(data.len())..],
            rows,
            cols,
            rs: width,
            cs: 1,
        }
    }

    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element lies in the buffer.
    fn spans(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }
}

/// `c = a · b` (plus `c` when `accumulate`); `c` is `a.rows x b.cols` at
/// `(i, j) = c_data[i * c_rs + j]`.
pub(crate) fn gemm<T: Real>(
    a: View<'_, T>,
    b: View<'_, T>,
    c: &mut [T],
    c_rs: usize,
    accumulate: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let c_spans = m == 0 || n == 0 || (m - 1) * c_rs + n <= c.len();
    assert!(
        b.rows == k && a.spans() && b.spans() && c_spans && (m <= 1 || c_rs >= n),
        "jagged gemm: internal shape error"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.chunks_mut(c_rs.max(1))
                .take(m)
                .for_each(|r| r[..n].fill(T::ZERO));
        }
        return;
    }
    // SAFETY: every element of each view and of `c` lies in its buffer
    // (checked above); `c` is an exclusive borrow whose rows do not overlap
    // (c_rs >= n), and the shared views cannot alias it. `T` is f32 or f64
    // (sealed `Real`), which gemm supports. gemm computes
    // dst = alpha·dst + beta·lhs·rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            c_rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}
