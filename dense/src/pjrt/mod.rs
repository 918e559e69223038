//! PJRT: XLA plugins loaded at run time through the PJRT C API. A plugin
//! (`xla_cpu_pjrt.so` here, a CUDA or TPU one elsewhere) compiles StableHLO
//! text into executables and runs them on its devices.
//!
//! - `ffi`: the hand-written `repr(C)` declarations of the C API subset.
//! - `runtime`: safe wrappers: [`Plugin`], [`Client`], [`Executable`], [`DeviceBuffer`].
//! - `hlo`: StableHLO text for each dense op; `backend`: [`PjrtBackend`], the
//!   [`DenseBackend`](crate::DenseBackend) that runs them.

mod backend;
mod cache;
mod ffi;
// StableHLO text and its lowering are how ember-models compiles a whole
// step; they are not an API of their own and may change with it.
#[doc(hidden)]
pub mod hlo;
#[doc(hidden)]
pub mod lower;
mod runtime;
mod window;

pub use backend::{CompileStats, PjrtBackend};
pub use cache::default_cache_dir;
pub use runtime::{
    default_plugin_path, plugin_for_tests, Client, DeviceBuffer, DeviceInfo, Executable, PjrtError,
    Plugin,
};
