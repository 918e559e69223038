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
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma") {
                return Isa::Avx512;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    })
}

/// `multiversion!(pub(crate) fn name(args) -> Ret = body_fn);` defines `name`,
/// which calls `body_fn` (an `#[inline(always)]` function with the same
/// arguments) compiled for AVX-512, AVX2+FMA or baseline, whichever the CPU
/// supports.
macro_rules! multiversion {
    ($vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty = $body:path) => {
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    $body($($arg),*)
                }
                match $crate::simd::isa() {
                    // SAFETY: isa() checked the CPU supports these features.
                    $crate::simd::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::simd::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::Isa::Baseline => {}
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;
