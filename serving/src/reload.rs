//! Hot reload: the served checkpoint (a file, or a run's checkpoint
//! directory whose newest checkpoint or delta chain it follows) is watched;
//! a new one is loaded beside the serving model and swapped in between
//! batches. One that fails its checks, or whose inputs differ from those
//! the server answers metadata with, is refused and logged, and the model
//! before keeps serving.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::batcher::Batcher;
use crate::inputs::Inputs;
use crate::model::{ModelOptions, ServedModel};
use crate::ServeError;

/// What to watch and how to open what appears.
#[derive(Clone, Debug)]
pub struct ReloadOptions {
    /// The checkpoint served: a file, a set's index or a run's directory.
    pub checkpoint: PathBuf,
    /// How often to look for a new checkpoint (Triton's
    /// `--repository-poll-secs`).
    pub poll: Duration,
    /// How a new checkpoint's model is opened; a disk tier's files go into
    /// a directory of each version (`version-N`) under its directory.
    pub model: ModelOptions,
    /// The checkpoint serving now ([`identity`] read before it was opened).
    pub serving: Identity,
}

/// Which checkpoint a path holds now: the file it resolves to, its
/// modification time and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity(PathBuf, SystemTime, u64);

/// The checkpoint `path` resolves to now (a directory: its newest).
pub fn identity(path: &Path) -> Result<Identity, ServeError> {
    let file = if path.is_dir() {
        ember_models::checkpoint::latest(path, None)?
            .ok_or_else(|| ServeError::Config(format!("{}: no checkpoint in it", path.display())))?
    } else {
        path.to_path_buf()
    };
    let meta = std::fs::metadata(&file)?;
    Ok(Identity(file, meta.modified()?, meta.len()))
}

/// The disk tier's options for `version` (its own directory: two versions
/// live side by side while one replaces the other).
pub fn for_version(options: &ModelOptions, version: u64) -> ModelOptions {
    let mut options = options.clone();
    if let Some(tier) = options.disk_tier.as_mut() {
        tier.dir = tier.dir.join(format!("version-{version}"));
    }
    options
}

/// Watches `options.checkpoint`, until `stop` says so or
/// is dropped; swaps each new model into `batcher`.
pub fn watch(
    options: ReloadOptions,
    inputs: Arc<Inputs>,
    batcher: Arc<Batcher>,
    stop: Receiver<()>,
) {
    // `refused`: the checkpoint (or the error naming why none could be
    // found) refused last, so that it is logged and counted once.
    let (mut serving, mut refused) = (options.serving.clone(), None);
    let mut version = batcher.version();
    let refuse = |refused: &mut Option<Result<Identity, String>>, key, why: String| {
        batcher.metrics().reload_failures.inc();
        let serving = batcher.version();
        eprintln!("reload: refused {why} (version {serving} keeps serving)");
        *refused = Some(key);
    };
    loop {
        match stop.recv_timeout(options.poll) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let now = identity(&options.checkpoint).map_err(|e| e.to_string());
        if now.as_ref() == Ok(&serving) || Some(&now) == refused.as_ref() {
            continue;
        }
        let now = match now {
            Ok(now) => now,
            Err(e) => {
                let why = format!("{}: {e}", options.checkpoint.display());
                refuse(&mut refused, Err(e), why);
                continue;
            }
        };
        let next = version + 1;
        let opened = ServedModel::open(
            &options.checkpoint,
            inputs.name(),
            &for_version(&options.model, next),
        )
        .and_then(|model| match model.inputs.same_as(&inputs) {
            true => Ok(model),
            false => Err(ServeError::Config(
                "its inputs or outputs differ from the served model's: restart the server to change them".into(),
            )),
        });
        match opened {
            Ok(model) => {
                if let Err(e) = batcher.swap(model.instances, next) {
                    let why = format!("{}: {e}", now.0.display());
                    refuse(&mut refused, Ok(now), why);
                    continue;
                }
                version = next;
                batcher.metrics().reloads.inc();
                eprintln!("reload: serving {} as version {next}", now.0.display());
                serving = now;
                refused = None;
            }
            Err(e) => {
                let why = format!("{}: {e}", now.0.display());
                refuse(&mut refused, Ok(now), why);
            }
        }
    }
}
