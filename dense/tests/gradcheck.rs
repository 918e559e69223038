//! Central finite differences in f64 against every layer's analytic gradients, with respect to
//! inputs and parameters. Each check uses the scalar loss `L = Σ r ⊙ output` with a fixed random
//! `r`, so `dL/doutput = r`.

use ember_dense::{
    Activation, BceWithLogits, DenseBackend, DotInteraction, Initializer, Linear, LowRankCrossNet,
    Mlp, NativeBackend, Tensor,
};

const EPS: f64 = 1e-6;
const TOL: f64 = 1e-6;

fn be() -> NativeBackend {
    NativeBackend::new(1)
}

fn random(rng: &mut Initializer, rows: usize, cols: usize) -> Tensor<f64> {
    rng.uniform_tensor(rows, cols, 1.0)
}

fn weighted_sum(out: &Tensor<f64>, r: &Tensor<f64>) -> f64 {
    out.data().iter().zip(r.data()).map(|(a, b)| a * b).sum()
}

/// Compares `analytic[i]` with `(L(v_i + eps) - L(v_i - eps)) / 2 eps`, where
/// `eval(i, v)` sets element `i` to `v`, returns the loss, and restores it.
fn check(what: &str, values: &[f64], analytic: &[f64], mut eval: impl FnMut(usize, f64) -> f64) {
    assert_eq!(
        values.len(),
        analytic.len(),
        "{what}: gradient has the wrong length"
    );
    assert!(!values.is_empty());
    let mut worst = 0.0f64;
    for (i, &v) in values.iter().enumerate() {
        let numeric = (eval(i, v + EPS) - eval(i, v - EPS)) / (2.0 * EPS);
        let err = (numeric - analytic[i]).abs() / (1.0 + analytic[i].abs());
        worst = worst.max(err);
        assert!(
            err <= TOL,
            "{what}[{i}]: analytic {} vs numeric {numeric} (rel err {err:.2e})",
            analytic[i]
        );
    }
    assert!(worst.is_finite());
}

fn linear_case(act: Activation) {
    let be = be();
    let mut rng = Initializer::new(1);
    let mut layer = Linear::<f64>::new(4, 3, act, 7);
    let x = random(&mut rng, 5, 4);
    let r = random(&mut rng, 5, 3);
    let loss = |l: &Linear<f64>, x: &Tensor<f64>| {
        let mut y = Tensor::zeros(0, 0);
        l.forward(&be, x, &mut y);
        weighted_sum(&y, &r)
    };
    let mut y = Tensor::zeros(0, 0);
    layer.forward(&be, &x, &mut y);
    let (mut dy, mut dx) = (r.clone(), Tensor::zeros(0, 0));
    layer.backward(&be, &x, &y, &mut dy, Some(&mut dx));

    let name = format!("Linear {act:?}");
    let mut xp = x.clone();
    check(&format!("{name} dx"), x.data(), dx.data(), |i, v| {
        xp.data_mut()[i] = v;
        let l = loss(&layer, &xp);
        xp.data_mut()[i] = x.data()[i];
        l
    });
    let (w, wg) = (
        layer.weight.data().to_vec(),
        layer.weight_grad.data().to_vec(),
    );
    let mut probe = layer.clone();
    check(&format!("{name} dweight"), &w, &wg, |i, v| {
        probe.weight.data_mut()[i] = v;
        let l = loss(&probe, &x);
        probe.weight.data_mut()[i] = w[i];
        l
    });
    let (b, bg) = (layer.bias.clone(), layer.bias_grad.clone());
    check(&format!("{name} dbias"), &b, &bg, |i, v| {
        probe.bias[i] = v;
        let l = loss(&probe, &x);
        probe.bias[i] = b[i];
        l
    });
}

#[test]
fn linear_none() {
    linear_case(Activation::None);
}

#[test]
fn linear_relu() {
    linear_case(Activation::Relu);
}

#[test]
fn linear_sigmoid() {
    linear_case(Activation::Sigmoid);
}

fn mlp_case(final_activation: Activation) {
    let be = be();
    let mut rng = Initializer::new(2);
    let mut mlp = Mlp::<f64>::new(&[5, 8, 6, 3], final_activation, 3);
    let x = random(&mut rng, 6, 5);
    let r = random(&mut rng, 6, 3);
    mlp.forward(&be, &x);
    let dx = mlp.backward(&be, &r, true).unwrap().clone();
    let mut probe = mlp.clone();
    let loss = |m: &mut Mlp<f64>, x: &Tensor<f64>| weighted_sum(m.forward(&be, x), &r);

    let mut xp = x.clone();
    check("Mlp dx", x.data(), dx.data(), |i, v| {
        xp.data_mut()[i] = v;
        let l = loss(&mut probe, &xp);
        xp.data_mut()[i] = x.data()[i];
        l
    });
    for k in 0..mlp.layers().len() {
        let lay = &mlp.layers()[k];
        let (w, wg) = (lay.weight.data().to_vec(), lay.weight_grad.data().to_vec());
        check(&format!("Mlp layer {k} dweight"), &w, &wg, |i, v| {
            probe.layers_mut()[k].weight.data_mut()[i] = v;
            let l = loss(&mut probe, &x);
            probe.layers_mut()[k].weight.data_mut()[i] = w[i];
            l
        });
        let (b, bg) = (lay.bias.clone(), lay.bias_grad.clone());
        check(&format!("Mlp layer {k} dbias"), &b, &bg, |i, v| {
            probe.layers_mut()[k].bias[i] = v;
            let l = loss(&mut probe, &x);
            probe.layers_mut()[k].bias[i] = b[i];
            l
        });
    }
}

#[test]
fn mlp_final_none() {
    mlp_case(Activation::None);
}

#[test]
fn mlp_final_relu() {
    mlp_case(Activation::Relu);
}

/// `d = 5` takes the generic kernel, `d = 8` a fixed-size one.
#[test]
fn dot_interaction() {
    dot_interaction_case(3, 3, 5);
    dot_interaction_case(2, 4, 8);
}

fn dot_interaction_case(n: usize, f: usize, d: usize) {
    let be = be();
    let mut rng = Initializer::new(4);
    let mut inter = DotInteraction::<f64>::new(f, d);
    let dense = random(&mut rng, n, d);
    let sparse = random(&mut rng, n, f * d);
    let r = random(&mut rng, n, inter.output_dim());
    inter.forward(&be, &dense, &sparse);
    let (dd, ds) = inter.backward(&be, &r);
    let (dd, ds) = (dd.clone(), ds.clone());
    let mut probe = DotInteraction::<f64>::new(f, d);
    let mut loss = |a: &Tensor<f64>, b: &Tensor<f64>| weighted_sum(probe.forward(&be, a, b), &r);

    let mut dp = dense.clone();
    check("DotInteraction ddense", dense.data(), dd.data(), |i, v| {
        dp.data_mut()[i] = v;
        let l = loss(&dp, &sparse);
        dp.data_mut()[i] = dense.data()[i];
        l
    });
    let mut sp = sparse.clone();
    check(
        "DotInteraction dsparse",
        sparse.data(),
        ds.data(),
        |i, v| {
            sp.data_mut()[i] = v;
            let l = loss(&dense, &sp);
            sp.data_mut()[i] = sparse.data()[i];
            l
        },
    );
}

#[test]
fn low_rank_cross_net() {
    let be = be();
    let mut rng = Initializer::new(5);
    let (n, inp, layers, rank) = (4, 6, 3, 2);
    let mut net = LowRankCrossNet::<f64>::new(inp, layers, rank, 9);
    // TorchRec starts biases at zero; random ones make the check cover the bias term.
    for b in &mut net.bias {
        *b = rng.uniform_vec(inp, 0.5);
    }
    let x0 = random(&mut rng, n, inp);
    let r = random(&mut rng, n, inp);
    net.forward(&be, &x0);
    let dx0 = net.backward(&be, &r).clone();
    let mut probe = net.clone();
    let loss = |m: &mut LowRankCrossNet<f64>, x: &Tensor<f64>| weighted_sum(m.forward(&be, x), &r);

    let mut xp = x0.clone();
    check("CrossNet dx0", x0.data(), dx0.data(), |i, v| {
        xp.data_mut()[i] = v;
        let l = loss(&mut probe, &xp);
        xp.data_mut()[i] = x0.data()[i];
        l
    });
    for l in 0..layers {
        let (w, g) = (
            net.w_kernels[l].data().to_vec(),
            net.w_grads[l].data().to_vec(),
        );
        check(&format!("CrossNet dW{l}"), &w, &g, |i, v| {
            probe.w_kernels[l].data_mut()[i] = v;
            let out = loss(&mut probe, &x0);
            probe.w_kernels[l].data_mut()[i] = w[i];
            out
        });
        let (vk, g) = (
            net.v_kernels[l].data().to_vec(),
            net.v_grads[l].data().to_vec(),
        );
        check(&format!("CrossNet dV{l}"), &vk, &g, |i, v| {
            probe.v_kernels[l].data_mut()[i] = v;
            let out = loss(&mut probe, &x0);
            probe.v_kernels[l].data_mut()[i] = vk[i];
            out
        });
        let (b, g) = (net.bias[l].clone(), net.bias_grads[l].clone());
        check(&format!("CrossNet dbias{l}"), &b, &g, |i, v| {
            probe.bias[l][i] = v;
            let out = loss(&mut probe, &x0);
            probe.bias[l][i] = b[i];
            out
        });
    }
}

#[test]
fn bce_with_logits() {
    let be = be();
    let logits = Tensor::from_vec(6, 1, vec![-3.0, -0.5, 0.0, 0.7, 2.5, 9.0]).unwrap();
    let labels = [0.0, 1.0, 1.0, 0.0, 1.0, 0.0];
    let mut loss = BceWithLogits::<f64>::new();
    loss.forward_backward(&be, &logits, &labels);
    let grad = loss.grad().clone();
    assert_eq!(grad.shape(), (6, 1));
    let mut lp = logits.clone();
    check("bce dlogits", logits.data(), grad.data(), |i, v| {
        lp.data_mut()[i] = v;
        let (mut g, mut l) = (Tensor::default(), 0.0);
        be.bce_with_logits(lp.data(), &labels, &mut g, &mut l);
        lp.data_mut()[i] = logits.data()[i];
        l
    });
}

/// The DLRM dense path end to end: bottom MLP -> interaction -> top MLP -> BCE, gradient with
/// respect to the bottom MLP's first weights and the pooled embeddings.
#[test]
fn dlrm_dense_chain() {
    let be = be();
    let mut rng = Initializer::new(6);
    let (n, f, d) = (4, 3, 4);
    let mut bottom = Mlp::<f64>::new(&[5, 7, d], Activation::Relu, 1);
    let mut inter = DotInteraction::<f64>::new(f, d);
    let mut top = Mlp::<f64>::new(&[inter.output_dim(), 6, 1], Activation::None, 2);
    let mut bce = BceWithLogits::<f64>::new();
    let x = random(&mut rng, n, 5);
    let emb = random(&mut rng, n, f * d);
    let labels = [1.0, 0.0, 0.0, 1.0];

    let mut step = |bottom: &mut Mlp<f64>, emb: &Tensor<f64>, backward: bool| {
        let dense = bottom.forward(&be, &x).clone();
        let z = inter.forward(&be, &dense, emb).clone();
        let logits = top.forward(&be, &z).clone();
        bce.forward_backward(&be, &logits, &labels);
        let loss = bce.loss();
        let mut demb = None;
        if backward {
            let dz = top.backward(&be, bce.grad(), true).unwrap().clone();
            let (dd, ds) = inter.backward(&be, &dz);
            let dd = dd.clone();
            demb = Some(ds.clone());
            bottom.backward(&be, &dd, false);
        }
        (loss, demb)
    };
    let (_, demb) = step(&mut bottom, &emb, true);
    let demb = demb.unwrap();
    let w0 = bottom.layers()[0].weight.data().to_vec();
    let g0 = bottom.layers()[0].weight_grad.data().to_vec();
    let mut probe = bottom.clone();
    let mut ep = emb.clone();
    check(
        "DLRM d(pooled embeddings)",
        emb.data(),
        demb.data(),
        |i, v| {
            ep.data_mut()[i] = v;
            let l = step(&mut probe, &ep, false).0;
            ep.data_mut()[i] = emb.data()[i];
            l
        },
    );
    check("DLRM d(bottom layer 0 weight)", &w0, &g0, |i, v| {
        probe.layers_mut()[0].weight.data_mut()[i] = v;
        let l = step(&mut probe, &emb, false).0;
        probe.layers_mut()[0].weight.data_mut()[i] = w0[i];
        l
    });
}

#[test]
fn layer_norm_gradients() {
    use ember_dense::{HasParams, LayerNorm};
    for affine in [false, true] {
        let mut rng = Initializer::new(21);
        let mut norm = LayerNorm::<f64>::new(5, 1e-6, affine);
        if affine {
            norm.weight = rng.uniform_vec(5, 1.0);
            norm.bias = rng.uniform_vec(5, 1.0);
        }
        let x = random(&mut rng, 4, 5);
        let r = random(&mut rng, 4, 5);
        let loss = |n: &mut LayerNorm<f64>, x: &Tensor<f64>| {
            let mut y = Tensor::zeros(0, 0);
            n.forward(x, &mut y);
            weighted_sum(&y, &r)
        };
        let mut y = Tensor::zeros(0, 0);
        norm.forward(&x, &mut y);
        // Each row is normalised: mean 0, variance 1 (less eps) before the affine map.
        if !affine {
            for row in y.data().chunks(5) {
                assert!(row.iter().sum::<f64>().abs() < 1e-12);
                assert!((row.iter().map(|v| v * v).sum::<f64>() / 5.0 - 1.0).abs() < 1e-4);
            }
        }
        let mut dx = Tensor::zeros(0, 0);
        norm.backward(&r, &mut dx);
        let mut probe = norm.clone();
        check("layer norm dx", x.data(), dx.data(), |i, v| {
            let mut x = x.clone();
            x.data_mut()[i] = v;
            loss(&mut probe, &x)
        });
        if affine {
            let (w, gw) = (norm.weight.clone(), norm.weight_grad.clone());
            check("layer norm weight", &w, &gw, |i, v| {
                let mut p = norm.clone();
                p.weight[i] = v;
                loss(&mut p, &x)
            });
            let (b, gb) = (norm.bias.clone(), norm.bias_grad.clone());
            check("layer norm bias", &b, &gb, |i, v| {
                let mut p = norm.clone();
                p.bias[i] = v;
                loss(&mut p, &x)
            });
            assert_eq!(norm.params().len(), 2);
        }
    }
}

#[test]
fn layer_norm_of_many_rows_is_each_rows() {
    use ember_dense::LayerNorm;
    // Enough rows for the parallel blocks (and a last, partial one).
    let mut rng = Initializer::new(4);
    let x = random(&mut rng, 1001, 7);
    let dy = random(&mut rng, 1001, 7);
    let mut all = LayerNorm::<f64>::new(7, 1e-5, true);
    let (mut y, mut dx) = (Tensor::zeros(0, 0), Tensor::zeros(0, 0));
    all.forward(&x, &mut y);
    all.backward(&dy, &mut dx);
    for r in [0, 63, 64, 999, 1000] {
        let mut one = LayerNorm::<f64>::new(7, 1e-5, true);
        let row = |t: &Tensor<f64>| Tensor::from_vec(1, 7, t.row(r).to_vec()).unwrap();
        let (mut y1, mut dx1) = (Tensor::zeros(0, 0), Tensor::zeros(0, 0));
        one.forward(&row(&x), &mut y1);
        one.backward(&row(&dy), &mut dx1);
        assert_eq!(y1.data(), y.row(r), "row {r}");
        assert_eq!(dx1.data(), dx.row(r), "row {r}");
    }
}
