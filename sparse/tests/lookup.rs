//! Lookups and fused updates against plain f64 references.

use ember_sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType, SparseError,
    TableOptimizer, TableStepSettings,
};
use proptest::prelude::*;

/// A small random problem: tables (some shared by two features) and a batch.
#[derive(Debug, Clone)]
struct Case {
    configs: Vec<EmbeddingBagConfig>,
    kjt: KeyedJaggedTensor,
    grad: Vec<f32>,
}

fn case_strategy() -> impl Strategy<Value = Case> {
    // Small shapes make duplicates common; large ones (over 64 samples, over
    // 512 distinct ids) exercise the multi-task forward and update paths.
    let rows = prop_oneof![1usize..12, 500usize..3000];
    // Dims 16, 32, 64 and 128 take the fixed-dim kernels, the others the generic one.
    let dim = prop_oneof![1usize..7, Just(16), Just(32), Just(64), Just(128)];
    let table = (rows, dim, 1usize..3, prop::bool::ANY);
    let batch = prop_oneof![0usize..7, 60usize..200];
    (
        prop::collection::vec(table, 1..4),
        batch,
        any::<u64>(),
        prop::bool::ANY,
        // Short bags get dense prefetch hints, long ones every other line.
        prop_oneof![Just(5u64), Just(12u64)],
    )
        .prop_map(|(tables, batch, seed, weighted, max_len)| {
            let mut rng = ember_sparse::rng::Rng::new(seed);
            let mut configs = Vec::new();
            let mut keys = Vec::new();
            let mut rows_of_key = Vec::new();
            for (t, (rows, dim, features, mean)) in tables.into_iter().enumerate() {
                let names: Vec<String> = (0..features).map(|f| format!("t{t}_f{f}")).collect();
                let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
                let pooling = if mean {
                    PoolingType::Mean
                } else {
                    PoolingType::Sum
                };
                configs.push(
                    EmbeddingBagConfig::new(&format!("t{t}"), rows, dim, &refs)
                        .with_pooling(pooling),
                );
                for n in names {
                    keys.push(n);
                    rows_of_key.push(rows);
                }
            }
            // Input keys in reverse order: the collection must not rely on order.
            keys.reverse();
            rows_of_key.reverse();
            let mut lengths = Vec::new();
            let mut values = Vec::new();
            for &rows in &rows_of_key {
                for _ in 0..batch {
                    let len = rng.below(max_len) as i64;
                    lengths.push(len);
                    for _ in 0..len {
                        // Few rows, so duplicates are common.
                        values.push(rng.below(rows as u64) as i64);
                    }
                }
            }
            let weights =
                weighted.then(|| values.iter().map(|_| rng.next_f32() * 2.0 - 0.5).collect());
            let kjt = KeyedJaggedTensor::from_lengths(keys, values, &lengths, weights).unwrap();
            let width: usize = configs
                .iter()
                .map(|c| c.embedding_dim * c.feature_names.len())
                .sum();
            let grad = (0..batch * width)
                .map(|_| rng.next_f32() * 2.0 - 1.0)
                .collect();
            Case { configs, kjt, grad }
        })
}

/// (table index, column) of each output feature, in output order.
fn layout(configs: &[EmbeddingBagConfig]) -> Vec<(usize, String, usize)> {
    let mut out = Vec::new();
    let mut col = 0;
    for (t, c) in configs.iter().enumerate() {
        for f in &c.feature_names {
            out.push((t, f.clone(), col));
            col += c.embedding_dim;
        }
    }
    out
}

/// Plain pooled lookup in f64.
fn reference_forward(
    ebc: &EmbeddingBagCollection,
    configs: &[EmbeddingBagConfig],
    kjt: &KeyedJaggedTensor,
) -> Vec<f64> {
    let b = kjt.stride();
    let lay = layout(configs);
    let width: usize = configs
        .iter()
        .map(|c| c.embedding_dim * c.feature_names.len())
        .sum();
    let mut out = vec![0.0f64; b * width];
    for (t, feature, col) in lay {
        let jt = kjt.get(&feature).unwrap();
        let table = &ebc.tables()[t];
        let dim = table.dim();
        let start = kjt.key_range(kjt.key_index(&feature).unwrap()).start;
        for s in 0..b {
            let bag = jt.bag(s);
            for (i, &id) in bag.iter().enumerate() {
                let w = kjt
                    .weights()
                    .map_or(1.0, |w| w[start + jt.offsets()[s] + i] as f64);
                for d in 0..dim {
                    out[s * width + col + d] += w * table.row(id as usize)[d] as f64;
                }
            }
            if configs[t].pooling == PoolingType::Mean && !bag.is_empty() {
                for d in 0..dim {
                    out[s * width + col + d] /= bag.len() as f64;
                }
            }
        }
    }
    out
}

/// Plain gradient of each table in f64: dense [rows, dim], plus which rows
/// were touched, plus which rows are ill-conditioned: an element whose f32
/// sum of n contributions may be off (n x 2^-24 x the sum of their sizes,
/// the summation's error bound) by more than 2e-5 of its value, where f32
/// and f64 rightly disagree in relative terms (a near-cancelling sum, or
/// hundreds of contributions to one row).
type TableGrads = Vec<(Vec<f64>, Vec<bool>, Vec<bool>)>;

fn reference_table_grads(
    configs: &[EmbeddingBagConfig],
    kjt: &KeyedJaggedTensor,
    grad: &[f32],
) -> TableGrads {
    let b = kjt.stride();
    let width: usize = configs
        .iter()
        .map(|c| c.embedding_dim * c.feature_names.len())
        .sum();
    let mut count: Vec<Vec<f64>> = configs
        .iter()
        .map(|c| vec![0.0; c.num_embeddings * c.embedding_dim])
        .collect();
    let mut magnitude: Vec<Vec<f64>> = configs
        .iter()
        .map(|c| vec![0.0; c.num_embeddings * c.embedding_dim])
        .collect();
    let mut grads: Vec<(Vec<f64>, Vec<bool>)> = configs
        .iter()
        .map(|c| {
            (
                vec![0.0; c.num_embeddings * c.embedding_dim],
                vec![false; c.num_embeddings],
            )
        })
        .collect();
    for (t, feature, col) in layout(configs) {
        let dim = configs[t].embedding_dim;
        let jt = kjt.get(&feature).unwrap();
        let start = kjt.key_range(kjt.key_index(&feature).unwrap()).start;
        for s in 0..b {
            let bag = jt.bag(s);
            let mean = if configs[t].pooling == PoolingType::Mean {
                bag.len().max(1) as f64
            } else {
                1.0
            };
            for (i, &id) in bag.iter().enumerate() {
                let w = kjt
                    .weights()
                    .map_or(1.0, |w| w[start + jt.offsets()[s] + i] as f64);
                grads[t].1[id as usize] = true;
                for d in 0..dim {
                    let contribution = w / mean * grad[s * width + col + d] as f64;
                    grads[t].0[id as usize * dim + d] += contribution;
                    magnitude[t][id as usize * dim + d] += contribution.abs();
                    count[t][id as usize * dim + d] += 1.0;
                }
            }
        }
    }
    grads
        .into_iter()
        .zip(magnitude.into_iter().zip(count))
        .zip(configs)
        .map(|(((g, touched), (mag, n)), c)| {
            let dim = c.embedding_dim;
            let bound = |i: usize| n[i] * 2f64.powi(-24) * mag[i];
            let ill = (0..c.num_embeddings)
                .map(|r| {
                    (r * dim..(r + 1) * dim)
                        .any(|i| g[i].abs() < 1e-3 * mag[i] || bound(i) > 2e-5 * g[i].abs())
                })
                .collect();
            (g, touched, ill)
        })
        .collect()
}

/// Reference dense update of one row in f64, touched rows only.
fn reference_update(
    opt: &TableOptimizer,
    step: u64,
    row: &mut [f64],
    g: &[f64],
    state: &mut [f64],
) {
    match *opt {
        TableOptimizer::None => {}
        TableOptimizer::Sgd { lr } => row.iter_mut().zip(g).for_each(|(w, g)| *w -= lr as f64 * g),
        TableOptimizer::Adagrad { lr, eps } => {
            for i in 0..row.len() {
                state[i] += g[i] * g[i];
                row[i] -= lr as f64 * g[i] / (state[i].sqrt() + eps as f64);
            }
        }
        TableOptimizer::RowWiseAdagrad { lr, eps } => {
            state[0] += g.iter().map(|g| g * g).sum::<f64>() / g.len() as f64;
            for i in 0..row.len() {
                row[i] -= lr as f64 * g[i] / (state[0].sqrt() + eps as f64);
            }
        }
        TableOptimizer::Adam {
            lr,
            beta1,
            beta2,
            eps,
        } => {
            let (b1, b2) = (beta1 as f64, beta2 as f64);
            let d = row.len();
            for i in 0..d {
                state[i] = b1 * state[i] + (1.0 - b1) * g[i];
                state[d + i] = b2 * state[d + i] + (1.0 - b2) * g[i] * g[i];
                let m = state[i] / (1.0 - b1.powi(step as i32));
                let v = state[d + i] / (1.0 - b2.powi(step as i32));
                row[i] -= lr as f64 * m / (v.sqrt() + eps as f64);
            }
        }
    }
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + a.abs().max(b.abs()))
}

fn optimizers() -> Vec<TableOptimizer> {
    vec![
        TableOptimizer::sgd(0.1),
        TableOptimizer::adagrad(0.1),
        TableOptimizer::rowwise_adagrad(0.1),
        TableOptimizer::adam(0.01),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn forward_matches_reference(case in case_strategy()) {
        let ebc = EmbeddingBagCollection::new(case.configs.clone(), TableOptimizer::None, 7).unwrap();
        let out = ebc.forward(&case.kjt).unwrap();
        let expected = reference_forward(&ebc, &case.configs, &case.kjt);
        prop_assert_eq!(out.values().len(), expected.len());
        for (a, e) in out.values().iter().zip(&expected) {
            prop_assert!(close(*a as f64, *e, 1e-5), "{} vs {}", a, e);
        }
        // Straight into a slice: the same bits, and a slice of another
        // length refused.
        let mut flat = vec![f32::NAN; out.values().len()];
        ebc.forward_into_slice(&case.kjt, &mut flat).unwrap();
        prop_assert_eq!(&flat[..], out.values());
        let mut short = vec![0.0f32; flat.len() + 1];
        prop_assert!(ebc.forward_into_slice(&case.kjt, &mut short).is_err());
    }

    #[test]
    fn fused_updates_match_reference(case in case_strategy(), which in 0usize..4) {
        let opt = optimizers()[which];
        let mut ebc = EmbeddingBagCollection::new(case.configs.clone(), opt, 11).unwrap();
        let mut expected: Vec<Vec<f64>> = ebc.tables().iter().map(|t| t.weights().iter().map(|&w| w as f64).collect()).collect();
        let mut states: Vec<Vec<f64>> = ebc.tables().iter().map(|t| vec![0.0; t.optimizer_state().len()]).collect();
        // Rows whose gradient cancels to near zero: Adagrad and Adam divide by
        // the gradient's own size, so rounding decides their step there.
        let mut skip: Vec<Vec<bool>> = case.configs.iter().map(|c| vec![false; c.num_embeddings]).collect();
        // Two steps with the same batch: checks the state carries over (and Adam's step count).
        for step in 1..=2u64 {
            ebc.forward(&case.kjt).unwrap();
            ebc.backward_update(&case.kjt, &case.grad).unwrap();
            let grads = reference_table_grads(&case.configs, &case.kjt, &case.grad);
            for (t, (g, touched, ill)) in grads.iter().enumerate() {
                let dim = case.configs[t].embedding_dim;
                let per_row = opt.state_floats_per_row(dim);
                for r in 0..case.configs[t].num_embeddings {
                    skip[t][r] |= ill[r] && !matches!(opt, TableOptimizer::Sgd { .. });
                    if touched[r] {
                        reference_update(&opt, step, &mut expected[t][r * dim..(r + 1) * dim], &g[r * dim..(r + 1) * dim], &mut states[t][r * per_row..(r + 1) * per_row]);
                    }
                }
            }
        }
        for (t, table) in ebc.tables().iter().enumerate() {
            let dim = case.configs[t].embedding_dim;
            let per_row = opt.state_floats_per_row(dim);
            for (i, (a, e)) in table.weights().iter().zip(&expected[t]).enumerate() {
                prop_assert!(skip[t][i / dim] || close(*a as f64, *e, 1e-4), "table {} ({:?}): {} vs {}", t, opt, a, e);
            }
            for (i, (a, e)) in table.optimizer_state().iter().zip(&states[t]).enumerate() {
                prop_assert!(skip[t][i / per_row] || close(*a as f64, *e, 1e-4), "state of table {}: {} vs {}", t, a, e);
            }
        }
    }

    #[test]
    fn jagged_roundtrip(lengths in prop::collection::vec(0i64..5, 0..20), keys in 1usize..4) {
        let n = lengths.len() - lengths.len() % keys;
        let lengths = &lengths[..n];
        let values: Vec<i64> = (0..lengths.iter().sum::<i64>()).collect();
        let names: Vec<String> = (0..keys).map(|k| format!("k{k}")).collect();
        let a = KeyedJaggedTensor::from_lengths(names.clone(), values.clone(), lengths, None).unwrap();
        let offsets: Vec<i64> = a.offsets().iter().map(|&o| o as i64).collect();
        let b = KeyedJaggedTensor::from_offsets(names, values, &offsets, None).unwrap();
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(a.lengths().iter().map(|&l| l as i64).collect::<Vec<_>>(), lengths.to_vec());
        prop_assert_eq!(a.stride() * keys, n);
    }
}

fn one_table(opt: TableOptimizer) -> EmbeddingBagCollection {
    let config = EmbeddingBagConfig {
        weight_init_min: Some(1.0),
        weight_init_max: Some(1.0),
        ..EmbeddingBagConfig::new("t", 3, 2, &["f"])
    };
    EmbeddingBagCollection::new(vec![config], opt, 0).unwrap()
}

/// Row 1 appears twice in one batch with gradients (1, 2) and (3, -1):
/// the summed gradient is (4, 1). Expected values computed by hand.
#[test]
fn duplicate_ids_update_with_summed_gradient_by_hand() {
    let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![1, 1], &[1, 1], None).unwrap();
    let grad = [1.0, 2.0, 3.0, -1.0];
    let cases: [(TableOptimizer, [f32; 2]); 4] = [
        // 1 - 0.5 * (4, 1)
        (TableOptimizer::sgd(0.5), [-1.0, 0.5]),
        // s = (16, 1); 1 - 0.5 * g / sqrt(s) = 1 - 0.5 * (1, 1)
        (TableOptimizer::Adagrad { lr: 0.5, eps: 0.0 }, [0.5, 0.5]),
        // s = (16 + 1) / 2 = 8.5; 1 - 0.5 * (4, 1) / sqrt(8.5)
        (
            TableOptimizer::RowWiseAdagrad { lr: 0.5, eps: 0.0 },
            [1.0 - 2.0 / 8.5f32.sqrt(), 1.0 - 0.5 / 8.5f32.sqrt()],
        ),
        // first Adam step moves each weight by lr * sign(g)
        (
            TableOptimizer::Adam {
                lr: 0.5,
                beta1: 0.9,
                beta2: 0.999,
                eps: 0.0,
            },
            [0.5, 0.5],
        ),
    ];
    for (opt, expected) in cases {
        let mut ebc = one_table(opt);
        ebc.backward_update(&kjt, &grad).unwrap();
        let row = ebc.tables()[0].row(1);
        for (a, e) in row.iter().zip(expected) {
            assert!((a - e).abs() < 1e-6, "{opt:?}: {row:?} vs {expected:?}");
        }
        assert_eq!(ebc.tables()[0].row(0), &[1.0, 1.0], "untouched row moved");
    }
}

/// A schedule's rate and FBGEMM's L2 table decay (`g += decay * w`
/// before the optimizer reads `g`), over three steps with a new rate each,
/// against the f64 reference; rows no batch reads do not decay.
#[test]
fn step_settings_rate_and_l2_decay_match_the_reference() {
    let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![1, 1], &[1, 1], None).unwrap();
    let grad = [1.0, 2.0, 3.0, -1.0];
    let decay = 0.25f32;
    let rates = [0.5f32, 0.25, 0.125];
    for opt in [
        TableOptimizer::sgd(9.0),
        TableOptimizer::Adagrad { lr: 9.0, eps: 0.0 },
        TableOptimizer::RowWiseAdagrad { lr: 9.0, eps: 0.0 },
    ] {
        let mut ebc = one_table(opt);
        let (mut row, mut state) = (vec![1.0f64; 2], vec![0.0f64; opt.state_floats_per_row(2)]);
        for (step, lr) in rates.into_iter().enumerate() {
            let settings = TableStepSettings {
                learning_rate: Some(lr),
                weight_decay: decay,
            };
            ebc.set_step_settings(settings).unwrap();
            ebc.backward_update(&kjt, &grad).unwrap();
            // The summed gradient (4, 1), decayed by the row before the step.
            let g: Vec<f64> = [4.0, 1.0]
                .iter()
                .zip(&row)
                .map(|(g, w)| g + decay as f64 * w)
                .collect();
            let with_rate = match opt {
                TableOptimizer::Sgd { .. } => TableOptimizer::sgd(lr),
                TableOptimizer::Adagrad { .. } => TableOptimizer::Adagrad { lr, eps: 0.0 },
                _ => TableOptimizer::RowWiseAdagrad { lr, eps: 0.0 },
            };
            reference_update(&with_rate, step as u64 + 1, &mut row, &g, &mut state);
            let got = ebc.tables()[0].row(1);
            for (a, e) in got.iter().zip(&row) {
                assert!(
                    close(*a as f64, *e, 1e-6),
                    "{opt:?} step {step}: {got:?} vs {row:?}"
                );
            }
        }
        assert_eq!(ebc.tables()[0].row(0), &[1.0, 1.0], "an unread row decayed");
        // The optimizer's own configuration is untouched.
        assert_eq!(ebc.optimizer().learning_rate(), 9.0);
    }
    // Decay for Adam, a negative rate or a NaN decay: refused, nothing set.
    let mut adam = one_table(TableOptimizer::adam(0.1));
    let decayed = TableStepSettings {
        learning_rate: None,
        weight_decay: 0.1,
    };
    assert!(adam
        .set_step_settings(decayed)
        .unwrap_err()
        .to_string()
        .contains("not Adam"));
    let mut sgd = one_table(TableOptimizer::sgd(0.1));
    for bad in [
        TableStepSettings {
            learning_rate: Some(-1.0),
            weight_decay: 0.0,
        },
        TableStepSettings {
            learning_rate: None,
            weight_decay: f32::NAN,
        },
    ] {
        assert!(sgd.set_step_settings(bad).is_err(), "{bad:?}");
    }
    assert_eq!(sgd.step_settings(), TableStepSettings::default());
}

/// An optimizer set after building trains as one built in (fresh state,
/// as TorchRec's `apply_optimizer_in_backward`); a refused one changes
/// nothing.
#[test]
fn optimizer_set_after_building_trains_as_one_built_in() {
    let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![1, 2], &[1, 1], None).unwrap();
    let grad = [1.0, 2.0, 3.0, -1.0];
    for opt in optimizers() {
        let mut built = one_table(opt);
        let mut set = one_table(TableOptimizer::None);
        set.set_optimizer(opt).unwrap();
        assert_eq!(set.optimizer(), &opt);
        for _ in 0..3 {
            built.backward_update(&kjt, &grad).unwrap();
            set.backward_update(&kjt, &grad).unwrap();
        }
        assert_eq!(built.tables()[0].weights(), set.tables()[0].weights());
        assert_eq!(
            built.tables()[0].optimizer_state(),
            set.tables()[0].optimizer_state()
        );
    }
    // Adam set after training with another optimizer steps as a fresh one:
    // its bias correction counts from its own first step.
    let mut fresh = one_table(TableOptimizer::adam(0.01));
    let mut reset = one_table(TableOptimizer::sgd(0.0));
    reset.backward_update(&kjt, &grad).unwrap();
    reset.set_optimizer(TableOptimizer::adam(0.01)).unwrap();
    assert_eq!(reset.step(), 0);
    fresh.backward_update(&kjt, &grad).unwrap();
    reset.backward_update(&kjt, &grad).unwrap();
    assert_eq!(fresh.tables()[0].weights(), reset.tables()[0].weights());
    // A refused optimizer changes nothing: optimizer, state, step.
    let mut ebc = one_table(TableOptimizer::adagrad(0.1));
    ebc.backward_update(&kjt, &grad).unwrap();
    let state = ebc.tables()[0].optimizer_state().to_vec();
    let bad = TableOptimizer::Adagrad {
        lr: f32::NAN,
        eps: 0.0,
    };
    assert!(matches!(
        ebc.set_optimizer(bad),
        Err(SparseError::InvalidOptimizer(_))
    ));
    assert_eq!(ebc.optimizer(), &TableOptimizer::adagrad(0.1));
    assert_eq!(ebc.tables()[0].optimizer_state(), state.as_slice());
    assert_eq!(ebc.step(), 1);
    let int8 =
        EmbeddingBagConfig::new("q", 4, 8, &["f"]).with_data_type(ember_sparse::DataType::Int8);
    let mut quantized = EmbeddingBagCollection::new(vec![int8], TableOptimizer::None, 0).unwrap();
    let err = quantized
        .set_optimizer(TableOptimizer::sgd(0.1))
        .unwrap_err();
    assert!(err.to_string().contains("for inference"), "{err}");
}

#[test]
fn same_seed_same_tables() {
    let configs = vec![
        EmbeddingBagConfig::new("a", 10_000, 8, &["x"]),
        EmbeddingBagConfig::new("b", 5, 3, &["y"]),
    ];
    let a = EmbeddingBagCollection::new(configs.clone(), TableOptimizer::None, 42).unwrap();
    let b = EmbeddingBagCollection::new(configs.clone(), TableOptimizer::None, 42).unwrap();
    let c = EmbeddingBagCollection::new(configs, TableOptimizer::None, 43).unwrap();
    assert_eq!(a.tables()[0].weights(), b.tables()[0].weights());
    assert_ne!(a.tables()[0].weights(), c.tables()[0].weights());
    let bound = (1.0f32 / 10_000.0).sqrt();
    assert!(a.tables()[0].weights().iter().all(|w| w.abs() <= bound));
    // Results do not depend on the thread count.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let d = pool.install(|| {
        EmbeddingBagCollection::new(
            vec![EmbeddingBagConfig::new("a", 10_000, 8, &["x"])],
            TableOptimizer::None,
            42,
        )
        .unwrap()
    });
    assert_eq!(a.tables()[0].weights(), d.tables()[0].weights());
}

#[test]
fn bad_lookups_name_the_fault() {
    let ebc = one_table(TableOptimizer::sgd(0.1));
    let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![0, 3], &[1, 1], None).unwrap();
    assert_eq!(
        ebc.forward(&kjt).unwrap_err(),
        SparseError::IdOutOfRange {
            table: "t".into(),
            feature: "f".into(),
            sample: 1,
            id: 3,
            rows: 3
        }
    );
    // Deep in a long batch of short bags (several forward tasks, empty bags
    // before it), the second id of sample 278's bag: the error names the sample.
    let lengths: Vec<i64> = (0..300).map(|s| s % 3).collect();
    let mut values: Vec<i64> = vec![0; lengths.iter().sum::<i64>() as usize];
    let before: i64 = lengths[..278].iter().sum();
    values[before as usize + 1] = 7;
    let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], values, &lengths, None).unwrap();
    assert_eq!(
        ebc.forward(&kjt).unwrap_err(),
        SparseError::IdOutOfRange {
            table: "t".into(),
            feature: "f".into(),
            sample: 278,
            id: 7,
            rows: 3
        }
    );
    let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![-1], &[1], None).unwrap();
    assert!(matches!(
        ebc.forward(&kjt).unwrap_err(),
        SparseError::IdOutOfRange { id: -1, .. }
    ));
    // A key no table serves is ignored (TorchRec's collections look up
    // their own features of a batch that feeds several).
    let kjt =
        KeyedJaggedTensor::from_lengths(vec!["g".into(), "f".into()], vec![-5, 1], &[1, 1], None)
            .unwrap();
    let only_f = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![1], &[1], None).unwrap();
    assert_eq!(
        ebc.forward(&kjt).unwrap().values(),
        ebc.forward(&only_f).unwrap().values()
    );
    let kjt = KeyedJaggedTensor::from_lengths(vec![], vec![], &[], None).unwrap();
    assert_eq!(
        ebc.forward(&kjt).unwrap_err(),
        SparseError::MissingFeature("f".into())
    );
    let mut ebc = ebc;
    let kjt = KeyedJaggedTensor::from_lengths(vec!["f".into()], vec![0], &[1], None).unwrap();
    assert!(matches!(
        ebc.backward_update(&kjt, &[0.0; 3]).unwrap_err(),
        SparseError::GradShape { .. }
    ));
    let bad = EmbeddingBagConfig::new("z", 0, 4, &["q"]);
    assert!(matches!(
        EmbeddingBagCollection::new(vec![bad], TableOptimizer::None, 0).unwrap_err(),
        SparseError::InvalidConfig { .. }
    ));
    let twice = vec![
        EmbeddingBagConfig::new("a", 2, 2, &["q"]),
        EmbeddingBagConfig::new("b", 2, 2, &["q"]),
    ];
    assert!(matches!(
        EmbeddingBagCollection::new(twice, TableOptimizer::None, 0).unwrap_err(),
        SparseError::FeatureServedTwice { .. }
    ));
}

#[test]
fn config_is_json() {
    let c = EmbeddingBagConfig::new("t_cat_0", 100, 16, &["cat_0"]).with_pooling(PoolingType::Mean);
    let json = serde_json::to_string(&c).unwrap();
    assert!(json.contains("\"pooling\":\"mean\""));
    let back: EmbeddingBagConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, c);
    let minimal: EmbeddingBagConfig = serde_json::from_str(
        r#"{"name":"t","num_embeddings":5,"embedding_dim":4,"feature_names":["f"]}"#,
    )
    .unwrap();
    assert_eq!(minimal.pooling, PoolingType::Sum);
}

/// Bags so long that a forward task holds a single sample (its ids capped),
/// next to empty bags: sums match a plain reference.
#[test]
fn very_long_bags_pool_correctly() {
    let configs = vec![
        EmbeddingBagConfig::new("a", 1000, 16, &["fa"]),
        EmbeddingBagConfig::new("b", 50, 3, &["fb"]).with_pooling(PoolingType::Mean),
    ];
    let ebc = EmbeddingBagCollection::new(configs.clone(), TableOptimizer::None, 3).unwrap();
    let mut rng = ember_sparse::rng::Rng::new(9);
    let lengths: Vec<i64> = vec![150_000, 0, 90_000, 70_000, 1, 0];
    let rows = [1000u64, 1000, 1000, 50, 50, 50];
    let values: Vec<i64> = lengths
        .iter()
        .zip(rows)
        .flat_map(|(&len, rows)| (0..len).map(|_| rng.below(rows) as i64).collect::<Vec<_>>())
        .collect();
    let kjt =
        KeyedJaggedTensor::from_lengths(vec!["fa".into(), "fb".into()], values, &lengths, None)
            .unwrap();
    let out = ebc.forward(&kjt).unwrap();
    let expected = reference_forward(&ebc, &configs, &kjt);
    for (a, e) in out.values().iter().zip(&expected) {
        assert!(close(*a as f64, *e, 1e-4), "{a} vs {e}");
    }
}

/// Sparse results are bitwise identical whatever the thread count.
#[test]
fn thread_count_does_not_change_results() {
    let configs: Vec<EmbeddingBagConfig> = (0..3)
        .map(|t| EmbeddingBagConfig::new(&format!("t{t}"), 700, 16, &[&format!("f{t}")]))
        .collect();
    let mut rng = ember_sparse::rng::Rng::new(8);
    let batch = 300;
    let lengths: Vec<i64> = (0..3 * batch).map(|_| rng.below(6) as i64).collect();
    let values = (0..lengths.iter().sum::<i64>())
        .map(|_| rng.below(700) as i64)
        .collect();
    let keys = (0..3).map(|t| format!("f{t}")).collect();
    let kjt = KeyedJaggedTensor::from_lengths(keys, values, &lengths, None).unwrap();
    let grad: Vec<f32> = (0..batch * 48).map(|_| rng.next_f32() - 0.5).collect();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut ebc =
                EmbeddingBagCollection::new(configs.clone(), TableOptimizer::adam(0.01), 1)
                    .unwrap();
            let out = ebc.forward(&kjt).unwrap();
            ebc.backward_update(&kjt, &grad).unwrap();
            let tables: Vec<Vec<f32>> = ebc.tables().iter().map(|t| t.weights().to_vec()).collect();
            (out.values().to_vec(), tables)
        })
    };
    assert_eq!(run(1), run(2));
    assert_eq!(run(1), run(3));
}

/// A bad id anywhere in the batch leaves every table and the step count untouched.
#[test]
fn failed_backward_changes_nothing() {
    let configs = vec![
        EmbeddingBagConfig::new("a", 10, 4, &["x"]),
        EmbeddingBagConfig::new("b", 5, 4, &["y"]),
    ];
    let mut ebc = EmbeddingBagCollection::new(configs, TableOptimizer::adam(0.1), 0).unwrap();
    let before: Vec<Vec<f32>> = ebc.tables().iter().map(|t| t.weights().to_vec()).collect();
    let kjt = KeyedJaggedTensor::from_lengths(
        vec!["x".into(), "y".into()],
        vec![1, 2, 3, 9],
        &[1, 1, 1, 1],
        None,
    )
    .unwrap();
    let err = ebc.backward_update(&kjt, &[0.5; 16]).unwrap_err();
    assert_eq!(
        err,
        SparseError::IdOutOfRange {
            table: "b".into(),
            feature: "y".into(),
            sample: 1,
            id: 9,
            rows: 5
        }
    );
    let after: Vec<Vec<f32>> = ebc.tables().iter().map(|t| t.weights().to_vec()).collect();
    assert_eq!(before, after);
    assert_eq!(ebc.step(), 0);
}

#[test]
fn bad_optimizers_and_sizes_are_rejected() {
    let c = || vec![EmbeddingBagConfig::new("a", 10, 4, &["x"])];
    let bad = TableOptimizer::Adam {
        lr: 0.1,
        beta1: 1.0,
        beta2: 0.999,
        eps: 1e-8,
    };
    assert!(matches!(
        EmbeddingBagCollection::new(c(), bad, 0).unwrap_err(),
        SparseError::InvalidOptimizer(_)
    ));
    assert!(matches!(
        EmbeddingBagCollection::new(c(), TableOptimizer::sgd(f32::NAN), 0).unwrap_err(),
        SparseError::InvalidOptimizer(_)
    ));
    let huge = vec![EmbeddingBagConfig::new("h", usize::MAX / 2, 4, &["x"])];
    assert!(matches!(
        EmbeddingBagCollection::new(huge, TableOptimizer::None, 0).unwrap_err(),
        SparseError::InvalidConfig { .. }
    ));
    let twice = vec![EmbeddingBagConfig::new("a", 10, 4, &["x", "x"])];
    let err = EmbeddingBagCollection::new(twice, TableOptimizer::None, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("listed twice"), "{err}");
    let typo = serde_json::from_str::<EmbeddingBagConfig>(
        r#"{"name":"t","num_embeddings":5,"embedding_dim":4,"feature_names":["f"],"poolng":"mean"}"#,
    );
    assert!(typo.is_err());
}
