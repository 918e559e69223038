//! The results page's key-value section, rendered from the committed
//! runs in `docs/results/kv-stream/`: `bench stream` reports
//! (`seed<S>-<config>.json`) as a table of mean AUC per configuration and
//! seed, and `bench dlrm` reports taken in alternating pairs
//! (`cost-kv.jsonl` against `cost-static.jsonl`) as a throughput ratio.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;

/// The runs' directory, under the book's results.
pub const KV_STREAM_DIR: &str = "kv-stream";

/// The configurations in the table's order: `id mod rows` first.
const CONFIGS: [(&str, &str); 5] = [
    ("modulo-eq", "`id mod rows`, 15,430 rows (the same bytes)"),
    ("lru", "key-value, LRU"),
    ("lfu", "key-value, LFU"),
    ("ttl-20", "key-value, TTL 20 steps"),
    ("l2-norm", "key-value, L2 norm"),
];

fn read(path: &Path) -> anyhow::Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

fn number(v: &serde_json::Value, key: &str, path: &Path) -> anyhow::Result<f64> {
    v[key]
        .as_f64()
        .with_context(|| format!("{} has no {key}", path.display()))
}

/// The section, or nothing when the directory is absent.
pub fn section(results: &Path) -> anyhow::Result<String> {
    let dir = results.join(KV_STREAM_DIR);
    if !dir.exists() {
        return Ok(String::new());
    }
    // Mean AUC and table bytes by configuration, then seed.
    let mut runs: BTreeMap<&str, BTreeMap<u64, (f64, f64)>> = BTreeMap::new();
    let mut seeds = std::collections::BTreeSet::new();
    let mut cpu = String::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let name = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        let Some(rest) = name.as_deref().and_then(|n| n.strip_prefix("seed")) else {
            continue;
        };
        let (seed, config) = rest
            .split_once('-')
            .with_context(|| format!("{}: not seed<S>-<config>", path.display()))?;
        let seed: u64 = seed
            .parse()
            .with_context(|| format!("{}: seed", path.display()))?;
        let (config, _) = (CONFIGS.iter())
            .find(|(c, _)| *c == config)
            .with_context(|| format!("{}: unknown configuration", path.display()))?;
        let run = read(&path)?;
        if let Some(c) = run["run"]["cpu"].as_str() {
            cpu = c.to_string();
        }
        let auc = number(&run, "mean_auc", &path)?;
        let bytes = number(&run, "table_bytes", &path)?;
        runs.entry(config).or_default().insert(seed, (auc, bytes));
        seeds.insert(seed);
    }
    let mut out = String::from(
        "\n## Key-value tables against `id mod rows`\n\n\
         `ember bench stream --preset kaggle --data-rows 10000`: 26 features, each one's raw ids \
         drawn log-uniformly from a million (100 times 10,000) and drifting by 5,000 ranks a window; \
         10 windows of 20 batches of 2,048, each window evaluated before it is trained on; \
         the mean AUC over windows 1 to 9. Key-value tables of 10,000 rows with count \
         admission (`--kv-min-rows 2 --kv-admission count:2:4096`: a sketch this narrow \
         over-counts, so it turns away few ids); `id mod rows` with as many bytes (rows, \
         optimizer state and, for key-value tables, the map), on the same stream.",
    );
    out.push_str(&format!(" CPU: {cpu}.\n\n"));
    let seeds: Vec<u64> = seeds.into_iter().collect();
    out.push_str("| tables | MiB |");
    for s in &seeds {
        out.push_str(&format!(" seed {s} |"));
    }
    out.push_str(" mean | above `id mod rows` |\n|---|---|");
    out.push_str(&"---|".repeat(seeds.len() + 2));
    out.push('\n');
    let mean_of = |config: &str| -> Option<f64> {
        let r = runs.get(config)?;
        Some(r.values().map(|v| v.0).sum::<f64>() / r.len() as f64)
    };
    let base = mean_of("modulo-eq");
    for (config, label) in CONFIGS {
        let Some(r) = runs.get(config) else { continue };
        let bytes = r.values().next().map_or(0.0, |v| v.1);
        out.push_str(&format!("| {label} | {:.1} |", bytes / (1 << 20) as f64));
        for s in &seeds {
            match r.get(s) {
                Some((auc, _)) => out.push_str(&format!(" {auc:.4} |")),
                None => out.push_str(" |"),
            }
        }
        let mean = mean_of(config).unwrap_or(f64::NAN);
        let above = match (config, base) {
            ("modulo-eq", _) | (_, None) => String::new(),
            (_, Some(b)) => format!("{:+.4}", mean - b),
        };
        out.push_str(&format!(" {mean:.4} | {above} |\n"));
    }
    out.push_str(&cost(&dir)?);
    out.push_str(&deltas(&dir)?);
    out.push_str(&scale(&dir)?);
    Ok(out)
}

/// The committed run of key-value tables of 300 million ids on the disk
/// tier, if any.
fn scale(dir: &Path) -> anyhow::Result<String> {
    let path = dir.join("scale-300m.json");
    if !path.exists() {
        return Ok(String::new());
    }
    let run = read(&path)?;
    let tables = run["key_value_tables"]
        .as_array()
        .with_context(|| format!("{} has no key_value_tables", path.display()))?;
    let sum = |key: &str| -> f64 { tables.iter().filter_map(|t| t[key].as_f64()).sum() };
    let tier = &run["disk_tier"];
    let gib = |b: f64| b / (1u64 << 30) as f64;
    Ok(format!(
        "\nScale: `{}`: {} key-value tables on the disk tier, their maps in RAM; \
         at the end they hold {:.1} million ids ({:.1} million admitted in all). Peak RSS \
         {:.1} GiB; files {:.1} GiB on disk (removed when the run ends); {:.0} samples/s \
         ({:.0} thousand ids/s), every batch's ids nearly all new, so nearly every lookup a \
         miss (hit rate {:.3}).\n",
        run["run"]["command"].as_str().unwrap_or("?"),
        tables.len(),
        sum("occupancy") / 1e6,
        sum("admitted") / 1e6,
        gib(number(&run, "peak_rss_bytes", &path)?),
        gib(number(tier, "disk_bytes", &path)?),
        number(&run, "samples_per_s", &path)?,
        number(&run, "ids_per_s", &path)? / 1e3,
        number(tier, "hit_rate", &path)?,
    ))
}

/// Runs with `--checkpoint-dir`, by file stem, and what they show.
const DELTA_RUNS: [(&str, &str); 2] = [
    (
        "checkpoints-10000-rows",
        "key-value tables of 10,000 rows (LRU), as above",
    ),
    (
        "checkpoints-preset-rows",
        "key-value tables of the preset's rows (LRU), the same stream",
    ),
];

/// Delta checkpoint bytes against the full checkpoint, if committed.
fn deltas(dir: &Path) -> anyhow::Result<String> {
    let mut out = String::new();
    for (stem, label) in DELTA_RUNS {
        let path = dir.join(format!("{stem}.json"));
        if !path.exists() {
            continue;
        }
        let run = read(&path)?;
        let bytes: Vec<f64> = (run["windows"].as_array().into_iter().flatten())
            .filter_map(|w| w["checkpoint_bytes"].as_f64())
            .collect();
        anyhow::ensure!(bytes.len() >= 2, "{}: no checkpoint bytes", path.display());
        let ratio = number(&run, "delta_over_full", &path)?;
        if out.is_empty() {
            out.push_str(
                "\nDelta checkpoints: the same stream with `--checkpoint-dir`, a full checkpoint \
                 after window 0 and a delta after each later window (the rows the window \
                 changed; a table most of whose rows changed is written whole).\n\n\
                 | tables | full MiB | median delta MiB | delta / full |\n|---|---|---|---|\n",
            );
        }
        let mut deltas = bytes[1..].to_vec();
        deltas.sort_by(f64::total_cmp);
        let mib = |b: f64| b / (1 << 20) as f64;
        out.push_str(&format!(
            "| {label} | {:.1} | {:.1} | {ratio:.3} |\n",
            mib(bytes[0]),
            mib(deltas[deltas.len() / 2])
        ));
    }
    Ok(out)
}

/// The throughput ratio of the paired `bench dlrm` runs, if committed.
fn cost(dir: &Path) -> anyhow::Result<String> {
    let (kv, stat) = (dir.join("cost-kv.jsonl"), dir.join("cost-static.jsonl"));
    if !kv.exists() || !stat.exists() {
        return Ok(String::new());
    }
    let lines = |p: &Path| -> anyhow::Result<Vec<f64>> {
        (std::fs::read_to_string(p)?.lines())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l)?;
                number(&v, "samples_per_s", p)
            })
            .collect()
    };
    let (a, b) = (lines(&kv)?, lines(&stat)?);
    anyhow::ensure!(
        a.len() == b.len() && !a.is_empty(),
        "{} and {}: results come in pairs",
        kv.display(),
        stat.display()
    );
    let mut ratios: Vec<f64> = a.iter().zip(&b).map(|(x, y)| x / y).collect();
    ratios.sort_by(f64::total_cmp);
    let median = super::bench_embedding::median(&mut ratios);
    Ok(format!(
        "\nCost: `ember bench dlrm --preset kaggle --kv-min-rows 2` (every table key-value, the \
         preset's 100,000 rows) against the same run with static tables, {} pairs taken in turn: \
         {median:.3}x the training samples per second (pairs {:.3} to {:.3}).\n",
        ratios.len(),
        ratios[0],
        ratios[ratios.len() - 1]
    ))
}
