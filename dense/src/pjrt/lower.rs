//! The dense ops as StableHLO, emitted into a [`Func`] on SSA values: the
//! eager backend wraps one op per program; the compiled step chains them all.
//! Each function mirrors the [`DenseBackend`](crate::DenseBackend) op of the
//! same name (shapes, conventions, activation semantics).

use super::hlo::{gather_columns, ty, Func};
use crate::backend::Activation;

/// `y[n, out] = act(x[n, in] · w[out, in]ᵀ + b)`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward(
    f: &mut Func,
    x: &str,
    w: &str,
    b: &str,
    n: usize,
    inp: usize,
    out: usize,
    act: Activation,
) -> String {
    let (z, dims) = f.dot(x, &[n, inp], 1, w, &[out, inp], 1);
    let bb = f.broadcast_row(b, n, out);
    let z = f.binary("add", &z, &bb, &dims);
    f.activate(&z, act, &dims)
}

/// Gradients of a linear layer: `(dz, dw, db, dx)`; `dx` only when asked.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    f: &mut Func,
    x: &str,
    w: &str,
    y: &str,
    dy: &str,
    n: usize,
    inp: usize,
    out: usize,
    act: Activation,
    want_dx: bool,
) -> (String, String, String, Option<String>) {
    let no = [n, out];
    let dz = match act {
        Activation::None => dy.to_string(),
        Activation::Relu => {
            let zero = f.splat(0.0, &no);
            let pos = f.op(format!(
                "stablehlo.compare GT, {y}, {zero} : ({t}, {t}) -> tensor<{n}x{out}xi1>",
                t = ty(&no)
            ));
            f.op(format!(
                "stablehlo.select {pos}, {dy}, {zero} : tensor<{n}x{out}xi1>, {}",
                ty(&no)
            ))
        }
        Activation::Sigmoid => {
            let one = f.splat(1.0, &no);
            let om = f.binary("subtract", &one, y, &no);
            let g = f.binary("multiply", dy, y, &no);
            f.binary("multiply", &g, &om, &no)
        }
    };
    let (dw, _) = f.dot(&dz, &no, 0, x, &[n, inp], 0);
    let db = f.sum_rows(&dz, n, out);
    let dx = want_dx.then(|| f.dot(&dz, &no, 1, w, &[out, inp], 0).0);
    (dz, dw, db, dx)
}

/// `[dense, sparse_0 .. sparse_{F-1}]` as `[n, F + 1, d]`.
pub fn combined(f: &mut Func, dense: &str, sparse: &str, n: usize, fk: usize, d: usize) -> String {
    let d3 = f.reshape(dense, &[n, d], &[n, 1, d]);
    let s3 = f.reshape(sparse, &[n, fk * d], &[n, fk, d]);
    f.op(format!(
        "stablehlo.concatenate {d3}, {s3}, dim = 1 : ({}, {}) -> {}",
        ty(&[n, 1, d]),
        ty(&[n, fk, d]),
        ty(&[n, fk + 1, d])
    ))
}

/// The DLRM dot interaction: `[dense, <c_i, c_j> for i < j]`, `d + k(k-1)/2` columns.
pub fn dot_interaction_forward(
    f: &mut Func,
    dense: &str,
    sparse: &str,
    n: usize,
    fk: usize,
    d: usize,
) -> String {
    let k = fk + 1;
    let pairs: Vec<usize> = (0..k)
        .flat_map(|i| (i + 1..k).map(move |j| i * k + j))
        .collect();
    let c = combined(f, dense, sparse, n, fk, d);
    let z = f.op(format!(
        "stablehlo.dot_general {c}, {c}, batching_dims = [0] x [0], contracting_dims = [2] x [2], precision = [HIGHEST, HIGHEST] : ({t}, {t}) -> {}",
        ty(&[n, k, k]),
        t = ty(&[n, k, d])
    ));
    let zf = f.reshape(&z, &[n, k, k], &[n, k * k]);
    let p = gather_columns(f, &zf, n, k * k, &pairs);
    concat_columns(f, dense, &p, n, d, pairs.len())
}

/// Backward of the dot interaction: `(ddense [n, d], dsparse [n, F d])`.
pub fn dot_interaction_backward(
    f: &mut Func,
    dense: &str,
    sparse: &str,
    dout: &str,
    n: usize,
    fk: usize,
    d: usize,
) -> (String, String) {
    let k = fk + 1;
    let np = k * (k - 1) / 2;
    // Column of d(out) feeding z[i][j]; the pair count (a zero column) for i >= j.
    let mut map = vec![np; k * k];
    let mut p = 0;
    for i in 0..k {
        for j in i + 1..k {
            map[i * k + j] = p;
            p += 1;
        }
    }
    let c = combined(f, dense, sparse, n, fk, d);
    let gdense = slice_columns(f, dout, n, d + np, 0, d);
    let gpairs = slice_columns(f, dout, n, d + np, d, d + np);
    let zero = f.splat(0.0, &[n, 1]);
    let padded = concat_columns(f, &gpairs, &zero, n, np, 1);
    let gz = gather_columns(f, &padded, n, np + 1, &map);
    let gz = f.reshape(&gz, &[n, k * k], &[n, k, k]);
    let gzt = f.op(format!(
        "stablehlo.transpose {gz}, dims = [0, 2, 1] : ({t}) -> {t}",
        t = ty(&[n, k, k])
    ));
    let gs = f.binary("add", &gz, &gzt, &[n, k, k]);
    let gc = f.op(format!(
        "stablehlo.dot_general {gs}, {c}, batching_dims = [0] x [0], contracting_dims = [2] x [1], precision = [HIGHEST, HIGHEST] : ({}, {}) -> {}",
        ty(&[n, k, k]),
        ty(&[n, k, d]),
        ty(&[n, k, d])
    ));
    let g0 = f.op(format!(
        "stablehlo.slice {gc} [0:{n}, 0:1, 0:{d}] : ({}) -> {}",
        ty(&[n, k, d]),
        ty(&[n, 1, d])
    ));
    let g0 = f.reshape(&g0, &[n, 1, d], &[n, d]);
    let gd = f.binary("add", &g0, &gdense, &[n, d]);
    let gsp = f.op(format!(
        "stablehlo.slice {gc} [0:{n}, 1:{k}, 0:{d}] : ({}) -> {}",
        ty(&[n, k, d]),
        ty(&[n, fk, d])
    ));
    let gsp = f.reshape(&gsp, &[n, fk, d], &[n, fk * d]);
    (gd, gsp)
}

/// `x0 ⊙ (h + b) + xl`.
pub fn cross_combine_forward(
    f: &mut Func,
    x0: &str,
    h: &str,
    b: &str,
    xl: &str,
    n: usize,
    c: usize,
) -> String {
    let dims = [n, c];
    let bb = f.broadcast_row(b, n, c);
    let hb = f.binary("add", h, &bb, &dims);
    let m = f.binary("multiply", x0, &hb, &dims);
    f.binary("add", &m, xl, &dims)
}

/// `(dh = dout ⊙ x0, db = Σ dh, dx0 + dout ⊙ (h + b))`.
#[allow(clippy::too_many_arguments)]
pub fn cross_combine_backward(
    f: &mut Func,
    x0: &str,
    h: &str,
    b: &str,
    dout: &str,
    dx0: &str,
    n: usize,
    c: usize,
) -> (String, String, String) {
    let dims = [n, c];
    let gh = f.binary("multiply", dout, x0, &dims);
    let gb = f.sum_rows(&gh, n, c);
    let bb = f.broadcast_row(b, n, c);
    let hb = f.binary("add", h, &bb, &dims);
    let t = f.binary("multiply", dout, &hb, &dims);
    let gx = f.binary("add", dx0, &t, &dims);
    (gh, gb, gx)
}

/// Mean BCE on logits `z[n]` against `y[n]`, stable: `(loss, dz = (σ(z) - y) / n)`.
pub fn bce_with_logits(f: &mut Func, z: &str, y: &str, n: usize) -> (String, String) {
    let dims = [n];
    let zero = f.splat(0.0, &dims);
    let relu = f.binary("maximum", z, &zero, &dims);
    let zy = f.binary("multiply", z, y, &dims);
    let a = f.op(format!("stablehlo.abs {z} : {}", ty(&dims)));
    let na = f.op(format!("stablehlo.negate {a} : {}", ty(&dims)));
    let e = f.op(format!("stablehlo.exponential {na} : {}", ty(&dims)));
    let l = f.op(format!("stablehlo.log_plus_one {e} : {}", ty(&dims)));
    let t = f.binary("subtract", &relu, &zy, &dims);
    let per = f.binary("add", &t, &l, &dims);
    let sum = f.sum_all(&per, n);
    let count = f.splat(n.max(1) as f32, &[]);
    let loss = f.binary("divide", &sum, &count, &[]);
    let s = f.op(format!("stablehlo.logistic {z} : {}", ty(&dims)));
    let diff = f.binary("subtract", &s, y, &dims);
    let cn = f.splat(n.max(1) as f32, &dims);
    let g = f.binary("divide", &diff, &cn, &dims);
    (loss, g)
}

/// `alpha · op(a) · op(b) (+ beta · c)`, `op` transposing when its flag is set; `c` is read
/// only when given (`beta != 0`). Returns the value and its dims.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    f: &mut Func,
    a: &str,
    ad: &[usize],
    trans_a: bool,
    b: &str,
    bd: &[usize],
    trans_b: bool,
    alpha: f32,
    c: Option<(&str, f32)>,
) -> (String, Vec<usize>) {
    let (mut out, dims) = f.dot(
        a,
        ad,
        if trans_a { 0 } else { 1 },
        b,
        bd,
        if trans_b { 1 } else { 0 },
    );
    if alpha != 1.0 {
        let s = f.splat(alpha, &dims);
        out = f.binary("multiply", &out, &s, &dims);
    }
    if let Some((c, beta)) = c {
        let s = f.splat(beta, &dims);
        let bc = f.binary("multiply", c, &s, &dims);
        out = f.binary("add", &out, &bc, &dims);
    }
    (out, dims)
}

/// `[a, b]` side by side: `[n, ca]` and `[n, cb]` → `[n, ca + cb]`.
pub fn concat_columns(f: &mut Func, a: &str, b: &str, n: usize, ca: usize, cb: usize) -> String {
    f.op(format!(
        "stablehlo.concatenate {a}, {b}, dim = 1 : ({}, {}) -> {}",
        ty(&[n, ca]),
        ty(&[n, cb]),
        ty(&[n, ca + cb])
    ))
}

/// Columns `from..to` of `x` (`[n, cols]`).
pub fn slice_columns(
    f: &mut Func,
    x: &str,
    n: usize,
    cols: usize,
    from: usize,
    to: usize,
) -> String {
    f.op(format!(
        "stablehlo.slice {x} [0:{n}, {from}:{to}] : ({}) -> {}",
        ty(&[n, cols]),
        ty(&[n, to - from])
    ))
}
