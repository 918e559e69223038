//! A sequence model's checkpoint opened by `SequenceScorer`: it records
//! its model, and scores histories as the model that wrote it does.

use ember_dense::NativeBackend;
use ember_models::sequential::{
    history_batch, history_batches, HstuRanking, HstuRankingConfig, SasRec, SasRecConfig,
    SequenceRetriever, SequenceScorer, SequenceScores, SyntheticHistories, UserHistory,
};
use ember_models::Model;

fn users() -> Vec<UserHistory> {
    let users: Vec<UserHistory> = SyntheticHistories {
        num_users: 60,
        num_items: 60,
        num_topics: 4,
        max_len: 20,
        seed: 5,
        ..SyntheticHistories::default()
    }
    .generate()
    .unwrap()
    .into_iter()
    .filter(|u| u.items.len() >= 5)
    .collect();
    assert!(users.len() > 5, "{} users", users.len());
    users
}

#[test]
fn a_sasrec_checkpoint_gives_each_history_its_best_items() {
    let dir = tempfile::tempdir().unwrap();
    let config = SasRecConfig {
        hidden_units: 16,
        seed: 2,
        ..SasRecConfig::new(60, 8)
    };
    let mut model = SasRec::new(config.clone()).unwrap();
    model.save_checkpoint(dir.path(), None).unwrap();
    let mut scorer = SequenceScorer::open(dir.path()).unwrap();
    assert_eq!(scorer.config().name(), "sasrec");

    let users = users();
    let SequenceScores::TopItems { items, scores } = scorer.score(&users, 5).unwrap() else {
        panic!("SASRec retrieves items");
    };
    assert_eq!(
        (items.len(), scores.len()),
        (users.len() * 5, users.len() * 5)
    );
    // The queries of the saved model, against every item, in f64: each
    // user's whole history read (any item after it, held out as the next).
    let be = NativeBackend::new(1);
    let followed: Vec<UserHistory> = (users.iter())
        .map(|u| {
            let mut u = u.clone();
            u.items.push(7);
            u.timestamps.push(*u.timestamps.last().unwrap());
            u
        })
        .collect();
    let batch = &history_batches(&followed, users.len(), 8 + 1).unwrap()[0];
    let queries = model.user_queries(&be, batch).unwrap();
    let rows = model.item_embeddings();
    for u in 0..users.len() {
        let score = |id: usize| -> f64 {
            let q = queries.row(u).iter().zip(rows.row(id));
            q.map(|(a, b)| f64::from(*a) * f64::from(*b)).sum()
        };
        let mut all: Vec<usize> = (0..60).collect();
        all.sort_by(|a, b| score(*b).total_cmp(&score(*a)));
        for r in 0..5 {
            let id = items[u * 5 + r] as usize;
            assert!((score(id) - f64::from(scores[u * 5 + r])).abs() < 1e-4);
            // The r-th best, up to rounding between near ties.
            assert!(
                (score(id) - score(all[r])).abs() < 1e-4,
                "user {u} rank {r}"
            );
        }
    }
}

#[test]
fn an_hstu_ranking_checkpoint_scores_candidates_as_its_model() {
    let dir = tempfile::tempdir().unwrap();
    let config = HstuRankingConfig {
        embedding_dim: 16,
        attention_dim: 8,
        linear_dim: 8,
        head_hidden: 16,
        num_candidates: 3,
        seed: 4,
        ..HstuRankingConfig::new(60, 12)
    };
    let mut model = HstuRanking::new(config).unwrap();
    model.save_checkpoint(dir.path(), None).unwrap();
    let mut scorer = SequenceScorer::open(dir.path()).unwrap();
    assert_eq!(scorer.config().candidates(), Some((3, 2)));

    let users = users();
    let SequenceScores::Candidates { logits } = scorer.score(&users, 0).unwrap() else {
        panic!("HSTU ranking scores candidates");
    };
    let batch = history_batch(scorer.config(), &users).unwrap();
    let be = NativeBackend::new(1);
    let expected = model.candidate_logits(&be, &batch).unwrap();
    assert_eq!(logits.len(), users.len() * 3 * 2);
    assert_eq!(logits, expected, "bitwise the model that wrote it");
}

#[test]
fn a_checkpoint_without_a_sequence_model_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("none.safetensors");
    let err = SequenceScorer::open(&path).err().unwrap();
    assert!(err.to_string().contains("none.safetensors"), "{err}");
    // Not a sequence model's: left to the DLRM reader (a set's index here).
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index, "{}").unwrap();
    let found = ember_models::sequential::SequenceModelConfig::of_checkpoint(&index).unwrap();
    assert!(found.is_none());
    // A checkpoint of another kind: a DLRM's.
    let config = ember_models::DlrmConfig {
        tables: ember_models::DlrmConfig::criteo_tables(&[5, 6], 4),
        bottom_mlp: vec![3, 4],
        top_mlp: vec![3, 1],
        interaction: ember_models::InteractionType::Dot,
    };
    let mut dlrm = ember_models::Dlrm::builder(config).build().unwrap();
    let file = dlrm.save_checkpoint(dir.path(), None).unwrap();
    let err = SequenceScorer::open(&file).err().unwrap();
    assert!(err.to_string().contains("no sequence model"), "{err}");
}
