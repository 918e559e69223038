//! `Tensor`: memory of Ember's that Python reads through DLPack, without
//! a copy: a pooled output (its buffer returned to the collection's pool
//! when the last consumer lets go), or a view of a table's rows or
//! optimizer state (keeping the collection alive).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::Fixed;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyBufferError, PyMemoryError, PyValueError};
use pyo3::prelude::*;

/// Element types a `Tensor` holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// Pooled outputs, fp32 rows, optimizer state.
    F32,
    /// fp16 rows.
    F16,
    /// bf16 rows.
    Bf16,
    /// Quantized rows as stored (int8, int4, fp8, mxfp4): bytes.
    U8,
}

impl Dtype {
    fn dlpack(self) -> DLDataType {
        let (code, bits) = match self {
            Self::F32 => (DLDataTypeCode::FLOAT, 32),
            Self::F16 => (DLDataTypeCode::FLOAT, 16),
            Self::Bf16 => (DLDataTypeCode::BFLOAT, 16),
            Self::U8 => (DLDataTypeCode::UINT, 8),
        };
        DLDataType {
            code,
            bits,
            lanes: 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::Bf16 => "bfloat16",
            Self::U8 => "uint8",
        }
    }

    pub(crate) fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::U8 => 1,
        }
    }
}

/// Spare output buffers of one collection: a forward reuses one instead of
/// asking the allocator (and the kernel, for pages) for megabytes a batch.
pub type BufferPool = Arc<Mutex<Vec<Vec<f32>>>>;
/// Buffers kept for reuse: an output in use by the model, one by its
/// backward, one being made.
const POOL_KEEP: usize = 4;

/// An output's values; back to its pool when dropped.
pub struct PooledBuffer {
    values: Vec<f32>,
    pool: BufferPool,
}

impl PooledBuffer {
    /// A buffer of `len` values from `pool` (contents unspecified: the
    /// forward writes every value); a `MemoryError` when one cannot be
    /// allocated.
    pub fn take(pool: &BufferPool, len: usize) -> PyResult<Self> {
        let reused = pool.lock().ok().and_then(|mut spare| {
            let at = spare.iter().position(|b| b.len() == len)?;
            Some(spare.swap_remove(at))
        });
        let values = match reused {
            Some(values) => values,
            None => {
                let mut values = Vec::new();
                values.try_reserve_exact(len).map_err(|_| {
                    PyMemoryError::new_err(format!(
                        "cannot allocate an output of {len} floats ({} bytes)",
                        len.saturating_mul(4)
                    ))
                })?;
                values.resize(len, 0.0);
                values
            }
        };
        Ok(Self {
            values,
            pool: Arc::clone(pool),
        })
    }

    /// The values, to fill.
    pub fn values_mut(&mut self) -> &mut [f32] {
        &mut self.values
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Ok(mut spare) = self.pool.lock() {
            if spare.len() < POOL_KEEP {
                spare.push(std::mem::take(&mut self.values));
            }
        }
    }
}

/// The memory and its keepers (held for their Drop), shared by every
/// DLPack export of a tensor.
struct Memory {
    data: *mut c_void,
    /// An output's own buffer.
    _buffer: Option<PooledBuffer>,
    /// The Python object (a collection) whose memory a view shows.
    _object: Option<Py<PyAny>>,
    /// A guard the object counts to know a view of it is alive.
    _guard: Option<Arc<()>>,
}

// SAFETY: `data` points into memory the keepers keep alive, at a fixed
// address: an owned Vec's heap block, a table's rows (one allocation for
// the table's life), or its optimizer state (replaced only while no guard
// is held). The pointer carries no thread affinity; access to the values
// is the consumer's, as for any DLPack tensor.
unsafe impl Send for Memory {}
// SAFETY: as for Send: shared references only hand out the pointer.
unsafe impl Sync for Memory {}

/// A 2-D row-major CPU tensor, exported through DLPack
/// (`torch.from_dlpack(t)`, `numpy.from_dlpack(t)`) without a copy.
#[pyclass(module = "ember._native", frozen)]
pub struct Tensor {
    memory: Arc<Memory>,
    shape: [i64; 2],
    dtype: Dtype,
}

impl Tensor {
    /// A tensor over a buffer of its own.
    pub fn owned(mut buffer: PooledBuffer, rows: usize, cols: usize) -> Self {
        debug_assert_eq!(buffer.values.len(), rows * cols);
        let data = buffer.values_mut().as_mut_ptr().cast();
        Self {
            memory: Arc::new(Memory {
                data,
                _buffer: Some(buffer),
                _object: None,
                _guard: None,
            }),
            shape: [rows as i64, cols as i64],
            dtype: Dtype::F32,
        }
    }

    /// A view of `rows x cols` values of `dtype` at `data`, kept alive by
    /// `owner`; `guard` is held as long as the view (or an export of it).
    ///
    /// # Safety
    /// `data` must point to `rows * cols` values of `dtype` that stay
    /// valid, and at that address, while `owner` lives (and `guard` is
    /// held, where given).
    pub unsafe fn view(
        owner: Py<PyAny>,
        guard: Option<Arc<()>>,
        data: *mut u8,
        rows: usize,
        cols: usize,
        dtype: Dtype,
    ) -> Self {
        Self {
            memory: Arc::new(Memory {
                data: data.cast(),
                _buffer: None,
                _object: Some(owner),
                _guard: guard,
            }),
            shape: [rows as i64, cols as i64],
            dtype,
        }
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let strides = [self.shape[1], 1];
        let mut tensor = Fixed::new(self.shape, strides)
            .initialize_as::<M>(Arc::clone(&self.memory))
            .map_err(|e| PyMemoryError::new_err(format!("DLPack export: {e}")))?;
        tensor
            .set_data(self.memory.data)
            .set_dtype(self.dtype.dlpack())
            .set_device(DLDevice::CPU);
        // SAFETY: the data pointer, shape, strides and dtype describe memory
        // the context (the Arc'd Memory) keeps alive until the deleter runs.
        Ok(unsafe { tensor.finish() })
    }
}

impl DlpackExporter for Tensor {
    fn device(&self) -> DLDevice {
        DLDevice::CPU
    }
    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }
    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        Ok(())
    }
    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }
    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl Tensor {
    /// The DLPack capsule of this tensor (the Python array API's protocol).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "ember tensors export without copies: copy=True is not offered",
            ));
        }
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    /// `(device type, device id)`: (1, 0), the CPU.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (1, 0)
    }

    /// `(rows, columns)`.
    #[getter]
    fn shape(&self) -> (i64, i64) {
        (self.shape[0], self.shape[1])
    }

    /// The element type's name, as torch and numpy spell it.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// The address of the first value (a consumer's tensor over the same
    /// memory has the same), a method as torch's.
    fn data_ptr(&self) -> usize {
        self.memory.data as usize
    }

    /// The values as nested lists (fp32 tensors; for use without numpy or
    /// torch).
    fn tolist(&self) -> PyResult<Vec<Vec<f32>>> {
        if self.dtype != Dtype::F32 {
            return Err(PyValueError::new_err(format!(
                "tolist() reads float32 tensors; this one is {}: use torch.from_dlpack",
                self.dtype.name()
            )));
        }
        let [rows, cols] = self.shape.map(|d| d as usize);
        // SAFETY: `memory` keeps `rows * cols` f32 values alive at `data`.
        let values =
            unsafe { std::slice::from_raw_parts(self.memory.data as *const f32, rows * cols) };
        Ok(values
            .chunks(cols.max(1))
            .take(rows)
            .map(<[f32]>::to_vec)
            .collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "ember.Tensor(shape=({}, {}), dtype={})",
            self.shape[0],
            self.shape[1],
            self.dtype.name()
        )
    }
}
