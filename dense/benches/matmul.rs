//! Matrix products of the DLRM Criteo-Kaggle dense tower (batch 2048), `gemm` 0.19 against
//! `matrixmultiply`, on 1 and 2 threads; plus the native backend's MLP, interaction and whole
//! dense step at the same shapes. Throughput of the product groups is in FLOP/s ("elem/s"),
//! of the layer groups in samples/s.
//!
//! `matrixmultiply` is built without its `threading` feature (its thread pool crate is not a
//! dependency here), so its 2-thread variant splits the rows of C into two halves with
//! `rayon::join`, which is how this crate would parallelize it.
//!
//! `gemm` is built with its `x86-v4` feature (see Cargo.toml), so on a CPU with AVX-512 both
//! crates use AVX-512 kernels; on an AVX2-only CPU (Zen 3) both fall back to AVX2+FMA.
//!
//! Run: `cargo bench -p ember-dense --bench matmul` (add a filter such as `gemm_vs` or `layers`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ember_dense::{
    Activation, BceWithLogits, DenseOptimizer, DenseOptimizerConfig, DotInteraction, HasParams,
    Initializer, Mlp, NativeBackend, Tensor,
};

const BATCH: usize = 2048;

/// `C[m, n] = op(A)[m, k] · op(B)[k, n]`, named after the layer and pass it comes from.
struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
}

#[rustfmt::skip]
const SHAPES: &[Shape] = &[
    // forward y = x · wᵀ
    Shape { name: "fwd_2048x13->512", m: BATCH, n: 512, k: 13, ta: false, tb: true },
    Shape { name: "fwd_2048x512->256", m: BATCH, n: 256, k: 512, ta: false, tb: true },
    Shape { name: "fwd_2048x367->512", m: BATCH, n: 512, k: 367, ta: false, tb: true },
    // backward dw = dzᵀ · x
    Shape { name: "dw_512x13_k2048", m: 512, n: 13, k: BATCH, ta: true, tb: false },
    Shape { name: "dw_256x512_k2048", m: 256, n: 512, k: BATCH, ta: true, tb: false },
    Shape { name: "dw_512x367_k2048", m: 512, n: 367, k: BATCH, ta: true, tb: false },
    // backward dx = dz · w
    Shape { name: "dx_2048x256->512", m: BATCH, n: 512, k: 256, ta: false, tb: false },
    Shape { name: "dx_2048x512->367", m: BATCH, n: 367, k: 512, ta: false, tb: false },
];

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// Row and column strides of `op(X)` for a row-major `X` stored as `[rows, cols]`.
fn strides(cols: usize, trans: bool) -> (isize, isize) {
    if trans {
        (1, cols as isize)
    } else {
        (cols as isize, 1)
    }
}

struct Operands {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    a_rs: isize,
    a_cs: isize,
    b_rs: isize,
    b_cs: isize,
}

fn operands(s: &Shape) -> Operands {
    let mut rng = Initializer::new(1);
    let a: Tensor<f32> = rng.uniform_tensor(s.m, s.k, 1.0);
    let b: Tensor<f32> = rng.uniform_tensor(s.k, s.n, 1.0);
    // Stored as op(X)'s transpose when op transposes; only the strides matter for speed.
    let (a_rs, a_cs) = strides(if s.ta { s.m } else { s.k }, s.ta);
    let (b_rs, b_cs) = strides(if s.tb { s.k } else { s.n }, s.tb);
    Operands {
        a: a.into_vec(),
        b: b.into_vec(),
        c: vec![0.0; s.m * s.n],
        a_rs,
        a_cs,
        b_rs,
        b_cs,
    }
}

fn run_gemm(s: &Shape, o: &mut Operands, threads: usize) {
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: buffers hold exactly the strided extents described.
    unsafe {
        gemm::gemm(
            s.m,
            s.n,
            s.k,
            o.c.as_mut_ptr(),
            1,
            s.n as isize,
            false,
            o.a.as_ptr(),
            o.a_cs,
            o.a_rs,
            o.b.as_ptr(),
            o.b_cs,
            o.b_rs,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// `matrixmultiply::sgemm` on rows `[r0, r0 + rows)` of C.
fn mm_rows(s: &Shape, o: &Operands, c: usize, r0: usize, rows: usize) {
    // SAFETY: the row range lies inside C and A; C rows of different calls do not overlap.
    unsafe {
        matrixmultiply::sgemm(
            rows,
            s.k,
            s.n,
            1.0,
            o.a.as_ptr().offset(r0 as isize * o.a_rs),
            o.a_rs,
            o.a_cs,
            o.b.as_ptr(),
            o.b_rs,
            o.b_cs,
            0.0,
            (c as *mut f32).add(r0 * s.n),
            s.n as isize,
            1,
        );
    }
}

fn run_mm(s: &Shape, o: &mut Operands, threads: usize) {
    let c = o.c.as_mut_ptr() as usize;
    if threads == 1 {
        mm_rows(s, o, c, 0, s.m);
    } else {
        let half = s.m / 2;
        let o = &*o;
        rayon::join(
            || mm_rows(s, o, c, 0, half),
            || mm_rows(s, o, c, half, s.m - half),
        );
    }
}

fn gemm_vs_matrixmultiply(cr: &mut Criterion) {
    let mut group = cr.benchmark_group("gemm_vs_matrixmultiply");
    for s in SHAPES {
        group.throughput(Throughput::Elements((2 * s.m * s.n * s.k) as u64));
        let mut o = operands(s);
        for threads in [1, 2] {
            let p = pool(threads);
            group.bench_function(
                BenchmarkId::new(format!("gemm/{threads}t"), s.name),
                |bch| p.install(|| bch.iter(|| run_gemm(s, black_box(&mut o), threads))),
            );
            group.bench_function(
                BenchmarkId::new(format!("matrixmultiply/{threads}t"), s.name),
                |bch| p.install(|| bch.iter(|| run_mm(s, black_box(&mut o), threads))),
            );
        }
    }
    group.finish();
}

fn layers(cr: &mut Criterion) {
    let mut group = cr.benchmark_group("layers");
    group.throughput(Throughput::Elements(BATCH as u64));
    let mut rng = Initializer::new(2);
    let x_top: Tensor<f32> = rng.uniform_tensor(BATCH, 367, 1.0);
    let dy_top: Tensor<f32> = rng.uniform_tensor(BATCH, 1, 1.0);
    let x_bot: Tensor<f32> = rng.uniform_tensor(BATCH, 13, 1.0);
    let dy_bot: Tensor<f32> = rng.uniform_tensor(BATCH, 16, 1.0);
    let emb: Tensor<f32> = rng.uniform_tensor(BATCH, 26 * 16, 1.0);
    let dz: Tensor<f32> = rng.uniform_tensor(BATCH, 367, 1.0);
    let labels: Vec<f32> = (0..BATCH).map(|i| (i % 4 == 0) as u8 as f32).collect();
    for threads in [1, 2] {
        let p = pool(threads);
        let be = NativeBackend::new(threads);
        let mut top = Mlp::<f32>::new(&[367, 512, 256, 1], Activation::None, 1);
        group.bench_function(
            BenchmarkId::new("top_mlp_fwd_bwd", format!("{threads}t")),
            |bch| {
                p.install(|| {
                    bch.iter(|| {
                        top.forward(&be, &x_top);
                        black_box(top.backward(&be, &dy_top, true));
                    })
                })
            },
        );
        let mut bottom = Mlp::<f32>::new(&[13, 512, 256, 64, 16], Activation::Relu, 1);
        group.bench_function(
            BenchmarkId::new("bottom_mlp_fwd_bwd", format!("{threads}t")),
            |bch| {
                p.install(|| {
                    bch.iter(|| {
                        bottom.forward(&be, &x_bot);
                        black_box(bottom.backward(&be, &dy_bot, false));
                    })
                })
            },
        );
        let mut inter = DotInteraction::<f32>::new(26, 16);
        group.bench_function(
            BenchmarkId::new("interaction_fwd_bwd", format!("{threads}t")),
            |bch| {
                p.install(|| {
                    bch.iter(|| {
                        inter.forward(&be, &dy_bot, &emb);
                        black_box(inter.backward(&be, &dz));
                    })
                })
            },
        );
        // The whole dense side of a DLRM step: everything but the embedding lookups/updates.
        let mut inter = DotInteraction::<f32>::new(26, 16);
        let mut bce = BceWithLogits::<f32>::new();
        let mut opt_top = DenseOptimizer::<f32>::new(DenseOptimizerConfig::sgd(0.01));
        let mut opt_bottom = DenseOptimizer::<f32>::new(DenseOptimizerConfig::sgd(0.01));
        group.bench_function(
            BenchmarkId::new("dense_step_sgd", format!("{threads}t")),
            |bch| {
                p.install(|| {
                    bch.iter(|| {
                        let dense = bottom.forward(&be, &x_bot);
                        let z = inter.forward(&be, dense, &emb);
                        let logits = top.forward(&be, z);
                        bce.forward_backward(&be, logits, &labels);
                        let dz = top.backward(&be, bce.grad(), true).unwrap();
                        let (ddense, demb) = inter.backward(&be, dz);
                        black_box(demb);
                        bottom.backward(&be, ddense, false);
                        opt_top.step(top.params());
                        opt_bottom.step(bottom.params());
                    })
                })
            },
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    targets = gemm_vs_matrixmultiply, layers
}
criterion_main!(benches);
