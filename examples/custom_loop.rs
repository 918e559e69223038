//! A training loop of the user's own over Ember's step API: a DLRM whose
//! tables the planner shards over 2 in-process devices, fed from the user's
//! own iterator (no Parquet), checkpointed halfway, and resumed from the
//! checkpoint into a second model, which then takes exactly the same steps.
//!
//! `cargo run --release --example custom_loop`

use ember::prelude::*;
use ember::sparse::rng::Rng;

const STEPS: u64 = 20;
const BATCH: usize = 256;

/// The user's own data: 4 dense features and 3 categorical ones, with a
/// click when the first dense feature and the first id agree.
fn my_batches(seed: u64) -> impl Iterator<Item = Batch> {
    let mut rng = Rng::new(seed);
    std::iter::repeat_with(move || {
        let dense: Vec<f32> = (0..BATCH * 4).map(|_| rng.next_f32()).collect();
        let keys: Vec<String> = (0..3).map(|i| format!("cat_{i}")).collect();
        let values: Vec<i64> = (0..3 * BATCH).map(|_| rng.below(1000) as i64).collect();
        let labels = (0..BATCH)
            .map(|s| ((dense[4 * s] > 0.5) == (values[s] < 500)) as u8 as f32)
            .collect();
        Batch {
            dense: Tensor::from_vec(BATCH, 4, dense).expect("4 columns"),
            sparse: KeyedJaggedTensor::from_lengths(keys, values, &[1; 3 * BATCH], None)
                .expect("one id per bag"),
            labels,
        }
    })
}

fn config() -> DlrmConfig {
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[1000, 1000, 1000], 8),
        bottom_mlp: vec![4, 16, 8],
        top_mlp: vec![16, 1],
        interaction: InteractionType::Dot,
    }
}

/// The model sharded over 2 devices by the planner.
fn sharded_model() -> Result<Dlrm, ModelError> {
    (Dlrm::builder(config()).seed(7))
        .optimizers(
            TableOptimizer::rowwise_adagrad(0.05),
            DenseOptimizerConfig::adagrad(0.05),
        )
        .shard_over(2)
        .build()
}

/// Runs the loop: steps `0..STEPS`, a checkpoint at the half; then a new
/// model resumed from it takes the second half again. Returns both halves'
/// losses.
fn run(dir: &std::path::Path) -> Result<(Vec<f32>, Vec<f32>), Box<dyn std::error::Error>> {
    let backend = Backend::native();
    let mut model = sharded_model()?;
    let mut losses = Vec::new();
    let mut checkpoint = None;
    for (step, batch) in (0..STEPS).zip(my_batches(1)) {
        if step == STEPS / 2 {
            let state = TrainState {
                steps: step,
                ..TrainState::default()
            };
            checkpoint = Some(model.save_checkpoint(dir, Some(&state))?);
        }
        losses.push(model.train_step(&backend, &batch, ExecMode::Strict)?.loss);
    }
    // A second process would start here: a model of the same plan, loaded.
    let mut resumed = sharded_model()?;
    let state = resumed
        .load_checkpoint(&checkpoint.expect("saved at the half"))?
        .unwrap_or_default();
    let mut again = Vec::new();
    for batch in my_batches(1)
        .skip(state.steps as usize)
        .take((STEPS - state.steps) as usize)
    {
        again.push(resumed.train_step(&backend, &batch, ExecMode::Strict)?.loss);
    }
    Ok((losses[(STEPS / 2) as usize..].to_vec(), again))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("ember-custom-loop-{}", std::process::id()));
    let (first, resumed) = run(&dir)?;
    std::fs::remove_dir_all(&dir)?;
    println!("steps {}..{STEPS}, uninterrupted: {first:?}", STEPS / 2);
    println!("steps {}..{STEPS}, resumed:       {resumed:?}", STEPS / 2);
    println!("bitwise equal: {}", first == resumed);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn resumed_run_takes_the_same_steps() {
        let dir =
            std::env::temp_dir().join(format!("ember-custom-loop-test-{}", std::process::id()));
        let (first, resumed) = super::run(&dir).expect("runs");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(first.len(), 10);
        assert_eq!(first, resumed);
    }
}
