//! `Tensor`: memory of Ember's that Python reads through DLPack, without
//! a copy: a pooled output (its buffer returned to the collection's pool
//! when the last consumer lets go), a batch's arrays, or a view of a
//! table's rows or optimizer state (keeping the collection alive).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyBufferError, PyMemoryError, PyValueError};
use pyo3::prelude::*;

/// Element types a `Tensor` holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// Pooled outputs, fp32 rows, optimizer state, dense features,
    /// labels, logits, per-id weights.
    F32,
    /// fp16 rows.
    F16,
    /// bf16 rows.
    Bf16,
    /// Quantized rows as stored (int8, int4, fp8, mxfp4): bytes.
    U8,
    /// Ids, lengths, offsets.
    I64,
}

impl Dtype {
    fn dlpack(self) -> DLDataType {
        let (code, bits) = match self {
            Self::F32 => (DLDataTypeCode::FLOAT, 32),
            Self::F16 => (DLDataTypeCode::FLOAT, 16),
            Self::Bf16 => (DLDataTypeCode::BFLOAT, 16),
            Self::U8 => (DLDataTypeCode::UINT, 8),
            Self::I64 => (DLDataTypeCode::INT, 64),
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
            Self::I64 => "int64",
        }
    }

    pub(crate) fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::U8 => 1,
            Self::I64 => 8,
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

    /// The buffer itself, to lend to what fills a `Vec` (and give back at
    /// the same length: the export reads it).
    pub fn vec_mut(&mut self) -> &mut Vec<f32> {
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
    /// The tensor's own values (a pooled buffer, a Vec).
    _owned: Option<Box<dyn std::any::Any + Send + Sync>>,
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

/// A row-major CPU tensor (1-D or 2-D), exported through DLPack
/// (`torch.from_dlpack(t)`, `numpy.from_dlpack(t)`) without a copy.
#[pyclass(module = "ember._native", frozen)]
pub struct Tensor {
    memory: Arc<Memory>,
    shape: Vec<i64>,
    dtype: Dtype,
}

/// Element types a `Tensor` can own.
pub trait Element: Send + Sync + 'static {
    /// Its DLPack type.
    const DTYPE: Dtype;
}
impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl Element for i64 {
    const DTYPE: Dtype = Dtype::I64;
}

impl Tensor {
    /// A `[rows, cols]` tensor over a pooled buffer of its own.
    pub fn owned(mut buffer: PooledBuffer, rows: usize, cols: usize) -> Self {
        // The export reads the shape's number of values: a must.
        assert_eq!(buffer.values.len(), rows * cols, "an output's shape");
        let data = buffer.values_mut().as_mut_ptr().cast();
        Self {
            memory: Arc::new(Memory {
                data,
                _owned: Some(Box::new(buffer)),
                _object: None,
                _guard: None,
            }),
            shape: vec![rows as i64, cols as i64],
            dtype: Dtype::F32,
        }
    }

    /// A tensor of `shape` over `values` (their number is the shape's).
    pub fn from_vec<T: Element>(mut values: Vec<T>, shape: &[usize]) -> Self {
        // The export reads the shape's number of values: a must.
        assert_eq!(
            values.len(),
            shape.iter().product::<usize>(),
            "a tensor's shape"
        );
        let data = values.as_mut_ptr().cast();
        Self {
            memory: Arc::new(Memory {
                data,
                _owned: Some(Box::new(values)),
                _object: None,
                _guard: None,
            }),
            shape: shape.iter().map(|&d| d as i64).collect(),
            dtype: T::DTYPE,
        }
    }

    /// A view of `shape` values of `dtype` at `data`, kept alive by
    /// `owner`; `guard` is held as long as the view (or an export of it).
    ///
    /// # Safety
    /// `data` must point to the shape's number of values of `dtype` that
    /// stay valid, and at that address, while `owner` lives (and `guard`
    /// is held, where given).
    pub unsafe fn view(
        owner: Py<PyAny>,
        guard: Option<Arc<()>>,
        data: *mut u8,
        shape: &[usize],
        dtype: Dtype,
    ) -> Self {
        Self {
            memory: Arc::new(Memory {
                data: data.cast(),
                _owned: None,
                _object: Some(owner),
                _guard: guard,
            }),
            shape: shape.iter().map(|&d| d as i64).collect(),
            dtype,
        }
    }

    fn len(&self) -> usize {
        self.shape.iter().map(|&d| d as usize).product()
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let mut tensor = Dynamic::compact(self.shape.clone())
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

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
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

    /// The values as a list (1-D) or a list of rows (2-D), for use without
    /// numpy or torch (float32 and int64 tensors).
    fn tolist<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        fn nest<'py, T: Copy + IntoPyObject<'py>>(
            py: Python<'py>,
            values: &[T],
            shape: &[i64],
        ) -> PyResult<Bound<'py, PyAny>> {
            match shape {
                [_] => Ok(values.to_vec().into_pyobject(py)?.into_any()),
                [rows, cols] => {
                    let cols = *cols as usize;
                    let rows: Vec<Vec<T>> = (0..*rows as usize)
                        .map(|r| values[r * cols..(r + 1) * cols].to_vec())
                        .collect();
                    Ok(rows.into_pyobject(py)?.into_any())
                }
                _ => Err(PyValueError::new_err("tolist() reads 1-D and 2-D tensors")),
            }
        }
        let len = self.len();
        match self.dtype {
            // SAFETY: `memory` keeps `len` values of the tensor's dtype alive at `data`.
            Dtype::F32 => nest(
                py,
                unsafe { std::slice::from_raw_parts(self.memory.data as *const f32, len) },
                &self.shape,
            ),
            // SAFETY: as above.
            Dtype::I64 => nest(
                py,
                unsafe { std::slice::from_raw_parts(self.memory.data as *const i64, len) },
                &self.shape,
            ),
            other => Err(PyValueError::new_err(format!(
                "tolist() reads float32 and int64 tensors; this one is {}: use torch.from_dlpack",
                other.name()
            ))),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "ember.Tensor(shape={:?}, dtype={})",
            self.shape,
            self.dtype.name()
        )
    }
}
