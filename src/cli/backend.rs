//! `--dense-backend native|pjrt`, `--pjrt-plugin` and `--mode`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_dense::pjrt::{default_cache_dir, default_plugin_path};
pub use ember_models::{Backend, ExecMode};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Rust kernels (gemm + rayon).
    Native,
    /// StableHLO compiled by a PJRT plugin.
    Pjrt,
}

/// `--mode` and `--no-pipeline`, for the commands that train.
#[derive(Args, Clone, Debug)]
pub struct ModeArgs {
    /// How the dense step runs: strict (op by op), debug (every step
    /// checked for bad ids and NaN/Inf, naming the op), defer-fuse (the
    /// dense step recorded and run fused) or compiled (the whole dense step
    /// as one executable; parameters stay on the device). defer-fuse and
    /// compiled need `--dense-backend pjrt`.
    #[arg(long, default_value_t = ExecMode::Strict)]
    pub mode: ExecMode,
    /// Take each batch and run its input dist on the training thread, in
    /// turn with the step, instead of one batch ahead on a pipeline thread
    /// (the same results; for measuring the overlap).
    #[arg(long)]
    pub no_pipeline: bool,
}

#[derive(Args, Clone, Debug)]
pub struct PluginArgs {
    /// The PJRT plugin library [default: $EMBER_PJRT_PLUGIN, else where
    /// scripts/fetch-pjrt-plugin.sh puts the CPU plugin].
    #[arg(long)]
    pub pjrt_plugin: Option<PathBuf>,
}

impl PluginArgs {
    pub fn path(&self) -> PathBuf {
        self.pjrt_plugin.clone().unwrap_or_else(default_plugin_path)
    }
}

#[derive(Args, Clone, Debug)]
pub struct BackendArgs {
    /// Where the dense towers run.
    #[arg(long, value_enum, default_value_t = BackendKind::Native)]
    pub dense_backend: BackendKind,
    #[command(flatten)]
    pub plugin: PluginArgs,
    /// Where compiled PJRT executables are kept for later runs [default:
    /// $EMBER_PJRT_CACHE_DIR, else ~/.cache/ember/pjrt/executables].
    #[arg(long)]
    pub compile_cache: Option<PathBuf>,
}

impl BackendArgs {
    /// The backend for `mode`, inside the caller's rayon pool (the native
    /// one sizes itself by it).
    pub fn build(&self, mode: ExecMode) -> anyhow::Result<Backend> {
        anyhow::ensure!(
            !mode.needs_pjrt() || self.dense_backend == BackendKind::Pjrt,
            "--mode {mode} compiles the dense step with PJRT: it needs --dense-backend pjrt"
        );
        Ok(match self.dense_backend {
            BackendKind::Native => Backend::native(),
            BackendKind::Pjrt => {
                let cache = self.compile_cache.clone().unwrap_or_else(default_cache_dir);
                if cache.exists() && !cache.is_dir() {
                    eprintln!(
                        "warning: the compile cache {} is a file, not a directory: compiled \
                         executables are not cached (give --compile-cache a directory)",
                        cache.display()
                    );
                }
                Backend::pjrt(&self.plugin.path(), &cache)?
            }
        })
    }
}
