//! HSTU for next-item retrieval, from the library alone, beside SASRec of
//! the same size trained the same way (as the HSTU paper compares them):
//! synthetic user histories (items in topics, users drifting between
//! them), the leave-one-out split, training with the library's Trainer,
//! and HR@10, NDCG@10 and MRR over every item and over 100 sampled
//! negatives, with the popularity baseline.
//!
//! `cargo run --release --example hstu_retrieval [-- EPOCHS]`

use ember::models::sequential::{
    evaluate_retrieval, history_batches, EvalNegatives, HstuRetrieval, HstuRetrievalConfig, SasRec,
    SasRecConfig, SasRecLoss, SequenceRetriever, SyntheticHistories, UserHistory,
};
use ember::prelude::*;

const MAX_LEN: usize = 50;
const ITEMS: usize = 2000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let epochs: u64 = std::env::args().nth(1).map_or(Ok(10), |a| a.parse())?;
    let users = SyntheticHistories {
        num_users: 5000,
        num_items: ITEMS,
        num_topics: 40,
        max_len: MAX_LEN,
        ..SyntheticHistories::default()
    }
    .generate()?;
    // Leave-one-out: train on all but the last two items, validate on the
    // second-to-last, test on the last.
    let train: Vec<UserHistory> = users.iter().map(|u| u.without_last(2)).collect();
    let valid: Vec<UserHistory> = users.iter().map(|u| u.without_last(1)).collect();
    let batches = InMemory(history_batches(&train, 128, MAX_LEN)?);

    // The reference's MovieLens-1M shape (dim 50, 2 blocks, 1 head), and
    // SASRec of that shape trained with the same sampled softmax.
    let mut hstu = HstuRetrieval::new(HstuRetrievalConfig::new(ITEMS, MAX_LEN))?;
    let mut sasrec = SasRec::new(SasRecConfig {
        loss: SasRecLoss::SampledSoftmax {
            negatives: 128,
            temperature: 0.05,
        },
        ..SasRecConfig::new(ITEMS, MAX_LEN)
    })?;
    let trainer = Trainer::new(
        TrainerConfig {
            epochs,
            mode: ExecMode::Strict,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let be = NativeBackend::new(threads);
    let models: [(&str, &mut dyn Trained); 2] = [("HSTU", &mut hstu), ("SASRec", &mut sasrec)];
    for (name, model) in models {
        let summary = trainer.fit(model.model(), &batches, FitOptions::default())?;
        println!(
            "{name}: {} steps in {:.1} s, loss {:.3} -> {:.3}",
            summary.steps, summary.train_seconds, summary.loss_first, summary.loss_last
        );
        for (set_name, set) in [("validation", &valid), ("test", &users)] {
            for negatives in [EvalNegatives::All, EvalNegatives::Sampled(100)] {
                let m = evaluate_retrieval(
                    model.retriever(),
                    &be,
                    set,
                    (MAX_LEN, 256),
                    (negatives, 10),
                    7,
                )?;
                println!(
                    "  {set_name} against {negatives:?}: HR@10 {:.4}, NDCG@10 {:.4}, MRR {:.4}",
                    m.hit_rate, m.ndcg, m.mrr
                );
            }
        }
    }
    println!(
        "popularity's HR@10 against all items: {:.4}",
        popularity(&users)
    );
    Ok(())
}

/// A model both trained and evaluated.
trait Trained {
    fn model(&mut self) -> &mut dyn Model;
    fn retriever(&mut self) -> &mut dyn SequenceRetriever;
}

impl<M: Model + SequenceRetriever> Trained for M {
    fn model(&mut self) -> &mut dyn Model {
        self
    }
    fn retriever(&mut self) -> &mut dyn SequenceRetriever {
        self
    }
}

/// HR@10 of recommending the ten items most seen in training.
fn popularity(users: &[UserHistory]) -> f64 {
    let mut counts = vec![0usize; ITEMS];
    for u in users {
        for &i in &u.items[..u.items.len() - 2] {
            counts[i as usize] += 1;
        }
    }
    let mut order: Vec<usize> = (0..ITEMS).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(counts[i]));
    let last = |u: &UserHistory| *u.items.last().unwrap_or(&-1) as usize;
    let hits = users
        .iter()
        .filter(|u| order[..10].contains(&last(u)))
        .count();
    hits as f64 / users.len() as f64
}
