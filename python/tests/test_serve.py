"""`ember serve` spoken to by Triton's own client (tritonclient, HTTP and
gRPC): its health, metadata and inference endpoints, scores bitwise those of `ember
predict` on the same rows, concurrent requests joined into batches, the
Prometheus metrics read by Prometheus' own parser, clear 400s for bad
requests, and a clean stop on SIGTERM."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import require
from ember.data import ParquetLoader
from ember.train import DLRM, Trainer

from test_train import NUM_CAT, tables, write_clicks

pa = require("pyarrow")
pq = require("pyarrow.parquet")
httpclient = require("tritonclient.http")
grpcclient = require("tritonclient.grpc")
require("mlperf_loadgen")
prometheus_parser = require("prometheus_client.parser")

ROWS = 64


def ember_bin():
    path = os.environ.get("EMBER_BIN", "target/debug/ember")
    if not os.path.exists(path):
        why = f"no ember binary at {path} (cargo build --bin ember, or set EMBER_BIN)"
        if os.environ.get("EMBER_REQUIRE_TORCHREC") == "1":
            pytest.fail(why)  # scripts/test-python builds it: the suite runs whole
        pytest.skip(why)
    return path


def raw_rows(path, seed):
    """Criteo-schema rows with what serving must transform: negative and
    large counts, raw ids far beyond the tables' rows, and missing values."""
    rng = np.random.default_rng(seed)
    columns = {"label": pa.array(rng.integers(0, 2, ROWS), pa.int8())}
    for j in range(13):
        values = rng.integers(-2, 5000, ROWS).tolist()
        values[j] = None
        columns[f"int_{j}"] = pa.array(values, pa.int32())
    for j in range(NUM_CAT):
        ids = rng.integers(-10**12, 10**12, ROWS).tolist()
        ids[2 * j + 1] = None
        columns[f"cat_{j}"] = pa.array(ids, pa.int64())
    table = pa.table(columns)
    path.mkdir()
    pq.write_table(table, path / "part-0.parquet")
    return table


def arrays_of(table):
    """The rows as the model's inputs: raw dense values (missing: 0, as the
    loader reads them), and each feature's lengths and ids (missing: an
    empty bag)."""
    dense = np.stack([np.nan_to_num(table[f"int_{j}"].to_numpy(zero_copy_only=False)
                                    .astype(np.float64)) for j in range(13)], axis=1)
    arrays = {"dense": dense.astype(np.float32)}
    for j in range(NUM_CAT):
        ids = table[f"cat_{j}"].to_pylist()
        arrays[f"cat_{j}.lengths"] = np.array([0 if i is None else 1 for i in ids], np.int64)
        arrays[f"cat_{j}.values"] = np.array([i for i in ids if i is not None], np.int64)
    return arrays


def datatype(array):
    return "FP32" if array.dtype == np.float32 else "INT64"


def inputs_of(table, binary):
    out = []
    for name, array in arrays_of(table).items():
        item = httpclient.InferInput(name, list(array.shape), datatype(array))
        item.set_data_from_numpy(array, binary_data=binary)
        out.append(item)
    return out


def grpc_inputs_of(table):
    out = []
    for name, array in arrays_of(table).items():
        item = grpcclient.InferInput(name, list(array.shape), datatype(array))
        item.set_data_from_numpy(array)
        out.append(item)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A trained checkpoint, `ember predict`'s scores of the raw rows, and
    `ember serve` of the checkpoint on a free loopback port."""
    tmp = tmp_path_factory.mktemp("serve")
    model = DLRM(tables(), 13, [16, 8], [16, 1], seed=3)
    train = ParquetLoader([write_clicks(tmp / "train", 2048, 1)], 256, tables=tables())
    Trainer(epochs=1, checkpoint_dir=tmp / "ckpt").fit(model, train)
    table = raw_rows(tmp / "rows", 7)
    subprocess.run([ember_bin(), "predict", "--checkpoint", str(tmp / "ckpt"), "--data",
                    str(tmp / "rows"), "--output", str(tmp / "scores.parquet"),
                    "--mini-batch-size", str(ROWS)], check=True, capture_output=True)
    scores = pq.read_table(tmp / "scores.parquet")
    server = subprocess.Popen([ember_bin(), "serve", "--checkpoint", str(tmp / "ckpt"),
                               "--http-port", "0", "--grpc-port", "0",
                               "--max-batch-size", str(ROWS), "--max-queue-delay-us", "2000"],
                              stderr=subprocess.PIPE, text=True)
    line = server.stderr.readline()
    match = re.search(r"on http://([\d.]+:\d+)/v2 and grpc://([\d.]+:\d+)", line)
    assert match, line
    yield match.group(1), table, scores, server, match.group(2)
    if server.poll() is None:
        server.kill()
        server.wait()


def test_tritonclient_gets_ember_predicts_scores(served):
    address, table, scores, *_ = served
    client = httpclient.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("dlrm")
    metadata = client.get_model_metadata("dlrm")
    names = [i["name"] for i in metadata["inputs"]]
    assert names[:3] == ["dense", "cat_0.lengths", "cat_0.values"]
    assert [o["name"] for o in metadata["outputs"]] == ["logit", "probability"]
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    logit = scores["logit"].to_numpy()
    probability = scores["probability"].to_numpy()
    for binary in (True, False):
        outputs = [httpclient.InferRequestedOutput(name, binary_data=binary)
                   for name in ("logit", "probability")]
        result = client.infer("dlrm", inputs_of(table, binary), outputs=outputs,
                              request_id="r1")
        # Bitwise: the same rows in the same batch, the same transforms.
        assert result.as_numpy("logit").tobytes() == logit.tobytes()
        assert result.as_numpy("probability").tobytes() == probability.tobytes()
        assert result.get_response()["id"] == "r1"
    # Without outputs named: both, as binary (tritonclient asks so).
    result = client.infer("dlrm", inputs_of(table, True))
    assert result.as_numpy("logit").tobytes() == logit.tobytes()


def post(address, path, body, headers=None):
    request = urllib.request.Request(f"http://{address}{path}", data=body,
                                     headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_bad_requests_get_clear_errors_and_the_server_goes_on(served):
    address, table, scores, *_ = served
    good = {"inputs": [{"name": name, "shape": list(a.shape), "datatype": datatype(a),
                        "data": a.flatten().tolist()} for name, a in arrays_of(table).items()]}

    def error(body, path="/v2/models/dlrm/infer", status=400, headers=None):
        code, text = post(address, path, json.dumps(body).encode()
                          if not isinstance(body, bytes) else body, headers)
        assert code == status, (code, text)
        return json.loads(text)["error"]

    wrong_name = json.loads(json.dumps(good))
    wrong_name["inputs"][1]["name"] = "cat_9.lengths"
    assert "input 'cat_9.lengths' is not an input of model 'dlrm'" in error(wrong_name)
    missing = {"inputs": good["inputs"][:-1]}
    assert "input 'cat_3.values' is missing" in error(missing)
    short = json.loads(json.dumps(good))
    short["inputs"][2]["shape"] = [5]
    assert "input 'cat_0.values'" in error(short)
    wrong_type = json.loads(json.dumps(good))
    wrong_type["inputs"][0]["datatype"] = "BYTES"
    assert "input 'dense': datatype BYTES" in error(wrong_type)
    big = json.loads(json.dumps(good))
    big["inputs"][0]["shape"] = [ROWS * 2, 13]
    assert re.search("more than|a batch of", error(big))
    assert "not an inference request" in error(b"{not json")
    assert "beyond the body" in error(b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert "is not served here" in error(good, "/v2/models/other/infer", 404)
    assert "no version '7'" in error(good, "/v2/models/dlrm/versions/7/infer", 404)
    # And the server still answers, with the same scores.
    code, text = post(address, "/v2/models/dlrm/infer", json.dumps(good).encode())
    assert code == 200
    out = {o["name"]: o for o in json.loads(text)["outputs"]}
    assert np.array(out["logit"]["data"], np.float32).tobytes() == \
        scores["logit"].to_numpy().tobytes()


def scraped(address):
    """The server's /metrics, through prometheus_client's parser: every
    sample by its name and labels (the parser names a counter's sample
    `<name>_total`, as OpenMetrics does)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model"))
            assert sample.labels["model"] == "dlrm", sample
            samples[(sample.name, labels)] = sample.value
    return samples


def test_concurrent_requests_are_batched_and_counted(served):
    address, table, scores, *_ = served
    before = scraped(address)
    rows = [table.slice(i, 1) for i in range(ROWS)]

    def one(row):
        # One client per thread: tritonclient's HTTP client is not shared
        # across threads.
        client = httpclient.InferenceServerClient(address)
        return client.infer("dlrm", inputs_of(row, True)).as_numpy("logit")

    with ThreadPoolExecutor(16) as pool:
        logits = np.concatenate(list(pool.map(one, rows)))
    # Batched with other requests, a sample's score may differ from the one
    # it got in predict's batch in the last bits (the dense layers' sums).
    np.testing.assert_allclose(logits, scores["logit"].to_numpy(), rtol=1e-5, atol=1e-6)
    after = scraped(address)

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert grew("nv_inference_request_success_total") == ROWS
    assert grew("nv_inference_count_total") == ROWS
    # 16 clients at once with a 2 ms queue delay: requests shared batches.
    assert grew("nv_inference_exec_count_total") < ROWS
    assert grew("ember_batch_size_count") == grew("nv_inference_exec_count_total")
    assert grew("ember_batch_size_sum") == ROWS
    assert grew("ember_request_duration_seconds_count") == ROWS
    assert after[("nv_inference_pending_request_count", ())] == 0
    assert after[("ember_model_version", ())] == 1
    assert grew("nv_inference_queue_duration_us_total") > 0
    assert grew("nv_inference_compute_infer_duration_us_total") > 0


def test_tritonclient_grpc_gets_the_same_scores(served):
    address, table, scores, _, grpc_address = served
    client = grpcclient.InferenceServerClient(grpc_address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("dlrm") and not client.is_model_ready("other")
    metadata = client.get_model_metadata("dlrm", as_json=True)
    http = httpclient.InferenceServerClient(address).get_model_metadata("dlrm")
    # protobuf's JSON writes int64 as strings.
    assert metadata["inputs"] == [{**i, "shape": [str(d) for d in i["shape"]]}
                                  for i in http["inputs"]]
    outputs = [grpcclient.InferRequestedOutput(name) for name in ("logit", "probability")]
    result = client.infer("dlrm", grpc_inputs_of(table), outputs=outputs, request_id="g1")
    # Bitwise: the same rows in the same batch as `ember predict`'s.
    assert result.as_numpy("logit").tobytes() == scores["logit"].to_numpy().tobytes()
    assert result.as_numpy("probability").tobytes() == \
        scores["probability"].to_numpy().tobytes()
    assert result.get_response().id == "g1"
    bad = grpc_inputs_of(table)
    bad[1] = grpcclient.InferInput("cat_9.lengths", [ROWS], "INT64")
    bad[1].set_data_from_numpy(np.zeros(ROWS, np.int64))
    with pytest.raises(grpcclient.InferenceServerException) as error:
        client.infer("dlrm", bad)
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'cat_9.lengths' is not an input of model 'dlrm'" in error.value.message()
    with pytest.raises(grpcclient.InferenceServerException) as error:
        client.infer("other", grpc_inputs_of(table))
    assert error.value.status() == "StatusCode.NOT_FOUND"


def test_the_load_test_drives_the_server_with_mlperf_loadgen(served, tmp_path):
    *_, grpc_address = served
    table = served[1]
    pq.write_table(table, tmp_path / "rows.parquet")
    out = tmp_path / "latency.json"
    run = subprocess.run([sys.executable, "scripts/serve_loadtest.py", "--grpc", grpc_address,
                          "--data", str(tmp_path / "rows.parquet"), "--rows-per-query", "8",
                          "--qps", "20,40", "--duration-s", "1", "--max-queries", "200",
                          "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["rows_per_query"] == 8 and result["target_latency_ms"] == 60
    assert [r["target_qps"] for r in result["rates"]] == [20, 40]
    for r in result["rates"]:
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"], r
        assert 0 < r["queries"] <= 200 and r["completed_samples_per_s"] > 0, r
        assert r["failed"] == 0, r


def test_sigterm_stops_the_server_cleanly(served):
    server = served[3]
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=30) == 0
