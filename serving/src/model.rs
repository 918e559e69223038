//! A served model: a checkpoint's DLRM with the dataset spec it was trained
//! on, so that requests carry raw features and get the transforms `ember
//! predict` applies to the same rows (bitwise the same logits for the same
//! batch).

use std::collections::HashMap;
use std::path::Path;

use ember_dataloader::{Batch, DatasetSpec, IdTransform};
use ember_dense::{DenseOptimizerConfig, Tensor};
use ember_models::{Backend, BatchShape, Checkpoint, Dlrm, Model};
use ember_sparse::{KeyedJaggedTensor, TableOptimizer};

use crate::protocol::{ModelMetadata, ParsedRequest, TensorMetadata};
use crate::tensor::{decode, Values};
use crate::ServeError;

/// What one request may hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Samples a request (the model is built for batches of this size).
    pub max_batch_size: usize,
    /// Ids of one feature in a request.
    pub max_ids_per_feature: usize,
}

impl Default for Limits {
    /// 4096 samples, 64 ids a sample of a feature on average.
    fn default() -> Self {
        Self {
            max_batch_size: 4096,
            max_ids_per_feature: 4096 * 64,
        }
    }
}

/// The dense features' input.
pub const DENSE: &str = "dense";

/// The outputs every model gives, as `ember predict` writes them.
pub const OUTPUTS: [&str; 2] = ["logit", "probability"];

/// A DLRM served from a checkpoint.
pub struct ServedModel {
    name: String,
    model: Dlrm,
    backend: Backend,
    spec: DatasetSpec,
    limits: Limits,
    metadata: ModelMetadata,
}

impl ServedModel {
    /// The model of `checkpoint` (a file, a set's index, or a run's
    /// directory), named `name`, reading its inputs as its recorded dataset
    /// spec says (Criteo's columns for a file that records none).
    pub fn open(checkpoint: &Path, name: &str, limits: Limits) -> Result<Self, ServeError> {
        if limits.max_batch_size == 0 || limits.max_ids_per_feature == 0 {
            return Err(ServeError::Config(
                "the batch and id limits must be at least 1".into(),
            ));
        }
        let ckpt = Checkpoint::open(checkpoint)?;
        let mut spec = ckpt.input_spec();
        // The model's key-value tables take raw ids, as `ember predict` reads them.
        for s in &mut spec.tables {
            let model = ckpt.config().tables.iter().find(|t| t.name == s.name);
            s.kv = model.and_then(|t| t.kv.clone());
        }
        spec.validate()?;
        let model = ckpt
            .builder()
            .optimizers(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
            .batches(BatchShape {
                batch_size: limits.max_batch_size,
                ..Default::default()
            })
            .build()?;
        let metadata = metadata_of(name, &spec);
        Ok(Self {
            name: name.into(),
            model,
            backend: Backend::native(),
            spec,
            limits,
            metadata,
        })
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its inputs and outputs.
    pub fn metadata(&self) -> &ModelMetadata {
        &self.metadata
    }

    /// A request's inputs as a batch, the spec's transforms applied: the
    /// dense values and the ids as the loader gives them from the same raw
    /// columns.
    pub fn batch(&self, parsed: &ParsedRequest<'_>) -> Result<Batch, ServeError> {
        let bad = |m: String| ServeError::BadRequest(m);
        let nd = self.spec.num_dense();
        let max_dense = self.limits.max_batch_size.saturating_mul(nd.max(1));
        let max_ids = (self.limits.max_ids_per_feature).max(self.limits.max_batch_size);
        let mut given: HashMap<&str, (&[i64], Values)> = HashMap::new();
        for (input, bytes) in parsed.request.inputs.iter().zip(&parsed.binary) {
            if !self.metadata.inputs.iter().any(|m| m.name == input.name) {
                let names: Vec<&str> = (self.metadata.inputs.iter())
                    .map(|m| m.name.as_str())
                    .collect();
                return Err(bad(format!(
                    "input '{}' is not an input of model '{}' (its inputs: {})",
                    input.name,
                    self.name,
                    names.join(", ")
                )));
            }
            let limit = if input.name == DENSE {
                max_dense
            } else {
                max_ids
            };
            let values = decode(input, *bytes, limit)?;
            let entry = (input.shape.as_slice(), values);
            if given.insert(input.name.as_str(), entry).is_some() {
                return Err(bad(format!("input '{}' is given twice", input.name)));
            }
        }
        let mut take = |name: &str| {
            (given.remove(name)).ok_or_else(|| bad(format!("input '{name}' is missing")))
        };
        // The batch size: the dense rows, else the first feature's lengths.
        let mut batch = None;
        let mut dense = Vec::new();
        if nd > 0 {
            let (shape, values) = take(DENSE)?;
            match shape {
                [rows, cols] if *cols == nd as i64 => batch = Some(*rows as usize),
                _ => {
                    return Err(bad(format!(
                        "input '{DENSE}': shape {shape:?}, expected [batch, {nd}]"
                    )))
                }
            }
            dense = match values {
                Values::Floats(v) => v,
                Values::Ints(v) => v.into_iter().map(|x| x as f32).collect(),
            };
        }
        let mut keys = Vec::with_capacity(self.spec.sparse.len());
        let (mut values, mut lengths) = (Vec::new(), Vec::new());
        let mut weights = self.spec.weighted().then(Vec::new);
        for column in &self.spec.sparse {
            let key = column.key();
            let lengths_name = format!("{key}.lengths");
            let ls = one_d_ints(take(&lengths_name)?, &lengths_name)?;
            let b = *batch.get_or_insert(ls.len());
            if ls.len() != b {
                return Err(bad(format!(
                    "input '{lengths_name}': {} lengths for a batch of {b}",
                    ls.len()
                )));
            }
            if let Some(at) = ls.iter().position(|&l| l < 0) {
                return Err(bad(format!(
                    "input '{lengths_name}': length {} of sample {at} is negative",
                    ls[at]
                )));
            }
            let total = (ls.iter())
                .try_fold(0i64, |sum, &l| sum.checked_add(l))
                .ok_or_else(|| bad(format!("input '{lengths_name}': the lengths overflow")))?;
            let values_name = format!("{key}.values");
            let ids = one_d_ints(take(&values_name)?, &values_name)?;
            if ids.len() as i64 != total {
                return Err(bad(format!(
                    "input '{values_name}': {} ids, but its lengths add up to {total}",
                    ids.len()
                )));
            }
            let rows = (self.spec.rows_of(key)).expect("validated: every feature has a table");
            let transform = self.spec.id_transform_of(key);
            let is_kv = (self.spec.tables.iter())
                .any(|t| t.kv.is_some() && t.feature_names.iter().any(|f| f == key));
            if let (IdTransform::Raw, false) = (transform, is_kv) {
                if let Some(id) = ids.iter().find(|&&id| id < 0 || id as u64 >= rows) {
                    return Err(bad(format!(
                        "input '{values_name}': id {id} is outside the table's {rows} rows"
                    )));
                }
            }
            values.extend(ids.into_iter().map(|id| transform.apply(id, rows)));
            lengths.extend_from_slice(&ls);
            if let Some(w) = weights.as_mut() {
                if column.weights.is_some() {
                    let name = format!("{key}.weights");
                    let (shape, Values::Floats(ws)) = take(&name)? else {
                        return Err(bad(format!("input '{name}': weights are FP32")));
                    };
                    if let Some(x) = ws.iter().find(|x| !x.is_finite()) {
                        return Err(bad(format!("input '{name}': weight {x} is not finite")));
                    }
                    if shape.len() != 1 || ws.len() as i64 != total {
                        return Err(bad(format!(
                            "input '{name}': shape {shape:?} for {total} ids"
                        )));
                    }
                    w.extend(ws);
                } else {
                    w.extend(std::iter::repeat_n(1.0, total as usize));
                }
            }
            keys.push(key.to_string());
        }
        let batch = batch.unwrap_or(0);
        if batch == 0 || batch > self.limits.max_batch_size {
            return Err(bad(format!(
                "a batch of {batch} samples: this server takes 1 to {}",
                self.limits.max_batch_size
            )));
        }
        let dense = self.transform_dense(dense, batch)?;
        let sparse = KeyedJaggedTensor::from_lengths(keys, values, &lengths, weights)
            .map_err(|e| bad(e.to_string()))?;
        Ok(Batch {
            dense,
            sparse,
            labels: vec![f32::NAN; batch],
        })
    }

    /// Raw dense values into the model's inputs, column by column.
    fn transform_dense(
        &self,
        mut dense: Vec<f32>,
        batch: usize,
    ) -> Result<Tensor<f32>, ServeError> {
        let nd = self.spec.num_dense();
        if dense.len() != batch * nd {
            return Err(ServeError::BadRequest(format!(
                "input 'dense': {} values for {batch} samples of {nd} features",
                dense.len()
            )));
        }
        for (i, x) in dense.iter_mut().enumerate() {
            let j = i % nd;
            let y = self.spec.transform_of(j).apply_f32(Some(*x));
            if !x.is_finite() || !y.is_finite() {
                return Err(ServeError::BadRequest(format!(
                    "input 'dense': sample {} feature {j} ({}) is {x}: dense values must be finite",
                    i / nd,
                    self.spec.dense[j].column
                )));
            }
            *x = y;
        }
        Tensor::from_vec(batch, nd, dense).map_err(|e| ServeError::BadRequest(e.to_string()))
    }

    /// The logits of `batch`, checked finite.
    pub fn infer(&mut self, batch: &Batch) -> Result<Vec<f32>, ServeError> {
        let logits = self.model.predict(&self.backend, batch)?.to_vec();
        if let Some(at) = logits.iter().position(|z| !z.is_finite()) {
            return Err(ServeError::Internal(format!(
                "model '{}' gave a non-finite logit ({}) for sample {at}",
                self.name, logits[at]
            )));
        }
        Ok(logits)
    }
}

/// A one-dimensional integer input (ids, lengths), named for errors.
fn one_d_ints((shape, values): (&[i64], Values), name: &str) -> Result<Vec<i64>, ServeError> {
    match (shape, values) {
        ([_], Values::Ints(v)) => Ok(v),
        ([_], Values::Floats(_)) => Err(ServeError::BadRequest(format!(
            "input '{name}': expected INT64 or INT32"
        ))),
        _ => Err(ServeError::BadRequest(format!(
            "input '{name}': shape {shape:?}, expected one dimension"
        ))),
    }
}

/// The model's inputs (`dense`, then each feature's lengths, values and
/// weights) and outputs.
fn metadata_of(name: &str, spec: &DatasetSpec) -> ModelMetadata {
    let tensor = |name: String, datatype: &str, shape: Vec<i64>| TensorMetadata {
        name,
        datatype: datatype.into(),
        shape,
    };
    let mut inputs = Vec::new();
    if spec.num_dense() > 0 {
        inputs.push(tensor(
            "dense".into(),
            "FP32",
            vec![-1, spec.num_dense() as i64],
        ));
    }
    for column in &spec.sparse {
        let key = column.key();
        inputs.push(tensor(format!("{key}.lengths"), "INT64", vec![-1]));
        inputs.push(tensor(format!("{key}.values"), "INT64", vec![-1]));
        if column.weights.is_some() {
            inputs.push(tensor(format!("{key}.weights"), "FP32", vec![-1]));
        }
    }
    let outputs = OUTPUTS
        .iter()
        .map(|o| tensor(o.to_string(), "FP32", vec![-1]))
        .collect();
    ModelMetadata {
        name: name.into(),
        versions: vec!["1".into()],
        platform: "ember_dlrm".into(),
        inputs,
        outputs,
    }
}
