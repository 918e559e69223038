//! Gradients of the whole DLRM and DLRM-DCNv2 against central finite
//! differences in f64.

use ember_dense::{DenseBackend, DenseOptimizerConfig, HasParams, NativeBackend, Tensor};
use ember_models::{Backend, ExecMode, Model};
use ember_models::{
    Batch, DataGeneration, DenseArch, Dlrm, DlrmConfig, InteractionType, SyntheticConfig,
    SyntheticData,
};
use ember_sparse::TableOptimizer;

fn config(interaction: InteractionType) -> DlrmConfig {
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[7, 5, 9], 4),
        bottom_mlp: vec![3, 5, 4],
        top_mlp: vec![6, 1],
        interaction,
    }
}

fn interactions() -> [InteractionType; 2] {
    [
        InteractionType::Dot,
        InteractionType::Dcn { layers: 2, rank: 3 },
    ]
}

fn batch(config: &DlrmConfig, size: usize) -> Batch {
    SyntheticData::new(SyntheticConfig::for_model(
        config,
        DataGeneration::Learnable,
        3,
        9,
    ))
    .unwrap()
    .batch(0, size)
}

/// Mean BCE loss of the dense arch in f64.
fn loss(
    arch: &mut DenseArch<f64>,
    be: &NativeBackend,
    dense: &Tensor<f64>,
    pooled: &Tensor<f64>,
    labels: &[f64],
) -> f64 {
    let logits = arch.forward(be, dense, pooled).clone();
    let (mut d, mut loss) = (Tensor::default(), 0.0);
    be.bce_with_logits(logits.data(), labels, &mut d, &mut loss);
    loss
}

fn assert_close(what: &str, analytic: f64, numeric: f64) {
    let tol = 1e-6 * (1.0 + analytic.abs().max(numeric.abs()));
    assert!(
        (analytic - numeric).abs() <= tol.max(1e-9),
        "{what}: analytic {analytic} vs finite difference {numeric}"
    );
}

#[test]
fn dense_arch_gradients_match_finite_differences() {
    let be = NativeBackend::new(1);
    for interaction in interactions() {
        let config = config(interaction);
        let mut arch = DenseArch::<f64>::new(&config, 1).unwrap();
        let b = batch(&config, 5);
        let dense: Tensor<f64> = b.dense.cast();
        let mut rng = ember_sparse::rng::Rng::new(4);
        let width = config.num_sparse_features() * config.embedding_dim();
        let pooled = Tensor::from_vec(
            5,
            width,
            (0..5 * width).map(|_| rng.next_f64() - 0.5).collect(),
        )
        .unwrap();
        let labels: Vec<f64> = b.labels.iter().map(|&y| y as f64).collect();

        let logits = arch.forward(&be, &dense, &pooled).clone();
        let mut d_logits = Tensor::default();
        be.bce_with_logits(logits.data(), &labels, &mut d_logits, &mut 0.0);
        let d_pooled = arch.backward(&be, &d_logits).clone();
        let grads: Vec<(String, Vec<f64>)> = arch
            .params()
            .into_iter()
            .map(|p| (p.name, p.grad.to_vec()))
            .collect();

        let eps = 1e-6;
        for i in (0..pooled.data().len()).step_by(7) {
            let mut plus = pooled.clone();
            plus.data_mut()[i] += eps;
            let mut minus = pooled.clone();
            minus.data_mut()[i] -= eps;
            let numeric = (loss(&mut arch, &be, &dense, &plus, &labels)
                - loss(&mut arch, &be, &dense, &minus, &labels))
                / (2.0 * eps);
            assert_close(
                &format!("{interaction:?} d pooled[{i}]"),
                d_pooled.data()[i],
                numeric,
            );
        }
        for (p, (name, grad)) in grads.iter().enumerate() {
            for i in (0..grad.len()).step_by(5) {
                let nudge =
                    |arch: &mut DenseArch<f64>, delta: f64| arch.params()[p].value[i] += delta;
                nudge(&mut arch, eps);
                let up = loss(&mut arch, &be, &dense, &pooled, &labels);
                nudge(&mut arch, -2.0 * eps);
                let down = loss(&mut arch, &be, &dense, &pooled, &labels);
                nudge(&mut arch, eps);
                assert_close(
                    &format!("{interaction:?} {name}[{i}]"),
                    grad[i],
                    (up - down) / (2.0 * eps),
                );
            }
        }
        assert!(grads.iter().any(|(n, _)| n.starts_with("over_arch")));
        assert!(grads.iter().any(|(n, _)| n.starts_with("dense_arch")));
        assert_eq!(
            grads
                .iter()
                .any(|(n, _)| n.starts_with("inter_arch.crossnet")),
            matches!(interaction, InteractionType::Dcn { .. })
        );
    }
}

/// The whole model, embeddings included: one SGD step with lr 1 on the tables
/// (and lr 0 on the dense part) moves every table entry by minus its
/// gradient; that gradient must match finite differences of the f64 loss as
/// a function of the table entries.
#[test]
fn whole_dlrm_table_gradients_match_finite_differences() {
    let be = NativeBackend::new(1);
    let backend = Backend::Native(NativeBackend::new(1));
    for interaction in interactions() {
        let config = config(interaction);
        let mut model = Dlrm::builder(config.clone())
            .optimizers(
                TableOptimizer::sgd(1.0),
                DenseOptimizerConfig::Sgd { lr: 0.0 },
            )
            .seed(3)
            .build()
            .unwrap();
        let b = batch(&config, 6);
        let tables_before: Vec<Vec<f64>> = model
            .sparse_arch()
            .unsharded()
            .unwrap()
            .tables()
            .iter()
            .map(|t| t.weights().iter().map(|&w| w as f64).collect())
            .collect();
        // The f64 twin of the dense arch, with the f32 model's weights.
        let mut arch64 = DenseArch::<f64>::new(&config, 3).unwrap();
        for (dst, src) in arch64
            .params()
            .into_iter()
            .zip(model.dense_arch_mut().params())
        {
            assert_eq!(dst.name, src.name);
            dst.value
                .iter_mut()
                .zip(src.value.iter())
                .for_each(|(d, s)| *d = *s as f64);
        }
        model.train_step(&backend, &b, ExecMode::Strict).unwrap();
        let dense: Tensor<f64> = b.dense.cast();
        let labels: Vec<f64> = b.labels.iter().map(|&y| y as f64).collect();
        let dim = config.embedding_dim();
        let f = config.num_sparse_features();
        // Sum-pooling in f64 from the given tables.
        let pool = |tables: &[Vec<f64>]| {
            let mut pooled = Tensor::<f64>::zeros(6, f * dim);
            for (t, table) in tables.iter().enumerate() {
                let key = b
                    .sparse
                    .key_index(&config.tables[t].feature_names[0])
                    .unwrap();
                let offsets = &b.sparse.offsets()[key * 6..=(key + 1) * 6];
                for s in 0..6 {
                    for p in offsets[s]..offsets[s + 1] {
                        let id = b.sparse.values()[p] as usize;
                        for d in 0..dim {
                            pooled.row_mut(s)[t * dim + d] += table[id * dim + d];
                        }
                    }
                }
            }
            pooled
        };
        let eps = 1e-6;
        let mut checked = 0;
        for (t, table) in model
            .sparse_arch()
            .unsharded()
            .unwrap()
            .tables()
            .iter()
            .enumerate()
        {
            for i in 0..table.weights().len() {
                let analytic = tables_before[t][i] - table.weights()[i] as f64;
                let mut plus = tables_before.clone();
                plus[t][i] += eps;
                let mut minus = tables_before.clone();
                minus[t][i] -= eps;
                let numeric = (loss(&mut arch64, &be, &dense, &pool(&plus), &labels)
                    - loss(&mut arch64, &be, &dense, &pool(&minus), &labels))
                    / (2.0 * eps);
                // The analytic side ran in f32: allow f32 rounding of a weight update.
                let tol = 2e-6 + 1e-3 * numeric.abs();
                assert!(
                    (analytic - numeric).abs() <= tol,
                    "{interaction:?} table {t} entry {i}: {analytic} vs {numeric}"
                );
                checked += (numeric != 0.0) as usize;
            }
        }
        assert!(checked > 10, "too few table entries received a gradient");
    }
}
