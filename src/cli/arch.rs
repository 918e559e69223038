//! The architecture and optimizer flags shared by `bench dlrm`, `train`,
//! `ingest synthetic` (the table sizes) and, later, `plan`; names follow
//! dlrm_s_pytorch.py.

use anyhow::bail;
use clap::{Args, ValueEnum};

use ember_dataloader::DatasetSpec;
use ember_dense::DenseOptimizerConfig;
use ember_models::{DlrmConfig, InteractionType};
use ember_sparse::{DataType, TableOptimizer};

use super::bench_embedding::BenchOptimizer;
use super::kv::KvArgs;
use super::parse_sizes;

/// The 26 table sizes of the MLPerf DLRMv2 benchmark (Criteo 1TB, the
/// reference's `--num_embeddings_per_feature`: five tables at 40M rows,
/// 204,184,588 in all; MLPerf v1's, the ids dlrm_s_pytorch's Terabyte
/// preprocessing counted, were 187,767,399).
pub const MLPERF_TABLE_ROWS: [usize; 26] = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
];
/// Cap on MLPerf table rows when `--max-ind-range` is not given: keeps the
/// preset's tables near 4 GB, so it runs on a 24 GiB machine.
pub const MLPERF_DEFAULT_MAX_IND_RANGE: usize = 1_000_000;

/// MLPerf DLRMv2's multi-hot sizes per feature (the reference's
/// `--multi_hot_sizes`: 214 ids a sample).
pub const MLPERF_MULTI_HOT_SIZES: [usize; 26] = [
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// Criteo Kaggle shape: dim 16, bottom 13-512-256-64-16, top 512-256-1, 26 x 100k rows, dot.
    Kaggle,
    /// MLPerf DLRM-DCNv2: dim 128, bottom 13-512-256-128, DCN 3 layers rank 512, top 1024-1024-512-256-1.
    Mlperf,
    /// MLPerf DLRMv2 as benchmarked: the mlperf model, each feature's bags
    /// of exactly MLPerf's multi-hot size (3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,
    /// 1,1,1,12,100,27,10,3,1,1: 214 ids a sample).
    MlperfMultihot,
}

impl Preset {
    /// Each feature's ids per bag, for the multi-hot preset.
    pub fn multi_hot_sizes(self) -> Option<Vec<usize>> {
        (self == Preset::MlperfMultihot).then(|| MLPERF_MULTI_HOT_SIZES.to_vec())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InteractionOp {
    Dot,
    Dcn,
}

/// What a preset (or none) fills in.
struct PresetDefaults {
    dim: usize,
    rows: Vec<usize>,
    bot: &'static str,
    top: &'static str,
    op: InteractionOp,
    lookups: usize,
    fixed: bool,
    cap: Option<usize>,
}

#[derive(Args, Clone, Debug)]
pub struct ArchArgs {
    /// Fill the architecture from a known shape; explicit flags still win.
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Embedding dim [default: 2].
    #[arg(long)]
    pub arch_sparse_feature_size: Option<usize>,
    /// Rows per table, dash-separated [default: 4-3-2].
    #[arg(long)]
    pub arch_embedding_size: Option<String>,
    /// Bottom MLP sizes including the dense input [default: 4-3-2].
    #[arg(long)]
    pub arch_mlp_bot: Option<String>,
    /// Top MLP sizes after the interaction [default: 4-2-1].
    #[arg(long)]
    pub arch_mlp_top: Option<String>,
    /// dot (DLRM) or dcn (DLRM-DCNv2) [default: dot].
    #[arg(long, value_enum)]
    pub arch_interaction_op: Option<InteractionOp>,
    /// Cross layers of the DCN [default: 3].
    #[arg(long)]
    pub dcn_num_layers: Option<usize>,
    /// Rank of the DCN's low-rank cross layers [default: 512].
    #[arg(long)]
    pub dcn_low_rank_dim: Option<usize>,
    /// Caps every table's rows (ids are reduced below the cap).
    #[arg(long)]
    pub max_ind_range: Option<usize>,
    /// Data type of every table's rows: fp32, fp16 or bf16 (half-precision
    /// rows are updated with stochastic rounding) [default: fp32, or each
    /// of a dataset spec's tables' own `data_type`].
    #[arg(long, value_parser = super::parse_data_type)]
    pub table_dtype: Option<DataType>,
    #[command(flatten)]
    pub kv: KvArgs,
    /// The rows the data's vocabulary needs per table
    /// (`ingest criteo --vocabulary-threshold`), when it has one: the
    /// tables' rows unless `--arch-embedding-size` gives them.
    #[arg(skip)]
    pub data_rows: Option<Vec<usize>>,
}

impl ArchArgs {
    /// The architecture flags given (all but `--table-dtype`): what a run
    /// that takes its architecture from a checkpoint ignores.
    pub fn given_architecture_flags(&self) -> Vec<&'static str> {
        [
            ("--preset", self.preset.is_some()),
            (
                "--arch-sparse-feature-size",
                self.arch_sparse_feature_size.is_some(),
            ),
            ("--arch-embedding-size", self.arch_embedding_size.is_some()),
            ("--arch-mlp-bot", self.arch_mlp_bot.is_some()),
            ("--arch-mlp-top", self.arch_mlp_top.is_some()),
            ("--arch-interaction-op", self.arch_interaction_op.is_some()),
            ("--dcn-num-layers", self.dcn_num_layers.is_some()),
            ("--dcn-low-rank-dim", self.dcn_low_rank_dim.is_some()),
            ("--max-ind-range", self.max_ind_range.is_some()),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .chain(self.kv.given())
        .collect()
    }

    /// The preset's ids per bag for each feature, when it has them.
    pub fn multi_hot_sizes(&self) -> Option<Vec<usize>> {
        self.preset.and_then(Preset::multi_hot_sizes)
    }

    /// The architecture, and the preset's default ids per bag (and whether fixed).
    pub fn resolve(&self) -> anyhow::Result<(DlrmConfig, usize, bool)> {
        self.resolve_for(None)
    }

    /// The embedding dim and the rows of each table the flags give (the
    /// preset's where they give none, capped by `--max-ind-range`).
    pub fn table_shape(&self) -> anyhow::Result<(usize, Vec<usize>)> {
        let p = self.preset_defaults();
        let dim = self.arch_sparse_feature_size.unwrap_or(p.dim);
        let mut rows = match (&self.arch_embedding_size, &self.data_rows) {
            (Some(s), _) => parse_sizes("--arch-embedding-size", s)?,
            (None, Some(data)) => data.clone(),
            (None, None) => p.rows,
        };
        if let Some(i) = rows.iter().position(|&r| r == 0) {
            bail!("--arch-embedding-size: table {i} has 0 rows");
        }
        // Ids beyond a table would be folded by modulo: only when asked.
        let short = (self.data_rows.iter())
            .flat_map(|data| rows.iter().zip(data).enumerate())
            .find(|(_, (r, d))| r < d);
        if let (Some((i, (r, d))), None) = (short, self.max_ind_range) {
            bail!(
                "--arch-embedding-size gives table {i} {r} rows, but the data's vocabulary \
                 needs {d} rows in it: give at least that many, or --max-ind-range to fold ids by modulo"
            );
        }
        if let Some(cap) = self.max_ind_range.or(p.cap) {
            anyhow::ensure!(cap > 0, "--max-ind-range must be at least 1");
            rows.iter_mut().for_each(|r| *r = (*r).min(cap));
        }
        Ok((dim, rows))
    }

    fn preset_defaults(&self) -> PresetDefaults {
        let (dim, rows, bot, top, op, lookups, fixed, cap) = match self.preset {
            None => (
                2,
                vec![4, 3, 2],
                "4-3-2",
                "4-2-1",
                InteractionOp::Dot,
                10,
                false,
                None,
            ),
            Some(Preset::Kaggle) => (
                16,
                vec![100_000; 26],
                "13-512-256-64-16",
                "512-256-1",
                InteractionOp::Dot,
                1,
                true,
                None,
            ),
            Some(Preset::Mlperf | Preset::MlperfMultihot) => (
                128,
                MLPERF_TABLE_ROWS.to_vec(),
                "13-512-256-128",
                "1024-1024-512-256-1",
                InteractionOp::Dcn,
                1,
                true,
                Some(MLPERF_DEFAULT_MAX_IND_RANGE),
            ),
        };
        PresetDefaults {
            dim,
            rows,
            bot,
            top,
            op,
            lookups,
            fixed,
            cap,
        }
    }

    /// The architecture for `spec`'s data (its tables; the bottom MLP's
    /// input is its dense columns), or for Criteo's when `None`. Without
    /// `--arch-mlp-bot`, a spec's bottom MLP is the preset's with the
    /// dataset's dense width in and the tables' dim out.
    pub fn resolve_for(
        &self,
        spec: Option<&DatasetSpec>,
    ) -> anyhow::Result<(DlrmConfig, usize, bool)> {
        let p = self.preset_defaults();
        let (bot, top, op, lookups, fixed) = (p.bot, p.top, p.op, p.lookups, p.fixed);
        let (dim, rows) = self.table_shape()?;
        let mut bottom_mlp = parse_sizes(
            "--arch-mlp-bot",
            self.arch_mlp_bot.as_deref().unwrap_or(bot),
        )?;
        let mut tables = match spec {
            None => DlrmConfig::criteo_tables(&rows, dim),
            Some(spec) => {
                let dense = spec.num_dense();
                if self.arch_mlp_bot.is_none() {
                    bottom_mlp[0] = dense;
                    if let Some(t) = spec.tables.first() {
                        *bottom_mlp.last_mut().expect("parsed sizes") = t.embedding_dim;
                    }
                }
                anyhow::ensure!(
                    bottom_mlp[0] == dense,
                    "--arch-mlp-bot takes {} dense inputs, the dataset has {dense} dense columns",
                    bottom_mlp[0]
                );
                spec.tables.clone()
            }
        };
        if let Some(dtype) = self.table_dtype {
            trainable(dtype)?;
            tables.iter_mut().for_each(|t| t.data_type = dtype);
        }
        self.kv.apply(&mut tables)?;
        let top_mlp = parse_sizes(
            "--arch-mlp-top",
            self.arch_mlp_top.as_deref().unwrap_or(top),
        )?;
        let interaction = match self.arch_interaction_op.unwrap_or(op) {
            InteractionOp::Dot => InteractionType::Dot,
            InteractionOp::Dcn => InteractionType::Dcn {
                layers: self.dcn_num_layers.unwrap_or(3),
                rank: self.dcn_low_rank_dim.unwrap_or(512),
            },
        };
        let config = DlrmConfig {
            tables,
            bottom_mlp,
            top_mlp,
            interaction,
        };
        config.validate()?;
        Ok((config, lookups, fixed))
    }
}

/// Refuses a `--table-dtype` that does not train.
pub fn trainable(dtype: DataType) -> anyhow::Result<()> {
    anyhow::ensure!(
        dtype.is_trainable(),
        "--table-dtype {dtype}: quantized tables are for inference; train in fp32, fp16 or bf16, \
         then quantize the checkpoint with `ember quantize`"
    );
    Ok(())
}

#[derive(Args, Clone, Debug)]
pub struct OptimArgs {
    /// [default: 0.01]
    #[arg(long)]
    pub learning_rate: Option<f32>,
    /// Optimizer of the tables (fused) and, for the dense part: sgd → SGD,
    /// adagrad and rowwise-adagrad → Adagrad, adam → Adam. The default is
    /// TorchRec's usual fused choice: at batch 2048 and dlrm_s_pytorch's lr of
    /// 0.01, plain SGD barely moves the rows [default: rowwise-adagrad]
    #[arg(long, value_enum)]
    pub optimizer: Option<BenchOptimizer>,
}

impl OptimArgs {
    /// The learning rate (0.01 unless given).
    pub fn lr(&self) -> f32 {
        self.learning_rate.unwrap_or(0.01)
    }

    /// The optimizer (row-wise Adagrad unless given).
    pub fn kind(&self) -> BenchOptimizer {
        self.optimizer.unwrap_or(BenchOptimizer::RowwiseAdagrad)
    }

    /// The flags given (what a resumed run, which keeps its checkpoint's
    /// optimizers, overrides).
    pub fn given(&self) -> Vec<String> {
        let mut given = Vec::new();
        if let Some(lr) = self.learning_rate {
            given.push(format!("--learning-rate {lr}"));
        }
        if let Some(o) = self.optimizer {
            given.push(format!(
                "--optimizer {}",
                o.to_possible_value()
                    .map_or("?".into(), |v| v.get_name().to_string())
            ));
        }
        given
    }

    pub fn table_optimizer(&self) -> TableOptimizer {
        self.kind().table_optimizer(self.lr())
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if !(self.lr().is_finite() && self.lr() >= 0.0) {
            bail!(
                "--learning-rate must be a finite number >= 0, got {}",
                self.lr()
            );
        }
        Ok(())
    }

    pub fn dense_optimizer(&self) -> DenseOptimizerConfig {
        let lr = self.lr();
        match self.kind() {
            BenchOptimizer::None | BenchOptimizer::Sgd => DenseOptimizerConfig::Sgd { lr },
            BenchOptimizer::Adagrad | BenchOptimizer::RowwiseAdagrad => {
                DenseOptimizerConfig::Adagrad { lr, eps: 1e-10 }
            }
            BenchOptimizer::Adam => DenseOptimizerConfig::Adam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
        }
    }
}

/// Table sizes alone, for commands that read or write data but build no
/// model (`ingest synthetic`, `bench loader`): ids are drawn below, or
/// reduced modulo, these sizes.
#[derive(Args, Clone, Debug)]
pub struct TableArgs {
    #[arg(long, value_enum, default_value_t = Preset::Kaggle)]
    pub preset: Preset,
    /// Rows per table, dash-separated (26 tables) [default: the preset's].
    #[arg(long)]
    pub arch_embedding_size: Option<String>,
    /// Caps every table's rows.
    #[arg(long)]
    pub max_ind_range: Option<usize>,
}

impl TableArgs {
    /// `(feature, rows)` of every table: `cat_i` for table `t_cat_i`.
    pub fn feature_rows(&self) -> anyhow::Result<Vec<(String, usize)>> {
        Ok(self
            .tables()?
            .iter()
            .map(|t| (t.feature_names[0].clone(), t.num_embeddings))
            .collect())
    }

    /// The Criteo tables `t_cat_i` of the flags' sizes.
    pub fn tables(&self) -> anyhow::Result<Vec<ember_sparse::EmbeddingBagConfig>> {
        let tables = self.arch().resolve()?.0.tables;
        anyhow::ensure!(
            tables.len() == ember_dataloader::schema::NUM_CAT,
            "the Criteo schema has {} categorical columns; --arch-embedding-size gives {} tables",
            ember_dataloader::schema::NUM_CAT,
            tables.len()
        );
        Ok(tables)
    }

    /// The rows of each table the flags give (any number of tables).
    pub fn rows(&self) -> anyhow::Result<Vec<usize>> {
        Ok(self.arch().table_shape()?.1)
    }

    fn arch(&self) -> ArchArgs {
        ArchArgs {
            preset: Some(self.preset),
            arch_sparse_feature_size: None,
            arch_embedding_size: self.arch_embedding_size.clone(),
            arch_mlp_bot: None,
            arch_mlp_top: None,
            arch_interaction_op: None,
            dcn_num_layers: None,
            dcn_low_rank_dim: None,
            max_ind_range: self.max_ind_range,
            table_dtype: None,
            kv: KvArgs::default(),
            data_rows: None,
        }
    }
}
