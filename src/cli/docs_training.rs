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
    /// `metrics` (the default: each run's final AUC, log loss, NE),
    /// `throughput` (runs in alternating pairs of two flag sets: samples/s
    /// and phase ms, medians, and the pairs' ratio) or `vocabulary` (runs
    /// that are ingest vocabularies, then train runs).
    #[serde(default)]
    kind: Kind,
    /// The CPU (`lscpu`'s model name) and the date.
    cpu: String,
    date: String,
    runs: Vec<Run>,
}

#[derive(Default, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
enum Kind {
    #[default]
    Metrics,
    Throughput,
    Vocabulary,
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
    let files = super::docs::json_files(&dir)?;
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
    match c.kind {
        Kind::Throughput => return throughput(c),
        Kind::Vocabulary => return vocabulary(c),
        Kind::Metrics => {}
    }
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

/// The runs' two flag sets (in alternating pairs): each one's median
/// samples/s, phase ms and cache hit rate, and the median of the pairs'
/// ratios (second over first) with their range.
fn throughput(c: &Comparison) -> anyhow::Result<String> {
    let mut sets: Vec<&str> = Vec::new();
    for run in &c.runs {
        if !sets.contains(&run.flags.as_str()) {
            sets.push(&run.flags);
        }
    }
    anyhow::ensure!(
        sets.len() == 2,
        "a throughput comparison is of two flag sets, not {}",
        sets.len()
    );
    fn of<'a>(c: &'a Comparison, set: &'a str) -> impl Iterator<Item = &'a Run> {
        c.runs.iter().filter(move |r| r.flags == set)
    }
    let value = |r: &Run, path: &[&str]| {
        let mut v = &r.report;
        for key in path {
            v = &v[*key];
        }
        v.as_f64()
            .with_context(|| format!("run `{}` has no {}", r.flags, path.join(".")))
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let columns: [(&str, &[&str]); 6] = [
        ("samples/s", &["samples_per_s"]),
        ("sparse forward ms", &["phase_ms", "sparse_forward"]),
        ("dense forward ms", &["phase_ms", "dense_forward"]),
        ("dense backward ms", &["phase_ms", "dense_backward"]),
        (
            "sparse backward + update ms",
            &["phase_ms", "sparse_backward_update"],
        ),
        ("cache hit rate", &["disk_tier", "hit_rate"]),
    ];
    let mut out = format!(
        "\n## {}\n\n{}\n\n`{}` ({}, {})\n\n| flags | runs |",
        c.title, c.about, c.command, c.cpu, c.date
    );
    for (name, _) in &columns {
        out.push_str(&format!(" {name} |"));
    }
    out.push_str(&format!("\n|---|---|{}\n", "---|".repeat(columns.len())));
    for set in &sets {
        out.push_str(&format!("| `{set}` | {} |", of(c, set).count()));
        for (name, path) in &columns {
            let values = of(c, set)
                .map(|r| value(r, path))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let m = median(values);
            out.push_str(&match *name {
                "samples/s" => format!(" {m:.0} |"),
                "cache hit rate" => format!(" {:.1} % |", m * 100.0),
                _ => format!(" {m:.1} |"),
            });
        }
        out.push('\n');
    }
    let (a, b): (Vec<_>, Vec<_>) = (of(c, sets[0]).collect(), of(c, sets[1]).collect());
    anyhow::ensure!(a.len() == b.len(), "the runs come in pairs");
    let ratios = (a.iter().zip(&b))
        .map(|(a, b)| Ok(value(b, &["samples_per_s"])? / value(a, &["samples_per_s"])?))
        .collect::<anyhow::Result<Vec<f64>>>()?;
    let (lo, hi) = ratios
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(l, h), &r| (l.min(r), h.max(r)));
    out.push_str(&format!(
        "\n`{}` over `{}`: {:.2}x samples/s (median of {} pairs, range {lo:.2} to {hi:.2}).\n",
        sets[1],
        sets[0],
        median(ratios.clone()),
        ratios.len()
    ));
    Ok(out)
}

/// The vocabularies' table sizes (runs whose report is a vocabulary, with
/// a `data` label), then the train runs' evaluation.
fn vocabulary(c: &Comparison) -> anyhow::Result<String> {
    let mut out = format!(
        "\n## {}\n\n{}\n\n| data | flags | rows | distinct ids | table rows | partitions | peak memory |\n|---|---|---|---|---|---|---|\n",
        c.title, c.about
    );
    let (sizes, trained): (Vec<&Run>, Vec<&Run>) =
        c.runs.iter().partition(|r| r.report.get("data").is_some());
    for run in sizes {
        let r = &run.report;
        let sum = |key: &str| -> anyhow::Result<u64> {
            (r[key].as_array())
                .with_context(|| format!("run `{}` has no {key}", run.flags))?
                .iter()
                .map(|v| v.as_u64().context("a count"))
                .sum()
        };
        let memory = r["peak_rss_mib"]
            .as_f64()
            .map_or("".into(), |m| format!("{m:.0} MiB"));
        out.push_str(&format!(
            "| {} | `{}` | {} | {} | {} | {} | {memory} |\n",
            r["data"].as_str().unwrap_or_default(),
            run.flags,
            r["rows"],
            sum("distinct_ids")?,
            sum("num_embeddings_per_feature")?,
            r["partitions"],
        ));
    }
    out.push_str(&format!(
        "\n`{}` ({}, {})\n\n| ids | AUC | log loss | NE |\n|---|---|---|---|\n",
        c.command, c.cpu, c.date
    ));
    for run in trained {
        let eval = &run.report["eval"];
        let number = |key: &str| {
            eval[key]
                .as_f64()
                .with_context(|| format!("run `{}` has no eval {key}", run.flags))
        };
        out.push_str(&format!(
            "| {} | {:.4} | {:.4} | {:.4} |\n",
            run.flags,
            number("auc")?,
            number("logloss")?,
            number("ne")?
        ));
    }
    Ok(out)
}
