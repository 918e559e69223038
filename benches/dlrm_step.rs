//! One DLRM training step (forward, loss, backward, both optimizers) on the
//! Criteo Kaggle architecture with smaller tables (26 x 10k rows), so the
//! dense towers dominate as they do at full size.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ember::dense::{DenseOptimizerConfig, NativeBackend};
use ember::models::{
    Backend, DataGeneration, Dlrm, DlrmConfig, ExecMode, InteractionType, Model, SyntheticConfig,
    SyntheticData,
};
use ember::sparse::TableOptimizer;

fn bench(c: &mut Criterion) {
    let batch_size = 2048;
    let config = DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[10_000; 26], 16),
        bottom_mlp: vec![13, 512, 256, 64, 16],
        top_mlp: vec![512, 256, 1],
        interaction: InteractionType::Dot,
    };
    let data = SyntheticData::new(SyntheticConfig {
        fixed_indices: true,
        ..SyntheticConfig::for_model(&config, DataGeneration::Random, 1, 0)
    })
    .unwrap();
    let batch = data.batch(0, batch_size);
    let be = Backend::Native(NativeBackend::new(rayon::current_num_threads()));
    let mut model = Dlrm::builder(config)
        .optimizers(
            TableOptimizer::rowwise_adagrad(0.01),
            DenseOptimizerConfig::Adagrad {
                lr: 0.01,
                eps: 1e-10,
            },
        )
        .seed(0)
        .build()
        .unwrap();
    let mut group = c.benchmark_group("dlrm_kaggle");
    group.sample_size(10);
    group.throughput(Throughput::Elements(batch_size as u64));
    group.bench_function("train_step_rowwise_adagrad", |b| {
        b.iter(|| model.train_step(&be, &batch, ExecMode::Strict).unwrap())
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
