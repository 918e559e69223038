//! The key-value table flags of `train`, `bench dlrm` and `bench stream`:
//! which tables find rows by the raw id, and how they admit, evict and
//! fall back (see the guide's key-value tables page).

use anyhow::{bail, Context};
use clap::Args;

use ember_sparse::{Admission, EmbeddingBagConfig, Eviction, Fallback, KvConfig};

#[derive(Args, Clone, Debug, Default)]
pub struct KvArgs {
    /// Make every table of at least this many rows a key-value table: rows
    /// found by the raw 64-bit id through a map (its last row the
    /// fallback), ids not reduced by --id-transform [default: none].
    #[arg(long)]
    pub kv_min_rows: Option<usize>,
    /// When a new id gets a row: always, count:N, count:N:WIDTH or
    /// count:N:WIDTH:HALVE (at its N-th sighting, counted in a count-min
    /// sketch of 4 x WIDTH counters, WIDTH 2^20 unless given, every counter
    /// halved each HALVE training batches if given), or probability:P
    /// [default: always].
    #[arg(long, value_parser = parse_admission, requires = "kv_min_rows")]
    pub kv_admission: Option<Admission>,
    /// Which rows a full table gives up: lru, lfu, ttl:STEPS or l2-norm
    /// [default: lru].
    #[arg(long, value_parser = parse_eviction, requires = "kv_min_rows")]
    pub kv_eviction: Option<Eviction>,
    /// What an id without a row reads: zeros or shared-row [default: zeros].
    #[arg(long, value_parser = parse_fallback, requires = "kv_min_rows")]
    pub kv_fallback: Option<Fallback>,
}

/// Counters per row of a count admission's sketch when not given.
const DEFAULT_SKETCH_WIDTH: usize = 1 << 20;

impl KvArgs {
    /// The flags given, by name.
    pub fn given(&self) -> Vec<&'static str> {
        [
            ("--kv-min-rows", self.kv_min_rows.is_some()),
            ("--kv-admission", self.kv_admission.is_some()),
            ("--kv-eviction", self.kv_eviction.is_some()),
            ("--kv-fallback", self.kv_fallback.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    /// Makes the tables the flags name key-value (nothing without
    /// `--kv-min-rows`).
    pub fn apply(&self, tables: &mut [EmbeddingBagConfig]) -> anyhow::Result<()> {
        let Some(min_rows) = self.kv_min_rows else {
            return Ok(());
        };
        if min_rows < 2 {
            bail!("--kv-min-rows {min_rows}: a key-value table needs 2 rows at least (one is the fallback)");
        }
        let kv = KvConfig {
            admission: self.kv_admission.unwrap_or_default(),
            eviction: self.kv_eviction.unwrap_or_default(),
            fallback: self.kv_fallback.unwrap_or_default(),
            ..KvConfig::default()
        };
        for t in tables.iter_mut().filter(|t| t.num_embeddings >= min_rows) {
            t.kv = Some(kv.clone());
        }
        Ok(())
    }
}

/// `NAME` or `NAME:ARG[:ARG]`.
fn split(s: &str) -> (&str, Vec<&str>) {
    let mut parts = s.split(':');
    let name = parts.next().unwrap_or_default();
    (name, parts.collect())
}

fn number<T: std::str::FromStr>(what: &str, s: &str) -> anyhow::Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    s.parse()
        .with_context(|| format!("{what} '{s}' is not a number"))
}

pub fn parse_admission(s: &str) -> anyhow::Result<Admission> {
    match split(s) {
        ("always", args) if args.is_empty() => Ok(Admission::Always),
        ("count", args) if (1..=3).contains(&args.len()) => {
            let min_count = number("count", args[0])?;
            let width = args.get(1).map(|w| number("sketch width", w)).transpose()?;
            let sketch_width = width.unwrap_or(DEFAULT_SKETCH_WIDTH);
            anyhow::ensure!(
                min_count >= 1 && sketch_width >= 1,
                "count:N:WIDTH takes N and WIDTH of 1 at least"
            );
            let halve_every = args
                .get(2)
                .map(|h| number("halving period", h))
                .transpose()?;
            anyhow::ensure!(
                halve_every != Some(0),
                "count:N:WIDTH:HALVE halves every 1 batch at least"
            );
            Ok(Admission::Count {
                min_count,
                sketch_width,
                halve_every,
            })
        }
        ("probability", args) if args.len() == 1 => {
            let p: f64 = number("probability", args[0])?;
            anyhow::ensure!(p > 0.0 && p <= 1.0, "probability:{p} is not in (0, 1]");
            Ok(Admission::Probability { p })
        }
        _ => bail!("'{s}': admission is always, count:N[:WIDTH[:HALVE]] or probability:P"),
    }
}

pub fn parse_eviction(s: &str) -> anyhow::Result<Eviction> {
    match split(s) {
        ("lru", args) if args.is_empty() => Ok(Eviction::Lru),
        ("lfu", args) if args.is_empty() => Ok(Eviction::Lfu),
        ("l2-norm", args) if args.is_empty() => Ok(Eviction::L2Norm),
        ("ttl", args) if args.len() == 1 => {
            let steps = number("ttl", args[0])?;
            anyhow::ensure!(steps >= 1, "ttl:{steps}: rows live 1 step at least");
            Ok(Eviction::Ttl { steps })
        }
        _ => bail!("'{s}': eviction is lru, lfu, ttl:STEPS or l2-norm"),
    }
}

pub fn parse_fallback(s: &str) -> anyhow::Result<Fallback> {
    match s {
        "zeros" => Ok(Fallback::Zeros),
        "shared-row" => Ok(Fallback::SharedRow),
        _ => bail!("'{s}': the fallback is zeros or shared-row"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_admission("count:3").unwrap(),
            Admission::Count {
                min_count: 3,
                sketch_width: DEFAULT_SKETCH_WIDTH,
                halve_every: None,
            }
        );
        assert_eq!(
            parse_admission("count:2:64:100").unwrap(),
            Admission::Count {
                min_count: 2,
                sketch_width: 64,
                halve_every: Some(100),
            }
        );
        assert_eq!(
            parse_eviction("ttl:100").unwrap(),
            Eviction::Ttl { steps: 100 }
        );
        assert_eq!(parse_fallback("shared-row").unwrap(), Fallback::SharedRow);
        assert!(parse_admission("count:x")
            .unwrap_err()
            .to_string()
            .contains("'x'"));
        assert!(parse_admission("probability:1.5")
            .unwrap_err()
            .to_string()
            .contains("1.5"));
        assert!(parse_eviction("ttl:0").is_err());
        assert!(parse_eviction("mru")
            .unwrap_err()
            .to_string()
            .contains("'mru'"));
    }
}

/// One key-value table's figures over a run (`--json`'s `key_value_tables`).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct KvTableReport {
    pub table: String,
    #[serde(flatten)]
    pub stats: ember_sparse::KvStats,
}

/// One line for the human summary: every key-value table's figures summed.
pub fn kv_summary(tables: &[KvTableReport]) -> String {
    let sum =
        |f: fn(&ember_sparse::KvStats) -> u64| tables.iter().map(|t| f(&t.stats)).sum::<u64>();
    format!(
        "key-value tables ({}): {} of {} rows held; {} ids seen, {} admitted, {} rejected, {} without room, {} evicted, {} fallback reads",
        tables.len(),
        sum(|s| s.occupancy),
        sum(|s| s.capacity),
        sum(|s| s.seen),
        sum(|s| s.admitted),
        sum(|s| s.rejected),
        sum(|s| s.full),
        sum(|s| s.evicted),
        sum(|s| s.fallback_reads)
    )
}

/// The figures of `model`'s key-value tables, in the model's table order
/// (on ranks, gathered from the rank holding each: every rank calls this
/// together); `None` when it has none.
pub fn kv_report(model: &ember_models::Dlrm) -> anyhow::Result<Option<Vec<KvTableReport>>> {
    let arch = model.sparse_arch();
    let tables: Vec<(&str, &ember_sparse::EmbeddingTable)> = match arch.sharded() {
        Some(s) => (s.local_shards().into_iter())
            .map(|l| (l.table, l.data))
            .collect(),
        None => (arch.local().map_or(&[][..], |e| e.tables()).iter())
            .map(|t| (t.name(), t))
            .collect(),
    };
    let mut reports: Vec<KvTableReport> = (tables.into_iter())
        .filter_map(|(name, t)| {
            Some(KvTableReport {
                table: name.to_string(),
                stats: t.kv_stats()?,
            })
        })
        .collect();
    if let Some(world) = model.world() {
        let all = world.all_gather(serde_json::to_vec(&reports)?)?;
        reports.clear();
        for part in all {
            reports.extend(serde_json::from_slice::<Vec<KvTableReport>>(&part)?);
        }
    }
    // A table sharded by buckets: its shards' figures summed.
    let order = |name: &str| (model.config().tables.iter()).position(|t| t.name == name);
    reports.sort_by_key(|r| order(&r.table));
    let mut tables: Vec<KvTableReport> = Vec::new();
    for r in reports {
        match tables.last_mut().filter(|t| t.table == r.table) {
            Some(t) => t.stats.add(&r.stats),
            None => tables.push(r),
        }
    }
    Ok((!tables.is_empty()).then_some(tables))
}
