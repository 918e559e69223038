//! The jagged operators against plain references on padded sequences
//! (property tests over random lengths, 0 and 1 included), and their
//! backwards against central finite differences in f64.

use ember_dense::jagged::{self, complete_cumsum, Jagged};
use ember_dense::{Initializer, Tensor};
use proptest::prelude::*;

/// A batch as nested rows: `seqs[b][i]` is row `i` of sequence `b`.
type Padded = Vec<Vec<Vec<f64>>>;

fn random_jagged(rng: &mut Initializer, lengths: &[usize], dim: usize) -> Jagged<f64> {
    let total = lengths.iter().sum();
    Jagged::from_lengths(rng.uniform_tensor(total, dim, 1.0), lengths).unwrap()
}

fn nested(x: &Jagged<f64>) -> Padded {
    let d = x.dim().max(1);
    (0..x.batch())
        .map(|b| x.segment(b).chunks(d).map(<[f64]>::to_vec).collect())
        .collect()
}

fn flat(seqs: &Padded, dim: usize) -> Jagged<f64> {
    let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let data: Vec<f64> = seqs.iter().flatten().flatten().copied().collect();
    let total = lengths.iter().sum();
    Jagged::from_lengths(Tensor::from_vec(total, dim, data).unwrap(), &lengths).unwrap()
}

/// `[rows, cols]` row `r` of sample `b`'s block of a `[batch * rows, cols]` tensor.
fn block_row(t: &Tensor<f64>, rows: usize, b: usize, r: usize) -> &[f64] {
    t.row(b * rows + r)
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-9 * (1.0 + y.abs()))
}

fn shapes() -> impl Strategy<Value = (Vec<usize>, usize, usize, u64)> {
    (
        prop::collection::vec(0usize..6, 0..6),
        1usize..5,
        1usize..5,
        any::<u64>(),
    )
}

proptest! {
    #[test]
    fn cumsum_gives_offsets(lengths in prop::collection::vec(0usize..9, 0..9)) {
        let offsets = complete_cumsum(&lengths);
        prop_assert_eq!(offsets.len(), lengths.len() + 1);
        prop_assert_eq!(offsets[0], 0);
        for (b, l) in lengths.iter().enumerate() {
            prop_assert_eq!(offsets[b + 1] - offsets[b], *l);
        }
    }

    #[test]
    fn padding_round_trips_and_cuts((lengths, dim, cut, seed) in shapes()) {
        let x = random_jagged(&mut Initializer::new(seed), &lengths, dim);
        let max_len = x.max_len();
        let padded = jagged::to_padded(&x, max_len, -7.0);
        let seqs = nested(&x);
        for (b, seq) in seqs.iter().enumerate() {
            for i in 0..max_len {
                let want = seq.get(i).cloned().unwrap_or(vec![-7.0; dim]);
                prop_assert_eq!(block_row(&padded, max_len, b, i), &want[..]);
            }
        }
        prop_assert_eq!(&jagged::from_padded(&padded, x.offsets(), max_len), &x);
        // Cut to `cut` rows: the rows past it come back as zeros.
        let short = jagged::to_padded(&x, cut, 0.0);
        let back = jagged::from_padded(&short, x.offsets(), cut);
        let want: Padded = seqs
            .iter()
            .map(|s| {
                (s.iter().enumerate())
                    .map(|(i, r)| if i < cut { r.clone() } else { vec![0.0; dim] })
                    .collect()
            })
            .collect();
        prop_assert_eq!(back, flat(&want, dim));
    }

    #[test]
    fn concat_and_split_are_inverse((lengths, dim, _, seed) in shapes(), extra in prop::collection::vec(0usize..4, 6)) {
        let mut rng = Initializer::new(seed);
        let a = random_jagged(&mut rng, &lengths, dim);
        let b = random_jagged(&mut rng, &extra[..lengths.len()], dim);
        let joined = jagged::concat(&a, &b);
        let want: Padded = (nested(&a).into_iter().zip(nested(&b)))
            .map(|(mut x, y)| { x.extend(y); x })
            .collect();
        prop_assert_eq!(&joined, &flat(&want, dim));
        let (a2, b2) = jagged::split(&joined, &lengths);
        prop_assert_eq!((a2, b2), (a, b));
    }

    #[test]
    fn softmax_matches_the_padded_reference((lengths, dim, _, seed) in shapes()) {
        let x = random_jagged(&mut Initializer::new(seed), &lengths, dim);
        let y = jagged::softmax(&x);
        for (b, seq) in nested(&x).iter().enumerate() {
            for c in 0..dim {
                let denom: f64 = seq.iter().map(|r| r[c].exp()).sum();
                for (i, r) in seq.iter().enumerate() {
                    let got = y.segment(b)[i * dim + c];
                    prop_assert!((got - r[c].exp() / denom).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn jagged_dense_bmm_matches_the_padded_reference((lengths, n, m, seed) in shapes()) {
        let mut rng = Initializer::new(seed);
        let x = random_jagged(&mut rng, &lengths, n);
        let y = rng.uniform_tensor(lengths.len() * n, m, 1.0);
        let z = jagged::jagged_dense_bmm(&x, &y);
        let want: Padded = (nested(&x).iter().enumerate())
            .map(|(b, seq)| {
                seq.iter()
                    .map(|r| (0..m).map(|j| (0..n).map(|k| r[k] * block_row(&y, n, b, k)[j]).sum()).collect())
                    .collect()
            })
            .collect();
        prop_assert!(close(z.values().data(), flat(&want, m).values().data()));
        prop_assert_eq!(z.offsets(), x.offsets());
    }

    #[test]
    fn jagged_jagged_bmm_matches_the_padded_reference((lengths, n, m, seed) in shapes()) {
        let mut rng = Initializer::new(seed);
        let x = random_jagged(&mut rng, &lengths, n);
        let y = random_jagged(&mut rng, &lengths, m);
        let z = jagged::jagged_jagged_bmm(&x, &y);
        prop_assert_eq!(z.shape(), (lengths.len() * n, m));
        for (b, (xs, ys)) in nested(&x).iter().zip(nested(&y)).enumerate() {
            for k in 0..n {
                let want: Vec<f64> = (0..m)
                    .map(|j| xs.iter().zip(&ys).map(|(xr, yr)| xr[k] * yr[j]).sum())
                    .collect();
                prop_assert!(close(block_row(&z, n, b, k), &want));
            }
        }
    }
}

const EPS: f64 = 1e-6;

/// Compares `analytic` with central differences of `loss` in each element
/// of `values` (`set(i, v)` sets element `i` and returns the loss).
fn gradcheck(
    what: &str,
    values: &[f64],
    analytic: &[f64],
    mut loss_at: impl FnMut(usize, f64) -> f64,
) {
    assert_eq!(values.len(), analytic.len(), "{what}: gradient length");
    for (i, &v) in values.iter().enumerate() {
        let numeric = (loss_at(i, v + EPS) - loss_at(i, v - EPS)) / (2.0 * EPS);
        let err = (numeric - analytic[i]).abs() / (1.0 + analytic[i].abs());
        assert!(
            err < 1e-6,
            "{what}[{i}]: analytic {} vs numeric {numeric}",
            analytic[i]
        );
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `x` with element `i` set to `v`.
fn with(x: &Jagged<f64>, i: usize, v: f64) -> Jagged<f64> {
    let mut x = x.clone();
    x.values_mut().data_mut()[i] = v;
    x
}

/// Lengths with an empty and a one-row sequence among longer ones.
const LENGTHS: [usize; 5] = [3, 0, 1, 4, 2];

#[test]
fn padding_concat_and_split_backwards_are_each_others_forwards() {
    let mut rng = Initializer::new(3);
    let x = random_jagged(&mut rng, &LENGTHS, 3);
    // Σ r ⊙ to_padded(x), cut to 3 rows: its gradient is from_padded(r).
    let r = rng.uniform_tensor(LENGTHS.len() * 3, 3, 1.0);
    let dx = jagged::from_padded(&r, x.offsets(), 3);
    let loss = |x: &Jagged<f64>| dot(jagged::to_padded(x, 3, 0.5).data(), r.data());
    gradcheck(
        "to_padded",
        x.values().data(),
        dx.values().data(),
        |i, v| loss(&with(&x, i, v)),
    );
    // Σ r ⊙ concat(a, b): its gradients are split(r).
    let b = random_jagged(&mut rng, &[1, 2, 0, 0, 3], 3);
    let r = random_jagged(&mut rng, &[4, 2, 1, 4, 5], 3);
    let (da, db) = jagged::split(&r, &LENGTHS);
    let loss = |a: &Jagged<f64>, b: &Jagged<f64>| {
        dot(jagged::concat(a, b).values().data(), r.values().data())
    };
    gradcheck("concat a", x.values().data(), da.values().data(), |i, v| {
        loss(&with(&x, i, v), &b)
    });
    gradcheck("concat b", b.values().data(), db.values().data(), |i, v| {
        loss(&x, &with(&b, i, v))
    });
}

#[test]
fn softmax_backward_matches_finite_differences() {
    let mut rng = Initializer::new(5);
    let x = random_jagged(&mut rng, &LENGTHS, 2);
    let r = random_jagged(&mut rng, &LENGTHS, 2);
    let dx = jagged::softmax_backward(&jagged::softmax(&x), &r);
    let loss = |x: &Jagged<f64>| dot(jagged::softmax(x).values().data(), r.values().data());
    gradcheck("softmax", x.values().data(), dx.values().data(), |i, v| {
        loss(&with(&x, i, v))
    });
}

#[test]
fn bmm_backwards_match_finite_differences() {
    let mut rng = Initializer::new(9);
    let (n, m) = (3, 2);
    let x = random_jagged(&mut rng, &LENGTHS, n);
    let y = rng.uniform_tensor(LENGTHS.len() * n, m, 1.0);
    let r = random_jagged(&mut rng, &LENGTHS, m);
    let (dx, dy) = jagged::jagged_dense_bmm_backward(&x, &y, &r);
    let loss = |x: &Jagged<f64>, y: &Tensor<f64>| {
        dot(
            jagged::jagged_dense_bmm(x, y).values().data(),
            r.values().data(),
        )
    };
    gradcheck(
        "jagged_dense x",
        x.values().data(),
        dx.values().data(),
        |i, v| loss(&with(&x, i, v), &y),
    );
    gradcheck("jagged_dense y", y.data(), dy.data(), |i, v| {
        let mut y = y.clone();
        y.data_mut()[i] = v;
        loss(&x, &y)
    });

    let w = random_jagged(&mut rng, &LENGTHS, m);
    let r = rng.uniform_tensor(LENGTHS.len() * n, m, 1.0);
    let (dx, dw) = jagged::jagged_jagged_bmm_backward(&x, &w, &r);
    let loss =
        |x: &Jagged<f64>, w: &Jagged<f64>| dot(jagged::jagged_jagged_bmm(x, w).data(), r.data());
    gradcheck(
        "jagged_jagged x",
        x.values().data(),
        dx.values().data(),
        |i, v| loss(&with(&x, i, v), &w),
    );
    gradcheck(
        "jagged_jagged y",
        w.values().data(),
        dw.values().data(),
        |i, v| loss(&x, &with(&w, i, v)),
    );
}

#[test]
fn large_batches_run_in_parallel_as_they_do_alone() {
    // Big enough for the parallel paths; each sample's result as computed alone.
    let mut rng = Initializer::new(11);
    let lengths: Vec<usize> = (0..300).map(|b| b % 17).collect();
    let x = random_jagged(&mut rng, &lengths, 16);
    let y = rng.uniform_tensor(lengths.len() * 16, 16, 1.0);
    let z = jagged::jagged_dense_bmm(&x, &y);
    let s = jagged::softmax(&x);
    for b in [0, 1, 16, 299] {
        let xb = sample_alone(&x, b);
        let yb = Tensor::from_vec(16, 16, y.data()[b * 256..(b + 1) * 256].to_vec()).unwrap();
        assert_eq!(jagged::jagged_dense_bmm(&xb, &yb).segment(0), z.segment(b));
        assert_eq!(jagged::softmax(&xb).segment(0), s.segment(b));
    }
}

/// Sample `b` of `x` as a batch of one.
fn sample_alone(x: &Jagged<f64>, b: usize) -> Jagged<f64> {
    let rows = x.segment(b).len() / x.dim();
    let t = Tensor::from_vec(rows, x.dim(), x.segment(b).to_vec()).unwrap();
    Jagged::from_lengths(t, &[rows]).unwrap()
}

#[test]
fn offsets_that_do_not_fit_are_refused() {
    let t = Tensor::<f32>::zeros(4, 2);
    assert!(Jagged::new(t.clone(), vec![0, 2, 4]).is_ok());
    for bad in [vec![1, 4], vec![0, 3, 2, 4], vec![0, 3], vec![]] {
        assert!(Jagged::new(t.clone(), bad.clone()).is_err(), "{bad:?}");
    }
}
