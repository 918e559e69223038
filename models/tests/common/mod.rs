//! What the Trainer's tests share: a small DLRM, its learnable batches,
//! every weight of a model, a fresh temporary directory.

#![allow(dead_code)]

use std::path::PathBuf;

use ember_dense::HasParams;
use ember_models::{
    DataGeneration, Dlrm, DlrmConfig, InteractionType, SyntheticBatches, SyntheticConfig,
    SyntheticData,
};

/// Three small tables, a dot interaction.
pub fn config() -> DlrmConfig {
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[50, 80, 30], 4),
        bottom_mlp: vec![3, 8, 4],
        top_mlp: vec![6, 1],
        interaction: InteractionType::Dot,
    }
}

/// `batches` learnable batches of 32 for [`config`], from batch `first`.
pub fn batches(first: u64, batches: u64) -> SyntheticBatches {
    let data = SyntheticConfig::for_model(&config(), DataGeneration::Learnable, 3, 5);
    SyntheticBatches {
        data: SyntheticData::new(data).unwrap(),
        first,
        batches,
        size: 32,
        rank: 0,
        world_size: 1,
    }
}

/// Every table weight and optimizer state, then every dense weight.
pub fn weights(model: &mut Dlrm) -> Vec<f32> {
    let mut all: Vec<f32> = (model.sparse_arch().unsharded().unwrap().tables().iter())
        .flat_map(|t| t.weights().iter().chain(t.optimizer_state()).copied())
        .collect();
    for p in model.dense_arch_mut().params() {
        all.extend_from_slice(p.value);
    }
    all
}

/// `ember-<test>-<name>-<pid>` under the temporary directory, absent.
pub fn temp_dir(test: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-{test}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
