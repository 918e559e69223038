//! Causal attention on jagged sequences, forward and backward: per sample
//! and head, `O = W(alpha Q Kᵀ + rab) V` over the sample's own tokens only
//! (no padding), samples in parallel, where `W` is HSTU's pointwise
//! `SiLU(S) / n ⊙ M` or a transformer's softmax over each row's visible
//! keys. The attention matrix is not kept: the backward makes it again.

use rayon::prelude::*;

use crate::jagged::gemm::{gemm, View};
use crate::real::Real;

/// The shape of one attention: heads, dims, scale, and which token sees which.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) heads: usize,
    /// Query and key width per head.
    pub(crate) qk_dim: usize,
    /// Value width per head.
    pub(crate) v_dim: usize,
    /// Multiplies `Q Kᵀ` before the bias.
    pub(crate) alpha: f64,
    /// Divides `SiLU(..)`: the layer's maximum sequence length.
    pub(crate) n: f64,
    /// A softmax over each row's visible keys instead of `SiLU(..) / n`.
    pub(crate) softmax: bool,
    /// Dropout on the attention weights: the chance, and the key its masks
    /// are drawn from (each weight's by hashing the key, the sample's
    /// first row, the head and the weight's place, so that the backward
    /// draws the same mask without keeping it).
    pub(crate) dropout: (f64, u64),
}

/// The inputs of one sample: its rows of the projection's output, `width`
/// wide, whose columns from `v_at`, `q_at`, `k_at` hold `V`, `Q`, `K` (every
/// head side by side).
pub(crate) struct Sample<'a, T> {
    /// The sample's first row in the batch (its dropout masks' place).
    pub(crate) first_row: usize,
    pub(crate) rows: &'a [T],
    pub(crate) width: usize,
    pub(crate) v_at: usize,
    pub(crate) q_at: usize,
    pub(crate) k_at: usize,
    /// Tokens.
    pub(crate) len: usize,
    /// The last `targets` tokens are candidates: each sees the history and
    /// itself, not the other candidates; the history never sees them.
    pub(crate) targets: usize,
}

impl<T> Sample<'_, T> {
    /// Whether query `i` sees key `j`.
    pub(crate) fn sees(&self, i: usize, j: usize) -> bool {
        let history = self.len - self.targets;
        j == i || (j < i && j < history)
    }
}

/// `s = alpha q kᵀ + bias` for one head: `[len, len]` into `s`.
fn scores<T: Real>(
    x: &Sample<'_, T>,
    shape: &Shape,
    h: usize,
    bias: &dyn Fn(usize, usize) -> T,
    s: &mut Vec<T>,
) {
    let n = x.len;
    s.resize(n * n, T::ZERO);
    let q = View::columns(x.rows, x.width, x.q_at + h * shape.qk_dim, shape.qk_dim);
    let k = View::columns(x.rows, x.width, x.k_at + h * shape.qk_dim, shape.qk_dim);
    gemm(q, k.t(), s, n, false);
    let alpha = T::from_f64(shape.alpha);
    for (i, row) in s.chunks_mut(n.max(1)).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = *v * alpha + bias(i, j);
        }
    }
}

fn sigmoid<T: Real>(z: T) -> T {
    T::ONE / (T::ONE + (-z).exp())
}

/// Turns scores `s` (`[len, len]`) into attention weights in place.
fn weigh<T: Real>(x: &Sample<'_, T>, shape: &Shape, s: &mut [T]) {
    let n = x.len;
    let inv_n = T::ONE / T::from_f64(shape.n);
    for (i, row) in s.chunks_mut(n.max(1)).enumerate() {
        if shape.softmax {
            let max = (0..n)
                .filter(|&j| x.sees(i, j))
                .fold(T::from_f64(f64::NEG_INFINITY), |m, j| m.max(row[j]));
            let mut sum = T::ZERO;
            for (j, v) in row.iter_mut().enumerate() {
                *v = match x.sees(i, j) {
                    true => (*v - max).exp(),
                    false => T::ZERO,
                };
                sum += *v;
            }
            row.iter_mut().for_each(|v| *v /= sum);
        } else {
            for (j, v) in row.iter_mut().enumerate() {
                *v = match x.sees(i, j) {
                    true => *v * sigmoid(*v) * inv_n,
                    false => T::ZERO,
                };
            }
        }
    }
}

/// Multiplies each attention weight of head `h` by its dropout mask: 0
/// with the dropout's chance, else `1 / (1 - p)`.
fn drop_weights<T: Real>(x: &Sample<'_, T>, shape: &Shape, h: usize, w: &mut [T]) {
    let (p, key) = shape.dropout;
    if p <= 0.0 {
        return;
    }
    let keep = T::from_f64(1.0 / (1.0 - p));
    let n = x.len;
    for (i, row) in w.chunks_mut(n.max(1)).enumerate() {
        let row_key = splitmix(key ^ splitmix(((x.first_row + i) as u64) << 8 | h as u64));
        for (j, v) in row.iter_mut().enumerate() {
            let u = (splitmix(row_key ^ j as u64) >> 11) as f64 / (1u64 << 53) as f64;
            *v = if u < p { T::ZERO } else { *v * keep };
        }
    }
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash.
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One sample's attention output, `[len, heads * v_dim]` into `out`.
pub(crate) fn forward<T: Real>(
    x: &Sample<'_, T>,
    shape: &Shape,
    bias: &dyn Fn(usize, usize) -> T,
    out: &mut [T],
) {
    let (n, vw) = (x.len, shape.heads * shape.v_dim);
    let mut s = Vec::new();
    for h in 0..shape.heads {
        scores(x, shape, h, bias, &mut s);
        weigh(x, shape, &mut s);
        drop_weights(x, shape, h, &mut s);
        let v = View::columns(x.rows, x.width, x.v_at + h * shape.v_dim, shape.v_dim);
        let at = (h * shape.v_dim).min(out.len());
        let o = &mut out[at..];
        gemm(View::rows(&s, n, n), v, o, vw, false);
    }
}

/// One sample's gradients from its output's, `d_out` (`[len, heads *
/// v_dim]`): those of `V`, `Q`, `K` written into `d_rows` (laid out as
/// `x.rows`; other columns untouched), and `d_bias(i, j, g)` told each
/// score's gradient, head by head.
pub(crate) fn backward<T: Real>(
    x: &Sample<'_, T>,
    shape: &Shape,
    bias: &dyn Fn(usize, usize) -> T,
    d_out: &[T],
    d_rows: &mut [T],
    d_bias: &mut dyn FnMut(usize, usize, T),
) {
    let (n, w, vw) = (x.len, x.width, shape.heads * shape.v_dim);
    let inv_n = T::ONE / T::from_f64(shape.n);
    let alpha = T::from_f64(shape.alpha);
    let (mut s, mut p, mut dp) = (Vec::new(), vec![T::ZERO; n * n], vec![T::ZERO; n * n]);
    let mut pd = Vec::new();
    for h in 0..shape.heads {
        scores(x, shape, h, bias, &mut s);
        let (qc, kc) = (x.q_at + h * shape.qk_dim, x.k_at + h * shape.qk_dim);
        let (vc, oc) = (x.v_at + h * shape.v_dim, h * shape.v_dim);
        // p = W(s), and dP = dO Vᵀ.
        p.copy_from_slice(&s);
        weigh(x, shape, &mut p);
        let d_o = View::columns(d_out, vw, oc, shape.v_dim);
        let v = View::columns(x.rows, w, vc, shape.v_dim);
        gemm(d_o, v.t(), &mut dp, n, false);
        // With dropout (masks D): O = (P ⊙ D) V, so dV = (P ⊙ D)ᵀ dO and
        // dP = (dO Vᵀ) ⊙ D.
        let dropped = shape.dropout.0 > 0.0;
        if dropped {
            pd.clear();
            pd.extend_from_slice(&p);
            drop_weights(x, shape, h, &mut pd);
            drop_weights(x, shape, h, &mut dp);
        }
        let weights = if dropped { &pd } else { &p };
        gemm(
            View::rows(weights, n, n).t(),
            d_o,
            tail(d_rows, vc),
            w,
            false,
        );
        // dS, kept in dp: dP ⊙ M ⊙ SiLU'(s) / n, or the softmax's
        // P ⊙ (dP - rowsum(P ⊙ dP)).
        for (i, (g_row, (s_row, p_row))) in (dp.chunks_mut(n.max(1)))
            .zip(s.chunks(n.max(1)).zip(p.chunks(n.max(1))))
            .enumerate()
        {
            let dot = match shape.softmax {
                true => g_row
                    .iter()
                    .zip(p_row)
                    .fold(T::ZERO, |a, (&g, &pv)| a + g * pv),
                false => T::ZERO,
            };
            for (j, g) in g_row.iter_mut().enumerate() {
                if !x.sees(i, j) {
                    *g = T::ZERO;
                    continue;
                }
                *g = match shape.softmax {
                    true => p_row[j] * (*g - dot),
                    false => {
                        let (sv, sg) = (s_row[j], sigmoid(s_row[j]));
                        *g * sg * (T::ONE + sv * (T::ONE - sg)) * inv_n
                    }
                };
                d_bias(i, j, *g);
            }
        }
        // dQ = alpha dS K, dK = alpha dSᵀ Q (alpha applied after).
        let q = View::columns(x.rows, w, qc, shape.qk_dim);
        let k = View::columns(x.rows, w, kc, shape.qk_dim);
        let ds = View::rows(&dp, n, n);
        gemm(ds, k, tail(d_rows, qc), w, false);
        gemm(ds.t(), q, tail(d_rows, kc), w, false);
        for row in d_rows.chunks_mut(w.max(1)) {
            for c in (qc..qc + shape.qk_dim).chain(kc..kc + shape.qk_dim) {
                row[c] *= alpha;
            }
        }
    }
}

/// Runs `f(b, item)` on each sample's item, in parallel when `work` is
/// worth it.
pub(crate) fn per_sample<I: Send>(items: Vec<I>, work: usize, f: impl Fn(usize, I) + Sync + Send) {
    map_samples(items, work, f);
}

/// `f(b, item)` of each sample's item, in order, computed in parallel when
/// `work` is worth it.
pub(crate) fn map_samples<I: Send, R: Send>(
    items: Vec<I>,
    work: usize,
    f: impl Fn(usize, I) -> R + Sync + Send,
) -> Vec<R> {
    match crate::jagged::parallel(work) {
        true => items
            .into_par_iter()
            .enumerate()
            .map(|(b, i)| f(b, i))
            .collect(),
        false => items
            .into_iter()
            .enumerate()
            .map(|(b, i)| f(b, i))
            .collect(),
    }
}

/// `data` from `at` on (empty past its end).
fn tail<T>(data: &mut [T], at: usize) -> &mut [T] {
    let at = at.min(data.len());
    &mut data[at..]
}
