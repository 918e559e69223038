//! A window of recorded ops: the one StableHLO function they build, the host
//! buffers they read (uploaded once, as the function's arguments) and the
//! host buffers they write (known by address, filled when the window runs).
//!
//! Host buffers are identified by their address. Within a window an address
//! means the latest value written there, so an op that reads what an earlier
//! op of the window wrote gets that value without a round trip to the host.
//! That is sound only while every buffer the window knows stays alive and
//! unmoved until [`Window::run`]: the eager mode runs a window per op (the
//! op's borrows cover it), and `DenseBackend::fused` puts it on its caller.

use std::sync::Arc;

use super::hlo::Func;
use super::runtime::{Client, DeviceBuffer, Executable, PjrtError};
use crate::tensor::Tensor;

/// What a host address holds in this window: an SSA value and its shape.
struct Value {
    name: String,
    dims: Vec<usize>,
}

/// A host buffer an op wrote, filled when the window runs.
struct Destination {
    ptr: *mut f32,
    len: usize,
}

impl Destination {
    /// Its address, the key of `Window::values`.
    fn key(&self) -> usize {
        self.ptr as usize
    }
}

#[derive(Default)]
pub(super) struct Window {
    pub f: Func,
    args: Vec<DeviceBuffer>,
    values: std::collections::HashMap<usize, Value>,
    /// In order of first write, so the program text (the cache key) is the
    /// same for the same sequence of ops.
    destinations: Vec<Destination>,
}

// SAFETY: the pointers are dereferenced only in `run`, by the one owner of
// the window (moved out of the backend's mutex first), under the contract in
// the module docs.
unsafe impl Send for Window {}

impl Window {
    /// The value of `data` (shape `dims`): what an earlier op of this window
    /// wrote there, or a new argument holding its contents now.
    pub fn read(
        &mut self,
        client: &Client,
        data: &[f32],
        dims: &[usize],
    ) -> Result<String, PjrtError> {
        if data.is_empty() {
            // Empty buffers share a dangling address; they have no contents to track.
            return Ok(self.f.splat(0.0, dims));
        }
        let key = data.as_ptr() as usize;
        if let Some(v) = self.values.get(&key) {
            let len: usize = v.dims.iter().product();
            assert_eq!(
                len,
                data.len(),
                "deferred window: a buffer of {len} values is read as {} (it was resized outside the backend)",
                data.len()
            );
            if v.dims == dims {
                return Ok(v.name.clone());
            }
            let (name, from) = (v.name.clone(), v.dims.clone());
            return Ok(self.f.reshape(&name, &from, dims));
        }
        self.args.push(client.buffer_f32(data, dims)?);
        let name = self.f.arg(dims);
        self.values.insert(
            key,
            Value {
                name: name.clone(),
                dims: dims.to_vec(),
            },
        );
        Ok(name)
    }

    /// Records that `value` (shape `dims`) goes into `dst` when the window runs.
    pub fn write(&mut self, dst: &mut [f32], dims: &[usize], value: String) {
        let (ptr, len) = (dst.as_mut_ptr(), dst.len());
        let key = ptr as usize;
        if len == 0 {
            // Nothing to write; what the window knew of this (shrunk) buffer is stale.
            self.forget(key);
            return;
        }
        self.values.insert(
            key,
            Value {
                name: value,
                dims: dims.to_vec(),
            },
        );
        // The newest pointer: it is the one derived from the live borrow.
        match self.destinations.iter_mut().find(|d| d.key() == key) {
            Some(d) => (d.ptr, d.len) = (ptr, len),
            None => self.destinations.push(Destination { ptr, len }),
        }
    }

    fn forget(&mut self, key: usize) {
        self.values.remove(&key);
        self.destinations.retain(|d| d.key() != key);
    }

    /// [`Window::write`] into `t` resized to `[rows, cols]`. When the resize
    /// moves `t`'s memory, what the window knew of the old memory goes: it
    /// was `t`'s, and it has been freed.
    pub fn write_tensor(&mut self, t: &mut Tensor<f32>, rows: usize, cols: usize, value: String) {
        let old = t.data().as_ptr() as usize;
        t.resize(rows, cols);
        if t.data().as_ptr() as usize != old {
            self.forget(old);
        }
        self.write(t.data_mut(), &[rows, cols], value);
    }

    /// Runs the window as one executable (from `executable`, which compiles
    /// or finds it by its text), fills every destination and leaves the window
    /// empty, also when it fails.
    pub fn run(
        &mut self,
        executable: impl FnOnce(&str) -> Arc<Executable>,
    ) -> Result<bool, PjrtError> {
        let w = std::mem::take(self);
        if w.destinations.is_empty() {
            return Ok(false);
        }
        let results: Vec<(String, Vec<usize>)> = (w.destinations.iter())
            .map(|d| {
                let v = &w.values[&d.key()];
                (v.name.clone(), v.dims.clone())
            })
            .collect();
        let exe = executable(&w.f.finish(&results));
        let args: Vec<&DeviceBuffer> = w.args.iter().collect();
        let outs = exe.execute(&args)?;
        for (d, out) in w.destinations.iter().zip(&outs) {
            // SAFETY: `d` was the live `len`-long output of an op of this window,
            // and the window's contract (module docs) keeps it alive and unmoved
            // until now; nothing else borrows it while the backend runs.
            let dst = unsafe { std::slice::from_raw_parts_mut(d.ptr, d.len) };
            out.copy_to_f32(dst)?;
        }
        Ok(true)
    }
}
