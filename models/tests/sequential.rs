//! Sequential retrieval end to end: synthetic histories, HSTU trained by
//! the library's Trainer, leave-one-out HR@10 and NDCG@10 against the
//! popularity baseline; checkpoints that resume exactly.

use ember_dense::NativeBackend;
use ember_models::sequential::{
    evaluate_retrieval, history_batches, EvalNegatives, HstuRetrieval, HstuRetrievalConfig,
    SequenceRetriever, SyntheticHistories, UserHistory,
};
use ember_models::{Backend, ExecMode, FitOptions, InMemory, Model, Trainer, TrainerConfig};

const MAX_LEN: usize = 30;

fn data() -> Vec<UserHistory> {
    SyntheticHistories {
        num_users: 800,
        num_items: 300,
        num_topics: 10,
        max_len: MAX_LEN,
        drift: 0.05,
        seed: 1,
        ..SyntheticHistories::default()
    }
    .generate()
    .unwrap()
}

fn config() -> HstuRetrievalConfig {
    HstuRetrievalConfig {
        embedding_dim: 32,
        attention_dim: 16,
        linear_dim: 16,
        num_heads: 2,
        num_negatives: 32,
        learning_rate: 3e-3,
        seed: 3,
        ..HstuRetrievalConfig::new(300, MAX_LEN)
    }
}

/// Eight epochs of `batches` by the library's Trainer.
fn fit_eight_epochs(
    model: &mut dyn Model,
    batches: Vec<ember_models::Batch>,
) -> ember_models::TrainSummary {
    let config = TrainerConfig {
        epochs: 8,
        mode: ExecMode::Strict,
        ..TrainerConfig::default()
    };
    let trainer = Trainer::new(config, Backend::native());
    trainer
        .fit(model, &InMemory(batches), FitOptions::default())
        .unwrap()
}

/// HR@10 of ranking by popularity in the training histories.
fn popularity_hit_rate(users: &[UserHistory], items: usize) -> f64 {
    let mut counts = vec![0usize; items];
    for u in users {
        for &i in &u.items[..u.items.len() - 2] {
            counts[i as usize] += 1;
        }
    }
    let mut order: Vec<usize> = (0..items).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(counts[i]));
    let top: std::collections::HashSet<usize> = order[..10].iter().copied().collect();
    let hits = users
        .iter()
        .filter(|u| top.contains(&(*u.items.last().unwrap() as usize)))
        .count();
    hits as f64 / users.len() as f64
}

#[test]
fn hstu_learns_the_histories_structure() {
    let users = data();
    let train: Vec<UserHistory> = users.iter().map(|u| u.without_last(2)).collect();
    let batches = history_batches(&train, 64, MAX_LEN).unwrap();
    let mut model = HstuRetrieval::new(config()).unwrap();
    let be = NativeBackend::new(2);
    let before = evaluate_retrieval(
        &mut model,
        &be,
        &users,
        (MAX_LEN, 128),
        (EvalNegatives::All, 10),
        0,
    )
    .unwrap();
    let summary = fit_eight_epochs(&mut model, batches);
    let after = evaluate_retrieval(
        &mut model,
        &be,
        &users,
        (MAX_LEN, 128),
        (EvalNegatives::All, 10),
        0,
    )
    .unwrap();
    let sampled = evaluate_retrieval(
        &mut model,
        &be,
        &users,
        (MAX_LEN, 128),
        (EvalNegatives::Sampled(100), 10),
        0,
    )
    .unwrap();
    let popular = popularity_hit_rate(&users, 300);
    eprintln!("loss {:?}, before {before:?}, after {after:?}, sampled {sampled:?}, popularity HR@10 {popular:.3}", (summary.loss_first, summary.loss_last));
    assert_eq!(after.users, users.len());
    assert!(
        after.hit_rate > 2.0 * popular,
        "HR@10 {} against popularity's {popular}",
        after.hit_rate
    );
    assert!(after.hit_rate > 2.0 * before.hit_rate);
    assert!(
        sampled.hit_rate > after.hit_rate,
        "100 negatives rank easier than all 300 items"
    );
    assert!(after.ndcg > 0.0 && after.ndcg <= after.hit_rate && after.mrr > 0.0);
}

#[test]
fn a_checkpoint_loads_into_a_model_of_another_seed() {
    let users: Vec<UserHistory> = data()[..200].iter().map(|u| u.without_last(2)).collect();
    let batches = history_batches(&users, 50, MAX_LEN).unwrap();
    let be = Backend::native();
    let mut a = HstuRetrieval::new(config()).unwrap();
    a.train_step(&be, &batches[0], ExecMode::Strict).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = a.save_checkpoint(dir.path(), None).unwrap();
    let mut b = HstuRetrieval::new(HstuRetrievalConfig {
        seed: 99,
        ..config()
    })
    .unwrap();
    let want = a.predict(&be, &batches[2]).unwrap().to_vec();
    assert_ne!(b.predict(&be, &batches[2]).unwrap(), &want[..]);
    b.load_checkpoint(&path).unwrap();
    assert_eq!(b.predict(&be, &batches[2]).unwrap(), &want[..]);
    assert_eq!(b.item_embeddings(), a.item_embeddings());
}

#[test]
fn sasrec_learns_the_histories_structure_with_either_loss() {
    use ember_models::sequential::{SasRec, SasRecConfig, SasRecLoss};
    let users = data();
    let train: Vec<UserHistory> = users.iter().map(|u| u.without_last(2)).collect();
    // SASRec reads windows of maxlen inputs: batches of maxlen + 1 items.
    let batches = history_batches(&train, 64, MAX_LEN + 1).unwrap();
    let popular = popularity_hit_rate(&users, 300);
    let sampled = SasRecLoss::SampledSoftmax {
        negatives: 32,
        temperature: 0.05,
    };
    for loss in [SasRecLoss::Bce, sampled] {
        let config = SasRecConfig {
            hidden_units: 32,
            num_heads: 2,
            lr: 3e-3,
            loss,
            seed: 3,
            ..SasRecConfig::new(300, MAX_LEN)
        };
        let mut model = SasRec::new(config).unwrap();
        let be = NativeBackend::new(2);
        let summary = fit_eight_epochs(&mut model, batches.clone());
        let all = (EvalNegatives::All, 10);
        let after =
            evaluate_retrieval(&mut model, &be, &users, (MAX_LEN + 1, 128), all, 0).unwrap();
        eprintln!(
            "sasrec {loss:?}: loss {} -> {}, {after:?}, popularity {popular:.3}",
            summary.loss_first, summary.loss_last
        );
        assert!(summary.loss_last < summary.loss_first, "{loss:?}");
        assert!(
            after.hit_rate > 1.5 * popular,
            "{loss:?}: HR@10 {} against popularity's {popular}",
            after.hit_rate
        );
    }
}

#[test]
fn hstu_learns_with_in_batch_negatives_too() {
    use ember_models::sequential::NegativeSampling;
    let users = data();
    let train: Vec<UserHistory> = users.iter().map(|u| u.without_last(2)).collect();
    let batches = history_batches(&train, 64, MAX_LEN).unwrap();
    let config = HstuRetrievalConfig {
        negative_sampling: NegativeSampling::InBatch,
        ..config()
    };
    let mut model = HstuRetrieval::new(config).unwrap();
    let summary = fit_eight_epochs(&mut model, batches);
    let be = NativeBackend::new(2);
    let all = (EvalNegatives::All, 10);
    let after = evaluate_retrieval(&mut model, &be, &users, (MAX_LEN, 128), all, 0).unwrap();
    let popular = popularity_hit_rate(&users, 300);
    eprintln!(
        "in-batch: loss {} -> {}, {after:?}",
        summary.loss_first, summary.loss_last
    );
    assert!(summary.loss_last < summary.loss_first);
    // Below uniform negatives' (popular items are negatives more often,
    // and nothing corrects for it), and still well above popularity.
    assert!(
        after.hit_rate > 1.3 * popular,
        "HR@10 {} against popularity's {popular}",
        after.hit_rate
    );
}
