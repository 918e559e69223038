//! Jagged (ragged) inputs and pooled outputs, named as in TorchRec.
//!
//! A [`KeyedJaggedTensor`] holds, for `K` keys (features) and a batch of `B`
//! samples, one bag of ids per (key, sample), key-major:
//!
//! ```text
//! keys     = [f0,          f1         ]      B = 2
//! lengths  = [2,    1,     0,    3    ]      one per (key, sample)
//! offsets  = [0,    2,     3,    3,    6]    K*B + 1, monotonic, last = values.len()
//! values   = [a b | c    |      | d e f]
//! ```
//!
//! Invariant (checked by every constructor): offsets start at 0, never
//! decrease and end at `values.len()`; lengths are the offset differences.

use crate::{DataType, SparseError};

/// One jagged dimension: `offsets.len() - 1` bags over `values`.
#[derive(Clone, Debug, PartialEq)]
pub struct JaggedTensor {
    values: Vec<i64>,
    weights: Option<Vec<f32>>,
    offsets: Vec<usize>,
}

impl JaggedTensor {
    /// Builds from per-bag lengths.
    pub fn from_lengths(
        values: Vec<i64>,
        lengths: &[i64],
        weights: Option<Vec<f32>>,
    ) -> Result<Self, SparseError> {
        let offsets = offsets_from_lengths(lengths, values.len(), |i| ("", i))?;
        check_weights(&weights, values.len())?;
        Ok(Self {
            values,
            weights,
            offsets,
        })
    }

    /// Builds from offsets (`bags + 1` entries, starting at 0).
    pub fn from_offsets(
        values: Vec<i64>,
        offsets: &[i64],
        weights: Option<Vec<f32>>,
    ) -> Result<Self, SparseError> {
        let offsets = validate_offsets(offsets, values.len())?;
        check_weights(&weights, values.len())?;
        Ok(Self {
            values,
            weights,
            offsets,
        })
    }

    /// All ids, bag after bag.
    pub fn values(&self) -> &[i64] {
        &self.values
    }
    /// Per-id weights (one per value), if any.
    pub fn weights(&self) -> Option<&[f32]> {
        self.weights.as_deref()
    }
    /// `num_bags() + 1` offsets into `values`, from 0 to `values().len()`.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }
    /// Number of bags.
    pub fn num_bags(&self) -> usize {
        self.offsets.len() - 1
    }
    /// The ids of bag `i`.
    pub fn bag(&self, i: usize) -> &[i64] {
        &self.values[self.offsets[i]..self.offsets[i + 1]]
    }
    /// Each bag's length (the differences of the offsets).
    pub fn lengths(&self) -> Vec<usize> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Sparse features of a batch: `K` keys x `B` samples of bags, key-major,
/// like TorchRec's `KeyedJaggedTensor`. Bag `(k, b)` is
/// `values[offsets[k*B + b]..offsets[k*B + b + 1]]`; optional per-id weights
/// (a weighted KJT) scale each id's row when pooled. The batch size `B` is
/// [`stride`](Self::stride).
///
/// ```rust
/// use ember_sparse::{KeyedJaggedTensor, SparseError};
///
/// // Two features, batch of 2: f0 has bags [1, 2] and [3], f1 has [] and [4, 5, 6].
/// let kjt = KeyedJaggedTensor::from_lengths(
///     vec!["f0".to_string(), "f1".to_string()],
///     vec![1, 2, 3, 4, 5, 6],
///     &[2, 1, 0, 3],
///     None,
/// )?;
/// assert_eq!(kjt.keys(), ["f0", "f1"]);
/// assert_eq!(kjt.stride(), 2);
/// assert_eq!(kjt.offsets(), [0, 2, 3, 3, 6]);
/// assert_eq!(kjt.lengths(), [2, 1, 0, 3]);
/// assert_eq!(kjt.key_range(1), 3..6);
///
/// // One feature's bags, as a JaggedTensor.
/// let f1 = kjt.get("f1").unwrap();
/// assert!(f1.bag(0).is_empty());
/// assert_eq!(f1.bag(1), [4, 5, 6]);
///
/// // Invalid lengths are rejected, naming the fault.
/// let err = KeyedJaggedTensor::from_lengths(vec!["f0".into()], vec![7, 8], &[1, -1], None)
///     .unwrap_err();
/// assert_eq!(
///     err,
///     SparseError::NegativeLength { key: "f0".into(), sample: 1, index: 1, length: -1 }
/// );
/// let err = KeyedJaggedTensor::from_lengths(vec!["f0".into()], vec![7, 8], &[1, 0], None)
///     .unwrap_err();
/// assert_eq!(err, SparseError::LengthSumMismatch { sum: 1, values: 2 });
/// # Ok::<(), SparseError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct KeyedJaggedTensor {
    keys: Vec<String>,
    values: Vec<i64>,
    weights: Option<Vec<f32>>,
    offsets: Vec<usize>,
    stride: usize,
}

impl KeyedJaggedTensor {
    /// Builds from one length per (key, sample), key-major, as TorchRec's
    /// `KeyedJaggedTensor.from_lengths_sync`.
    pub fn from_lengths(
        keys: Vec<String>,
        values: Vec<i64>,
        lengths: &[i64],
        weights: Option<Vec<f32>>,
    ) -> Result<Self, SparseError> {
        let stride = stride_of(&keys, lengths.len())?;
        let offsets = offsets_from_lengths(lengths, values.len(), |i| {
            (keys[i / stride.max(1)].as_str(), i % stride.max(1))
        })?;
        check_weights(&weights, values.len())?;
        Ok(Self {
            keys,
            values,
            weights,
            offsets,
            stride,
        })
    }

    /// Builds from `K*B + 1` offsets, as TorchRec's `from_offsets_sync`.
    pub fn from_offsets(
        keys: Vec<String>,
        values: Vec<i64>,
        offsets: &[i64],
        weights: Option<Vec<f32>>,
    ) -> Result<Self, SparseError> {
        if offsets.is_empty() {
            return Err(SparseError::LengthsNotDivisible {
                lengths: 0,
                keys: keys.len(),
            });
        }
        let stride = stride_of(&keys, offsets.len() - 1)?;
        let offsets = validate_offsets(offsets, values.len())?;
        check_weights(&weights, values.len())?;
        Ok(Self {
            keys,
            values,
            weights,
            offsets,
            stride,
        })
    }

    /// The keys (feature names), in input order: `K = keys().len()`.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }
    /// Batch size `B`.
    pub fn stride(&self) -> usize {
        self.stride
    }
    /// All ids, key-major: key 0's bags for samples `0..B`, then key 1's, ...
    pub fn values(&self) -> &[i64] {
        &self.values
    }
    /// Per-id weights, laid out as `values`, if any.
    pub fn weights(&self) -> Option<&[f32]> {
        self.weights.as_deref()
    }
    /// `K*B + 1` offsets into `values`, key-major.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }
    /// `K*B` bag lengths, key-major (the differences of the offsets).
    pub fn lengths(&self) -> Vec<usize> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }
    /// Position of `key` in [`keys`](Self::keys), if present.
    pub fn key_index(&self, key: &str) -> Option<usize> {
        self.keys.iter().position(|k| k == key)
    }
    /// The range of `values` that holds key `k`'s bags.
    pub fn key_range(&self, k: usize) -> std::ops::Range<usize> {
        self.offsets[k * self.stride]..self.offsets[(k + 1) * self.stride]
    }
    /// The same bags holding other ids (rewritten ids: rows for raw ids).
    ///
    /// # Panics
    /// When `values.len()` differs from this one's.
    pub fn with_values(&self, values: Vec<i64>) -> Self {
        assert_eq!(values.len(), self.values.len(), "with_values: as many ids");
        Self {
            keys: self.keys.clone(),
            values,
            weights: self.weights.clone(),
            offsets: self.offsets.clone(),
            stride: self.stride,
        }
    }
    /// Samples `samples` of every key (copies): a rank's part of a batch.
    ///
    /// # Panics
    /// When `samples` goes past the stride.
    pub fn select_samples(&self, samples: std::ops::Range<usize>) -> KeyedJaggedTensor {
        assert!(
            samples.start <= samples.end && samples.end <= self.stride,
            "select_samples: {samples:?} of {} samples",
            self.stride
        );
        let b = samples.len();
        let mut offsets = Vec::with_capacity(self.keys.len() * b + 1);
        let (mut values, mut weights) = (Vec::new(), Vec::new());
        offsets.push(0);
        for k in 0..self.keys.len() {
            let (s, e) = (
                self.offsets[k * self.stride + samples.start],
                self.offsets[k * self.stride + samples.end],
            );
            for i in samples.clone() {
                offsets.push(values.len() + self.offsets[k * self.stride + i + 1] - s);
            }
            values.extend_from_slice(&self.values[s..e]);
            if let Some(w) = &self.weights {
                weights.extend_from_slice(&w[s..e]);
            }
        }
        KeyedJaggedTensor {
            keys: self.keys.clone(),
            stride: b,
            values,
            weights: self.weights.as_ref().map(|_| weights),
            offsets,
        }
    }

    /// A tensor of the keys at `indices` of this one's, in that order, with
    /// their bags; TorchRec's `permute`. An index out of range or given
    /// twice (a key twice) is an error.
    ///
    /// ```
    /// # use ember_sparse::KeyedJaggedTensor;
    /// let kjt = KeyedJaggedTensor::from_lengths(
    ///     vec!["a".into(), "b".into(), "c".into()], vec![1, 2, 3, 4], &[1, 0, 2, 0, 1, 0], None)?;
    /// let ca = kjt.permute(&[2, 0])?;
    /// assert_eq!(ca.keys(), ["c", "a"]);
    /// assert_eq!((ca.values(), ca.lengths()), (&[4, 1][..], vec![1, 0, 1, 0]));
    /// let (ab, c) = { let mut parts = kjt.split(&[2, 1])?; (parts.remove(0), parts.remove(0)) };
    /// assert_eq!((ab.keys().len(), c.keys()), (2, &["c".to_string()][..]));
    /// assert_eq!(kjt.select_keys(&["b"])?.values(), [2, 3]);
    /// assert!(kjt.permute(&[0, 0]).is_err()); // a key twice
    /// assert_eq!(kjt.permute(&[])?.stride(), 0); // no keys, as from_lengths makes them
    /// # Ok::<(), ember_sparse::SparseError>(())
    /// ```
    pub fn permute(&self, indices: &[usize]) -> Result<KeyedJaggedTensor, SparseError> {
        let b = self.stride;
        let mut keys = Vec::with_capacity(indices.len());
        let mut offsets = Vec::with_capacity(indices.len() * b + 1);
        let (mut values, mut weights) = (Vec::new(), Vec::new());
        offsets.push(0);
        for &k in indices {
            let key = self.keys.get(k).ok_or_else(|| SparseError::KeyNotFound {
                key: format!("#{k}"),
                keys: self.keys.clone(),
            })?;
            keys.push(key.clone());
            let range = self.key_range(k);
            let shift = values.len();
            let start = range.start;
            offsets.extend(
                self.offsets[k * b + 1..=(k + 1) * b]
                    .iter()
                    .map(|o| o - start + shift),
            );
            values.extend_from_slice(&self.values[range.clone()]);
            if let Some(w) = &self.weights {
                weights.extend_from_slice(&w[range]);
            }
        }
        if let Some(twice) = (keys.iter().enumerate()).find(|(i, k)| keys[..*i].contains(k)) {
            return Err(SparseError::DuplicateKey(twice.1.clone()));
        }
        Ok(KeyedJaggedTensor {
            // No keys: no bags, stride 0, as the constructors make it.
            stride: if keys.is_empty() { 0 } else { b },
            keys,
            values,
            weights: self.weights.as_ref().map(|_| weights),
            offsets,
        })
    }

    /// The tensor of `keys` (in that order) with their bags; a key it does
    /// not hold is an error naming it.
    pub fn select_keys(&self, keys: &[&str]) -> Result<KeyedJaggedTensor, SparseError> {
        let indices = (keys.iter())
            .map(|key| {
                self.key_index(key).ok_or_else(|| SparseError::KeyNotFound {
                    key: key.to_string(),
                    keys: self.keys.clone(),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.permute(&indices)
    }

    /// Consecutive groups of keys as tensors of their own: `segments[i]`
    /// keys in part `i`, adding up to all keys; TorchRec's `split`.
    pub fn split(&self, segments: &[usize]) -> Result<Vec<KeyedJaggedTensor>, SparseError> {
        if segments.iter().sum::<usize>() != self.keys.len() {
            return Err(SparseError::SplitMismatch {
                segments: segments.to_vec(),
                keys: self.keys.len(),
            });
        }
        let mut first = 0;
        (segments.iter())
            .map(|&n| {
                first += n;
                self.permute(&(first - n..first).collect::<Vec<_>>())
            })
            .collect()
    }

    /// Key `key`'s `B` bags as a [`JaggedTensor`] (copies); `None` when the
    /// key is absent.
    pub fn get(&self, key: &str) -> Option<JaggedTensor> {
        let k = self.key_index(key)?;
        let base = self.offsets[k * self.stride];
        let range = self.key_range(k);
        Some(JaggedTensor {
            values: self.values[range.clone()].to_vec(),
            weights: self.weights.as_ref().map(|w| w[range].to_vec()),
            offsets: self.offsets[k * self.stride..=(k + 1) * self.stride]
                .iter()
                .map(|o| o - base)
                .collect(),
        })
    }
}

fn stride_of(keys: &[String], bags: usize) -> Result<usize, SparseError> {
    for (i, k) in keys.iter().enumerate() {
        if keys[..i].contains(k) {
            return Err(SparseError::DuplicateKey(k.clone()));
        }
    }
    if keys.is_empty() {
        return if bags == 0 {
            Ok(0)
        } else {
            Err(SparseError::LengthsNotDivisible {
                lengths: bags,
                keys: 0,
            })
        };
    }
    if !bags.is_multiple_of(keys.len()) {
        return Err(SparseError::LengthsNotDivisible {
            lengths: bags,
            keys: keys.len(),
        });
    }
    Ok(bags / keys.len())
}

fn offsets_from_lengths<'k>(
    lengths: &[i64],
    num_values: usize,
    locate: impl Fn(usize) -> (&'k str, usize),
) -> Result<Vec<usize>, SparseError> {
    let mut offsets = Vec::with_capacity(lengths.len() + 1);
    offsets.push(0usize);
    let mut sum: i64 = 0;
    for (i, &length) in lengths.iter().enumerate() {
        if length < 0 {
            let (key, sample) = locate(i);
            return Err(SparseError::NegativeLength {
                key: key.to_string(),
                sample,
                index: i,
                length,
            });
        }
        sum = sum.saturating_add(length);
        offsets.push(sum as usize);
    }
    if sum as u64 != num_values as u64 {
        return Err(SparseError::LengthSumMismatch {
            sum,
            values: num_values,
        });
    }
    Ok(offsets)
}

fn validate_offsets(offsets: &[i64], num_values: usize) -> Result<Vec<usize>, SparseError> {
    match offsets.first() {
        None => {
            return Err(SparseError::LengthSumMismatch {
                sum: 0,
                values: num_values,
            })
        }
        Some(&first) if first != 0 => return Err(SparseError::OffsetsNotStartingAtZero(first)),
        _ => {}
    }
    for i in 1..offsets.len() {
        if offsets[i] < offsets[i - 1] {
            return Err(SparseError::NonMonotonicOffsets {
                index: i,
                value: offsets[i],
                previous: offsets[i - 1],
            });
        }
    }
    let last = offsets[offsets.len() - 1];
    if last as u64 != num_values as u64 {
        return Err(SparseError::LengthSumMismatch {
            sum: last,
            values: num_values,
        });
    }
    Ok(offsets.iter().map(|&o| o as usize).collect())
}

fn check_weights(weights: &Option<Vec<f32>>, values: usize) -> Result<(), SparseError> {
    match weights {
        Some(w) if w.len() != values => Err(SparseError::WeightsMismatch {
            weights: w.len(),
            values,
        }),
        _ => Ok(()),
    }
}

/// The value type of pooled embeddings ([`KeyedTensor`]): `f32`, or for
/// inference `half::f16` or `half::bf16`, which halve the bytes the forward
/// writes (FBGEMM's inference TBE's `output_dtype`, FP16 by default there;
/// TorchRec's `QuantEmbeddingBagCollection(output_dtype=...)`). Sums are
/// taken in fp32 whatever the type, and each pooled value is rounded to the
/// nearest (ties to even) once. Sealed: these three are the forward's.
pub trait PooledValue:
    Copy + Default + PartialEq + std::fmt::Debug + Send + Sync + 'static + sealed::Sealed
{
    /// The type, as the `DataType` of the same name.
    const DTYPE: DataType;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl PooledValue for f32 {
    const DTYPE: DataType = DataType::Fp32;
}
impl PooledValue for half::f16 {
    const DTYPE: DataType = DataType::Fp16;
}
impl PooledValue for half::bf16 {
    const DTYPE: DataType = DataType::Bf16;
}

/// Pooled embeddings of a batch: one row per sample, the features' pooled
/// vectors side by side (TorchRec's `KeyedTensor` with `key_dim = 1`), in
/// fp32 unless `T` says otherwise ([`PooledValue`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KeyedTensor<T = f32> {
    keys: Vec<String>,
    length_per_key: Vec<usize>,
    offset_per_key: Vec<usize>,
    batch: usize,
    values: Vec<T>,
}

impl<T: PooledValue> KeyedTensor<T> {
    /// Wraps pooled values, row-major `[batch, sum(length_per_key)]`, as
    /// TorchRec's `KeyedTensor(keys, length_per_key, values)`.
    pub fn new(
        keys: Vec<String>,
        length_per_key: Vec<usize>,
        values: Vec<T>,
    ) -> Result<Self, SparseError> {
        if keys.len() != length_per_key.len() {
            return Err(SparseError::KeyedTensorShape(format!(
                "{} keys but {} lengths",
                keys.len(),
                length_per_key.len()
            )));
        }
        stride_of(&keys, 0)?;
        let width: usize = length_per_key.iter().sum();
        if !values.len().is_multiple_of(width) {
            return Err(SparseError::KeyedTensorShape(format!(
                "{} values do not fill rows of width {width}",
                values.len()
            )));
        }
        let batch = values.len().checked_div(width).unwrap_or(0);
        let mut tensor = Self::zeros(keys, length_per_key, 0);
        tensor.batch = batch;
        tensor.values = values;
        Ok(tensor)
    }

    /// A zeroed tensor for `batch` samples.
    ///
    /// # Panics
    /// When `keys` and `length_per_key` differ in length (use [`KeyedTensor::new`]
    /// for unchecked input).
    pub fn zeros(keys: Vec<String>, length_per_key: Vec<usize>, batch: usize) -> Self {
        assert_eq!(keys.len(), length_per_key.len(), "one length per key");
        let mut offset_per_key = vec![0];
        for l in &length_per_key {
            offset_per_key.push(offset_per_key.last().unwrap() + l);
        }
        let width = *offset_per_key.last().unwrap();
        Self {
            keys,
            length_per_key,
            offset_per_key,
            batch,
            values: crate::storage::zeroed_vec(batch * width),
        }
    }
    /// The keys (feature names), in column order.
    pub fn keys(&self) -> &[String] {
        &self.keys
    }
    /// Width (embedding dim) of each key's pooled vector.
    pub fn length_per_key(&self) -> &[usize] {
        &self.length_per_key
    }
    /// Column where each key's vector starts within a row, then the total
    /// width: `keys().len() + 1` entries.
    pub fn offset_per_key(&self) -> &[usize] {
        &self.offset_per_key
    }
    /// Number of samples (rows).
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Total width of a row: the sum of the keys' dims.
    pub fn width(&self) -> usize {
        *self.offset_per_key.last().unwrap()
    }
    /// Row-major `[batch, width]` values.
    pub fn values(&self) -> &[T] {
        &self.values
    }
    /// Row-major `[batch, width]` values, mutable (the shape stays fixed).
    pub fn values_mut(&mut self) -> &mut [T] {
        &mut self.values
    }
    /// The row-major `[batch, width]` values, taken out (their buffer
    /// kept for reuse).
    pub fn into_values(self) -> Vec<T> {
        self.values
    }
    /// Sample `b`'s pooled vector for key index `k`.
    pub fn get(&self, b: usize, k: usize) -> &[T] {
        let row = b * self.width();
        &self.values[row + self.offset_per_key[k]..row + self.offset_per_key[k + 1]]
    }
    pub(crate) fn set_batch(&mut self, batch: usize) {
        self.batch = batch;
        self.values.resize(batch * self.width(), T::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("f{i}")).collect()
    }

    #[test]
    fn kjt_from_lengths_matches_diagram() {
        let kjt =
            KeyedJaggedTensor::from_lengths(keys(2), vec![1, 2, 3, 4, 5, 6], &[2, 1, 0, 3], None)
                .unwrap();
        assert_eq!(kjt.stride(), 2);
        assert_eq!(kjt.offsets(), &[0, 2, 3, 3, 6]);
        assert_eq!(kjt.key_range(1), 3..6);
        let f1 = kjt.get("f1").unwrap();
        assert_eq!(f1.bag(0), &[] as &[i64]);
        assert_eq!(f1.bag(1), &[4, 5, 6]);
    }

    #[test]
    fn keyed_tensor_checks_its_shape() {
        let kt = KeyedTensor::new(keys(2), vec![2, 1], vec![1., 2., 3., 4., 5., 6.]).unwrap();
        assert_eq!(kt.batch(), 2);
        assert_eq!(kt.get(1, 0), &[4., 5.]);
        assert_eq!(kt.get(1, 1), &[6.]);
        assert!(KeyedTensor::<f32>::new(keys(2), vec![2], vec![]).is_err());
        assert!(KeyedTensor::new(keys(2), vec![2, 1], vec![1.; 4]).is_err());
        assert_eq!(
            KeyedTensor::<f32>::new(vec!["a".into(), "a".into()], vec![1, 1], vec![]).unwrap_err(),
            SparseError::DuplicateKey("a".into())
        );
    }

    #[test]
    fn bad_inputs_name_the_fault() {
        let e = KeyedJaggedTensor::from_lengths(keys(2), vec![1, 2], &[1, -1, 1, 1], None);
        assert_eq!(
            e.unwrap_err(),
            SparseError::NegativeLength {
                key: "f0".into(),
                sample: 1,
                index: 1,
                length: -1
            }
        );
        let e = KeyedJaggedTensor::from_lengths(keys(2), vec![1, 2], &[1, 1, 1, 1], None);
        assert_eq!(
            e.unwrap_err(),
            SparseError::LengthSumMismatch { sum: 4, values: 2 }
        );
        let e = KeyedJaggedTensor::from_offsets(keys(2), vec![1, 2], &[0, 2, 1, 2, 2], None);
        assert_eq!(
            e.unwrap_err(),
            SparseError::NonMonotonicOffsets {
                index: 2,
                value: 1,
                previous: 2
            }
        );
        let e = KeyedJaggedTensor::from_lengths(keys(2), vec![1], &[1, 0, 0], None);
        assert!(matches!(
            e.unwrap_err(),
            SparseError::LengthsNotDivisible { .. }
        ));
        let e = KeyedJaggedTensor::from_lengths(keys(1), vec![1], &[1], Some(vec![]));
        assert_eq!(
            e.unwrap_err(),
            SparseError::WeightsMismatch {
                weights: 0,
                values: 1
            }
        );
        let e =
            KeyedJaggedTensor::from_lengths(vec!["a".into(), "a".into()], vec![], &[0, 0], None);
        assert_eq!(e.unwrap_err(), SparseError::DuplicateKey("a".into()));
        let e = JaggedTensor::from_offsets(vec![1], &[1, 1], None);
        assert_eq!(e.unwrap_err(), SparseError::OffsetsNotStartingAtZero(1));
    }
}
