//! The retrieval losses sequence models train with, and their gradients.

/// Norms below this are taken as this (the reference's eps).
pub(crate) const NORM_EPS: f32 = 1e-6;

/// Rows of `x` scaled to unit length into `out`; returns each row's norm
/// (at least the eps).
pub(crate) fn normalize(x: &[f32], dim: usize, out: &mut Vec<f32>) -> Vec<f32> {
    out.clear();
    let mut norms = Vec::with_capacity(x.len() / dim.max(1));
    for row in x.chunks(dim.max(1)) {
        let n = row.iter().map(|v| v * v).sum::<f32>().sqrt().max(NORM_EPS);
        norms.push(n);
        out.extend(row.iter().map(|v| v / n));
    }
    norms
}

/// The gradient through `x / max(|x|, eps)` from the output's, in place:
/// `(g - x̂ (x̂·g)) / |x|` (`g / eps` where the norm was clamped).
fn normalize_backward(normed: &[f32], norms: &[f32], grad: &mut [f32], dim: usize) {
    let rows = grad.chunks_mut(dim.max(1)).zip(normed.chunks(dim.max(1)));
    for ((g, x), &n) in rows.zip(norms) {
        let dot: f32 = g.iter().zip(x).map(|(a, b)| a * b).sum();
        let clamped = n <= NORM_EPS;
        for (gv, &xv) in g.iter_mut().zip(x) {
            *gv = match clamped {
                true => *gv / n,
                false => (*gv - xv * dot) / n,
            };
        }
    }
}

/// The sampled softmax's buffers, kept from step to step: the target rows
/// are many (a token's negatives each), and memory allocated afresh each
/// step is memory the kernel maps afresh.
#[derive(Debug, Default)]
pub(crate) struct SoftmaxBuffers {
    q: Vec<f32>,
    e: Vec<f32>,
    /// The raw queries' gradient, after a call.
    pub(crate) dq: Vec<f32>,
    /// The raw targets' gradient, after a call.
    pub(crate) de: Vec<f32>,
}

/// The reference's sampled softmax: each of the `queries` (`[tokens, d]`)
/// against its `per` target rows of `targets` (`[tokens * per, d]`; the
/// first the positive, then the negatives, of ids `ids`), both
/// L2-normalised, logits their dot products over `temperature`, a negative
/// equal to the positive left out. Returns the mean cross-entropy; the
/// gradients of the raw queries and targets are left in `b`.
pub(crate) fn sampled_softmax(
    (queries, targets): (&[f32], &[f32]),
    ids: &[i64],
    (per, d): (usize, usize),
    temperature: f32,
    b: &mut SoftmaxBuffers,
) -> f64 {
    let SoftmaxBuffers { q, e, dq, de } = b;
    let q_norms = normalize(queries, d, q);
    let e_norms = normalize(targets, d, e);
    let tokens = q.len() / d.max(1);
    let mut loss = 0.0f64;
    dq.clear();
    dq.resize(q.len(), 0.0);
    de.clear();
    de.resize(e.len(), 0.0);
    let mut logits = vec![0.0f32; per];
    for tok in 0..tokens {
        let qt = &q[tok * d..(tok + 1) * d];
        let pos_id = ids[tok * per];
        for (j, l) in logits.iter_mut().enumerate() {
            let row = tok * per + j;
            let same = j > 0 && ids[row] == pos_id;
            let dot: f32 = qt
                .iter()
                .zip(&e[row * d..(row + 1) * d])
                .map(|(a, b)| a * b)
                .sum();
            *l = if same {
                f32::NEG_INFINITY
            } else {
                dot / temperature
            };
        }
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = logits.iter().map(|l| (l - max).exp()).sum();
        loss += f64::from(sum.ln() + max - logits[0]);
        for (j, &l) in logits.iter().enumerate() {
            let p = (l - max).exp() / sum;
            let g = (p - f32::from(j == 0)) / tokens as f32 / temperature;
            if g == 0.0 {
                continue;
            }
            let row = tok * per + j;
            for c in 0..d {
                dq[tok * d + c] += g * e[row * d + c];
                de[row * d + c] += g * qt[c];
            }
        }
    }
    normalize_backward(q, &q_norms, dq, d);
    normalize_backward(e, &e_norms, de, d);
    loss / tokens.max(1) as f64
}
