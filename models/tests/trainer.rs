//! The library's Trainer in-process: a run stopped by `max_steps` and
//! resumed from its checkpoint is bitwise the run that never stopped
//! (unsharded and sharded over threads), the events come in order, and a
//! bad run fails with a typed error.

mod common;
use common::{batches, config, temp_dir, weights};

use std::path::{Path, PathBuf};
use std::time::Duration;

use ember_dense::DenseOptimizerConfig;
use ember_models::{
    Backend, Batch, Dlrm, ExecMode, FitOptions, InMemory, Model, ModelError, StepOutput,
    SyntheticBatches, TrainData, TrainError, TrainEvent, TrainState, Trainer, TrainerConfig,
};
use ember_sharding::{PlannerOptions, ShardingPlan, Topology};
use ember_sparse::TableOptimizer;

fn plan(devices: usize) -> Option<ShardingPlan> {
    (devices > 1).then(|| {
        let options = PlannerOptions {
            batch_size: 32,
            pooling_factor: 2.0,
            optimizer: TableOptimizer::adam(0.01),
            sharding: Some(ember_sharding::ShardingType::RowWise),
            disk_tier: None,
        };
        let topo = Topology::uniform(devices, 1 << 30);
        ember_sharding::plan(&config().tables, &topo, &options)
            .unwrap()
            .0
    })
}

fn model(seed: u64, devices: usize) -> Dlrm {
    let optimizers = (TableOptimizer::adam(0.01), DenseOptimizerConfig::adam(0.01));
    (Dlrm::builder(config()).optimizers(optimizers.0, optimizers.1))
        .seed(seed)
        .plan(plan(devices))
        .build()
        .unwrap()
}

fn trainer(dir: &Path, max_steps: Option<u64>) -> Trainer {
    let config = TrainerConfig {
        epochs: 2,
        max_steps,
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every: 4,
        eval_every: 5,
        ..TrainerConfig::default()
    };
    Trainer::new(config, Backend::native())
}

/// Trains from `from`, returning each step's loss and the events' kinds.
fn fit(
    trainer: &Trainer,
    model: &mut Dlrm,
    from: TrainState,
) -> (Vec<f32>, Vec<&'static str>, ember_models::TrainSummary) {
    let (train, test) = (batches(0, 6), batches(1 << 40, 2));
    let (mut losses, mut kinds) = (Vec::new(), Vec::new());
    let summary = trainer
        .fit(
            model,
            &train,
            FitOptions {
                eval: Some(&test),
                from,
                on_event: Some(&mut |e: &TrainEvent| {
                    kinds.push(match e {
                        TrainEvent::Start { .. } => "start",
                        TrainEvent::Step { loss, .. } => {
                            losses.push(*loss);
                            "step"
                        }
                        TrainEvent::Eval { .. } => "eval",
                        TrainEvent::Checkpoint { .. } => "checkpoint",
                        _ => "other",
                    })
                }),
            },
        )
        .unwrap();
    (losses, kinds, summary)
}

#[test]
fn a_resumed_run_is_bitwise_the_run_that_never_stopped() {
    for devices in [1, 2] {
        let (whole, parts) = (
            temp_dir("trainer", &format!("whole{devices}")),
            temp_dir("trainer", &format!("parts{devices}")),
        );
        let mut uninterrupted = model(3, devices);
        let (all_losses, _, summary) = fit(
            &trainer(&whole, None),
            &mut uninterrupted,
            TrainState::default(),
        );
        assert_eq!((summary.steps, all_losses.len()), (12, 12));

        // Stopped mid-epoch 1 (step 9, no checkpoint cadence there), then resumed
        // into a model made from another seed: the checkpoint overwrites all.
        let mut first = model(3, devices);
        let (mut losses, _, stopped) =
            fit(&trainer(&parts, Some(9)), &mut first, TrainState::default());
        assert_eq!(
            (
                stopped.steps,
                stopped.state.epoch,
                stopped.state.batches_in_epoch
            ),
            (9, 1, 3)
        );
        drop(first);
        let again = trainer(&parts, None);
        let mut resumed = model(99, devices);
        let from = again.resume(&mut resumed).unwrap();
        assert_eq!(from.steps, 9);
        let (rest, _, end) = fit(&again, &mut resumed, from);
        losses.extend(rest);
        assert_eq!(end.resumed_at_step, 9);
        assert_eq!(losses, all_losses, "{devices} devices");
        assert_eq!(
            weights(&mut resumed),
            weights(&mut uninterrupted),
            "{devices} devices"
        );
        for dir in [whole, parts] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}

#[test]
fn the_pipeline_gives_the_bits_of_the_unpipelined_order() {
    // Local tables (batches taken ahead) and row-wise over 2 and 4 threads
    // (input dists routed ahead too), with evaluations and checkpoints
    // between steps, under every native mode.
    for (devices, mode) in [
        (1, ExecMode::Strict),
        (2, ExecMode::Debug),
        (4, ExecMode::Strict),
    ] {
        let run = |pipeline: bool| {
            let dir = temp_dir("trainer", &format!("pipe{devices}{pipeline}"));
            let mut config = trainer(&dir, None).config().clone();
            (config.pipeline, config.mode) = (pipeline, mode);
            let mut m = model(3, devices);
            let (mut losses, mut routed) = (Vec::new(), Duration::ZERO);
            let (train, test) = (batches(0, 6), batches(1 << 40, 2));
            let summary = Trainer::new(config, Backend::native())
                .fit(
                    &mut m,
                    &train,
                    FitOptions {
                        eval: Some(&test),
                        from: TrainState::default(),
                        on_event: Some(&mut |e: &TrainEvent| {
                            if let TrainEvent::Step {
                                loss, input_dist, ..
                            } = e
                            {
                                losses.push(*loss);
                                routed += *input_dist;
                            }
                        }),
                    },
                )
                .unwrap();
            std::fs::remove_dir_all(dir).unwrap();
            (losses, weights(&mut m), routed, summary)
        };
        let (losses, weights, routed, summary) = run(true);
        let (losses_in_turn, weights_in_turn, routed_in_turn, _) = run(false);
        assert_eq!(losses.len(), 12);
        assert_eq!(losses, losses_in_turn, "{devices} devices");
        assert_eq!(weights, weights_in_turn, "{devices} devices");
        // Sharded, the input dist ran ahead: timed there, not in the step.
        assert_eq!(routed > Duration::ZERO, devices > 1, "{devices} devices");
        assert_eq!(routed_in_turn, Duration::ZERO);
        assert_eq!(summary.input_dist_seconds, routed.as_secs_f64());
        assert!(summary.compute_seconds > 0.0);
    }
}

#[test]
fn events_follow_the_cadences_and_no_position_is_saved_twice() {
    let dir = temp_dir("trainer", "events");
    let (_, kinds, summary) = fit(
        &trainer(&dir, None),
        &mut model(1, 1),
        TrainState::default(),
    );
    let count = |k| kinds.iter().filter(|&&x| x == k).count();
    assert_eq!(kinds[0], "start");
    assert_eq!(count("step"), 12);
    // Every 5 steps (5, 10) and at both epoch ends (6, 12).
    assert_eq!(count("eval"), 4);
    // Every 4 steps (4, 8, 12: the last is also epoch 1's end, saved once) and at epoch 0's end.
    assert_eq!(count("checkpoint"), 4);
    assert_eq!(summary.state.epoch, 2);
    assert!(summary.eval.is_some_and(|m| m.count == 64));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A model whose loss is NaN from the first step.
struct Diverges;

impl Model for Diverges {
    fn train_step(
        &mut self,
        _: &Backend,
        _: &Batch,
        _: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        Ok(StepOutput {
            loss: f32::NAN,
            times: Default::default(),
        })
    }
    fn predict(&mut self, _: &Backend, _: &Batch) -> Result<&[f32], ModelError> {
        Ok(&[])
    }
    fn save_checkpoint(
        &mut self,
        dir: &Path,
        _: Option<&TrainState>,
    ) -> Result<PathBuf, ModelError> {
        Ok(dir.to_path_buf())
    }
    fn load_checkpoint(&mut self, _: &Path) -> Result<Option<TrainState>, ModelError> {
        Ok(None)
    }
}

#[test]
fn bad_runs_fail_with_typed_errors() {
    let trainer = Trainer::new(TrainerConfig::default(), Backend::native());
    let mut ignore = |_: &TrainEvent| {};
    let err = trainer
        .fit(
            &mut Diverges,
            &batches(0, 3),
            FitOptions {
                eval: None,
                from: TrainState::default(),
                on_event: Some(&mut ignore),
            },
        )
        .unwrap_err();
    assert!(
        matches!(err, TrainError::NonFiniteLoss { step: 0, .. }),
        "{err}"
    );
    let empty = InMemory(Vec::new());
    let err = trainer
        .fit(
            &mut Diverges,
            &empty,
            FitOptions {
                eval: None,
                from: TrainState::default(),
                on_event: Some(&mut ignore),
            },
        )
        .unwrap_err();
    assert!(
        matches!(err, TrainError::EmptyEpoch { epoch: 0, .. }),
        "{err}"
    );
    // A mode the backend cannot run is refused before any step.
    let compiled = Trainer::new(
        TrainerConfig {
            mode: ExecMode::Compiled,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let err = compiled
        .fit(
            &mut model(1, 1),
            &batches(0, 1),
            FitOptions {
                eval: None,
                from: TrainState::default(),
                on_event: Some(&mut ignore),
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("pjrt"), "{err}");
    // Resuming on other data than the checkpoint's.
    struct Tagged(SyntheticBatches);
    impl TrainData for Tagged {
        fn batches_per_epoch(&self, e: u64) -> u64 {
            self.0.batches_per_epoch(e)
        }
        fn epoch(
            &self,
            e: u64,
            skip: u64,
        ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_> {
            self.0.epoch(e, skip)
        }
        fn fingerprint(&self) -> u64 {
            42
        }
    }
    let from = TrainState {
        data_fingerprint: 7,
        ..TrainState::default()
    };
    let err = trainer
        .fit(
            &mut model(1, 1),
            &Tagged(batches(0, 1)),
            FitOptions {
                eval: None,
                from,
                on_event: Some(&mut ignore),
            },
        )
        .unwrap_err();
    assert!(matches!(err, TrainError::OtherData), "{err}");
}
