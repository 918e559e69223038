//! Outputs that appear whole or not at all: a file is written as
//! `.<name>.tmp` beside its final name, fsynced, renamed, and the directory
//! fsynced. [`AtomicFile`] is the one guard every writer of Ember uses: a
//! file dropped before [`AtomicFile::commit`] (an error, a panic, a full
//! disk) removes its temporary file. A `kill -9` cannot run the guard; its
//! leftover keeps the `.<name>.tmp` pattern, which the next write of the
//! same file replaces and [`remove_leftovers`] recognises. (The PJRT
//! compile cache, in `ember-dense`, below this crate, writes its entries
//! the same way on its own: a cache entry left half-written is a miss.)
//!
//! Files are created with the process's umask (normally 0644), as every
//! other output, so a checkpoint on a shared file system is as readable as
//! the data beside it.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::DataError;

/// A file being written under its temporary name.
pub struct AtomicFile {
    file: Option<File>,
    temp: PathBuf,
    path: PathBuf,
}

/// The temporary name of `path`: `.<name>.tmp` in the same directory (hidden,
/// and not `*.parquet`, so neither Ember's loader nor pyarrow reads it).
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.tmp"))
}

/// The final name an unfinished write's temporary file stands for: `x`
/// for `.x.tmp`; `None` for any other name.
pub fn temp_of(name: &str) -> Option<&str> {
    (name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp"))).filter(|n| !n.is_empty())
}

impl AtomicFile {
    /// Creates (or truncates) `path`'s temporary file; `path` itself appears
    /// only at [`commit`](Self::commit).
    pub fn create(path: &Path) -> Result<Self, DataError> {
        let temp = temp_path(path);
        let file = File::create(&temp).map_err(DataError::io(&temp))?;
        Ok(Self {
            file: Some(file),
            temp,
            path: path.to_path_buf(),
        })
    }

    /// The open temporary file.
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("open until commit")
    }

    /// The temporary file's path (errors while writing name it).
    pub fn temp(&self) -> &Path {
        &self.temp
    }

    /// The final path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the open file out, for a writer that owns it (the Parquet
    /// writer); it comes back through [`commit_file`](Self::commit_file).
    pub fn take_file(&mut self) -> File {
        self.file.take().expect("open until commit")
    }

    /// Fsyncs the file, renames it to its final name and fsyncs the
    /// directory; returns the file's size in bytes.
    pub fn commit(mut self) -> Result<u64, DataError> {
        let file = self.file.take().expect("open until commit");
        self.commit_file(file)
    }

    /// [`commit`](Self::commit) for a file taken by [`take_file`](Self::take_file).
    pub fn commit_file(mut self, file: File) -> Result<u64, DataError> {
        file.sync_all().map_err(DataError::io(&self.temp))?;
        let bytes = file.metadata().map_err(DataError::io(&self.temp))?.len();
        drop(file);
        std::fs::rename(&self.temp, &self.path).map_err(DataError::io(&self.path))?;
        // Renamed: nothing is left to remove, whatever the fsync below says.
        self.temp = PathBuf::new();
        sync_dir(&self.path)?;
        Ok(bytes)
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.temp.as_os_str().is_empty() {
            self.file.take();
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Fsyncs the directory holding `path`, so a rename into it is durable.
fn sync_dir(path: &Path) -> Result<(), DataError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(DataError::io(dir))
}

/// Whether `a` and `b` name one file: both resolved (links followed, `..`
/// and `.` gone; a file not yet written by its directory's resolved path),
/// so an output is never written over an input through another spelling.
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (resolved(a), resolved(b)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// The canonical path `path` names (its directory's canonical path and its
/// name, for a file not written yet); `None` when its directory is missing.
fn resolved(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Some(p);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    Some(std::fs::canonicalize(dir).ok()?.join(path.file_name()?))
}

/// Writes `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let mut out = AtomicFile::create(path)?;
    let temp = out.temp().to_path_buf();
    out.file().write_all(bytes).map_err(DataError::io(temp))?;
    out.commit().map(|_| ())
}

/// Removes from `dir` the temporary files of writes that never finished (a
/// killed run) whose names `ours` recognises (it is given the whole name;
/// see [`temp_of`]); returns the paths removed. A missing directory has none.
pub fn remove_leftovers(
    dir: &Path,
    ours: impl Fn(&str) -> bool,
) -> Result<Vec<PathBuf>, DataError> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(DataError::io(dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(DataError::io(dir))?;
        let name = entry.file_name();
        if ours(&name.to_string_lossy()) && entry.path().is_file() {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => removed.push(entry.path()),
                // Another rank sharing the directory removed it first.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(DataError::io(entry.path())(e)),
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_file_leaves_nothing_and_a_committed_one_only_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        let mut f = AtomicFile::create(&path).unwrap();
        f.file().write_all(b"half").unwrap();
        assert!(dir.path().join(".a.json.tmp").is_file());
        drop(f);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        write_atomic(&path, b"whole").unwrap();
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("a.json")]);
        assert_eq!(std::fs::read(&path).unwrap(), b"whole");
    }

    #[test]
    fn leftovers_of_a_killed_write_are_recognised() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(".model.safetensors.tmp"), b"x").unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"x").unwrap();
        std::fs::write(dir.path().join(".hidden"), b"x").unwrap();
        std::fs::write(dir.path().join(".other.json.tmp"), b"x").unwrap();
        let models = |n: &str| temp_of(n).is_some_and(|n| n.starts_with("model"));
        let removed = remove_leftovers(dir.path(), models).unwrap();
        assert_eq!(removed, vec![dir.path().join(".model.safetensors.tmp")]);
        assert!(
            dir.path().join(".hidden").is_file() && dir.path().join(".other.json.tmp").is_file()
        );
        assert!(remove_leftovers(&dir.path().join("none"), models)
            .unwrap()
            .is_empty());
    }

    #[cfg(target_os = "linux")]
    fn is_char_device(path: &str) -> bool {
        use std::os::unix::fs::FileTypeExt;
        std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device())
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_full_disk_is_named_and_leaves_no_temporary_file() {
        // /dev/full fails every write with ENOSPC: a stale temporary file
        // that links to it makes the write below hit a "full disk".
        if !is_char_device("/dev/full") {
            eprintln!("skipped: no /dev/full");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        std::os::unix::fs::symlink("/dev/full", temp_path(&path)).unwrap();
        let err = write_atomic(&path, &[0; 1 << 16]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("disk is full") && text.contains(".plan.json.tmp"),
            "{text}"
        );
        assert!(matches!(err, DataError::DiskFull { .. }));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
