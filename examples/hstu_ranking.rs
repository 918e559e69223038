//! HSTU ranking in DLRMv4's shape, from the library alone: synthetic user
//! histories with two action bits (engaged, liked), each user's last 8
//! items held out as the candidates to score, training with the library's
//! Trainer from the length-bucketed history loader, and AUC per task
//! before and after.
//!
//! `cargo run --release --example hstu_ranking [-- EPOCHS]`

use ember::models::sequential::{
    HistoryLoader, HstuRanking, HstuRankingConfig, SyntheticHistories, UserHistory,
};
use ember::prelude::*;

const MAX_LEN: usize = 64;
const ITEMS: usize = 1000;
const CANDIDATES: usize = 8;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let epochs: u64 = std::env::args().nth(1).map_or(Ok(5), |a| a.parse())?;
    let users = SyntheticHistories {
        num_users: 5000,
        num_items: ITEMS,
        num_topics: 20,
        max_len: MAX_LEN,
        drift: 0.2,
        ..SyntheticHistories::default()
    }
    .generate()?;
    // Train on each history less its candidates; score those candidates.
    let train: Vec<UserHistory> = users.iter().map(|u| u.without_last(CANDIDATES)).collect();
    let loader = HistoryLoader::new(train, 128, MAX_LEN)
        .shuffled(1)
        .bucketed(16);
    let mut model = HstuRanking::new(HstuRankingConfig {
        num_candidates: CANDIDATES,
        ..HstuRankingConfig::new(ITEMS, MAX_LEN)
    })?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let be = NativeBackend::new(threads);
    let report = |when: &str, m: &ember::models::sequential::RankingMetrics| {
        let aucs: Vec<String> = m.tasks.iter().map(|t| format!("{:.4}", t.auc)).collect();
        println!(
            "{when}: AUC per task (engaged, liked) {} over {} candidates",
            aucs.join(", "),
            m.candidates
        );
    };
    report("before", &model.evaluate(&be, &users, 256)?);
    let trainer = Trainer::new(
        TrainerConfig {
            epochs,
            mode: ExecMode::Strict,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let summary = trainer.fit(&mut model, &loader, FitOptions::default())?;
    println!(
        "{} steps in {:.1} s, loss {:.4} -> {:.4}",
        summary.steps, summary.train_seconds, summary.loss_first, summary.loss_last
    );
    report("after", &model.evaluate(&be, &users, 256)?);
    Ok(())
}
