//! Loader flags shared by `train`, `eval`, `predict` and `bench loader`.

use std::path::PathBuf;

use clap::Args;

use ember_dataloader::schema::NUM_INT;
use ember_dataloader::{DenseTransform, IdTransform, Loader, LoaderConfig};

#[derive(Args, Clone, Debug)]
pub struct LoaderArgs {
    /// Dense transform: log1p (dlrm_s_pytorch) or log-plus3 (TorchRec's Parquet path).
    #[arg(long, default_value = "log1p")]
    pub dense_transform: DenseTransform,
    /// Categorical transform: modulo (TorchRec, MLPerf) or hash.
    #[arg(long, default_value = "modulo")]
    pub id_transform: IdTransform,
    /// Parquet decoding threads.
    #[arg(long, default_value_t = 1)]
    pub loader_threads: usize,
    /// Decoded row groups queued ahead, per decoding thread.
    #[arg(long, default_value_t = 2)]
    pub prefetch: usize,
}

impl LoaderArgs {
    /// A loader of the Criteo columns the model's features name, in input
    /// order (no shuffle, nothing dropped).
    pub fn open(
        &self,
        data: &[PathBuf],
        features: &[(String, usize)],
        num_dense: usize,
        batch_size: usize,
    ) -> anyhow::Result<Loader> {
        Ok(Loader::open(
            data,
            self.config(features, num_dense, batch_size)?,
        )?)
    }

    pub fn config(
        &self,
        features: &[(String, usize)],
        num_dense: usize,
        batch_size: usize,
    ) -> anyhow::Result<LoaderConfig> {
        anyhow::ensure!(
            num_dense == NUM_INT,
            "the model takes {num_dense} dense features; the Criteo schema has {NUM_INT}"
        );
        Ok(LoaderConfig {
            dense_transform: self.dense_transform,
            id_transform: self.id_transform,
            threads: self.loader_threads,
            prefetch: self.prefetch,
            ..LoaderConfig::criteo(batch_size, features)
        })
    }
}
