//! PJRT: XLA plugins loaded at run time through the PJRT C API. A plugin
//! (`xla_cpu_pjrt.so` here, a CUDA or TPU one elsewhere) compiles StableHLO
//! text into executables and runs them on its devices.
//!
//! - [`ffi`]: the hand-written `repr(C)` declarations of the C API subset.
//! - [`runtime`]: safe wrappers: [`Plugin`], [`Client`], [`Executable`], [`DeviceBuffer`].

pub mod ffi;
mod runtime;

pub use runtime::{
    default_plugin_path, Client, DeviceBuffer, DeviceInfo, Executable, PjrtError, Plugin,
};
