//! `--mode debug`: the first NaN or infinity of a step is an error naming
//! where it appeared, before anything is updated.

use ember_dense::{DenseOptimizerConfig, HasParams, NativeBackend};
use ember_models::{Backend, ExecMode, Model};
use ember_models::{
    DataGeneration, Dlrm, DlrmConfig, InteractionType, ModelError, SyntheticConfig, SyntheticData,
};
use ember_sparse::TableOptimizer;

fn model_and_data() -> (Dlrm, SyntheticData) {
    let config = DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[10, 12], 4),
        bottom_mlp: vec![3, 6, 4],
        top_mlp: vec![5, 1],
        interaction: InteractionType::Dot,
    };
    let data = SyntheticData::new(SyntheticConfig {
        fixed_indices: true,
        ..SyntheticConfig::for_model(&config, DataGeneration::Random, 1, 1)
    })
    .unwrap();
    let model = Dlrm::builder(config)
        .optimizers(TableOptimizer::sgd(0.1), DenseOptimizerConfig::sgd(0.1))
        .seed(4)
        .build()
        .unwrap();
    (model, data)
}

#[test]
fn checked_steps_equal_plain_steps_on_finite_data() {
    let be = Backend::Native(NativeBackend::new(1));
    let (mut a, data) = model_and_data();
    let (mut b, _) = model_and_data();
    for i in 0..3 {
        let batch = data.batch(i, 8);
        assert_eq!(
            a.train_step(&be, &batch, ExecMode::Debug).unwrap().loss,
            b.train_step(&be, &batch, ExecMode::Strict).unwrap().loss
        );
    }
}

#[test]
fn the_first_non_finite_value_is_named_and_nothing_is_updated() {
    let be = Backend::Native(NativeBackend::new(1));
    // A NaN row in a table: named by feature, table and sample.
    let (mut model, data) = model_and_data();
    let batch = data.batch(0, 8);
    let id = batch.sparse.values()[batch.sparse.key_range(1).start] as usize;
    model.sparse_arch_mut().local_mut().unwrap().tables_mut()[1].weights_mut()[id * 4 + 2] =
        f32::NAN;
    let err = model.train_step(&be, &batch, ExecMode::Debug).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("cat_1") && text.contains("t_cat_1") && text.contains("sample 0, column 2"),
        "{text}"
    );
    // An infinite weight in the bottom MLP: named by its layer.
    let (mut model, data) = model_and_data();
    let dense = |m: &mut Dlrm| -> Vec<Vec<f32>> {
        (m.dense_arch_mut().params().iter())
            .map(|p| p.value.to_vec())
            .collect()
    };
    let before = dense(&mut model);
    model.dense_arch_mut().params()[0].value[0] = f32::INFINITY;
    let err = model
        .train_step(&be, &data.batch(0, 8), ExecMode::Debug)
        .unwrap_err();
    assert!(
        matches!(&err, ModelError::NonFinite { what, .. } if what.contains("dense_arch.model._mlp.0")),
        "{err}"
    );
    // The failed step left every other parameter as it was.
    let after = dense(&mut model);
    assert_eq!(after[1..], before[1..]);
}
