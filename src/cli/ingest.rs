//! `ember ingest criteo` and `ember ingest synthetic`: data into Parquet
//! (user histories: [`super::ingest_sequences`]).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Subcommand};
use serde::Serialize;

use ember_dataloader::ingest::{ingest_criteo, IngestOptions, IngestSummary};
use ember_dataloader::lock::DirLock;
use ember_dataloader::multi_hot::MultiHot;
use ember_dataloader::schema::NUM_CAT;
use ember_dataloader::vocabulary::VocabularyOptions;
use ember_dataloader::writer::{Codec, CriteoBatchBuilder, ParquetSink, SinkOptions, StagedSet};
use ember_models::{DataGeneration, DriftingConfig, DriftingData, SyntheticConfig, SyntheticData};

use super::arch::TableArgs;
use super::Progress;

#[derive(Subcommand, Clone, Debug)]
pub enum IngestCommand {
    /// Criteo display-advertising TSV files (plain or gzip) into Parquet.
    Criteo(CriteoArgs),
    /// Learnable synthetic data in the same schema (for benchmarks and tests).
    Synthetic(SyntheticArgs),
    /// Interactions (Parquet, CSV/TSV, MovieLens `::`, `user item`) into
    /// per-user histories: one Parquet row per user, list columns.
    Sequences(super::ingest_sequences::SequencesArgs),
    /// Learnable synthetic user histories (topics, drift, Zipf popularity
    /// and lengths, two action bits) in the same schema.
    SyntheticHistories(super::ingest_sequences::SyntheticHistoriesArgs),
}

#[derive(Args, Clone, Debug)]
pub struct SinkArgs {
    /// Rows per output file [default: one file per input].
    #[arg(long)]
    pub rows_per_file: Option<u64>,
    /// Rows per Parquet row group (the loader's unit of shuffling and sharding).
    #[arg(long, default_value_t = 65536)]
    pub row_group_size: usize,
    /// zstd, snappy or none.
    #[arg(long, default_value = "zstd")]
    pub compression: Codec,
}

impl SinkArgs {
    fn options(&self) -> anyhow::Result<SinkOptions> {
        anyhow::ensure!(
            self.row_group_size > 0 && self.rows_per_file != Some(0),
            "--row-group-size and --rows-per-file must be at least 1"
        );
        Ok(SinkOptions {
            rows_per_file: self.rows_per_file,
            row_group_size: self.row_group_size,
            compression: self.compression,
        })
    }
}

#[derive(Args, Clone, Debug)]
pub struct CriteoArgs {
    /// Input files: `day_0`, `day_0.gz`, `train.txt`, ...
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    #[arg(long)]
    pub output: PathBuf,
    #[command(flatten)]
    pub sink: SinkArgs,
    /// Stop at the first malformed line (default: skip, count and report).
    #[arg(long)]
    pub strict: bool,
    /// Skip inputs whose output is complete from an earlier run (and whose
    /// size and modification time are those it read).
    #[arg(long)]
    pub resume: bool,
    /// The largest fraction of an input's lines that may be rejected; an
    /// input over it (or empty) is an error. 1 accepts anything.
    #[arg(long, default_value_t = ember_dataloader::ingest::DEFAULT_MAX_REJECT_FRACTION)]
    pub max_reject_fraction: f64,
    /// Expand each one-hot id into MLPerf DLRMv2's multi-hot bag, as the
    /// reference's multi_hot.py does: 26 sizes, dash- or comma-separated
    /// (MLPerf's: 3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1).
    #[arg(long)]
    pub multi_hot: Option<String>,
    /// The tables' rows the expansion draws below (the reference's
    /// --num_embeddings_per_feature) [default: MLPerf DLRMv2's 26 table sizes].
    #[arg(long, requires = "multi_hot")]
    pub multi_hot_rows: Option<String>,
    /// Number each column's ids contiguously over all inputs, as TorchRec's
    /// preprocessing does (`--frequency_threshold`): ids seen fewer than T
    /// times become 1, the rest 2, 3, ... in order of first appearance. A
    /// first pass counts them (spilling to disk, so memory stays bounded);
    /// the vocabulary and the table sizes `train` uses go beside the data.
    #[arg(long, value_name = "T")]
    pub vocabulary_threshold: Option<u64>,
    /// Memory the counting may take, in MiB: past it the ids are spilled
    /// by hash into that many more partition files (about as large as the
    /// input) and counted one at a time.
    #[arg(long, requires = "vocabulary_threshold", default_value_t = ember_dataloader::vocabulary::DEFAULT_COUNT_MEMORY >> 20)]
    pub vocabulary_memory_mib: u64,
    /// Count in this many partitions whatever the memory (tests compare
    /// the spilled count with TorchRec's on small inputs).
    #[arg(long, hide = true, requires = "vocabulary_threshold")]
    pub vocabulary_partitions: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

/// `--multi-hot` and `--multi-hot-rows`: MLPerf's expansion tables.
fn multi_hot(args: &CriteoArgs) -> anyhow::Result<Option<std::sync::Arc<MultiHot>>> {
    let Some(sizes) = &args.multi_hot else {
        return Ok(None);
    };
    let list = |flag: &str, text: &str| {
        let sizes = super::parse_sizes(flag, &text.replace(',', "-"))
            .with_context(|| format!("{flag} {text}"))?;
        anyhow::ensure!(
            sizes.len() == NUM_CAT,
            "{flag}: {} values; give {NUM_CAT}",
            sizes.len()
        );
        Ok(sizes)
    };
    let sizes = list("--multi-hot", sizes)?;
    let rows: Vec<u64> = match &args.multi_hot_rows {
        Some(rows) => list("--multi-hot-rows", rows)?
            .into_iter()
            .map(|r| r as u64)
            .collect(),
        None => super::arch::MLPERF_TABLE_ROWS
            .iter()
            .map(|&r| r as u64)
            .collect(),
    };
    // Linux lends memory it may not have: check before drawing the tables.
    let bytes = MultiHot::bytes(&sizes, &rows);
    if let Some(free) = ember_sparse::storage::available_memory().filter(|&m| bytes > m) {
        anyhow::bail!(
            "--multi-hot: the expansion tables of these sizes over these rows (--multi-hot-rows) \
             take {:.1} GB of memory, more than the {:.1} GB available",
            bytes as f64 / 1e9,
            free as f64 / 1e9
        );
    }
    let tables = MultiHot::mlperf(&sizes, &rows).context("--multi-hot")?;
    Ok(Some(std::sync::Arc::new(tables)))
}

pub fn criteo(args: &CriteoArgs) -> anyhow::Result<IngestSummary> {
    let f = args.max_reject_fraction;
    anyhow::ensure!(
        (0.0..=1.0).contains(&f),
        "--max-reject-fraction {f}: must be within 0 and 1"
    );
    let options = IngestOptions {
        sink: args.sink.options()?,
        strict: args.strict,
        resume: args.resume,
        max_reject_fraction: Some(args.max_reject_fraction),
        multi_hot: multi_hot(args)?,
        vocabulary: args.vocabulary_threshold.map(|t| VocabularyOptions {
            count_memory: args.vocabulary_memory_mib.max(1) << 20,
            partitions: args.vocabulary_partitions,
            ..VocabularyOptions::new(t)
        }),
    };
    let total: u64 = (args.inputs.iter())
        .map(|p| {
            std::fs::metadata(p)
                .map(|m| m.len())
                .with_context(|| p.display().to_string())
        })
        .sum::<anyhow::Result<u64>>()?;
    let passes = 1 + args.vocabulary_threshold.is_some() as u64;
    let progress = Progress::bytes(total * passes, "ingest", args.json);
    let summary = ingest_criteo(&args.inputs, &args.output, &options, &mut |b| {
        progress.set(b)
    });
    progress.finish();
    Ok(summary?)
}

/// The text form of an ingest summary.
pub struct IngestReport(pub IngestSummary);

impl Serialize for IngestReport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl std::fmt::Display for IngestReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.0;
        writeln!(
            f,
            "{} rows written to {} files in {:.1} s ({:.0} rows/s); {:.1} MB in, {:.1} MB out",
            s.rows_written,
            s.files.len(),
            s.seconds,
            s.rows_per_s,
            s.bytes_in as f64 / 1e6,
            s.bytes_out as f64 / 1e6
        )?;
        if !s.resumed_inputs.is_empty() {
            writeln!(
                f,
                "{} inputs already complete (resumed)",
                s.resumed_inputs.len()
            )?;
        }
        write!(f, "{} lines rejected", s.lines_rejected)?;
        for (reason, n) in &s.rejected {
            write!(f, ", {n} {reason}")?;
        }
        writeln!(f)?;
        for r in &s.first_rejected {
            writeln!(f, "  {}:{}: {}", r.file.display(), r.line, r.reason)?;
        }
        if s.lines_rejected > s.first_rejected.len() as u64 {
            writeln!(
                f,
                "  ... and {} more",
                s.lines_rejected - s.first_rejected.len() as u64
            )?;
        }
        write!(f, "nulls:")?;
        for n in &s.nulls {
            write!(f, " {}={}", n.column, n.nulls)?;
        }
        if let Some(v) = &s.vocabulary {
            let sizes = &v.num_embeddings_per_feature;
            writeln!(f)?;
            writeln!(
                f,
                "vocabulary (ids seen at least {} times; counted in {} partitions): {} rows in all",
                v.frequency_threshold,
                v.partitions,
                sizes.iter().sum::<u64>()
            )?;
            let list: Vec<String> = sizes.iter().map(u64::to_string).collect();
            write!(f, "num_embeddings_per_feature: {}", list.join(","))?;
        }
        Ok(())
    }
}

#[derive(Args, Clone, Debug)]
pub struct SyntheticArgs {
    #[arg(long)]
    pub rows: u64,
    #[arg(long)]
    pub output: PathBuf,
    /// Ids per bag: one size for every feature or 26 dash-separated; a
    /// feature above 1 is written as a `list<int64>` column of 1..=size ids
    /// [default: 1, all scalar; --preset mlperf-multihot: exactly MLPerf's
    /// sizes].
    #[arg(long)]
    pub multi_hot: Option<String>,
    /// Seeds the hidden model and the rows.
    #[arg(long, default_value_t = 123)]
    pub seed: u64,
    /// A disjoint stream of rows from the same hidden model: write training
    /// data with 0 and evaluation data with 1 (same seed).
    #[arg(long, default_value_t = 0)]
    pub stream: u32,
    #[command(flatten)]
    pub tables: TableArgs,
    /// Ids are the generator's log-uniform ranks unless these say otherwise.
    #[command(flatten)]
    pub ids: super::ids::IdArgs,
    /// Drifting raw ids (for key-value tables and --stream-window): each
    /// feature's 64-bit ids drawn from --id-space times its table's rows,
    /// Zipf-popular (alpha 1: log-uniform ranks), the ranking moved on by
    /// this share of the table's rows every window; one file per window of
    /// --window-rows rows. `bench stream`'s stream, as Parquet.
    #[arg(long)]
    pub drift: Option<f64>,
    /// With --drift: distinct raw ids per feature, as a multiple of its
    /// table's rows [default: 100].
    #[arg(long)]
    pub id_space: Option<u64>,
    /// With --drift: rows per window (and per file).
    #[arg(long)]
    pub window_rows: Option<u64>,
    #[command(flatten)]
    pub sink: SinkArgs,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct SyntheticReport {
    pub rows_written: u64,
    pub files: Vec<PathBuf>,
    pub bytes_out: u64,
    pub seconds: f64,
    pub rows_per_s: f64,
}

impl std::fmt::Display for SyntheticReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rows written to {} files in {:.1} s ({:.0} rows/s), {:.1} MB",
            self.rows_written,
            self.files.len(),
            self.seconds,
            self.rows_per_s,
            self.bytes_out as f64 / 1e6
        )
    }
}

pub fn synthetic(args: &SyntheticArgs) -> anyhow::Result<SyntheticReport> {
    let start = Instant::now();
    let mut sink_options = args.sink.options()?;
    let features = args.tables.feature_rows()?;
    let drifting = match args.drift {
        Some(drift) => {
            let (data, per_file) = drifting(args, drift, features.clone())?;
            sink_options.rows_per_file = Some(per_file);
            Some(data)
        }
        None => {
            anyhow::ensure!(
                args.window_rows.is_none() && args.id_space.is_none(),
                "--window-rows and --id-space are for --drift"
            );
            None
        }
    };
    let preset = args
        .tables
        .preset
        .multi_hot_sizes()
        .filter(|_| args.multi_hot.is_none());
    let sizes = match &args.multi_hot {
        None => preset.clone().unwrap_or(vec![1; NUM_CAT]),
        Some(s) => {
            let sizes = super::parse_sizes("--multi-hot", s)?;
            match sizes.len() {
                1 => vec![sizes[0]; NUM_CAT],
                NUM_CAT => sizes,
                n => anyhow::bail!("--multi-hot: {n} sizes; give one or {NUM_CAT}"),
            }
        }
    };
    anyhow::ensure!(!sizes.contains(&0), "--multi-hot sizes must be at least 1");
    let data = SyntheticData::new(SyntheticConfig {
        kind: DataGeneration::Learnable,
        num_dense: ember_dataloader::schema::NUM_INT,
        features,
        indices_per_lookup: 1,
        indices_per_feature: sizes.clone(),
        // MLPerf's multi-hot bags hold exactly their size.
        fixed_indices: preset.is_some(),
        ids: args.ids.distribution()?,
        seed: args.seed,
    })?;
    let multi: [bool; NUM_CAT] = std::array::from_fn(|i| sizes[i] > 1);
    let mut builder = CriteoBatchBuilder::new(&multi);
    let _lock = DirLock::acquire(&args.output, "ember ingest synthetic")?;
    // A rerun replaces the set whole (no part of a longer earlier run
    // stays), once the new one is: until then the old one stays as it was.
    let staged = StagedSet::begin(&args.output, SYNTHETIC)?;
    let mut sink = ParquetSink::new(
        staged.staging_dir(),
        SYNTHETIC,
        builder.schema().clone(),
        sink_options,
    );
    let progress = Progress::new(args.rows, "synthetic", args.json);
    let chunk = sink_options.row_group_size.min(1 << 16) as u64;
    let mut written = 0;
    let first = (args.stream as u64) << 32;
    for index in first.. {
        if written == args.rows {
            break;
        }
        let n = match &drifting {
            // Whole generator batches, up to a chunk.
            Some((data, batch)) => {
                let n = (chunk / batch).max(1) * batch;
                let n = n.min(args.rows - written);
                for k in 0..n / batch {
                    builder.push_batch(&data.batch(written / batch + k, *batch as usize))?;
                }
                n
            }
            None => {
                let n = chunk.min(args.rows - written);
                builder.push_batch(&data.batch(index, n as usize))?;
                n
            }
        };
        sink.write(&builder.finish())?;
        written += n;
        progress.set(written);
    }
    let (files, bytes_out) = sink.finish()?;
    let files = staged.replace(&files)?;
    progress.finish();
    let seconds = start.elapsed().as_secs_f64();
    Ok(SyntheticReport {
        rows_written: written,
        files,
        bytes_out,
        seconds,
        rows_per_s: written as f64 / seconds.max(1e-9),
    })
}

/// `--drift`'s generator and its batch size (windows are whole batches),
/// and the rows per file (a window's).
fn drifting(
    args: &SyntheticArgs,
    drift: f64,
    features: Vec<(String, usize)>,
) -> anyhow::Result<((DriftingData, u64), u64)> {
    let window = args
        .window_rows
        .ok_or_else(|| anyhow::anyhow!("--drift needs --window-rows (rows per window)"))?;
    anyhow::ensure!(window > 0, "--window-rows must be at least 1");
    anyhow::ensure!(
        args.multi_hot.is_none()
            && args.tables.preset.multi_hot_sizes().is_none()
            && args.ids.id_distribution.is_none()
            && args.ids.zipf_alpha.is_none(),
        "--drift draws one id per bag with its own popularity: drop --multi-hot (and --preset mlperf-multihot) and the id distribution flags"
    );
    anyhow::ensure!(
        args.rows.is_multiple_of(window),
        "--rows {} is not a whole number of --window-rows {window}",
        args.rows
    );
    anyhow::ensure!(
        args.stream == 0,
        "--drift: the windows are the stream (evaluate each on the model trained before it); drop --stream"
    );
    anyhow::ensure!(
        args.sink.rows_per_file.is_none(),
        "--drift writes one file a window (--window-rows): drop --rows-per-file"
    );
    // The generator's batches: a whole number of them to a window.
    let batch = gcd(window, 4096);
    let data = DriftingData::new(DriftingConfig {
        num_dense: ember_dataloader::schema::NUM_INT,
        features,
        space_per_row: args.id_space.unwrap_or(100),
        window_batches: window / batch,
        drift,
        seed: args.seed,
    })?;
    Ok(((data, batch), window))
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The prefix of `ingest synthetic`'s parts and marker.
const SYNTHETIC: &str = "synthetic";
