//! `--dense-backend native|pjrt` and `--pjrt-plugin`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_dense::pjrt::{
    default_cache_dir, default_plugin_path, Client, CompileStats, PjrtBackend, Plugin,
};
use ember_dense::{DenseBackend, NativeBackend};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Rust kernels (gemm + rayon).
    Native,
    /// StableHLO compiled by a PJRT plugin.
    Pjrt,
}

#[derive(Args, Clone, Debug)]
pub struct BackendArgs {
    /// Where the dense towers run.
    #[arg(long, value_enum, default_value_t = BackendKind::Native)]
    pub dense_backend: BackendKind,
    /// The PJRT plugin library [default: $EMBER_PJRT_PLUGIN, else where
    /// scripts/fetch-pjrt-plugin.sh puts the CPU plugin].
    #[arg(long)]
    pub pjrt_plugin: Option<PathBuf>,
    /// Where compiled PJRT executables are kept for later runs [default:
    /// $EMBER_PJRT_CACHE_DIR, else ~/.cache/ember/pjrt/executables].
    #[arg(long)]
    pub compile_cache: Option<PathBuf>,
}

pub enum Backend {
    Native(NativeBackend),
    Pjrt(Box<PjrtBackend>),
}

impl BackendArgs {
    /// The backend, inside the caller's rayon pool (the native one sizes itself by it).
    pub fn build(&self) -> anyhow::Result<Backend> {
        Ok(match self.dense_backend {
            BackendKind::Native => {
                Backend::Native(NativeBackend::new(rayon::current_num_threads()))
            }
            BackendKind::Pjrt => {
                let path = self.pjrt_plugin.clone().unwrap_or_else(default_plugin_path);
                let client = Client::new(Plugin::load(&path)?)?;
                let cache = self.compile_cache.clone().unwrap_or_else(default_cache_dir);
                Backend::Pjrt(Box::new(PjrtBackend::with_disk_cache(client, cache)))
            }
        })
    }
}

impl Backend {
    pub fn dense(&self) -> &dyn DenseBackend<f32> {
        match self {
            Backend::Native(b) => b,
            Backend::Pjrt(b) => b.as_ref(),
        }
    }

    pub fn name(&self) -> &'static str {
        self.dense().name()
    }

    /// Compilations so far (PJRT only).
    pub fn compile_stats(&self) -> Option<CompileStats> {
        match self {
            Backend::Native(_) => None,
            Backend::Pjrt(b) => Some(b.stats()),
        }
    }
}
