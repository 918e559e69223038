//! The Open Inference Protocol (KServe v2, what Triton speaks) over
//! HTTP/REST: its JSON objects, and the binary tensor data extension
//! (tensors as raw little-endian bytes after the JSON object, whose length
//! the `Inference-Header-Content-Length` header gives).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::ServeError;

/// The header giving the JSON object's length when binary data follows.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// `GET /v2`: the server's name, version and protocol extensions.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServerMetadata {
    /// `ember`.
    pub name: String,
    /// Ember's version.
    pub version: String,
    /// `binary_tensor_data`.
    pub extensions: Vec<String>,
}

/// One tensor a model takes or gives: its name, data type and shape (`-1`:
/// any size).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorMetadata {
    /// The tensor's name in requests and responses.
    pub name: String,
    /// The protocol's type name (`FP32`, `INT64`, ...).
    pub datatype: String,
    /// Its shape, `-1` where any size goes.
    pub shape: Vec<i64>,
}

/// `GET /v2/models/{name}`: what a model takes and gives.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelMetadata {
    /// The model's name.
    pub name: String,
    /// The versions served (one).
    pub versions: Vec<String>,
    /// `ember_dlrm`.
    pub platform: String,
    /// Its inputs.
    pub inputs: Vec<TensorMetadata>,
    /// Its outputs.
    pub outputs: Vec<TensorMetadata>,
}

/// A request's input tensor: its data in `data` (JSON, row-major, flat or
/// nested) or, with a `binary_data_size` parameter, as bytes after the
/// JSON object.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RequestInput {
    /// The model input it is.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its data type.
    pub datatype: String,
    /// `binary_data_size` among others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Map<String, Value>>,
    /// The values, when not binary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

/// An output a request asks for (`binary_data`: as bytes).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RequestOutput {
    /// The model output.
    pub name: String,
    /// `binary_data` among others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Map<String, Value>>,
}

/// `POST /v2/models/{name}/infer`'s body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InferRequest {
    /// Echoed in the response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `binary_data_output` among others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Map<String, Value>>,
    /// The inputs.
    pub inputs: Vec<RequestInput>,
    /// The outputs wanted (none: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<Vec<RequestOutput>>,
}

/// An output tensor of a response: its data in `data`, or with a
/// `binary_data_size` parameter after the JSON object.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ResponseOutput {
    /// The model output.
    pub name: String,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its data type.
    pub datatype: String,
    /// `binary_data_size` when binary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Map<String, Value>>,
    /// The values, when not binary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<OutputData>,
}

/// An output's values as JSON: integers or floats, by its datatype.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OutputData {
    /// `INT64` values.
    Ints(Vec<i64>),
    /// `FP32` values.
    Floats(Vec<f32>),
}

/// The response to an inference request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InferResponse {
    /// The model's name.
    pub model_name: String,
    /// The version that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_version: Option<String>,
    /// The request's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The outputs asked for.
    pub outputs: Vec<ResponseOutput>,
}

/// What failed, as the protocol's error object.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The reason, naming the input at fault.
    pub error: String,
}

/// A request body taken apart: the JSON object and, for each input in
/// order, its binary data (`None`: its data is in the JSON).
pub struct ParsedRequest<'a> {
    /// The JSON object.
    pub request: InferRequest,
    /// Each input's bytes, when binary.
    pub binary: Vec<Option<&'a [u8]>>,
}

fn bad(m: impl Into<String>) -> ServeError {
    ServeError::BadRequest(m.into())
}

/// A parameter as a non-negative integer (`None`: not given).
fn size_parameter(
    parameters: &Option<Map<String, Value>>,
    key: &str,
    of: &str,
) -> Result<Option<usize>, ServeError> {
    match parameters.as_ref().and_then(|p| p.get(key)) {
        None => Ok(None),
        Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) => Ok(Some(n)),
            None => Err(bad(format!("{of}: {key} {v} is not a byte count"))),
        },
    }
}

/// A parameter as a flag (`None`: not given).
pub fn flag(parameters: &Option<Map<String, Value>>, key: &str) -> Option<bool> {
    parameters.as_ref()?.get(key)?.as_bool()
}

/// Takes a request body apart: the JSON object (all of `body`, or its
/// first `header_length` bytes), then each binary input's bytes in order.
/// Every size is checked against what the body holds.
pub fn parse_request(
    body: &[u8],
    header_length: Option<usize>,
) -> Result<ParsedRequest<'_>, ServeError> {
    let json_len = header_length.unwrap_or(body.len());
    if json_len > body.len() {
        return Err(bad(format!(
            "Inference-Header-Content-Length {json_len} is beyond the body's {} bytes",
            body.len()
        )));
    }
    let (json, mut rest) = body.split_at(json_len);
    let request: InferRequest = serde_json::from_slice(json)
        .map_err(|e| bad(format!("the request is not an inference request: {e}")))?;
    let mut binary = Vec::with_capacity(request.inputs.len());
    for input in &request.inputs {
        let of = format!("input '{}'", input.name);
        match size_parameter(&input.parameters, "binary_data_size", &of)? {
            Some(n) => {
                if input.data.is_some() {
                    return Err(bad(format!("{of}: both data and binary_data_size")));
                }
                if n > rest.len() {
                    return Err(bad(format!(
                        "{of}: binary_data_size {n}, but {} bytes are left in the body",
                        rest.len()
                    )));
                }
                let (mine, tail) = rest.split_at(n);
                binary.push(Some(mine));
                rest = tail;
            }
            None if input.data.is_none() => {
                return Err(bad(format!(
                    "{of}: no data (neither data nor binary_data_size)"
                )))
            }
            None => binary.push(None),
        }
    }
    if !rest.is_empty() {
        return Err(bad(format!(
            "{} bytes after the inputs' binary data",
            rest.len()
        )));
    }
    Ok(ParsedRequest { request, binary })
}

/// A response body: the JSON object, then each binary output's bytes;
/// with the JSON object's length when binary data follows.
pub fn encode_response(
    mut response: InferResponse,
    binary: Vec<Option<Vec<u8>>>,
) -> (Vec<u8>, Option<usize>) {
    for (output, bytes) in response.outputs.iter_mut().zip(&binary) {
        if let Some(bytes) = bytes {
            let parameters = output.parameters.get_or_insert_with(Map::new);
            parameters.insert("binary_data_size".into(), Value::from(bytes.len()));
            output.data = None;
        }
    }
    let mut body = serde_json::to_vec(&response).expect("a response serialises");
    if binary.iter().all(Option::is_none) {
        return (body, None);
    }
    let json_len = body.len();
    for bytes in binary.into_iter().flatten() {
        body.extend_from_slice(&bytes);
    }
    (body, Some(json_len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn binary_inputs_follow_the_json_in_order() {
        let json = br#"{"inputs":[{"name":"a","shape":[2],"datatype":"INT32","parameters":{"binary_data_size":8}},{"name":"b","shape":[1],"datatype":"FP32","data":[1.5]},{"name":"c","shape":[1],"datatype":"BOOL","parameters":{"binary_data_size":1}}]}"#;
        let mut body = json.to_vec();
        body.extend_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0, 1]);
        let parsed = parse_request(&body, Some(json.len())).unwrap();
        assert_eq!(parsed.binary[0], Some(&[1, 0, 0, 0, 2, 0, 0, 0][..]));
        assert_eq!(parsed.binary[1], None);
        assert_eq!(parsed.binary[2], Some(&[1][..]));
        let short = parse_request(&body[..body.len() - 1], Some(json.len()));
        assert!(matches!(short, Err(ServeError::BadRequest(m)) if m.contains("input 'c'")));
        let long = [&body[..], &[0]].concat();
        assert!(parse_request(&long, Some(json.len())).is_err());
    }

    #[test]
    fn responses_put_binary_outputs_after_the_json() {
        let out = |name: &str| ResponseOutput {
            name: name.into(),
            shape: vec![1],
            datatype: "FP32".into(),
            parameters: None,
            data: Some(OutputData::Floats(vec![0.5])),
        };
        let response = InferResponse {
            model_name: "m".into(),
            model_version: None,
            id: None,
            outputs: vec![out("x"), out("y")],
        };
        let (body, len) = encode_response(response, vec![None, Some(vec![9, 9, 9, 9])]);
        let len = len.unwrap();
        assert_eq!(&body[len..], &[9, 9, 9, 9]);
        let back: InferResponse = serde_json::from_slice(&body[..len]).unwrap();
        assert_eq!(back.outputs[0].data, Some(OutputData::Floats(vec![0.5])));
        assert_eq!(back.outputs[1].data, None);
    }

    proptest! {
        // Any body and header length: a parse or a clear refusal, never a panic.
        #[test]
        fn any_body_parses_or_is_refused(body in proptest::collection::vec(any::<u8>(), 0..256),
                                         len in proptest::option::of(0usize..300)) {
            let _ = parse_request(&body, len);
        }
    }
}
