//! Synthetic id draws: uniform, Zipf at the exponents of the book's synthetic-data page, and the
//! `learnable` generator's log-uniform rank it sits beside, on the largest
//! MLPerf DLRMv2 table (40M rows).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ember::sparse::rng::Rng;
use ember::sparse::IdDistribution;

const ROWS: u64 = 40_000_000;
const DRAWS: u64 = 100_000;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("id_draws");
    group.throughput(Throughput::Elements(DRAWS));
    let cases = [
        ("uniform", IdDistribution::Uniform),
        ("zipf_0.9", IdDistribution::Zipf { alpha: 0.9 }),
        ("zipf_1.0", IdDistribution::Zipf { alpha: 1.0 }),
        ("zipf_1.15", IdDistribution::Zipf { alpha: 1.15 }),
    ];
    for (name, ids) in cases {
        let sampler = ids.sampler(ROWS).unwrap();
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            let mut rng = Rng::new(1);
            b.iter(|| (0..DRAWS).map(|_| sampler.sample(&mut rng)).sum::<u64>())
        });
    }
    // The log-uniform rank of `learnable` (models/src/data.rs), for scale.
    group.bench_function(BenchmarkId::from_parameter("log_uniform"), |b| {
        let mut rng = Rng::new(1);
        b.iter(|| {
            (0..DRAWS)
                .map(|_| ((ROWS as f64 + 1.0).powf(rng.next_f64()) - 1.0) as u64 % ROWS)
                .sum::<u64>()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
