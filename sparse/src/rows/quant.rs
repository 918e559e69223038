//! Quantized rows for inference: row-wise int8 and int4 (a scale and a bias
//! per row, as FBGEMM's fused row-wise quantization), FP8 E4M3 scaled per
//! row, and OCP MXFP4. Each is a quantizer (fp32 row to bytes) here and a
//! [`RowFormat`] (bytes to values) that the kernels and `read_row` share.
//! Layouts: [`DataType`](crate::DataType)'s variants.

use super::half::{f16_to_f32, f32_to_f16};
use super::RowFormat;
use crate::dtype::{FP8_HEADER, MX_GROUP, NBIT_HEADER};
use crate::DataType;

/// Row-wise `BITS`-bit integers (8 or 4): fp16 scale, fp16 bias, codes.
pub(crate) struct NBit<const BITS: u32>;

/// The scale and bias of an int8/int4 row.
#[derive(Clone, Copy)]
pub(crate) struct ScaleBias {
    scale: f32,
    bias: f32,
}

impl<const BITS: u32> RowFormat for NBit<BITS> {
    const DTYPE: DataType = if BITS == 8 {
        DataType::Int8
    } else {
        DataType::Int4
    };
    type Header = ScaleBias;

    #[inline(always)]
    unsafe fn header(row: *const u8, _dim: usize) -> ScaleBias {
        let half = |at: usize| f16_to_f32(u16::from_le_bytes([*row.add(at), *row.add(at + 1)]));
        ScaleBias {
            scale: half(0),
            bias: half(2),
        }
    }

    #[inline(always)]
    unsafe fn value(row: *const u8, h: ScaleBias, _dim: usize, d: usize) -> f32 {
        let codes = row.add(NBIT_HEADER);
        let q = if BITS == 8 {
            *codes.add(d)
        } else {
            (*codes.add(d / 2) >> (4 * (d % 2))) & 0xf
        };
        h.scale * q as f32 + h.bias
    }

    #[inline(always)]
    unsafe fn add_row<const D: usize>(acc: &mut [f32; D], row: *const u8, w: f32) {
        let h = Self::header(row, D);
        let codes = row.add(NBIT_HEADER);
        if BITS == 8 || D % 2 == 1 {
            for (d, a) in acc.iter_mut().enumerate() {
                *a += w * Self::value(row, h, D, d);
            }
            return;
        }
        // Two columns per byte: unpack both nibbles of each byte, the same
        // values as `value` gives column by column.
        for (i, pair) in acc.chunks_exact_mut(2).enumerate() {
            let byte = *codes.add(i);
            pair[0] += w * (h.scale * (byte & 0xf) as f32 + h.bias);
            pair[1] += w * (h.scale * (byte >> 4) as f32 + h.bias);
        }
    }
}

/// Quantizes `src` into an int8 (`BITS = 8`) or int4 row `dst`: the bias is
/// the row's minimum (rounded down to fp16), the scale its range over
/// `2^BITS - 1` (fp16; 1 for a constant row), codes rounded to nearest.
pub(crate) fn quantize_nbit<const BITS: u32>(src: &[f32], dst: &mut [u8]) {
    let levels = ((1u32 << BITS) - 1) as f32;
    let (min, max) = src
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        });
    let (min, max) = if src.is_empty() {
        (0.0, 0.0)
    } else {
        (min, max)
    };
    let mut bias = f32_to_f16(min);
    if f16_to_f32(bias) > min {
        // One fp16 step toward -inf, so no value lies below the bias.
        bias = if bias & 0x7fff == 0 {
            0x8001
        } else if bias & 0x8000 != 0 {
            bias + 1
        } else {
            bias - 1
        };
    }
    let bias_value = f16_to_f32(bias);
    let mut scale = f32_to_f16((max - bias_value) / levels);
    let scale_value = f16_to_f32(scale);
    if scale_value == 0.0 || !scale_value.is_finite() {
        scale = f32_to_f16(1.0);
    }
    let inverse = 1.0 / f16_to_f32(scale);
    dst[..2].copy_from_slice(&scale.to_le_bytes());
    dst[2..4].copy_from_slice(&bias.to_le_bytes());
    let codes = &mut dst[NBIT_HEADER..];
    codes.fill(0);
    for (d, &x) in src.iter().enumerate() {
        let q = ((x - bias_value) * inverse)
            .round_ties_even()
            .clamp(0.0, levels) as u8;
        if BITS == 8 {
            codes[d] = q;
        } else {
            codes[d / 2] |= q << (4 * (d % 2));
        }
    }
}

/// FP8 E4M3 scaled per row: an fp32 scale, then one E4M3 byte per column.
pub(crate) struct Fp8;

/// The value of each E4M3 byte (OCP E4M3FN: bias 7, no infinities,
/// `S.1111.111` is NaN).
static E4M3: [f32; 256] = e4m3_values();

const fn e4m3_values() -> [f32; 256] {
    let mut out = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        let sign = ((b >> 7) as u32) << 31;
        let (e, m) = ((b >> 3) & 0xf, (b & 7) as u32);
        let bits = if e == 0xf && m == 7 {
            0x7fc0_0000
        } else if e == 0 && m == 0 {
            0
        } else if e == 0 {
            // Subnormal m * 2^-9: normalise on m's leading bit p.
            let p = 31 - m.leading_zeros();
            ((127 - 9 + p) << 23) | ((m - (1 << p)) << (23 - p))
        } else {
            ((e as u32 + 127 - 7) << 23) | (m << 20)
        };
        out[b] = f32::from_bits(bits | sign);
        b += 1;
    }
    out
}

/// The largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;

impl RowFormat for Fp8 {
    const DTYPE: DataType = DataType::Fp8;
    type Header = f32;

    #[inline(always)]
    unsafe fn header(row: *const u8, _dim: usize) -> f32 {
        f32::from_le_bytes([*row, *row.add(1), *row.add(2), *row.add(3)])
    }

    #[inline(always)]
    unsafe fn value(row: *const u8, scale: f32, _dim: usize, d: usize) -> f32 {
        scale * E4M3[*row.add(FP8_HEADER + d) as usize]
    }
}

/// Quantizes `src` into an fp8 row `dst`: scale `max |x| / 448` (1 for a
/// row of zeros), each `x / scale` to the nearest E4M3 (ties to even).
pub(crate) fn quantize_fp8(src: &[f32], dst: &mut [u8]) {
    let amax = src.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    };
    dst[..FP8_HEADER].copy_from_slice(&scale.to_le_bytes());
    for (q, &x) in dst[FP8_HEADER..].iter_mut().zip(src) {
        let v = x / scale;
        *q = if v.is_nan() {
            0x7f
        } else {
            nearest_code(&E4M3[..0x7f], v.abs()) | if v.is_sign_negative() { 0x80 } else { 0 }
        };
    }
}

/// OCP MXFP4: groups of 32 E2M1 values, each group followed by its E8M0 scale.
pub(crate) struct Mxfp4;

/// The magnitudes of the E2M1 codes 0..8 (bit 3 is the sign).
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
/// Signed E2M1 values of all 16 codes.
const E2M1_SIGNED: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];
/// E2M1's largest exponent: 6 = 1.5 x 2^2.
const E2M1_EMAX: i32 = 2;

/// Where group `g`'s bytes start in an MXFP4 row, and how many values it has.
#[inline(always)]
fn mx_group(dim: usize, g: usize) -> (usize, usize) {
    (g * (MX_GROUP / 2 + 1), MX_GROUP.min(dim - g * MX_GROUP))
}

/// The value 2^(b - 127) of an E8M0 scale byte (b = 0 is 2^-127, a subnormal fp32).
#[inline(always)]
fn e8m0(b: u8) -> f32 {
    if b == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits((b as u32) << 23)
    }
}

impl RowFormat for Mxfp4 {
    const DTYPE: DataType = DataType::Mxfp4;
    type Header = ();

    #[inline(always)]
    unsafe fn header(_row: *const u8, _dim: usize) {}

    #[inline(always)]
    unsafe fn value(row: *const u8, _: (), dim: usize, d: usize) -> f32 {
        let (start, len) = mx_group(dim, d / MX_GROUP);
        let i = d % MX_GROUP;
        let code = (*row.add(start + i / 2) >> (4 * (i % 2))) & 0xf;
        e8m0(*row.add(start + len.div_ceil(2))) * E2M1_SIGNED[code as usize]
    }

    #[inline(always)]
    unsafe fn add_row<const D: usize>(acc: &mut [f32; D], row: *const u8, w: f32) {
        if D % 2 == 1 {
            for (d, a) in acc.iter_mut().enumerate() {
                *a += w * Self::value(row, (), D, d);
            }
            return;
        }
        // Group by group, two columns per byte: the same values as `value`
        // gives column by column, with the group's scale read once.
        for (g, group) in acc.chunks_mut(MX_GROUP).enumerate() {
            let (start, len) = mx_group(D, g);
            let scale = e8m0(*row.add(start + len.div_ceil(2)));
            for (i, pair) in group.chunks_exact_mut(2).enumerate() {
                let byte = *row.add(start + i);
                pair[0] += w * (scale * E2M1_SIGNED[(byte & 0xf) as usize]);
                pair[1] += w * (scale * E2M1_SIGNED[(byte >> 4) as usize]);
            }
        }
    }
}

/// Quantizes `src` into an MXFP4 row `dst`, group by group as the OCP MX
/// specification says: the shared scale is 2^(floor(log2(max |x|)) - 2),
/// each `x / scale` goes to the nearest E2M1 (ties to even), saturating at ±6.
pub(crate) fn quantize_mxfp4(src: &[f32], dst: &mut [u8]) {
    let dim = src.len();
    dst.fill(0);
    for g in 0..dim.div_ceil(MX_GROUP) {
        let (start, len) = mx_group(dim, g);
        let values = &src[g * MX_GROUP..g * MX_GROUP + len];
        let amax = values.iter().fold(0f32, |m, x| m.max(x.abs()));
        let shared = if amax > 0.0 && amax.is_finite() {
            (amax.log2().floor() as i32 - E2M1_EMAX).clamp(-127, 127)
        } else {
            -127
        };
        let byte = (shared + 127) as u8;
        let scale = e8m0(byte);
        for (i, &x) in values.iter().enumerate() {
            let magnitude = nearest_code(&E2M1, (x / scale).abs());
            let code = magnitude
                | if x.is_sign_negative() && magnitude != 0 {
                    8
                } else {
                    0
                };
            dst[start + i / 2] |= code << (4 * (i % 2));
        }
        dst[start + len.div_ceil(2)] = byte;
    }
}

/// The code of the value of `grid` nearest `a` (a magnitude: `grid` holds
/// the values of codes 0, 1, ..., increasing from 0), ties to the even
/// code, saturating at the largest.
fn nearest_code(grid: &[f32], a: f32) -> u8 {
    let above = grid.partition_point(|&v| v < a);
    let code = if above == 0 {
        0
    } else if above == grid.len() {
        grid.len() - 1
    } else {
        let (lo, hi) = (grid[above - 1], grid[above]);
        match (a - lo).partial_cmp(&(hi - a)) {
            Some(std::cmp::Ordering::Less) => above - 1,
            Some(std::cmp::Ordering::Greater) => above,
            _ if (above - 1) % 2 == 0 => above - 1,
            _ => above,
        }
    };
    code as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::decode_with;
    use proptest::prelude::*;

    #[test]
    fn e4m3_values_follow_the_ocp_table() {
        assert_eq!(E4M3[0x01], 2f32.powi(-9));
        assert_eq!(E4M3[0x07], 7.0 * 2f32.powi(-9));
        assert_eq!(E4M3[0x08], 2f32.powi(-6));
        assert_eq!(E4M3[0x38], 1.0);
        assert_eq!(E4M3[0x7e], 448.0);
        assert!(E4M3[0x7f].is_nan() && E4M3[0xff].is_nan());
        assert_eq!(E4M3[0xb8], -1.0);
        // Positive codes increase: the grid nearest_code searches is sorted.
        assert!(E4M3[..0x7f].windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn nearest_rounds_ties_to_even_and_saturates() {
        // 1.0625 is halfway between 1.0 (code 0x38) and 1.125 (0x39): even wins.
        assert_eq!(nearest_code(&E4M3[..0x7f], 1.0625), 0x38);
        assert_eq!(nearest_code(&E4M3[..0x7f], 1.1875), 0x3a);
        assert_eq!(nearest_code(&E4M3[..0x7f], 1000.0), 0x7e);
        // E2M1: 2.5 is between 2 (code 4) and 3 (code 5): 4; 5 between 4 and 6: 6 (code 6).
        assert_eq!(nearest_code(&E2M1, 2.5), 4);
        assert_eq!(nearest_code(&E2M1, 5.0), 6);
        assert_eq!(nearest_code(&E2M1, 0.25), 0);
        assert_eq!(nearest_code(&E2M1, 9.0), 7);
    }

    fn round_trip<F: RowFormat>(
        quantize: fn(&[f32], &mut [u8]),
        dtype: crate::DataType,
        row: &[f32],
    ) -> Vec<f32> {
        let mut bytes = vec![0u8; dtype.row_bytes(row.len()).unwrap()];
        quantize(row, &mut bytes);
        let mut out = vec![0f32; row.len()];
        decode_with::<F>(&bytes, &mut out);
        out
    }

    proptest! {
        /// Each format's error on a row stays within its step: int8/int4
        /// half a code step of the row's range (and the fp16 scale's
        /// rounding); fp8 a 16th of the value plus the subnormal step; MXFP4
        /// two group scales (its step at the top, and the clipping of values
        /// above 6 scales).
        #[test]
        fn quantized_rows_stay_within_their_steps(
            row in proptest::collection::vec(-1.0f32..1.0, 1..70),
            magnitude in -12i32..3,
        ) {
            let row: Vec<f32> = row.iter().map(|x| x * 2f32.powi(magnitude)).collect();
            let (min, max) = row.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
            let range = max - min;
            for (bits, got) in [
                (8, round_trip::<NBit<8>>(quantize_nbit::<8>, crate::DataType::Int8, &row)),
                (4, round_trip::<NBit<4>>(quantize_nbit::<4>, crate::DataType::Int4, &row)),
            ] {
                // Half a step, plus what the fp16 scale's rounding adds at
                // the top code (relative 2^-11, or half the subnormal step
                // 2^-25 for tiny rows); the bias sits up to one fp16 step
                // below the minimum, widening the step a little.
                let levels = ((1 << bits) - 1) as f32;
                let step = (range + min.abs() * 2f32.powi(-9) + 2f32.powi(-23)) / levels;
                let bound = 0.5 * step + levels * (step * 2f32.powi(-11)).max(2f32.powi(-25));
                for (x, y) in row.iter().zip(&got) {
                    prop_assert!((x - y).abs() <= bound, "int{bits}: {x} -> {y}, bound {bound}");
                }
            }
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            let got = round_trip::<Fp8>(quantize_fp8, crate::DataType::Fp8, &row);
            for (x, y) in row.iter().zip(&got) {
                let bound = x.abs() / 16.0 + amax / 448.0 * 2f32.powi(-10);
                prop_assert!((x - y).abs() <= bound * 1.0001, "fp8: {x} -> {y}");
            }
            let got = round_trip::<Mxfp4>(quantize_mxfp4, crate::DataType::Mxfp4, &row);
            for (g, (xs, ys)) in row.chunks(MX_GROUP).zip(got.chunks(MX_GROUP)).enumerate() {
                let gmax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
                let scale = if gmax > 0.0 { 2f32.powi(gmax.log2().floor() as i32 - 2) } else { 0.0 };
                for (x, y) in xs.iter().zip(ys) {
                    prop_assert!((x - y).abs() <= 2.0 * scale, "mxfp4 group {g}: {x} -> {y}");
                }
            }
        }
    }

    #[test]
    fn constant_and_zero_rows_quantize_exactly() {
        let zeros = [0f32; 40];
        assert_eq!(
            round_trip::<NBit<8>>(quantize_nbit::<8>, crate::DataType::Int8, &zeros),
            zeros
        );
        assert_eq!(
            round_trip::<NBit<4>>(quantize_nbit::<4>, crate::DataType::Int4, &zeros),
            zeros
        );
        assert_eq!(
            round_trip::<Fp8>(quantize_fp8, crate::DataType::Fp8, &zeros),
            zeros
        );
        assert_eq!(
            round_trip::<Mxfp4>(quantize_mxfp4, crate::DataType::Mxfp4, &zeros),
            zeros
        );
        let ones = [0.5f32; 7];
        assert_eq!(
            round_trip::<NBit<4>>(quantize_nbit::<4>, crate::DataType::Int4, &ones),
            ones
        );
    }

    #[test]
    fn mxfp4_layout_is_values_then_the_scale_byte_per_group() {
        // 33 columns: one group of 32 (16 bytes + scale), one of 1 (1 byte + scale).
        let mut row = vec![0f32; 33];
        row[0] = 1.0; // amax 1: shared exponent 0 - 2 = -2, scale byte 125
        row[1] = -0.5; // -0.5 / 0.25 = -2: code 0b1100
        row[32] = 6.0; // amax 6: exponent 2 - 2 = 0, byte 127; 6 / 1 = code 7
        let mut bytes = vec![0u8; crate::DataType::Mxfp4.row_bytes(33).unwrap()];
        quantize_mxfp4(&row, &mut bytes);
        assert_eq!(bytes.len(), 19);
        assert_eq!(
            bytes[0],
            0x6 | (0xc << 4),
            "1.0 / 0.25 = 4 is code 6, low nibble"
        );
        assert_eq!(bytes[16], 125);
        assert_eq!(bytes[17], 7);
        assert_eq!(bytes[18], 127);
    }
}
