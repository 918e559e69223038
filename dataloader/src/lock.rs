//! One writer per directory: [`DirLock`] is an exclusive advisory lock
//! (`flock`, through the standard library's `File::try_lock`) on
//! `<dir>/.ember.lock`, held for as long as the guard lives. A second
//! writer is refused at once, with the holder's pid and start time; readers
//! never take it, so they are never blocked. The kernel releases the lock
//! of a process that dies, so a lock left by a `kill -9` is simply taken
//! over; the file holds only who to name in the refusal.
//!
//! The guard removes the file when it drops. That is safe because a taker
//! checks, once locked, that the name still refers to the file it locked
//! (an unlink between its open and its lock would otherwise give two
//! holders of two different files), and tries again when not.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::DataError;

/// The lock file's name in a locked directory.
pub const LOCK_FILE: &str = ".ember.lock";

/// An exclusive lock on a directory, held until dropped.
#[derive(Debug)]
pub struct DirLock {
    /// The lock file (its directory resolved), the key of [`HELD`].
    path: PathBuf,
}

/// The directories this process holds, with their locked files and how
/// many guards share each: one process may take a directory twice (a
/// checkpoint directory that is also its `--disk-dir`), and only the
/// last guard to drop releases it.
static HELD: Mutex<BTreeMap<PathBuf, (File, usize)>> = Mutex::new(BTreeMap::new());

impl DirLock {
    /// Creates `dir` if needed and locks it for this process, recording
    /// `what` (e.g. `ember train`) for a refused second writer to read.
    /// Refused at once ([`DataError::InUse`]) while another process holds
    /// it; this process may take it again.
    ///
    /// ```
    /// use ember_dataloader::lock::DirLock;
    /// let dir = tempfile::tempdir()?;
    /// let held = DirLock::acquire(dir.path(), "ember train")?;
    /// assert!(held.path().exists());
    /// // The same process may take it again; the last guard releases it.
    /// let again = DirLock::acquire(dir.path(), "ember train")?;
    /// drop(held);
    /// assert!(again.path().exists());
    /// drop(again);
    /// assert!(!dir.path().join(".ember.lock").exists());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn acquire(dir: &Path, what: &str) -> Result<Self, DataError> {
        std::fs::create_dir_all(dir).map_err(DataError::io(dir))?;
        let path = std::fs::canonicalize(dir)
            .map_err(DataError::io(dir))?
            .join(LOCK_FILE);
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, guards)) = held.get_mut(&path) {
            *guards += 1;
            return Ok(Self { path });
        }
        let file = lock(dir, &path, what)?;
        held.insert(path.clone(), (file, 1));
        Ok(Self { path })
    }

    /// [`acquire`](Self::acquire) for the directory a file `path` is
    /// written into (`.` for a bare name).
    pub fn for_file(path: &Path, what: &str) -> Result<Self, DataError> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        Self::acquire(dir, what)
    }

    /// The locked directory's lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Opens and locks `path`, the lock file of `dir`, recording who holds it.
fn lock(dir: &Path, path: &Path, what: &str) -> Result<File, DataError> {
    loop {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(DataError::io(path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = match holder.trim() {
                    "" => "another process".to_string(),
                    h => h.to_string(),
                };
                return Err(DataError::InUse {
                    path: dir.to_path_buf(),
                    holder,
                });
            }
            // A file system without locks (Lustre without `-o flock`, some
            // NFS): the run goes on unguarded rather than not at all.
            Err(TryLockError::Error(e))
                if [libc::ENOSYS, libc::ENOLCK, libc::EOPNOTSUPP]
                    .contains(&e.raw_os_error().unwrap_or(0)) =>
            {
                return Ok(file)
            }
            Err(TryLockError::Error(e)) => return Err(DataError::io(path)(e)),
        }
        // The holder before us may have removed the name after we opened
        // it: then we hold a lock on a file nobody else sees.
        let same = match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        };
        if !same {
            continue;
        }
        let started = chrono::Local::now().format("%Y-%m-%d %H:%M:%S %Z");
        let record = format!("pid {} (started {started}: {what})\n", std::process::id());
        file.set_len(0).map_err(DataError::io(path))?;
        file.write_all(record.as_bytes())
            .map_err(DataError::io(path))?;
        return Ok(file);
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        let Some((_, guards)) = held.get_mut(&self.path) else {
            return;
        };
        *guards -= 1;
        if *guards == 0 {
            // Removed while still locked: a waiting taker then sees a new file.
            let _ = std::fs::remove_file(&self.path);
            if let Some((file, _)) = held.remove(&self.path) {
                let _ = file.unlock();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_process_is_refused_with_the_holder_named() {
        let dir = tempfile::tempdir().unwrap();
        let held = DirLock::acquire(dir.path(), "ember train").unwrap();
        // Another open file description stands for another process.
        let path = dir.path().join(LOCK_FILE);
        let error = lock(dir.path(), &path, "ember ingest")
            .unwrap_err()
            .to_string();
        let me = format!("is in use by pid {} (started", std::process::id());
        assert!(
            error.contains(&me) && error.contains("ember train)"),
            "{error}"
        );
        drop(held);
        lock(dir.path(), &path, "ember ingest").unwrap();
    }

    #[test]
    fn a_lock_left_by_a_dead_holder_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        // A killed holder leaves its file, but the kernel dropped its lock.
        std::fs::write(
            dir.path().join(LOCK_FILE),
            "pid 1 (started then: ember train)\n",
        )
        .unwrap();
        let held = DirLock::acquire(dir.path(), "ember ingest").unwrap();
        let record = std::fs::read_to_string(held.path()).unwrap();
        assert!(
            record.starts_with(&format!("pid {} ", std::process::id())),
            "{record}"
        );
        drop(held);
        assert!(!dir.path().join(LOCK_FILE).exists());
    }
}
