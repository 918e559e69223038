//! The first pass's spill: `(column, id, line)` records written, each id
//! to the partition file of its hash, so the ids can be counted one
//! partition at a time ([`crate::vocabulary`]). Varints by hand: two LEB128
//! integers a record, read back in one buffer, are less than a crate's
//! framing.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::ingest::InputStamp;
use crate::DataError;

/// The most partition files open at once (each with a 64 KiB buffer).
pub(crate) const MAX_PARTITIONS: usize = 256;

/// Bytes of memory one distinct id takes while counted (the map's entry,
/// its control byte and spare room).
const COUNT_BYTES_PER_ID: u64 = 40;

/// Enough partitions that one partition's distinct ids fit `memory`,
/// taking every id of the inputs as distinct (a gzip input as four times
/// its size) and a Criteo line as about 10 bytes per id.
pub(crate) fn partitions_for(inputs: &[PathBuf], memory: u64) -> Result<usize, DataError> {
    let mut ids = 0u64;
    for input in inputs {
        let bytes = InputStamp::of(input)?.bytes;
        let mut magic = [0u8; 2];
        let gzip = File::open(input)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
            && magic == [0x1f, 0x8b];
        ids += bytes * if gzip { 4 } else { 1 } / 10;
    }
    Ok((ids * COUNT_BYTES_PER_ID)
        .div_ceil(memory.max(1))
        .clamp(1, MAX_PARTITIONS as u64) as usize)
}

/// The partition files of the first pass: `(column, id, line)` records,
/// written in line order, each id to the partition of its hash.
pub(crate) struct Spill {
    dir: SpillDir,
    files: Vec<BufWriter<File>>,
    last_line: Vec<u64>,
}

/// The spill directory, removed when dropped (on success and on every failure).
pub(crate) struct SpillDir(PathBuf);

impl Drop for SpillDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Spill {
    pub(crate) fn create(dir: &Path, partitions: usize) -> Result<Self, DataError> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(DataError::io(dir))?;
        let guard = SpillDir(dir.to_path_buf());
        let files = (0..partitions)
            .map(|p| {
                let path = dir.join(format!("part-{p}"));
                File::create(&path)
                    .map(|f| BufWriter::with_capacity(1 << 16, f))
                    .map_err(DataError::io(&path))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            dir: guard,
            files,
            last_line: vec![0; partitions],
        })
    }

    fn path(&self, p: usize) -> PathBuf {
        self.dir.0.join(format!("part-{p}"))
    }

    /// A record: the column (one byte), the id and the line's distance from
    /// the partition's last record, both as LEB128 varints (a Criteo id
    /// takes 5 bytes, the distance one).
    pub(crate) fn push(&mut self, column: usize, id: i64, line: u64) -> Result<(), DataError> {
        // Another hash than the counting map's: within a partition the
        // map's hashes must not share their low bits.
        let mixed = ember_sparse::rng::splitmix(id as u64 ^ PARTITION_SEED);
        let p = (mixed % self.files.len() as u64) as usize;
        let mut record = [0u8; MAX_RECORD];
        record[0] = column as u8;
        let mut n = 1 + leb128(id as u64, &mut record[1..]);
        n += leb128(line - self.last_line[p], &mut record[n..]);
        self.last_line[p] = line;
        // The path is made only for an error: this runs for every id.
        self.files[p]
            .write_all(&record[..n])
            .map_err(|e| DataError::io(&self.path(p))(e))
    }

    /// Flushes every partition; returns the directory's guard and the files.
    pub(crate) fn finish(mut self) -> Result<(SpillDir, Vec<PathBuf>), DataError> {
        for p in 0..self.files.len() {
            let path = self.path(p);
            self.files[p].flush().map_err(DataError::io(&path))?;
        }
        let parts = (0..self.files.len()).map(|p| self.path(p)).collect();
        Ok((self.dir, parts))
    }
}

/// Seeds the partition hash.
const PARTITION_SEED: u64 = 0xA076_1D64_78BD_642F;

/// Hands each record of a partition file to `each`, in the order written.
pub(crate) fn read_part(
    path: &Path,
    each: &mut dyn FnMut(usize, i64, u64),
) -> Result<(), DataError> {
    read_part_in(path, each, 1 << 20)
}

/// [`read_part`] through a buffer of `buf_len` bytes (at least two records).
fn read_part_in(
    path: &Path,
    each: &mut dyn FnMut(usize, i64, u64),
    buf_len: usize,
) -> Result<(), DataError> {
    let mut file = File::open(path).map_err(DataError::io(path))?;
    let mut buf = vec![0u8; buf_len.max(2 * MAX_RECORD)];
    let (mut have, mut line) = (0usize, 0u64);
    loop {
        let n = file.read(&mut buf[have..]).map_err(DataError::io(path))?;
        have += n;
        let mut at = 0;
        // Whole records only, unless the file has ended.
        while at < have && (n == 0 || have - at >= MAX_RECORD) {
            let column = buf[at] as usize;
            at += 1;
            let id = leb128_read(&buf[..have], &mut at, path)?;
            line += leb128_read(&buf[..have], &mut at, path)?;
            each(column, id as i64, line);
        }
        buf.copy_within(at..have, 0);
        have -= at;
        if n == 0 {
            return Ok(());
        }
    }
}

/// The longest record: a column byte and two 10-byte varints.
const MAX_RECORD: usize = 21;

fn leb128(mut v: u64, out: &mut [u8]) -> usize {
    let mut n = 0;
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out[n] = byte;
            return n + 1;
        }
        out[n] = byte | 0x80;
        n += 1;
    }
}

fn leb128_read(bytes: &[u8], at: &mut usize, path: &Path) -> Result<u64, DataError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = bytes.get(*at) else { break };
        *at += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(DataError::Vocabulary(format!(
        "{}: a spill file ends mid-record (was it changed while counting?)",
        path.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = [0u8; MAX_RECORD];
            let n = leb128(v, &mut out);
            let mut at = 0;
            assert_eq!(leb128_read(&out[..n], &mut at, Path::new("x")).unwrap(), v);
            assert_eq!(at, n);
            assert!(leb128_read(&out[..n - 1], &mut 0, Path::new("x")).is_err() || n == 1);
        }
    }

    #[test]
    fn records_cross_the_read_buffer_whole() {
        let dir = tempfile::tempdir().unwrap();
        let mut spill = Spill::create(&dir.path().join("spill"), 1).unwrap();
        let records: Vec<(usize, i64, u64)> = (0..500u64)
            .map(|k| {
                (
                    (k % 26) as usize,
                    (k * 2_654_435_761 % (1 << 40)) as i64,
                    1 + k * k,
                )
            })
            .collect();
        for &(column, id, line) in &records {
            spill.push(column, id, line).unwrap();
        }
        let (_dir, parts) = spill.finish().unwrap();
        for buf_len in [2 * MAX_RECORD, 2 * MAX_RECORD + 1, 100, 1 << 20] {
            let mut got = Vec::new();
            read_part_in(
                &parts[0],
                &mut |c, id, line| got.push((c, id, line)),
                buf_len,
            )
            .unwrap();
            assert_eq!(got, records, "buffer of {buf_len}");
        }
    }
}
