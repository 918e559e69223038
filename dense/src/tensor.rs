//! A row-major 2-D tensor that owns its buffer.

use crate::error::DenseError;
use crate::real::Real;

/// A dense row-major matrix `[rows, cols]`: element `[r, c]` is `data[r * cols + c]`, and
/// `data.len() == rows * cols` always holds. For activations, rows are samples of the batch.
///
/// Layers keep their activations and gradients in `Tensor`s and [`Tensor::resize`] them each
/// step, so after the first step of a given batch size none of these buffers is reallocated
/// (the gemm crate still allocates its own packing buffers inside each product).
///
/// ```
/// use ember_dense::Tensor;
///
/// let t = Tensor::from_vec(2, 3, vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
/// assert_eq!((t.rows(), t.cols()), (2, 3));
/// assert_eq!(t.shape(), (2, 3));
/// assert_eq!(t.row(1), &[4.0, 5.0, 6.0]);
/// let (r, c) = (1, 2);
/// assert_eq!(t.data()[r * t.cols() + c], 6.0); // row-major
///
/// // The length must match the shape.
/// assert!(Tensor::<f32>::from_vec(2, 3, vec![0.0; 5]).is_err());
///
/// let z = Tensor::<f64>::zeros(4, 2);
/// assert_eq!(z.len(), 8);
/// assert!(z.data().iter().all(|&v| v == 0.0));
/// ```
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Tensor<T> {
    rows: usize,
    cols: usize,
    data: Vec<T>,
}

/// `rows * cols`, refusing a product that overflows (the shape invariant
/// `data.len() == rows * cols` is what the unsafe gemm calls rely on).
fn element_count(rows: usize, cols: usize) -> usize {
    rows.checked_mul(cols)
        .unwrap_or_else(|| panic!("tensor shape [{rows}, {cols}] overflows usize"))
}

impl<T: Real> Tensor<T> {
    /// A `[rows, cols]` tensor of zeros (torch `zeros`).
    ///
    /// # Panics
    /// When `rows * cols` overflows `usize`.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Tensor {
            rows,
            cols,
            data: vec![T::ZERO; element_count(rows, cols)],
        }
    }

    /// Wraps `data` (row-major); fails when its length is not `rows * cols`.
    pub fn from_vec(rows: usize, cols: usize, data: Vec<T>) -> Result<Self, DenseError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(DenseError::DataLength {
                op: "Tensor::from_vec",
                rows,
                cols,
                len: data.len(),
            });
        }
        Ok(Tensor { rows, cols, data })
    }

    /// A `[rows, cols]` tensor whose entries are `f(row, col)`, called in row-major order.
    pub fn from_fn(rows: usize, cols: usize, mut f: impl FnMut(usize, usize) -> T) -> Self {
        let mut data = Vec::with_capacity(element_count(rows, cols));
        for r in 0..rows {
            for c in 0..cols {
                data.push(f(r, c));
            }
        }
        Tensor { rows, cols, data }
    }

    /// Number of rows (the first dimension; the batch size for activations).
    #[inline]
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (elements per row).
    #[inline]
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `(rows, cols)`.
    #[inline]
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Number of elements, `rows * cols`.
    #[inline]
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether there are no elements (`rows == 0` or `cols == 0`).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Every element, row-major: `[r, c]` is at `r * cols + c`.
    #[inline]
    pub fn data(&self) -> &[T] {
        &self.data
    }

    /// Every element, row-major, mutable. The shape stays; use [`Tensor::resize`] to change it.
    #[inline]
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }

    /// Gives the buffer back (row-major).
    pub fn into_vec(self) -> Vec<T> {
        self.data
    }

    /// Row `i`: `cols` elements.
    ///
    /// # Panics
    /// When `i >= rows` (and `cols > 0`).
    #[inline]
    pub fn row(&self, i: usize) -> &[T] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Row `i`, mutable.
    ///
    /// # Panics
    /// When `i >= rows` (and `cols > 0`).
    #[inline]
    pub fn row_mut(&mut self, i: usize) -> &mut [T] {
        &mut self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Reshapes to `[rows, cols]`, reusing the allocation when it is large enough. The contents
    /// are unspecified afterwards (but initialized): callers overwrite them.
    pub fn resize(&mut self, rows: usize, cols: usize) {
        self.rows = rows;
        self.cols = cols;
        self.data.resize(element_count(rows, cols), T::ZERO);
    }

    /// Sets every element to `v`.
    pub fn fill(&mut self, v: T) {
        self.data.fill(v);
    }

    /// Becomes a copy of `src` (shape and values), reusing the allocation.
    pub fn copy_from(&mut self, src: &Tensor<T>) {
        self.resize(src.rows, src.cols);
        self.data.copy_from_slice(&src.data);
    }

    /// Becomes `[a, b]` side by side (`a` and `b` have the same rows).
    pub fn concat_columns_of(&mut self, a: &Tensor<T>, b: &Tensor<T>) {
        let ca = a.cols;
        self.resize(a.rows, ca + b.cols);
        for r in 0..a.rows {
            let row = self.row_mut(r);
            row[..ca].copy_from_slice(a.row(r));
            row[ca..].copy_from_slice(b.row(r));
        }
    }

    /// Inverse of [`Tensor::concat_columns_of`]: the first `cols_a` columns go to `a`, the rest
    /// to `b`.
    pub fn split_columns_into(&self, cols_a: usize, a: &mut Tensor<T>, b: &mut Tensor<T>) {
        a.resize(self.rows, cols_a);
        b.resize(self.rows, self.cols - cols_a);
        for r in 0..self.rows {
            let row = self.row(r);
            a.row_mut(r).copy_from_slice(&row[..cols_a]);
            b.row_mut(r).copy_from_slice(&row[cols_a..]);
        }
    }

    /// Converts every element (through `f64`).
    pub fn cast<U: Real>(&self) -> Tensor<U> {
        Tensor {
            rows: self.rows,
            cols: self.cols,
            data: self.data.iter().map(|v| U::from_f64(v.to_f64())).collect(),
        }
    }

    /// `[rows, cols]` as text, for error messages.
    pub(crate) fn dims(&self) -> String {
        format!("[{}, {}]", self.rows, self.cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_vec_checks_length() {
        assert!(Tensor::<f32>::from_vec(2, 3, vec![0.0; 6]).is_ok());
        let err = Tensor::<f32>::from_vec(2, 3, vec![0.0; 5]).unwrap_err();
        assert!(err.to_string().contains("[2, 3]"), "{err}");
    }

    #[test]
    fn rows_and_resize() {
        let mut t = Tensor::from_vec(2, 2, vec![1.0f64, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(t.row(1), &[3.0, 4.0]);
        t.row_mut(0)[1] = 9.0;
        assert_eq!(t.data(), &[1.0, 9.0, 3.0, 4.0]);
        let cap = t.data.capacity();
        t.resize(1, 3);
        assert_eq!(t.shape(), (1, 3));
        assert_eq!(t.len(), 3);
        assert_eq!(t.data.capacity(), cap);
        t.resize(3, 3);
        assert_eq!(t.len(), 9);
    }

    #[test]
    fn cast_round_trips() {
        let t = Tensor::from_fn(3, 2, |r, c| (r * 2 + c) as f32 * 0.5);
        let d: Tensor<f64> = t.cast();
        assert_eq!(d.row(2), &[2.0, 2.5]);
        assert_eq!(d.cast::<f32>(), t);
    }
}
