//! Memory for embedding tables: one contiguous, 64-byte aligned
//! allocation per table (rows in the table's data type, or optimizer state). Large tables are 2 MiB aligned and advised to use
//! transparent huge pages *before* they are first touched, because random row
//! gathers over gigabytes are bound by TLB misses on 4 KiB pages (about 1.4x
//! on 512-byte rows on this machine, 3x on 64-byte rows).

use std::alloc::{alloc, dealloc, Layout};
use std::ptr::NonNull;

use rayon::prelude::*;

const HUGE_PAGE: usize = 2 << 20;
/// Bytes zeroed per parallel task (4 MiB).
const ZERO_CHUNK: usize = 4 << 20;

/// A fixed-size buffer of plain values (`f32` by default; `u8` for rows of
/// other data types), zeroed at birth, then filled by `new`'s caller.
pub struct AlignedBuffer<T: bytemuck::Pod = f32> {
    ptr: NonNull<T>,
    len: usize,
    layout: Layout,
}

// SAFETY: AlignedBuffer owns its allocation exclusively, like Vec<T>.
unsafe impl<T: bytemuck::Pod + Send> Send for AlignedBuffer<T> {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl<T: bytemuck::Pod + Sync> Sync for AlignedBuffer<T> {}

impl<T: bytemuck::Pod> AlignedBuffer<T> {
    /// Allocates `len` values, advises huge pages when large, zeroes them,
    /// then lets `fill` write them (in parallel if it likes) before anyone
    /// reads. Returns `None` when the allocation fails.
    pub fn new(len: usize, fill: impl FnOnce(&mut [T])) -> Option<Self> {
        let bytes = len.max(1).checked_mul(std::mem::size_of::<T>())?;
        let layout = line_or_page_layout(bytes, std::mem::align_of::<T>())?;
        let ptr = allocate_advised(layout)?.cast::<T>();
        let raw = ptr.as_ptr();
        // Zero in parallel (first touch of every page, after the huge-page
        // advice, so pages come back huge) before any slice exists. Zero
        // bytes are a valid T (Pod).
        let base = raw as usize;
        let in_use = len * std::mem::size_of::<T>();
        (0..in_use.div_ceil(ZERO_CHUNK))
            .into_par_iter()
            .for_each(|chunk| {
                let start = chunk * ZERO_CHUNK;
                let count = ZERO_CHUNK.min(in_use - start);
                // SAFETY: each chunk is a disjoint byte range of our allocation.
                unsafe { std::ptr::write_bytes((base as *mut u8).add(start), 0, count) };
            });
        // SAFETY: allocated for `len` values, all zeroed above.
        let slice = unsafe { std::slice::from_raw_parts_mut(raw, len) };
        fill(slice);
        Some(Self { ptr, len, layout })
    }

    /// The `len` values.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: initialised in `new`, len elements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The `len` values, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: initialised in `new`, len elements, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Address of the first value (64-byte aligned, 2 MiB for large buffers).
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: bytemuck::Pod> Drop for AlignedBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr() as *mut u8, self.layout) }
    }
}

impl<T: bytemuck::Pod> Clone for AlignedBuffer<T> {
    fn clone(&self) -> Self {
        let src = self.as_slice();
        // An allocation failure on clone is as fatal as for Vec::clone.
        Self::new(self.len, |dst| dst.copy_from_slice(src)).expect("allocation failed")
    }
}

impl<T: bytemuck::Pod> std::fmt::Debug for AlignedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "AlignedBuffer({} x {})",
            self.len,
            std::any::type_name::<T>()
        )
    }
}

/// `len` zeros in a `Vec`, its whole 2 MiB pages advised to be huge before
/// they are first touched (large outputs are written at a stride of a row:
/// with 4 KiB pages nearly every write is a TLB miss).
pub(crate) fn zeroed_vec<T: Copy + Default>(len: usize) -> Vec<T> {
    let bytes = len.saturating_mul(std::mem::size_of::<T>());
    if bytes < 2 * HUGE_PAGE {
        return vec![T::default(); len];
    }
    let mut v: Vec<T> = Vec::with_capacity(len);
    let start = v.as_mut_ptr() as usize;
    let (first, end) = (start.next_multiple_of(HUGE_PAGE), start + bytes);
    advise_huge_pages(first as *mut u8, (end - first) / HUGE_PAGE * HUGE_PAGE);
    v.resize(len, T::default());
    v
}

/// A fixed-size array for values read at random (a cache's tags and
/// stamps, a log's positions): 64-byte aligned, so that a group of 16
/// four-byte values is one cache line (a `Vec`'s large allocations start
/// 16 bytes into a page, so every such group spanned two lines, one of
/// them not prefetched), and when large 2 MiB aligned and advised huge
/// before first touch (with 4 KiB pages nearly every read is a TLB miss).
pub(crate) struct HugeArray<T> {
    ptr: NonNull<T>,
    len: usize,
    layout: Layout,
}

// SAFETY: HugeArray owns its values exclusively, like Vec<T>.
unsafe impl<T: Send> Send for HugeArray<T> {}
// SAFETY: shared use is sound for the reason `Send` is, above.
unsafe impl<T: Sync> Sync for HugeArray<T> {}

impl<T> HugeArray<T> {
    /// `len` values made by `value`. Aborts when memory runs out, as `Vec`
    /// does (callers estimate the bytes first).
    pub(crate) fn new(len: usize, mut value: impl FnMut() -> T) -> Self {
        let bytes = len
            .max(1)
            .checked_mul(std::mem::size_of::<T>().max(1))
            .expect("array size overflows");
        let layout = line_or_page_layout(bytes, std::mem::align_of::<T>()).expect("array layout");
        let Some(ptr) = allocate_advised(layout) else {
            std::alloc::handle_alloc_error(layout)
        };
        let ptr = ptr.cast::<T>();
        let raw = ptr.as_ptr();
        for i in 0..len {
            // SAFETY: within the allocation; each value written once.
            unsafe { raw.add(i).write(value()) };
        }
        Self { ptr, len, layout }
    }
}

impl<T> std::ops::Deref for HugeArray<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` values initialised in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for HugeArray<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: `len` values initialised in `new`, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for HugeArray<T> {
    fn drop(&mut self) {
        // SAFETY: the values were initialised in `new`, the memory
        // allocated there with this layout.
        unsafe {
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ));
            dealloc(self.ptr.as_ptr() as *mut u8, self.layout);
        }
    }
}

impl<T> std::fmt::Debug for HugeArray<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HugeArray({} x {})",
            self.len,
            std::any::type_name::<T>()
        )
    }
}

/// `bytes` (non-zero) aligned to a cache line, or to a huge page from a
/// huge page's size up (and at least to `align`).
fn line_or_page_layout(bytes: usize, align: usize) -> Option<Layout> {
    let line_or_page = if bytes >= HUGE_PAGE { HUGE_PAGE } else { 64 };
    Layout::from_size_align(bytes, line_or_page.max(align)).ok()
}

/// Memory for `layout` (non-zero size), its whole huge pages advised huge
/// before anyone touches them; `None` when the allocation fails.
fn allocate_advised(layout: Layout) -> Option<NonNull<u8>> {
    // SAFETY: layout has non-zero size.
    let ptr = NonNull::new(unsafe { alloc(layout) })?;
    if layout.align() >= HUGE_PAGE {
        advise_huge_pages(ptr.as_ptr(), layout.size() / HUGE_PAGE * HUGE_PAGE);
    }
    Some(ptr)
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: *mut u8, bytes: usize) {
    // Advice only: a kernel without THP simply ignores it.
    // SAFETY: the range is one live allocation of ours.
    unsafe {
        libc::madvise(ptr as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_ptr: *mut u8, _bytes: usize) {}

/// Hints the CPU to start loading `bytes` bytes at `ptr` into cache.
/// The pointer may be anything: prefetches never fault.
#[inline(always)]
pub fn prefetch<T>(ptr: *const T, bytes: usize) {
    prefetch_every(ptr, bytes, 64)
}

/// Like [`prefetch`], one hint every `step` bytes. With 128, the CPU's
/// adjacent-line prefetcher fetches the other half of each pair: fewer hint
/// instructions and miss-buffer slots, which pays off with several ids per
/// bag (measured: -15% time at 20 ids, +5% at 1-2 ids, 512-byte rows).
#[inline(always)]
pub fn prefetch_every<T>(ptr: *const T, bytes: usize, step: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut off = 0;
        while off < bytes {
            // SAFETY: prefetch is a hint and never faults, whatever the address.
            unsafe { _mm_prefetch((ptr as *const i8).wrapping_add(off), _MM_HINT_T0) };
            off += step;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ptr, bytes);
    }
}

/// Memory this process can still take without swapping (Linux's
/// `MemAvailable`), or `None` where the system does not say.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::HugeArray;

    /// Sixteen 4-byte values from a multiple of 16 share one cache line, in
    /// small and large arrays (a large `Vec` starts 16 bytes into a page,
    /// which put every set of a cache across two lines); values are made
    /// in order and dropped with the array.
    #[test]
    fn huge_arrays_start_on_a_cache_line_and_drop_their_values() {
        for len in [1usize, 100, 3 << 20] {
            let mut next = 0u32;
            let array = HugeArray::new(len, || {
                next += 1;
                next
            });
            assert_eq!(array.as_ptr() as usize % 64, 0, "{len} values");
            assert!(array.iter().copied().eq(1..=len as u32));
        }
        let alive = std::rc::Rc::new(());
        let array = HugeArray::new(5, || alive.clone());
        assert_eq!(std::rc::Rc::strong_count(&alive), 6);
        drop(array);
        assert_eq!(std::rc::Rc::strong_count(&alive), 1);
    }
}
