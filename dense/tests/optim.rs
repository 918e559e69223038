//! Optimizers against values worked out by hand (torch's update formulas, three steps).

use ember_dense::{DenseOptimizer, DenseOptimizerConfig, Param};

const P0: [f64; 3] = [1.0, -2.0, 0.5];
const GRADS: [[f64; 3]; 3] = [[0.1, -0.2, 0.3], [0.4, 0.0, -0.1], [-0.2, 0.5, 0.05]];

/// Runs three steps on one parameter (plus an untouched second one, to exercise the state
/// keying) and returns the value after each step.
fn run(config: DenseOptimizerConfig) -> Vec<[f64; 3]> {
    let mut opt = DenseOptimizer::<f64>::new(config);
    let mut p = P0;
    let mut other = [3.0f64; 2];
    let mut zero = [0.0f64; 2];
    let mut out = Vec::new();
    for mut g in GRADS {
        opt.step(vec![
            Param::new("w", &mut p, &mut g),
            Param::new("b", &mut other, &mut zero),
        ]);
        out.push(p);
    }
    assert_eq!(
        other, [3.0; 2],
        "a zero gradient must leave the parameter alone"
    );
    assert_eq!(opt.steps(), 3);
    out
}

fn assert_close(got: &[f64; 3], want: [f64; 3], what: &str) {
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-12, "{what}: got {got:?}, want {want:?}");
    }
}

// Learning rates and betas are exact binary fractions, so the f32 config fields carry them
// into the f64 update unchanged.

#[test]
fn sgd_matches_hand_computed() {
    let steps = run(DenseOptimizerConfig::sgd(0.125));
    // p -= 0.125 g each step.
    assert_close(&steps[0], [0.9875, -1.975, 0.4625], "step 1");
    assert_close(&steps[1], [0.9375, -1.975, 0.475], "step 2");
    assert_close(&steps[2], [0.9625, -2.0375, 0.46875], "step 3");
}

#[test]
fn adagrad_matches_hand_computed() {
    let steps = run(DenseOptimizerConfig::Adagrad {
        lr: 0.25,
        eps: 1e-10,
    });
    // Step 1: s = g², so p -= 0.25 · g/(|g| + 1e-10), e.g. 1 - 0.25·0.1/(0.1 + 1e-10).
    assert_close(
        &steps[0],
        [0.75000000025, -1.750000000125, 0.25000000008333334],
        "step 1",
    );
    // Step 2: s = [0.17, 0.04, 0.1]; the zero gradient leaves p[1] alone.
    assert_close(
        &steps[1],
        [0.5074643752724906, -1.750000000125, 0.32905694156254284],
        "step 2",
    );
    assert_close(
        &steps[2],
        [0.6165733203666772, -1.9821191728032113, 0.29001350110258645],
        "step 3",
    );
}

#[test]
fn adam_matches_hand_computed() {
    let steps = run(DenseOptimizerConfig::Adam {
        lr: 0.015625,
        beta1: 0.875,
        beta2: 1.0 - 1.0 / 1024.0,
        eps: 1e-8,
    });
    // Step 1: bias-corrected m̂ = g, v̂ = g², so p -= lr · g/(|g| + 1e-8).
    assert_close(
        &steps[0],
        [0.9843750015624998, -1.98437500078125, 0.4843750005208333],
        "step 1",
    );
    assert_close(
        &steps[1],
        [0.9704437441864607, -1.9740605078935953, 0.4783177996119958],
        "step 2",
    );
    assert_close(
        &steps[2],
        [0.965377081116041, -1.9806597535609276, 0.4721629383404289],
        "step 3",
    );
}

#[test]
fn f32_adam_follows_f64() {
    let config = DenseOptimizerConfig::adam(0.01);
    let mut o32 = DenseOptimizer::<f32>::new(config);
    let mut o64 = DenseOptimizer::<f64>::new(config);
    // Big enough to take the parallel path.
    let n = 70_000;
    let mut p32: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut p64: Vec<f64> = p32.iter().map(|&v| v as f64).collect();
    for s in 0..3 {
        let mut g32: Vec<f32> = (0..n).map(|i| ((i + s * 7) as f32 * 0.11).cos()).collect();
        let mut g64: Vec<f64> = g32.iter().map(|&v| v as f64).collect();
        o32.step(vec![Param::new("w", &mut p32, &mut g32)]);
        o64.step(vec![Param::new("w", &mut p64, &mut g64)]);
    }
    for (a, b) in p32.iter().zip(&p64) {
        assert!((*a as f64 - b).abs() < 1e-6, "{a} vs {b}");
    }
}

#[test]
#[should_panic(expected = "parameter #0 is `v")]
fn state_is_checked_against_the_parameters() {
    let mut opt = DenseOptimizer::<f64>::new(DenseOptimizerConfig::adagrad(0.1));
    let (mut a, mut g) = ([1.0; 2], [0.5; 2]);
    opt.step(vec![Param::new("w", &mut a, &mut g)]);
    opt.step(vec![Param::new("v", &mut a, &mut g)]);
}
