//! Jagged tensors of floats and the operators sequence models need on them,
//! forward and backward: a batch of sequences of different lengths stored
//! without padding, as FBGEMM's jagged tensor ops and TorchRec's
//! `JaggedTensor` (values `[total_len, dim]`, offsets `[batch + 1]`).
//!
//! - [`Jagged`]: the tensor; [`complete_cumsum`] turns lengths into offsets
//!   (FBGEMM's `asynchronous_complete_cumsum`).
//! - [`to_padded`] / [`from_padded`]: to a padded dense `[batch * max_len,
//!   dim]` and back (FBGEMM's `jagged_to_padded_dense` and
//!   `dense_to_jagged`); each is the other's backward.
//! - [`concat()`] / [`split`]: sequences joined or cut per sample (a history
//!   and its candidates); each is the other's backward.
//! - [`softmax`] and [`softmax_backward`]: a softmax over each sequence, per
//!   column (FBGEMM's `jagged_softmax`).
//! - [`jagged_dense_bmm`] and [`jagged_jagged_bmm`] with their backwards:
//!   per-sample matrix products (FBGEMM's ops of the same names).
//!
//! Every operator works on real rows only: time and memory go with the
//! tokens, not with the longest sequence. The padded references they are
//! tested against live in the tests.

mod bmm;
pub(crate) mod gemm;
mod softmax;

pub use bmm::{
    jagged_dense_bmm, jagged_dense_bmm_backward, jagged_jagged_bmm, jagged_jagged_bmm_backward,
};
pub use softmax::{softmax, softmax_backward};

use rayon::prelude::*;

use crate::error::DenseError;
use crate::real::Real;
use crate::tensor::Tensor;

/// A batch of sequences of rows: sequence `b` is rows
/// `offsets[b]..offsets[b + 1]` of `values` (`[total_len, dim]`). `offsets` starts at 0, never
/// decreases and ends at `values.rows()`.
#[derive(Clone, Debug, PartialEq)]
pub struct Jagged<T> {
    values: Tensor<T>,
    offsets: Vec<usize>,
}

impl<T: Real> Default for Jagged<T> {
    /// No sequences.
    fn default() -> Self {
        Self {
            values: Tensor::zeros(0, 0),
            offsets: vec![0],
        }
    }
}

/// The offsets of `lengths`: `[0, l0, l0 + l1, ...]`, one more than the
/// lengths (FBGEMM's `asynchronous_complete_cumsum`).
pub fn complete_cumsum(lengths: &[usize]) -> Vec<usize> {
    let mut offsets = Vec::with_capacity(lengths.len() + 1);
    offsets.push(0);
    let mut total = 0usize;
    for &l in lengths {
        total += l;
        offsets.push(total);
    }
    offsets
}

impl<T: Real> Jagged<T> {
    /// Sequences of `values`' rows by `offsets`; an error when the offsets
    /// do not start at 0, decrease, or end elsewhere than `values.rows()`.
    pub fn new(values: Tensor<T>, offsets: Vec<usize>) -> Result<Self, DenseError> {
        let ok = offsets.first() == Some(&0)
            && offsets.windows(2).all(|w| w[0] <= w[1])
            && offsets.last() == Some(&values.rows());
        if !ok {
            return Err(DenseError::ShapeMismatch {
                op: "Jagged::new",
                detail: format!(
                    "offsets must start at 0, never decrease and end at the values' {} rows",
                    values.rows()
                ),
            });
        }
        Ok(Self { values, offsets })
    }

    /// Sequences of `values`' rows of `lengths`.
    pub fn from_lengths(values: Tensor<T>, lengths: &[usize]) -> Result<Self, DenseError> {
        Self::new(values, complete_cumsum(lengths))
    }

    /// `lengths`' sequences of zeros of `dim` columns.
    pub fn zeros(lengths: &[usize], dim: usize) -> Self {
        let offsets = complete_cumsum(lengths);
        let total = offsets[lengths.len()];
        Self {
            values: Tensor::zeros(total, dim),
            offsets,
        }
    }

    /// Zeros in the shape of `like`, with `dim` columns.
    pub fn zeros_like(like: &Jagged<T>, dim: usize) -> Self {
        Self {
            values: Tensor::zeros(like.total_len(), dim),
            offsets: like.offsets.clone(),
        }
    }

    /// The rows, `[total_len, dim]`.
    pub fn values(&self) -> &Tensor<T> {
        &self.values
    }

    /// The rows, writable (the offsets stay).
    pub fn values_mut(&mut self) -> &mut Tensor<T> {
        &mut self.values
    }

    /// The offsets, `batch + 1` of them.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// Each sequence's length.
    pub fn lengths(&self) -> Vec<usize> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// The number of sequences.
    pub fn batch(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Columns of every row.
    pub fn dim(&self) -> usize {
        self.values.cols()
    }

    /// Rows of all sequences together.
    pub fn total_len(&self) -> usize {
        self.values.rows()
    }

    /// The longest sequence's length (0 for an empty batch).
    pub fn max_len(&self) -> usize {
        self.offsets
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
    }

    /// Sequence `b`'s rows, row-major.
    pub fn segment(&self, b: usize) -> &[T] {
        let d = self.dim();
        &self.values.data()[self.offsets[b] * d..self.offsets[b + 1] * d]
    }

    /// Each sequence's rows, writable, in order.
    pub fn segments_mut(&mut self) -> Vec<&mut [T]> {
        let dim = self.values.cols();
        split_by_offsets(self.values.data_mut(), &self.offsets, dim)
    }

    /// The values and offsets.
    pub fn into_parts(self) -> (Tensor<T>, Vec<usize>) {
        (self.values, self.offsets)
    }
}

/// `data`'s rows of `dim` cut at `offsets`.
pub(crate) fn split_by_offsets<'a, T>(
    mut data: &'a mut [T],
    offsets: &[usize],
    dim: usize,
) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (head, rest) = data.split_at_mut((w[1] - w[0]) * dim);
        out.push(head);
        data = rest;
    }
    out
}

/// Panics with the op's name when `ok` is false (a programming error, as
/// every dense op).
fn check(ok: bool, op: &'static str, detail: impl FnOnce() -> String) {
    if !ok {
        let detail = detail();
        panic!("{}", DenseError::ShapeMismatch { op, detail });
    }
}

/// Whether work of `elements` is worth spreading over rayon's threads.
pub(crate) fn parallel(elements: usize) -> bool {
    elements >= 1 << 15
}

/// `x` as a padded dense `[batch * max_len, dim]`: sequence `b` in rows
/// `b * max_len..`, cut to `max_len` rows, the rest `pad`.
pub fn to_padded<T: Real>(x: &Jagged<T>, max_len: usize, pad: T) -> Tensor<T> {
    let d = x.dim();
    let mut out = Tensor::zeros(x.batch() * max_len, d);
    out.fill(pad);
    let fill = |(b, dst): (usize, &mut [T])| {
        let src = x.segment(b);
        let n = src.len().min(max_len * d);
        dst[..n].copy_from_slice(&src[..n]);
    };
    if max_len * d == 0 {
        return out;
    }
    match parallel(out.len()) {
        true => out
            .data_mut()
            .par_chunks_mut(max_len * d)
            .enumerate()
            .for_each(fill),
        false => out
            .data_mut()
            .chunks_mut(max_len * d)
            .enumerate()
            .for_each(fill),
    }
    out
}

/// The rows of a padded dense `[batch * max_len, dim]` that sequences of
/// `offsets` hold (rows past `max_len` of a longer sequence are zero): the
/// inverse of [`to_padded`], and its backward.
pub fn from_padded<T: Real>(padded: &Tensor<T>, offsets: &[usize], max_len: usize) -> Jagged<T> {
    let batch = offsets.len().saturating_sub(1);
    let valid = offsets.first() == Some(&0) && offsets.windows(2).all(|w| w[0] <= w[1]);
    check(valid, "jagged::from_padded", || {
        "offsets must start at 0 and never decrease".into()
    });
    check(
        padded.rows() == batch * max_len,
        "jagged::from_padded",
        || {
            format!(
                "padded has {} rows, not {batch} sequences x {max_len}",
                padded.rows()
            )
        },
    );
    let d = padded.cols();
    let total = offsets.last().copied().unwrap_or(0);
    let mut out = Jagged {
        values: Tensor::zeros(total, d),
        offsets: offsets.to_vec(),
    };
    let take = |(b, dst): (usize, &mut &mut [T])| {
        let n = dst.len().min(max_len * d);
        let src = &padded.data()[b * max_len * d..];
        dst[..n].copy_from_slice(&src[..n]);
    };
    let mut segments = out.segments_mut();
    match parallel(total * d) {
        true => segments.par_iter_mut().enumerate().for_each(take),
        false => segments.iter_mut().enumerate().for_each(take),
    }
    drop(segments);
    out
}

/// Sequence by sequence, `a`'s rows then `b`'s (a history and the
/// candidates after it).
pub fn concat<T: Real>(a: &Jagged<T>, b: &Jagged<T>) -> Jagged<T> {
    check(
        a.batch() == b.batch() && a.dim() == b.dim(),
        "jagged::concat",
        || {
            format!(
                "{} sequences of dim {} and {} of dim {}",
                a.batch(),
                a.dim(),
                b.batch(),
                b.dim()
            )
        },
    );
    let lengths: Vec<usize> = (a.offsets.windows(2).zip(b.offsets.windows(2)))
        .map(|(x, y)| (x[1] - x[0]) + (y[1] - y[0]))
        .collect();
    let mut out = Jagged::zeros(&lengths, a.dim());
    let join = |(s, dst): (usize, &mut &mut [T])| {
        let (x, y) = (a.segment(s), b.segment(s));
        dst[..x.len()].copy_from_slice(x);
        dst[x.len()..].copy_from_slice(y);
    };
    let mut segments = out.segments_mut();
    match parallel(segments.iter().map(|s| s.len()).sum()) {
        true => segments.par_iter_mut().enumerate().for_each(join),
        false => segments.iter_mut().enumerate().for_each(join),
    }
    drop(segments);
    out
}

/// Cuts each sequence of `x` after its first `first_lengths[b]` rows: the
/// inverse of [`concat()`], and its backward.
pub fn split<T: Real>(x: &Jagged<T>, first_lengths: &[usize]) -> (Jagged<T>, Jagged<T>) {
    let lengths = x.lengths();
    check(
        first_lengths.len() == lengths.len()
            && first_lengths.iter().zip(&lengths).all(|(f, l)| f <= l),
        "jagged::split",
        || "each first part must be at most its sequence's length".into(),
    );
    let rest: Vec<usize> = lengths
        .iter()
        .zip(first_lengths)
        .map(|(l, f)| l - f)
        .collect();
    let (mut a, mut b) = (
        Jagged::zeros(first_lengths, x.dim()),
        Jagged::zeros(&rest, x.dim()),
    );
    for (s, (da, db)) in a
        .segments_mut()
        .into_iter()
        .zip(b.segments_mut())
        .enumerate()
    {
        let src = x.segment(s);
        da.copy_from_slice(&src[..da.len()]);
        db.copy_from_slice(&src[da.len()..]);
    }
    (a, b)
}
