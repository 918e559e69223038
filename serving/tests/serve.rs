//! The server end to end, in process: requests through the router (axum's
//! service, no socket) to the batching thread and a real checkpoint's
//! model. Dynamic batching joins requests, a panicking model fails only the
//! request at fault, a full server sheds, deadlines drop queued requests,
//! hot reload swaps checkpoints and refuses a broken one, instances run
//! batches side by side and reload together, every error is the
//! protocol's JSON object, and gRPC answers as HTTP does.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use tower::ServiceExt;

use ember_dataloader::{Batch, DatasetSpec};
use ember_models::{Dlrm, DlrmConfig, InteractionType};
use ember_serving::grpc::proto::grpc_inference_service_server::GrpcInferenceService;
use ember_serving::grpc::proto::{
    model_infer_request::InferInputTensor, InferTensorContents, ModelInferRequest,
    ModelMetadataRequest, ModelReadyRequest,
};
use ember_serving::grpc::GrpcService;
use ember_serving::reload::identity;
use ember_serving::{
    router, BatchOptions, Column, Limits, ModelOptions, ReloadOptions, Scorer, ServeError,
    ServeOptions, ServedModel, Server,
};

const ROWS: [usize; 3] = [50, 70, 30];

/// A small DLRM checkpoint with Criteo's recorded inputs, written (through
/// a temporary file and a rename, as Ember writes them) to `path`.
fn checkpoint(path: &Path, seed: u64) {
    let config = DlrmConfig {
        tables: DlrmConfig::criteo_tables(&ROWS, 4),
        bottom_mlp: vec![13, 8, 4],
        top_mlp: vec![6, 1],
        interaction: InteractionType::Dot,
    };
    let mut model = Dlrm::builder(config.clone()).seed(seed).build().unwrap();
    model.set_dataset_spec(Some(DatasetSpec::criteo(&config.tables)));
    let temp = path.with_extension("tmp");
    ember_models::checkpoint::save(&mut model, &temp, None).unwrap();
    std::fs::rename(&temp, path).unwrap();
}

/// A fresh directory for test `name` holding a checkpoint of `seed`.
fn checkpoint_in(name: &str, seed: u64) -> (PathBuf, PathBuf) {
    let dir = temp_dir(name);
    let path = dir.join("model.safetensors");
    checkpoint(&path, seed);
    (dir, path)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn limits(max_batch_size: usize) -> ModelOptions {
    ModelOptions {
        limits: Limits {
            max_batch_size,
            max_ids_per_feature: 1000,
        },
        ..Default::default()
    }
}

/// A JSON inference request of samples `first..first + rows`, each
/// sample's raw values drawn from its number (so requests of consecutive
/// samples hold what one request of them all holds); `dense0` replaces
/// the first dense value.
fn request(first: i64, rows: usize, dense0: Option<f32>) -> Value {
    let samples = first..first + rows as i64;
    let mut dense: Vec<f32> = (samples.clone())
        .flat_map(|s| (0..13).map(move |j| ((s * 7 + j) % 50) as f32))
        .collect();
    if let Some(x) = dense0 {
        dense[0] = x;
    }
    let mut inputs =
        vec![json!({"name": "dense", "shape": [rows, 13], "datatype": "FP32", "data": dense})];
    for f in 0..ROWS.len() as i64 {
        let lengths: Vec<i64> = samples.clone().map(|s| s % 3).collect();
        let ids: Vec<i64> = (samples.clone())
            .flat_map(|s| (0..s % 3).map(move |t| (s * 31 + t) * 1_000_003 * (f + 1)))
            .collect();
        inputs.push(json!({"name": format!("cat_{f}.lengths"), "shape": [rows], "datatype": "INT64", "data": lengths}));
        inputs.push(json!({"name": format!("cat_{f}.values"), "shape": [ids.len()], "datatype": "INT64", "data": ids}));
    }
    json!({ "inputs": inputs })
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, value)
}

async fn post(
    app: &Router,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (StatusCode, Value) {
    let mut r = Request::post(path);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    send(app, r.body(Body::from(body)).unwrap()).await
}

async fn infer(app: &Router, body: Value) -> (StatusCode, Value) {
    let bytes = serde_json::to_vec(&body).unwrap();
    post(app, "/v2/models/dlrm/infer", bytes, &[]).await
}

async fn get(app: &Router, path: &str) -> (StatusCode, Value) {
    send(app, Request::get(path).body(Body::empty()).unwrap()).await
}

async fn metrics(app: &Router) -> String {
    match get(app, "/metrics").await {
        (StatusCode::OK, Value::String(text)) => text,
        other => panic!("{other:?}"),
    }
}

/// The value of the metric line of `name` (its labels, if any, after it).
fn metric(text: &str, name: &str) -> Option<f64> {
    (text.lines())
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

fn logits(body: &Value) -> Vec<f32> {
    let outputs = body["outputs"].as_array().unwrap();
    let logit = outputs.iter().find(|o| o["name"] == "logit").unwrap();
    (logit["data"].as_array().unwrap().iter())
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

fn decode(model: &ServedModel, body: &Value) -> ember_serving::inputs::Samples {
    let bytes = serde_json::to_vec(body).unwrap();
    let parsed = ember_serving::protocol::parse_request(&bytes, None).unwrap();
    model.inputs.decode(&parsed).unwrap()
}

/// The logits `model` gives `body`'s samples, as one batch.
fn direct(model: &mut ServedModel, body: &Value) -> Vec<f32> {
    let samples = decode(model, body);
    let batch = model.inputs.batch(&[&samples]).unwrap();
    match model.instances[0].score(&batch).unwrap().swap_remove(0) {
        Column::Floats(logits) => logits,
        Column::Ints(_) => panic!("a DLRM's logits are floats"),
    }
}

/// A long queue delay: a batch closes only when full, so which requests
/// join one is certain.
fn until_full(max_queue_size: usize) -> ServeOptions {
    ServeOptions {
        batching: BatchOptions {
            max_queue_delay: Duration::from_secs(600),
            max_queue_size,
            default_timeout: None,
            threads: Some(1),
        },
        ..ServeOptions::default()
    }
}

#[test]
fn requests_joined_make_the_batch_of_their_samples() {
    let (dir, path) = checkpoint_in("join", 1);
    let model = ServedModel::open(&path, "dlrm", &limits(64)).unwrap();
    let (a, b) = (
        decode(&model, &request(0, 5, None)),
        decode(&model, &request(5, 7, None)),
    );
    let whole = decode(&model, &request(0, 12, None));
    let joined: Batch = model.inputs.batch(&[&a, &b]).unwrap();
    let alone: Batch = model.inputs.batch(&[&whole]).unwrap();
    assert_eq!(joined.dense.data(), alone.dense.data());
    assert_eq!(joined.sparse, alone.sparse);
    assert_eq!(joined.labels.len(), 12);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_join_one_batch_and_score_as_it() {
    let (dir, path) = checkpoint_in("batch", 2);
    let mut reference = ServedModel::open(&path, "dlrm", &limits(12)).unwrap();
    let want = direct(&mut reference, &request(0, 12, None));
    let model = ServedModel::open(&path, "dlrm", &limits(12)).unwrap();
    let app = router(model, &until_full(8)).unwrap();
    // 5 + 7 samples fill a batch of 12: it runs once both are queued.
    let (first, second) = tokio::join!(
        infer(&app, request(0, 5, None)),
        infer(&app, request(5, 7, None))
    );
    assert_eq!(first.0, StatusCode::OK, "{first:?}");
    assert_eq!(second.0, StatusCode::OK, "{second:?}");
    let got = [logits(&first.1), logits(&second.1)].concat();
    assert_eq!(got, want, "the joined batch scores as the batch of 12");
    let text = metrics(&app).await;
    assert_eq!(
        metric(&text, "nv_inference_exec_count"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(metric(&text, "nv_inference_count"), Some(12.0));
    assert_eq!(metric(&text, "nv_inference_request_success"), Some(2.0));
    assert_eq!(metric(&text, "ember_batch_size_sum"), Some(12.0));
    assert_eq!(metric(&text, "ember_model_version"), Some(1.0));
    std::fs::remove_dir_all(dir).unwrap();
}

/// The model of a checkpoint, panicking on a batch whose first dense
/// feature (transformed) is above 10: a bug that one request triggers.
struct Fragile(Box<dyn Scorer>);

impl Scorer for Fragile {
    fn score(&mut self, batch: &Batch) -> Result<Vec<Column>, ServeError> {
        let dense = batch.dense.data();
        if dense.chunks(13).any(|row| row[0] > 10.0) {
            panic!("injected: a bug this request triggers");
        }
        self.0.score(batch)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_fails_only_the_request_that_caused_it() {
    let (dir, path) = checkpoint_in("panic", 3);
    let mut reference = ServedModel::open(&path, "dlrm", &limits(6)).unwrap();
    let good = request(0, 5, None);
    let want = direct(&mut reference, &good);
    let model = ServedModel::open(&path, "dlrm", &limits(6)).unwrap();
    let model = ServedModel {
        instances: (model.instances.into_iter())
            .map(|m| Box::new(Fragile(m)) as Box<dyn Scorer>)
            .collect(),
        ..model
    };
    let app = router(model, &until_full(8)).unwrap();
    // One batch of both: it panics, each runs alone, only the bad one fails.
    let bad = request(5, 1, Some(1e9));
    let (ok, failed) = tokio::join!(infer(&app, good.clone()), infer(&app, bad));
    assert_eq!(ok.0, StatusCode::OK, "{ok:?}");
    assert_eq!(logits(&ok.1), want);
    assert_eq!(failed.0, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        failed.1["error"].as_str().unwrap().contains("panicked"),
        "{failed:?}"
    );
    // The server goes on.
    let (again, one) = tokio::join!(infer(&app, good.clone()), infer(&app, request(9, 1, None)));
    assert_eq!((again.0, one.0), (StatusCode::OK, StatusCode::OK));
    assert_eq!(logits(&again.1), want);
    let text = metrics(&app).await;
    assert_eq!(
        metric(
            &text,
            "nv_inference_request_failure{model=\"dlrm\",reason=\"BACKEND\"}"
        ),
        Some(1.0),
        "{text}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A model that tells when it starts a batch and waits to be let go.
struct Gated {
    inner: Box<dyn Scorer>,
    started: mpsc::Sender<()>,
    go: Mutex<mpsc::Receiver<()>>,
}

impl Scorer for Gated {
    fn score(&mut self, batch: &Batch) -> Result<Vec<Column>, ServeError> {
        let _ = self.started.send(());
        let _ = self.go.lock().unwrap().recv();
        self.inner.score(batch)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_sheds_and_a_late_request_is_dropped() {
    let (dir, path) = checkpoint_in("shed", 4);
    let model = ServedModel::open(&path, "dlrm", &limits(1)).unwrap();
    let (started, running) = mpsc::channel();
    let (go, gate) = mpsc::channel();
    let inner = model.instances.into_iter().next().unwrap();
    let model = ServedModel {
        instances: vec![Box::new(Gated {
            inner,
            started,
            go: Mutex::new(gate),
        })],
        ..model
    };
    let app = router(model, &until_full(2)).unwrap();
    // The first request runs (a batch of 1 is full) and holds the model.
    let first = tokio::spawn({
        let app = app.clone();
        async move { infer(&app, request(0, 1, None)).await }
    });
    tokio::task::spawn_blocking(move || running.recv().unwrap())
        .await
        .unwrap();
    // The second queues behind it, with a deadline of 1 us.
    let mut late = request(1, 1, None);
    late["parameters"] = json!({"timeout": 1});
    let second = tokio::spawn({
        let app = app.clone();
        async move { infer(&app, late).await }
    });
    // Two held (the first on the model, the second queued): a third is
    // shed at once.
    eventually(&app, "the second request's arrival", |m| {
        metric(m, "nv_inference_pending_request_count") == Some(2.0)
    })
    .await;
    let shed = infer(&app, request(2, 1, None)).await;
    assert_eq!(shed.0, StatusCode::SERVICE_UNAVAILABLE, "{shed:?}");
    assert!(shed.1["error"]
        .as_str()
        .unwrap()
        .contains("--max-queue-size"));
    go.send(()).unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.0, StatusCode::OK, "{first:?}");
    let second = second.await.unwrap();
    assert_eq!(second.0, StatusCode::SERVICE_UNAVAILABLE, "{second:?}");
    assert!(second.1["error"].as_str().unwrap().contains("timeout"));
    let text = metrics(&app).await;
    let failures = |reason: &str| {
        let name = format!("nv_inference_request_failure{{model=\"dlrm\",reason=\"{reason}\"}}");
        metric(&text, &name)
    };
    assert_eq!(failures("REJECTED"), Some(1.0), "{text}");
    assert_eq!(failures("TIMEOUT"), Some(1.0), "{text}");
    drop(go);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A model whose batch finishes only once another batch runs beside it
/// (or, after 20 s alone, fails): proof that instances run side by side.
struct Together {
    inner: Box<dyn Scorer>,
    running: std::sync::Arc<(Mutex<usize>, std::sync::Condvar)>,
}

impl Scorer for Together {
    fn score(&mut self, batch: &Batch) -> Result<Vec<Column>, ServeError> {
        let (count, arrived) = &*self.running;
        let mut count = count.lock().unwrap();
        *count += 1;
        arrived.notify_all();
        let (count, waited) = arrived
            .wait_timeout_while(count, Duration::from_secs(20), |n| *n < 2)
            .unwrap();
        drop(count);
        match waited.timed_out() {
            true => Err(ServeError::Internal("this batch ran alone".into())),
            false => self.inner.score(batch),
        }
    }
}

/// `model`'s instances, each batch of which runs only beside another.
fn together(model: ServedModel) -> ServedModel {
    let running = std::sync::Arc::new((Mutex::new(0), std::sync::Condvar::new()));
    ServedModel {
        instances: (model.instances.into_iter())
            .map(|inner| {
                let running = std::sync::Arc::clone(&running);
                Box::new(Together { inner, running }) as Box<dyn Scorer>
            })
            .collect(),
        ..model
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_left_out_of_a_batch_wakes_an_idle_instance() {
    let (dir, path) = checkpoint_in("wake", 8);
    let options = ModelOptions {
        instances: 2,
        ..limits(4)
    };
    let model = together(ServedModel::open(&path, "dlrm", &options).unwrap());
    let mut serve = until_full(8);
    serve.batching.threads = Some(2);
    let app = router(model, &serve).unwrap();
    // 2 samples first: an instance forms a batch of them and waits out the
    // queue delay (600 s) for more.
    let first = tokio::spawn({
        let app = app.clone();
        async move { infer(&app, request(0, 2, None)).await }
    });
    eventually(&app, "the first request queued", |m| {
        metric(m, "nv_inference_pending_request_count") == Some(1.0)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await; // decoded and queued
                                                          // 4 more cannot join it (a batch holds 4): that batch closes, and the
                                                          // idle instance must take these at once (a full batch), not leave them
                                                          // queued behind it; each batch here finishes only beside the other.
    let second = infer(&app, request(2, 4, None)).await;
    let first = first.await.unwrap();
    assert_eq!(
        (first.0, second.0),
        (StatusCode::OK, StatusCode::OK),
        "{first:?} {second:?}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_run_batches_side_by_side_and_reload_together() {
    let (dir, path) = checkpoint_in("instances", 7);
    let (first, second) = (request(0, 4, None), request(4, 4, None));
    let mut reference = ServedModel::open(&path, "dlrm", &limits(4)).unwrap();
    let want = [
        direct(&mut reference, &first),
        direct(&mut reference, &second),
    ];
    let options = ModelOptions {
        instances: 2,
        ..limits(4)
    };
    let model = together(ServedModel::open(&path, "dlrm", &options).unwrap());
    assert_eq!(model.instances.len(), 2);
    let serve = ServeOptions {
        reload: Some(ReloadOptions {
            checkpoint: path.clone(),
            poll: Duration::from_millis(10),
            model: options.clone(),
            serving: identity(&path).unwrap(),
        }),
        ..ServeOptions::default()
    };
    let app = router(model, &serve).unwrap();
    // Each request fills a batch of 4: one instance each, at once.
    let (a, b) = tokio::join!(infer(&app, first.clone()), infer(&app, second.clone()));
    assert_eq!((a.0, b.0), (StatusCode::OK, StatusCode::OK), "{a:?} {b:?}");
    assert_eq!([logits(&a.1), logits(&b.1)], want);

    // A new checkpoint: both instances serve it once version 2 is reported.
    std::thread::sleep(Duration::from_millis(20)); // a later modification time
    checkpoint(&path, 8);
    let mut reloaded = ServedModel::open(&path, "dlrm", &limits(4)).unwrap();
    let want = [
        direct(&mut reloaded, &first),
        direct(&mut reloaded, &second),
    ];
    eventually(&app, "the reload", |m| {
        metric(m, "ember_model_version") == Some(2.0)
    })
    .await;
    for _ in 0..3 {
        let (a, b) = tokio::join!(infer(&app, first.clone()), infer(&app, second.clone()));
        assert_eq!((a.0, b.0), (StatusCode::OK, StatusCode::OK), "{a:?} {b:?}");
        assert_eq!(
            (&a.1["model_version"], &b.1["model_version"]),
            (&json!("2"), &json!("2"))
        );
        assert_eq!([logits(&a.1), logits(&b.1)], want);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Polls until `done` holds (a wait for the server's own thread, not a
/// timing figure); fails after a minute.
async fn eventually(app: &Router, what: &str, done: impl Fn(&str) -> bool) {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let text = metrics(app).await;
        if done(&text) {
            return;
        }
        assert!(Instant::now() < give_up, "{what} never happened:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_reload_swaps_checkpoints_and_refuses_a_broken_one() {
    let (dir, path) = checkpoint_in("reload", 5);
    let body = request(0, 4, None);
    let mut first = ServedModel::open(&path, "dlrm", &limits(8)).unwrap();
    let want_first = direct(&mut first, &body);
    let serving = identity(&dir).unwrap();
    let model = ServedModel::open(&dir, "dlrm", &limits(8)).unwrap();
    let options = ServeOptions {
        reload: Some(ReloadOptions {
            checkpoint: dir.clone(),
            poll: Duration::from_millis(10),
            model: limits(8),
            serving,
        }),
        ..ServeOptions::default()
    };
    let app = router(model, &options).unwrap();
    let (status, answer) = infer(&app, body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(
        (logits(&answer), &answer["model_version"]),
        (want_first, &json!("1"))
    );

    // A new checkpoint in the directory: loaded and served as version 2.
    std::thread::sleep(Duration::from_millis(20)); // a later modification time
    checkpoint(&path, 6);
    let want_second = direct(
        &mut ServedModel::open(&path, "dlrm", &limits(8)).unwrap(),
        &body,
    );
    assert_ne!(want_second, direct(&mut first, &body));
    eventually(&app, "the reload", |m| {
        metric(m, "ember_model_version") == Some(2.0)
    })
    .await;
    let (status, answer) = infer(&app, body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(
        (logits(&answer), &answer["model_version"]),
        (want_second.clone(), &json!("2"))
    );
    let (_, metadata) = get(&app, "/v2/models/dlrm").await;
    assert_eq!(metadata["versions"], json!(["2"]));
    let (status, _) = get(&app, "/v2/models/dlrm/versions/1").await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // A broken one is refused; version 2 serves on.
    std::thread::sleep(Duration::from_millis(20));
    let temp = dir.join("broken.tmp");
    std::fs::write(&temp, b"not a checkpoint").unwrap();
    std::fs::rename(&temp, &path).unwrap();
    eventually(&app, "the refusal", |m| {
        metric(m, "ember_model_reload_failures_total") == Some(1.0)
    })
    .await;
    let (status, answer) = infer(&app, body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(
        (logits(&answer), &answer["model_version"]),
        (want_second, &json!("2"))
    );
    let text = metrics(&app).await;
    assert_eq!(metric(&text, "ember_model_reloads_total"), Some(1.0));
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_the_protocols_json_object() {
    let (dir, path) = checkpoint_in("errors", 7);
    let model = ServedModel::open(&path, "dlrm", &limits(8)).unwrap();
    let options = ServeOptions {
        max_request_bytes: 1024,
        ..ServeOptions::default()
    };
    let app = router(model, &options).unwrap();
    let json_error = |(status, body): (StatusCode, Value), want: StatusCode, says: &str| {
        assert_eq!(status, want, "{body}");
        let error = body["error"].as_str().unwrap_or_else(|| panic!("{body}"));
        assert!(error.contains(says), "{error}");
    };
    json_error(get(&app, "/v3/nowhere").await, StatusCode::NOT_FOUND, "/v2");
    json_error(
        get(&app, "/v2/models/dlrm/infer").await,
        StatusCode::METHOD_NOT_ALLOWED,
        "Method Not Allowed",
    );
    let big = serde_json::to_vec(&request(0, 8, None)).unwrap();
    let small = serde_json::to_vec(&request(0, 1, None)).unwrap();
    assert!(
        small.len() < 1024 && big.len() > 1024,
        "{} {}",
        small.len(),
        big.len()
    );
    json_error(
        post(&app, "/v2/models/dlrm/infer", big, &[]).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "length limit",
    );
    let gzip = [("content-encoding", "gzip")];
    json_error(
        post(&app, "/v2/models/dlrm/infer", small.clone(), &gzip).await,
        StatusCode::BAD_REQUEST,
        "Content-Encoding",
    );
    let mut twice = request(0, 1, None);
    twice["outputs"] = json!([{"name": "logit"}, {"name": "logit"}]);
    json_error(
        infer(&app, twice).await,
        StatusCode::BAD_REQUEST,
        "asked for twice",
    );
    let mut classes = request(0, 1, None);
    classes["outputs"] = json!([{"name": "probability", "parameters": {"classification": 2}}]);
    json_error(
        infer(&app, classes).await,
        StatusCode::BAD_REQUEST,
        "classification",
    );
    let mut timeout = request(0, 1, None);
    timeout["parameters"] = json!({"timeout": -3});
    json_error(
        infer(&app, timeout).await,
        StatusCode::BAD_REQUEST,
        "timeout",
    );
    let (status, _) = infer(&app, request(0, 1, None)).await;
    assert_eq!(status, StatusCode::OK);
    let text = metrics(&app).await;
    let bad = "nv_inference_request_failure{model=\"dlrm\",reason=\"BAD_REQUEST\"}";
    assert_eq!(metric(&text, bad), Some(4.0), "{text}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `body`'s inputs as a gRPC request: raw little-endian bytes (as
/// tritonclient sends them), or typed contents.
fn grpc_request(body: &Value, raw: bool) -> ModelInferRequest {
    let mut request = ModelInferRequest {
        model_name: "dlrm".into(),
        ..Default::default()
    };
    for input in body["inputs"].as_array().unwrap() {
        let data = input["data"].as_array().unwrap();
        let mut contents = InferTensorContents::default();
        let bytes: Vec<u8> = match input["datatype"].as_str().unwrap() {
            "FP32" => {
                contents.fp32_contents = data.iter().map(|v| v.as_f64().unwrap() as f32).collect();
                contents
                    .fp32_contents
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect()
            }
            _ => {
                contents.int64_contents = data.iter().map(|v| v.as_i64().unwrap()).collect();
                contents
                    .int64_contents
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect()
            }
        };
        request.inputs.push(InferInputTensor {
            name: input["name"].as_str().unwrap().into(),
            datatype: input["datatype"].as_str().unwrap().into(),
            shape: serde_json::from_value(input["shape"].clone()).unwrap(),
            contents: (!raw).then_some(contents),
            ..Default::default()
        });
        if raw {
            request.raw_input_contents.push(bytes);
        }
    }
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_answers_as_http_does_and_refuses_with_statuses() {
    let (dir, path) = checkpoint_in("grpc", 8);
    let model = ServedModel::open(&path, "dlrm", &limits(8)).unwrap();
    let server = Server::start(model, &ServeOptions::default()).unwrap();
    let (app, grpc) = (server.http(), GrpcService::new(&server));
    let body = request(3, 5, None);
    let (status, answer) = infer(&app, body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let want: Vec<u8> = logits(&answer)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    for raw in [true, false] {
        let mut request = grpc_request(&body, raw);
        request.id = "r7".into();
        let response = grpc
            .model_infer(tonic::Request::new(request))
            .await
            .unwrap();
        let response = response.into_inner();
        assert_eq!(
            (response.id.as_str(), response.model_version.as_str()),
            ("r7", "1")
        );
        let names: Vec<&str> = response.outputs.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["logit", "probability"]);
        assert_eq!(response.outputs[0].shape, [5]);
        // Bitwise: the same samples in a batch of their own.
        assert_eq!(response.raw_output_contents[0], want);
    }
    let ready = |name: &str, version: &str| ModelReadyRequest {
        name: name.into(),
        version: version.into(),
    };
    let is_ready = |r| async {
        grpc.model_ready(tonic::Request::new(r))
            .await
            .unwrap()
            .into_inner()
            .ready
    };
    assert!(is_ready(ready("dlrm", "")).await && is_ready(ready("dlrm", "1")).await);
    assert!(!is_ready(ready("dlrm", "2")).await && !is_ready(ready("other", "")).await);
    let metadata = grpc
        .model_metadata(tonic::Request::new(ModelMetadataRequest {
            name: "dlrm".into(),
            version: String::new(),
        }))
        .await
        .unwrap()
        .into_inner();
    let (_, http_metadata) = get(&app, "/v2/models/dlrm").await;
    let names: Vec<&str> = metadata.inputs.iter().map(|t| t.name.as_str()).collect();
    let http_names: Vec<&str> = (http_metadata["inputs"].as_array().unwrap().iter())
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, http_names);

    let refused = |request: ModelInferRequest| async {
        match grpc.model_infer(tonic::Request::new(request)).await {
            Ok(_) => panic!("answered a bad request"),
            Err(status) => (status.code(), status.message().to_string()),
        }
    };
    let mut misplaced = grpc_request(&body, false);
    let lengths = misplaced.inputs[1].contents.as_mut().unwrap();
    lengths.int_contents = lengths.int64_contents.iter().map(|&v| v as i32).collect();
    lengths.int64_contents.clear();
    let (code, message) = refused(misplaced).await;
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        message.contains("input 'cat_0.lengths': INT64 values go in int64_contents"),
        "{message}"
    );
    let mut short = grpc_request(&body, true);
    short.raw_input_contents.pop();
    let (code, message) = refused(short).await;
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(
        message.contains("raw_input_contents holds 6 tensors for 7 inputs"),
        "{message}"
    );
    let mut cut = grpc_request(&body, true);
    cut.raw_input_contents[0].pop();
    let (code, message) = refused(cut).await;
    assert_eq!(code, tonic::Code::InvalidArgument);
    assert!(message.contains("input 'dense'"), "{message}");
    let mut other = grpc_request(&body, true);
    other.model_name = "other".into();
    assert_eq!(refused(other).await.0, tonic::Code::NotFound);
    let text = metrics(&app).await;
    assert_eq!(
        metric(&text, "nv_inference_request_success{model=\"dlrm\"}"),
        Some(3.0),
        "{text}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
