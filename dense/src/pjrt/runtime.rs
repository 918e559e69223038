//! Safe wrappers over the PJRT C API. Every call goes through one helper
//! that turns a returned `PJRT_Error` into a [`PjrtError`] with the plugin's
//! message, so no error is dropped and none leaks.

// Argument structs are filled field by field after `default()` (which sets
// `struct_size`), as the C API's documentation fills them.
#![allow(clippy::field_reassign_with_default)]

use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thiserror::Error;

use super::ffi::{self, index};

/// What went wrong with a PJRT plugin: loading it, its API version, or one of its calls
/// (with the plugin's own message).
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PjrtError {
    /// [`Plugin::load`] could not load the file: it is missing, `dlopen` failed, it has no
    /// `GetPjrtApi` symbol, or its API table is shorter than the bindings need.
    #[error("PJRT plugin {}: {message}", path.display())]
    Load {
        /// The plugin file.
        path: PathBuf,
        /// Why (the `dlerror` text, or what was wrong with the file).
        message: String,
    },
    /// [`Plugin::load`] found a C API version the bindings do not take: a major other than
    /// theirs (0), or a minor above theirs (81).
    #[error("PJRT plugin {} has C API {major}.{minor}; Ember's bindings are {}.{} and take plugins of API {}.x up to .{}, the versions they were checked against", path.display(), ffi::API_MAJOR, ffi::API_MINOR, ffi::API_MAJOR, ffi::API_MINOR)]
    Version {
        /// The plugin file.
        path: PathBuf,
        /// The plugin's C API major version.
        major: i32,
        /// The plugin's C API minor version.
        minor: i32,
    },
    /// A C API function returned an error, or the plugin does not implement it, or Ember
    /// refused the arguments before calling (e.g. a host buffer of the wrong length).
    #[error("PJRT {call}: {message}")]
    Call {
        /// The C API function, e.g. `"PJRT_Client_Compile"`.
        call: &'static str,
        /// The plugin's error message (or Ember's, for refused arguments).
        message: String,
    },
}

/// Where the fetch script puts the CPU plugin, unless `EMBER_PJRT_PLUGIN` says otherwise:
/// `$EMBER_PJRT_HOME` or `$XDG_CACHE_HOME/ember/pjrt` or `~/.cache/ember/pjrt`,
/// then `xla-cpu-pjrt-0.0.1/xla_cpu_pjrt.so`.
pub fn default_plugin_path() -> PathBuf {
    if let Some(p) = std::env::var_os("EMBER_PJRT_PLUGIN") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("EMBER_PJRT_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(super::cache::ember_pjrt_cache);
    home.join("xla-cpu-pjrt-0.0.1").join("xla_cpu_pjrt.so")
}

/// The plugin the test suites run against: the default one, when it is
/// there. Without it they skip, except under `EMBER_REQUIRE_PJRT` (set by
/// CI), where a missing plugin is a failure (a panic, as tests want).
#[doc(hidden)]
pub fn plugin_for_tests() -> Option<PathBuf> {
    let path = default_plugin_path();
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("EMBER_REQUIRE_PJRT").is_none(),
        "EMBER_REQUIRE_PJRT is set but there is no PJRT plugin at {}",
        path.display()
    );
    eprintln!(
        "skipping: no PJRT plugin at {} (run scripts/fetch-pjrt-plugin.sh)",
        path.display()
    );
    None
}

/// Plugins loaded so far, by canonical path.
type Loaded = Vec<(PathBuf, Arc<Plugin>)>;

/// A loaded plugin. It stays loaded for the life of the process: plugins
/// keep threads and global state that do not survive `dlclose`.
pub struct Plugin {
    path: PathBuf,
    api: *const ffi::Api,
    version: (i32, i32),
}

// SAFETY: the API table is immutable after loading and PJRT functions are
// thread-safe (the C API's contract).
unsafe impl Send for Plugin {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl Sync for Plugin {}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: dlerror returned a non-null pointer to a NUL-terminated
        // message, valid until the next dl call of this thread (below, none).
        unsafe { std::ffi::CStr::from_ptr(e) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Copies a (pointer, length) string the plugin owns.
fn c_str(ptr: *const std::ffi::c_char, len: usize) -> String {
    String::from_utf8_lossy(c_bytes(ptr, len)).into_owned()
}

/// The (pointer, length) bytes the plugin owns, borrowed.
fn c_bytes<'a>(ptr: *const std::ffi::c_char, len: usize) -> &'a [u8] {
    if ptr.is_null() {
        return &[];
    }
    // SAFETY: the plugin returns `len` valid bytes at `ptr`, alive while the
    // caller reads them.
    unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) }
}

impl Plugin {
    /// Loads the plugin at `path`, checks its API version and initialises
    /// it, once per process: later loads of the same file share it.
    pub fn load(path: &Path) -> Result<Arc<Plugin>, PjrtError> {
        static LOADED: std::sync::OnceLock<std::sync::Mutex<Loaded>> = std::sync::OnceLock::new();
        let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let loaded = LOADED.get_or_init(Default::default);
        let mut loaded = loaded.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, p)) = loaded.iter().find(|(k, _)| *k == key) {
            return Ok(p.clone());
        }
        let plugin = Self::load_new(path)?;
        loaded.push((key, plugin.clone()));
        Ok(plugin)
    }

    fn load_new(path: &Path) -> Result<Arc<Plugin>, PjrtError> {
        let load_err = |message: String| PjrtError::Load {
            path: path.to_path_buf(),
            message,
        };
        if !path.is_file() {
            return Err(load_err(
                "no such file (run scripts/fetch-pjrt-plugin.sh, or set --pjrt-plugin or EMBER_PJRT_PLUGIN)".into(),
            ));
        }
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| load_err("path contains a NUL byte".into()))?;
        // SAFETY: dlopen of a path; RTLD_LOCAL keeps the plugin's symbols to itself.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(load_err(dl_error()));
        }
        // SAFETY: a symbol lookup on a live handle.
        let sym = unsafe { libc::dlsym(handle, c"GetPjrtApi".as_ptr()) };
        if sym.is_null() {
            return Err(load_err(
                "not a PJRT plugin: it has no GetPjrtApi symbol".into(),
            ));
        }
        // SAFETY: GetPjrtApi is `const PJRT_Api* GetPjrtApi(void)`.
        let get: unsafe extern "C" fn() -> *const ffi::Api = unsafe { std::mem::transmute(sym) };
        // SAFETY: `get` is the plugin's GetPjrtApi, which takes nothing.
        let api = unsafe { get() };
        if api.is_null() {
            return Err(load_err("GetPjrtApi returned null".into()));
        }
        // SAFETY: the plugin returned a valid API table.
        let (size, major, minor) = unsafe {
            (
                (*api).struct_size,
                (*api).pjrt_api_version.major_version,
                (*api).pjrt_api_version.minor_version,
            )
        };
        if major != ffi::API_MAJOR || minor > ffi::API_MINOR {
            return Err(PjrtError::Version {
                path: path.to_path_buf(),
                major,
                minor,
            });
        }
        let needed =
            std::mem::size_of::<ffi::Api>() + index::USED * std::mem::size_of::<*const c_void>();
        if size < needed {
            return Err(load_err(format!(
                "its API table has {size} bytes, fewer than the {needed} these bindings use"
            )));
        }
        let plugin = Plugin {
            path: path.to_path_buf(),
            api,
            version: (major, minor),
        };
        let mut args = ffi::PluginInitializeArgs::default();
        plugin.call(
            index::PLUGIN_INITIALIZE,
            "PJRT_Plugin_Initialize",
            &mut args,
        )?;
        Ok(Arc::new(plugin))
    }

    /// The file the plugin was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The plugin's C API version (major, minor).
    pub fn api_version(&self) -> (i32, i32) {
        self.version
    }

    fn function(&self, i: usize) -> *const c_void {
        // SAFETY: `load` checked that the table reaches past every index used.
        unsafe { *(*self.api).functions.as_ptr().add(i) }
    }

    /// Calls API function `i` with `args`; a returned error becomes a [`PjrtError`].
    pub(crate) fn call<A>(
        &self,
        i: usize,
        name: &'static str,
        args: &mut A,
    ) -> Result<(), PjrtError> {
        let f = self.function(i);
        if f.is_null() {
            return Err(PjrtError::Call {
                call: name,
                message: "the plugin does not implement it".into(),
            });
        }
        // SAFETY: every PJRT API function takes one pointer to its args
        // struct (declared in ffi with the header's layout) and returns a
        // PJRT_Error* (null on success).
        let f: ffi::ErrorFn = unsafe { std::mem::transmute(f) };
        // SAFETY: `f` has that signature (above), and `args` is a live
        // args struct of its function, borrowed exclusively for the call.
        let error = unsafe { f((args as *mut A).cast()) };
        if error.is_null() {
            Ok(())
        } else {
            Err(PjrtError::Call {
                call: name,
                message: self.take_error(error),
            })
        }
    }

    /// The message of `error`, which is destroyed.
    fn take_error(&self, error: *mut ffi::Error) -> String {
        let mut m = ffi::ErrorMessageArgs::default();
        m.error = error;
        // SAFETY: Error_Message and Error_Destroy take their args and return nothing.
        let message_fn: ffi::VoidFn =
            unsafe { std::mem::transmute(self.function(index::ERROR_MESSAGE)) };
        // SAFETY: Error_Message's args: `m`, live, holding a live error.
        unsafe { message_fn((&mut m as *mut ffi::ErrorMessageArgs).cast()) };
        let message = c_str(m.message, m.message_size);
        let mut d = ffi::ErrorDestroyArgs::default();
        d.error = error;
        // SAFETY: as Error_Message's, above.
        let destroy_fn: ffi::VoidFn =
            unsafe { std::mem::transmute(self.function(index::ERROR_DESTROY)) };
        // SAFETY: Error_Destroy's args: `d`, holding the error this call
        // owns, destroyed once (its message was copied out above).
        unsafe { destroy_fn((&mut d as *mut ffi::ErrorDestroyArgs).cast()) };
        message
    }

    /// Waits for `event` and destroys it.
    fn await_event(&self, event: *mut ffi::Event, what: &'static str) -> Result<(), PjrtError> {
        if event.is_null() {
            return Ok(());
        }
        let mut a = ffi::EventAwaitArgs::default();
        a.event = event;
        let waited = self.call(index::EVENT_AWAIT, what, &mut a);
        let mut d = ffi::EventDestroyArgs::default();
        d.event = event;
        let destroyed = self.call(index::EVENT_DESTROY, "PJRT_Event_Destroy", &mut d);
        waited.and(destroyed)
    }
}

/// One addressable device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// The device's id (`PJRT_DeviceDescription_Id`).
    pub id: i32,
    /// The device kind as the plugin names it (`PJRT_DeviceDescription_Kind`).
    pub kind: String,
}

/// The client handle, shared by everything made from it: executables and
/// buffers keep it (and so the plugin) alive, so the client is destroyed
/// only after the last of them.
pub(crate) struct ClientHandle {
    plugin: Arc<Plugin>,
    raw: *mut ffi::Client,
}

// SAFETY: PJRT clients are thread-safe (the C API's contract).
unsafe impl Send for ClientHandle {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl Sync for ClientHandle {}

impl std::ops::Deref for ClientHandle {
    type Target = Plugin;
    fn deref(&self) -> &Plugin {
        &self.plugin
    }
}

impl Drop for ClientHandle {
    fn drop(&mut self) {
        let mut a = ffi::ClientDestroyArgs::default();
        a.client = self.raw;
        let _ = self
            .plugin
            .call(index::CLIENT_DESTROY, "PJRT_Client_Destroy", &mut a);
    }
}

/// A PJRT client: the plugin's devices, compilation and buffers.
pub struct Client {
    handle: Arc<ClientHandle>,
    devices: Vec<*mut ffi::Device>,
}

// SAFETY: PJRT clients are thread-safe (the C API's contract).
unsafe impl Send for Client {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl Sync for Client {}

impl Client {
    /// Creates a client of `plugin` with default options and lists its addressable devices;
    /// fails when there are none.
    pub fn new(plugin: Arc<Plugin>) -> Result<Self, PjrtError> {
        let mut a = ffi::ClientCreateArgs::default();
        plugin.call(index::CLIENT_CREATE, "PJRT_Client_Create", &mut a)?;
        let handle = Arc::new(ClientHandle {
            plugin,
            raw: a.client,
        });
        let mut client = Client {
            handle,
            devices: Vec::new(),
        };
        let mut d = ffi::ClientAddressableDevicesArgs::default();
        d.client = client.handle.raw;
        client.handle.call(
            index::CLIENT_ADDRESSABLE_DEVICES,
            "PJRT_Client_AddressableDevices",
            &mut d,
        )?;
        if d.num_addressable_devices == 0 || d.addressable_devices.is_null() {
            return Err(PjrtError::Call {
                call: "PJRT_Client_AddressableDevices",
                message: "the client has no devices".into(),
            });
        }
        // SAFETY: the plugin returned this many device pointers.
        client.devices =
            unsafe { std::slice::from_raw_parts(d.addressable_devices, d.num_addressable_devices) }
                .to_vec();
        Ok(client)
    }

    /// The plugin this client belongs to.
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.handle.plugin
    }

    /// The platform's name (`PJRT_Client_PlatformName`, e.g. `cpu`).
    pub fn platform_name(&self) -> Result<String, PjrtError> {
        let mut a = ffi::ClientPlatformNameArgs::default();
        a.client = self.handle.raw;
        self.handle.call(
            index::CLIENT_PLATFORM_NAME,
            "PJRT_Client_PlatformName",
            &mut a,
        )?;
        Ok(c_str(a.platform_name, a.platform_name_size))
    }

    /// The platform's version text (`PJRT_Client_PlatformVersion`); part of the disk cache's
    /// key, since it changes the compiled code.
    pub fn platform_version(&self) -> Result<String, PjrtError> {
        let mut a = ffi::ClientPlatformVersionArgs::default();
        a.client = self.handle.raw;
        self.handle.call(
            index::CLIENT_PLATFORM_VERSION,
            "PJRT_Client_PlatformVersion",
            &mut a,
        )?;
        Ok(c_str(a.platform_version, a.platform_version_size))
    }

    /// Id and kind of every addressable device, in the plugin's order. Buffers and
    /// executions use the first one.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, PjrtError> {
        self.devices
            .iter()
            .map(|&device| {
                let mut g = ffi::DeviceGetDescriptionArgs::default();
                g.device = device;
                self.handle.call(
                    index::DEVICE_GET_DESCRIPTION,
                    "PJRT_Device_GetDescription",
                    &mut g,
                )?;
                let mut id = ffi::DeviceDescriptionIdArgs::default();
                id.device_description = g.device_description;
                self.handle.call(
                    index::DEVICE_DESCRIPTION_ID,
                    "PJRT_DeviceDescription_Id",
                    &mut id,
                )?;
                let mut kind = ffi::DeviceDescriptionKindArgs::default();
                kind.device_description = g.device_description;
                self.handle.call(
                    index::DEVICE_DESCRIPTION_KIND,
                    "PJRT_DeviceDescription_Kind",
                    &mut kind,
                )?;
                Ok(DeviceInfo {
                    id: id.id,
                    kind: c_str(kind.device_kind, kind.device_kind_size),
                })
            })
            .collect()
    }

    /// Compiles StableHLO (MLIR text) for one device.
    pub fn compile(&self, stablehlo: &str) -> Result<Executable, PjrtError> {
        let mut program = ffi::Program::default();
        program.code = stablehlo.as_ptr().cast();
        program.code_size = stablehlo.len();
        program.format = c"mlir".as_ptr();
        program.format_size = 4;
        let options = COMPILE_OPTIONS;
        let mut a = ffi::ClientCompileArgs::default();
        a.client = self.handle.raw;
        a.program = &program;
        a.compile_options = options.as_ptr().cast();
        a.compile_options_size = options.len();
        self.handle
            .call(index::CLIENT_COMPILE, "PJRT_Client_Compile", &mut a)?;
        Executable::wrap(self.handle.clone(), a.executable)
    }

    /// Loads an executable serialized by [`Executable::serialize`] with the same plugin.
    pub fn deserialize(&self, bytes: &[u8]) -> Result<Executable, PjrtError> {
        let mut a = ffi::ExecutableDeserializeAndLoadArgs::default();
        a.client = self.handle.raw;
        a.serialized_executable = bytes.as_ptr().cast();
        a.serialized_executable_size = bytes.len();
        self.handle.call(
            index::EXECUTABLE_DESERIALIZE_AND_LOAD,
            "PJRT_Executable_DeserializeAndLoad",
            &mut a,
        )?;
        Executable::wrap(self.handle.clone(), a.loaded_executable)
    }

    /// Copies a row-major f32 array of shape `dims` to device 0.
    pub fn buffer_f32(&self, data: &[f32], dims: &[usize]) -> Result<DeviceBuffer, PjrtError> {
        let count: usize = dims.iter().product();
        if count != data.len() {
            return Err(PjrtError::Call {
                call: "PJRT_Client_BufferFromHostBuffer",
                message: format!("{} values for shape {dims:?}", data.len()),
            });
        }
        let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let mut a = ffi::ClientBufferFromHostBufferArgs::default();
        a.client = self.handle.raw;
        a.data = data.as_ptr().cast();
        a.type_ = ffi::BUFFER_TYPE_F32;
        a.dims = dims.as_ptr();
        a.num_dims = dims.len();
        a.host_buffer_semantics = ffi::HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL;
        a.device = self.devices[0];
        self.handle.call(
            index::CLIENT_BUFFER_FROM_HOST_BUFFER,
            "PJRT_Client_BufferFromHostBuffer",
            &mut a,
        )?;
        let buffer = DeviceBuffer {
            plugin: self.handle.clone(),
            raw: a.buffer,
        };
        self.handle
            .await_event(a.done_with_host_buffer, "PJRT_Event_Await (host to device)")?;
        Ok(buffer)
    }
}

/// `xla.CompileOptionsProto` for one replica and one partition, encoded by
/// hand: field 3 (executable_build_options, 15 bytes) holding
/// device_ordinal = -1 (field 1, a 10-byte varint), num_replicas = 1
/// (field 4) and num_partitions = 1 (field 5). Part of the cache key.
pub const COMPILE_OPTIONS: &[u8] = &[
    0x1a, 15, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x20, 0x01, 0x28,
    0x01,
];

/// A compiled program on a client's devices.
pub struct Executable {
    plugin: Arc<ClientHandle>,
    raw: *mut ffi::LoadedExecutable,
    num_outputs: usize,
}

// SAFETY: loaded executables may be executed from any thread (C API contract).
unsafe impl Send for Executable {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl Sync for Executable {}

impl Executable {
    fn wrap(plugin: Arc<ClientHandle>, raw: *mut ffi::LoadedExecutable) -> Result<Self, PjrtError> {
        let mut exe = Executable {
            plugin,
            raw,
            num_outputs: 0,
        };
        let num_outputs = {
            let inner = exe.inner()?;
            let mut n = ffi::ExecutableNumOutputsArgs::default();
            n.executable = inner.0;
            exe.plugin.call(
                index::EXECUTABLE_NUM_OUTPUTS,
                "PJRT_Executable_NumOutputs",
                &mut n,
            )?;
            n.num_outputs
        };
        exe.num_outputs = num_outputs;
        Ok(exe)
    }

    /// The unloaded executable (destroyed when the guard drops).
    fn inner(&self) -> Result<InnerExecutable<'_>, PjrtError> {
        let mut g = ffi::LoadedExecutableGetExecutableArgs::default();
        g.loaded_executable = self.raw;
        self.plugin.call(
            index::LOADED_EXECUTABLE_GET_EXECUTABLE,
            "PJRT_LoadedExecutable_GetExecutable",
            &mut g,
        )?;
        Ok(InnerExecutable(g.executable, &self.plugin.plugin))
    }

    /// Number of outputs of the program (its result tuple, flattened).
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// The executable as bytes, for the on-disk compile cache.
    pub fn serialize(&self) -> Result<Vec<u8>, PjrtError> {
        let inner = self.inner()?;
        let mut a = ffi::ExecutableSerializeArgs::default();
        a.executable = inner.0;
        self.plugin.call(
            index::EXECUTABLE_SERIALIZE,
            "PJRT_Executable_Serialize",
            &mut a,
        )?;
        let bytes = c_bytes(a.serialized_bytes, a.serialized_bytes_size).to_vec();
        if let Some(deleter) = a.serialized_executable_deleter {
            // SAFETY: the plugin's deleter for the object it gave us.
            unsafe { deleter(a.serialized_executable) };
        }
        Ok(bytes)
    }

    /// Runs on device 0 with `args`; returns the outputs (the program's
    /// result tuple, flattened).
    pub fn execute(&self, args: &[&DeviceBuffer]) -> Result<Vec<DeviceBuffer>, PjrtError> {
        let arg_ptrs: Vec<*mut ffi::Buffer> = args.iter().map(|b| b.raw).collect();
        let arg_list: *const *mut ffi::Buffer = arg_ptrs.as_ptr();
        let mut outputs: Vec<*mut ffi::Buffer> = vec![std::ptr::null_mut(); self.num_outputs];
        let output_list: *mut *mut ffi::Buffer = outputs.as_mut_ptr();
        let mut options = ffi::ExecuteOptions::default();
        let mut event: *mut ffi::Event = std::ptr::null_mut();
        let mut a = ffi::LoadedExecutableExecuteArgs::default();
        a.executable = self.raw;
        a.options = &mut options;
        a.argument_lists = &arg_list;
        a.num_devices = 1;
        a.num_args = args.len();
        a.output_lists = &output_list;
        a.device_complete_events = &mut event;
        self.plugin.call(
            index::LOADED_EXECUTABLE_EXECUTE,
            "PJRT_LoadedExecutable_Execute",
            &mut a,
        )?;
        let outs: Vec<DeviceBuffer> = outputs
            .into_iter()
            .map(|raw| DeviceBuffer {
                plugin: self.plugin.clone(),
                raw,
            })
            .collect();
        self.plugin
            .await_event(event, "PJRT_Event_Await (execute)")?;
        Ok(outs)
    }
}

struct InnerExecutable<'a>(*mut ffi::Executable, &'a Plugin);

impl Drop for InnerExecutable<'_> {
    fn drop(&mut self) {
        let mut a = ffi::ExecutableDestroyArgs::default();
        a.executable = self.0;
        let _ = self
            .1
            .call(index::EXECUTABLE_DESTROY, "PJRT_Executable_Destroy", &mut a);
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut a = ffi::LoadedExecutableDestroyArgs::default();
        a.executable = self.raw;
        let _ = self.plugin.call(
            index::LOADED_EXECUTABLE_DESTROY,
            "PJRT_LoadedExecutable_Destroy",
            &mut a,
        );
    }
}

/// An array on a device.
pub struct DeviceBuffer {
    plugin: Arc<ClientHandle>,
    raw: *mut ffi::Buffer,
}

// SAFETY: PJRT buffers may be used from any thread (C API contract).
unsafe impl Send for DeviceBuffer {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// The array's shape; empty for a scalar.
    pub fn dims(&self) -> Result<Vec<usize>, PjrtError> {
        let mut a = ffi::BufferDimensionsArgs::default();
        a.buffer = self.raw;
        self.plugin
            .call(index::BUFFER_DIMENSIONS, "PJRT_Buffer_Dimensions", &mut a)?;
        if a.num_dims == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned `num_dims` dimensions.
        Ok(unsafe { std::slice::from_raw_parts(a.dims, a.num_dims) }
            .iter()
            .map(|&d| d as usize)
            .collect())
    }

    /// Copies an f32 buffer back to the host.
    pub fn to_f32(&self) -> Result<Vec<f32>, PjrtError> {
        let count: usize = self.dims()?.iter().product();
        let mut out = vec![0f32; count];
        self.copy_to_f32(&mut out)?;
        Ok(out)
    }

    /// Copies an f32 buffer into `dst`, which must hold exactly its values.
    pub fn copy_to_f32(&self, dst: &mut [f32]) -> Result<(), PjrtError> {
        let count: usize = self.dims()?.iter().product();
        if count != dst.len() {
            return Err(PjrtError::Call {
                call: "PJRT_Buffer_ToHostBuffer",
                message: format!("{count} values into a buffer of {}", dst.len()),
            });
        }
        let mut a = ffi::BufferToHostBufferArgs::default();
        a.src = self.raw;
        a.dst = dst.as_mut_ptr().cast();
        a.dst_size = count * 4;
        self.plugin.call(
            index::BUFFER_TO_HOST_BUFFER,
            "PJRT_Buffer_ToHostBuffer",
            &mut a,
        )?;
        self.plugin
            .await_event(a.event, "PJRT_Event_Await (device to host)")?;
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let mut a = ffi::BufferDestroyArgs::default();
        a.buffer = self.raw;
        let _ = self
            .plugin
            .call(index::BUFFER_DESTROY, "PJRT_Buffer_Destroy", &mut a);
    }
}
