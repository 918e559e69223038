//! Runtime choice of instruction set for the hot kernels.
//!
//! The lookup and update loops are short vector adds over rows; compiled for
//! baseline x86-64 (SSE2) they, not memory, become the bottleneck (measured:
//! 25 vs 40 M ids/s for 512-byte rows, 20 ids per bag). `multiversion!` builds
//! a kernel once per instruction set from one `#[inline(always)]` body and
//! picks the best the CPU has, so one binary runs everywhere.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Avx512,
    Avx2,
    Baseline,
}

pub(crate) fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // F16C comes with every AVX2 CPU made; it is checked all the same.
            let fma_f16c =
                std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c");
            if std::is_x86_feature_detected!("avx512f") && fma_f16c {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && fma_f16c {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    })
}

/// `multiversion!(pub(crate) fn name(args) -> Ret = body_fn);` defines `name`,
/// which calls `body_fn` (an `#[inline(always)]` function with the same
/// arguments) compiled for AVX-512, AVX2 (both with FMA and F16C) or
/// baseline, whichever the CPU supports.
///
/// `... = simd_body, baseline baseline_body` calls `simd_body` in the AVX2
/// and AVX-512 builds and `baseline_body` in the other: a body may then
/// use F16C, which only those builds enable
/// ([`Fp16F16c`](crate::rows::Fp16F16c)).
macro_rules! multiversion {
    ($vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty = $body:path) => {
        $crate::simd::multiversion!($vis fn $name($($arg: $ty),*) -> $ret = $body, baseline $body);
    };
    ($vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty = $simd:path, baseline $body:path) => {
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma,f16c")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $simd($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $simd($($arg),*)
                }
                match $crate::simd::isa() {
                    // SAFETY: isa() checked the CPU supports these features.
                    $crate::simd::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above, for the AVX2 build.
                    $crate::simd::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::Isa::Baseline => {}
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;
