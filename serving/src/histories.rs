//! A sequence model's requests: one user history a sample, in the
//! jagged layout of a feature (`history.lengths`, then each history's
//! items in `history.values`, with their `history.timestamps` in seconds
//! and, for ranking, their `history.actions` bit masks), read as `ember
//! predict` reads a histories file.
//!
//! A retrieval model (SASRec, HSTU retrieval) answers each history's
//! `top_k` best next `items` over the catalogue and their `scores`; HSTU
//! ranking reads each history's last `num_candidates` items as the
//! candidates (their actions unread) and answers a `logit` and a
//! `probability` for each candidate and task.

use ember_models::sequential::{SequenceModelConfig, UserHistory};

use crate::inputs::{one_d_ints, Given};
use crate::outputs::OutputSpec;
use crate::protocol::{ModelMetadata, TensorMetadata};
use crate::tensor::Values;
use crate::ServeError;

/// The histories' input names.
pub const LENGTHS: &str = "history.lengths";
/// Each history's items, oldest first.
pub const ITEMS: &str = "history.values";
/// Each item's time, in seconds (optional: 0).
pub const TIMESTAMPS: &str = "history.timestamps";
/// Each item's action bits (ranking only).
pub const ACTIONS: &str = "history.actions";

/// What the model answers for each history.
pub(crate) fn outputs(config: &SequenceModelConfig, top_k: usize) -> Vec<OutputSpec> {
    match config.candidates() {
        None => {
            let k = top_k.min(config.num_items());
            vec![
                OutputSpec {
                    name: "items",
                    ints: true,
                    sample_shape: vec![k],
                },
                OutputSpec {
                    name: "scores",
                    ints: false,
                    sample_shape: vec![k],
                },
            ]
        }
        Some((candidates, tasks)) => ["logit", "probability"]
            .map(|name| OutputSpec {
                name,
                ints: false,
                sample_shape: vec![candidates, tasks],
            })
            .into(),
    }
}

/// The model's inputs and outputs, as the metadata endpoint gives them.
pub(crate) fn metadata(
    name: &str,
    config: &SequenceModelConfig,
    outputs: &[OutputSpec],
) -> ModelMetadata {
    let mut names = vec![LENGTHS, ITEMS, TIMESTAMPS];
    if config.candidates().is_some() {
        names.push(ACTIONS);
    }
    ModelMetadata {
        name: name.into(),
        versions: vec!["1".into()],
        platform: format!("ember_{}", config.name().replace('-', "_")),
        inputs: (names.into_iter())
            .map(|n| TensorMetadata {
                name: n.into(),
                datatype: "INT64".into(),
                shape: vec![-1],
            })
            .collect(),
        outputs: outputs.iter().map(OutputSpec::metadata).collect(),
    }
}

/// A request's histories, checked: every history long enough, every item
/// in the catalogue, one time (and action) an item.
pub(crate) fn decode(
    config: &SequenceModelConfig,
    mut given: Given<'_>,
) -> Result<Vec<UserHistory>, ServeError> {
    let bad = |m: String| ServeError::BadRequest(m);
    let lengths = one_d_ints(given.take(LENGTHS)?, LENGTHS)?;
    let min = config.min_history();
    let mut total = 0usize;
    for (s, &l) in lengths.iter().enumerate() {
        if l < min as i64 {
            return Err(bad(format!(
                "input '{LENGTHS}': sample {s} has {l} items; {} reads at least {min}",
                config.name()
            )));
        }
        total = total.saturating_add(l as usize);
    }
    let items = one_d_ints(given.take(ITEMS)?, ITEMS)?;
    if items.len() != total {
        return Err(bad(format!(
            "input '{ITEMS}': {} items, but its lengths add up to {total}",
            items.len()
        )));
    }
    let n = config.num_items();
    // The sample holding value `at` of the flat inputs.
    let sample_of = |at: usize| {
        let mut end = 0usize;
        lengths.iter().position(|&l| {
            end += l as usize;
            at < end
        })
    };
    if let Some(at) = items.iter().position(|&id| id < 0 || id as u64 >= n as u64) {
        return Err(bad(format!(
            "input '{ITEMS}': sample {}: item {} is outside the catalogue's {n} items",
            sample_of(at).unwrap_or(0),
            items[at]
        )));
    }
    let per_item = |name: &str, given: Option<(&[i64], Values)>| -> Result<Vec<i64>, ServeError> {
        let Some(given) = given else {
            return Ok(vec![0; total]);
        };
        let v = one_d_ints(given, name)?;
        match v.len() == total {
            true => Ok(v),
            false => Err(bad(format!(
                "input '{name}': {} values for {total} items",
                v.len()
            ))),
        }
    };
    let times = per_item(TIMESTAMPS, given.take_optional(TIMESTAMPS))?;
    let actions = match config.candidates() {
        None => Vec::new(),
        Some(_) => per_item(ACTIONS, Some(given.take(ACTIONS)?))?,
    };
    if let Some(a) = actions.iter().find(|&&a| a < 0) {
        return Err(bad(format!(
            "input '{ACTIONS}': action {a} is negative (actions are bit masks)"
        )));
    }
    let mut users = Vec::with_capacity(lengths.len());
    let mut at = 0;
    for (s, &l) in lengths.iter().enumerate() {
        let span = at..at + l as usize;
        let user = UserHistory {
            items: items[span.clone()].to_vec(),
            timestamps: times[span.clone()].to_vec(),
            actions: actions.get(span).map_or(Vec::new(), <[i64]>::to_vec),
        };
        // As `predict` reads a histories file: in time order.
        if let Some((column, why)) = user.fault() {
            let input = match column {
                "items" => ITEMS,
                "actions" => ACTIONS,
                _ => TIMESTAMPS,
            };
            return Err(bad(format!("input '{input}': sample {s}: {why}")));
        }
        users.push(user);
        at += l as usize;
    }
    Ok(users)
}
