//! The results page's serving section, rendered from the committed load
//! tests in `docs/results/serving/` (`scripts/serve_loadtest.py`'s JSON, as
//! `scripts/serve-latency` takes them): one table of latency against
//! offered load for each served model, the highest load that held the p99
//! bound as a fraction of `ember predict`'s offline throughput, and the
//! empty model's round trip.

use std::path::Path;

use super::load_test::{read, LoadTest};

/// The runs' directory, under the book's results.
pub const SERVING_DIR: &str = "serving";
/// The empty model's run in it; every other file is a model's.
const EMPTY: &str = "empty.json";
/// The latency plot `scripts/serve-latency` draws, beside the page.
const PICTURE: &str = "serving-latency.png";

/// The section, or nothing when the directory is absent.
pub fn section(results: &Path) -> anyhow::Result<String> {
    let dir = results.join(SERVING_DIR);
    if !dir.exists() {
        return Ok(String::new());
    }
    let files = super::docs::json_files(&dir)?;
    let mut out = String::from(
        "\n## Serving: latency against offered load\n\n\
         `scripts/serve-latency` ([the serving guide](../guides/serving.md#latency-under-load)): \
         MLPerf's load generator (server scenario, Poisson arrivals) sends queries over gRPC on \
         loopback to `ember serve`, on the same machine. Each rate is a fraction of `ember \
         predict`'s offline samples/s on the same model (the median of three runs); each figure \
         is the median of the rate's runs, the p99 of every run shown. The bound is MLPerf \
         DLRMv2's: p99 at most 60 ms.\n",
    );
    for path in files.iter().filter(|p| !p.ends_with(EMPTY)) {
        out.push_str(&model(&read(path)?));
    }
    if let Some(path) = files.iter().find(|p| p.ends_with(EMPTY)) {
        out.push_str(&empty(&read(path)?));
    }
    if results.join("../src/benchmarks").join(PICTURE).exists() {
        out.push_str(&format!(
            "\n![Latency percentiles against offered load]({PICTURE})\n"
        ));
    }
    Ok(out)
}

fn machine(t: &LoadTest) -> String {
    format!(
        "{}, {} CPUs, {}; {} a query; each figure the median of {} runs (fewer at a rate that shed)",
        t.cpu,
        t.cpus,
        t.date,
        match t.rows_per_query {
            1 => "1 row".to_string(),
            n => format!("{n} rows"),
        },
        t.repeats
    )
}

/// A model's table and the highest load it held.
fn model(t: &LoadTest) -> String {
    let bound = t.target_latency_ms;
    let mut out = format!("\n### {}\n\n{}", t.label, machine(t));
    if let Some(offline) = t.offline_samples_per_s {
        out.push_str(&format!("; offline {offline:.0} samples/s"));
    }
    out.push_str(".\n\n");
    let best = (t.rates.iter().filter(|r| r.held(bound)))
        .max_by(|a, b| a.target_qps.total_cmp(&b.target_qps));
    out.push_str(&match best {
        Some(r) => format!(
            "Highest load held with p99 at most {bound:.0} ms: **{:.0} samples/s**{}.\n\n",
            r.target_samples_per_s,
            (r.fraction_of_offline)
                .map(|f| format!(", **{f:.2} of offline**"))
                .unwrap_or_default()
        ),
        None => format!("No load held p99 at most {bound:.0} ms.\n\n"),
    });
    out.push_str(
        "| offered samples/s | of offline | completed samples/s | p50 ms | p99 ms | p99 of each run | p99.9 ms | held |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in &t.rates {
        let runs: Vec<String> = r.p99_ms_runs.iter().map(|v| format!("{v:.1}")).collect();
        let fraction = r.fraction_of_offline.map(|f| format!("{f:.2}"));
        let held = match (r.held(bound), r.failed) {
            (true, _) => "yes".to_string(),
            (false, 0) => "no".to_string(),
            (false, n) => format!("no: {n} shed"),
        };
        out.push_str(&format!(
            "| {:.0} | {} | {:.0} | {:.1} | {:.1} | {} | {:.1} | {held} |\n",
            r.target_samples_per_s,
            fraction.unwrap_or_default(),
            r.completed_samples_per_s,
            r.p50_ms,
            r.p99_ms,
            runs.join(", "),
            r.p999_ms,
        ));
    }
    out
}

/// The empty model's round trips.
fn empty(t: &LoadTest) -> String {
    let mut out = format!(
        "\n### {}: the server's own cost\n\n{}. A model that computes nothing: what \
         protocol, queue and threads cost a request.\n\n\
         | offered queries/s | completed queries/s | p50 ms | p99 ms | p99.9 ms |\n\
         |---|---|---|---|---|\n",
        t.label,
        machine(t)
    );
    for r in &t.rates {
        out.push_str(&format!(
            "| {:.0} | {:.0} | {:.2} | {:.2} | {:.2} |\n",
            r.target_qps,
            r.completed_samples_per_s / t.rows_per_query.max(1) as f64,
            r.p50_ms,
            r.p99_ms,
            r.p999_ms
        ));
    }
    out
}
