//! The key-value tables' map alone against this machine's random-access
//! limit: two tables of 5M held ids, a batch of 100k held ids per table
//! found by inference staging (`prefetch` with `set_training(false)`: the
//! map's lookups and the batch rewritten as rows, no admission), beside
//! the roofline's plain prefetched gather of as many rows from tables of
//! as many rows (`ember::sparse::roofline`, what `bench embedding
//! --roofline` compares with). Both are ids per second; their ratio is
//! the map's share of the limit.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ember::sparse::rng::{splitmix, Rng};
use ember::sparse::{
    EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KvConfig, TableOptimizer,
};

const HELD: usize = 5_000_000;
const BATCH: usize = 100_000;
const DIM: usize = 16;

/// Raw ids of table `t`: 64-bit hashes of `0..HELD`.
fn raw(t: u64, k: u64) -> i64 {
    splitmix(k ^ (t << 60)) as i64
}

fn batch(ids: [Vec<i64>; 2]) -> KeyedJaggedTensor {
    let n = ids[0].len();
    let lengths = vec![1i64; 2 * n];
    let keys = vec!["a".into(), "b".into()];
    KeyedJaggedTensor::from_lengths(keys, ids.concat(), &lengths, None).unwrap()
}

fn bench(c: &mut Criterion) {
    let tables = ["a", "b"].map(|f| EmbeddingBagConfig {
        kv: Some(KvConfig::default()),
        ..EmbeddingBagConfig::new(&format!("t_{f}"), HELD + 1, DIM, &[f])
    });
    let mut ebc = EmbeddingBagCollection::new(tables.to_vec(), TableOptimizer::None, 1).unwrap();
    // Every id admitted, a chunk at a time.
    for first in (0..HELD as u64).step_by(1 << 20) {
        let last = (first + (1 << 20)).min(HELD as u64);
        ebc.prefetch(&batch(
            [0, 1].map(|t| (first..last).map(|k| raw(t, k)).collect()),
        ))
        .unwrap();
    }
    ebc.set_training(false);
    let mut rng = Rng::new(7);
    let lookups =
        batch([0, 1].map(|t| (0..BATCH).map(|_| raw(t, rng.below(HELD as u64))).collect()));
    let rows: Vec<Vec<f32>> = (0..2).map(|_| vec![0.5f32; (HELD + 1) * DIM]).collect();
    let row_ids: Vec<Vec<u32>> = (0..2)
        .map(|_| (0..BATCH).map(|_| rng.below(HELD as u64) as u32).collect())
        .collect();

    let mut group = c.benchmark_group("kv_map");
    group.throughput(Throughput::Elements(2 * BATCH as u64));
    group.bench_function(BenchmarkId::from_parameter("map_lookups"), |b| {
        b.iter(|| ebc.prefetch(&lookups).unwrap())
    });
    group.bench_function(BenchmarkId::from_parameter("roofline_gather"), |b| {
        let tables: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let ids: Vec<&[u32]> = row_ids.iter().map(Vec::as_slice).collect();
        b.iter(|| ember::sparse::roofline::gather_sum(&tables, &ids, DIM, 1))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
