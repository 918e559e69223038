//! The route layout: the output features (slots), their (feature, shard)
//! routes to the owning devices, and the per-call context the device
//! stages share.

use std::ops::Range;
use std::sync::Arc;

use ember_sparse::KeyedJaggedTensor;

use crate::plan::RowSplit;

/// One output feature of the whole collection.
#[derive(Clone, Debug)]
pub(super) struct Slot {
    pub(super) feature: String,
    pub(super) table: usize,
    /// Column of the feature's pooled vector in an output row.
    pub(super) offset: usize,
    /// Mean pooling over a row-split table: each shard sees only part of a
    /// bag, so the mean's 1/len travels as a per-id weight (computed as the
    /// unsharded kernel computes its scale) and shards sum.
    pub(super) split_mean: bool,
}

/// One (feature, shard): what a device looks up for a feature.
#[derive(Clone, Debug)]
pub(super) struct Route {
    pub(super) slot: usize,
    /// The shard's index in its table's plan.
    pub(super) shard: usize,
    pub(super) device: usize,
    pub(super) rows: RowSplit,
    pub(super) columns: Range<usize>,
    pub(super) data_parallel: bool,
}

/// What every device reads and none changes: the features, the routes, and
/// the pool the kernels run in.
pub(super) struct Layout {
    pub(super) slots: Vec<Slot>,
    pub(super) routes: Vec<Route>,
    /// Width of an output row.
    pub(super) width: usize,
    /// Some feature is a row-split mean (its 1/len travels as weights).
    pub(super) any_split_mean: bool,
    /// The pool the collection was made in. Only kernels run there: a device
    /// body blocks on its peers, which would starve a pool with fewer
    /// threads than devices, so device bodies are plain threads.
    pub(super) pool: Arc<rayon::ThreadPool>,
}

impl Layout {
    /// The view of one call's input that the device stages share.
    pub(super) fn context<'a>(
        &'a self,
        kjt: &'a KeyedJaggedTensor,
        keys: &'a [usize],
        owners: &'a [Range<usize>],
        offset: usize,
    ) -> Context<'a> {
        Context {
            layout: self,
            kjt,
            keys,
            owners,
            offset,
            weighted: kjt.weights().is_some() || self.any_split_mean,
        }
    }
}

pub(super) fn local_name(name: &str, shard: usize) -> String {
    format!("{name}#{shard}")
}

pub(super) struct Context<'a> {
    layout: &'a Layout,
    kjt: &'a KeyedJaggedTensor,
    keys: &'a [usize],
    /// Every device's samples, in global positions.
    pub(super) owners: &'a [Range<usize>],
    /// The global position of `kjt`'s first sample (0 unless on a rank).
    pub(super) offset: usize,
    /// The local bags carry weights: the input's, or a row-split mean's 1/len.
    pub(super) weighted: bool,
}

impl std::ops::Deref for Context<'_> {
    type Target = Layout;
    fn deref(&self) -> &Layout {
        self.layout
    }
}

impl Context<'_> {
    /// The ids (and weights) of `slot`'s bag of global sample `sample`.
    pub(super) fn bag(&self, slot: usize, sample: usize) -> (&[i64], Option<&[f32]>) {
        let sample = sample - self.offset;
        let b = self.kjt.stride();
        let k = self.keys[slot];
        let (s, e) = (
            self.kjt.offsets()[k * b + sample],
            self.kjt.offsets()[k * b + sample + 1],
        );
        (
            &self.kjt.values()[s..e],
            self.kjt.weights().map(|w| &w[s..e]),
        )
    }

    /// Does route `r` carry bags from device `src` in the forward?
    pub(super) fn forward_sends(&self, r: usize, src: usize) -> bool {
        !self.routes[r].data_parallel || self.routes[r].device == src
    }
}
