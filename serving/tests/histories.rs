//! Sequence models behind the server, in process: a SASRec checkpoint
//! answers each history's top items and HSTU ranking its candidates'
//! logits, as `SequenceScorer` (what `ember predict` runs) scores the same
//! histories in one batch; bad histories get a 400 naming the input.

use std::path::Path;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use ember_models::sequential::{
    HstuRanking, HstuRankingConfig, HstuRetrieval, HstuRetrievalConfig, SasRec, SasRecConfig,
    SequenceScorer, SequenceScores, UserHistory,
};
use ember_models::Model;
use ember_serving::{router, ModelOptions, ServeOptions, ServedModel};

const ITEMS: usize = 40;

fn users() -> Vec<UserHistory> {
    (0..5i64)
        .map(|u| {
            let n = 5 + 2 * u as usize;
            UserHistory {
                items: (0..n as i64)
                    .map(|t| (u * 7 + t * 3) % ITEMS as i64)
                    .collect(),
                timestamps: (0..n as i64).map(|t| 1_000 + 60 * t * (u + 1)).collect(),
                actions: (0..n as i64).map(|t| (t + u) % 4).collect(),
            }
        })
        .collect()
}

/// One request of `users`: lengths, items, times and (`actions`) actions.
fn request(users: &[UserHistory], actions: bool) -> Value {
    let flat = |f: fn(&UserHistory) -> &Vec<i64>| -> Vec<i64> {
        users.iter().flat_map(|u| f(u).iter().copied()).collect()
    };
    let tensor = |name: &str, data: Vec<i64>| json!({"name": name, "shape": [data.len()], "datatype": "INT64", "data": data});
    let lengths = users.iter().map(|u| u.items.len() as i64).collect();
    let mut inputs = vec![
        tensor("history.lengths", lengths),
        tensor("history.values", flat(|u| &u.items)),
        tensor("history.timestamps", flat(|u| &u.timestamps)),
    ];
    if actions {
        inputs.push(tensor("history.actions", flat(|u| &u.actions)));
    }
    json!({ "inputs": inputs })
}

async fn infer(app: &Router, name: &str, body: &Value) -> (StatusCode, Value) {
    let request = Request::post(format!("/v2/models/{name}/infer"))
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

fn output<'a>(body: &'a Value, name: &str) -> &'a Value {
    let outputs = body["outputs"].as_array().unwrap();
    outputs.iter().find(|o| o["name"] == name).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    let data = v["data"].as_array().unwrap();
    data.iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn app(dir: &Path, name: &str, top_k: usize) -> Router {
    let options = ModelOptions {
        top_k,
        ..Default::default()
    };
    let model = ServedModel::open(dir, name, &options).unwrap();
    router(model, &ServeOptions::default()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasrec_answers_each_history_its_top_items() {
    let dir = tempfile::tempdir().unwrap();
    let config = SasRecConfig {
        hidden_units: 16,
        seed: 3,
        ..SasRecConfig::new(ITEMS, 6)
    };
    SasRec::new(config)
        .unwrap()
        .save_checkpoint(dir.path(), None)
        .unwrap();
    let app = app(dir.path(), "sasrec", 4);
    let users = users();
    let (status, body) = infer(&app, "sasrec", &request(&users, false)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let items = output(&body, "items");
    assert_eq!(items["datatype"], "INT64");
    assert_eq!(items["shape"], json!([5, 4]));
    let SequenceScores::TopItems {
        items: want,
        scores,
    } = SequenceScorer::open(dir.path())
        .unwrap()
        .score(&users, 4)
        .unwrap()
    else {
        panic!("SASRec retrieves items");
    };
    let got: Vec<i64> = (items["data"].as_array().unwrap().iter())
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert_eq!(got, want);
    assert_eq!(floats(output(&body, "scores")), scores, "bitwise");

    // Metadata names the inputs and the outputs' shapes.
    let get = Request::get("/v2/models/sasrec")
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(get).await.unwrap();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let meta: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(meta["platform"], "ember_sasrec");
    assert_eq!(meta["inputs"].as_array().unwrap().len(), 3);
    assert_eq!(meta["outputs"][0]["shape"], json!([-1, 4]));

    // Bad histories: refused naming the input.
    let mut outside = users.clone();
    outside[1].items[2] = ITEMS as i64;
    let mut empty = users.clone();
    (empty[3].items, empty[3].timestamps) = (Vec::new(), Vec::new());
    let mut unordered = users.clone();
    unordered[2].timestamps.swap(0, 1);
    let cases = [
        (request(&outside, false), "sample 1: item 40 is outside"),
        (request(&empty, false), "sample 3 has 0 items"),
        (
            request(&unordered, false),
            "'history.timestamps': sample 2: not in time order",
        ),
        (request(&users, true), "'history.actions' is not an input"),
    ];
    for (body, says) in cases {
        let (status, answer) = infer(&app, "sasrec", &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(says), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hstu_ranking_answers_each_candidates_logits() {
    let dir = tempfile::tempdir().unwrap();
    let config = HstuRankingConfig {
        embedding_dim: 16,
        attention_dim: 8,
        linear_dim: 8,
        head_hidden: 16,
        num_candidates: 3,
        seed: 4,
        ..HstuRankingConfig::new(ITEMS, 8)
    };
    HstuRanking::new(config)
        .unwrap()
        .save_checkpoint(dir.path(), None)
        .unwrap();
    let app = app(dir.path(), "ranking", 10);
    let users = users();
    let (status, body) = infer(&app, "ranking", &request(&users, true)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let logit = output(&body, "logit");
    assert_eq!(logit["shape"], json!([5, 3, 2]));
    let SequenceScores::Candidates { logits } = SequenceScorer::open(dir.path())
        .unwrap()
        .score(&users, 0)
        .unwrap()
    else {
        panic!("HSTU ranking scores candidates");
    };
    assert_eq!(floats(logit), logits, "bitwise");
    let p = floats(output(&body, "probability"));
    for (p, z) in p.iter().zip(&logits) {
        assert!((p - 1.0 / (1.0 + (-z).exp())).abs() < 1e-6);
    }
    // The candidates' actions are not read; the item before them is.
    let mut acted = users.clone();
    let n = acted[0].actions.len();
    acted[0].actions[n - 1] ^= 3;
    let (_, same) = infer(&app, "ranking", &request(&acted, true)).await;
    assert_eq!(floats(output(&same, "logit")), logits);
    let mut moved = users.clone();
    moved[0].items[n - 4] = (moved[0].items[n - 4] + 1) % ITEMS as i64;
    let (_, other) = infer(&app, "ranking", &request(&moved, true)).await;
    assert_ne!(floats(output(&other, "logit"))[..6], logits[..6]);

    let mut short = users.clone();
    short[0].items.truncate(3);
    short[0].timestamps.truncate(3);
    short[0].actions.truncate(3);
    let cases = [
        (request(&users, false), "input 'history.actions' is missing"),
        (
            request(&short, true),
            "sample 0 has 3 items; hstu-ranking reads at least 4",
        ),
    ];
    for (body, says) in cases {
        let (status, answer) = infer(&app, "ranking", &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(says), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hstu_retrieval_answers_each_history_its_top_items() {
    let dir = tempfile::tempdir().unwrap();
    let config = HstuRetrievalConfig {
        embedding_dim: 16,
        attention_dim: 8,
        linear_dim: 8,
        num_heads: 2,
        seed: 6,
        ..HstuRetrievalConfig::new(ITEMS, 6)
    };
    HstuRetrieval::new(config)
        .unwrap()
        .save_checkpoint(dir.path(), None)
        .unwrap();
    let app = app(dir.path(), "hstu", 3);
    let users = users();
    let (status, body) = infer(&app, "hstu", &request(&users, false)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(output(&body, "items")["shape"], json!([5, 3]));
    let SequenceScores::TopItems { scores, .. } = SequenceScorer::open(dir.path())
        .unwrap()
        .score(&users, 3)
        .unwrap()
    else {
        panic!("HSTU retrieval retrieves items");
    };
    assert_eq!(floats(output(&body, "scores")), scores, "bitwise");
}
