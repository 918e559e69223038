//! Chains of delta checkpoints in a directory: the full checkpoint
//! (`model.safetensors`), then `model.delta-000001.safetensors`,
//! `model.delta-000002.safetensors`, … each holding what training changed
//! since the file before it. Each delta names the full file it builds on
//! and its parent by their [`identity`]; a chain is read from the full file
//! along those links, and one that breaks is refused, naming the file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::store::{MappedFile, TensorStore};
use super::{fail_at, CHECKPOINT_FILE, META_CRC32};
use crate::ModelError;

/// The metadata key of a delta's [`DeltaLink`].
pub(super) const META_DELTA: &str = "ember.delta";

/// What a delta's metadata says of its place in the chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct DeltaLink {
    /// 1 for the first delta after the full file.
    pub(super) sequence: u64,
    /// The [`identity`] of the full file, as 8 hex digits.
    pub(super) base: String,
    /// The [`identity`] of the file before this one (the full file for
    /// the first delta), as 8 hex digits.
    pub(super) parent: String,
    /// Tables written whole (most of their rows changed): their tensors
    /// are a full file's, under `delta.`, without a list of rows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) whole_tables: Vec<String>,
}

/// What a file is known by in a chain: the CRC-32 of its checksums entry
/// ([`META_CRC32`], which covers every tensor's bytes and the other
/// metadata). `None` for a file without one (not written by Ember).
pub(super) fn identity(meta: &HashMap<String, String>) -> Option<u32> {
    meta.get(META_CRC32).map(|s| crc32fast::hash(s.as_bytes()))
}

pub(super) fn hex(identity: u32) -> String {
    format!("{identity:08x}")
}

/// The name of the `sequence`-th delta of a directory's chain.
pub fn delta_file_name(sequence: u64) -> String {
    format!("model.delta-{sequence:06}.safetensors")
}

/// The sequence number of a delta's file name.
pub(super) fn delta_sequence(name: &str) -> Option<u64> {
    let digits = name
        .strip_prefix("model.delta-")?
        .strip_suffix(".safetensors")?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
        .filter(|&n| n > 0)
}

/// Where a model's tables stand against a checkpoint directory: the chain
/// it last saved there or was loaded from, so that a delta holds exactly
/// what changed since.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChainHead {
    pub(crate) dir: PathBuf,
    /// Identity of the chain's full file.
    pub(crate) base: u32,
    /// Identity of the chain's last file.
    pub(crate) tail: u32,
    /// Deltas in the chain (0: only the full file).
    pub(crate) sequence: u64,
}

/// A directory's chain: its full file and the deltas linked to it, in order.
pub(super) struct Chain {
    pub(super) base: PathBuf,
    pub(super) base_identity: u32,
    /// Each delta's file, opened, and its identity.
    pub(super) deltas: Vec<(MappedFile, u32)>,
}

impl Chain {
    /// The chain in `dir` (`None` without a full file), up to delta
    /// `last` when given (what follows it is not read, so a broken later
    /// delta does not keep an earlier one from loading). Deltas that name
    /// another full file are leftovers of an earlier chain, and ignored
    /// (the next save removes them); a delta of this chain out of sequence
    /// or linked to another parent is an error naming it.
    pub(super) fn read(dir: &Path, last: Option<u64>) -> Result<Option<Self>, ModelError> {
        let base = dir.join(CHECKPOINT_FILE);
        if !base.is_file() {
            return Ok(None);
        }
        let base_file = MappedFile::open(&base)?;
        let Some(base_identity) = identity(base_file.metadata()) else {
            // Not Ember's file: no delta can build on it.
            return Ok(Some(Self {
                base,
                base_identity: 0,
                deltas: Vec::new(),
            }));
        };
        drop(base_file);
        let mut deltas = Vec::new();
        let files = delta_files(dir)?.into_iter();
        for (sequence, path) in files.take_while(|(k, _)| last.is_none_or(|l| *k <= l)) {
            let file = MappedFile::open(&path)?;
            let link: DeltaLink = super::read::meta_value(file.metadata(), META_DELTA, &path)?
                .ok_or_else(|| fail_at(&path, format!("a delta's name without '{META_DELTA}'")))?;
            if link.base != hex(base_identity) {
                continue;
            }
            let (parent, expected) = match deltas.last() {
                Some((_, id)) => (*id, deltas.len() as u64 + 1),
                None => (base_identity, 1),
            };
            let broken = |why: String| fail_at(&path, format!("broken delta chain: {why}"));
            if link.sequence != sequence {
                return Err(broken(format!(
                    "it says it is delta {}, not delta {sequence}",
                    link.sequence
                )));
            }
            if sequence != expected {
                return Err(broken(format!(
                    "delta {expected}, which it follows, is missing"
                )));
            }
            if link.parent != hex(parent) {
                return Err(broken(format!(
                    "it builds on a file {} that is not the chain's delta {} ({})",
                    link.parent,
                    sequence - 1,
                    hex(parent)
                )));
            }
            let id = identity(file.metadata())
                .ok_or_else(|| broken("it carries no checksums".into()))?;
            deltas.push((file, id));
        }
        Ok(Some(Self {
            base,
            base_identity,
            deltas,
        }))
    }

    /// The last file of the chain (the full file without deltas).
    pub(super) fn tail(&self) -> PathBuf {
        match self.deltas.last() {
            Some((file, _)) => file.path().to_path_buf(),
            None => self.base.clone(),
        }
    }

    /// The chain's head, as a model built from (or saving) all of it holds.
    pub(super) fn head(&self, dir: &Path) -> ChainHead {
        ChainHead {
            dir: dir.to_path_buf(),
            base: self.base_identity,
            tail: self.deltas.last().map_or(self.base_identity, |(_, id)| *id),
            sequence: self.deltas.len() as u64,
        }
    }
}

/// The delta files in `dir` by sequence number.
fn delta_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>, ModelError> {
    let entries = std::fs::read_dir(dir).map_err(|e| fail_at(dir, e.to_string()))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| fail_at(dir, e.to_string()))?;
        let name = entry.file_name();
        if let Some(sequence) = name.to_str().and_then(delta_sequence) {
            files.push((sequence, entry.path()));
        }
    }
    files.sort();
    Ok(files)
}

/// Removes the deltas of `dir` numbered `after + 1` and up (all with 0):
/// a new full file's old chain, or a chain forked at `after` (where a
/// delta left behind would break the new chain: the error says which).
pub(super) fn remove_deltas(dir: &Path, after: u64) -> Result<(), ModelError> {
    for (sequence, path) in delta_files(dir)? {
        if sequence > after {
            std::fs::remove_file(&path).map_err(|e| fail_at(&path, e.to_string()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{delta_file_name, delta_sequence};

    #[test]
    fn delta_names_round_trip_and_others_are_not_deltas() {
        assert_eq!(delta_sequence(&delta_file_name(7)), Some(7));
        assert_eq!(delta_sequence(&delta_file_name(1_234_567)), Some(1_234_567));
        for other in [
            "model.safetensors",
            "model.delta-.safetensors",
            "model.delta-1x.safetensors",
        ] {
            assert_eq!(delta_sequence(other), None, "{other}");
        }
    }
}
