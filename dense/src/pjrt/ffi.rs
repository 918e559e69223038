//! The few declarations of the PJRT C API (version 0.81, `pjrt_c_api.h` as
//! shipped by the plugin) that Ember calls, written by hand as `repr(C)`.
//! Every argument struct starts with its own size and an extension pointer;
//! a plugin accepts a struct at least as large as the one it was built with,
//! so these declarations work with plugins of API 0.81 and older 0.x.

#![allow(non_camel_case_types, dead_code)]
// The items below mirror pjrt_c_api.h (0.81) field for field; their documentation is that header's.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_void};

pub const API_MAJOR: i32 = 0;
pub const API_MINOR: i32 = 81;

/// Opaque handles.
pub enum Error {}
pub enum Client {}
pub enum Device {}
pub enum DeviceDescription {}
pub enum LoadedExecutable {}
pub enum Executable {}
pub enum Buffer {}
pub enum Event {}
pub enum SerializedExecutable {}

#[repr(C)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub major_version: c_int,
    pub minor_version: c_int,
}

/// The head of `PJRT_Api`: then one function pointer per API function, in
/// the header's order (indices below).
#[repr(C)]
pub struct Api {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub pjrt_api_version: ApiVersion,
    pub functions: [*const c_void; 0],
}

/// Positions of the functions used, in `PJRT_Api`'s list of function pointers.
pub mod index {
    pub const ERROR_DESTROY: usize = 0;
    pub const ERROR_MESSAGE: usize = 1;
    pub const PLUGIN_INITIALIZE: usize = 3;
    pub const EVENT_DESTROY: usize = 5;
    pub const EVENT_AWAIT: usize = 8;
    pub const CLIENT_CREATE: usize = 10;
    pub const CLIENT_DESTROY: usize = 11;
    pub const CLIENT_PLATFORM_NAME: usize = 12;
    pub const CLIENT_PLATFORM_VERSION: usize = 14;
    pub const CLIENT_ADDRESSABLE_DEVICES: usize = 16;
    pub const CLIENT_COMPILE: usize = 20;
    pub const CLIENT_BUFFER_FROM_HOST_BUFFER: usize = 22;
    pub const DEVICE_DESCRIPTION_ID: usize = 23;
    pub const DEVICE_DESCRIPTION_KIND: usize = 26;
    pub const DEVICE_GET_DESCRIPTION: usize = 29;
    pub const EXECUTABLE_DESTROY: usize = 40;
    pub const EXECUTABLE_NUM_OUTPUTS: usize = 44;
    pub const EXECUTABLE_SERIALIZE: usize = 49;
    pub const LOADED_EXECUTABLE_DESTROY: usize = 50;
    pub const LOADED_EXECUTABLE_GET_EXECUTABLE: usize = 51;
    pub const LOADED_EXECUTABLE_EXECUTE: usize = 55;
    pub const EXECUTABLE_DESERIALIZE_AND_LOAD: usize = 56;
    pub const BUFFER_DESTROY: usize = 58;
    pub const BUFFER_DIMENSIONS: usize = 60;
    pub const BUFFER_TO_HOST_BUFFER: usize = 70;
    /// One past the last function used: the API struct must reach it.
    pub const USED: usize = 71;
}

pub type ErrorFn = unsafe extern "C" fn(*mut c_void) -> *mut Error;
pub type VoidFn = unsafe extern "C" fn(*mut c_void);

macro_rules! args {
    ($name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        #[repr(C)]
        pub struct $name {
            pub struct_size: usize,
            pub extension_start: *mut c_void,
            $(pub $field: $ty,)*
        }
        impl Default for $name {
            /// Zeroed, with `struct_size` set.
            fn default() -> Self {
                // SAFETY: every field is a pointer, integer or float, for
                // which all-zero bytes are a valid (null / 0) value.
                let mut a: Self = unsafe { std::mem::zeroed() };
                a.struct_size = std::mem::size_of::<Self>();
                a
            }
        }
    };
}

args!(ErrorDestroyArgs { error: *mut Error });
args!(ErrorMessageArgs { error: *const Error, message: *const c_char, message_size: usize });
args!(PluginInitializeArgs {});
args!(EventDestroyArgs { event: *mut Event });
args!(EventAwaitArgs { event: *mut Event });
args!(ClientCreateArgs {
    create_options: *const c_void,
    num_options: usize,
    kv_get_callback: *const c_void,
    kv_get_user_arg: *mut c_void,
    kv_put_callback: *const c_void,
    kv_put_user_arg: *mut c_void,
    client: *mut Client,
    kv_try_get_callback: *const c_void,
    kv_try_get_user_arg: *mut c_void,
});
args!(ClientDestroyArgs { client: *mut Client });
args!(ClientPlatformNameArgs { client: *mut Client, platform_name: *const c_char, platform_name_size: usize });
args!(ClientPlatformVersionArgs { client: *mut Client, platform_version: *const c_char, platform_version_size: usize });
args!(ClientAddressableDevicesArgs { client: *mut Client, addressable_devices: *const *mut Device, num_addressable_devices: usize });
args!(DeviceGetDescriptionArgs { device: *mut Device, device_description: *mut DeviceDescription });
args!(DeviceDescriptionIdArgs { device_description: *mut DeviceDescription, id: c_int });
args!(DeviceDescriptionKindArgs { device_description: *mut DeviceDescription, device_kind: *const c_char, device_kind_size: usize });
args!(Program { code: *const c_char, code_size: usize, format: *const c_char, format_size: usize });
args!(ClientCompileArgs {
    client: *mut Client,
    program: *const Program,
    compile_options: *const c_char,
    compile_options_size: usize,
    executable: *mut LoadedExecutable,
});
args!(ClientBufferFromHostBufferArgs {
    client: *mut Client,
    data: *const c_void,
    type_: c_int,
    dims: *const i64,
    num_dims: usize,
    byte_strides: *const i64,
    num_byte_strides: usize,
    host_buffer_semantics: c_int,
    device: *mut Device,
    memory: *mut c_void,
    device_layout: *mut c_void,
    done_with_host_buffer: *mut Event,
    buffer: *mut Buffer,
});
args!(ExecuteOptions {
    send_callbacks: *mut c_void,
    recv_callbacks: *mut c_void,
    num_send_ops: usize,
    num_recv_ops: usize,
    launch_id: c_int,
    non_donatable_input_indices: *const i64,
    num_non_donatable_input_indices: usize,
    context: *mut c_void,
    call_location: *const c_char,
    num_tasks: usize,
    task_ids: *mut c_int,
    incarnation_ids: *mut i64,
});
args!(LoadedExecutableExecuteArgs {
    executable: *mut LoadedExecutable,
    options: *mut ExecuteOptions,
    argument_lists: *const *const *mut Buffer,
    num_devices: usize,
    num_args: usize,
    output_lists: *const *mut *mut Buffer,
    device_complete_events: *mut *mut Event,
    execute_device: *mut Device,
});
args!(LoadedExecutableDestroyArgs { executable: *mut LoadedExecutable });
args!(LoadedExecutableGetExecutableArgs { loaded_executable: *mut LoadedExecutable, executable: *mut Executable });
args!(ExecutableDestroyArgs { executable: *mut Executable });
args!(ExecutableNumOutputsArgs { executable: *mut Executable, num_outputs: usize });
args!(ExecutableSerializeArgs {
    executable: *const Executable,
    serialized_bytes: *const c_char,
    serialized_bytes_size: usize,
    serialized_executable: *mut SerializedExecutable,
    serialized_executable_deleter: Option<unsafe extern "C" fn(*mut SerializedExecutable)>,
});
args!(ExecutableDeserializeAndLoadArgs {
    client: *mut Client,
    serialized_executable: *const c_char,
    serialized_executable_size: usize,
    loaded_executable: *mut LoadedExecutable,
    overridden_serialized_compile_options: *const c_char,
    overridden_serialized_compile_options_size: usize,
});
args!(BufferDestroyArgs { buffer: *mut Buffer });
args!(BufferDimensionsArgs { buffer: *mut Buffer, dims: *const i64, num_dims: usize });
args!(BufferToHostBufferArgs {
    src: *mut Buffer,
    host_layout: *mut c_void,
    dst: *mut c_void,
    dst_size: usize,
    event: *mut Event,
});

/// `PJRT_Buffer_Type_F32`.
pub const BUFFER_TYPE_F32: c_int = 11;
/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the host data is
/// copied before the call returns.
pub const HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL: c_int = 0;
