//! A disk-tier table's file as a log of records: a changed row leaving the
//! cache is appended, never written in place.
//!
//! Written in place, each evicted row touched a page of its own: with the
//! file in the page cache that is a new page (allocated and zeroed, about
//! 4-19 us a row here), and with a file larger than memory a page read
//! from the disk before the write. Appended, a batch's evicted rows go out
//! in one write of consecutive records, about 30 to a page, as FBGEMM's
//! SSD TBE gets from RocksDB.
//!
//! The file is cut into segments of consecutive records. Each record
//! starts with its row (4 bytes), then the row's bytes and its state; a
//! table row's newest record is found through a position per row, in
//! memory. Older records of a row are garbage: when only a segment's worth
//! of room is left, the segment with the fewest live records is *cleaned*
//! (its live records appended anew, the segment reused), so the file never
//! grows past its size, reserved when the table is built: the table's
//! records and one eighth more, and two segments.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::SparseError;

/// Bytes before a record's row: the row's number (little-endian u32).
const HEADER: usize = 4;
/// Bytes of a segment, about (the unit of cleaning).
const SEGMENT_BYTES: usize = 1 << 20;
/// The room the file keeps beyond the table's records: one eighth.
const SLACK: usize = 8;
/// How many records ahead [`RowLog::append`] fetches a record's parts.
const APPEND_AHEAD: usize = 8;

/// Records per segment and segments of a log for `rows` rows of `record`
/// bytes (header included).
fn layout(rows: usize, record: usize) -> (usize, usize) {
    let segment = (SEGMENT_BYTES / record).clamp(1, rows.div_ceil(SLACK).max(1));
    let used = rows.div_ceil(segment);
    (segment, used + used.div_ceil(SLACK) + 2)
}

/// Bytes of the file of a disk-tier table of `rows` rows, each with
/// `row_and_state` bytes (its bytes in its data type and its optimizer
/// state): the log's records, headers and room to clean in included.
pub fn file_bytes(rows: u64, row_and_state: u64) -> u64 {
    let record = row_and_state as usize + HEADER;
    let (segment, segments) = layout(rows as usize, record);
    (segment * segments) as u64 * record as u64
}

/// The log of one table.
#[derive(Debug)]
pub(crate) struct RowLog {
    file: RowFile,
    /// Bytes of a record: header, row, state.
    record: usize,
    /// Records per segment.
    segment: usize,
    /// Per table row: its newest record's position + 1, or 0 when the log
    /// holds none (atomics: a [`ReadAhead`](super::ReadAhead) reads them
    /// from another thread).
    at: crate::storage::HugeArray<AtomicU32>,
    space: Mutex<Space>,
}

/// Where the log appends, and what cleaning needs.
#[derive(Debug)]
struct Space {
    /// The next position appended, and the end of its segment.
    head: usize,
    end: usize,
    /// Live records in each segment.
    live: Vec<u32>,
    /// Segments holding no live record, to append to.
    free: Vec<usize>,
    is_free: Vec<bool>,
    /// Records appended but not written yet (consecutive from `run_at`),
    /// and their rows.
    run: Vec<u8>,
    run_at: usize,
    run_rows: Vec<u32>,
}

impl RowLog {
    /// An empty log for `rows` rows of `payload` bytes (row and state), its
    /// file in `dir`, its space reserved when `reserve`.
    pub(crate) fn create(
        dir: &Path,
        table: &str,
        rows: usize,
        payload: usize,
        reserve: bool,
    ) -> Result<Self, SparseError> {
        let record = payload + HEADER;
        let (segment, segments) = layout(rows, record);
        if rows > u32::MAX as usize || segment * segments >= u32::MAX as usize {
            return Err(SparseError::InvalidConfig {
                table: table.to_string(),
                reason: format!("{rows} rows: the disk tier holds tables of up to 2^32 - 1 rows"),
            });
        }
        let file = RowFile::create(dir, table, (segment * segments * record) as u64, reserve)?;
        Ok(Self {
            file,
            record,
            segment,
            at: crate::storage::HugeArray::new(rows, || AtomicU32::new(0)),
            space: Mutex::new(Space {
                head: 0,
                end: segment,
                live: vec![0; segments],
                free: (1..segments).rev().collect(),
                is_free: (0..segments).map(|s| s > 0).collect(),
                run: Vec::new(),
                run_at: 0,
                run_rows: Vec::new(),
            }),
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.file.path
    }

    /// Bytes in memory: a position per row, a count per segment.
    pub(crate) fn bytes(&self) -> usize {
        let segments = self.lock().live.len();
        4 * self.at.len() + 13 * segments
    }

    /// Whether the log holds a record of `row`.
    pub(crate) fn stored(&self, row: u64) -> bool {
        self.at[row as usize].load(Ordering::Relaxed) != 0
    }

    /// Starts fetching `row`'s position into the CPU's cache.
    pub(crate) fn prefetch_position(&self, row: u64) {
        crate::storage::prefetch(self.at.as_ptr().wrapping_add(row as usize), 4);
    }

    /// Byte offset of `row`'s bytes in the file (past its header).
    fn offset(&self, row: u64) -> Option<u64> {
        let p = self.at[row as usize].load(Ordering::Relaxed);
        (p != 0).then(|| (p as u64 - 1) * self.record as u64 + HEADER as u64)
    }

    /// Reads row `row`'s newest record (stored) into `parts` (a slot's row
    /// and state); see [`RowFile::read_parts`].
    pub(crate) fn read(
        &self,
        table: &str,
        row: u64,
        parts: [&mut [u8]; 2],
        nowait: bool,
        scratch: &mut Vec<u8>,
    ) -> Result<bool, SparseError> {
        let at = self.offset(row).expect("a row read is stored");
        self.file.read_parts(table, parts, at, nowait, scratch)
    }

    /// Fills the records (row and state) of the stored rows among
    /// `first..` in `buf`, as many as it holds; the others are left as
    /// they are. Consecutive records are read together, many reads in
    /// flight.
    pub(crate) fn read_range(
        &self,
        table: &str,
        first: u64,
        buf: &mut [u8],
    ) -> Result<(), SparseError> {
        let payload = self.record - HEADER;
        let n = buf.len() / payload;
        let mut stored: Vec<(u32, usize)> = (0..n)
            .filter_map(|i| {
                let p = self.at[first as usize + i].load(Ordering::Relaxed);
                (p != 0).then(|| (p - 1, i))
            })
            .collect();
        stored.sort_unstable();
        let runs: Vec<&[(u32, usize)]> = stored.chunk_by(|a, b| b.0 == a.0 + 1).collect();
        let read = super::transfer::io_pool().install(|| {
            runs.par_iter()
                .map(|run| {
                    let mut bytes = vec![0u8; run.len() * self.record];
                    let at = run[0].0 as u64 * self.record as u64;
                    self.file.read(table, &mut bytes, at).map(|()| bytes)
                })
                .collect::<Result<Vec<_>, _>>()
        })?;
        for (run, bytes) in runs.iter().zip(read) {
            for (&(_, i), rec) in run.iter().zip(bytes.chunks_exact(self.record)) {
                buf[i * payload..][..payload].copy_from_slice(&rec[HEADER..]);
            }
        }
        Ok(())
    }

    /// Appends a record for each `(row, parts)` (the parts: the row's bytes
    /// and its state), which becomes the row's newest. Written in runs of
    /// consecutive records; a row's position moves only once its record is
    /// written, so after a failed write every row still has its last.
    pub(crate) fn append(
        &self,
        table: &str,
        records: &[(u64, [&[u8]; 2])],
    ) -> Result<(), SparseError> {
        let mut space = self.lock();
        for chunk in records.chunks(self.segment) {
            self.make_room(table, &mut space, chunk.len())?;
            for (i, &(row, parts)) in chunk.iter().enumerate() {
                // A record's parts (a cache slot) and its row's position
                // are random lines: fetched a few records ahead.
                if let Some(&(row, parts)) = chunk.get(i + APPEND_AHEAD) {
                    self.prefetch_position(row);
                    for p in parts {
                        crate::storage::prefetch(p.as_ptr(), p.len());
                    }
                }
                self.put(table, &mut space, row as u32, parts)?;
            }
        }
        self.write_run(table, &mut space)
    }

    /// Asks the kernel to start reading row `row`'s record (stored) into
    /// the page cache, without waiting for it.
    pub(crate) fn will_need(&self, row: u64) {
        #[cfg(target_os = "linux")]
        if let Some(at) = self.offset(row) {
            use std::os::fd::AsRawFd;
            let len = (self.record - HEADER) as libc::off_t;
            // SAFETY: a valid descriptor; the advice is only a hint.
            unsafe {
                libc::posix_fadvise(
                    self.file.file.as_raw_fd(),
                    at as libc::off_t,
                    len,
                    libc::POSIX_FADV_WILLNEED,
                )
            };
        }
        #[cfg(not(target_os = "linux"))]
        let _ = row;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Space> {
        // The space is consistent between calls; a panic elsewhere leaves it so.
        self.space.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Positions left to append to without cleaning.
    fn room(&self, space: &Space) -> usize {
        space.end - space.head + space.free.len() * self.segment
    }

    /// Cleans until `n` records fit with a segment to spare (room that
    /// cleaning a segment needs: its live records, fewer than a segment).
    fn make_room(&self, table: &str, space: &mut Space, n: usize) -> Result<(), SparseError> {
        while self.room(space) < n + self.segment {
            self.clean(table, space)?;
        }
        Ok(())
    }

    /// Appends the live records of the segment with the fewest (not the
    /// one appended to) and frees it. The file's slack makes that fewer
    /// than a segment's records.
    fn clean(&self, table: &str, space: &mut Space) -> Result<(), SparseError> {
        // Rows' positions must be current before liveness is judged.
        self.write_run(table, space)?;
        let appending = (space.end - 1) / self.segment;
        let victim = (0..space.live.len())
            .filter(|&s| s != appending && !space.is_free[s])
            .min_by_key(|&s| space.live[s])
            .filter(|&s| (space.live[s] as usize) < self.segment)
            .ok_or_else(|| SparseError::Disk {
                table: table.to_string(),
                path: self.file.path.clone(),
                reason: "the file's log has no room left to clean".to_string(),
            })?;
        let first = victim * self.segment;
        let mut bytes = vec![0u8; self.segment * self.record];
        self.file
            .read(table, &mut bytes, (first * self.record) as u64)?;
        for (k, rec) in bytes.chunks_exact(self.record).enumerate() {
            let row = u32::from_le_bytes(rec[..HEADER].try_into().expect("a 4-byte header"));
            let live = (row as usize) < self.at.len()
                && self.at[row as usize].load(Ordering::Relaxed) as usize == first + k + 1;
            if live {
                self.put(table, space, row, [&rec[HEADER..], &[]])?;
            }
        }
        self.write_run(table, space)?;
        debug_assert_eq!(space.live[victim], 0);
        space.is_free[victim] = true;
        space.free.push(victim);
        Ok(())
    }

    /// Adds a record to the run, writing the run first when its segment is
    /// full (room was made: a free segment follows).
    fn put(
        &self,
        table: &str,
        space: &mut Space,
        row: u32,
        parts: [&[u8]; 2],
    ) -> Result<(), SparseError> {
        if space.head == space.end {
            self.write_run(table, space)?;
            let next = space.free.pop().expect("make_room leaves a free segment");
            space.is_free[next] = false;
            space.head = next * self.segment;
            space.end = space.head + self.segment;
            space.run_at = space.head;
        }
        space.run.extend_from_slice(&row.to_le_bytes());
        space.run.extend_from_slice(parts[0]);
        space.run.extend_from_slice(parts[1]);
        space.run_rows.push(row);
        space.head += 1;
        Ok(())
    }

    /// Writes the run, then points its rows at their new records.
    fn write_run(&self, table: &str, space: &mut Space) -> Result<(), SparseError> {
        let run = std::mem::take(&mut space.run);
        let rows = std::mem::take(&mut space.run_rows);
        let at = std::mem::replace(&mut space.run_at, space.head);
        if rows.is_empty() {
            return Ok(());
        }
        self.file.write(table, &run, (at * self.record) as u64)?;
        for (k, &row) in rows.iter().enumerate() {
            let pos = at + k;
            let old = self.at[row as usize].swap(pos as u32 + 1, Ordering::Relaxed);
            if old != 0 {
                space.live[(old as usize - 1) / self.segment] -= 1;
            }
            space.live[pos / self.segment] += 1;
        }
        // Keep the buffers' capacity for the next run.
        space.run = run;
        space.run.clear();
        space.run_rows = rows;
        space.run_rows.clear();
        Ok(())
    }
}

/// Removes from `dir` the table files (`<table>.<pid>.<n>.rows`) of
/// processes that are gone (a killed run's: a table file is removed when its
/// table drops, which a `kill -9` never lets happen); returns each file
/// removed with its size. Files of live processes, this one's included, and
/// any other file are left alone.
pub fn reclaim_row_files(dir: &Path) -> std::io::Result<Vec<(PathBuf, u64)>> {
    let mut reclaimed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(reclaimed),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = row_file_pid(&name) else {
            continue;
        };
        if pid == std::process::id() || alive(pid) {
            continue;
        }
        let bytes = entry.metadata().map_or(0, |m| m.len());
        match std::fs::remove_file(entry.path()) {
            Ok(()) => reclaimed.push((entry.path(), bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(reclaimed)
}

/// The pid in a table file's name `<table>.<pid>.<n>.rows`.
fn row_file_pid(name: &str) -> Option<u32> {
    let mut parts = name.strip_suffix(".rows")?.rsplitn(3, '.');
    let n = parts.next()?;
    let pid = parts.next()?;
    let table = parts.next()?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(n) && !table.is_empty()).then_some(())?;
    pid.parse().ok().filter(|_| digits(pid))
}

/// Whether process `pid` exists (signal 0 checks without sending).
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks the process.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A table's file; removed on drop.
#[derive(Debug)]
struct RowFile {
    file: File,
    path: PathBuf,
}

impl RowFile {
    fn create(dir: &Path, table: &str, bytes: u64, reserve: bool) -> Result<Self, SparseError> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let n = SERIAL.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{table}.{}.{n}.rows", std::process::id()));
        let fail = |e: std::io::Error| disk_error(table, &path, "cannot create the file", e);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(fail)?;
        let this = Self { file, path };
        // Sized, and (for rows that change) its blocks reserved, up front:
        // rows are written long after (when they first leave the cache),
        // and a disk too small fails while the table is built. An
        // inference table's rows are written while it is built, if at all
        // (a delta's later: a full disk is then that write's error).
        this.file
            .set_len(bytes)
            .map_err(|e| disk_error(table, &this.path, "cannot size the file", e))?;
        if reserve {
            this.reserve(bytes)
                .map_err(|e| disk_error(table, &this.path, "cannot reserve the file's space", e))?;
        }
        advise_random(&this.file);
        Ok(this)
    }

    /// Allocates the file's blocks (unwritten: they read as zeros), where
    /// the file system can; elsewhere its space is taken as rows are
    /// written.
    fn reserve(&self, bytes: u64) -> std::io::Result<()> {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            if bytes == 0 {
                return Ok(());
            }
            // SAFETY: a valid descriptor; mode 0 allocates and extends.
            let r = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
            let e = std::io::Error::last_os_error();
            // A file system that cannot reserve (EOPNOTSUPP, EINVAL, ...)
            // is not an error: only no room is.
            let no_room = [libc::ENOSPC, libc::EDQUOT, libc::EFBIG, libc::EIO];
            if r != 0 && e.raw_os_error().is_some_and(|c| no_room.contains(&c)) {
                return Err(e);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = bytes;
        Ok(())
    }

    fn read(&self, table: &str, buf: &mut [u8], at: u64) -> Result<(), SparseError> {
        self.file
            .read_exact_at(buf, at)
            .map_err(|e| disk_error(table, &self.path, &format!("read at byte {at} failed"), e))
    }

    /// Reads one record's row and state at byte `at` into `parts` (a
    /// slot's row and state), one system call. With `nowait` only if the
    /// page cache holds it all (`Ok(false)` when it would have waited).
    /// Short reads (a signal) are read again whole through `scratch`.
    fn read_parts(
        &self,
        table: &str,
        mut parts: [&mut [u8]; 2],
        at: u64,
        nowait: bool,
        scratch: &mut Vec<u8>,
    ) -> Result<bool, SparseError> {
        let len = parts[0].len() + parts[1].len();
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let iov = parts.each_mut().map(|p| libc::iovec {
                iov_base: p.as_mut_ptr().cast(),
                iov_len: p.len(),
            });
            let flags = if nowait { libc::RWF_NOWAIT } else { 0 };
            // SAFETY: two iovecs over the two parts, valid for their lengths.
            let n = unsafe {
                libc::preadv2(
                    self.file.as_raw_fd(),
                    iov.as_ptr(),
                    2,
                    at as libc::off_t,
                    flags,
                )
            };
            if n == len as isize {
                return Ok(true);
            }
            if nowait {
                return Ok(false);
            }
        }
        #[cfg(not(target_os = "linux"))]
        if nowait {
            return Ok(false);
        }
        scratch.resize(len, 0);
        self.read(table, scratch, at)?;
        let (row, state) = scratch.split_at(parts[0].len());
        let [a, b] = parts;
        a.copy_from_slice(row);
        b.copy_from_slice(state);
        Ok(true)
    }

    fn write(&self, table: &str, buf: &[u8], at: u64) -> Result<(), SparseError> {
        self.file
            .write_all_at(buf, at)
            .map_err(|e| disk_error(table, &self.path, &format!("write at byte {at} failed"), e))
    }
}

impl Drop for RowFile {
    fn drop(&mut self) {
        // Working storage only: nothing in it outlives the table.
        let _ = std::fs::remove_file(&self.path);
    }
}

fn disk_error(table: &str, path: &Path, what: &str, e: std::io::Error) -> SparseError {
    SparseError::Disk {
        table: table.to_string(),
        path: path.to_path_buf(),
        reason: format!("{what}: {e}"),
    }
}

/// Reads are random: no read-ahead (it would read pages nobody asked for).
fn advise_random(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor; the advice is only a hint.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

#[cfg(test)]
mod tests {
    #[test]
    fn row_file_names_give_their_pid() {
        use super::row_file_pid;
        assert_eq!(row_file_pid("t_cat_0.4242.7.rows"), Some(4242));
        assert_eq!(row_file_pid("a.b.12.0.rows"), Some(12));
        for other in [
            "t.rows",
            "t.x.1.rows",
            "t.1.x.rows",
            ".1.2.rows",
            "t.1.2.rows.tmp",
        ] {
            assert_eq!(row_file_pid(other), None, "{other}");
        }
    }

    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever is appended, in batches of any size, each row reads
        /// back its last record, and the file never grows past its size
        /// (cleaning reuses segments): against a map.
        #[test]
        fn every_row_reads_back_its_newest_record(
            rows in 1usize..200,
            batches in proptest::collection::vec(proptest::collection::vec(0u64..1000, 0..150), 1..40),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let log = RowLog::create(dir.path(), "t", rows, 8, true).unwrap();
            let mut newest: HashMap<u64, [u8; 8]> = HashMap::new();
            for (b, ids) in batches.iter().enumerate() {
                let mut seen = std::collections::HashSet::new();
                let batch: Vec<(u64, [u8; 8])> = ids
                    .iter()
                    .map(|&i| i % rows as u64)
                    .filter(|&r| seen.insert(r))
                    .map(|r| (r, [b as u8, r as u8, 1, 2, 3, 4, 5, 6]))
                    .collect();
                let records: Vec<(u64, [&[u8]; 2])> =
                    batch.iter().map(|(r, v)| (*r, [&v[..5], &v[5..]])).collect();
                log.append("t", &records).unwrap();
                newest.extend(batch.iter().copied());
            }
            let len = std::fs::metadata(log.path()).unwrap().len();
            prop_assert_eq!(len, file_bytes(rows as u64, 8));
            for r in 0..rows as u64 {
                prop_assert_eq!(log.stored(r), newest.contains_key(&r));
                if let Some(v) = newest.get(&r) {
                    let (mut a, mut b) = ([0u8; 5], [0u8; 3]);
                    log.read("t", r, [&mut a, &mut b], false, &mut Vec::new()).unwrap();
                    prop_assert_eq!([&a[..], &b[..]].concat(), v.to_vec());
                }
            }
            let mut all = vec![0xAAu8; rows * 8];
            log.read_range("t", 0, &mut all).unwrap();
            for (r, rec) in all.chunks_exact(8).enumerate() {
                let want = newest.get(&(r as u64)).map_or(vec![0xAA; 8], |v| v.to_vec());
                prop_assert_eq!(rec.to_vec(), want);
            }
            let live: u32 = log.lock().live.iter().sum();
            prop_assert_eq!(live as usize, newest.len());
        }
    }

    #[test]
    fn a_table_past_the_positions_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = RowLog::create(dir.path(), "huge", u32::MAX as usize + 1, 8, true).unwrap_err();
        assert!(err.to_string().contains("huge"), "{err}");
    }
}
