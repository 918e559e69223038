//! Optimizers against values worked out by hand (torch's update formulas, three steps).

use ember_dense::{clip_grad_norm, DenseOptimizer, DenseOptimizerConfig, Param, WeightDecay};

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

/// Three steps with `decay` and a learning rate set before each (a
/// schedule's), returning the values after each.
fn run_decayed(config: DenseOptimizerConfig, decay: WeightDecay, rates: [f32; 3]) -> Vec<[f64; 3]> {
    let mut opt = DenseOptimizer::<f64>::new(config);
    opt.set_weight_decay(decay);
    let mut p = P0;
    let mut out = Vec::new();
    for (mut g, lr) in GRADS.into_iter().zip(rates) {
        opt.set_learning_rate(Some(lr));
        opt.step(vec![Param::new("w", &mut p, &mut g)]);
        out.push(p);
    }
    assert_eq!(opt.config(), config, "the config keeps its own rate");
    out
}

/// One step of a rule by hand: the value, its gradient, the rate, the step
/// (from 1) and two state vectors.
type Rule<'a> = dyn Fn(&mut [f64; 3], &[f64; 3], f64, u64, &mut [[f64; 3]; 2]) + 'a;

/// torch's rules by hand in f64, at rates changing every step: L2 decay
/// adds `decay * w` to the gradient (SGD, Adagrad, Adam's `weight_decay`);
/// decoupled decay (AdamW) shrinks `w` by `lr * decay` first.
#[test]
fn weight_decay_and_scheduled_rates_match_torch_rules() {
    let rates = [0.5, 0.25, 0.125];
    let decay = 0.0625;
    let reference = |rule: &Rule<'_>| {
        let (mut p, mut state, mut out) = (P0, [[0.0; 3]; 2], Vec::new());
        for (t, (g, lr)) in GRADS.iter().zip(rates).enumerate() {
            rule(&mut p, g, lr as f64, t as u64 + 1, &mut state);
            out.push(p);
        }
        out
    };
    let sgd_l2 = reference(&|p, g, lr, _, _| {
        for i in 0..3 {
            p[i] -= lr * (g[i] + decay * p[i]);
        }
    });
    let adagrad_l2 = reference(&|p, g, lr, _, s| {
        for i in 0..3 {
            let g = g[i] + decay * p[i];
            s[0][i] += g * g;
            p[i] -= lr * g / (s[0][i].sqrt() + 1e-10);
        }
    });
    let adam = |decoupled: bool| {
        move |p: &mut [f64; 3], g: &[f64; 3], lr: f64, t: u64, s: &mut [[f64; 3]; 2]| {
            let (b1, b2, eps) = (0.875f64, 1.0 - 1.0 / 1024.0, 1e-8);
            for i in 0..3 {
                let g = if decoupled {
                    p[i] *= 1.0 - lr * decay;
                    g[i]
                } else {
                    g[i] + decay * p[i]
                };
                s[0][i] = b1 * s[0][i] + (1.0 - b1) * g;
                s[1][i] = b2 * s[1][i] + (1.0 - b2) * g * g;
                let m = s[0][i] / (1.0 - b1.powi(t as i32));
                let v = s[1][i] / (1.0 - b2.powi(t as i32));
                p[i] -= lr * m / (v.sqrt() + eps);
            }
        }
    };
    let adam_config = DenseOptimizerConfig::Adam {
        lr: 1.0,
        beta1: 0.875,
        beta2: 1.0 - 1.0 / 1024.0,
        eps: 1e-8,
    };
    let cases = [
        (
            DenseOptimizerConfig::sgd(1.0),
            WeightDecay::L2(decay as f32),
            sgd_l2,
        ),
        (
            DenseOptimizerConfig::adagrad(1.0),
            WeightDecay::L2(decay as f32),
            adagrad_l2,
        ),
        (
            adam_config,
            WeightDecay::L2(decay as f32),
            reference(&adam(false)),
        ),
        (
            adam_config,
            WeightDecay::Decoupled(decay as f32),
            reference(&adam(true)),
        ),
    ];
    for (config, wd, want) in cases {
        let got = run_decayed(config, wd, rates);
        for (step, (g, w)) in got.iter().zip(want).enumerate() {
            assert_close(g, w, &format!("{config:?} {wd:?} step {}", step + 1));
        }
    }
}

/// torch's `clip_grad_norm_`: the global L2 norm over every parameter;
/// above the maximum, every gradient scaled by `max / (norm + 1e-6)`;
/// below it, left alone.
#[test]
fn clip_grad_norm_scales_by_the_global_norm() {
    let (mut a, mut b) = ([0.0f64; 2], [0.0f64; 1]);
    let (mut ga, mut gb) = ([3.0f64, 0.0], [4.0f64]);
    let mut params = vec![
        Param::new("a", &mut a, &mut ga),
        Param::new("b", &mut b, &mut gb),
    ];
    let norm = clip_grad_norm(&mut params, 1.0);
    assert_eq!(norm, 5.0);
    let c = 1.0 / (5.0 + 1e-6);
    assert_eq!((ga, gb), ([3.0 * c, 0.0], [4.0 * c]));
    let (mut ga, mut gb) = ([0.3f64, 0.0], [0.4f64]);
    let mut params = vec![
        Param::new("a", &mut a, &mut ga),
        Param::new("b", &mut b, &mut gb),
    ];
    assert!((clip_grad_norm(&mut params, 1.0) - 0.5).abs() < 1e-15);
    assert_eq!(
        (ga, gb),
        ([0.3, 0.0], [0.4]),
        "below the maximum: unchanged"
    );
}
