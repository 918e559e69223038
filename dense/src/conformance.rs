//! One conformance suite for every [`DenseBackend<f32>`]: each op is run on a few random shapes
//! (including ones big enough to take parallel paths) and compared with plain `f64` reference
//! loops. The native backend's tests call [`run_all`]; a PJRT backend calls the same function.
//!
//! Tolerance: `|got - want| <= TOL * max(1, max |want|)` over each output tensor, i.e. a
//! norm-wise relative error of `TOL`. A wrong index or a missed term shows up as an error of
//! order 1, far above it.

use crate::backend::{Activation, DenseBackend};
use crate::init::Initializer;
use crate::tensor::Tensor;

/// Norm-wise relative tolerance of an `f32` backend against the `f64` reference.
pub const TOL: f64 = 1e-5;

const ACTIVATIONS: [Activation; 3] = [Activation::None, Activation::Relu, Activation::Sigmoid];

/// One check: `Ok(comparisons made)` or a description of the first mismatch.
pub type Check<B> = fn(&B) -> Result<usize, String>;

/// Runs every check; `Ok` carries the number of comparisons made, `Err` lists every failure.
pub fn run_all<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let checks: [(&str, Check<B>); 9] = [
        ("matmul", check_matmul::<B>),
        ("linear_forward", check_linear_forward::<B>),
        ("linear_backward", check_linear_backward::<B>),
        ("dot_interaction", check_dot_interaction::<B>),
        ("cross_combine", check_cross_combine::<B>),
        ("add_assign", check_add_assign::<B>),
        ("bce_with_logits", check_bce_with_logits::<B>),
        ("copies", check_copies::<B>),
        ("fused_window", check_fused_window::<B>),
    ];
    let mut total = 0;
    let mut failures = Vec::new();
    for (name, check) in checks {
        match check(be) {
            Ok(n) => total += n,
            Err(e) => failures.push(format!("[{} backend] {name}: {e}", be.name())),
        }
    }
    if failures.is_empty() {
        Ok(total)
    } else {
        Err(failures.join("\n"))
    }
}

/// All transpose combinations, `beta = 0` (with a NaN-filled `c` that must not be read) and
/// `beta != 0`.
pub fn check_matmul<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(11);
    let mut n = 0;
    for &(m, k, p) in &[
        (1, 1, 1),
        (3, 5, 7),
        (17, 33, 9),
        (64, 13, 40),
        (300, 70, 130),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                for &(alpha, beta) in &[(1.0f32, 0.0f32), (-0.5, 0.75)] {
                    let a = if ta {
                        random(&mut rng, k, m)
                    } else {
                        random(&mut rng, m, k)
                    };
                    let b = if tb {
                        random(&mut rng, p, k)
                    } else {
                        random(&mut rng, k, p)
                    };
                    let c0 = random(&mut rng, m, p);
                    let mut c = if beta == 0.0 {
                        Tensor::from_vec(1, 1, vec![f32::NAN]).unwrap()
                    } else {
                        c0.clone()
                    };
                    be.matmul(&a, ta, &b, tb, alpha, beta, &mut c);
                    let want = reference::matmul(
                        &a.cast(),
                        ta,
                        &b.cast(),
                        tb,
                        alpha as f64,
                        beta as f64,
                        &c0.cast(),
                    );
                    let what =
                        format!("[{m}x{k}]·[{k}x{p}] ta={ta} tb={tb} alpha={alpha} beta={beta}");
                    compare(&what, &c, &want)?;
                    n += 1;
                }
            }
        }
    }
    Ok(n)
}

/// `linear_forward` with every activation on a few shapes, into an output of another shape
/// (the op must resize it).
pub fn check_linear_forward<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(12);
    let mut n = 0;
    for &(rows, inp, out) in &[(1, 1, 1), (5, 3, 4), (33, 13, 64), (300, 67, 129)] {
        for act in ACTIVATIONS {
            let x = random(&mut rng, rows, inp);
            let w = random(&mut rng, out, inp);
            let b = random(&mut rng, 1, out);
            let mut y = Tensor::zeros(2, 3);
            be.linear_forward(&x, &w, b.data(), act, &mut y);
            let want = reference::linear_forward(&x.cast(), &w.cast(), &b.cast(), act);
            compare(
                &format!("x[{rows}x{inp}] w[{out}x{inp}] {act:?}"),
                &y,
                &want,
            )?;
            n += 1;
        }
    }
    Ok(n)
}

/// `linear_backward` with every activation, with and without `dx`: `dz` (written into `dy`),
/// `dw`, `db` (overwritten, not accumulated) and `dx`, including narrow outputs over many rows.
pub fn check_linear_backward<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(13);
    let mut n = 0;
    for &(rows, inp, out) in &[
        (1, 1, 1),
        (5, 3, 4),
        (33, 13, 64),
        (300, 67, 129),
        (600, 40, 3),
        // Narrow outputs over many rows: the native backend's parallel
        // column-sum path for the bias gradient (rows x cols >= 32768).
        (4096, 24, 16),
    ] {
        for act in ACTIVATIONS {
            for want_dx in [true, false] {
                let x = random(&mut rng, rows, inp);
                let w = random(&mut rng, out, inp);
                let b = random(&mut rng, 1, out);
                let y: Tensor<f32> =
                    reference::linear_forward(&x.cast(), &w.cast(), &b.cast(), act).cast();
                let dy = random(&mut rng, rows, out);
                let mut dz = dy.clone();
                let mut dw = Tensor::zeros(1, 1);
                let mut db = vec![7.0f32; out];
                let mut dx = Tensor::zeros(1, 2);
                be.linear_backward(
                    &x,
                    &w,
                    &y,
                    act,
                    &mut dz,
                    &mut dw,
                    &mut db,
                    want_dx.then_some(&mut dx),
                );
                let r =
                    reference::linear_backward(&x.cast(), &w.cast(), &y.cast(), act, &dy.cast());
                let what = format!("x[{rows}x{inp}] w[{out}x{inp}] {act:?} dx={want_dx}");
                compare(&format!("{what} dz"), &dz, &r.dz)?;
                compare(&format!("{what} dw"), &dw, &r.dw)?;
                compare(
                    &format!("{what} db"),
                    &Tensor::from_vec(1, out, db).unwrap(),
                    &r.db,
                )?;
                if want_dx {
                    compare(&format!("{what} dx"), &dx, &r.dx)?;
                }
                n += 1;
            }
        }
    }
    Ok(n)
}

/// `dot_interaction_forward` and `_backward`, from `F = 0` (no sparse features) up to
/// Criteo's 26 sparse features (`F = 26`, `D = 16`).
pub fn check_dot_interaction<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(14);
    let mut n = 0;
    for &(rows, f, d) in &[
        (1, 1, 1),
        (3, 0, 4),
        (2, 0, 16),
        (5, 3, 4),
        (7, 2, 13),
        (9, 5, 8),
        (3, 2, 32),
        (3, 1, 128),
        (130, 26, 16),
    ] {
        let dense = random(&mut rng, rows, d);
        let sparse = random(&mut rng, rows, f * d);
        let what = format!("n={rows} F={f} D={d}");
        let mut out = Tensor::zeros(1, 1);
        be.dot_interaction_forward(&dense, &sparse, &mut out);
        let want = reference::dot_interaction_forward(&dense.cast(), &sparse.cast());
        compare(&format!("{what} forward"), &out, &want)?;

        let dout = random(&mut rng, rows, want.cols());
        let (mut dd, mut ds) = (Tensor::zeros(1, 1), Tensor::zeros(2, 2));
        be.dot_interaction_backward(&dense, &sparse, &dout, &mut dd, &mut ds);
        let (wd, ws) =
            reference::dot_interaction_backward(&dense.cast(), &sparse.cast(), &dout.cast());
        compare(&format!("{what} ddense"), &dd, &wd)?;
        compare(&format!("{what} dsparse"), &ds, &ws)?;
        n += 1;
    }
    Ok(n)
}

/// `cross_combine_forward` and `_backward`; `dx0` must accumulate onto what it held and
/// `db` be overwritten.
pub fn check_cross_combine<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(15);
    let mut n = 0;
    for &(rows, cols) in &[(1, 1), (4, 7), (300, 129), (4096, 32)] {
        let (x0, h, xl) = (
            random(&mut rng, rows, cols),
            random(&mut rng, rows, cols),
            random(&mut rng, rows, cols),
        );
        let b = random(&mut rng, 1, cols);
        let what = format!("[{rows}x{cols}]");
        let mut out = Tensor::zeros(1, 1);
        be.cross_combine_forward(&x0, &h, b.data(), &xl, &mut out);
        let want = reference::cross_combine_forward(&x0.cast(), &h.cast(), &b.cast(), &xl.cast());
        compare(&format!("{what} forward"), &out, &want)?;

        let dout = random(&mut rng, rows, cols);
        let dx0_before = random(&mut rng, rows, cols);
        let mut dx0 = dx0_before.clone();
        let mut dh = Tensor::zeros(1, 1);
        let mut db = vec![7.0f32; cols];
        be.cross_combine_backward(&x0, &h, b.data(), &dout, &mut dh, &mut db, &mut dx0);
        let r = reference::cross_combine_backward(
            &x0.cast(),
            &h.cast(),
            &b.cast(),
            &dout.cast(),
            &dx0_before.cast(),
        );
        compare(&format!("{what} dh"), &dh, &r.0)?;
        compare(
            &format!("{what} db"),
            &Tensor::from_vec(1, cols, db).unwrap(),
            &r.1,
        )?;
        compare(&format!("{what} dx0 (accumulated)"), &dx0, &r.2)?;
        n += 1;
    }
    Ok(n)
}

/// `add_assign` on a few shapes, up to parallel sizes.
pub fn check_add_assign<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(16);
    let mut n = 0;
    for &(rows, cols) in &[(1, 1), (3, 5), (400, 100)] {
        let (x, y0) = (random(&mut rng, rows, cols), random(&mut rng, rows, cols));
        let mut y = y0.clone();
        be.add_assign(&mut y, &x);
        let want = Tensor::from_fn(rows, cols, |r, c| y0.row(r)[c] as f64 + x.row(r)[c] as f64);
        compare(&format!("[{rows}x{cols}]"), &y, &want)?;
        n += 1;
    }
    Ok(n)
}

/// Includes extreme logits (±100) that break a naive `log(sigmoid(z))`.
pub fn check_bce_with_logits<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(17);
    let mut n = 0;
    for &len in &[1usize, 7, 2048] {
        let mut logits: Vec<f32> = (0..len).map(|_| rng.uniform(-8.0, 8.0) as f32).collect();
        if len > 2 {
            logits[0] = 100.0;
            logits[1] = -100.0;
        }
        let labels: Vec<f32> = (0..len)
            .map(|i| (rng.unit() < 0.3 || i == 1) as u8 as f32)
            .collect();
        // Sized wrong on purpose: the backend makes it [len, 1].
        let mut grad = Tensor::from_vec(1, len + 1, vec![f32::NAN; len + 1]).unwrap();
        let mut loss = f32::NAN;
        be.bce_with_logits(&logits, &labels, &mut grad, &mut loss);
        let l64: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
        let y64: Vec<f64> = labels.iter().map(|&v| v as f64).collect();
        let (want_loss, want_grad) = reference::bce_with_logits(&l64, &y64);
        let what = format!("n={len}");
        compare(
            &format!("{what} loss"),
            &Tensor::from_vec(1, 1, vec![loss]).unwrap(),
            &Tensor::from_vec(1, 1, vec![want_loss]).unwrap(),
        )?;
        compare(
            &format!("{what} dlogits"),
            &grad,
            &Tensor::from_vec(len, 1, want_grad).unwrap(),
        )?;
        n += 1;
    }
    Ok(n)
}

/// `copy`, `zeros`, `concat_columns` and `split_columns` (into buffers of
/// other shapes, zero-width parts included), eagerly and inside a window.
pub fn check_copies<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(18);
    let mut n = 0;
    for &(rows, ca, cb) in &[(1, 1, 1), (3, 5, 2), (4, 0, 3), (4, 3, 0), (300, 16, 416)] {
        let (a, b) = (random(&mut rng, rows, ca), random(&mut rng, rows, cb));
        for fused in [false, true] {
            let what = format!(
                "[{rows}x{ca}] and [{rows}x{cb}]{}",
                if fused { " fused" } else { "" }
            );
            let nan = || Tensor::from_fn(2, 3, |_, _| f32::NAN);
            let (mut c, mut z, mut ab, mut a2, mut b2) = (nan(), nan(), nan(), nan(), nan());
            let mut ops = || {
                be.copy(&mut c, &a);
                be.zeros(&mut z, rows, cb);
                be.concat_columns(&a, &b, &mut ab);
                be.split_columns(&ab, ca, &mut a2, &mut b2);
            };
            if fused {
                // SAFETY: the buffers outlive the call and only ops touch them.
                unsafe { be.fused(&mut ops) };
            } else {
                ops();
            }
            compare(&format!("{what} copy"), &c, &a.cast())?;
            compare(&format!("{what} zeros"), &z, &Tensor::zeros(rows, cb))?;
            let want = Tensor::from_fn(rows, ca + cb, |r, col| {
                if col < ca {
                    a.row(r)[col] as f64
                } else {
                    b.row(r)[col - ca] as f64
                }
            });
            compare(&format!("{what} concat_columns"), &ab, &want)?;
            compare(&format!("{what} split_columns (left)"), &a2, &a.cast())?;
            compare(&format!("{what} split_columns (right)"), &b2, &b.cast())?;
            n += 1;
        }
    }
    Ok(n)
}

/// Buffers of [`check_fused_window`]'s chain.
#[derive(Default)]
struct Chain {
    xc: Tensor<f32>,
    y: Tensor<f32>,
    cat: Tensor<f32>,
    logits: Tensor<f32>,
    dlogits: Tensor<f32>,
    loss: f32,
    dw2: Tensor<f32>,
    db2: Vec<f32>,
    dcat: Tensor<f32>,
    dy: Tensor<f32>,
    dx_cat: Tensor<f32>,
    dw: Tensor<f32>,
    db: Vec<f32>,
    dx: Tensor<f32>,
    grown: Tensor<f32>,
}

impl Chain {
    /// Every output set to a sentinel (on the host, between windows), so an
    /// output a window fails to write shows. Finite, so that a backend that
    /// accumulates where it should overwrite fails only its own op's check.
    fn poison(&mut self) {
        const SENTINEL: f32 = 1e30;
        for t in [
            &mut self.xc,
            &mut self.y,
            &mut self.cat,
            &mut self.logits,
            &mut self.dlogits,
            &mut self.dw2,
            &mut self.dcat,
            &mut self.dy,
            &mut self.dx_cat,
            &mut self.dw,
            &mut self.dx,
            &mut self.grown,
        ] {
            t.fill(SENTINEL);
        }
        self.loss = SENTINEL;
        self.db.fill(SENTINEL);
        self.db2.fill(SENTINEL);
    }

    /// A small network's forward, loss and backward, with an output read by
    /// later ops, one overwritten in place, and one grown past its capacity.
    fn run<B: DenseBackend<f32> + ?Sized>(&mut self, be: &B, x: &Tensor<f32>, p: &ChainParams) {
        let (rows, out) = (x.rows(), p.w.rows());
        be.copy(&mut self.xc, x);
        be.linear_forward(&self.xc, &p.w, p.b.data(), Activation::Relu, &mut self.y);
        be.concat_columns(&self.y, &self.xc, &mut self.cat);
        be.linear_forward(&self.cat, &p.w2, &p.b2, Activation::None, &mut self.logits);
        be.bce_with_logits(
            self.logits.data(),
            &p.labels[..rows],
            &mut self.dlogits,
            &mut self.loss,
        );
        be.linear_backward(
            &self.cat,
            &p.w2,
            &self.logits,
            Activation::None,
            &mut self.dlogits,
            &mut self.dw2,
            &mut self.db2,
            Some(&mut self.dcat),
        );
        be.split_columns(&self.dcat, out, &mut self.dy, &mut self.dx_cat);
        be.linear_backward(
            &self.xc,
            &p.w,
            &self.y,
            Activation::Relu,
            &mut self.dy,
            &mut self.dw,
            &mut self.db,
            Some(&mut self.dx),
        );
        be.add_assign(&mut self.dx, &self.dx_cat);
        // Grown inside the window, past anything it held before.
        be.copy(&mut self.grown, &self.cat);
        be.concat_columns(&self.cat, &self.dcat, &mut self.grown);
    }

    fn outputs(&self) -> Vec<(&'static str, Tensor<f32>)> {
        let v = |v: &[f32]| Tensor::from_vec(1, v.len(), v.to_vec()).unwrap();
        vec![
            ("y", self.y.clone()),
            ("logits", self.logits.clone()),
            ("loss", v(&[self.loss])),
            ("dlogits", self.dlogits.clone()),
            ("dw2", self.dw2.clone()),
            ("db2", v(&self.db2)),
            ("dy", self.dy.clone()),
            ("dw", self.dw.clone()),
            ("db", v(&self.db)),
            ("dx", self.dx.clone()),
            ("dx_cat", self.dx_cat.clone()),
            ("grown", self.grown.clone()),
        ]
    }
}

struct ChainParams {
    w: Tensor<f32>,
    b: Tensor<f32>,
    w2: Tensor<f32>,
    b2: [f32; 1],
    labels: Vec<f32>,
}

/// The ops of a chain inside [`DenseBackend::fused`] give what they give one
/// at a time, over two windows on the same buffers (the second with fewer
/// rows: buffers shrink in place), with every output poisoned in between.
pub fn check_fused_window<B: DenseBackend<f32> + ?Sized>(be: &B) -> Result<usize, String> {
    let mut rng = Initializer::new(19);
    let (inp, out) = (12, 7);
    let p = ChainParams {
        w: random(&mut rng, out, inp),
        b: random(&mut rng, 1, out),
        w2: random(&mut rng, 1, out + inp),
        b2: [0.25],
        labels: (0..33).map(|r| (r % 3 == 0) as u8 as f32).collect(),
    };
    let inputs = [random(&mut rng, 33, inp), random(&mut rng, 20, inp)];
    let (mut eager, mut fused) = (Chain::default(), Chain::default());
    for (round, x) in inputs.iter().enumerate() {
        for c in [&mut eager, &mut fused] {
            c.db = vec![0.0; out];
            c.db2 = vec![0.0];
            c.poison();
        }
        eager.run(be, x, &p);
        let chain = &mut fused;
        // SAFETY: every buffer the ops are given lives in `fused`, `x` or `p`,
        // all of which outlive the call; `run` touches them through ops only.
        unsafe { be.fused(&mut || chain.run(be, x, &p)) };
        for ((what, got), (_, want)) in fused.outputs().into_iter().zip(eager.outputs()) {
            compare(&format!("round {round} {what}"), &got, &want.cast())?;
        }
    }
    Ok(2)
}

fn random(rng: &mut Initializer, rows: usize, cols: usize) -> Tensor<f32> {
    rng.uniform_tensor(rows, cols, 1.0)
}

/// Shape must match exactly; values within the norm-wise tolerance.
fn compare(what: &str, got: &Tensor<f32>, want: &Tensor<f64>) -> Result<(), String> {
    if got.shape() != want.shape() {
        return Err(format!(
            "{what}: shape {:?}, want {:?}",
            got.shape(),
            want.shape()
        ));
    }
    let scale = want.data().iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.data().iter().zip(want.data()).enumerate() {
        let err = (g as f64 - w).abs();
        // Written so that a NaN fails too.
        if err.is_nan() || err > TOL * scale {
            let (r, c) = (i / want.cols().max(1), i % want.cols().max(1));
            return Err(format!(
                "{what}: at [{r}, {c}] got {g}, want {w} (|err| {err:.3e} > {TOL:e} x {scale:.3})"
            ));
        }
    }
    Ok(())
}

/// Straightforward `f64` loops, written independently of any backend (also used by the
/// gradient-check and property tests).
pub mod reference {
    use crate::backend::Activation;
    use crate::tensor::Tensor;

    fn at(t: &Tensor<f64>, trans: bool, i: usize, j: usize) -> f64 {
        if trans {
            t.row(j)[i]
        } else {
            t.row(i)[j]
        }
    }

    /// `alpha * op(a) * op(b) + beta * c` (`c` ignored when `beta == 0`).
    pub fn matmul(
        a: &Tensor<f64>,
        ta: bool,
        b: &Tensor<f64>,
        tb: bool,
        alpha: f64,
        beta: f64,
        c: &Tensor<f64>,
    ) -> Tensor<f64> {
        let (m, k) = if ta {
            (a.cols(), a.rows())
        } else {
            (a.rows(), a.cols())
        };
        let p = if tb { b.rows() } else { b.cols() };
        Tensor::from_fn(m, p, |i, j| {
            let s: f64 = (0..k).map(|l| at(a, ta, i, l) * at(b, tb, l, j)).sum();
            alpha * s + if beta == 0.0 { 0.0 } else { beta * c.row(i)[j] }
        })
    }

    /// `act(z)` for one value.
    pub fn activate(z: f64, act: Activation) -> f64 {
        match act {
            Activation::None => z,
            Activation::Relu => z.max(0.0),
            Activation::Sigmoid => 1.0 / (1.0 + (-z).exp()),
        }
    }

    /// `act(x · wᵀ + b)`: `x` is `[n, in]`, `w` is `[out, in]`, `b` holds `out` values
    /// (e.g. `[1, out]`); the result is `[n, out]`.
    pub fn linear_forward(
        x: &Tensor<f64>,
        w: &Tensor<f64>,
        b: &Tensor<f64>,
        act: Activation,
    ) -> Tensor<f64> {
        Tensor::from_fn(x.rows(), w.rows(), |i, o| {
            let z: f64 = b.data()[o]
                + (0..x.cols())
                    .map(|l| x.row(i)[l] * w.row(o)[l])
                    .sum::<f64>();
            activate(z, act)
        })
    }

    /// The gradients [`linear_backward`] returns.
    pub struct LinearGrads {
        /// Gradient of the pre-activation, `[n, out]`.
        pub dz: Tensor<f64>,
        /// Gradient of the weight, `[out, in]`.
        pub dw: Tensor<f64>,
        /// Gradient of the bias, `[1, out]`.
        pub db: Tensor<f64>,
        /// Gradient of the input, `[n, in]`.
        pub dx: Tensor<f64>,
    }

    /// Backward of [`linear_forward`], given its input `x`, weight `w`, activated output `y`
    /// and `dy = dL/dy` (`[n, out]`).
    pub fn linear_backward(
        x: &Tensor<f64>,
        w: &Tensor<f64>,
        y: &Tensor<f64>,
        act: Activation,
        dy: &Tensor<f64>,
    ) -> LinearGrads {
        let dz = Tensor::from_fn(dy.rows(), dy.cols(), |i, o| {
            let (g, yv) = (dy.row(i)[o], y.row(i)[o]);
            match act {
                Activation::None => g,
                Activation::Relu => {
                    if yv > 0.0 {
                        g
                    } else {
                        0.0
                    }
                }
                Activation::Sigmoid => g * yv * (1.0 - yv),
            }
        });
        let dw = Tensor::from_fn(w.rows(), w.cols(), |o, l| {
            (0..x.rows()).map(|i| dz.row(i)[o] * x.row(i)[l]).sum()
        });
        let db = Tensor::from_fn(1, w.rows(), |_, o| {
            (0..x.rows()).map(|i| dz.row(i)[o]).sum()
        });
        let dx = Tensor::from_fn(x.rows(), x.cols(), |i, l| {
            (0..w.rows()).map(|o| dz.row(i)[o] * w.row(o)[l]).sum()
        });
        LinearGrads { dz, dw, db, dx }
    }

    /// The `F + 1` vectors of one sample.
    fn combined(dense: &Tensor<f64>, sparse: &Tensor<f64>, r: usize) -> Vec<Vec<f64>> {
        let d = dense.cols();
        let mut v = vec![dense.row(r).to_vec()];
        v.extend(sparse.row(r).chunks(d).map(|c| c.to_vec()));
        v
    }

    /// `[dense, <c_i, c_j> for i < j]` per sample over `c = [dense, sparse_0, ..]`: `dense` is
    /// `[n, D]`, `sparse` `[n, F * D]`, the result `[n, D + F(F+1)/2]` (as
    /// [`DenseBackend::dot_interaction_forward`](crate::DenseBackend::dot_interaction_forward)).
    pub fn dot_interaction_forward(dense: &Tensor<f64>, sparse: &Tensor<f64>) -> Tensor<f64> {
        let d = dense.cols();
        let nv = sparse.cols() / d + 1;
        let mut out = Tensor::zeros(dense.rows(), d + nv * (nv - 1) / 2);
        for r in 0..dense.rows() {
            let c = combined(dense, sparse, r);
            let mut row = dense.row(r).to_vec();
            for i in 0..nv {
                for j in i + 1..nv {
                    row.push((0..d).map(|l| c[i][l] * c[j][l]).sum());
                }
            }
            out.row_mut(r).copy_from_slice(&row);
        }
        out
    }

    /// `(ddense [n, D], dsparse [n, F * D])` of [`dot_interaction_forward`] given `dout`.
    pub fn dot_interaction_backward(
        dense: &Tensor<f64>,
        sparse: &Tensor<f64>,
        dout: &Tensor<f64>,
    ) -> (Tensor<f64>, Tensor<f64>) {
        let d = dense.cols();
        let nv = sparse.cols() / d + 1;
        let mut dd = Tensor::zeros(dense.rows(), d);
        let mut ds = Tensor::zeros(sparse.rows(), sparse.cols());
        for r in 0..dense.rows() {
            let c = combined(dense, sparse, r);
            let mut dc = vec![vec![0.0; d]; nv];
            dc[0].copy_from_slice(&dout.row(r)[..d]);
            let mut k = d;
            for i in 0..nv {
                for j in i + 1..nv {
                    let g = dout.row(r)[k];
                    for l in 0..d {
                        dc[i][l] += g * c[j][l];
                        dc[j][l] += g * c[i][l];
                    }
                    k += 1;
                }
            }
            dd.row_mut(r).copy_from_slice(&dc[0]);
            for (f, v) in dc[1..].iter().enumerate() {
                ds.row_mut(r)[f * d..(f + 1) * d].copy_from_slice(v);
            }
        }
        (dd, ds)
    }

    /// `x0 ⊙ (h + b) + xl`, all `[n, cols]` but `b`, which holds `cols` values broadcast over
    /// rows.
    pub fn cross_combine_forward(
        x0: &Tensor<f64>,
        h: &Tensor<f64>,
        b: &Tensor<f64>,
        xl: &Tensor<f64>,
    ) -> Tensor<f64> {
        Tensor::from_fn(x0.rows(), x0.cols(), |i, j| {
            x0.row(i)[j] * (h.row(i)[j] + b.data()[j]) + xl.row(i)[j]
        })
    }

    /// `(dh, db [1, cols], dx0_before + dout ⊙ (h + b))`.
    pub fn cross_combine_backward(
        x0: &Tensor<f64>,
        h: &Tensor<f64>,
        b: &Tensor<f64>,
        dout: &Tensor<f64>,
        dx0_before: &Tensor<f64>,
    ) -> (Tensor<f64>, Tensor<f64>, Tensor<f64>) {
        let dh = Tensor::from_fn(x0.rows(), x0.cols(), |i, j| dout.row(i)[j] * x0.row(i)[j]);
        let db = Tensor::from_fn(1, x0.cols(), |_, j| {
            (0..x0.rows()).map(|i| dh.row(i)[j]).sum()
        });
        let dx0 = Tensor::from_fn(x0.rows(), x0.cols(), |i, j| {
            dx0_before.row(i)[j] + dout.row(i)[j] * (h.row(i)[j] + b.data()[j])
        });
        (dh, db, dx0)
    }

    /// `(mean loss, dlogits)`, the loss from `-(y ln p + (1-y) ln(1-p))` in a stable form.
    pub fn bce_with_logits(logits: &[f64], labels: &[f64]) -> (f64, Vec<f64>) {
        let n = logits.len() as f64;
        let mut loss = 0.0;
        let mut grad = Vec::with_capacity(logits.len());
        for (&z, &y) in logits.iter().zip(labels) {
            // ln p = -ln(1 + e^{-z}), ln(1 - p) = -ln(1 + e^{z}); softplus written stably.
            let softplus = |t: f64| {
                if t > 0.0 {
                    t + (-t).exp().ln_1p()
                } else {
                    t.exp().ln_1p()
                }
            };
            loss += y * softplus(-z) + (1.0 - y) * softplus(z);
            grad.push((1.0 / (1.0 + (-z).exp()) - y) / n);
        }
        (loss / n, grad)
    }
}
