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
    /// [`ModelError::Config`] saying what is wrong.
    pub fn validate(&self) -> Result<(), ModelError> {
        let fail = |m: String| Err(ModelError::Config(m));
        if self.tables.is_empty() {
            return fail("at least one embedding table is needed".into());
        }
        if let Some(t) = self.tables.iter().find(|t| t.num_embeddings == 0) {
            return fail(format!("table '{}' has no rows", t.name));
        }
        let dim = self.embedding_dim();
        if let Some(t) = self.tables.iter().find(|t| t.embedding_dim != dim) {
            return fail(format!(
                "all tables need one embedding dim for the interaction: '{}' has {}, the first has {dim}",
                t.name, t.embedding_dim
            ));
        }
        if self.bottom_mlp.len() < 2 || self.bottom_mlp.contains(&0) {
            return fail(format!(
                "bottom MLP {:?} needs an input and at least one layer, none of size 0",
                self.bottom_mlp
            ));
        }
        if *self.bottom_mlp.last().unwrap() != dim {
            return fail(format!(
                "the bottom MLP ends in {} but the embedding dim is {dim}: they must match",
                self.bottom_mlp.last().unwrap()
            ));
        }
        if self.top_mlp.last() != Some(&1) || self.top_mlp.contains(&0) {
            return fail(format!(
                "top MLP {:?} must end in a single logit (1)",
                self.top_mlp
            ));
        }
        if let InteractionType::Dcn { layers, rank } = self.interaction {
            if layers == 0 || rank == 0 {
                return fail("a DCN needs at least one layer and a rank of at least 1".into());
            }
            if layers > MAX_LAYERS {
                return fail(format!(
                    "a DCN of {layers} cross layers: at most {MAX_LAYERS} (DCNv2 uses 2 to 4)"
                ));
            }
        }
        for (name, mlp) in [("bottom", &self.bottom_mlp), ("top", &self.top_mlp)] {
            if mlp.len() > MAX_LAYERS + 1 {
                return fail(format!(
                    "a {name} MLP of {} layers: at most {MAX_LAYERS}",
                    mlp.len() - 1
                ));
            }
        }
        Ok(())
    }
}
