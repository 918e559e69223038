//! The on-disk compile cache: serialized executables, one file per program.
//!
//! An entry is `magic | program | plugin identity | options | executable |
//! checksum`, each part length-prefixed, the checksum an FNV-1a over the
//! rest. The file name is a hash of the key parts, but an entry is used only
//! when its stored program, plugin identity (path, size, modification time,
//! platform version, `XLA_FLAGS`) and options equal the ones asked for, and
//! its checksum holds; anything
//! else (a collision, a changed plugin, a torn or corrupt file) is a miss,
//! and the recompiled executable replaces the entry atomically.

use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"EMBERX1\n";

/// The default directory: `$EMBER_PJRT_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/ember/pjrt/executables` (or `~/.cache/...`).
pub fn default_cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("EMBER_PJRT_CACHE_DIR") {
        return PathBuf::from(p);
    }
    ember_pjrt_cache().join("executables")
}

/// `$XDG_CACHE_HOME/ember/pjrt`, or `~/.cache/ember/pjrt`, or `./ember/pjrt`:
/// where the plugin and the compiled executables live by default.
pub fn ember_pjrt_cache() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("."));
    cache.join("ember").join("pjrt")
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Part boundaries matter: "ab"+"c" differs from "a"+"bc".
        h ^= p.len() as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// What identifies a plugin build: its path, size and modification time.
pub fn plugin_identity(path: &Path) -> Vec<u8> {
    let meta = std::fs::metadata(path).ok();
    let size = meta.as_ref().map_or(0, |m| m.len());
    let mtime = (meta.and_then(|m| m.modified().ok()))
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("{}|{size}|{mtime}", path.display()).into_bytes()
}

pub struct DiskCache {
    dir: PathBuf,
    plugin: Vec<u8>,
}

impl DiskCache {
    pub fn new(dir: PathBuf, plugin: Vec<u8>) -> Self {
        Self { dir, plugin }
    }

    fn path(&self, program: &str, options: &[u8]) -> PathBuf {
        let h = fnv1a(&[program.as_bytes(), &self.plugin, options]);
        self.dir.join(format!("{h:016x}.pjrt"))
    }

    /// The serialized executable for `program`, if a valid entry exists.
    pub fn get(&self, program: &str, options: &[u8]) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.path(program, options)).ok()?;
        let mut r = Parts { buf: &bytes, at: 0 };
        if r.take(8)? != MAGIC {
            return None;
        }
        let body_end = bytes.len().checked_sub(8)?;
        let stored_sum = u64::from_le_bytes(bytes[body_end..].try_into().ok()?);
        if fnv1a(&[&bytes[..body_end]]) != stored_sum {
            return None;
        }
        let (p, plugin, o, exe) = (r.part()?, r.part()?, r.part()?, r.part()?);
        (p == program.as_bytes()
            && plugin == self.plugin.as_slice()
            && o == options
            && r.at == body_end)
            .then(|| exe.to_vec())
    }

    /// Stores an entry (temporary file, then rename); a failure to write
    /// only costs a compile next time, so it is ignored.
    pub fn put(&self, program: &str, options: &[u8], executable: &[u8]) {
        let mut out = MAGIC.to_vec();
        for part in [program.as_bytes(), &self.plugin, options, executable] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(part);
        }
        let sum = fnv1a(&[&out]);
        out.extend_from_slice(&sum.to_le_bytes());
        let path = self.path(program, options);
        let temp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::create_dir_all(&self.dir)
            .and_then(|()| std::fs::write(&temp, &out))
            .and_then(|()| std::fs::rename(&temp, &path));
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
    }
}

struct Parts<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Parts<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len())?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Some(s)
    }
    fn part(&mut self) -> Option<&'a [u8]> {
        let n = u64::from_le_bytes(self.take(8)?.try_into().ok()?) as usize;
        self.take(n)
    }
}
