//! The results page's training section, rendered from the committed runs in
//! `docs/results/training/`: each file one comparison (`scripts/` says how
//! it was taken), a table of its runs' flags and final metrics.

use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// The comparisons' directory, under the book's results.
const TRAINING_DIR: &str = "training";

/// One comparison: runs of one command that differ in a few flags.
#[derive(Deserialize)]
struct Comparison {
    /// The section's title.
    title: String,
    /// What is compared and how, one paragraph.
    about: String,
    /// The command every run shares.
    command: String,
    /// The CPU (`lscpu`'s model name) and the date.
    cpu: String,
    date: String,
    runs: Vec<Run>,
}

#[derive(Deserialize)]
struct Run {
    /// What this run adds to the command.
    flags: String,
    /// Its `--json` report.
    report: serde_json::Value,
}

/// The section, or nothing when the directory is absent.
pub fn section(results: &Path) -> anyhow::Result<String> {
    let dir = results.join(TRAINING_DIR);
    if !dir.exists() {
        return Ok(String::new());
    }
    let mut files: Vec<_> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "json"));
    files.sort();
    let mut out = String::new();
    for path in files {
        let text = std::fs::read_to_string(&path)?;
        let c: Comparison = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a training comparison", path.display()))?;
        out.push_str(&render(&c).with_context(|| path.display().to_string())?);
    }
    Ok(out)
}

fn render(c: &Comparison) -> anyhow::Result<String> {
    let mut out = format!(
        "\n## {}\n\n{}\n\n`{}` ({}, {})\n\n| flags | batches | AUC | log loss | NE |\n|---|---|---|---|---|\n",
        c.title, c.about, c.command, c.cpu, c.date
    );
    for run in &c.runs {
        let r = &run.report;
        let number = |key: &str| {
            r[key]
                .as_f64()
                .with_context(|| format!("run `{}` has no {key}", run.flags))
        };
        let flags = if run.flags.is_empty() {
            "(none)".to_string()
        } else {
            format!("`{}`", run.flags)
        };
        out.push_str(&format!(
            "| {flags} | {} | {:.4} | {:.4} | {:.4} |\n",
            number("num_batches")?,
            number("auc")?,
            number("logloss")?,
            number("ne")?,
        ));
    }
    Ok(out)
}
