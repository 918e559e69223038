//! The backend conformance suite on the native backend, and proof that the suite catches bugs.

use ember_dense::conformance::run_all;
use ember_dense::{Activation, DenseBackend, NativeBackend, Tensor};

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

#[test]
fn native_one_thread() {
    let n = pool(1)
        .install(|| run_all(&NativeBackend::new(1)))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(n >= 90, "only {n} checks ran");
}

#[test]
fn native_two_threads() {
    pool(2)
        .install(|| run_all(&NativeBackend::new(2)))
        .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn native_through_a_trait_object() {
    let be: Box<dyn DenseBackend<f32>> = Box::new(NativeBackend::new(2));
    run_all(be.as_ref()).unwrap_or_else(|e| panic!("{e}"));
}

/// Native backend with one deliberate bug, to show each check can fail.
struct Broken(NativeBackend, Bug);

#[derive(Clone, Copy, Debug)]
enum Bug {
    MatmulIgnoresBeta,
    ReluLeaksNegatives,
    BiasGradAccumulates,
    InteractionSkipsLastPair,
    CrossDx0Overwrites,
    BceUnscaled,
    ConcatSwaps,
}

impl DenseBackend<f32> for Broken {
    fn name(&self) -> &'static str {
        "broken"
    }
    fn matmul(
        &self,
        a: &Tensor<f32>,
        ta: bool,
        b: &Tensor<f32>,
        tb: bool,
        alpha: f32,
        beta: f32,
        c: &mut Tensor<f32>,
    ) {
        let beta = if matches!(self.1, Bug::MatmulIgnoresBeta) && beta != 0.0 {
            1.0
        } else {
            beta
        };
        self.0.matmul(a, ta, b, tb, alpha, beta, c)
    }
    fn linear_forward(
        &self,
        x: &Tensor<f32>,
        w: &Tensor<f32>,
        b: &[f32],
        act: Activation,
        y: &mut Tensor<f32>,
    ) {
        if matches!(self.1, Bug::ReluLeaksNegatives) && act == Activation::Relu {
            self.0.linear_forward(x, w, b, Activation::None, y);
            y.data_mut().iter_mut().for_each(|v| *v = v.max(-0.01));
        } else {
            self.0.linear_forward(x, w, b, act, y)
        }
    }
    fn linear_backward(
        &self,
        x: &Tensor<f32>,
        w: &Tensor<f32>,
        y: &Tensor<f32>,
        act: Activation,
        dy: &mut Tensor<f32>,
        dw: &mut Tensor<f32>,
        db: &mut [f32],
        dx: Option<&mut Tensor<f32>>,
    ) {
        let before = db.to_vec();
        self.0.linear_backward(x, w, y, act, dy, dw, db, dx);
        if matches!(self.1, Bug::BiasGradAccumulates) {
            db.iter_mut().zip(before).for_each(|(d, b)| *d += b);
        }
    }
    fn dot_interaction_forward(
        &self,
        dense: &Tensor<f32>,
        sparse: &Tensor<f32>,
        out: &mut Tensor<f32>,
    ) {
        self.0.dot_interaction_forward(dense, sparse, out);
        if matches!(self.1, Bug::InteractionSkipsLastPair) {
            let c = out.cols();
            for r in 0..out.rows() {
                out.row_mut(r)[c - 1] = 0.0;
            }
        }
    }
    fn dot_interaction_backward(
        &self,
        d: &Tensor<f32>,
        s: &Tensor<f32>,
        g: &Tensor<f32>,
        dd: &mut Tensor<f32>,
        ds: &mut Tensor<f32>,
    ) {
        self.0.dot_interaction_backward(d, s, g, dd, ds)
    }
    fn cross_combine_forward(
        &self,
        x0: &Tensor<f32>,
        h: &Tensor<f32>,
        b: &[f32],
        xl: &Tensor<f32>,
        out: &mut Tensor<f32>,
    ) {
        self.0.cross_combine_forward(x0, h, b, xl, out)
    }
    fn cross_combine_backward(
        &self,
        x0: &Tensor<f32>,
        h: &Tensor<f32>,
        b: &[f32],
        dout: &Tensor<f32>,
        dh: &mut Tensor<f32>,
        db: &mut [f32],
        dx0: &mut Tensor<f32>,
    ) {
        if matches!(self.1, Bug::CrossDx0Overwrites) {
            dx0.fill(0.0);
        }
        self.0.cross_combine_backward(x0, h, b, dout, dh, db, dx0)
    }
    fn add_assign(&self, y: &mut Tensor<f32>, x: &Tensor<f32>) {
        DenseBackend::<f32>::add_assign(&self.0, y, x)
    }
    fn bce_with_logits(
        &self,
        logits: &[f32],
        labels: &[f32],
        dlogits: &mut Tensor<f32>,
        loss: &mut f32,
    ) {
        self.0.bce_with_logits(logits, labels, dlogits, loss);
        if matches!(self.1, Bug::BceUnscaled) {
            dlogits
                .data_mut()
                .iter_mut()
                .for_each(|g| *g *= logits.len() as f32);
        }
    }
    fn copy(&self, dst: &mut Tensor<f32>, src: &Tensor<f32>) {
        DenseBackend::<f32>::copy(&self.0, dst, src)
    }
    fn zeros(&self, t: &mut Tensor<f32>, rows: usize, cols: usize) {
        DenseBackend::<f32>::zeros(&self.0, t, rows, cols)
    }
    fn concat_columns(&self, a: &Tensor<f32>, b: &Tensor<f32>, out: &mut Tensor<f32>) {
        match self.1 {
            Bug::ConcatSwaps => self.0.concat_columns(b, a, out),
            _ => self.0.concat_columns(a, b, out),
        }
    }
    fn split_columns(
        &self,
        x: &Tensor<f32>,
        cols_a: usize,
        a: &mut Tensor<f32>,
        b: &mut Tensor<f32>,
    ) {
        self.0.split_columns(x, cols_a, a, b)
    }
}

#[test]
fn the_suite_catches_each_planted_bug() {
    for bug in [
        Bug::MatmulIgnoresBeta,
        Bug::ReluLeaksNegatives,
        Bug::BiasGradAccumulates,
        Bug::InteractionSkipsLastPair,
        Bug::CrossDx0Overwrites,
        Bug::BceUnscaled,
        Bug::ConcatSwaps,
    ] {
        let err = run_all(&Broken(NativeBackend::new(1), bug))
            .expect_err(&format!("{bug:?} went unnoticed"));
        assert_eq!(
            err.lines().count(),
            1,
            "{bug:?} should fail exactly one check:\n{err}"
        );
    }
}
