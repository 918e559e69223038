//! `ember bench hstu`: HSTU training steps on synthetic user histories of
//! Zipf lengths: the item lookup (an `EmbeddingCollection`), a stack of
//! HSTU layers forward and backward on the jagged batch, and the fused
//! table update. Reports samples/s, the step split (lookup, attention,
//! rest), GFLOP/s against the same run's GEMM peak, and with `--padded`
//! the same layers on the batch padded to its longest history.

use std::time::Instant;

use clap::{Args, ValueEnum};
use ember_dense::jagged::Jagged;
use ember_dense::{
    DenseBackend, DenseOptimizer, DenseOptimizerConfig, HasParams, HstuConfig, HstuInput,
    HstuLayer, NativeBackend, Tensor,
};
use ember_sparse::rng::Rng;
use ember_sparse::{
    EmbeddingCollection, EmbeddingConfig, IdDistribution, KeyedJaggedTensor, TableOptimizer,
};
use serde::Serialize;

use super::bench_embedding::median;
use super::Progress;
use ember_models::sequential::Zipf;

/// Shapes people compare against.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum HstuPreset {
    /// MLPerf DLRMv4's HSTU layers: 3 layers, 4 heads, attention and linear
    /// dims 128, tokens of 512; histories up to 4096. The item table is
    /// scaled to 100,000 rows (the benchmark's are billions) so the run
    /// fits any machine; the layers are the benchmark's.
    Dlrmv4,
    /// A small model (ML-1M's research config: 2 layers, 1 head, dim 50,
    /// histories up to 200).
    Ml1m,
}

#[derive(Args, Clone, Debug)]
pub struct HstuArgs {
    /// The layer shape and history lengths (each flag below overrides it).
    #[arg(long, value_enum, default_value = "dlrmv4")]
    pub preset: HstuPreset,
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub num_heads: Option<usize>,
    /// Query and key width per head.
    #[arg(long)]
    pub attention_dim: Option<usize>,
    /// Value and gate width per head.
    #[arg(long)]
    pub linear_dim: Option<usize>,
    /// Token (item embedding) width.
    #[arg(long)]
    pub embedding_dim: Option<usize>,
    /// The longest history.
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// Rows of the item table.
    #[arg(long)]
    pub num_items: Option<usize>,
    /// Users a step.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// History lengths: Zipf over 1..=max-seq-len with this exponent.
    #[arg(long, default_value_t = 1.0)]
    pub length_alpha: f64,
    /// Timed steps (after one untimed).
    #[arg(long, default_value_t = 10)]
    pub num_batches: usize,
    /// Also run the layers on the batches padded to their longest history.
    #[arg(long)]
    pub padded: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Compute threads (all cores when absent).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

/// The run's shape, presets resolved.
#[derive(Clone, Debug, Serialize)]
pub struct HstuShape {
    pub layers: usize,
    pub num_heads: usize,
    pub attention_dim: usize,
    pub linear_dim: usize,
    pub embedding_dim: usize,
    pub max_seq_len: usize,
    pub num_items: usize,
    pub batch_size: usize,
    pub length_alpha: f64,
}

impl HstuArgs {
    fn shape(&self) -> anyhow::Result<HstuShape> {
        let (layers, heads, attn, linear, dim, max_len, items) = match self.preset {
            HstuPreset::Dlrmv4 => (3, 4, 128, 128, 512, 4096, 100_000),
            HstuPreset::Ml1m => (2, 1, 50, 50, 50, 200, 3416),
        };
        let shape = HstuShape {
            layers: self.layers.unwrap_or(layers),
            num_heads: self.num_heads.unwrap_or(heads),
            attention_dim: self.attention_dim.unwrap_or(attn),
            linear_dim: self.linear_dim.unwrap_or(linear),
            embedding_dim: self.embedding_dim.unwrap_or(dim),
            max_seq_len: self.max_seq_len.unwrap_or(max_len),
            num_items: self.num_items.unwrap_or(items),
            batch_size: self.batch_size,
            length_alpha: self.length_alpha,
        };
        for (flag, v) in [
            ("--layers", shape.layers),
            ("--num-heads", shape.num_heads),
            ("--attention-dim", shape.attention_dim),
            ("--linear-dim", shape.linear_dim),
            ("--embedding-dim", shape.embedding_dim),
            ("--max-seq-len", shape.max_seq_len),
            ("--num-items", shape.num_items),
            ("--batch-size", shape.batch_size),
            ("--num-batches", self.num_batches),
        ] {
            anyhow::ensure!(v >= 1, "{flag} must be at least 1");
        }
        anyhow::ensure!(
            shape.max_seq_len <= MAX_SEQ_LEN,
            "--max-seq-len {}: at most {MAX_SEQ_LEN}",
            shape.max_seq_len
        );
        anyhow::ensure!(
            self.length_alpha.is_finite() && self.length_alpha > 0.0,
            "--length-alpha {}: a finite exponent above 0",
            self.length_alpha
        );
        Ok(shape)
    }
}

/// The longest history the bench takes: DLRMv4's 4096, and room above.
const MAX_SEQ_LEN: usize = 1 << 16;

/// Milliseconds a step, by part.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StepSplit {
    pub step_ms: f64,
    pub lookup_ms: f64,
    pub attention_ms: f64,
    pub rest_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct HstuReport {
    pub run: super::run_info::RunInfo,
    pub shape: HstuShape,
    pub threads: usize,
    pub batches: usize,
    /// Tokens (history items) a step, on average.
    pub tokens_per_batch: f64,
    pub samples_per_s: f64,
    /// The median step's split.
    pub split: StepSplit,
    /// Layers' forward and backward GFLOP/s (as computed: every token pair).
    pub gflops: f64,
    /// This run's GEMM peak on this machine (a 1024-cube product).
    pub gemm_peak_gflops: f64,
    /// The same layers on the batches padded to their longest history.
    pub padded: Option<PaddedRun>,
}

#[derive(Debug, Serialize)]
pub struct PaddedRun {
    /// Tokens a step, padding included.
    pub tokens_per_batch: f64,
    /// The layers' median step (no lookup).
    pub layers_ms: f64,
    /// The jagged run's layers' median step.
    pub jagged_layers_ms: f64,
    /// Padded time over jagged time.
    pub time_ratio: f64,
    /// Padded tokens over real tokens.
    pub token_ratio: f64,
}

impl std::fmt::Display for HstuReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (s, p) = (&self.shape, &self.split);
        write!(
            f,
            "hstu: {} layers, {} heads, dims {}/{}/{}, histories up to {} (Zipf {}), batch {}, {} threads\n\
             {:.1} samples/s, {:.0} tokens a batch; step {:.1} ms: lookup {:.1}, attention {:.1}, rest {:.1}\n\
             {:.1} GFLOP/s, {:.0}% of this run's GEMM peak ({:.1} GFLOP/s)",
            s.layers, s.num_heads, s.embedding_dim, s.attention_dim, s.linear_dim, s.max_seq_len,
            s.length_alpha, s.batch_size, self.threads, self.samples_per_s, self.tokens_per_batch,
            p.step_ms, p.lookup_ms, p.attention_ms, p.rest_ms, self.gflops,
            100.0 * self.gflops / self.gemm_peak_gflops.max(1e-9), self.gemm_peak_gflops
        )?;
        if let Some(p) = &self.padded {
            write!(
                f,
                "\npadded to the longest history: {:.0} tokens a batch ({:.2}x), layers {:.1} ms against {:.1} ms jagged ({:.2}x)",
                p.tokens_per_batch, p.token_ratio, p.layers_ms, p.jagged_layers_ms, p.time_ratio
            )?;
        }
        Ok(())
    }
}

/// One batch: the users' histories as a KJT of item ids, their timestamps.
struct HistoryBatch {
    kjt: KeyedJaggedTensor,
    lengths: Vec<usize>,
    timestamps: Vec<i64>,
}

fn batch(shape: &HstuShape, lengths: &Zipf, rng: &mut Rng) -> anyhow::Result<HistoryBatch> {
    let items = IdDistribution::Zipf { alpha: 1.0 }.sampler(shape.num_items as u64)?;
    // Lengths 1..=max-seq-len.
    let lens: Vec<usize> = (0..shape.batch_size)
        .map(|_| 1 + lengths.draw(rng))
        .collect();
    let total: usize = lens.iter().sum();
    let ids: Vec<i64> = (0..total).map(|_| items.sample(rng) as i64).collect();
    let mut timestamps = Vec::with_capacity(total);
    for &n in &lens {
        let mut t = 1_700_000_000i64;
        for _ in 0..n {
            t += (rng.next_u64() % 86_400) as i64;
            timestamps.push(t);
        }
    }
    let l: Vec<i64> = lens.iter().map(|&n| n as i64).collect();
    let kjt = KeyedJaggedTensor::from_lengths(vec!["history".into()], ids, &l, None)?;
    Ok(HistoryBatch {
        kjt,
        lengths: lens,
        timestamps,
    })
}

/// The GEMM rate of this machine now: the median of a few 1024-cube products.
fn gemm_peak(be: &NativeBackend) -> f64 {
    let n = 1024;
    let a = Tensor::<f32>::from_fn(n, n, |i, j| ((i * 7 + j) % 13) as f32 * 0.01);
    let mut c = Tensor::zeros(n, n);
    let mut rates: Vec<f64> = (0..5)
        .map(|_| {
            let start = Instant::now();
            be.matmul(&a, false, &a, false, 1.0, 0.0, &mut c);
            2.0 * (n * n * n) as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// The layers' forward and backward on `x`; returns the input's gradient
/// and the attention's seconds.
fn layers_step(
    be: &NativeBackend,
    layers: &mut [HstuLayer<f32>],
    x: Jagged<f32>,
    input: HstuInput<'_>,
) -> (Jagged<f32>, f64) {
    let mut h = x;
    for layer in layers.iter_mut() {
        h = layer.forward(be, &h, input).clone();
    }
    // A loss of the outputs' sum: every output's gradient is 1.
    let mut d = Jagged::new(
        Tensor::from_fn(h.total_len(), h.dim(), |_, _| 1.0),
        h.offsets().to_vec(),
    )
    .expect("the output's offsets");
    let mut attention = 0.0;
    for layer in layers.iter_mut().rev() {
        d = layer.backward(be, &d).clone();
        let (f, b) = layer.attention_seconds();
        attention += f + b;
    }
    (d, attention)
}

pub fn run(args: &HstuArgs) -> anyhow::Result<HstuReport> {
    let shape = args.shape()?;
    super::with_threads(args.threads, || run_in_pool(args, shape))?
}

fn run_in_pool(args: &HstuArgs, shape: HstuShape) -> anyhow::Result<HstuReport> {
    let threads = rayon::current_num_threads();
    let be = NativeBackend::new(threads);
    let d = shape.embedding_dim;
    let items = EmbeddingConfig::new("items", shape.num_items, d, &["history"]);
    let mut ec = EmbeddingCollection::new(
        vec![items],
        TableOptimizer::rowwise_adagrad(0.01),
        args.seed,
    )?;
    let config = HstuConfig {
        attention_dim: shape.attention_dim,
        linear_dim: shape.linear_dim,
        ..HstuConfig::new(d, shape.num_heads, shape.max_seq_len)
    };
    let mut layers: Vec<HstuLayer<f32>> = (0..shape.layers)
        .map(|l| HstuLayer::new(config.clone(), args.seed + l as u64))
        .collect();
    let mut optimizer = DenseOptimizer::new(DenseOptimizerConfig::adam(1e-3));
    let gemm_peak_gflops = gemm_peak(&be);
    let lengths = Zipf::new(shape.max_seq_len, shape.length_alpha);
    let mut rng = Rng::new(args.seed ^ 0x4857);
    let progress = Progress::new(args.num_batches as u64, "hstu", args.json);
    let (mut splits, mut layer_ms, mut padded_ms) = (Vec::new(), Vec::new(), Vec::new());
    let (mut tokens, mut padded_tokens, mut flops, mut seconds) = (0.0, 0.0, 0.0, 0.0);
    for step in 0..=args.num_batches {
        let b = batch(&shape, &lengths, &mut rng)?;
        let start = Instant::now();
        let looked = ec.forward(&b.kjt)?;
        let lookup = start.elapsed().as_secs_f64();
        let (rows, offsets) = looked.feature("history").expect("the collection's feature");
        let x = Jagged::new(Tensor::from_vec(rows.len() / d, d, rows.to_vec())?, offsets)?;
        let input = HstuInput {
            timestamps: Some(&b.timestamps),
            ..Default::default()
        };
        let layers_start = Instant::now();
        let (dx, attention) = layers_step(&be, &mut layers, x, input);
        let layers_s = layers_start.elapsed().as_secs_f64();
        let update = Instant::now();
        ec.backward_update(&b.kjt, dx.values().data())?;
        let lookup = lookup + update.elapsed().as_secs_f64();
        let params = (layers.iter_mut().enumerate())
            .flat_map(|(l, layer)| {
                let prefix = format!("{l}.");
                layer
                    .params()
                    .into_iter()
                    .map(move |p| p.with_prefix(&prefix))
            })
            .collect();
        optimizer.step(params);
        let step_s = start.elapsed().as_secs_f64();
        let padded_s = match args.padded {
            true => Some(padded_step(&be, &mut layers, &b, d)),
            false => None,
        };
        if step == 0 {
            continue; // untimed: first-touch allocations
        }
        progress.inc();
        splits.push(StepSplit {
            step_ms: step_s * 1e3,
            lookup_ms: lookup * 1e3,
            attention_ms: attention * 1e3,
            rest_ms: (step_s - lookup - attention) * 1e3,
        });
        layer_ms.push(layers_s * 1e3);
        let max = b.lengths.iter().copied().max().unwrap_or(0);
        tokens += b.lengths.iter().sum::<usize>() as f64;
        padded_tokens += (max * b.lengths.len()) as f64;
        let (f, bw) = layers[0].flops(&b.lengths);
        flops += (f + bw) * layers.len() as f64;
        seconds += layers_s;
        if let Some(p) = padded_s {
            padded_ms.push(p * 1e3);
        }
    }
    progress.finish();
    let n = args.num_batches as f64;
    // The median step's split (a step that was taken, not an average).
    let mut by_time = splits.clone();
    by_time.sort_by(|a, b| a.step_ms.total_cmp(&b.step_ms));
    let split = by_time.get(by_time.len() / 2).cloned().unwrap_or_default();
    let jagged_layers_ms = median(&mut layer_ms);
    let padded = (!padded_ms.is_empty()).then(|| {
        let layers_ms = median(&mut padded_ms);
        PaddedRun {
            tokens_per_batch: padded_tokens / n,
            layers_ms,
            jagged_layers_ms,
            time_ratio: layers_ms / jagged_layers_ms.max(1e-9),
            token_ratio: padded_tokens / tokens.max(1.0),
        }
    });
    Ok(HstuReport {
        run: super::run_info::RunInfo::now(),
        threads,
        batches: args.num_batches,
        tokens_per_batch: tokens / n,
        samples_per_s: n * shape.batch_size as f64
            / (splits.iter().map(|s| s.step_ms).sum::<f64>() / 1e3),
        split,
        gflops: flops / seconds.max(1e-9) / 1e9,
        gemm_peak_gflops,
        padded,
        shape,
    })
}

/// The layers' step on `b` padded: every history as long as the longest
/// (the padding rows zeros, as a padded implementation computes them).
fn padded_step(
    be: &NativeBackend,
    layers: &mut [HstuLayer<f32>],
    b: &HistoryBatch,
    d: usize,
) -> f64 {
    let max = b.lengths.iter().copied().max().unwrap_or(0);
    let lengths = vec![max; b.lengths.len()];
    let x = Jagged::zeros(&lengths, d);
    let timestamps = vec![0i64; max * lengths.len()];
    let input = HstuInput {
        timestamps: Some(&timestamps),
        ..Default::default()
    };
    let start = Instant::now();
    layers_step(be, layers, x, input);
    start.elapsed().as_secs_f64()
}
