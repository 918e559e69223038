//! Embedding kernels: pooled forward, and forward + backward + fused update,
//! on a TBE-like shape scaled to run in seconds (8 tables x 200k rows x 128).
//! The full-size shapes of the book's benchmark pages come from `ember bench embedding`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ember::sparse::rng::Rng;
use ember::sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, TableOptimizer,
};

const TABLES: usize = 8;
const ROWS: usize = 200_000;
const DIM: usize = 128;
const BATCH: usize = 2048;

fn input(pooling: usize, seed: u64) -> KeyedJaggedTensor {
    let mut rng = Rng::new(seed);
    let keys: Vec<String> = (0..TABLES).map(|t| format!("f{t}")).collect();
    let values = (0..TABLES * BATCH * pooling)
        .map(|_| rng.below(ROWS as u64) as i64)
        .collect();
    KeyedJaggedTensor::from_lengths(keys, values, &vec![pooling as i64; TABLES * BATCH], None)
        .unwrap()
}

fn collection(opt: TableOptimizer) -> EmbeddingBagCollection {
    let configs = (0..TABLES)
        .map(|t| EmbeddingBagConfig::new(&format!("t{t}"), ROWS, DIM, &[&format!("f{t}")]))
        .collect();
    EmbeddingBagCollection::new(configs, opt, 0).unwrap()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("embedding");
    group.sample_size(20);
    for pooling in [1, 20] {
        let kjt = input(pooling, pooling as u64);
        group.throughput(Throughput::Elements((TABLES * BATCH * pooling) as u64));
        let ebc = collection(TableOptimizer::None);
        let mut out = ebc.new_output(BATCH);
        group.bench_with_input(BenchmarkId::new("forward", pooling), &kjt, |b, kjt| {
            b.iter(|| ebc.forward_into(kjt, &mut out).unwrap())
        });
        let mut ebc = collection(TableOptimizer::rowwise_adagrad(0.01));
        let grad = vec![0.01f32; BATCH * TABLES * DIM];
        group.bench_with_input(
            BenchmarkId::new("forward_backward_rowwise_adagrad", pooling),
            &kjt,
            |b, kjt| {
                b.iter(|| {
                    ebc.forward_into(kjt, &mut out).unwrap();
                    ebc.backward_update(kjt, &grad).unwrap();
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
