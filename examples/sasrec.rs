//! SASRec on a `user item` file (the format of SASRec's published data),
//! trained and evaluated as the public PyTorch SASRec does: each user's
//! last item for test and second-to-last for validation (users of fewer
//! than 4 items train on all of them and are not evaluated), windows of `maxlen` items, 100
//! sampled negatives, HR@10 and NDCG@10; seconds per epoch.
//!
//! ```text
//! cargo run --release --example sasrec -- --synthetic data.txt   # 31k users, 24k items
//! cargo run --release --example sasrec -- data.txt [EPOCHS]
//! ```

use std::path::Path;
use std::time::Instant;

use ember::models::sequential::{
    evaluate_retrieval, history_batches, read_user_item_file, write_user_item_file, EvalNegatives,
    SasRec, SasRecConfig, SyntheticHistories, UserHistory,
};
use ember::prelude::*;

/// The PyTorch SASRec's flags for the comparison: maxlen 50, 50 hidden
/// units, 2 blocks, batch 128.
const MAXLEN: usize = 50;
const BATCH: usize = 128;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--synthetic") {
        let path = args.get(1).ok_or("--synthetic FILE")?;
        // The shape of the peer's reference dataset: 31k users, 24k items,
        // about 287k actions (9.2 a user).
        let users = SyntheticHistories {
            num_users: 31_000,
            num_items: 24_000,
            num_topics: 200,
            max_len: 50,
            length_alpha: 1.3,
            ..SyntheticHistories::default()
        }
        .generate()?;
        write_user_item_file(&users, 1, Path::new(path))?;
        let actions: usize = users.iter().map(|u| u.items.len()).sum();
        println!("{path}: {} users, {actions} actions", users.len());
        return Ok(());
    }
    let path = args
        .first()
        .ok_or("usage: sasrec FILE [EPOCHS] | --synthetic FILE")?;
    let epochs: usize = args.get(1).map_or(Ok(20), |a| a.parse())?;
    let users = read_user_item_file(Path::new(path))?;
    let items = 1 + users
        .iter()
        .flat_map(|u| &u.items)
        .copied()
        .max()
        .unwrap_or(0) as usize;
    let train: Vec<UserHistory> = (users.iter())
        .map(|u| {
            if u.items.len() < 4 {
                u.clone()
            } else {
                u.without_last(2)
            }
        })
        .collect();
    let tested: Vec<UserHistory> = users
        .iter()
        .filter(|u| u.items.len() >= 4)
        .cloned()
        .collect();
    let valid: Vec<UserHistory> = tested.iter().map(|u| u.without_last(1)).collect();

    let mut model = SasRec::new(SasRecConfig::new(items, MAXLEN))?;
    let trainer = Trainer::new(
        TrainerConfig {
            epochs: 1,
            mode: ExecMode::Strict,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let be = NativeBackend::new(threads);
    let mut order: Vec<usize> = (0..train.len()).collect();
    let mut rng = ember::sparse::rng::Rng::new(7);
    let mut seconds = Vec::new();
    for epoch in 1..=epochs {
        // Users in a new order each epoch (SASRec's sampler draws them at random).
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let shuffled: Vec<UserHistory> = order.iter().map(|&u| train[u].clone()).collect();
        let data = InMemory(history_batches(&shuffled, BATCH, MAXLEN + 1)?);
        let start = Instant::now();
        let summary = trainer.fit(&mut model, &data, FitOptions::default())?;
        seconds.push(start.elapsed().as_secs_f64());
        println!(
            "epoch {epoch}: {:.2} s, loss {:.4}",
            seconds[epoch - 1],
            summary.loss_last
        );
    }
    seconds.sort_by(f64::total_cmp);
    println!("median epoch: {:.2} s", seconds[seconds.len() / 2]);
    for (name, set) in [("valid", &valid), ("test", &tested)] {
        let negatives = (EvalNegatives::Sampled(100), 10);
        let m = evaluate_retrieval(&mut model, &be, set, (MAXLEN + 1, 256), negatives, 1)?;
        println!(
            "{name}: NDCG@10 {:.4}, HR@10 {:.4} ({} users)",
            m.ndcg, m.hit_rate, m.users
        );
    }
    Ok(())
}
