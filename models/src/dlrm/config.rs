//! A DLRM's architecture: the interaction type and [`DlrmConfig`] (tables,
//! bottom and top MLP sizes) with the sizes that follow from it and its
//! validation.

use ember_sparse::EmbeddingBagConfig;
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// How the bottom MLP's output and the pooled embeddings interact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum InteractionType {
    /// Pairwise dot products (DLRM).
    Dot,
    /// Low-rank cross network over the concatenated features (DLRM-DCNv2).
    Dcn {
        /// Cross layers (TorchRec's `num_layers`), each
        /// `x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`.
        layers: usize,
        /// The rank of each layer's `W_l V_l` (TorchRec's `low_rank`).
        rank: usize,
    },
}

/// The architecture of a DLRM, as dlrm_s_pytorch's flags describe it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DlrmConfig {
    /// The embedding tables, all of one embedding dim; their features, in
    /// order, are the sparse inputs.
    pub tables: Vec<EmbeddingBagConfig>,
    /// Bottom MLP sizes including its input (the number of dense features),
    /// e.g. `[13, 512, 256, 64, 16]`; the last equals the embedding dim.
    pub bottom_mlp: Vec<usize>,
    /// Top MLP sizes after its input (which follows from the interaction),
    /// e.g. `[512, 256, 1]`; the last is 1.
    pub top_mlp: Vec<usize>,
    /// How the bottom MLP's output and the pooled embeddings interact.
    pub interaction: InteractionType,
}

/// The most layers an MLP or a DCN may have: deeper stacks are a typo,
/// not a model (the DLRMs of papers and MLPerf have 2 to 4), and would run
/// for minutes before any step.
pub const MAX_LAYERS: usize = 128;

impl DlrmConfig {
    /// Criteo-style tables: feature `cat_i` looks up table `t_cat_i`.
    pub fn criteo_tables(rows: &[usize], dim: usize) -> Vec<EmbeddingBagConfig> {
        rows.iter()
            .enumerate()
            .map(|(i, &r)| {
                EmbeddingBagConfig::new(&format!("t_cat_{i}"), r, dim, &[&format!("cat_{i}")])
            })
            .collect()
    }

    /// Number of dense features: the bottom MLP's input.
    pub fn num_dense(&self) -> usize {
        self.bottom_mlp[0]
    }

    /// The embedding dim of the tables (the first table's; 0 without tables).
    pub fn embedding_dim(&self) -> usize {
        self.tables.first().map_or(0, |t| t.embedding_dim)
    }

    /// Every sparse feature with its table's row count, in output order.
    pub fn feature_rows(&self) -> Vec<(String, usize)> {
        (self.tables.iter())
            .flat_map(|t| {
                t.feature_names
                    .iter()
                    .map(|f| (f.clone(), t.num_embeddings))
            })
            .collect()
    }

    /// Number of pooled embedding vectors per sample.
    pub fn num_sparse_features(&self) -> usize {
        self.tables.iter().map(|t| t.feature_names.len()).sum()
    }

    /// Width of the interaction's output, the top MLP's input.
    pub fn interaction_output_dim(&self) -> usize {
        let (f, d) = (self.num_sparse_features(), self.embedding_dim());
        match self.interaction {
            InteractionType::Dot => d + f * (f + 1) / 2,
            InteractionType::Dcn { .. } => (f + 1) * d,
        }
    }

    /// Top MLP sizes including its input.
    pub fn top_mlp_sizes(&self) -> Vec<usize> {
        let mut sizes = vec![self.interaction_output_dim()];
        sizes.extend(&self.top_mlp);
        sizes
    }

    /// Checks the architecture: at least one table, none of 0 rows, one
    /// embedding dim for all, a bottom MLP of an input and at least one
    /// layer ending in that dim, a top MLP ending in 1, no size 0, and a
    /// DCN of at least one layer and rank 1. Fails with
    /// [`ModelError::Architecture`] saying what is wrong.
    pub fn validate(&self) -> Result<(), ModelError> {
        Ok(self.check()?)
    }

    fn check(&self) -> Result<(), ArchitectureError> {
        use ArchitectureError as E;
        if self.tables.is_empty() {
            return Err(E::NoTables);
        }
        if let Some(t) = self.tables.iter().find(|t| t.num_embeddings == 0) {
            return Err(E::EmptyTable(t.name.clone()));
        }
        let dim = self.embedding_dim();
        if let Some(t) = self.tables.iter().find(|t| t.embedding_dim != dim) {
            let (table, has) = (t.name.clone(), t.embedding_dim);
            return Err(E::MixedDims {
                table,
                has,
                first: dim,
            });
        }
        let bottom = self.bottom_mlp.clone();
        if bottom.len() < 2 || bottom.contains(&0) {
            return Err(E::BottomMlp(bottom));
        }
        if bottom[bottom.len() - 1] != dim {
            let ends = bottom[bottom.len() - 1];
            return Err(E::BottomDim { ends, dim });
        }
        if self.top_mlp.last() != Some(&1) || self.top_mlp.contains(&0) {
            return Err(E::TopMlp(self.top_mlp.clone()));
        }
        if let InteractionType::Dcn { layers, rank } = self.interaction {
            if layers == 0 || rank == 0 {
                return Err(E::EmptyDcn);
            }
            if layers > MAX_LAYERS {
                return Err(E::DeepDcn(layers));
            }
        }
        for (name, mlp) in [("bottom", &self.bottom_mlp), ("top", &self.top_mlp)] {
            if mlp.len() > MAX_LAYERS + 1 {
                return Err(E::DeepMlp {
                    which: name,
                    layers: mlp.len() - 1,
                });
            }
        }
        Ok(())
    }
}

/// What is wrong with a [`DlrmConfig`] ([`ModelError::Architecture`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArchitectureError {
    /// A sequence model's configuration that describes no model (which
    /// way: the message).
    #[error("{0}")]
    Sequence(String),
    /// No embedding table.
    #[error("at least one embedding table is needed")]
    NoTables,
    /// A table of 0 rows (named).
    #[error("table '{0}' has no rows")]
    EmptyTable(String),
    /// Tables of different dims: the interaction needs one.
    #[error("all tables need one embedding dim for the interaction: '{table}' has {has}, the first has {first}")]
    MixedDims {
        /// The first table of another dim.
        table: String,
        /// Its dim.
        has: usize,
        /// The first table's dim.
        first: usize,
    },
    /// A bottom MLP without an input and a layer, or with a size 0.
    #[error("bottom MLP {0:?} needs an input and at least one layer, none of size 0")]
    BottomMlp(Vec<usize>),
    /// A bottom MLP that does not end in the embedding dim.
    #[error("the bottom MLP ends in {ends} but the embedding dim is {dim}: they must match")]
    BottomDim {
        /// Its last size.
        ends: usize,
        /// The tables' dim.
        dim: usize,
    },
    /// A top MLP that does not end in one logit, or has a size 0.
    #[error("top MLP {0:?} must end in a single logit (1)")]
    TopMlp(Vec<usize>),
    /// A DCN of no layers or rank 0.
    #[error("a DCN needs at least one layer and a rank of at least 1")]
    EmptyDcn,
    /// A DCN of more cross layers than the most a model takes (128).
    #[error("a DCN of {0} cross layers: at most {MAX_LAYERS} (DCNv2 uses 2 to 4)")]
    DeepDcn(usize),
    /// An MLP of more layers than the most a model takes (128).
    #[error("a {which} MLP of {layers} layers: at most {MAX_LAYERS}")]
    DeepMlp {
        /// `bottom` or `top`.
        which: &'static str,
        /// Its layers.
        layers: usize,
    },
}
