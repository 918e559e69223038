//! Causal multi-head self-attention (torch's `nn.MultiheadAttention` with a
//! causal mask) against the equations written as loops, and its backward
//! against finite differences in f64.

use ember_dense::jagged::Jagged;
use ember_dense::{HasParams, Initializer, MultiheadAttention, NativeBackend, Tensor};

const LENGTHS: [usize; 4] = [3, 0, 1, 5];

fn layer() -> MultiheadAttention<f64> {
    let mut l = MultiheadAttention::<f64>::new(4, 2, 1);
    let mut init = Initializer::new(2);
    for p in l.params() {
        for v in p.value.iter_mut() {
            *v = init.uniform(-0.7, 0.7);
        }
    }
    l
}

fn input() -> Jagged<f64> {
    Jagged::from_lengths(Initializer::new(3).uniform_tensor(9, 4, 1.0), &LENGTHS).unwrap()
}

/// torch's causal self-attention written as loops, one sample at a time.
fn reference(l: &MultiheadAttention<f64>, x: &Jagged<f64>) -> Vec<f64> {
    let (d, heads) = (4, 2);
    let hd = d / heads;
    let proj = |w: &Tensor<f64>, b: &[f64], row: &[f64]| -> Vec<f64> {
        (0..w.rows())
            .map(|o| b[o] + (0..w.cols()).map(|i| w.row(o)[i] * row[i]).sum::<f64>())
            .collect()
    };
    let mut out = Vec::new();
    for s in 0..x.batch() {
        let rows: Vec<&[f64]> = x.segment(s).chunks(d).collect();
        let qkv: Vec<Vec<f64>> = rows
            .iter()
            .map(|r| proj(&l.in_proj.weight, &l.in_proj.bias, r))
            .collect();
        for i in 0..rows.len() {
            let mut attn = vec![0.0; d];
            for h in 0..heads {
                let score = |j: usize| -> f64 {
                    (0..hd)
                        .map(|c| qkv[i][h * hd + c] * qkv[j][d + h * hd + c])
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                };
                let max = (0..=i).map(score).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = (0..=i).map(|j| (score(j) - max).exp()).sum();
                for (j, kv) in qkv.iter().enumerate().take(i + 1) {
                    let p = (score(j) - max).exp() / z;
                    for c in 0..hd {
                        attn[h * hd + c] += p * kv[2 * d + h * hd + c];
                    }
                }
            }
            out.extend(proj(&l.out_proj.weight, &l.out_proj.bias, &attn));
        }
    }
    out
}

#[test]
fn forward_matches_the_equations_and_backward_finite_differences() {
    let be = NativeBackend::new(1);
    let (mut l, x) = (layer(), input());
    let fresh = l.clone();
    let y = l.forward(&be, &x);
    let want = reference(&l, &x);
    for (g, w) in y.values().data().iter().zip(&want) {
        assert!((g - w).abs() < 1e-12, "{g} vs {w}");
    }
    check_gradients(&mut l, &fresh, &x);
}

#[test]
fn dropout_masks_are_drawn_again_by_the_backward() {
    let be = NativeBackend::new(1);
    let (mut l, x) = (layer(), input());
    l.set_dropout(0.3);
    // Each forward draws its own masks: probes start from before the forward.
    let fresh = l.clone();
    let y = l.forward(&be, &x);
    let mut plain = fresh.clone();
    plain.set_dropout(0.0);
    assert_ne!(y, plain.forward(&be, &x), "some weights are dropped");
    check_gradients(&mut l, &fresh, &x);
}

/// Backpropagates `Σ r ⊙ y` through `trained` (just after its forward on
/// `x`) and checks the input's and every parameter's gradient against
/// central differences of that loss, each probe a copy of `fresh` (the
/// layer before that forward, so that probes draw its dropout masks).
fn check_gradients(
    trained: &mut MultiheadAttention<f64>,
    fresh: &MultiheadAttention<f64>,
    x: &Jagged<f64>,
) {
    let be = NativeBackend::new(1);
    let r: Vec<f64> = Initializer::new(4).uniform_vec(x.values().len(), 1.0);
    let dy = Jagged::new(
        Tensor::from_vec(x.total_len(), x.dim(), r.clone()).unwrap(),
        x.offsets().to_vec(),
    )
    .unwrap();
    let dx = trained.backward(&be, &dy);
    let loss = |mut probe: MultiheadAttention<f64>, x: &Jagged<f64>| -> f64 {
        let y = probe.forward(&be, x);
        y.values().data().iter().zip(&r).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-6;
    let close = |what: String, g: f64, numeric: f64| {
        assert!(
            (numeric - g).abs() < 1e-6 * (1.0 + g.abs()),
            "{what}: {g} vs {numeric}"
        );
    };
    for (i, &g) in dx.values().data().iter().enumerate() {
        let at = |v: f64| {
            let mut x = x.clone();
            x.values_mut().data_mut()[i] = v;
            loss(fresh.clone(), &x)
        };
        let v = x.values().data()[i];
        close(
            format!("x[{i}]"),
            g,
            (at(v + eps) - at(v - eps)) / (2.0 * eps),
        );
    }
    let grads: Vec<(String, Vec<f64>)> = trained
        .params()
        .into_iter()
        .map(|p| (p.name, p.grad.to_vec()))
        .collect();
    for (k, (name, grad)) in grads.iter().enumerate() {
        for (i, &g) in grad.iter().enumerate() {
            let at = |v: f64| {
                let mut probe = fresh.clone();
                probe.params()[k].value[i] = v;
                loss(probe, x)
            };
            let v = fresh.clone().params()[k].value[i];
            close(
                format!("{name}[{i}]"),
                g,
                (at(v + eps) - at(v - eps)) / (2.0 * eps),
            );
        }
    }
}
