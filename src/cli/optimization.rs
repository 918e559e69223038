//! Learning-rate schedules, weight decay and clipping flags (shared by
//! `train` and `bench dlrm`): dlrm_s_pytorch's names where it has them.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use ember_dense::WeightDecay;
use ember_models::{LrSchedule, Optimization};
use ember_sparse::TableOptimizer;

/// How the optimizers change over the run.
#[derive(Args, Clone, Debug, Default)]
pub struct OptimizationArgs {
    /// dlrm_s_pytorch's LRPolicyScheduler: warm up linearly over this many
    /// steps (tables and dense layers, unless --sparse-lr-schedule or
    /// --dense-lr-schedule say otherwise).
    #[arg(long, default_value_t = 0)]
    pub lr_num_warmup_steps: u64,
    /// dlrm_s_pytorch's LRPolicyScheduler: the step its polynomial decay
    /// starts at (not before the warmup ends).
    #[arg(long, default_value_t = 0)]
    pub lr_decay_start_step: u64,
    /// dlrm_s_pytorch's LRPolicyScheduler: steps of the decay (0: none).
    #[arg(long, default_value_t = 0)]
    pub lr_num_decay_steps: u64,
    /// DLRMv4's linear warmup from 0 over this many steps (instead of the
    /// LRPolicyScheduler flags).
    #[arg(long, conflicts_with_all = ["lr_num_warmup_steps", "lr_decay_start_step", "lr_num_decay_steps"])]
    pub lr_linear_warmup_steps: Option<u64>,
    /// The tables' schedule alone: constant, policy:WARMUP,DECAY_START,DECAY_STEPS
    /// or linear-warmup:STEPS.
    #[arg(long, value_parser = parse_schedule)]
    pub sparse_lr_schedule: Option<LrSchedule>,
    /// The dense layers' schedule alone (as --sparse-lr-schedule).
    #[arg(long, value_parser = parse_schedule)]
    pub dense_lr_schedule: Option<LrSchedule>,
    /// Weight decay of the dense parameters (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f32,
    /// How --weight-decay applies: l2 (torch's weight_decay) or decoupled
    /// (AdamW's).
    #[arg(long, value_enum, default_value_t = DecayMode::L2)]
    pub weight_decay_mode: DecayMode,
    /// FBGEMM's L2 weight decay of the tables (SGD, Adagrad, row-wise
    /// Adagrad; 0: none).
    #[arg(long, default_value_t = 0.0)]
    pub table_weight_decay: f32,
    /// Clip the dense gradients by their global L2 norm (torch's
    /// clip_grad_norm_; DLRMv4 uses 1.0).
    #[arg(long)]
    pub clip_grad_norm: Option<f32>,
}

/// How the dense weight decay applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum DecayMode {
    /// The gradient gains decay * w (torch's weight_decay).
    #[default]
    L2,
    /// w shrinks by lr * decay before the update (torch's AdamW).
    Decoupled,
}

impl OptimizationArgs {
    /// The run's [`Optimization`], checked.
    pub fn optimization(&self) -> Result<Optimization> {
        let both = match self.lr_linear_warmup_steps {
            Some(steps) => LrSchedule::LinearWarmup { steps },
            None if [
                self.lr_num_warmup_steps,
                self.lr_decay_start_step,
                self.lr_num_decay_steps,
            ] == [0; 3] =>
            {
                LrSchedule::Constant
            }
            None => LrSchedule::Policy {
                warmup_steps: self.lr_num_warmup_steps,
                decay_start_step: self.lr_decay_start_step,
                decay_steps: self.lr_num_decay_steps,
            },
        };
        let dense_weight_decay = match (self.weight_decay, self.weight_decay_mode) {
            (0.0, _) => WeightDecay::None,
            (r, DecayMode::L2) => WeightDecay::L2(r),
            (r, DecayMode::Decoupled) => WeightDecay::Decoupled(r),
        };
        let o = Optimization {
            sparse_schedule: self.sparse_lr_schedule.unwrap_or(both),
            dense_schedule: self.dense_lr_schedule.unwrap_or(both),
            dense_weight_decay,
            table_weight_decay: self.table_weight_decay,
            max_grad_norm: self.clip_grad_norm,
        };
        if let Err(e) = o.validate() {
            bail!("{e} (--lr-*, --weight-decay, --table-weight-decay, --clip-grad-norm)");
        }
        Ok(o)
    }
}

/// Refuses, by flag, what these optimizers or this mode cannot take,
/// before anything is built: FBGEMM's L2 decay on tables that are not
/// SGD or Adagrad, and weight decay or clipping in the compiled mode.
pub fn check_for(
    o: &Optimization,
    table: &TableOptimizer,
    mode: ember_models::ExecMode,
) -> Result<()> {
    let decays = matches!(
        table,
        TableOptimizer::Sgd { .. }
            | TableOptimizer::Adagrad { .. }
            | TableOptimizer::RowWiseAdagrad { .. }
    );
    if o.table_weight_decay > 0.0 && !decays {
        bail!(
            "--table-weight-decay: FBGEMM's L2 decay is for sgd, adagrad and rowwise-adagrad tables, not {table:?}"
        );
    }
    let decay_or_clip = o.dense_weight_decay != WeightDecay::None || o.max_grad_norm.is_some();
    if mode == ember_models::ExecMode::Compiled && decay_or_clip {
        bail!(
            "--weight-decay and --clip-grad-norm: the compiled mode takes learning-rate schedules \
             only; use --mode strict, debug or defer-fuse"
        );
    }
    Ok(())
}

/// `constant`, `policy:W,D,N` or `linear-warmup:N`.
fn parse_schedule(text: &str) -> Result<LrSchedule> {
    let (kind, rest) = text.split_once(':').unwrap_or((text, ""));
    let numbers = || -> Result<Vec<u64>> {
        (rest.split(',').map(|n| n.trim().parse::<u64>()))
            .collect::<Result<_, _>>()
            .with_context(|| format!("`{rest}`: expected whole numbers of steps"))
    };
    let bad = || {
        anyhow::anyhow!(
            "`{text}`: expected constant, policy:WARMUP,DECAY_START,DECAY_STEPS or linear-warmup:STEPS"
        )
    };
    match kind {
        "constant" if rest.is_empty() => Ok(LrSchedule::Constant),
        "policy" => match numbers()?.as_slice() {
            &[warmup_steps, decay_start_step, decay_steps] => Ok(LrSchedule::Policy {
                warmup_steps,
                decay_start_step,
                decay_steps,
            }),
            _ => Err(bad()),
        },
        "linear-warmup" => match numbers()?.as_slice() {
            &[steps] => Ok(LrSchedule::LinearWarmup { steps }),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_parse_and_bad_ones_are_named() {
        assert_eq!(parse_schedule("constant").unwrap(), LrSchedule::Constant);
        assert_eq!(
            parse_schedule("policy:10,20,30").unwrap(),
            LrSchedule::Policy {
                warmup_steps: 10,
                decay_start_step: 20,
                decay_steps: 30
            }
        );
        assert_eq!(
            parse_schedule("linear-warmup:5").unwrap(),
            LrSchedule::LinearWarmup { steps: 5 }
        );
        for bad in ["policy:1,2", "linear-warmup:x", "cosine:3", "constant:1"] {
            assert!(parse_schedule(bad).is_err(), "{bad}");
        }
    }
}
