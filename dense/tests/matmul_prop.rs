//! Property test: the native matmul equals the reference for random shapes, transposes and
//! scalars, in f64 (tight) and f32 (norm-wise 1e-5).

use ember_dense::conformance::reference;
use ember_dense::{DenseBackend, Initializer, NativeBackend, Tensor};
use proptest::prelude::*;

fn operand(rng: &mut Initializer, rows: usize, cols: usize, trans: bool) -> Tensor<f64> {
    if trans {
        rng.uniform_tensor(cols, rows, 1.0)
    } else {
        rng.uniform_tensor(rows, cols, 1.0)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn matmul_matches_reference(
        m in 0usize..48, k in 0usize..48, n in 0usize..48,
        ta: bool, tb: bool,
        alpha in -2.0f64..2.0, beta in prop_oneof![Just(0.0f64), -2.0f64..2.0],
        threads in 1usize..3, seed: u64,
    ) {
        let mut rng = Initializer::new(seed);
        let a = operand(&mut rng, m, k, ta);
        let b = operand(&mut rng, k, n, tb);
        let c0 = rng.uniform_tensor(m, n, 1.0);
        let want = reference::matmul(&a, ta, &b, tb, alpha, beta, &c0);
        let be = NativeBackend::new(threads);

        let mut c = if beta == 0.0 { Tensor::zeros(3, 1) } else { c0.clone() };
        be.matmul(&a, ta, &b, tb, alpha, beta, &mut c);
        prop_assert_eq!(c.shape(), (m, n));
        for (g, w) in c.data().iter().zip(want.data()) {
            prop_assert!((g - w).abs() <= 1e-12 * (1.0 + w.abs()) * (k as f64 + 1.0), "{} vs {}", g, w);
        }

        let (a32, b32): (Tensor<f32>, Tensor<f32>) = (a.cast(), b.cast());
        let mut c32: Tensor<f32> = if beta == 0.0 { Tensor::zeros(0, 0) } else { c0.cast() };
        be.matmul(&a32, ta, &b32, tb, alpha as f32, beta as f32, &mut c32);
        let want32 = reference::matmul(&a32.cast(), ta, &b32.cast(), tb, alpha as f32 as f64, beta as f32 as f64, &c0.cast::<f32>().cast());
        let scale = want32.data().iter().fold(1.0f64, |s, v| s.max(v.abs()));
        for (g, w) in c32.data().iter().zip(want32.data()) {
            prop_assert!((*g as f64 - w).abs() <= 1e-5 * scale, "{} vs {}", g, w);
        }
    }
}
