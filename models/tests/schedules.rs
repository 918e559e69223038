//! Learning-rate schedules, weight decay and clipping through the Trainer:
//! a scheduled run resumed from its checkpoint is bitwise the run that
//! never stopped (unsharded and sharded), the Trainer gives each step its
//! own rates, a scheduled step is a step at that rate, clipping bounds the
//! dense step, and evaluations on a grid stop the run at an AUC target.

mod common;
use common::{batches, config, temp_dir, weights};

use std::path::PathBuf;

use ember_dense::{DenseOptimizerConfig, HasParams, WeightDecay};
use ember_models::{
    Backend, Dlrm, ExecMode, FitOptions, LrSchedule, Model, Optimization, TrainData, TrainError,
    TrainEvent, TrainState, Trainer, TrainerConfig,
};
use ember_sharding::{PlannerOptions, ShardingPlan, Topology};
use ember_sparse::TableOptimizer;

fn model(optimizers: (TableOptimizer, DenseOptimizerConfig), devices: usize) -> Dlrm {
    let plan: Option<ShardingPlan> = (devices > 1).then(|| {
        let options = PlannerOptions {
            batch_size: 32,
            pooling_factor: 2.0,
            optimizer: optimizers.0,
            sharding: Some(ember_sharding::ShardingType::RowWise),
            disk_tier: None,
        };
        let topo = Topology::uniform(devices, 1 << 30);
        (ember_sharding::plan(&config().tables, &topo, &options).unwrap()).0
    });
    (Dlrm::builder(config()).optimizers(optimizers.0, optimizers.1))
        .seed(3)
        .plan(plan)
        .build()
        .unwrap()
}

fn dense_weights(model: &mut Dlrm) -> Vec<f32> {
    (model.dense_arch_mut().params().iter())
        .flat_map(|p| p.value.to_vec())
        .collect()
}

/// Everything at once: a policy for the tables, DLRMv4's warmup for the
/// dense layers, both decays and clipping.
fn everything() -> Optimization {
    Optimization {
        sparse_schedule: LrSchedule::Policy {
            warmup_steps: 3,
            decay_start_step: 5,
            decay_steps: 4,
        },
        dense_schedule: LrSchedule::LinearWarmup { steps: 6 },
        dense_weight_decay: WeightDecay::Decoupled(0.01),
        table_weight_decay: 0.001,
        max_grad_norm: Some(0.5),
    }
}

fn trainer(dir: Option<PathBuf>, max_steps: Option<u64>, optimization: Optimization) -> Trainer {
    let config = TrainerConfig {
        epochs: 2,
        max_steps,
        checkpoint_dir: dir,
        optimization,
        ..TrainerConfig::default()
    };
    Trainer::new(config, Backend::native())
}

#[test]
fn a_scheduled_run_resumed_is_bitwise_the_run_that_never_stopped() {
    let optimizers = (
        TableOptimizer::rowwise_adagrad(0.05),
        DenseOptimizerConfig::adam(0.01),
    );
    for devices in [1, 2] {
        let train = batches(0, 6);
        let whole = temp_dir("schedules", &format!("whole{devices}"));
        let mut straight = model(optimizers, devices);
        let t = trainer(Some(whole.clone()), None, everything());
        let summary = t.fit(&mut straight, &train, FitOptions::default()).unwrap();
        assert_eq!(summary.steps, 12);
        assert_eq!(
            summary.state.optimization,
            everything(),
            "recorded in the position"
        );

        let parts = temp_dir("schedules", &format!("parts{devices}"));
        let mut first = model(optimizers, devices);
        let t = trainer(Some(parts.clone()), Some(7), everything());
        t.fit(&mut first, &train, FitOptions::default()).unwrap();
        drop(first);

        // Another schedule on resume: refused, naming both.
        let other = Optimization {
            max_grad_norm: Some(1.0),
            ..everything()
        };
        let wrong = trainer(Some(parts.clone()), None, other);
        let mut resumed = model(optimizers, devices);
        let from = wrong.resume(&mut resumed).unwrap();
        let options = FitOptions {
            from,
            ..FitOptions::default()
        };
        match wrong.fit(&mut resumed, &train, options) {
            Err(e @ TrainError::OtherOptimization { .. }) => {
                assert!(e.to_string().contains("\"max_grad_norm\":0.5"), "{e}")
            }
            other => panic!("expected OtherOptimization, got {other:?}"),
        }

        let again = trainer(Some(parts.clone()), None, everything());
        let mut resumed = model(optimizers, devices);
        let from = again.resume(&mut resumed).unwrap();
        assert_eq!(from.steps, 7);
        let options = FitOptions {
            from,
            ..FitOptions::default()
        };
        again.fit(&mut resumed, &train, options).unwrap();
        assert_eq!(
            weights(&mut resumed),
            weights(&mut straight),
            "{devices} devices"
        );
        // And the knobs took: a plain run ends elsewhere.
        let mut plain = model(optimizers, devices);
        let t = trainer(None, None, Optimization::default());
        t.fit(&mut plain, &train, FitOptions::default()).unwrap();
        assert_ne!(
            weights(&mut plain),
            weights(&mut straight),
            "{devices} devices"
        );
        for dir in [whole, parts] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}

/// The Trainer calls `set_optimization` with each step's count: the same
/// bits as a loop that does so by hand.
#[test]
fn the_trainer_gives_each_step_its_rates() {
    let optimizers = (
        TableOptimizer::adagrad(0.05),
        DenseOptimizerConfig::sgd(0.1),
    );
    let train = batches(0, 9);
    let mut by_trainer = model(optimizers, 1);
    let t = trainer(None, None, everything());
    t.fit(&mut by_trainer, &train, FitOptions::default())
        .unwrap();

    let mut by_hand = model(optimizers, 1);
    let backend = Backend::native();
    let mut step = 0;
    for epoch in 0..2 {
        for batch in train.epoch(epoch, 0) {
            by_hand.set_optimization(&everything(), step).unwrap();
            (by_hand.train_step(&backend, &batch.unwrap(), ExecMode::Strict)).unwrap();
            step += 1;
        }
    }
    assert_eq!(weights(&mut by_trainer), weights(&mut by_hand));
    // Without a schedule, the rates are the optimizers' own: other bits.
    let mut plain = model(optimizers, 1);
    let t = trainer(None, None, Optimization::default());
    t.fit(&mut plain, &train, FitOptions::default()).unwrap();
    assert_ne!(weights(&mut plain), weights(&mut by_hand));
}

/// The first step of a linear warmup over 4 steps from 0.5 is an SGD step
/// at 0.125, tables and dense layers alike, bit for bit.
#[test]
fn a_scheduled_step_is_a_step_at_that_rate() {
    let warmup = Optimization {
        sparse_schedule: LrSchedule::LinearWarmup { steps: 4 },
        dense_schedule: LrSchedule::LinearWarmup { steps: 4 },
        ..Optimization::default()
    };
    let train = batches(0, 1);
    let mut scheduled = model(
        (TableOptimizer::sgd(0.5), DenseOptimizerConfig::sgd(0.5)),
        1,
    );
    let t = Trainer::new(
        TrainerConfig {
            optimization: warmup,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    t.fit(&mut scheduled, &train, FitOptions::default())
        .unwrap();
    let mut constant = model(
        (TableOptimizer::sgd(0.125), DenseOptimizerConfig::sgd(0.125)),
        1,
    );
    let t = Trainer::new(TrainerConfig::default(), Backend::native());
    t.fit(&mut constant, &train, FitOptions::default()).unwrap();
    assert_eq!(weights(&mut scheduled), weights(&mut constant));
}

/// With SGD (at a large rate, for a step well above f32's rounding), a
/// clipped step moves the dense weights by `lr * max_norm`
/// (their gradients' global norm is cut to `max_norm`); a maximum above
/// the norm changes no bit.
#[test]
fn clipping_bounds_the_dense_step() {
    let lr = 10.0f32;
    let optimizers = (TableOptimizer::sgd(lr), DenseOptimizerConfig::sgd(lr));
    let train = batches(0, 1);
    let run = |max_grad_norm: Option<f32>| {
        let mut m = model(optimizers, 1);
        let before = dense_weights(&mut m);
        let optimization = Optimization {
            max_grad_norm,
            ..Optimization::default()
        };
        let t = trainer(None, None, optimization);
        let t = Trainer::new(
            TrainerConfig {
                epochs: 1,
                ..t.config().clone()
            },
            Backend::native(),
        );
        t.fit(&mut m, &train, FitOptions::default()).unwrap();
        let after = dense_weights(&mut m);
        let moved: f64 = (before.iter().zip(&after))
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        (after, moved)
    };
    let (free, moved) = run(None);
    let max = 1e-4f32;
    assert!(
        moved > 10.0 * (lr * max) as f64,
        "the test needs a larger step: {moved}"
    );
    let (_, clipped) = run(Some(max));
    let want = (lr * max) as f64;
    // To the f32 weights' rounding of a step of about 1e-4 each.
    assert!((clipped - want).abs() < 1e-2 * want, "{clipped} vs {want}");
    assert_eq!(run(Some(1e6)).0, free);
}

/// Evaluations every quarter of an epoch of 8 batches come after batches
/// 2, 4, 6 and 8; a reachable AUC target stops the run at the first, with
/// a checkpoint there.
#[test]
fn evaluations_on_a_grid_and_the_auc_target() {
    let optimizers = (
        TableOptimizer::adagrad(0.05),
        DenseOptimizerConfig::sgd(0.1),
    );
    let (train, test) = (batches(0, 8), batches(1 << 40, 2));
    let run = |stop_at_auc: Option<f64>, dir: Option<PathBuf>| {
        let mut m = model(optimizers, 1);
        let t = Trainer::new(
            TrainerConfig {
                eval_every_fraction: Some(0.25),
                eval_at_epoch_end: true,
                stop_at_auc,
                checkpoint_dir: dir,
                ..TrainerConfig::default()
            },
            Backend::native(),
        );
        let mut events = Vec::new();
        let options = FitOptions {
            eval: Some(&test),
            from: TrainState::default(),
            on_event: Some(&mut |e: &TrainEvent| match e {
                TrainEvent::Eval { steps, .. } => events.push(format!("eval {steps}")),
                TrainEvent::TargetReached { steps, .. } => events.push(format!("target {steps}")),
                TrainEvent::Checkpoint { steps, .. } => events.push(format!("checkpoint {steps}")),
                _ => {}
            }),
        };
        let summary = t.fit(&mut m, &train, options).unwrap();
        (events, summary)
    };
    let (events, summary) = run(None, None);
    assert_eq!(events, ["eval 2", "eval 4", "eval 6", "eval 8"]);
    assert_eq!((summary.steps, summary.target_reached_at), (8, None));

    let dir = temp_dir("schedules", "target");
    let (events, summary) = run(Some(0.01), Some(dir.clone()));
    assert_eq!(events, ["eval 2", "target 2", "checkpoint 2"]);
    assert_eq!((summary.steps, summary.target_reached_at), (2, Some(2)));
    std::fs::remove_dir_all(dir).unwrap();

    // A target reached at an epoch's last batch: the position is the next
    // epoch's start, checkpointed there, and no second evaluation.
    let dir = temp_dir("schedules", "target-at-end");
    let mut m = model(optimizers, 1);
    let t = Trainer::new(
        TrainerConfig {
            epochs: 2,
            eval_every_fraction: Some(1.0),
            stop_at_auc: Some(0.01),
            checkpoint_dir: Some(dir.clone()),
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let mut evals = 0;
    let options = FitOptions {
        eval: Some(&test),
        from: TrainState::default(),
        on_event: Some(&mut |e: &TrainEvent| evals += matches!(e, TrainEvent::Eval { .. }) as u32),
    };
    let summary = t.fit(&mut m, &train, options).unwrap();
    assert_eq!(evals, 1);
    let s = &summary.state;
    assert_eq!((s.steps, s.epoch, s.batches_in_epoch), (8, 1, 0));
    assert!(summary.checkpoint.is_some());
    std::fs::remove_dir_all(dir).unwrap();

    // Fractions and targets outside (0, 1] are refused before any step.
    for (fraction, target) in [(Some(0.0), None), (Some(1.5), None), (None, Some(0.0))] {
        let t = Trainer::new(
            TrainerConfig {
                eval_every_fraction: fraction,
                stop_at_auc: target,
                ..TrainerConfig::default()
            },
            Backend::native(),
        );
        let mut m = model(optimizers, 1);
        assert!(t.fit(&mut m, &train, FitOptions::default()).is_err());
    }
}

/// Table decay on Adam tables, and a policy whose decay starts before its
/// warmup ends, are refused by name before any step.
#[test]
fn optimizations_no_run_can_use_are_refused() {
    let train = batches(0, 2);
    let cases = [
        (
            TableOptimizer::adam(0.01),
            Optimization {
                table_weight_decay: 0.1,
                ..Optimization::default()
            },
            "not Adam",
        ),
        (
            TableOptimizer::sgd(0.01),
            Optimization {
                dense_schedule: LrSchedule::Policy {
                    warmup_steps: 5,
                    decay_start_step: 2,
                    decay_steps: 1,
                },
                ..Optimization::default()
            },
            "must finish before",
        ),
    ];
    for (table, optimization, says) in cases {
        let mut m = model((table, DenseOptimizerConfig::sgd(0.1)), 1);
        let before = weights(&mut m);
        let t = trainer(None, None, optimization);
        let e = t.fit(&mut m, &train, FitOptions::default()).unwrap_err();
        assert!(e.to_string().contains(says), "{e}");
        assert_eq!(weights(&mut m), before, "nothing trained");
    }
}
