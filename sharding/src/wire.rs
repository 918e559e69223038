//! Flat little-endian encoding of the arrays devices exchange, so a
//! collective moves plain bytes (in-process here, MPI later).

pub(crate) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn new() -> Self {
        Self(Vec::new())
    }
    pub fn u32s(&mut self, v: impl ExactSizeIterator<Item = u32>) {
        self.0.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    pub fn i64s(&mut self, v: &[i64]) {
        self.0.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    pub fn f32s(&mut self, v: impl ExactSizeIterator<Item = f32>) {
        self.0.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
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
    fn len(&mut self) -> Result<usize, String> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
    }
    pub fn u32s(&mut self) -> Result<Vec<u32>, String> {
        let n = self.len()?;
        let b = self.take(n.checked_mul(4).ok_or("length overflow")?)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    }
    pub fn i64s(&mut self) -> Result<Vec<i64>, String> {
        let n = self.len()?;
        let b = self.take(n.checked_mul(8).ok_or("length overflow")?)?;
        Ok(b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8")))
            .collect())
    }
    pub fn f32s(&mut self) -> Result<Vec<f32>, String> {
        let n = self.len()?;
        let b = self.take(n.checked_mul(4).ok_or("length overflow")?)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    }
}
