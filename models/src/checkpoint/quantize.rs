//! Converting a checkpoint's tables to another data type: the rows of every
//! table read, converted (to the nearest value, or quantized row by row)
//! and written to a new checkpoint for inference.

use std::path::Path;

use ember_dataloader::atomic::same_file;
use ember_sparse::DataType;
use serde::Serialize;

use super::{save, Checkpoint};
use crate::{DiskTierOptions, Dlrm, DlrmConfig, ModelError};

/// What [`quantize`] did.
#[derive(Clone, Debug, Serialize)]
pub struct QuantizeSummary {
    /// The type every table now has.
    pub data_type: DataType,
    /// The tables whose type changed, with the type they had.
    pub converted: Vec<(String, DataType)>,
    /// Bytes of the tables' rows before and after.
    pub table_bytes_before: u64,
    /// Bytes of the tables' rows after.
    pub table_bytes_after: u64,
}

/// Writes `input`'s model with every table in `dtype` to `output`
/// (atomically), for `eval` and `predict`: the dense part as saved, no
/// optimizer state and no training position (a quantized table does not
/// train). `output` must not be the input.
///
/// ```
/// # use ember_dense::DenseOptimizerConfig;
/// # use ember_models::{Checkpoint, Dlrm, DlrmConfig, InteractionType};
/// # use ember_sparse::{DataType, TableOptimizer};
/// let config = DlrmConfig {
///     tables: DlrmConfig::criteo_tables(&[100, 200], 8),
///     bottom_mlp: vec![4, 8],
///     top_mlp: vec![8, 1],
///     interaction: InteractionType::Dot,
/// };
/// let mut model = Dlrm::builder(config)
///     .optimizers(TableOptimizer::rowwise_adagrad(0.05), DenseOptimizerConfig::sgd(0.1))
///     .seed(7)
///     .build()?;
/// let dir = tempfile::tempdir()?;
/// let (fp32, int8) = (dir.path().join("fp32.safetensors"), dir.path().join("int8.safetensors"));
/// ember_models::checkpoint::save(&mut model, &fp32, None)?;
///
/// let summary = ember_models::checkpoint::quantize(&fp32, DataType::Int8, &int8)?;
/// assert_eq!(summary.converted.len(), 2);
/// // int8 rows of dim 8: 8 codes and a 4-byte scale and bias, against 32 bytes.
/// assert_eq!(summary.table_bytes_after * 32, summary.table_bytes_before * 12);
/// let served = Checkpoint::open(&int8)?.inference_model()?;
/// assert_eq!(served.config().tables[0].data_type, DataType::Int8);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn quantize(
    input: &Path,
    dtype: DataType,
    output: &Path,
) -> Result<QuantizeSummary, ModelError> {
    refuse_directory(output)?;
    let mut checkpoint = Checkpoint::open(input)?;
    // The files themselves, through a directory's checkpoint and links.
    if let Some(f) = (checkpoint.files().iter()).find(|f| same_file(f, output)) {
        return Err(super::fail_at(
            output,
            format!(
                "the output is the input checkpoint's file {}: write the quantized one to another file",
                f.display()
            ),
        ));
    }
    if let Some((table, saved)) = (checkpoint.config().tables.iter())
        .zip(&checkpoint.stored)
        .find(|(_, saved)| !saved.is_trainable() && **saved != dtype)
    {
        return Err(super::fail_at(
            input,
            format!(
                "table '{}' is already quantized ({saved}): converting it to {dtype} would keep {saved}'s error; quantize the training checkpoint instead",
                table.name
            ),
        ));
    }
    let table_bytes_before = table_bytes(checkpoint.config());
    let converted = checkpoint.cast_tables(dtype);
    let table_bytes_after = table_bytes(checkpoint.config());
    let mut model = checkpoint.inference_model()?;
    drop(checkpoint);
    save(&mut model, output, None)?;
    Ok(QuantizeSummary {
        data_type: dtype,
        converted,
        table_bytes_before,
        table_bytes_after,
    })
}

/// Writes a new model of `config`'s shape, its tables drawn from `seed`
/// and stored in `dtype`, to `output` (atomically), as [`quantize`]
/// writes a trained one: a checkpoint of a model too large to hold twice
/// on this disk, for sizing and serving benchmarks (its rows are not
/// trained), without the full-precision checkpoint first. With
/// `disk_tier`, the tables it puts there never sit in memory: each row is
/// drawn and encoded as the file is written, a piece at a time. The checkpoint records
/// Criteo's columns as its inputs.
pub fn quantize_new(
    config: &DlrmConfig,
    seed: u64,
    dtype: DataType,
    disk_tier: Option<DiskTierOptions>,
    output: &Path,
) -> Result<QuantizeSummary, ModelError> {
    refuse_directory(output)?;
    let mut config = config.clone();
    let table_bytes_before = table_bytes(&config);
    let converted = (config.tables.iter_mut())
        .filter(|t| t.data_type != dtype)
        .map(|t| (t.name.clone(), std::mem::replace(&mut t.data_type, dtype)))
        .collect();
    let mut model = Dlrm::builder(config.clone())
        .optimizers(
            ember_sparse::TableOptimizer::None,
            ember_dense::DenseOptimizerConfig::sgd(0.0),
        )
        .seed(seed)
        .disk_tier(disk_tier)
        .build()?;
    model.set_dataset_spec(Some(ember_dataloader::DatasetSpec::criteo(&config.tables)));
    save(&mut model, output, None)?;
    Ok(QuantizeSummary {
        data_type: dtype,
        converted,
        table_bytes_before,
        table_bytes_after: table_bytes(&config),
    })
}

/// The bytes of a model's rows, every table in its type.
fn table_bytes(config: &DlrmConfig) -> u64 {
    (config.tables.iter())
        .map(|t| t.bytes().unwrap_or(0) as u64)
        .sum()
}

/// A directory is no file to write a checkpoint to.
fn refuse_directory(output: &Path) -> Result<(), ModelError> {
    match output.is_dir() {
        true => Err(super::fail_at(
            output,
            "is a directory: name the file to write the checkpoint to".into(),
        )),
        false => Ok(()),
    }
}
