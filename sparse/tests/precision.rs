//! Tables below fp32: every data type pools exactly as its decoded rows
//! would in fp32; fp16/bf16 rows train with reproducible, unbiased
//! stochastic rounding; quantized tables are for inference only; fp16 and
//! bf16 outputs are the fp32 output's nearest values.

use ember_sparse::{
    bf16, f16, DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor,
    KeyedTensor, PoolingType, SparseError, TableOptimizer,
};
use proptest::prelude::*;

/// Tables of every kernel shape (fixed dims and others, sum and mean), a
/// weighted or unweighted batch of random bags, and a gradient.
fn problem() -> impl Strategy<Value = (Vec<EmbeddingBagConfig>, KeyedJaggedTensor, Vec<f32>)> {
    let dim = prop_oneof![1usize..40, Just(16), Just(32), Just(64), Just(128)];
    let table = (prop_oneof![1usize..9, 300usize..900], dim, prop::bool::ANY);
    (
        prop::collection::vec(table, 1..4),
        prop_oneof![1usize..6, 70usize..160],
        any::<u64>(),
        prop::bool::ANY,
    )
        .prop_map(|(tables, batch, seed, weighted)| {
            let mut rng = ember_sparse::rng::Rng::new(seed);
            let (mut configs, mut lengths, mut values) = (Vec::new(), Vec::new(), Vec::new());
            let mut keys = Vec::new();
            for (t, (rows, dim, mean)) in tables.into_iter().enumerate() {
                let key = format!("f{t}");
                let pooling = if mean {
                    PoolingType::Mean
                } else {
                    PoolingType::Sum
                };
                configs.push(
                    EmbeddingBagConfig::new(&format!("t{t}"), rows, dim, &[&key])
                        .with_pooling(pooling),
                );
                keys.push(key);
                for _ in 0..batch {
                    let len = rng.below(6) as i64;
                    lengths.push(len);
                    values.extend((0..len).map(|_| rng.below(rows as u64) as i64));
                }
            }
            let weights =
                weighted.then(|| values.iter().map(|_| rng.next_f32() * 2.0 - 0.5).collect());
            let kjt = KeyedJaggedTensor::from_lengths(keys, values, &lengths, weights).unwrap();
            let width: usize = configs.iter().map(|c| c.embedding_dim).sum();
            let grad = (0..batch * width)
                .map(|_| rng.next_f32() * 2.0 - 1.0)
                .collect();
            (configs, kjt, grad)
        })
}

fn with_type(configs: &[EmbeddingBagConfig], dtype: DataType) -> Vec<EmbeddingBagConfig> {
    configs
        .iter()
        .map(|c| c.clone().with_data_type(dtype))
        .collect()
}

/// An fp32 collection holding `ebc`'s rows as fp32 values, decoded.
fn decoded(ebc: &EmbeddingBagCollection, configs: &[EmbeddingBagConfig]) -> EmbeddingBagCollection {
    let mut out = EmbeddingBagCollection::zeroed(configs.to_vec(), TableOptimizer::None).unwrap();
    for (src, dst) in ebc.tables().iter().zip(out.tables_mut()) {
        let mut row = vec![0f32; src.dim()];
        for id in 0..src.num_embeddings() {
            src.read_row(id, &mut row);
            dst.write_row(id, &row);
        }
    }
    out
}

/// All rows of a table, decoded, row-major.
fn rows_of(ebc: &EmbeddingBagCollection, t: usize) -> Vec<f32> {
    let table = &ebc.tables()[t];
    let mut out = vec![0f32; table.num_embeddings() * table.dim()];
    for (id, row) in out.chunks_exact_mut(table.dim()).enumerate() {
        table.read_row(id, row);
    }
    out
}

/// The largest spacing of `dtype`'s values around `x` (a relative step, or
/// the smallest subnormal step near zero).
fn spacing(dtype: DataType, x: f32) -> f32 {
    let (mantissa, tiny) = match dtype {
        DataType::Fp16 => (10, 2f32.powi(-24)),
        DataType::Bf16 => (7, 0.0),
        _ => (23, 0.0),
    };
    (x.abs() * 2f32.powi(-mantissa)).max(tiny) * 2.0
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// The forward of a table of any type gives, bit for bit, the forward of
    /// a fp32 table holding its decoded rows: decoding is the only difference.
    #[test]
    fn every_type_pools_exactly_as_its_decoded_rows((configs, kjt, _) in problem()) {
        for dtype in DataType::ALL {
            let typed = with_type(&configs, dtype);
            let ebc = EmbeddingBagCollection::new(typed, TableOptimizer::None, 5).unwrap();
            let reference = decoded(&ebc, &configs);
            let (got, want) = (ebc.forward(&kjt).unwrap(), reference.forward(&kjt).unwrap());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(got.values()), bits(want.values()), "{}", dtype);
        }
    }

    /// A forward into fp16 or bf16 output gives, for tables of every type,
    /// every kernel dim and both poolings, the nearest value of its type to
    /// the fp32 forward's (FBGEMM's inference `output_dtype`); a reused
    /// output of another batch's size is reshaped first.
    #[test]
    fn half_outputs_are_the_nearest_to_the_fp32_output((configs, kjt, _) in problem()) {
        for dtype in DataType::ALL {
            let ebc = EmbeddingBagCollection::new(with_type(&configs, dtype), TableOptimizer::None, 5)
                .unwrap();
            let want = ebc.forward(&kjt).unwrap();
            let mut fp16 = ebc.new_output_of::<f16>(kjt.stride() + 3);
            ebc.forward_into(&kjt, &mut fp16).unwrap();
            let mut bf16_out = KeyedTensor::<bf16>::zeros(vec![], vec![], 0);
            ebc.forward_into(&kjt, &mut bf16_out).unwrap();
            prop_assert_eq!(fp16.batch(), kjt.stride());
            prop_assert_eq!(fp16.keys(), want.keys());
            prop_assert_eq!(bf16_out.length_per_key(), want.length_per_key());
            let nearest16: Vec<u16> = want.values().iter().map(|&x| f16::from_f32(x).to_bits()).collect();
            let nearest_bf: Vec<u16> = want.values().iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
            let got16: Vec<u16> = fp16.values().iter().map(|x| x.to_bits()).collect();
            let got_bf: Vec<u16> = bf16_out.values().iter().map(|x| x.to_bits()).collect();
            prop_assert_eq!(got16, nearest16, "fp16 output of {} tables", dtype);
            prop_assert_eq!(got_bf, nearest_bf, "bf16 output of {} tables", dtype);
        }
    }

    /// One fused update of a fp16/bf16 table lands every updated value on a
    /// neighbour of the fp32 update of its decoded row; untouched rows keep
    /// their bits.
    #[test]
    fn half_updates_round_to_a_neighbour_of_the_fp32_update(
        (configs, kjt, grad) in problem(),
        which in 0usize..4,
    ) {
        let opt = [
            TableOptimizer::sgd(0.05),
            TableOptimizer::adagrad(0.05),
            TableOptimizer::rowwise_adagrad(0.05),
            TableOptimizer::adam(0.01),
        ][which];
        for dtype in [DataType::Fp16, DataType::Bf16] {
            let mut half = EmbeddingBagCollection::new(with_type(&configs, dtype), opt, 9).unwrap();
            // The same start in fp32: the decoded rows, the same optimizer.
            let mut full = EmbeddingBagCollection::zeroed(configs.clone(), opt).unwrap();
            for t in 0..configs.len() {
                let values = rows_of(&half, t);
                full.tables_mut()[t].weights_mut().copy_from_slice(&values);
            }
            let before: Vec<Vec<f32>> = (0..configs.len()).map(|t| rows_of(&half, t)).collect();
            half.backward_update(&kjt, &grad).unwrap();
            full.backward_update(&kjt, &grad).unwrap();
            for (t, before) in before.iter().enumerate() {
                let (got, want) = (rows_of(&half, t), rows_of(&full, t));
                for (i, ((g, w), b)) in got.iter().zip(&want).zip(before).enumerate() {
                    if w == b {
                        prop_assert_eq!(g.to_bits(), b.to_bits(), "{} table {} value {}: untouched", dtype, t, i);
                    } else {
                        prop_assert!((g - w).abs() <= spacing(dtype, *w), "{} table {} value {}: {} vs fp32 {}", dtype, t, i, g, w);
                    }
                }
                // The optimizer state stays fp32 and equals fp32 training's exactly.
                prop_assert_eq!(half.tables()[t].optimizer_state(), full.tables()[t].optimizer_state());
            }
        }
    }
}

fn one_table(dtype: DataType, rows: usize, dim: usize) -> Vec<EmbeddingBagConfig> {
    vec![EmbeddingBagConfig::new("t", rows, dim, &["f"]).with_data_type(dtype)]
}

/// A batch looking up ids `0..ids` once each.
fn batch_of(ids: usize) -> KeyedJaggedTensor {
    KeyedJaggedTensor::from_lengths(
        vec!["f".into()],
        (0..ids as i64).collect(),
        &vec![1; ids],
        None,
    )
    .unwrap()
}

#[test]
fn stochastic_rounding_repeats_whatever_the_threads_and_follows_the_seed() {
    let run = |threads: usize, seed: u64| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut ebc = EmbeddingBagCollection::new(
                one_table(DataType::Fp16, 3000, 24),
                TableOptimizer::adam(0.01),
                3,
            )
            .unwrap();
            ebc.set_rounding_seed(seed);
            let kjt = batch_of(3000);
            let grad: Vec<f32> = (0..3000 * 24)
                .map(|i| ((i % 97) as f32 - 48.0) * 1e-3)
                .collect();
            for _ in 0..3 {
                ebc.backward_update(&kjt, &grad).unwrap();
            }
            ebc.tables()[0].row_bytes().to_vec()
        })
    };
    let one = run(1, 3);
    assert_eq!(one, run(4, 3), "the thread count changed the rounding");
    assert_eq!(one, run(1, 3), "a second run rounded differently");
    assert_ne!(one, run(1, 4), "another seed drew the same rounding");
}

/// Steps far below a value's spacing move a fp16/bf16 row by their sum on
/// average, where rounding to nearest would never move it.
#[test]
fn small_updates_add_up_on_average() {
    for (dtype, step) in [(DataType::Fp16, 1e-4f32), (DataType::Bf16, 1e-3)] {
        let (rows, dim, steps) = (1, 4096, 100);
        let mut ebc = EmbeddingBagCollection::new(
            vec![EmbeddingBagConfig {
                weight_init_min: Some(1.0),
                weight_init_max: Some(1.0),
                ..one_table(dtype, rows, dim).remove(0)
            }],
            TableOptimizer::sgd(1.0),
            1,
        )
        .unwrap();
        let kjt = batch_of(rows);
        let grad = vec![step; dim];
        for _ in 0..steps {
            ebc.backward_update(&kjt, &grad).unwrap();
        }
        let values = rows_of(&ebc, 0);
        let mean = values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64;
        let want = 1.0 - (steps as f64) * step as f64;
        // Each value is a sum of `steps` independent roundings: a spread of
        // about sqrt(steps) / 2 spacings, over 4096 columns.
        let tolerance =
            3.0 * spacing(dtype, 1.0) as f64 * (steps as f64).sqrt() / (dim as f64).sqrt();
        assert!(
            (mean - want).abs() < tolerance,
            "{dtype}: mean {mean}, want {want} ± {tolerance}"
        );
        assert!(values.iter().any(|&v| v != 1.0));
    }
}

#[test]
fn quantized_tables_take_no_optimizer() {
    for dtype in [
        DataType::Int8,
        DataType::Int4,
        DataType::Fp8,
        DataType::Mxfp4,
    ] {
        let err = EmbeddingBagCollection::new(one_table(dtype, 4, 8), TableOptimizer::sgd(0.1), 1)
            .unwrap_err();
        let SparseError::InvalidConfig { table, reason } = err else {
            panic!("{err:?}")
        };
        assert_eq!(table, "t");
        assert!(
            reason.contains(dtype.name()) && reason.contains("inference"),
            "{reason}"
        );
        let ebc =
            EmbeddingBagCollection::new(one_table(dtype, 4, 8), TableOptimizer::None, 1).unwrap();
        assert_eq!(ebc.bytes(), 4 * dtype.row_bytes(8).unwrap());
    }
}

#[test]
fn tables_take_the_bytes_of_their_type() {
    for dtype in [DataType::Fp32, DataType::Fp16, DataType::Bf16] {
        let ebc = EmbeddingBagCollection::new(
            one_table(dtype, 1000, 16),
            TableOptimizer::rowwise_adagrad(0.1),
            1,
        )
        .unwrap();
        // Rows in their type, row-wise Adagrad's one fp32 per row.
        assert_eq!(ebc.bytes(), 1000 * dtype.row_bytes(16).unwrap() + 1000 * 4);
        assert_eq!(ebc.tables()[0].data_type(), dtype);
    }
}

#[test]
fn config_json_names_the_type_and_defaults_to_fp32() {
    let json = r#"{"name": "t", "num_embeddings": 3, "embedding_dim": 4, "feature_names": ["f"], "data_type": "bf16"}"#;
    let config: EmbeddingBagConfig = serde_json::from_str(json).unwrap();
    assert_eq!(config.data_type, DataType::Bf16);
    let old = r#"{"name": "t", "num_embeddings": 3, "embedding_dim": 4, "feature_names": ["f"]}"#;
    assert_eq!(
        serde_json::from_str::<EmbeddingBagConfig>(old)
            .unwrap()
            .data_type,
        DataType::Fp32
    );
    let bad = r#"{"name": "t", "num_embeddings": 3, "embedding_dim": 4, "feature_names": ["f"], "data_type": "fp64"}"#;
    assert!(serde_json::from_str::<EmbeddingBagConfig>(bad)
        .unwrap_err()
        .to_string()
        .contains("fp64"));
}
