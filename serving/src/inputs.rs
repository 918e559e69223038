//! A model's inputs: what a request must hold (names, types, shapes, limits)
//! and how its raw features become the model's, through the dataset spec the
//! checkpoint recorded, as `ember predict`'s loader reads the same columns;
//! or, for a sequence model, users' histories ([`crate::histories`]).
//! Requests are decoded apart ([`Samples`]) and joined into one batch.

use std::collections::HashMap;

use ember_dataloader::{Batch, DatasetSpec, IdTransform};
use ember_dense::Tensor;
use ember_models::sequential::{SequenceModelConfig, UserHistory};
use ember_sparse::KeyedJaggedTensor;

use crate::outputs::OutputSpec;
use crate::protocol::{ModelMetadata, ParsedRequest, TensorMetadata};
use crate::tensor::{decode, Values};
use crate::ServeError;

/// What one request may hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Samples a request (and a batch of requests) holds at most.
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

/// A DLRM's outputs, as `ember predict` writes them.
pub const OUTPUTS: [&str; 2] = ["logit", "probability"];

/// One sparse feature of a request, transformed: lengths a sample, the
/// model's ids, and weights when the model takes any.
#[derive(Clone, Debug, PartialEq)]
struct FeatureIds {
    lengths: Vec<i64>,
    ids: Vec<i64>,
    weights: Option<Vec<f32>>,
}

/// One request's samples, decoded and transformed, ready to join others'.
#[derive(Clone, Debug, PartialEq)]
pub struct Samples {
    count: usize,
    content: Content,
}

/// What a request's samples hold, by the model's layout.
#[derive(Clone, Debug, PartialEq)]
enum Content {
    Features {
        /// `count` rows of the dense features, transformed.
        dense: Vec<f32>,
        /// Each sparse feature, in the spec's order.
        features: Vec<FeatureIds>,
    },
    /// One history a sample.
    Histories(Vec<UserHistory>),
}

impl Samples {
    /// How many samples the request holds.
    pub fn count(&self) -> usize {
        self.count
    }
}

/// A model's inputs, fixed for as long as the model serves.
#[derive(Clone, Debug)]
pub struct Inputs {
    name: String,
    layout: Layout,
    limits: Limits,
    metadata: ModelMetadata,
    outputs: Vec<OutputSpec>,
}

/// What a model's requests hold.
#[derive(Clone, Debug, PartialEq)]
enum Layout {
    /// A DLRM's dense and sparse features, as its dataset spec reads them.
    Features {
        spec: DatasetSpec,
        /// Each sparse feature's table size and whether it takes raw ids
        /// (key-value tables do).
        tables: Vec<(u64, bool)>,
    },
    /// A sequence model's histories.
    Histories(SequenceModelConfig),
}

impl Inputs {
    /// The inputs of a model named `name` trained on `spec` (validated;
    /// its key-value tables marked).
    pub fn new(name: &str, spec: DatasetSpec, limits: Limits) -> Result<Self, ServeError> {
        if limits.max_batch_size == 0 || limits.max_ids_per_feature == 0 {
            return Err(ServeError::Config(
                "the batch and id limits must be at least 1".into(),
            ));
        }
        spec.validate()?;
        let tables = (spec.sparse.iter())
            .map(|column| {
                let key = column.key();
                let rows = spec
                    .rows_of(key)
                    .expect("validated: every feature has a table");
                let kv = (spec.tables.iter())
                    .any(|t| t.kv.is_some() && t.feature_names.iter().any(|f| f == key));
                (rows, kv)
            })
            .collect();
        let outputs: Vec<OutputSpec> = OUTPUTS.iter().map(|&o| OutputSpec::scalar(o)).collect();
        Ok(Self {
            metadata: metadata_of(name, &spec, &outputs),
            name: name.into(),
            layout: Layout::Features { spec, tables },
            limits,
            outputs,
        })
    }

    /// The inputs of a sequence model named `name`, whose retrieval
    /// gives each history its `top_k` best items.
    pub fn histories(
        name: &str,
        config: SequenceModelConfig,
        limits: Limits,
        top_k: usize,
    ) -> Result<Self, ServeError> {
        if limits.max_batch_size == 0 || limits.max_ids_per_feature == 0 || top_k == 0 {
            return Err(ServeError::Config(
                "the batch, id and top-k limits must be at least 1".into(),
            ));
        }
        let outputs = crate::histories::outputs(&config, top_k);
        Ok(Self {
            metadata: crate::histories::metadata(name, &config, &outputs),
            name: name.into(),
            layout: Layout::Histories(config),
            limits,
            outputs,
        })
    }

    /// Whether a model of `other` inputs may take over from this one (a
    /// reload): the same requests, read the same way, the same outputs.
    pub fn same_as(&self, other: &Inputs) -> bool {
        // A sequence model's batch is cut to its length as the first
        // model's config says: the kind and every shape must agree.
        let shape = |l: &Layout| match l {
            Layout::Features { spec, .. } => Ok(spec.clone()),
            Layout::Histories(c) => Err((c.name(), c.num_items(), c.max_len(), c.candidates())),
        };
        self.metadata.inputs == other.metadata.inputs
            && self.outputs == other.outputs
            && shape(&self.layout) == shape(&other.layout)
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its inputs and outputs, as the metadata endpoint gives them.
    pub fn metadata(&self) -> &ModelMetadata {
        &self.metadata
    }

    /// The dataset spec the inputs follow (`None`: histories).
    pub fn spec(&self) -> Option<&DatasetSpec> {
        match &self.layout {
            Layout::Features { spec, .. } => Some(spec),
            Layout::Histories(_) => None,
        }
    }

    /// What the model gives, in order.
    pub fn outputs(&self) -> &[OutputSpec] {
        &self.outputs
    }

    /// The limits a request is held to.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// A request's inputs, checked and transformed: the dense values and
    /// the ids as the loader gives them from the same raw columns, or the
    /// histories.
    pub fn decode(&self, parsed: &ParsedRequest<'_>) -> Result<Samples, ServeError> {
        let given = self.given(parsed)?;
        let (count, content) = match &self.layout {
            Layout::Features { spec, tables } => self.decode_features(spec, tables, given)?,
            Layout::Histories(config) => {
                let users = crate::histories::decode(config, given)?;
                self.check_count(users.len())?;
                (users.len(), Content::Histories(users))
            }
        };
        Ok(Samples { count, content })
    }

    /// A 400 unless a request of `count` samples is within the limits.
    fn check_count(&self, count: usize) -> Result<(), ServeError> {
        match count == 0 || count > self.limits.max_batch_size {
            true => Err(ServeError::BadRequest(format!(
                "a batch of {count} samples: this server takes 1 to {}",
                self.limits.max_batch_size
            ))),
            false => Ok(()),
        }
    }

    /// A request's inputs by name, each an input of the model, given once
    /// and within the limits.
    fn given<'a>(&self, parsed: &'a ParsedRequest<'_>) -> Result<Given<'a>, ServeError> {
        let bad = |m: String| ServeError::BadRequest(m);
        let nd = self.spec().map_or(0, DatasetSpec::num_dense);
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
        Ok(Given(given))
    }

    /// A DLRM's request: its samples' count and features.
    fn decode_features(
        &self,
        spec: &DatasetSpec,
        tables: &[(u64, bool)],
        mut given: Given<'_>,
    ) -> Result<(usize, Content), ServeError> {
        let bad = |m: String| ServeError::BadRequest(m);
        let nd = spec.num_dense();
        let mut take = |name: &str| given.take(name);
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
        let mut features = Vec::with_capacity(spec.sparse.len());
        for (column, &(rows, is_kv)) in spec.sparse.iter().zip(tables) {
            let key = column.key();
            let lengths_name = format!("{key}.lengths");
            let lengths = one_d_ints(take(&lengths_name)?, &lengths_name)?;
            let b = *batch.get_or_insert(lengths.len());
            if lengths.len() != b {
                return Err(bad(format!(
                    "input '{lengths_name}': {} lengths for a batch of {b}",
                    lengths.len()
                )));
            }
            if let Some(at) = lengths.iter().position(|&l| l < 0) {
                return Err(bad(format!(
                    "input '{lengths_name}': length {} of sample {at} is negative",
                    lengths[at]
                )));
            }
            let total = (lengths.iter())
                .try_fold(0i64, |sum, &l| sum.checked_add(l))
                .ok_or_else(|| bad(format!("input '{lengths_name}': the lengths overflow")))?;
            let values_name = format!("{key}.values");
            let mut ids = one_d_ints(take(&values_name)?, &values_name)?;
            if ids.len() as i64 != total {
                return Err(bad(format!(
                    "input '{values_name}': {} ids, but its lengths add up to {total}",
                    ids.len()
                )));
            }
            let transform = spec.id_transform_of(key);
            if let (IdTransform::Raw, false) = (transform, is_kv) {
                if let Some(id) = ids.iter().find(|&&id| id < 0 || id as u64 >= rows) {
                    return Err(bad(format!(
                        "input '{values_name}': id {id} is outside the table's {rows} rows"
                    )));
                }
            }
            for id in &mut ids {
                *id = transform.apply(*id, rows);
            }
            let weights = match (spec.weighted(), column.weights.is_some()) {
                (false, _) => None,
                (true, false) => Some(vec![1.0; total as usize]),
                (true, true) => {
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
                    Some(ws)
                }
            };
            features.push(FeatureIds {
                lengths,
                ids,
                weights,
            });
        }
        let count = batch.unwrap_or(0);
        self.check_count(count)?;
        let dense = transform_dense(spec, dense, count)?;
        Ok((count, Content::Features { dense, features }))
    }

    /// Requests' samples joined into one batch, in order: the batch `ember
    /// predict` reads from the same rows in the same order.
    pub fn batch(&self, parts: &[&Samples]) -> Result<Batch, ServeError> {
        match &self.layout {
            Layout::Features { spec, .. } => features_batch(spec, parts),
            Layout::Histories(config) => {
                let mut users: Vec<UserHistory> = Vec::new();
                for p in parts {
                    match &p.content {
                        Content::Histories(u) => users.extend_from_slice(u),
                        Content::Features { .. } => {
                            return Err(ServeError::Internal(
                                "features for a sequence model".into(),
                            ))
                        }
                    }
                }
                ember_models::sequential::history_batch(config, &users)
                    .map_err(|e| ServeError::Internal(e.to_string()))
            }
        }
    }
}

/// A request's inputs by name: shape and values.
pub(crate) struct Given<'a>(HashMap<&'a str, (&'a [i64], Values)>);

impl<'a> Given<'a> {
    /// The input `name`, or a 400 saying it is missing.
    pub(crate) fn take(&mut self, name: &str) -> Result<(&'a [i64], Values), ServeError> {
        (self.0.remove(name))
            .ok_or_else(|| ServeError::BadRequest(format!("input '{name}' is missing")))
    }

    /// The input `name` when given.
    pub(crate) fn take_optional(&mut self, name: &str) -> Option<(&'a [i64], Values)> {
        self.0.remove(name)
    }
}

/// Raw dense values into the model's inputs, column by column.
fn transform_dense(
    spec: &DatasetSpec,
    mut dense: Vec<f32>,
    batch: usize,
) -> Result<Vec<f32>, ServeError> {
    let nd = spec.num_dense();
    if dense.len() != batch * nd {
        return Err(ServeError::BadRequest(format!(
            "input 'dense': {} values for {batch} samples of {nd} features",
            dense.len()
        )));
    }
    for (i, x) in dense.iter_mut().enumerate() {
        let j = i % nd;
        let y = spec.transform_of(j).apply_f32(Some(*x));
        if !x.is_finite() || !y.is_finite() {
            return Err(ServeError::BadRequest(format!(
                "input 'dense': sample {} feature {j} ({}) is {x}: dense values must be finite",
                i / nd,
                spec.dense[j].column
            )));
        }
        *x = y;
    }
    Ok(dense)
}

/// DLRM requests' samples joined into one batch.
fn features_batch(spec: &DatasetSpec, parts: &[&Samples]) -> Result<Batch, ServeError> {
    let count: usize = parts.iter().map(|p| p.count).sum();
    let nd = spec.num_dense();
    let mut dense: Vec<f32> = Vec::with_capacity(count * nd);
    let mut all = Vec::with_capacity(parts.len());
    for p in parts {
        if let Content::Features { dense: d, features } = &p.content {
            dense.extend_from_slice(d);
            all.push(features);
        }
    }
    let dense =
        Tensor::from_vec(count, nd, dense).map_err(|e| ServeError::Internal(e.to_string()))?;
    let (mut keys, mut ids, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    let mut weights = spec.weighted().then(Vec::new);
    for (f, column) in spec.sparse.iter().enumerate() {
        keys.push(column.key().to_string());
        for features in &all {
            let feature = &features[f];
            ids.extend_from_slice(&feature.ids);
            lengths.extend_from_slice(&feature.lengths);
            if let (Some(w), Some(given)) = (weights.as_mut(), &feature.weights) {
                w.extend_from_slice(given);
            }
        }
    }
    let sparse = KeyedJaggedTensor::from_lengths(keys, ids, &lengths, weights)
        .map_err(|e| ServeError::Internal(e.to_string()))?;
    Ok(Batch {
        dense,
        sparse,
        labels: vec![f32::NAN; count],
    })
}

/// A one-dimensional integer input (ids, lengths), named for errors.
pub(crate) fn one_d_ints(
    (shape, values): (&[i64], Values),
    name: &str,
) -> Result<Vec<i64>, ServeError> {
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
fn metadata_of(name: &str, spec: &DatasetSpec, outputs: &[OutputSpec]) -> ModelMetadata {
    let tensor = |name: String, datatype: &str, shape: Vec<i64>| TensorMetadata {
        name,
        datatype: datatype.into(),
        shape,
    };
    let mut inputs = Vec::new();
    if spec.num_dense() > 0 {
        inputs.push(tensor(
            DENSE.into(),
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
    let outputs = outputs.iter().map(OutputSpec::metadata).collect();
    ModelMetadata {
        name: name.into(),
        versions: vec!["1".into()],
        platform: "ember_dlrm".into(),
        inputs,
        outputs,
    }
}
