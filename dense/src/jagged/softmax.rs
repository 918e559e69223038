//! A softmax over each sequence of a jagged tensor, column by column
//! (FBGEMM's `jagged_softmax`), and its backward.

use rayon::prelude::*;

use super::{check, parallel, Jagged};
use crate::real::Real;

/// Runs `f` on each sequence's output rows with the sequence's index, in
/// parallel when the tensor is large.
fn per_sequence<T: Real>(out: &mut Jagged<T>, f: impl Fn(usize, &mut [T]) + Sync + Send) {
    let work = out.values().len();
    let segments = out.segments_mut();
    match parallel(work) {
        true => segments
            .into_par_iter()
            .enumerate()
            .for_each(|(b, s)| f(b, s)),
        false => segments.into_iter().enumerate().for_each(|(b, s)| f(b, s)),
    }
}

/// `y[i, c] = exp(x[i, c]) / Σ_j exp(x[j, c])` over the rows `i`, `j` of
/// each sequence (less the sequence's column maximum, for range).
pub fn softmax<T: Real>(x: &Jagged<T>) -> Jagged<T> {
    let d = x.dim();
    let mut y = Jagged::zeros_like(x, d);
    per_sequence(&mut y, |b, yb| {
        let xb = x.segment(b);
        for c in 0..d {
            let col = || xb.iter().skip(c).step_by(d);
            let max = col().fold(T::from_f64(f64::NEG_INFINITY), |m, &v| m.max(v));
            let mut sum = T::ZERO;
            for (o, &v) in yb.iter_mut().skip(c).step_by(d).zip(col()) {
                *o = (v - max).exp();
                sum += *o;
            }
            yb.iter_mut().skip(c).step_by(d).for_each(|o| *o /= sum);
        }
    });
    y
}

/// The gradient of [`softmax`]'s input from its output `y` and the
/// output's gradient `dy`: `dx[i, c] = y[i, c] (dy[i, c] - Σ_j y[j, c]
/// dy[j, c])`.
pub fn softmax_backward<T: Real>(y: &Jagged<T>, dy: &Jagged<T>) -> Jagged<T> {
    check(
        y.offsets() == dy.offsets() && y.dim() == dy.dim(),
        "jagged::softmax_backward",
        || "y and dy must be of one shape".into(),
    );
    let d = y.dim();
    let mut dx = Jagged::zeros_like(y, d);
    per_sequence(&mut dx, |b, dxb| {
        let (yb, dyb) = (y.segment(b), dy.segment(b));
        for c in 0..d {
            let pairs = || yb.iter().zip(dyb).skip(c).step_by(d);
            let dot = pairs().fold(T::ZERO, |s, (&p, &g)| s + p * g);
            for (o, (&p, &g)) in dxb.iter_mut().skip(c).step_by(d).zip(pairs()) {
                *o = p * (g - dot);
            }
        }
    });
    dx
}
