//! Property-based fuzzing of the checkpoint reader on mutated safetensors
//! files: no panic, and either a clean error or a model that predicts
//! exactly as the saved one (every tensor's bytes carry a checksum, so a
//! flip that loads can only have hit bytes no reader uses).
//!
//! `EMBER_FUZZ_CASES=N` runs N cases (the CHANGELOG reports a long run).

use ember_models::{Backend, ExecMode, Model};
use std::sync::OnceLock;

use ember_dense::{DenseOptimizerConfig, NativeBackend};
use ember_models::checkpoint::save;
use ember_models::{
    Batch, Checkpoint, DataGeneration, Dlrm, DlrmConfig, InteractionType, SyntheticConfig,
    SyntheticData,
};
use ember_sparse::TableOptimizer;
use proptest::prelude::*;

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("EMBER_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    ProptestConfig::with_cases(n.unwrap_or(default))
}

/// A trained model's checkpoint bytes, a batch, and its predictions.
fn fixture() -> &'static (Vec<u8>, Batch, Vec<f32>) {
    static FIXTURE: OnceLock<(Vec<u8>, Batch, Vec<f32>)> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let config = DlrmConfig {
            tables: DlrmConfig::criteo_tables(&[7, 5, 9], 4),
            bottom_mlp: vec![3, 5, 4],
            top_mlp: vec![4, 1],
            interaction: InteractionType::Dot,
        };
        let be = Backend::Native(NativeBackend::new(1));
        let optimizers = (
            TableOptimizer::rowwise_adagrad(0.1),
            DenseOptimizerConfig::adam(0.01),
        );
        let mut model = Dlrm::builder(config.clone())
            .optimizers(optimizers.0, optimizers.1)
            .seed(5)
            .build()
            .unwrap();
        let data = SyntheticData::new(SyntheticConfig::for_model(
            &config,
            DataGeneration::Learnable,
            2,
            1,
        ))
        .unwrap();
        for i in 0..3 {
            model
                .train_step(&be, &data.batch(i, 8), ExecMode::Strict)
                .unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        save(&mut model, &path, None).unwrap();
        let batch = data.batch(9, 16);
        let want = model.predict(&be, &batch).unwrap().to_vec();
        (std::fs::read(&path).unwrap(), batch, want)
    })
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn mutated_checkpoints_are_refused_or_predict_as_saved(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..4),
        cut in proptest::option::weighted(0.1, any::<prop::sample::Index>()),
        in_header in any::<bool>(),
    ) {
        let (good, batch, want) = fixture();
        let mut bytes = good.clone();
        // Half the cases hit the JSON header, where the parser is.
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let span = if in_header { header.min(bytes.len()) } else { bytes.len() };
        for (at, x) in flips {
            bytes[at.index(span)] ^= x;
        }
        if let Some(c) = cut {
            bytes.truncate(c.index(bytes.len()));
        }
        let loaded = std::panic::catch_unwind(|| {
            let ckpt = Checkpoint::from_bytes(bytes, "fuzzed")?;
            let mut model = ckpt.builder().optimizers(TableOptimizer::rowwise_adagrad(0.1), DenseOptimizerConfig::adam(0.01)).build()?;
            model.predict(&Backend::Native(NativeBackend::new(1)), batch).map(|p| p.to_vec())
        });
        prop_assert!(loaded.is_ok(), "the reader panicked");
        match loaded.unwrap() {
            Ok(got) => prop_assert_eq!(&got, want),
            Err(e) => prop_assert!(e.to_string().contains("fuzzed"), "{}", e),
        }
    }
}
