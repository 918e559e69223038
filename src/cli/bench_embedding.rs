//! `ember bench embedding`: the embedding kernels alone, on the shapes of
//! FBGEMM's TBE benchmark (T tables x E rows x D dims, batch B, L ids per bag,
//! uniform ids, or Zipf's as its `--alpha`).

use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_sparse::rng::{mix, Rng};
use ember_sparse::{
    bf16, f16, DataType, DiskTierConfig, EmbeddingBagCollection, EmbeddingBagConfig,
    IdDistribution, KeyedJaggedTensor, PooledValue, TableOptimizer, TierStats,
};

use super::ids::IdArgs;
use super::tier::TierArgs;
use super::{peak_rss_bytes, Progress};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BenchOptimizer {
    None,
    Sgd,
    Adagrad,
    RowwiseAdagrad,
    Adam,
}

impl BenchOptimizer {
    pub fn table_optimizer(self, lr: f32) -> TableOptimizer {
        match self {
            Self::None => TableOptimizer::None,
            Self::Sgd => TableOptimizer::sgd(lr),
            Self::Adagrad => TableOptimizer::adagrad(lr),
            Self::RowwiseAdagrad => TableOptimizer::rowwise_adagrad(lr),
            Self::Adam => TableOptimizer::adam(lr),
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct EmbeddingArgs {
    /// Number of tables (one feature each).
    #[arg(long, default_value_t = 26)]
    pub tables: usize,
    /// Rows per table.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: usize,
    /// Embedding dim.
    #[arg(long, default_value_t = 128)]
    pub dim: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 2048)]
    pub batch: usize,
    /// Ids per bag (fixed).
    #[arg(long, default_value_t = 1)]
    pub pooling_factor: usize,
    /// `none` times the forward alone; any other times forward + backward + fused update.
    #[arg(long, value_enum, default_value_t = BenchOptimizer::None)]
    pub optimizer: BenchOptimizer,
    /// Data type of the rows: fp32, fp16, bf16, or (forward only) the
    /// quantized int8, int4, fp8, mxfp4.
    #[arg(long, default_value = "fp32", value_parser = super::parse_data_type)]
    pub table_dtype: DataType,
    /// Data type of the pooled output: fp32, or fp16 or bf16 (FBGEMM's
    /// inference TBE's `output_dtype`, FP16 there by default).
    #[arg(long, default_value = "fp32", value_parser = super::parse_data_type)]
    pub output_dtype: DataType,
    #[arg(long, default_value_t = 0.01)]
    pub learning_rate: f32,
    /// Timed iterations.
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Distinct batches, generated before timing and cycled (the peer's 4).
    /// A cache sees only their rows: time the disk tier with at least
    /// --warmup + --iters.
    #[arg(long, default_value_t = 4)]
    pub input_batches: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also measure this machine's limit: a plain prefetched random gather over the same tables.
    #[arg(long)]
    pub roofline: bool,
    /// Ids are uniform unless these say otherwise.
    #[command(flatten)]
    pub ids: IdArgs,
    /// Tables on the disk tier.
    #[command(flatten)]
    pub tier: TierArgs,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct EmbeddingReport {
    pub run: super::run_info::RunInfo,
    pub tables: usize,
    pub rows: usize,
    pub dim: usize,
    pub batch: usize,
    pub pooling_factor: usize,
    pub optimizer: BenchOptimizer,
    pub table_dtype: DataType,
    pub output_dtype: DataType,
    pub id_distribution: IdDistribution,
    pub threads: usize,
    pub iters: usize,
    pub iter_ms_median: f64,
    pub ids_per_s: f64,
    pub samples_per_s: f64,
    /// Rows read by the forward gathers (in their data type), in GB/s (10^9 bytes).
    pub gb_per_s: f64,
    pub table_bytes: u64,
    pub peak_rss_bytes: u64,
    pub peak_rss_over_table_bytes: f64,
    /// With --disk-dir: the cache's rows per table, its hit rate over the
    /// timed iterations, and the file bytes read and written per iteration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_tier: Option<DiskTierReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_ids_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction_of_limit: Option<f64>,
    /// What the limit gathers: fp32 rows summed (fp32 in and out), else the
    /// bytes a forward moves (its rows read, its pooled rows written).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// The order large tables' one-hot features pooled in, as the
    /// collection's timing chose: "id" or "sample" (absent: not chosen).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooling_order: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct DiskTierReport {
    pub cache_rows_per_table: usize,
    pub cache_policy: String,
    pub cache_bytes: u64,
    pub hit_rate: f64,
    /// The best hit rate any cache could have had: misses only of rows
    /// looked up for the first time.
    pub hit_rate_bound: f64,
    pub bytes_read_per_iter: f64,
    pub bytes_written_per_iter: f64,
}

/// The tables' configs, and their disk tiers (all `None` without --disk-dir).
fn tables(
    args: &EmbeddingArgs,
) -> anyhow::Result<(Vec<EmbeddingBagConfig>, Vec<Option<DiskTierConfig>>)> {
    let configs: Vec<EmbeddingBagConfig> = (0..args.tables)
        .map(|t| {
            EmbeddingBagConfig::new(&format!("t{t}"), args.rows, args.dim, &[&format!("f{t}")])
                .with_data_type(args.table_dtype)
        })
        .collect();
    let optimizer = args.optimizer.table_optimizer(args.learning_rate);
    let batch_ids = args.batch * args.pooling_factor;
    let tier = args.tier.options()?;
    let tiers =
        ember_models::disk_tier::tiers_for(tier.as_ref(), None, &configs, &optimizer, batch_ids)
            .map_err(|e| args.tier.explain(e.into()))?;
    Ok((configs, tiers))
}

pub fn run(args: &EmbeddingArgs) -> anyhow::Result<EmbeddingReport> {
    anyhow::ensure!(
        args.tables > 0 && args.rows > 0 && args.dim > 0 && args.batch > 0,
        "--tables, --rows, --dim and --batch must be at least 1"
    );
    anyhow::ensure!(
        args.pooling_factor > 0,
        "--pooling-factor must be at least 1"
    );
    anyhow::ensure!(args.iters > 0, "--iters must be at least 1");
    anyhow::ensure!(args.input_batches > 0, "--input-batches must be at least 1");
    anyhow::ensure!(
        !args.roofline || args.optimizer == BenchOptimizer::None,
        "--roofline compares the forward lookup with a plain gather: use it with --optimizer none"
    );
    anyhow::ensure!(
        args.rows <= u32::MAX as usize,
        "--rows above 2^32 are not supported by the benchmark's id generator"
    );
    anyhow::ensure!(
        args.table_dtype.is_trainable() || args.optimizer == BenchOptimizer::None,
        "--table-dtype {} is for inference: time its forward with --optimizer none",
        args.table_dtype
    );
    anyhow::ensure!(
        matches!(
            args.output_dtype,
            DataType::Fp32 | DataType::Fp16 | DataType::Bf16
        ),
        "--output-dtype {} is not an output type: use fp32, fp16 or bf16",
        args.output_dtype
    );
    anyhow::ensure!(
        !args.roofline || args.tier.disk_dir.is_none(),
        "--roofline gathers from tables in RAM: use it without --disk-dir"
    );
    check_memory(args)?;
    let ids = args.ids.distribution()?.unwrap_or(IdDistribution::Uniform);
    super::with_threads(args.threads, || run_in_pool(args, ids))?
}

/// Refuses shapes whose tables, ids and outputs cannot fit in memory, with
/// the estimate, before any of them is allocated.
fn check_memory(args: &EmbeddingArgs) -> anyhow::Result<()> {
    let m = |a: u64, b: u64| a.saturating_mul(b);
    let (t, b) = (args.tables as u64, args.batch as u64);
    let optimizer = args.optimizer.table_optimizer(args.learning_rate);
    let row = args
        .table_dtype
        .row_bytes(args.dim)
        .map_or(u64::MAX, |r| r as u64);
    let state = m(optimizer.state_floats_per_row(args.dim) as u64, 4);
    let (_, tiers) = tables(args)?;
    let resident = tiers[0]
        .as_ref()
        .map_or(args.rows, |c| c.cache_rows.min(args.rows)) as u64;
    let tables = m(m(t, resident), row.saturating_add(state));
    // Ids and lengths of every pregenerated batch; output and gradient.
    let bags = m(args.input_batches as u64, m(t, b));
    let estimate = ember_models::MemoryEstimate {
        tables,
        activations: m(m(m(t, b), args.dim as u64), 8),
        batches: m(m(bags, args.pooling_factor as u64), 8).saturating_add(m(bags, 8)),
        ..Default::default()
    };
    estimate
        .check(ember_models::available_memory())
        .map_err(|e| {
            anyhow::anyhow!("{e} (--tables, --rows, --dim, --batch and --pooling-factor set them)")
        })
}

fn run_in_pool(args: &EmbeddingArgs, ids: IdDistribution) -> anyhow::Result<EmbeddingReport> {
    let (configs, tiers) = tables(args)?;
    let cache = tiers[0].as_ref().map(|t| t.cache_rows);
    let taken = match args.tier.options()? {
        Some(tier) => Some(
            tier.take_dir("ember bench embedding")
                .map_err(|e| args.tier.explain(e.into()))?,
        ),
        None => None,
    };
    if let Some(line) = taken.as_ref().and_then(|t| t.reclaimed_line()) {
        eprintln!("{line}");
    }
    let ebc = EmbeddingBagCollection::with_disk_tiers(
        configs,
        args.optimizer.table_optimizer(args.learning_rate),
        args.seed,
        tiers,
    )
    .context("creating the tables")?;
    let mut ebc = ebc;
    let keys: Vec<String> = (0..args.tables).map(|t| format!("f{t}")).collect();
    let ids_per_batch = args.tables * args.batch * args.pooling_factor;
    let sampler = ids.sampler(args.rows as u64)?;
    let inputs: Vec<KeyedJaggedTensor> = (0..args.input_batches)
        .map(|i| {
            let mut rng = Rng::new(mix(&[args.seed, 0x1D5, i as u64]));
            let values = (0..ids_per_batch)
                .map(|_| sampler.sample(&mut rng) as i64)
                .collect();
            let lengths = vec![args.pooling_factor as i64; args.tables * args.batch];
            KeyedJaggedTensor::from_lengths(keys.clone(), values, &lengths, None)
        })
        .collect::<Result<_, _>>()?;
    let mut rng = Rng::new(args.seed ^ 0x96AD);
    let grad: Vec<f32> = (0..args.batch * args.tables * args.dim)
        .map(|_| rng.next_f32() - 0.5)
        .collect();
    let (mut times, before) = match args.output_dtype {
        DataType::Fp16 => timed::<f16>(&mut ebc, &inputs, &grad, args)?,
        DataType::Bf16 => timed::<bf16>(&mut ebc, &inputs, &grad, args)?,
        _ => timed::<f32>(&mut ebc, &inputs, &grad, args)?,
    };
    let total: f64 = times.iter().sum();
    let ids_per_s = (ids_per_batch * times.len()) as f64 / total;
    let disk_tier = cache.map(|cache_rows| {
        let timed = super::tier::totals(ebc.tables().iter()).since(&before);
        let iters = times.len() as f64;
        DiskTierReport {
            cache_rows_per_table: cache_rows,
            cache_policy: args.tier.cache_policy.to_string(),
            cache_bytes: ebc.bytes() as u64,
            hit_rate: timed.hit_rate(),
            hit_rate_bound: timed.hit_rate_bound(),
            bytes_read_per_iter: timed.bytes_read as f64 / iters,
            bytes_written_per_iter: timed.bytes_written as f64 / iters,
        }
    });

    let (limit_ids_per_s, fraction_of_limit) = if args.roofline {
        let limit = gather_limit(&ebc, &inputs, args);
        (Some(limit), Some(ids_per_s / limit))
    } else {
        (None, None)
    };
    let limit = args.roofline.then(|| match sums_fp32(args) {
        true => "fp32 rows summed".to_string(),
        false => format!(
            "bytes: {} B of row read and {:.1} B of pooled row written an id",
            ebc.tables()[0].bytes_per_row(),
            out_row_bytes(args) as f64 / args.pooling_factor as f64
        ),
    });
    let table_bytes = ebc.bytes() as u64;
    let peak = peak_rss_bytes();
    Ok(EmbeddingReport {
        run: super::run_info::RunInfo::now(),
        tables: args.tables,
        rows: args.rows,
        dim: args.dim,
        batch: args.batch,
        pooling_factor: args.pooling_factor,
        optimizer: args.optimizer,
        table_dtype: args.table_dtype,
        output_dtype: args.output_dtype,
        id_distribution: ids,
        threads: rayon::current_num_threads(),
        iters: args.iters,
        iter_ms_median: median(&mut times) * 1e3,
        ids_per_s,
        samples_per_s: (args.batch * times.len()) as f64 / total,
        gb_per_s: ids_per_s * ebc.tables()[0].bytes_per_row() as f64 / 1e9,
        table_bytes,
        peak_rss_bytes: peak,
        peak_rss_over_table_bytes: peak as f64 / table_bytes as f64,
        disk_tier,
        limit_ids_per_s,
        fraction_of_limit,
        limit,
        pooling_order: (ebc.pools_in_id_order()).map(|id| if id { "id" } else { "sample" }),
    })
}

/// Forwards the collection's choice of pooling order takes at most (see
/// `EmbeddingBagCollection::pools_in_id_order`), with room to spare; none
/// when no feature could pool in id order.
const MOST_ORDER_TRIALS: usize = 32;

/// Runs the warmup and timed iterations with output values of type `T`:
/// each timed iteration's seconds, and the tier counters when timing began.
fn timed<T: PooledValue>(
    ebc: &mut EmbeddingBagCollection,
    inputs: &[KeyedJaggedTensor],
    grad: &[f32],
    args: &EmbeddingArgs,
) -> anyhow::Result<(Vec<f64>, TierStats)> {
    let mut out = ebc.new_output_of::<T>(args.batch);
    let progress = Progress::new((args.warmup + args.iters) as u64, "embedding", args.json);
    let mut times = Vec::with_capacity(args.iters);
    let mut before = TierStats::default();
    // The collection times its pooling orders on its first forwards: those
    // come before the warmup, so that no timed iteration mixes the two
    // (not on the disk tier, whose cache counts from the first lookup).
    let trials = if args.tier.disk_dir.is_some() {
        0
    } else {
        MOST_ORDER_TRIALS
    };
    for kjt in inputs.iter().cycle().take(trials) {
        if ebc.pools_in_id_order().is_some() {
            break;
        }
        ebc.prefetch(kjt)?;
        ebc.forward_into(kjt, &mut out)?;
    }
    for i in 0..args.warmup + args.iters {
        let kjt = &inputs[i % inputs.len()];
        if i == args.warmup {
            before = super::tier::totals(ebc.tables().iter());
        }
        let start = Instant::now();
        ebc.prefetch(kjt)?;
        ebc.forward_into(kjt, &mut out)?;
        if args.optimizer != BenchOptimizer::None {
            ebc.backward_update(kjt, grad)?;
        }
        let elapsed = start.elapsed().as_secs_f64();
        if i >= args.warmup {
            times.push(elapsed);
        }
        progress.inc();
    }
    progress.finish();
    Ok((times, before))
}

/// Whether the limit is the fp32 summed gather (fp32 rows and output), as
/// it always was; other formats take the byte limit.
fn sums_fp32(args: &EmbeddingArgs) -> bool {
    args.table_dtype == DataType::Fp32 && args.output_dtype == DataType::Fp32
}

/// Bytes of one pooled output row.
fn out_row_bytes(args: &EmbeddingArgs) -> usize {
    (args.output_dtype.row_bytes(args.dim)).unwrap_or(args.dim * 4)
}

/// The plain gather's ids/s over the same tables and ids: fp32 rows summed,
/// or for other formats the same bytes read and pooled rows written.
fn gather_limit(
    ebc: &EmbeddingBagCollection,
    inputs: &[KeyedJaggedTensor],
    args: &EmbeddingArgs,
) -> f64 {
    let ids: Vec<Vec<u32>> = inputs
        .iter()
        .map(|k| k.values().iter().map(|&v| v as u32).collect())
        .collect();
    let per_table = args.batch * args.pooling_factor;
    let out_row = out_row_bytes(args);
    let mut out = match sums_fp32(args) {
        true => Vec::new(),
        // Written once before timing, as the forward's output is.
        false => vec![1u8; args.tables * args.batch * out_row],
    };
    let mut checksum = 0.0f32;
    let mut times = Vec::new();
    for i in 0..args.warmup + args.iters {
        let batch_ids: Vec<&[u32]> = ids[i % ids.len()].chunks(per_table).collect();
        let start = Instant::now();
        if sums_fp32(args) {
            let tables: Vec<&[f32]> = ebc.tables().iter().map(|t| t.weights()).collect();
            checksum += ember_sparse::roofline::gather_sum(
                &tables,
                &batch_ids,
                args.dim,
                args.pooling_factor,
            );
        } else {
            let tables: Vec<&[u8]> = ebc.tables().iter().map(|t| t.row_bytes()).collect();
            let row_bytes = ebc.tables()[0].bytes_per_row();
            let mut outs: Vec<&mut [u8]> = out.chunks_mut(args.batch * out_row).collect();
            let sum = ember_sparse::roofline::gather_bytes(
                &tables,
                row_bytes,
                &batch_ids,
                args.pooling_factor,
                &mut outs,
                out_row,
            );
            checksum += sum as f32;
        }
        if i >= args.warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    std::hint::black_box(checksum);
    (args.tables * per_table * times.len()) as f64 / times.iter().sum::<f64>()
}

pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

impl std::fmt::Display for EmbeddingReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "embedding bench: {} tables x {} rows x {} dim ({}, {} output), batch {}, {} id(s) per bag ({}), optimizer {:?}, {} threads",
            self.tables, self.rows, self.dim, self.table_dtype, self.output_dtype, self.batch, self.pooling_factor, self.id_distribution, self.optimizer, self.threads)?;
        writeln!(f, "  {:.2} M ids/s, {:.0} samples/s, {:.2} GB/s of rows read, {:.3} ms/iter (median of {})",
            self.ids_per_s / 1e6, self.samples_per_s, self.gb_per_s, self.iter_ms_median, self.iters)?;
        if let Some(d) = &self.disk_tier {
            writeln!(
                f,
                "  disk tier: cache of {} rows per table ({:.2} GiB), hit rate {:.1}% (at most {:.1}%: first lookups), {:.1} MB read and {:.1} MB written per iteration",
                d.cache_rows_per_table,
                d.cache_bytes as f64 / (1u64 << 30) as f64,
                d.hit_rate * 100.0,
                d.hit_rate_bound * 100.0,
                d.bytes_read_per_iter / 1e6,
                d.bytes_written_per_iter / 1e6
            )?;
        }
        if let (Some(limit), Some(frac)) = (self.limit_ids_per_s, self.fraction_of_limit) {
            writeln!(
                f,
                "  machine limit (plain prefetched gather): {:.2} M ids/s; this is {:.0}% of it",
                limit / 1e6,
                frac * 100.0
            )?;
        }
        write!(
            f,
            "  tables + optimizer state {:.2} GiB, peak RSS {:.2} GiB ({:.3}x)",
            self.table_bytes as f64 / (1u64 << 30) as f64,
            self.peak_rss_bytes as f64 / (1u64 << 30) as f64,
            self.peak_rss_over_table_bytes
        )
    }
}
