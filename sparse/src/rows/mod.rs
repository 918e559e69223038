//! A table's rows in its data type ([`TableRows`]), and how the kernels read
//! and write them ([`RowFormat`], one per [`DataType`]).
//!
//! Every format turns a row's bytes into fp32 values through the same
//! `value` function wherever rows are read (the forward's gather, the
//! backward's read of a row, `read_row`), so a table of any type pools
//! exactly as a fp32 table holding its decoded rows would.

mod half;
mod quant;

use rayon::prelude::*;

use crate::storage::AlignedBuffer;
use crate::DataType;
use half::rounding_bits;
use half::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_bf16_stochastic, f32_to_f16_stochastic};
pub(crate) use half::{narrow_to_bf16, narrow_to_f16};
pub(crate) use quant::{Fp8, Mxfp4, NBit};

/// How the kernels read one row format: a header read once per row (scale,
/// bias), then each column's fp32 value.
pub(crate) trait RowFormat {
    /// The data type whose rows this reads.
    const DTYPE: DataType;
    /// What a row carries besides its values (nothing, a scale, a scale and a bias).
    type Header: Copy;
    /// # Safety
    /// `row` points at a whole row of `dim` columns in this format.
    unsafe fn header(row: *const u8, dim: usize) -> Self::Header;
    /// Column `d`'s value.
    ///
    /// # Safety
    /// As for `header`, and `d < dim`.
    unsafe fn value(row: *const u8, header: Self::Header, dim: usize, d: usize) -> f32;

    /// Every column of the row, into `out` (`dim = out.len()`).
    ///
    /// # Safety
    /// As for `header`, with `dim = out.len()`.
    #[inline(always)]
    unsafe fn decode_row(row: *const u8, out: &mut [f32]) {
        let dim = out.len();
        let h = Self::header(row, dim);
        for (d, o) in out.iter_mut().enumerate() {
            *o = Self::value(row, h, dim, d);
        }
    }

    /// `acc[d] += w * value(d)` for each of the `D` columns: the forward's
    /// inner loop for a fixed dim.
    ///
    /// # Safety
    /// As for `header`, with `dim = D`.
    #[inline(always)]
    unsafe fn add_row<const D: usize>(acc: &mut [f32; D], row: *const u8, w: f32) {
        let h = Self::header(row, D);
        for (d, a) in acc.iter_mut().enumerate() {
            *a += w * Self::value(row, h, D, d);
        }
    }
}

/// A training format: rows the backward reads, updates in fp32 and writes
/// back (stochastically rounded unless the format is fp32 itself).
pub(crate) trait TrainFormat: RowFormat {
    /// Whether rows are fp32, updated where they lie (no decode, no rounding).
    const IN_PLACE: bool;
    /// Writes `src` as the row at `row`, column `first_column + d` of the
    /// whole table rounded with `rounding_bits(row_key, first_column + d)`.
    ///
    /// # Safety
    /// `row` points at a whole row of `src.len()` columns, which no one else
    /// reads or writes meanwhile.
    unsafe fn store(row: *mut u8, src: &[f32], row_key: u64, first_column: u64);
}

/// fp32 rows.
pub(crate) struct Fp32;
/// fp16 rows.
pub(crate) struct Fp16;
/// bf16 rows.
pub(crate) struct Bf16;

impl RowFormat for Fp32 {
    const DTYPE: DataType = DataType::Fp32;
    type Header = ();
    #[inline(always)]
    unsafe fn header(_: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn value(row: *const u8, _: (), _: usize, d: usize) -> f32 {
        *(row as *const f32).add(d)
    }
    #[inline(always)]
    unsafe fn add_row<const D: usize>(acc: &mut [f32; D], row: *const u8, w: f32) {
        // The row as one array, read as the fp32-only kernel always read it.
        let row = &*(row as *const [f32; D]);
        for d in 0..D {
            acc[d] += w * row[d];
        }
    }
}

impl TrainFormat for Fp32 {
    const IN_PLACE: bool = true;
    #[inline(always)]
    unsafe fn store(row: *mut u8, src: &[f32], _: u64, _: u64) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), row as *mut f32, src.len());
    }
}

/// The format of a 16-bit type: its values widened by `$widen`, written
/// back rounded by `$round` with each column's random bits.
macro_rules! half_format {
    ($format:ty, $dtype:expr, $widen:path, $round:path) => {
        impl RowFormat for $format {
            const DTYPE: DataType = $dtype;
            type Header = ();
            #[inline(always)]
            unsafe fn header(_: *const u8, _: usize) {}
            #[inline(always)]
            unsafe fn value(row: *const u8, _: (), _: usize, d: usize) -> f32 {
                $widen((row as *const u16).add(d).read_unaligned())
            }
        }

        impl TrainFormat for $format {
            const IN_PLACE: bool = false;
            #[inline(always)]
            unsafe fn store(row: *mut u8, src: &[f32], row_key: u64, first_column: u64) {
                // 16-bit rows are 2-byte aligned (even strides in a 64-byte aligned table).
                let out = std::slice::from_raw_parts_mut(row as *mut u16, src.len());
                for (d, (o, &x)) in out.iter_mut().zip(src).enumerate() {
                    *o = $round(x, rounding_bits(row_key, first_column + d as u64));
                }
            }
        }
    };
}
half_format!(Fp16, DataType::Fp16, f16_to_f32, f32_to_f16_stochastic);
half_format!(Bf16, DataType::Bf16, bf16_to_f32, f32_to_bf16_stochastic);

/// fp16 rows widened by the F16C instructions (8 values in one), for the
/// kernels built for AVX2 or AVX-512, whose builds enable F16C too: the
/// portable widening is a dozen operations a value, and made the fp16
/// forward 0.78x of fp32's where bf16's is 1.33x. Widening is exact either
/// way, so both formats read the same values; rounding is [`Fp16`]'s.
///
/// Only the AVX2 and AVX-512 builds of a kernel use it (see
/// [`multiversion!`](crate::simd::multiversion)).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Fp16F16c;

#[cfg(target_arch = "x86_64")]
impl Fp16F16c {
    /// Columns `d..d + 8` widened.
    ///
    /// # Safety
    /// The CPU has F16C, and the row holds columns `d..d + 8`.
    #[inline(always)]
    unsafe fn widen8(row: *const u8, d: usize) -> [f32; 8] {
        use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm_loadu_si128};
        let halves = _mm_loadu_si128((row as *const u16).add(d) as *const __m128i);
        std::mem::transmute(_mm256_cvtph_ps(halves))
    }
}

#[cfg(target_arch = "x86_64")]
impl RowFormat for Fp16F16c {
    const DTYPE: DataType = DataType::Fp16;
    type Header = ();
    #[inline(always)]
    unsafe fn header(_: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn value(row: *const u8, _: (), _: usize, d: usize) -> f32 {
        use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
        let bits = (row as *const u16).add(d).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
    #[inline(always)]
    unsafe fn decode_row(row: *const u8, out: &mut [f32]) {
        let whole = out.len() / 8 * 8;
        let (head, tail) = out.split_at_mut(whole);
        for (c, chunk) in head.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&Self::widen8(row, 8 * c));
        }
        for (o, d) in tail.iter_mut().zip(whole..) {
            *o = Self::value(row, (), 0, d);
        }
    }
    #[inline(always)]
    unsafe fn add_row<const D: usize>(acc: &mut [f32; D], row: *const u8, w: f32) {
        // Sixteen columns at a time, so that the AVX-512 build keeps the
        // sum in 512-bit registers: in 256-bit ones its stores to the
        // output doubled, and a bag of one id (bound by those stores) ran
        // at 0.8x of the portable widening's speed.
        let mut d = 0;
        while d + 16 <= D {
            let (low, high) = (Self::widen8(row, d), Self::widen8(row, d + 8));
            let wide = low.iter().chain(&high);
            for (a, x) in acc[d..d + 16].iter_mut().zip(wide) {
                *a += w * x;
            }
            d += 16;
        }
        for (a, d) in acc[d..].iter_mut().zip(d..) {
            *a += w * Self::value(row, (), D, d);
        }
    }
}

/// The fp16 format of the kernels' AVX2 and AVX-512 builds: [`Fp16F16c`]
/// on x86-64, the portable [`Fp16`] elsewhere.
#[cfg(target_arch = "x86_64")]
pub(crate) type Fp16Simd = Fp16F16c;
#[cfg(not(target_arch = "x86_64"))]
pub(crate) type Fp16Simd = Fp16;

#[cfg(target_arch = "x86_64")]
impl TrainFormat for Fp16F16c {
    const IN_PLACE: bool = false;
    #[inline(always)]
    unsafe fn store(row: *mut u8, src: &[f32], row_key: u64, first_column: u64) {
        Fp16::store(row, src, row_key, first_column)
    }
}

/// Runs `$f::<Format>($args)` with the [`RowFormat`] of `$dtype`;
/// `with_format!(kernel F16C, dtype, ...)` inside a multiversioned kernel,
/// where fp16 uses [`Fp16Simd`] in the builds with F16C.
macro_rules! with_format {
    ($dtype:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            $crate::DataType::Fp32 => $f::<$crate::rows::Fp32>($($arg),*),
            $crate::DataType::Fp16 => $f::<$crate::rows::Fp16>($($arg),*),
            $crate::DataType::Bf16 => $f::<$crate::rows::Bf16>($($arg),*),
            $crate::DataType::Int8 => $f::<$crate::rows::NBit<8>>($($arg),*),
            $crate::DataType::Int4 => $f::<$crate::rows::NBit<4>>($($arg),*),
            $crate::DataType::Fp8 => $f::<$crate::rows::Fp8>($($arg),*),
            $crate::DataType::Mxfp4 => $f::<$crate::rows::Mxfp4>($($arg),*),
        }
    };
    // In a multiversioned kernel: fp16 rows by F16C in the builds with it
    // (`$f16c`, a constant, so each build holds one fp16 kernel).
    (kernel $f16c:expr, $dtype:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            $crate::DataType::Fp16 if $f16c => $f::<$crate::rows::Fp16Simd>($($arg),*),
            other => $crate::rows::with_format!(other, $f($($arg),*)),
        }
    };
}
pub(crate) use with_format;

/// Bytes per row of format `F` at the kernels' dim: a constant when the
/// dim is one at compile time (`D > 0`), else the table's `stride`.
#[inline(always)]
pub(crate) fn fixed_stride<F: RowFormat, const D: usize>(stride: usize) -> usize {
    match F::DTYPE.row_bytes(D) {
        Some(bytes) if D > 0 => bytes,
        _ => stride,
    }
}

// The public row codec of a type: here, beside the formats it dispatches
// to, so that the type itself knows nothing of them.
impl DataType {
    /// Decodes one row of this type (`bytes`, [`row_bytes`](Self::row_bytes)
    /// of `out.len()` long) into `out`: the values the forward pools.
    ///
    /// # Panics
    /// When `bytes` is not one row of `out.len()` columns.
    pub fn decode_row(self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(
            Some(bytes.len()),
            self.row_bytes(out.len()),
            "decode_row: not one {self} row"
        );
        with_format!(self, decode_with(bytes, out));
    }

    /// Encodes `values` as one row of this type into `bytes`: the nearest
    /// value for fp16/bf16, the row's quantization for the quantized types.
    ///
    /// # Panics
    /// When `bytes` is not one row of `values.len()` columns.
    pub fn encode_row(self, values: &[f32], bytes: &mut [u8]) {
        assert_eq!(
            Some(bytes.len()),
            self.row_bytes(values.len()),
            "encode_row: not one {self} row"
        );
        encode(self, values, bytes);
    }
}

/// Decodes one row of format `F` (`src`, its bytes) into `out` (its columns).
pub(crate) fn decode_with<F: RowFormat>(src: &[u8], out: &mut [f32]) {
    // SAFETY: callers pass a whole row of `out.len()` columns (`row_bytes` bytes).
    unsafe { F::decode_row(src.as_ptr(), out) }
}

/// Encodes `src` into one row `dst` of `dtype`: training types to the
/// nearest value, quantized types by their quantizer.
pub(crate) fn encode(dtype: DataType, src: &[f32], dst: &mut [u8]) {
    match dtype {
        DataType::Fp32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        DataType::Fp16 => {
            // The half crate's slice conversion: F16C 8 values at a time
            // where the CPU has it (the same nearest values as one by one).
            // Copied out whole: value by value, each 2-byte copy was a call
            // to memcpy (a disk tier makes a row per first lookup).
            use ::half::slice::HalfFloatSliceExt;
            let mut narrow = [::half::f16::ZERO; 64];
            for (src, dst) in src.chunks(64).zip(dst.chunks_mut(128)) {
                let narrow = &mut narrow[..src.len()];
                narrow.convert_from_f32_slice(src);
                let bits: &[u16] = narrow.reinterpret_cast();
                dst.copy_from_slice(bytemuck::cast_slice(bits));
            }
        }
        DataType::Bf16 => {
            let mut narrow = [0u16; 64];
            for (src, dst) in src.chunks(64).zip(dst.chunks_mut(128)) {
                let narrow = &mut narrow[..src.len()];
                for (out, &x) in narrow.iter_mut().zip(src) {
                    *out = f32_to_bf16(x);
                }
                dst.copy_from_slice(bytemuck::cast_slice(narrow));
            }
        }
        DataType::Int8 => quant::quantize_nbit::<8>(src, dst),
        DataType::Int4 => quant::quantize_nbit::<4>(src, dst),
        DataType::Fp8 => quant::quantize_fp8(src, dst),
        DataType::Mxfp4 => quant::quantize_mxfp4(src, dst),
    }
}

/// A table's rows, `row_bytes(dim)` bytes each, in one aligned allocation.
#[derive(Clone, Debug)]
pub(crate) struct TableRows {
    dtype: DataType,
    dim: usize,
    stride: usize,
    bytes: AlignedBuffer<u8>,
}

impl TableRows {
    /// `rows` rows of zeros (zero bytes are zeros in every format). `None`
    /// when the size overflows or the allocation fails.
    pub(crate) fn new(dtype: DataType, rows: usize, dim: usize) -> Option<Self> {
        let stride = dtype.row_bytes(dim)?;
        let bytes = AlignedBuffer::new(rows.checked_mul(stride)?, |_| {})?;
        Some(Self {
            dtype,
            dim,
            stride,
            bytes,
        })
    }

    pub(crate) fn dtype(&self) -> DataType {
        self.dtype
    }

    /// Bytes per row.
    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    /// Every row's bytes, row-major.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes.as_mut_slice()
    }

    /// The rows as floats, for a fp32 table.
    pub(crate) fn as_f32(&self) -> Option<&[f32]> {
        (self.dtype == DataType::Fp32).then(|| bytemuck::cast_slice(self.bytes.as_slice()))
    }

    pub(crate) fn as_f32_mut(&mut self) -> Option<&mut [f32]> {
        (self.dtype == DataType::Fp32).then(|| bytemuck::cast_slice_mut(self.bytes.as_mut_slice()))
    }

    /// Address of the first row.
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.bytes.as_ptr()
    }

    /// Row `id`'s columns as fp32.
    ///
    /// # Panics
    /// When `id` is not a row or `out` is not `dim` long.
    pub(crate) fn read_row(&self, id: usize, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.dim,
            "read_row: a row has {} columns",
            self.dim
        );
        let bytes = &self.bytes()[id * self.stride..(id + 1) * self.stride];
        self.dtype.decode_row(bytes, out);
    }

    /// Sets row `id` to `src`, rounded to nearest (or quantized).
    ///
    /// # Panics
    /// When `id` is not a row or `src` is not `dim` long.
    pub(crate) fn write_row(&mut self, id: usize, src: &[f32]) {
        assert_eq!(
            src.len(),
            self.dim,
            "write_row: a row has {} columns",
            self.dim
        );
        let (stride, dtype) = (self.stride, self.dtype);
        encode(
            dtype,
            src,
            &mut self.bytes_mut()[id * stride..(id + 1) * stride],
        );
    }

    /// Fills the rows chunk by chunk of `chunk_rows` rows, in parallel:
    /// `draw(chunk, values)` writes the chunk's values as fp32, row-major,
    /// which are then rounded (or quantized) into the table's type.
    pub(crate) fn fill(&mut self, chunk_rows: usize, draw: impl Fn(usize, &mut [f32]) + Sync) {
        let (dtype, dim, stride) = (self.dtype, self.dim, self.stride);
        if let Some(values) = self.as_f32_mut() {
            values
                .par_chunks_mut(chunk_rows * dim)
                .enumerate()
                .for_each(|(chunk, values)| draw(chunk, values));
            return;
        }
        self.bytes_mut()
            .par_chunks_mut(chunk_rows * stride)
            .enumerate()
            .for_each(|(chunk, bytes)| {
                let rows = bytes.len() / stride;
                let mut values = vec![0f32; rows * dim];
                draw(chunk, &mut values);
                for (src, dst) in values.chunks_exact(dim).zip(bytes.chunks_exact_mut(stride)) {
                    encode(dtype, src, dst);
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fp16 rows are encoded to the nearest value, as one value at a time
    /// would: normals, subnormals, ties, overflow, infinities, NaNs, in rows
    /// longer and shorter than the conversion's chunk.
    #[test]
    fn fp16_encoding_is_the_nearest_value() {
        let mut rng = crate::rng::Rng::new(7);
        for len in [1usize, 7, 64, 100, 200] {
            let src: Vec<f32> = (0..len)
                .map(|i| match i % 5 {
                    0 => f32::from_bits(rng.next_u64() as u32),
                    1 => (rng.next_f32() - 0.5) * 1e-5,
                    2 => f32::from_bits(0x3f80_1000 + (i as u32 % 3) * 0x1000),
                    3 => [65520.0, -1e9, f32::INFINITY, f32::NAN][i / 5 % 4],
                    _ => rng.next_f32() - 0.5,
                })
                .collect();
            let mut dst = vec![0u8; 2 * len];
            encode(DataType::Fp16, &src, &mut dst);
            for (x, out) in src.iter().zip(dst.chunks_exact(2)) {
                let got = u16::from_ne_bytes([out[0], out[1]]);
                let want = super::half::f32_to_f16(*x);
                let nan = |b: u16| b & 0x7c00 == 0x7c00 && b & 0x3ff != 0;
                assert!(
                    got == want || (nan(got) && nan(want)),
                    "{x}: {got:#x} {want:#x}"
                );
            }
        }
    }

    /// F16C reads every fp16 value as the portable widening does: in rows
    /// with whole 8-column chunks and a tail, and in the fixed-dim sum.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_widening_matches_the_portable_one() {
        if !std::is_x86_feature_detected!("f16c") {
            return;
        }
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&all);
        for (c, row) in bytes.chunks(37 * 2).enumerate() {
            let dim = row.len() / 2;
            let (mut portable, mut f16c) = (vec![0f32; dim], vec![0f32; dim]);
            decode_with::<Fp16>(row, &mut portable);
            decode_with::<Fp16F16c>(row, &mut f16c);
            for (d, (&a, &b)) in portable.iter().zip(&f16c).enumerate() {
                assert!(same(a, b), "{:#06x}: {a} != {b}", all[37 * c + d]);
            }
        }
        for row in bytes.chunks_exact(16 * 2) {
            let (mut portable, mut f16c) = ([0.25f32; 16], [0.25f32; 16]);
            // SAFETY: a whole row of 16 fp16 columns; the CPU has F16C.
            unsafe {
                Fp16::add_row(&mut portable, row.as_ptr(), -1.5);
                Fp16F16c::add_row(&mut f16c, row.as_ptr(), -1.5);
            }
            assert!(portable.iter().zip(&f16c).all(|(&a, &b)| same(a, b)));
        }
    }

    #[test]
    fn rows_read_back_what_was_written_to_their_precision() {
        let dim = 37;
        let src: Vec<f32> = (0..dim).map(|d| (d as f32 - 18.0) / 40.0).collect();
        for dtype in DataType::ALL {
            let mut rows = TableRows::new(dtype, 3, dim).unwrap();
            assert_eq!(rows.bytes().len(), 3 * dtype.row_bytes(dim).unwrap());
            rows.write_row(1, &src);
            let mut back = vec![0f32; dim];
            rows.read_row(0, &mut back);
            assert!(
                back.iter().all(|&x| x == 0.0),
                "{dtype}: zero bytes are zeros"
            );
            rows.read_row(1, &mut back);
            let tolerance = match dtype {
                DataType::Fp32 => 0.0,
                DataType::Fp16 => 2e-4,
                DataType::Bf16 => 2e-3,
                DataType::Int8 => 2e-3,
                DataType::Fp8 | DataType::Int4 => 0.04,
                DataType::Mxfp4 => 0.13,
            };
            for (x, y) in src.iter().zip(&back) {
                assert!((x - y).abs() <= tolerance, "{dtype}: {x} -> {y}");
            }
        }
    }

    #[test]
    fn fill_draws_the_same_values_for_every_type() {
        let draw = |chunk: usize, values: &mut [f32]| {
            for (i, v) in values.iter_mut().enumerate() {
                *v = ((chunk * 1000 + i) % 17) as f32 / 16.0;
            }
        };
        let mut reference = TableRows::new(DataType::Fp32, 10, 4).unwrap();
        reference.fill(3, draw);
        let mut half = TableRows::new(DataType::Fp16, 10, 4).unwrap();
        half.fill(3, draw);
        let (mut a, mut b) = (vec![0f32; 4], vec![0f32; 4]);
        for id in 0..10 {
            reference.read_row(id, &mut a);
            half.read_row(id, &mut b);
            // Sixteenths are exact in fp16.
            assert_eq!(a, b, "row {id}");
        }
    }
}
