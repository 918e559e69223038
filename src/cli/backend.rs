//! `--dense-backend native|pjrt` and `--pjrt-plugin`.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use serde::Serialize;

use ember_dense::pjrt::{
    default_cache_dir, default_plugin_path, Client, CompileStats, PjrtBackend, Plugin,
};
use ember_dense::{DenseBackend, NativeBackend};
use ember_models::{Batch, CompiledDenseStep, Dlrm, StepOutput};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Rust kernels (gemm + rayon).
    Native,
    /// StableHLO compiled by a PJRT plugin.
    Pjrt,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecMode {
    /// Op by op, in program order (each PJRT op compiled once per shape).
    Strict,
    /// Synchronous, and every step checked before its update: ids against
    /// their tables, and the pooled embeddings, each layer's output, the loss
    /// and every gradient for NaN and infinity; the first failure names the
    /// table or layer, the sample and the value.
    Debug,
    /// Each step's dense forward, loss and backward recorded as one window
    /// of ops, which PJRT compiles (once per shape) and runs fused; the
    /// parameters go to the device and the results come back every step.
    #[serde(rename = "defer-fuse")]
    DeferFuse,
    /// The whole dense step (forward, backward, update) as one PJRT
    /// executable; parameters stay on the device between steps.
    Compiled,
}

/// `--mode`, for the commands that train.
#[derive(Args, Clone, Debug)]
pub struct ModeArgs {
    /// How the dense step runs (`compiled` needs `--dense-backend pjrt`).
    #[arg(long, value_enum, default_value_t = ExecMode::Strict)]
    pub mode: ExecMode,
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

pub enum Backend {
    Native(NativeBackend),
    Pjrt(Arc<PjrtBackend>),
}

impl BackendArgs {
    /// The backend for `mode`, inside the caller's rayon pool (the native
    /// one sizes itself by it).
    pub fn build(&self, mode: ExecMode) -> anyhow::Result<Backend> {
        anyhow::ensure!(
            !matches!(mode, ExecMode::Compiled | ExecMode::DeferFuse)
                || self.dense_backend == BackendKind::Pjrt,
            "--mode {} compiles the dense step with PJRT: it needs --dense-backend pjrt",
            mode.to_possible_value()
                .expect("no skipped modes")
                .get_name()
        );
        Ok(match self.dense_backend {
            BackendKind::Native => {
                Backend::Native(NativeBackend::new(rayon::current_num_threads()))
            }
            BackendKind::Pjrt => {
                let client = Client::new(Plugin::load(&self.plugin.path())?)?;
                let cache = self.compile_cache.clone().unwrap_or_else(default_cache_dir);
                Backend::Pjrt(Arc::new(PjrtBackend::with_disk_cache(client, cache)))
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

/// Runs training steps in the chosen mode. In `compiled` mode the dense
/// parameters live on the device; [`Stepper::sync`] brings them back before
/// the host reads them (evaluation, prediction, checkpoints).
pub struct Stepper {
    mode: ExecMode,
    compiled: Option<CompiledDenseStep>,
}

impl Stepper {
    pub fn new(mode: ExecMode) -> Self {
        Self {
            mode,
            compiled: None,
        }
    }

    pub fn step(
        &mut self,
        backend: &Backend,
        model: &mut Dlrm,
        batch: &Batch,
    ) -> anyhow::Result<StepOutput> {
        match (self.mode, backend) {
            (ExecMode::Compiled, Backend::Pjrt(pjrt)) => {
                // One executable per batch size: a short last batch gets its own.
                if self.compiled.as_ref().map(|s| s.batch_size()) != Some(batch.size()) {
                    self.sync(model)?;
                    self.compiled =
                        Some(CompiledDenseStep::new(pjrt.clone(), model, batch.size())?);
                }
                let step = self.compiled.as_mut().expect("made above");
                Ok(model.train_step_compiled(step, batch)?)
            }
            (ExecMode::Debug, _) => Ok(model.train_step_checked(backend.dense(), batch)?),
            (ExecMode::DeferFuse, _) => Ok(model.train_step_fused(backend.dense(), batch)?),
            _ => Ok(model.train_step(backend.dense(), batch)?),
        }
    }

    /// Brings the device's dense parameters and optimizer state to the host model.
    pub fn sync(&mut self, model: &mut Dlrm) -> anyhow::Result<()> {
        if let Some(step) = &mut self.compiled {
            step.sync_to_host(model)?;
        }
        Ok(())
    }
}
