//! The JSON `scripts/serve_loadtest.py` writes, as `ember plot-latency`
//! draws it and `ember docs` renders it.

use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// One load test: what `serve_loadtest.py` writes.
#[derive(Deserialize)]
pub struct LoadTest {
    pub label: String,
    pub offline_samples_per_s: Option<f64>,
    pub rows_per_query: u64,
    pub target_latency_ms: f64,
    #[serde(default = "one")]
    pub repeats: u64,
    #[serde(default)]
    pub cpu: String,
    #[serde(default)]
    pub cpus: u64,
    #[serde(default)]
    pub date: String,
    pub rates: Vec<Rate>,
}

fn one() -> u64 {
    1
}

/// One offered rate's figures (each the median of the runs).
#[derive(Deserialize)]
pub struct Rate {
    pub target_qps: f64,
    pub target_samples_per_s: f64,
    pub completed_samples_per_s: f64,
    pub fraction_of_offline: Option<f64>,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    #[serde(default)]
    pub p99_ms_runs: Vec<f64>,
    #[serde(default)]
    pub failed: u64,
}

impl Rate {
    /// Held: every query answered, the rate kept up, the p99 in bound.
    pub fn held(&self, bound_ms: f64) -> bool {
        self.failed == 0
            && self.p99_ms <= bound_ms
            && self.completed_samples_per_s >= 0.95 * self.target_samples_per_s
    }
}

/// The load test in `path`; an error names the file.
pub fn read(path: &Path) -> anyhow::Result<LoadTest> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: not a load test's JSON", path.display()))
}
