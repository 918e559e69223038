//! Property-based fuzzing of the sharding inputs users write by hand: plan
//! and topology JSON, and byte-size strings. No panic; either a clean error
//! or what a reference gives. `EMBER_FUZZ_CASES=N` runs N cases.

use ember_sharding::topology::parse_bytes;
use ember_sharding::{plan, stats, PlannerOptions, ShardingPlan, Topology};
use ember_sparse::{EmbeddingBagConfig, TableOptimizer};
use proptest::prelude::*;

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("EMBER_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    ProptestConfig::with_cases(n.unwrap_or(default))
}

fn tables() -> Vec<EmbeddingBagConfig> {
    (0..4)
        .map(|t| EmbeddingBagConfig::new(&format!("t{t}"), 50 + 30 * t, 8, &[&format!("f{t}")]))
        .collect()
}

fn options() -> PlannerOptions {
    PlannerOptions {
        batch_size: 64,
        pooling_factor: 2.0,
        optimizer: TableOptimizer::rowwise_adagrad(0.1),
        sharding: None,
        disk_tier: None,
    }
}

/// A valid plan's JSON (3 devices), made by the planner.
fn plan_json() -> (String, Topology) {
    let topo = Topology::uniform(3, 1 << 30);
    let (p, _) = plan(&tables(), &topo, &options()).unwrap();
    (p.to_json(), topo)
}

/// `text` with `edits` applied: a character replaced or removed at a place.
fn mutate(text: &str, edits: &[(prop::sample::Index, Option<char>)]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for (at, c) in edits {
        if chars.is_empty() {
            break;
        }
        let i = at.index(chars.len());
        match c {
            Some(c) => chars[i] = *c,
            None => {
                chars.remove(i);
            }
        }
    }
    chars.into_iter().collect()
}

fn edits() -> impl Strategy<Value = Vec<(prop::sample::Index, Option<char>)>> {
    let c = prop_oneof![
        Just(None),
        proptest::char::range('0', '9').prop_map(Some),
        proptest::sample::select(vec!['-', '"', ',', '{', '}', '[', ']', 'e', '.', ' ', 'x'])
            .prop_map(Some),
    ];
    proptest::collection::vec((any::<prop::sample::Index>(), c), 1..4)
}

proptest! {
    #![proptest_config(cases(512))]

    /// A hand-edited plan: parsed and validated, or refused; one that
    /// passes places every row exactly once (so the cost model can run on it).
    #[test]
    fn edited_plans_are_refused_or_valid(edits in edits()) {
        let (json, topo) = plan_json();
        let text = mutate(&json, &edits);
        let checked = std::panic::catch_unwind(|| {
            let p = ShardingPlan::from_json(&text)?;
            p.validate(&tables(), &options().optimizer)?;
            if p.num_devices == topo.num_devices() {
                stats(&tables(), &p, &topo, &options());
            }
            Ok::<_, ember_sharding::ShardingError>(())
        });
        prop_assert!(checked.is_ok(), "panicked on {}", text);
    }

    #[test]
    fn edited_topologies_are_refused_or_planned(edits in edits()) {
        let json = serde_json::to_string_pretty(&Topology::uniform(2, 1 << 30)).unwrap();
        let text = mutate(&json, &edits);
        let planned = std::panic::catch_unwind(|| {
            let Ok(topo) = serde_json::from_str::<Topology>(&text) else { return };
            if topo.validate().is_ok() {
                let _ = plan(&tables(), &topo, &options());
            }
        });
        prop_assert!(planned.is_ok(), "panicked on {}", text);
    }

    #[test]
    fn any_text_is_a_size_or_refused(text in "\\PC{0,24}") {
        let _ = parse_bytes(&text);
    }

    /// Sizes as people write them parse to the number the units mean.
    #[test]
    fn sizes_parse_to_what_their_units_mean(
        n in 0u64..1_000_000,
        unit in proptest::sample::select(vec![
            ("", 1u64), ("B", 1), ("KB", 1000), ("MB", 1_000_000), ("GB", 1_000_000_000),
            ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40),
        ]),
        space in any::<bool>(),
    ) {
        let text = format!("{n}{}{}", if space { " " } else { "" }, unit.0);
        prop_assert_eq!(parse_bytes(&text), Ok(n * unit.1));
    }
}
