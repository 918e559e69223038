//! Flat little-endian encoding of the arrays devices exchange, so a
//! collective moves plain bytes (in-process here, MPI later). Arrays are
//! copied in bulk: the machine's own layout is little-endian.

#[cfg(not(target_endian = "little"))]
compile_error!("the wire format copies memory as little-endian");

/// Plain numbers whose bytes can be copied as they are.
pub(crate) trait Pod: Copy + Default {}
impl Pod for u8 {}
impl Pod for u32 {}
impl Pod for i64 {}
impl Pod for u64 {}
impl Pod for f32 {}

fn bytes_of<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: Pod types have no padding and every byte is initialised; the
    // slice covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// `v`'s bytes, without a length prefix.
pub(crate) fn to_bytes<T: Pod>(v: &[T]) -> Vec<u8> {
    bytes_of(v).to_vec()
}

/// Fills `out` from `bytes` (unprefixed, possibly unaligned); false when the
/// sizes differ.
pub(crate) fn copy_from_bytes<T: Pod>(bytes: &[u8], out: &mut [T]) -> bool {
    if bytes.len() != std::mem::size_of_val(out) {
        return false;
    }
    // SAFETY: `out` has room for exactly `bytes.len()` bytes; the source may
    // be unaligned, which a byte copy does not mind.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), bytes.len());
    }
    true
}

pub(crate) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn new() -> Self {
        Self(Vec::new())
    }

    /// A length-prefixed array.
    pub fn put<T: Pod>(&mut self, v: &[T]) {
        self.0.extend_from_slice(&(v.len() as u64).to_le_bytes());
        self.0.extend_from_slice(bytes_of(v));
    }

    /// A length-prefixed array written from `parts` (`total` elements in all).
    pub fn put_parts<'a, T: Pod + 'a>(
        &mut self,
        total: usize,
        parts: impl Iterator<Item = &'a [T]>,
    ) {
        self.0.extend_from_slice(&(total as u64).to_le_bytes());
        let start = self.0.len();
        for p in parts {
            self.0.extend_from_slice(bytes_of(p));
        }
        debug_assert_eq!(self.0.len() - start, total * std::mem::size_of::<T>());
    }
}

/// Reads what a [`Writer`] wrote, in the same order. The data comes from
/// this process's own code, so a short buffer is a bug, reported as an error.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, at: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let end =
            end.ok_or_else(|| format!("message ends at byte {} of {}", self.at, self.buf.len()))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    pub fn get<T: Pod>(&mut self) -> Result<Vec<T>, String> {
        let n = u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")) as usize;
        let bytes = self.take(
            n.checked_mul(std::mem::size_of::<T>())
                .ok_or("length overflow")?,
        )?;
        let mut out = vec![T::default(); n];
        copy_from_bytes(bytes, &mut out);
        Ok(out)
    }
}
