//! The HSTU layer against a plain reference written from the equations
//! (each sample on its own, loops only), its backward against finite
//! differences in f64, and a batch against its samples alone.

use ember_dense::jagged::Jagged;
use ember_dense::{
    HasParams, HstuConfig, HstuInput, HstuLayer, Initializer, NativeBackend, Tensor,
};

const LENGTHS: [usize; 4] = [3, 0, 1, 5];
const TARGETS: [usize; 4] = [1, 0, 0, 2];

fn config() -> HstuConfig {
    HstuConfig {
        dim: 4,
        heads: 2,
        attention_dim: 2,
        linear_dim: 3,
        max_seq_len: 6,
        alpha: 0.7,
        relative_bias: true,
        time_buckets: 40,
        dropout: 0.0,
    }
}

fn timestamps() -> Vec<i64> {
    // Gaps from 0 s to a day, so several buckets are used.
    vec![10, 20, 1000, 7, 5, 9, 60, 4000, 90_000]
}

const QUERY: [i64; 4] = [2000, 0, 8, 100_000];

/// A layer with every parameter random (the relative bias's too).
fn layer(seed: u64) -> HstuLayer<f64> {
    let mut l = HstuLayer::new(config(), seed);
    let mut init = Initializer::new(seed + 1);
    for p in l.params() {
        for v in p.value.iter_mut() {
            *v = init.uniform(-0.5, 0.5);
        }
    }
    l
}

fn input(seed: u64) -> Jagged<f64> {
    let total = LENGTHS.iter().sum();
    Jagged::from_lengths(
        Initializer::new(seed).uniform_tensor(total, 4, 1.0),
        &LENGTHS,
    )
    .unwrap()
}

fn silu(z: f64) -> f64 {
    z / (1.0 + (-z).exp())
}

fn layer_norm(row: &[f64]) -> Vec<f64> {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    row.iter()
        .map(|v| (v - mean) / (var + 1e-6).sqrt())
        .collect()
}

/// The equations of the layer's docs, one sample at a time.
fn reference(l: &mut HstuLayer<f64>, x: &Jagged<f64>) -> Vec<f64> {
    let c = l.config().clone();
    let (h, dqk, dv, n) = (c.heads, c.attention_dim, c.linear_dim, c.max_seq_len);
    let hv = h * dv;
    let (uvqk, ow, ob) = (l.uvqk.clone(), l.out_weight.clone(), l.out_bias.clone());
    let (pos_w, ts_w) = (l.pos_w.clone(), l.ts_w.clone());
    let ts = timestamps();
    let mut out = Vec::new();
    for b in 0..x.batch() {
        let (r0, len) = (x.offsets()[b], LENGTHS[b]);
        let rows: Vec<&[f64]> = x.segment(b).chunks(4).collect();
        let act: Vec<Vec<f64>> = rows
            .iter()
            .map(|r| {
                let xn = layer_norm(r);
                (0..uvqk.cols())
                    .map(|col| silu((0..4).map(|d| xn[d] * uvqk.row(d)[col]).sum()))
                    .collect()
            })
            .collect();
        let next = |i: usize| {
            if i + 1 < len {
                ts[r0 + i + 1]
            } else {
                QUERY[b]
            }
        };
        let bucket = |d: i64| {
            (((d.abs().max(1)) as f64).ln() / 0.301)
                .floor()
                .min(c.time_buckets as f64) as usize
        };
        let history = len - TARGETS[b];
        let mut attn = vec![vec![0.0; hv]; len];
        for head in 0..h {
            for i in 0..len {
                for j in 0..len {
                    if !(j == i || (j < i && j < history)) {
                        continue;
                    }
                    let qk: f64 = (0..dqk)
                        .map(|d| {
                            act[i][2 * hv + head * dqk + d]
                                * act[j][2 * hv + h * dqk + head * dqk + d]
                        })
                        .sum();
                    let rab = pos_w[n - 1 + j - i] + ts_w[bucket(next(i) - ts[r0 + j])];
                    let p = silu(c.alpha * qk + rab) / n as f64;
                    for e in 0..dv {
                        attn[i][head * dv + e] += p * act[j][hv + head * dv + e];
                    }
                }
            }
        }
        for i in 0..len {
            let normed = layer_norm(&attn[i]);
            let gated: Vec<f64> = (0..hv).map(|e| act[i][e] * normed[e]).collect();
            for o in 0..4 {
                let proj: f64 = (0..hv).map(|e| gated[e] * ow.row(o)[e]).sum();
                out.push(rows[i][o] + proj + ob[o]);
            }
        }
    }
    out
}

fn hstu_input<'a>(ts: &'a [i64]) -> HstuInput<'a> {
    HstuInput {
        timestamps: Some(ts),
        query_times: Some(&QUERY),
        targets: Some(&TARGETS),
    }
}

fn loss(l: &mut HstuLayer<f64>, x: &Jagged<f64>, r: &[f64]) -> f64 {
    let be = NativeBackend::new(1);
    let ts = timestamps();
    let y = l.forward(&be, x, hstu_input(&ts));
    y.values().data().iter().zip(r).map(|(a, b)| a * b).sum()
}

#[test]
fn forward_matches_the_equations() {
    let be = NativeBackend::new(1);
    let (mut l, x) = (layer(1), input(2));
    let ts = timestamps();
    let got = l.forward(&be, &x, hstu_input(&ts)).values().data().to_vec();
    let want = reference(&mut l, &x);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() < 1e-12, "value {i}: {g} vs {w}");
    }
}

#[test]
fn backward_matches_finite_differences() {
    let be = NativeBackend::new(1);
    let (mut l, x) = (layer(3), input(4));
    let r: Vec<f64> = Initializer::new(5).uniform_vec(x.values().len(), 1.0);
    let ts = timestamps();
    l.forward(&be, &x, hstu_input(&ts));
    let dy = Jagged::new(
        Tensor::from_vec(x.total_len(), 4, r.clone()).unwrap(),
        x.offsets().to_vec(),
    )
    .unwrap();
    let dx = l.backward(&be, &dy).values().data().to_vec();
    let eps = 1e-6;
    let check = |what: &str, analytic: f64, plus: f64, minus: f64| {
        let numeric = (plus - minus) / (2.0 * eps);
        let err = (numeric - analytic).abs() / (1.0 + analytic.abs());
        assert!(
            err < 1e-6,
            "{what}: analytic {analytic} vs numeric {numeric}"
        );
    };
    for (i, &analytic) in dx.iter().enumerate() {
        let at = |v: f64| {
            let mut x = x.clone();
            x.values_mut().data_mut()[i] = v;
            loss(&mut l.clone(), &x, &r)
        };
        let v = x.values().data()[i];
        check(&format!("x[{i}]"), analytic, at(v + eps), at(v - eps));
    }
    let grads: Vec<(String, Vec<f64>)> = l
        .params()
        .into_iter()
        .map(|p| (p.name, p.grad.to_vec()))
        .collect();
    let mut used_buckets = 0;
    for (k, (name, grad)) in grads.iter().enumerate() {
        for (i, &g) in grad.iter().enumerate() {
            let at = |v: f64| {
                let mut probe = l.clone();
                probe.params()[k].value[i] = v;
                loss(&mut probe, &x, &r)
            };
            let v = l.clone().params()[k].value[i];
            check(&format!("{name}[{i}]"), g, at(v + eps), at(v - eps));
            used_buckets += (name.ends_with("_ts_w") && g != 0.0) as usize;
        }
    }
    assert!(
        used_buckets >= 3,
        "the test's timestamps use several buckets"
    );
}

#[test]
fn a_batch_is_its_samples_alone() {
    // Long enough for the samples to run in parallel.
    let be = NativeBackend::new(2);
    let mut c = config();
    c.max_seq_len = 64;
    let lengths: Vec<usize> = (0..40).map(|b| (b * 7) % 61).collect();
    let total: usize = lengths.iter().sum();
    let x =
        Jagged::from_lengths(Initializer::new(8).uniform_tensor(total, 4, 1.0), &lengths).unwrap();
    let ts: Vec<i64> = (0..total as i64).map(|i| i * i % 5000).collect();
    let mut l = HstuLayer::<f64>::new(c, 9);
    let all = l
        .forward(
            &be,
            &x,
            HstuInput {
                timestamps: Some(&ts),
                ..Default::default()
            },
        )
        .clone();
    for b in [0, 1, 17, 39] {
        let (r0, r1) = (x.offsets()[b], x.offsets()[b + 1]);
        let one = Jagged::from_lengths(
            Tensor::from_vec(r1 - r0, 4, x.segment(b).to_vec()).unwrap(),
            &[r1 - r0],
        )
        .unwrap();
        let alone = l.forward(
            &be,
            &one,
            HstuInput {
                timestamps: Some(&ts[r0..r1]),
                ..Default::default()
            },
        );
        assert_eq!(alone.segment(0), all.segment(b), "sample {b}");
    }
}

#[test]
fn dropout_drops_in_training_only() {
    let be = NativeBackend::new(1);
    let mut c = config();
    c.dropout = 0.5;
    let (x, ts) = (input(6), timestamps());
    let mut l = HstuLayer::<f64>::new(c, 10);
    let a = l.forward(&be, &x, hstu_input(&ts)).clone();
    let b = l.forward(&be, &x, hstu_input(&ts)).clone();
    assert_ne!(a, b, "each step draws its own mask");
    l.set_training(false);
    let c1 = l.forward(&be, &x, hstu_input(&ts)).clone();
    let c2 = l.forward(&be, &x, hstu_input(&ts)).clone();
    assert_eq!(c1, c2);
}

/// The layer in PyTorch, written from the reference's padded code
/// (scripts/hstu_fixture.py): its inputs, weights, output and autograd
/// gradients, committed; Ember's jagged layer agrees to 1e-5 relative.
#[test]
fn pytorch_reference_layer_agrees() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hstu_layer.safetensors"
    ))
    .unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |name: &str| -> Vec<f64> {
        let t = file.tensor(name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F64, "{name}");
        t.data()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let ints = |name: &str| -> Vec<usize> { get(name).iter().map(|&v| v as usize).collect() };
    let cfg = ints("config");
    let config = HstuConfig {
        dim: cfg[0],
        heads: cfg[1],
        attention_dim: cfg[2],
        linear_dim: cfg[3],
        max_seq_len: cfg[4],
        alpha: get("alpha")[0],
        relative_bias: true,
        time_buckets: cfg[5],
        dropout: 0.0,
    };
    let d = config.dim;
    let mut l = HstuLayer::<f64>::new(config, 0);
    for p in l.params() {
        let name = p.name.clone();
        p.value.copy_from_slice(&get(&name));
    }
    let lengths = ints("lengths");
    let total = lengths.iter().sum();
    let x = Jagged::from_lengths(Tensor::from_vec(total, d, get("x")).unwrap(), &lengths).unwrap();
    let ts: Vec<i64> = get("timestamps").iter().map(|&v| v as i64).collect();
    let query: Vec<i64> = get("query_times").iter().map(|&v| v as i64).collect();
    let targets = ints("targets");
    let input = HstuInput {
        timestamps: Some(&ts),
        query_times: Some(&query),
        targets: Some(&targets),
    };
    let be = NativeBackend::new(1);
    let close = |what: &str, got: &[f64], want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1e-3),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    };
    let y = l.forward(&be, &x, input).values().data().to_vec();
    close("y", &y, &get("y"));
    let dy =
        Jagged::from_lengths(Tensor::from_vec(total, d, get("dy")).unwrap(), &lengths).unwrap();
    let dx = l.backward(&be, &dy).values().data().to_vec();
    close("grad.x", &dx, &get("grad.x"));
    for p in l.params() {
        close(&p.name, p.grad, &get(&format!("grad.{}", p.name)));
    }
}
