//! fp16 and bf16 values: widening to fp32 in the kernels, and narrowing
//! from fp32 to the nearest value (initial rows, loaded checkpoints) or by
//! stochastic rounding (updated rows, as FBGEMM's `stochastic_rounding`).
//!
//! Stochastic rounding picks one of the two neighbours of `x` with the
//! probability that makes the expectation `x`: small updates to a row then
//! add up on average instead of being rounded away, which is what lets a
//! half-precision table train like an fp32 one.

const F16_SHIFTED_EXP: u32 = 0x7c00 << 13;

/// fp16 bits to fp32, exactly. Branch-free (selects only), so a row's
/// conversion vectorises (F. Giesen's method).
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let shifted = (h & 0x7fff) << 13;
    let exp = shifted & F16_SHIFTED_EXP;
    let normal = shifted + ((127 - 15) << 23);
    let inf_nan = normal + ((128 - 16) << 23);
    // A subnormal's bits, read with exponent 2^-14, less the implicit one.
    let magic = f32::from_bits(113 << 23);
    let subnormal = (f32::from_bits(normal + (1 << 23)) - magic).to_bits();
    let bits = if exp == F16_SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | (h & 0x8000) << 16)
}

/// bf16 bits to fp32, exactly (the top half of the fp32's bits).
#[inline(always)]
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// The nearest fp16 (ties to even; beyond the range, infinity).
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// The nearest bf16 (ties to even; NaN stays NaN, quieted, as the half
/// crate's). Branch-free (selects only), so a row's narrowing vectorises.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    // Adding 0x7fff plus the kept part's lowest bit rounds the dropped 16
    // bits to the nearest, ties to even; past the largest finite, infinity.
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let quiet_nan = (bits >> 16) | 0x0040;
    (if x.is_nan() { quiet_nan } else { rounded }) as u16
}

/// `src` narrowed to the nearest fp16 values (ties to even) at `dst`: by
/// F16C, 8 at a time, when `F16C` (the kernel builds that enable it).
///
/// # Safety
/// `dst` holds `src.len()` values; with `F16C`, the CPU has F16C.
#[inline(always)]
pub(crate) unsafe fn narrow_to_f16<const F16C: bool>(src: &[f32], dst: *mut u16) {
    let mut d = 0;
    #[cfg(target_arch = "x86_64")]
    if F16C {
        use std::arch::x86_64::{
            __m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
        };
        while d + 8 <= src.len() {
            let wide = _mm256_loadu_ps(src.as_ptr().add(d));
            let narrow = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(wide);
            _mm_storeu_si128(dst.add(d) as *mut __m128i, narrow);
            d += 8;
        }
    }
    for (i, &x) in src.iter().enumerate().skip(d) {
        *dst.add(i) = f32_to_f16(x);
    }
}

/// `src` narrowed to the nearest bf16 values (ties to even) at `dst`.
///
/// # Safety
/// `dst` holds `src.len()` values.
#[inline(always)]
pub(crate) unsafe fn narrow_to_bf16(src: &[f32], dst: *mut u16) {
    let dst = std::slice::from_raw_parts_mut(dst, src.len());
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = f32_to_bf16(x);
    }
}

/// `x` stochastically rounded to fp16 with the 32 random bits `r`: one of
/// the two fp16 values around `x`, the upper with probability
/// `(|x| - lower) / (upper - lower)`, so that the expectation is `x` (to
/// 2^-13 of a step). Values past fp16's range saturate to ±65504; NaN stays
/// NaN. Branch-free (selects only), so a row's rounding vectorises.
#[inline(always)]
pub(crate) fn f32_to_f16_stochastic(x: f32, r: u32) -> u16 {
    let bits = x.to_bits();
    let (sign, abs) = ((bits >> 16) & 0x8000, bits & 0x7fff_ffff);
    let noise = r >> 19;
    // Normals, [2^-14, 65504]: fp16 keeps the top 10 of fp32's 23 mantissa
    // bits, so adding 13 random bits below them and truncating rounds up
    // with probability equal to the dropped fraction (the bf16 method);
    // the truncated fp32 is an fp16 value, re-biased exactly. Past 65504
    // (infinity too) it saturates.
    let kept = (abs.min(0x477f_e000) + noise).min(0x477f_e000) & !0x1fff;
    let normal = (kept >> 13).wrapping_sub((127 - 15) << 10);
    // Subnormals, below 2^-14, are multiples of 2^-24: |x| in units of
    // 2^-37 (exact for |x| >= 2^-37) gets the same 13 random bits, and the
    // carry into 2^-14 lands on the smallest normal's bits by itself.
    // Clamped to 2^-14 first, so the product is in [0, 2^23] (NaN's bits
    // clamp too) and converts without Rust's saturating `as`, which does
    // not vectorise: it was a third of the fp16 update's time.
    let below_normal = f32::from_bits(abs.min(0x3880_0000)) * 2f32.powi(37);
    // SAFETY: `below_normal` is finite and in [0, 2^23], an i32's range.
    let units = unsafe { below_normal.to_int_unchecked::<i32>() } as u32;
    // (For values that are not subnormal, this lane is discarded.)
    let subnormal = (units + noise) >> 13;
    let magnitude = if abs < 0x3880_0000 { subnormal } else { normal };
    let nan = abs > 0x7f80_0000;
    (sign | if nan { 0x7e00 } else { magnitude }) as u16
}

/// `x` stochastically rounded to bf16 with the random bits `r`: adding 16
/// random bits below the kept half, then truncating, rounds up with
/// probability equal to the dropped fraction (FBGEMM's method). Values that
/// would round past the largest finite bf16 stay there; infinities and NaN
/// stay what they are. Branch-free.
#[inline(always)]
pub(crate) fn f32_to_bf16_stochastic(x: f32, r: u32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(r >> 16) >> 16;
    // A carry into an all-ones exponent would make infinity: keep the
    // largest finite; what is already infinite or NaN truncates.
    let special = bits & 0x7f80_0000 == 0x7f80_0000 || rounded & 0x7f80 == 0x7f80;
    let out = if special { bits >> 16 } else { rounded };
    // NaN stays NaN: keep a mantissa bit the truncation may have dropped.
    let nan = bits & 0x7fff_ffff > 0x7f80_0000;
    (if nan { out | 0x40 } else { out }) as u16
}

/// The random bits of column `column` of the row keyed `row_key` (from
/// the seed, table, step and global row): a hash of where the value is, so
/// every draw is the same whatever the threads or the sharding. 32-bit
/// multiplies only (murmur3's finaliser), so a row's draws vectorise.
#[inline(always)]
pub(crate) fn rounding_bits(row_key: u64, column: u64) -> u32 {
    let mut h =
        (row_key as u32 ^ (row_key >> 32) as u32) ^ (column as u32).wrapping_mul(0x9E37_79B9);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// About a million fp32 bit patterns spread over all of them (every
    /// sign, exponent, NaN and infinity), and the ones around each bf16/fp16
    /// rounding boundary that matter most: ties, and one either side.
    fn sample_bits() -> impl Iterator<Item = u32> {
        let spread = (0..=u32::MAX).step_by(4099);
        let ties = (0..1u32 << 16).flat_map(|k| {
            let tie = (k << 16) | 0x8000;
            [tie - 1, tie, tie + 1, (k << 13) | 0x1000]
        });
        spread
            .chain(ties)
            .chain([0x7f7f_ffff, 0x7f80_0000, 0xff80_0000, 0x7fc0_0001])
    }

    #[test]
    fn bf16_narrowing_is_the_half_crates_nearest() {
        for bits in sample_bits() {
            let x = f32::from_bits(bits);
            let (got, want) = (f32_to_bf16(x), half::bf16::from_f32(x).to_bits());
            assert_eq!(got, want, "{bits:#010x}");
        }
    }

    #[test]
    fn f16_narrowing_of_a_slice_is_the_nearest_in_every_build() {
        let src: Vec<f32> = sample_bits().map(f32::from_bits).collect();
        let want: Vec<u16> = src.iter().map(|&x| f32_to_f16(x)).collect();
        let check = |got: &[u16]| {
            for ((&g, &w), x) in got.iter().zip(&want).zip(&src) {
                let (g16, w16) = (half::f16::from_bits(g), half::f16::from_bits(w));
                assert!(
                    g == w || (g16.is_nan() && w16.is_nan()),
                    "{x:e}: {g:#06x} != {w:#06x}"
                );
            }
        };
        let mut got = vec![0u16; src.len()];
        // SAFETY: `got` holds `src.len()` values.
        unsafe { narrow_to_f16::<false>(&src, got.as_mut_ptr()) };
        check(&got);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("f16c") {
            #[target_feature(enable = "f16c")]
            unsafe fn with_f16c(src: &[f32], dst: &mut [u16]) {
                narrow_to_f16::<true>(src, dst.as_mut_ptr())
            }
            // Odd lengths too, so the tail after the last 8 is covered.
            for len in [src.len(), src.len() - 5] {
                let mut got = vec![0u16; len];
                // SAFETY: the CPU has F16C; `got` holds `len` values.
                unsafe { with_f16c(&src[..len], &mut got) };
                check(&got);
            }
        }
    }

    #[test]
    fn f16_widening_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} != {want}"
            );
        }
    }

    #[test]
    fn bf16_widening_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = half::bf16::from_bits(h).to_f32();
            let got = bf16_to_f32(h);
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
        }
    }

    /// The two neighbours of `x` in the narrow type, by its widening.
    fn neighbours(x: f32, nearest: fn(f32) -> u16, widen: fn(u16) -> f32) -> (f32, f32) {
        let n = nearest(x);
        let v = widen(n);
        let step = |b: u16, up: bool| {
            // Magnitude steps on sign-magnitude bits.
            let toward_bigger = up == (widen(b) >= 0.0);
            if toward_bigger {
                b + 1
            } else if b & 0x7fff == 0 {
                (b ^ 0x8000) + 1
            } else {
                b - 1
            }
        };
        if v == x {
            (v, v)
        } else if v < x {
            (v, widen(step(n, true)))
        } else {
            (widen(step(n, false)), v)
        }
    }

    proptest! {
        /// Every stochastic result is one of x's two neighbours, and which
        /// one follows the bits: all-zero bits round toward zero.
        #[test]
        fn stochastic_rounding_lands_on_a_neighbour(x in -60000.0f32..60000.0, scale in -30i32..1, r: u32) {
            let x = x * 2f32.powi(scale);
            for (round, nearest, widen) in [
                (f32_to_f16_stochastic as fn(f32, u32) -> u16, f32_to_f16 as fn(f32) -> u16, f16_to_f32 as fn(u16) -> f32),
                (f32_to_bf16_stochastic, f32_to_bf16, bf16_to_f32),
            ] {
                let (lo, hi) = neighbours(x, nearest, widen);
                let got = widen(round(x, r));
                prop_assert!(got == lo || got == hi, "{x}: {got} not in [{lo}, {hi}]");
                let toward_zero = widen(round(x, 0));
                prop_assert_eq!(toward_zero.abs(), lo.abs().min(hi.abs()));
            }
        }
    }

    /// The mean of many stochastic roundings of x is x (to the sampling
    /// error), where nearest rounding is off by a fixed amount.
    #[test]
    fn stochastic_rounding_is_unbiased() {
        for (x, round, widen) in [
            (
                1.0f32 + 0.3 * 2f32.powi(-10),
                f32_to_f16_stochastic as fn(f32, u32) -> u16,
                f16_to_f32 as fn(u16) -> f32,
            ),
            (-3.0e-6, f32_to_f16_stochastic, f16_to_f32),
            (
                1.0 + 0.3 * 2f32.powi(-7),
                f32_to_bf16_stochastic,
                bf16_to_f32,
            ),
            (-7.7e-3, f32_to_bf16_stochastic, bf16_to_f32),
        ] {
            let n = 200_000u64;
            let mean = (0..n)
                .map(|i| widen(round(x, rounding_bits(7, i))) as f64)
                .sum::<f64>()
                / n as f64;
            let (lo, hi) = (widen(round(x, 0)) as f64, widen(round(x, u32::MAX)) as f64);
            // Binomial sampling error of the mean: (hi - lo) / (2 sqrt n) at most.
            let sigma = (hi - lo).abs() / (2.0 * (n as f64).sqrt());
            assert!(
                (mean - x as f64).abs() < 5.0 * sigma,
                "{x}: mean {mean}, sigma {sigma}"
            );
        }
    }

    #[test]
    fn stochastic_rounding_keeps_specials_and_saturates() {
        assert!(f16_to_f32(f32_to_f16_stochastic(f32::NAN, 1)).is_nan());
        assert_eq!(f16_to_f32(f32_to_f16_stochastic(1e9, u32::MAX)), 65504.0);
        assert_eq!(f16_to_f32(f32_to_f16_stochastic(-1e9, 0)), -65504.0);
        assert_eq!(
            bf16_to_f32(f32_to_bf16_stochastic(f32::MAX, u32::MAX)),
            half::bf16::MAX.to_f32()
        );
        assert_eq!(f16_to_f32(f32_to_f16_stochastic(0.0, u32::MAX)), 0.0);
        assert_eq!(f16_to_f32(f32_to_f16_stochastic(0.5, u32::MAX)), 0.5);
    }
}
