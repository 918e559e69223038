//! `ember ingest sequences` (interactions into per-user histories) and
//! `ember ingest synthetic-histories` (learnable ones, for benchmarks and
//! tests): both write the user-history Parquet that `ember train --model
//! sasrec|hstu-retrieval|hstu-ranking` reads.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde::Serialize;

use ember_dataloader::sequences::{
    ingest_sequences, write_histories, InteractionFormat, SequenceIngestOptions,
    SequenceIngestSummary,
};
use ember_dataloader::writer::Codec;
use ember_models::sequential::SyntheticHistories;

use super::Progress;

#[derive(Args, Clone, Debug)]
pub struct SequencesArgs {
    /// The interactions: Parquet (`user`, `item`, optional `timestamp`,
    /// `action` columns), CSV or TSV (`user item [timestamp] [action]`,
    /// header optional), MovieLens' `ratings.dat`, or SASRec's `user item`
    /// lines.
    pub input: PathBuf,
    /// The user-history Parquet file to write.
    #[arg(long)]
    pub output: PathBuf,
    /// parquet, csv, tsv, movielens or user-item [default: from the
    /// extension: .parquet, .csv, .tsv, .dat, .txt]
    #[arg(long)]
    pub format: Option<InteractionFormat>,
    /// Leave out the input's action (rating) column.
    #[arg(long)]
    pub no_actions: bool,
    /// Users per Parquet row group.
    #[arg(long, default_value_t = 65536)]
    pub row_group_size: usize,
    /// zstd, snappy or none.
    #[arg(long, default_value = "zstd")]
    pub compression: Codec,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct SequencesReport {
    #[serde(flatten)]
    pub summary: SequenceIngestSummary,
    pub output: PathBuf,
    pub seconds: f64,
}

impl std::fmt::Display for SequencesReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.summary;
        write!(
            f,
            "{} interactions of {} users over {} items (largest id {}; longest history {}) \
             written to {} in {:.1} s; timestamps: {}, actions: {}",
            s.interactions,
            s.users,
            s.items,
            s.max_item,
            s.max_len,
            self.output.display(),
            self.seconds,
            if s.timestamps { "yes" } else { "line order" },
            if s.actions { "yes" } else { "none" },
        )
    }
}

pub fn sequences(args: &SequencesArgs) -> anyhow::Result<SequencesReport> {
    anyhow::ensure!(
        args.row_group_size > 0,
        "--row-group-size must be at least 1"
    );
    let start = Instant::now();
    let options = SequenceIngestOptions {
        format: args.format,
        actions: !args.no_actions,
        row_group_size: args.row_group_size,
        compression: args.compression,
    };
    let format = args
        .format
        .or_else(|| InteractionFormat::of_path(&args.input));
    // Text is followed by bytes read, Parquet by rows (no total known ahead).
    let progress = match format {
        Some(InteractionFormat::Parquet) => Progress::new(0, "ingest", args.json),
        _ => {
            let total = std::fs::metadata(&args.input).map_or(0, |m| m.len());
            Progress::bytes(total, "ingest", args.json)
        }
    };
    let summary = ingest_sequences(&args.input, &args.output, &options, &mut |b| {
        progress.set(b)
    });
    progress.finish();
    Ok(SequencesReport {
        summary: summary?,
        output: args.output.clone(),
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[derive(Args, Clone, Debug)]
pub struct SyntheticHistoriesArgs {
    /// The user-history Parquet file to write.
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, default_value_t = 6040)]
    pub users: usize,
    #[arg(long, default_value_t = 3706)]
    pub items: usize,
    /// Topics the items fall in (users drift between them).
    #[arg(long, default_value_t = 100)]
    pub topics: usize,
    /// The longest history.
    #[arg(long, default_value_t = 200)]
    pub max_len: usize,
    /// Exponent of the lengths' Zipf law (larger: shorter histories).
    #[arg(long, default_value_t = 1.0)]
    pub length_alpha: f64,
    /// The chance, at each item, that a user moves to another topic.
    #[arg(long, default_value_t = 0.1)]
    pub drift: f64,
    /// The chance, at each item, that a new session starts (days later,
    /// back in the user's first topic 4 times in 5); 0: no sessions.
    #[arg(long, default_value_t = 0.0)]
    pub session_start: f64,
    #[arg(long, default_value_t = 123)]
    pub seed: u64,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct SyntheticHistoriesReport {
    pub users: usize,
    pub interactions: usize,
    pub output: PathBuf,
    pub seconds: f64,
}

impl std::fmt::Display for SyntheticHistoriesReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} users, {} interactions written to {} in {:.1} s",
            self.users,
            self.interactions,
            self.output.display(),
            self.seconds
        )
    }
}

/// The defaults are MovieLens-1M's size (6,040 users, 3,706 items).
pub fn synthetic_histories(
    args: &SyntheticHistoriesArgs,
) -> anyhow::Result<SyntheticHistoriesReport> {
    let start = Instant::now();
    let users = SyntheticHistories {
        num_users: args.users,
        num_items: args.items,
        num_topics: args.topics,
        max_len: args.max_len,
        length_alpha: args.length_alpha,
        drift: args.drift,
        session_start: args.session_start,
        seed: args.seed,
        ..SyntheticHistories::default()
    }
    .generate()?;
    write_histories(
        &users,
        None,
        &args.output,
        &SequenceIngestOptions::default(),
    )?;
    Ok(SyntheticHistoriesReport {
        users: users.len(),
        interactions: users.iter().map(|u| u.items.len()).sum(),
        output: args.output.clone(),
        seconds: start.elapsed().as_secs_f64(),
    })
}
