//! A request's input tensors decoded: numbers from the JSON (flat or
//! nested, row-major) or from little-endian bytes, checked against the
//! tensor's shape and data type.

use serde_json::Value;

use crate::protocol::RequestInput;
use crate::ServeError;

/// An input's values, as floats or as integers.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// `FP32` or `FP64` (as f32, the model's type).
    Floats(Vec<f32>),
    /// `INT32` or `INT64`.
    Ints(Vec<i64>),
}

/// Bytes an element of `datatype` takes, and whether it is a float; `None`
/// for the types no Ember input takes.
fn element(datatype: &str) -> Option<(usize, bool)> {
    match datatype {
        "FP32" => Some((4, true)),
        "FP64" => Some((8, true)),
        "INT32" => Some((4, false)),
        "INT64" => Some((8, false)),
        _ => None,
    }
}

/// `values` as the little-endian bytes `bytes` gives each (binary tensor
/// data, gRPC's raw contents).
pub(crate) fn le_bytes<T: Copy, const N: usize>(values: &[T], bytes: fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| bytes(v)).collect()
}

/// The elements `shape` holds; refused for a negative or overflowing shape.
pub fn elements(input: &RequestInput) -> Result<usize, ServeError> {
    let bad = || {
        ServeError::BadRequest(format!(
            "input '{}': shape {:?} is not a tensor's shape",
            input.name, input.shape
        ))
    };
    input.shape.iter().try_fold(1usize, |n, &d| {
        let d = usize::try_from(d).map_err(|_| bad())?;
        n.checked_mul(d).ok_or_else(bad)
    })
}

/// Appends the numbers of a JSON value, nested arrays flattened (at most
/// 8 deep); `false` when something else is there.
fn flatten<'a>(value: &'a Value, out: &mut Vec<&'a Value>, depth: usize) -> bool {
    match value {
        Value::Array(items) if depth < 8 => items.iter().all(|v| flatten(v, out, depth + 1)),
        Value::Number(_) => {
            out.push(value);
            true
        }
        _ => false,
    }
}

/// The values of `input`, from its JSON `data` or its `binary` bytes, with
/// as many elements as its shape holds (at most `max_elements`).
pub fn decode(
    input: &RequestInput,
    binary: Option<&[u8]>,
    max_elements: usize,
) -> Result<Values, ServeError> {
    let name = &input.name;
    let bad = |m: String| ServeError::BadRequest(format!("input '{name}': {m}"));
    let (size, float) = element(&input.datatype).ok_or_else(|| {
        bad(format!(
            "datatype {} is not one Ember takes (FP32, FP64, INT32, INT64)",
            input.datatype
        ))
    })?;
    let n = elements(input)?;
    if n > max_elements {
        return Err(bad(format!(
            "{n} elements, more than the {max_elements} this server takes"
        )));
    }
    if let Some(bytes) = binary {
        // No overflow: the expected bytes are compared, not computed, past usize.
        if Some(bytes.len()) != n.checked_mul(size) {
            return Err(bad(format!(
                "{} bytes of binary data for shape {:?} of {} ({n} elements of {size} bytes)",
                bytes.len(),
                input.shape,
                input.datatype,
            )));
        }
        let chunks = bytes.chunks_exact(size);
        return Ok(match (size, float) {
            (4, true) => Values::Floats(
                chunks
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect(),
            ),
            (8, true) => Values::Floats(
                chunks
                    .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                    .collect(),
            ),
            (4, false) => Values::Ints(
                chunks
                    .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64)
                    .collect(),
            ),
            _ => Values::Ints(
                chunks
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect(),
            ),
        });
    }
    let data = input.data.as_ref().ok_or_else(|| bad("no data".into()))?;
    let mut numbers = Vec::with_capacity(n.min(1 << 20));
    if !flatten(data, &mut numbers, 0) {
        return Err(bad("data must be numbers, in arrays at most 8 deep".into()));
    }
    if numbers.len() != n {
        return Err(bad(format!(
            "{} values for shape {:?} ({n} expected)",
            numbers.len(),
            input.shape
        )));
    }
    if float {
        let floats = numbers.iter().map(|v| v.as_f64().map(|x| x as f32));
        let floats: Option<Vec<f32>> = floats.collect();
        floats
            .map(Values::Floats)
            .ok_or_else(|| bad("a value is not a number".into()))
    } else {
        let ints: Option<Vec<i64>> = numbers.iter().map(|v| v.as_i64()).collect();
        let ints = ints.ok_or_else(|| {
            bad(format!(
                "a value is not a whole number of {}",
                input.datatype
            ))
        })?;
        if size == 4 && ints.iter().any(|&v| i32::try_from(v).is_err()) {
            return Err(bad("a value is beyond INT32".into()));
        }
        Ok(Values::Ints(ints))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(datatype: &str, shape: &[i64], data: Option<Value>) -> RequestInput {
        RequestInput {
            name: "x".into(),
            shape: shape.to_vec(),
            datatype: datatype.into(),
            parameters: None,
            data,
        }
    }

    #[test]
    fn json_and_binary_decode_alike() {
        let nested = input(
            "FP32",
            &[2, 2],
            Some(serde_json::json!([[1.0, 2.5], [3.0, -4.0]])),
        );
        let flat = input(
            "FP32",
            &[2, 2],
            Some(serde_json::json!([1.0, 2.5, 3.0, -4.0])),
        );
        let bytes: Vec<u8> = [1.0f32, 2.5, 3.0, -4.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let binary = input("FP32", &[2, 2], None);
        let want = Values::Floats(vec![1.0, 2.5, 3.0, -4.0]);
        assert_eq!(decode(&nested, None, 100).unwrap(), want);
        assert_eq!(decode(&flat, None, 100).unwrap(), want);
        assert_eq!(decode(&binary, Some(&bytes), 100).unwrap(), want);
        let ints = input("INT32", &[3], None);
        let bytes: Vec<u8> = [7i32, -1, 9].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(
            decode(&ints, Some(&bytes), 100).unwrap(),
            Values::Ints(vec![7, -1, 9])
        );
    }

    #[test]
    fn bad_tensors_name_the_input_and_the_fault() {
        let err = |i: RequestInput, b: Option<&[u8]>| match decode(&i, b, 4) {
            Err(ServeError::BadRequest(m)) => m,
            other => panic!("{other:?}"),
        };
        let m = err(input("FP32", &[3], Some(serde_json::json!([1, 2]))), None);
        assert!(m.contains("input 'x': 2 values for shape [3]"), "{m}");
        let m = err(input("BYTES", &[1], Some(serde_json::json!(["a"]))), None);
        assert!(m.contains("datatype BYTES"), "{m}");
        let m = err(input("INT64", &[1], Some(serde_json::json!([1.5]))), None);
        assert!(m.contains("not a whole number"), "{m}");
        let m = err(input("FP32", &[5], None), Some(&[0; 20]));
        assert!(m.contains("more than the 4"), "{m}");
        let m = err(input("FP32", &[-1], None), Some(&[]));
        assert!(m.contains("not a tensor's shape"), "{m}");
        let m = err(input("INT32", &[2], None), Some(&[0; 7]));
        assert!(m.contains("7 bytes"), "{m}");
    }
}
