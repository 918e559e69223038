//! Checkpoints: one safetensors file, memory-mapped on load, with the tensor
//! names and shapes of TorchRec's DLRM `state_dict`:
//!
//! ```text
//! sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight   [rows, dim]
//!     (F32, F16 or BF16 by the table's type; quantized: U8 [rows, row bytes])
//! dense_arch.model._mlp.<i>._linear.{weight [out, in], bias [out]}
//! over_arch.model.0._mlp.<i>._linear.{weight, bias}   every top layer but the last
//! over_arch.model.1.{weight, bias}                    the last top layer
//! inter_arch.crossnet.W_kernels.<l> [in, rank], V_kernels.<l> [rank, in], bias.<l> [in]
//! ```
//!
//! Optimizer state sits beside the weights under `optimizer.<weight name
//! without .weight>.<state>`, with FBGEMM's names for the tables
//! (`momentum1`: row-wise Adagrad `[rows]`, Adagrad `[rows, dim]`, Adam's
//! first moment `[rows, dim]`; `momentum2`: Adam's second moment) and
//! torch's for the dense parameters (`sum` for Adagrad, `exp_avg` and
//! `exp_avg_sq` for Adam), e.g. `optimizer.dense_arch.model._mlp.0._linear.weight.exp_avg`.
//! The metadata holds the architecture (`ember.config`, JSON), both
//! optimizers, their step counts and the training position, so `eval` and
//! `predict` need no flags. A file without Ember's metadata (TorchRec's
//! `safetensors.torch.save_file(model.state_dict(), path)`) loads too: the
//! architecture is inferred from the names and shapes.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{ModelError, Optimization};

mod chain;
mod delta;
mod kv;
mod names;
mod quantize;
mod read;
mod rows;
mod set;
mod state;
mod store;
mod valid;
mod write;
pub use chain::delta_file_name;
pub(crate) use chain::ChainHead;
pub(crate) use delta::write_delta;
pub use delta::{compact, save_delta, CompactSummary};
pub use names::{dense_shapes, natural_key, table_weight_name, weight_layout};
pub use quantize::{quantize, quantize_new, QuantizeSummary};
pub use read::{resume, Checkpoint};
pub use set::{remove_set, save_set, INDEX_FILE};
pub use state::{StateDict, StateFile};
pub(crate) use write::fail_at;
pub use write::save;
pub(crate) use write::save_full;

/// The file a one-process checkpoint is written to in its directory.
pub const CHECKPOINT_FILE: &str = "model.safetensors";

/// The checkpoint to resume from in `dir`: one file (or the last delta
/// of its chain), or the set the ranks of a world wrote; the newer when
/// both are there (a crash between writing one and removing the other).
/// A broken delta chain is an error naming the file. On a world, rank 0
/// decides for every rank (all ranks call this together).
pub fn latest(
    dir: &Path,
    world: Option<&std::sync::Arc<dyn ember_sharding::Collective>>,
) -> Result<Option<PathBuf>, ModelError> {
    // A full file's state is its chain's last file (the full file
    // without deltas); the set's index or that, whichever is newer.
    let choose = || -> Result<Option<PathBuf>, ModelError> {
        let modified = |p: PathBuf| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p));
        let tail = chain::Chain::read(dir, None)?.map(|c| c.tail());
        Ok([Some(dir.join(INDEX_FILE)), tail]
            .into_iter()
            .flatten()
            .filter_map(modified)
            .max_by_key(|(t, _)| *t)
            .map(|(_, p)| p))
    };
    let Some(comm) = world else {
        return choose();
    };
    // Rank 0's error goes to every rank (after a NUL), so none waits on.
    let mine = match comm.rank() {
        0 => match choose() {
            Ok(p) => p.map_or(Vec::new(), |p| {
                p.to_string_lossy().into_owned().into_bytes()
            }),
            Err(e) => [&b"\0"[..], e.to_string().as_bytes()].concat(),
        },
        _ => Vec::new(),
    };
    let chosen = comm.broadcast(0, mine)?;
    let chosen = String::from_utf8_lossy(&chosen).into_owned();
    if let Some(error) = chosen.strip_prefix('\0') {
        return Err(fail_at(dir, format!("rank 0: {error}")));
    }
    Ok((!chosen.is_empty()).then(|| PathBuf::from(chosen)))
}

/// After `model` was saved whole to `dir`'s `model.safetensors` (of
/// `identity`): its changed rows count from there, and the directory's
/// older deltas go.
pub(crate) fn after_full_save(model: &mut crate::Dlrm, dir: &Path, identity: u32) {
    // Best effort: a delta left names the old full file and is ignored.
    let _ = chain::remove_deltas(dir, 0);
    let Some(ebc) = model.sparse_arch_mut().local_mut() else {
        return;
    };
    ebc.clear_changed();
    model.set_chain_head(Some(ChainHead {
        dir: dir.to_path_buf(),
        base: identity,
        tail: identity,
        sequence: 0,
    }));
}

/// The prefix of DLRM's table tensors (TorchRec's `EmbeddingBagCollection` in `sparse_arch`).
pub const TABLE_PREFIX: &str = "sparse_arch.embedding_bag_collection.embedding_bags.";
/// The prefix of optimizer-state tensors: a table's state is named
/// `optimizer.<table name without .weight>.<state>` (FBGEMM's `momentum1`,
/// `momentum2`), a dense parameter's `optimizer.<parameter>.<state>`
/// (torch's `sum`, `exp_avg`, `exp_avg_sq`).
pub const OPTIMIZER_PREFIX: &str = "optimizer.";

const META_CONFIG: &str = "ember.config";
const META_TABLE_OPTIMIZER: &str = "ember.table_optimizer";
const META_DENSE_OPTIMIZER: &str = "ember.dense_optimizer";
const META_SPARSE_STEP: &str = "ember.sparse_step";
const META_DENSE_STEPS: &str = "ember.dense_steps";
const META_TRAIN_STATE: &str = "ember.train_state";
const META_ROUNDING_SEED: &str = "ember.rounding_seed";
/// How the model reads its inputs: the dataset spec (columns, transforms,
/// tables) of the data it was trained on, JSON. `eval`, `predict` and
/// [`Checkpoint::input_spec`] read data this way unless told otherwise.
const META_DATASET_SPEC: &str = "ember.dataset_spec";
/// The CRC-32 (IEEE, as zlib's) of each tensor's bytes: a JSON object of
/// tensor name to 8 hex digits. Readers that do not know it (TorchRec's)
/// ignore it; Ember verifies it, and reads a file without it unverified.
const META_CRC32: &str = "ember.crc32";

/// Where training stood when a checkpoint was written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainState {
    /// The epoch in progress (0-based).
    pub epoch: u64,
    /// Batches of that epoch already trained on.
    pub batches_in_epoch: u64,
    /// Training steps in all.
    pub steps: u64,
    /// The batch size and shuffling seed the position counts in.
    pub batch_size: u64,
    /// The seed the row groups were shuffled with (`None`: not shuffled).
    pub shuffle_seed: Option<u64>,
    /// How the batches were made, which a resumed run must repeat.
    #[serde(default)]
    pub drop_last: bool,
    /// How raw dense values became model inputs (`None`: not recorded).
    #[serde(default)]
    pub dense_transform: Option<ember_dataloader::DenseTransform>,
    /// How raw ids became table rows (`None`: not recorded).
    #[serde(default)]
    pub id_transform: Option<ember_dataloader::IdTransform>,
    /// `Dataset::fingerprint` of the training data (0: not recorded).
    #[serde(default)]
    pub data_fingerprint: u64,
    /// Ranks the position counts in (each read its own row groups); 1 for
    /// checkpoints from before ranks, which ran in one process.
    #[serde(default = "one_process")]
    pub world_size: u64,
    /// With `train --stream-window`: the window (the data's file, in
    /// natural name order) this position is in; `None`: not a stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<u64>,
    /// The run's learning-rate schedules, weight decay and clipping
    /// ([`TrainerConfig::optimization`](crate::TrainerConfig::optimization)):
    /// the rates are a function of `steps`, so a resumed run that gives
    /// the same goes on bit for bit.
    #[serde(default, skip_serializing_if = "Optimization::is_default")]
    pub optimization: Optimization,
}

fn one_process() -> u64 {
    1
}

impl Default for TrainState {
    /// The start of a run in one process, nothing recorded of its batches.
    fn default() -> Self {
        Self {
            epoch: 0,
            batches_in_epoch: 0,
            steps: 0,
            batch_size: 0,
            shuffle_seed: None,
            drop_last: false,
            dense_transform: None,
            id_transform: None,
            data_fingerprint: 0,
            world_size: 1,
            window: None,
            optimization: Optimization::default(),
        }
    }
}

impl TrainState {
    /// Whether this is the start of a run: no step, epoch or batch done.
    pub fn is_fresh(&self) -> bool {
        self.epoch == 0 && self.batches_in_epoch == 0 && self.steps == 0
    }
}
