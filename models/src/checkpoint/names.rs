//! TorchRec's names and shapes of a DLRM `state_dict`: the tensors a config
//! has, and the config a TorchRec file's names and shapes imply.

use std::collections::BTreeMap;

use ember_sparse::{DataType, EmbeddingBagConfig};
use safetensors::tensor::Dtype;

use super::TABLE_PREFIX;
use crate::dlrm::{bottom_linear_prefix, top_linear_prefix};
use crate::{DlrmConfig, InteractionType};

/// Name of table `t`'s weight.
pub fn table_weight_name(table: &str) -> String {
    format!("{}.weight", table_base_name(table))
}

/// The safetensors dtype and shape of a table's weight of `rows` x `dim`
/// in `dtype`: F32, F16 or BF16 `[rows, dim]` for the training types (as
/// TorchRec saves fp32 and fp16 tables), and for the quantized types U8
/// `[rows, row bytes]` holding each row as Ember stores it (the layouts of
/// [`DataType`]), as TorchRec's `QuantEmbeddingBagCollection` saves its
/// fused rows.
pub fn weight_layout(dtype: DataType, rows: usize, dim: usize) -> (Dtype, Vec<usize>) {
    match dtype {
        DataType::Fp32 => (Dtype::F32, vec![rows, dim]),
        DataType::Fp16 => (Dtype::F16, vec![rows, dim]),
        DataType::Bf16 => (Dtype::BF16, vec![rows, dim]),
        _ => (Dtype::U8, vec![rows, dtype.row_bytes(dim).unwrap_or(0)]),
    }
}

/// A DLRM table's TorchRec name, to which `.weight` and the optimizer
/// state's suffixes are added.
pub(super) fn table_base_name(table: &str) -> String {
    format!("{TABLE_PREFIX}{table}")
}

/// Names and shapes of the dense parameters of `config`.
pub fn dense_shapes(config: &DlrmConfig) -> BTreeMap<String, Vec<usize>> {
    let mut shapes = BTreeMap::new();
    let mut linear = |prefix: String, inp: usize, out: usize| {
        shapes.insert(format!("{prefix}weight"), vec![out, inp]);
        shapes.insert(format!("{prefix}bias"), vec![out]);
    };
    for (i, w) in config.bottom_mlp.windows(2).enumerate() {
        linear(bottom_linear_prefix(i), w[0], w[1]);
    }
    let top = config.top_mlp_sizes();
    for (i, w) in top.windows(2).enumerate() {
        linear(top_linear_prefix(i, top.len() - 1), w[0], w[1]);
    }
    if let InteractionType::Dcn { layers, rank } = config.interaction {
        let n = (config.num_sparse_features() + 1) * config.embedding_dim();
        for l in 0..layers {
            let p = "inter_arch.crossnet.";
            shapes.insert(format!("{p}W_kernels.{l}"), vec![n, rank]);
            shapes.insert(format!("{p}V_kernels.{l}"), vec![rank, n]);
            shapes.insert(format!("{p}bias.{l}"), vec![n]);
        }
    }
    shapes
}

/// Orders `t_cat_2` before `t_cat_10` (and `day_2` before `day_10`):
/// digit runs compare as numbers.
pub fn natural_key(s: &str) -> Vec<(String, u64)> {
    let mut key = Vec::new();
    let mut text = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            let mut n = c.to_digit(10).unwrap_or(0) as u64;
            while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                n = n.saturating_mul(10).saturating_add(d as u64);
                chars.next();
            }
            key.push((std::mem::take(&mut text), n));
        } else {
            text.push(c);
        }
    }
    key.push((text, u64::MAX));
    key
}

/// The architecture of a TorchRec DLRM `state_dict` from its names and
/// shapes (`shapes`: every tensor of the file).
pub(super) fn infer_config(shapes: &BTreeMap<String, Vec<usize>>) -> Result<DlrmConfig, String> {
    let shape = |name: &str| shapes.get(name).cloned();
    let mut tables: Vec<(String, Vec<usize>)> = (shapes.keys())
        .filter_map(|n| {
            let table = n.strip_prefix(TABLE_PREFIX)?.strip_suffix(".weight")?;
            Some((table.to_string(), shape(n)?))
        })
        .collect();
    if tables.is_empty() {
        return Err(format!(
            "no Ember metadata and no {TABLE_PREFIX}<table>.weight tensors: not a DLRM checkpoint"
        ));
    }
    tables.sort_by_key(|(t, _)| natural_key(t));
    let tables = (tables.into_iter())
        .map(|(name, s)| match s[..] {
            [rows, dim] => {
                let feature = name.strip_prefix("t_").unwrap_or(&name).to_string();
                Ok(EmbeddingBagConfig::new(&name, rows, dim, &[&feature]))
            }
            _ => Err(format!(
                "tensor '{}': shape {s:?}, expected [rows, dim]",
                table_weight_name(&name)
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    // An MLP's sizes from consecutive `<prefix><i>._linear.weight` [out, in].
    let mlp = |prefix: &str| -> Vec<[usize; 2]> {
        (0..)
            .map_while(|i| shape(&format!("{prefix}{i}._linear.weight")))
            .filter_map(|s| <[usize; 2]>::try_from(s).ok())
            .collect()
    };
    let bottom = mlp("dense_arch.model._mlp.");
    let Some(first) = bottom.first() else {
        return Err("no dense_arch.model._mlp.0._linear.weight tensor".into());
    };
    let mut bottom_mlp = vec![first[1]];
    bottom_mlp.extend(bottom.iter().map(|s| s[0]));
    let mut top_mlp: Vec<usize> = mlp("over_arch.model.0._mlp.")
        .iter()
        .map(|s| s[0])
        .collect();
    match shape("over_arch.model.1.weight").as_deref() {
        Some(&[out, _]) => top_mlp.push(out),
        _ => return Err("no over_arch.model.1.weight [1, in] tensor".into()),
    }
    let layers = (0..)
        .take_while(|l| shape(&format!("inter_arch.crossnet.W_kernels.{l}")).is_some())
        .count();
    let interaction = match shape("inter_arch.crossnet.W_kernels.0").as_deref() {
        Some(&[_, rank]) => InteractionType::Dcn { layers, rank },
        _ => InteractionType::Dot,
    };
    Ok(DlrmConfig {
        tables,
        bottom_mlp,
        top_mlp,
        interaction,
    })
}

#[cfg(test)]
mod tests {
    use super::natural_key;

    #[test]
    fn days_sort_by_number() {
        let mut names = vec!["day_10.parquet", "day_2.parquet", "day_1.parquet"];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names, ["day_1.parquet", "day_2.parquet", "day_10.parquet"]);
    }
}
