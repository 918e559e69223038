//! HSTU ranking end to end on synthetic histories with actions, trained by
//! the library's Trainer from the bucketed history loader; and the
//! loader's own contract.

use ember_dense::NativeBackend;
use ember_models::sequential::{
    history_batches, HistoryLoader, HstuRanking, HstuRankingConfig, SyntheticHistories,
    UserHistory, ACTIONS_FEATURE,
};
use ember_models::{Backend, ExecMode, FitOptions, Model, TrainData, Trainer, TrainerConfig};

const CANDIDATES: usize = 4;

fn data() -> Vec<UserHistory> {
    SyntheticHistories {
        num_users: 4000,
        num_items: 300,
        num_topics: 10,
        max_len: 30,
        drift: 0.2,
        seed: 5,
        ..SyntheticHistories::default()
    }
    .generate()
    .unwrap()
}

#[test]
fn ranking_learns_every_action_above_chance() {
    let users = data();
    // Train on each user's history less its last candidates; evaluate on
    // those candidates (seen after the training ones).
    let train: Vec<UserHistory> = users.iter().map(|u| u.without_last(CANDIDATES)).collect();
    let config = HstuRankingConfig {
        embedding_dim: 32,
        attention_dim: 16,
        linear_dim: 16,
        num_candidates: CANDIDATES,
        head_hidden: 32,
        seed: 2,
        ..HstuRankingConfig::new(300, 40)
    };
    let mut model = HstuRanking::new(config).unwrap();
    let be = NativeBackend::new(2);
    let before = model.evaluate(&be, &users, 256).unwrap();
    let loader = HistoryLoader::new(train, 64, 40).shuffled(1).bucketed(8);
    let trainer = Trainer::new(
        TrainerConfig {
            epochs: 8,
            mode: ExecMode::Strict,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let summary = trainer
        .fit(&mut model, &loader, FitOptions::default())
        .unwrap();
    assert!(summary.loss_last < summary.loss_first, "{summary:?}");
    let after = model.evaluate(&be, &users, 256).unwrap();
    eprintln!("before {before:?}\nafter {after:?}");
    assert_eq!(after.tasks.len(), 2);
    for (t, (b, a)) in before.tasks.iter().zip(&after.tasks).enumerate() {
        assert!(
            a.auc > 0.55 && a.auc > b.auc + 0.05,
            "task {t}: AUC {} -> {}",
            b.auc,
            a.auc
        );
    }
}

#[test]
fn history_batches_carry_actions_beside_the_items() {
    let users = data();
    let batch = history_batches(&users[..3], 3, 5).unwrap().remove(0);
    let (actions, offsets) = {
        let kjt = &batch.sparse;
        let k = kjt.key_index(ACTIONS_FEATURE).unwrap();
        let b = kjt.stride();
        (
            kjt.values().to_vec(),
            kjt.offsets()[k * b..=(k + 1) * b].to_vec(),
        )
    };
    for (s, u) in users[..3].iter().enumerate() {
        let from = u.items.len().saturating_sub(5);
        assert_eq!(&actions[offsets[s]..offsets[s + 1]], &u.actions[from..]);
    }
}

#[test]
fn the_loader_reads_every_user_once_an_epoch_and_buckets_by_length() {
    let users = data();
    let n = users.iter().filter(|u| u.items.len() >= 2).count();
    let plain = HistoryLoader::new(users.clone(), 32, 30).shuffled(9);
    let bucketed = plain.clone().bucketed(16);
    for loader in [&plain, &bucketed] {
        let mut seen: Vec<usize> = loader.epoch_users(3).concat();
        seen.sort_unstable();
        assert_eq!(seen, (0..n).collect::<Vec<_>>());
        assert_eq!(loader.batches_per_epoch(3) as usize, n.div_ceil(32));
        // The same batches whenever asked, and other ones next epoch.
        assert_eq!(loader.epoch_users(3), loader.epoch_users(3));
        assert_ne!(loader.epoch_users(3), loader.epoch_users(4));
        // Resuming at batch 5 reads what the uninterrupted epoch read.
        let all: Vec<_> = loader.epoch(3, 0).map(|b| b.unwrap().sparse).collect();
        let rest: Vec<_> = loader.epoch(3, 5).map(|b| b.unwrap().sparse).collect();
        assert_eq!(all[5..], rest[..]);
    }
    let (padded_plain, real) = plain.padded_and_real_tokens(3);
    let (padded_bucketed, real_b) = bucketed.padded_and_real_tokens(3);
    assert_eq!(real, real_b);
    eprintln!(
        "padded/real: plain {:.2}, bucketed {:.2}",
        padded_plain as f64 / real as f64,
        padded_bucketed as f64 / real as f64
    );
    assert!(
        padded_bucketed * 10 < padded_plain * 7,
        "{padded_bucketed} vs {padded_plain}"
    );
}

/// DLRMv4's knobs on its model: the first step of a linear warmup over 4
/// steps from 0.02 is a step at 0.005, the item table's and the dense
/// layers' alike, bit for bit; clipping and each decay take.
#[test]
fn a_warmup_step_is_a_step_at_that_rate() {
    use ember_models::{LrSchedule, Optimization};
    let users: Vec<UserHistory> = data().into_iter().take(64).collect();
    let loader = HistoryLoader::new(users, 64, 40);
    let config = |lr: f32| HstuRankingConfig {
        embedding_dim: 16,
        attention_dim: 8,
        linear_dim: 8,
        num_candidates: CANDIDATES,
        head_hidden: 16,
        seed: 2,
        learning_rate: lr,
        table_optimizer: ember_sparse::TableOptimizer::rowwise_adagrad(lr),
        ..HstuRankingConfig::new(300, 40)
    };
    let run = |lr: f32, optimization: Optimization| {
        let mut model = HstuRanking::new(config(lr)).unwrap();
        let trainer = Trainer::new(
            TrainerConfig {
                optimization,
                ..TrainerConfig::default()
            },
            Backend::native(),
        );
        trainer
            .fit(&mut model, &loader, FitOptions::default())
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = model.save_checkpoint(dir.path(), None).unwrap();
        // Every tensor, by name (the metadata records the config's rates).
        let bytes = std::fs::read(path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<(String, Vec<u8>)> = (file.tensors().into_iter())
            .map(|(name, view)| (name, view.data().to_vec()))
            .collect();
        tensors.sort();
        tensors
    };
    let warmup = LrSchedule::LinearWarmup { steps: 4 };
    let scheduled = Optimization {
        sparse_schedule: warmup,
        dense_schedule: warmup,
        ..Optimization::default()
    };
    assert!(run(0.02, scheduled) == run(0.005, Optimization::default()));
    // Each knob on its own changes the result.
    let base = run(0.02, scheduled);
    for knob in [
        Optimization {
            max_grad_norm: Some(1e-3),
            ..scheduled
        },
        Optimization {
            table_weight_decay: 0.5,
            ..scheduled
        },
        Optimization {
            dense_weight_decay: ember_dense::WeightDecay::Decoupled(0.5),
            ..scheduled
        },
    ] {
        assert!(run(0.02, knob) != base, "{knob:?} changed nothing");
    }
}
