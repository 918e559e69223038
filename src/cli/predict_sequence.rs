//! `ember predict` on a sequence model's checkpoint (SASRec, HSTU): a
//! histories file (`ember ingest sequences`) in, one row a history out:
//! its `top_k` best next `items` and their `scores` (retrieval), or a
//! `logit` and `probability` for each of its last `num_candidates` items
//! and each task (ranking), as `ember serve` answers the same histories.

use std::path::Path;

use anyhow::Context;
use ember_dataloader::atomic::same_file;
use ember_dataloader::list_writer::{ListPredictionWriter, ListValues};
use ember_dataloader::lock::DirLock;
use ember_dataloader::writer::probability;
use ember_models::sequential::{
    read_histories, SequenceModelConfig, SequenceScorer, SequenceScores, UserHistory,
};

use super::eval::{PredictArgs, PredictReport};
use super::Progress;

/// The flags of a DLRM's predict that mean nothing here.
fn dlrm_only_flags(args: &PredictArgs) -> Vec<&'static str> {
    let tier = &args.eval.tier;
    let mut given: Vec<&'static str> = [
        (
            "--disk-dir (sequence models predict from memory)",
            tier.disk_dir.is_some(),
        ),
        ("--cache-memory", tier.cache_memory.is_some()),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .collect();
    given.extend(args.eval.loader.given_column_flags());
    given
}

/// Each history of `path` checked against the model: long enough, its
/// items in the catalogue, with actions where ranking reads them.
fn check(config: &SequenceModelConfig, users: &[UserHistory], path: &Path) -> anyhow::Result<()> {
    let (min, n) = (config.min_history(), config.num_items());
    for (row, u) in users.iter().enumerate() {
        let at = || format!("{}: row {row}", path.display());
        anyhow::ensure!(
            u.items.len() >= min,
            "{}: {} items; {} reads at least {min}",
            at(),
            u.items.len(),
            config.name()
        );
        if let Some(id) = u.items.iter().find(|&&id| id < 0 || id as u64 >= n as u64) {
            anyhow::bail!("{}: item {id} is outside the model's {n} items", at());
        }
        anyhow::ensure!(
            config.candidates().is_none() || u.actions.len() == u.items.len(),
            "{}: no actions, which ranking reads (ingest an action column)",
            at()
        );
    }
    Ok(())
}

pub fn predict(args: &PredictArgs, config: &SequenceModelConfig) -> anyhow::Result<PredictReport> {
    let ignored = dlrm_only_flags(args);
    anyhow::ensure!(
        ignored.is_empty(),
        "{} is a {} checkpoint: {} apply to DLRM checkpoints only",
        args.eval.checkpoint.display(),
        config.name(),
        ignored.join(", ")
    );
    anyhow::ensure!(
        args.eval.mini_batch_size > 0,
        "--mini-batch-size must be at least 1"
    );
    anyhow::ensure!(args.top_k > 0, "--top-k must be at least 1");
    anyhow::ensure!(
        args.eval.data.len() == 1,
        "--data: a sequence model reads one histories file ({} given)",
        args.eval.data.len()
    );
    let data = &args.eval.data[0];
    let checkpoint = &args.eval.checkpoint;
    for (input, what) in [(data, "the --data file"), (checkpoint, "the checkpoint")] {
        anyhow::ensure!(
            !same_file(input, &args.output),
            "--output {}: it is {what}; predictions go to a new file",
            args.output.display()
        );
    }
    let users = read_histories(data)?;
    check(config, &users, data)?;
    super::with_threads(args.eval.threads, || {
        let mut scorer = SequenceScorer::open(checkpoint)?;
        let _lock = DirLock::for_file(&args.output, "ember predict").context("--output")?;
        let columns: Vec<(&str, bool, usize)> = match config.candidates() {
            None => {
                let k = args.top_k.min(config.num_items());
                vec![("items", true, k), ("scores", false, k)]
            }
            Some((c, t)) => vec![("logit", false, c * t), ("probability", false, c * t)],
        };
        let batches = users.len().div_ceil(args.eval.mini_batch_size);
        let progress = Progress::new(batches as u64, "predict", args.eval.json);
        // Dropped unfinished, the writer leaves no file.
        let mut out = ListPredictionWriter::create(&args.output, &columns)?;
        let started = std::time::Instant::now();
        for (b, chunk) in users.chunks(args.eval.mini_batch_size).enumerate() {
            let scores = scorer.score(chunk, args.top_k).with_context(|| {
                let first = b * args.eval.mini_batch_size;
                format!("{}: rows {first}..{}", data.display(), first + chunk.len())
            })?;
            let finite = |v: &[f32], what: &str| match v.iter().find(|z| !z.is_finite()) {
                None => Ok(()),
                Some(z) => Err(anyhow::anyhow!(
                    "predict with {}: a {what} is {z}; nothing written",
                    checkpoint.display()
                )),
            };
            match scores {
                SequenceScores::TopItems { items, scores } => {
                    finite(&scores, "score")?;
                    let values = [ListValues::Ints(&items), ListValues::Floats(&scores)];
                    out.write(chunk.len(), &values)?;
                }
                SequenceScores::Candidates { logits } => {
                    finite(&logits, "logit")?;
                    let p: Vec<f32> = logits.iter().map(|&z| probability(z)).collect();
                    let values = [ListValues::Floats(&logits), ListValues::Floats(&p)];
                    out.write(chunk.len(), &values)?;
                }
            }
            progress.inc();
        }
        progress.finish();
        Ok(PredictReport::since(started, out.finish()?, &args.output))
    })?
}
