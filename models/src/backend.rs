//! Where the dense side runs ([`Backend`]) and how a training step runs on
//! it ([`ExecMode`]).

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use ember_dense::pjrt::{CompileStats, PjrtBackend, PjrtError};
use ember_dense::{DenseBackend, NativeBackend};
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// How the dense part of a training step runs (TorchTPU's eager modes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExecMode {
    /// Op by op, in program order (each PJRT op compiled once per shape).
    #[default]
    Strict,
    /// Synchronous, and every step checked before its update: ids against
    /// their tables, and the pooled embeddings, each layer's output, the loss
    /// and every gradient for NaN and infinity; the first failure names the
    /// table or layer, the sample and the value.
    Debug,
    /// Each step's dense forward, loss and backward recorded as one window of
    /// ops, which PJRT compiles (once per shape) and runs fused.
    DeferFuse,
    /// The whole dense step (forward, backward, update) as one PJRT
    /// executable; parameters stay on the device between steps.
    Compiled,
}

impl ExecMode {
    /// Every mode, in the order the CLI lists them.
    pub const ALL: [ExecMode; 4] = [
        ExecMode::Strict,
        ExecMode::Debug,
        ExecMode::DeferFuse,
        ExecMode::Compiled,
    ];

    /// The mode's name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            ExecMode::Strict => "strict",
            ExecMode::Debug => "debug",
            ExecMode::DeferFuse => "defer-fuse",
            ExecMode::Compiled => "compiled",
        }
    }

    /// The mode compiles dense work with PJRT, so it needs the PJRT backend.
    pub fn needs_pjrt(self) -> bool {
        matches!(self, ExecMode::DeferFuse | ExecMode::Compiled)
    }
}

impl fmt::Display for ExecMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ExecMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        (Self::ALL.into_iter().find(|m| m.name() == s)).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|m| m.name()).collect();
            format!("'{s}' is not a mode (one of {})", names.join(", "))
        })
    }
}

/// The dense backend a model trains on: native Rust kernels, or PJRT.
pub enum Backend {
    /// Rust kernels (gemm + rayon).
    Native(NativeBackend),
    /// StableHLO compiled by a PJRT plugin; shared, since a compiled step
    /// keeps a handle to it.
    Pjrt(Arc<PjrtBackend>),
}

impl Backend {
    /// The native backend, sized by the calling thread's rayon pool.
    pub fn native() -> Self {
        Backend::Native(NativeBackend::new(rayon::current_num_threads()))
    }

    /// The PJRT backend on the plugin at `plugin`, keeping compiled
    /// executables in `cache_dir` for later runs.
    pub fn pjrt(plugin: &Path, cache_dir: &Path) -> Result<Self, ModelError> {
        let client = ember_dense::pjrt::Client::new(ember_dense::pjrt::Plugin::load(plugin)?)?;
        Ok(Backend::Pjrt(Arc::new(PjrtBackend::with_disk_cache(
            client,
            cache_dir.to_path_buf(),
        ))))
    }

    /// The backend's dense ops.
    pub fn dense(&self) -> &dyn DenseBackend<f32> {
        match self {
            Backend::Native(b) => b,
            Backend::Pjrt(b) => b.as_ref(),
        }
    }

    /// `native` or `pjrt`.
    pub fn name(&self) -> &'static str {
        self.dense().name()
    }

    /// The PJRT backend, when this is it.
    pub fn pjrt_backend(&self) -> Option<&Arc<PjrtBackend>> {
        match self {
            Backend::Native(_) => None,
            Backend::Pjrt(b) => Some(b),
        }
    }

    /// Compilations so far (PJRT only).
    pub fn compile_stats(&self) -> Option<CompileStats> {
        self.pjrt_backend().map(|b| b.stats())
    }

    /// Refuses a mode this backend cannot run.
    pub fn check_mode(&self, mode: ExecMode) -> Result<(), ModelError> {
        match mode.needs_pjrt() && self.pjrt_backend().is_none() {
            true => Err(crate::Unsupported::ModeNeedsPjrt(mode).into()),
            false => Ok(()),
        }
    }
}

impl From<PjrtError> for ModelError {
    fn from(e: PjrtError) -> Self {
        ModelError::Pjrt(Box::new(e))
    }
}
