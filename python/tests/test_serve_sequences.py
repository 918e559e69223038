"""Sequence models behind `ember serve`, asked by Triton's own client
(tritonclient, HTTP and gRPC): a SASRec checkpoint answers each history's
top items and an HSTU ranking checkpoint its candidates' logits, bitwise
what `ember predict` writes for the same histories in one batch."""

import re
import subprocess

import numpy as np
import pytest

from conftest import require
from test_serve import ember_bin

pa = require("pyarrow")
pq = require("pyarrow.parquet")
httpclient = require("tritonclient.http")
grpcclient = require("tritonclient.grpc")

USERS = 12
TOP_K = 5


def run(*args):
    done = subprocess.run([ember_bin(), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done


def histories_arrays(table, actions):
    """The histories file's rows as the server's inputs."""
    items = table["items"].to_pylist()
    arrays = {
        "history.lengths": np.array([len(i) for i in items], np.int64),
        "history.values": np.concatenate([np.array(i, np.int64) for i in items]),
        "history.timestamps": np.concatenate(
            [np.array(t, np.int64) for t in table["timestamps"].to_pylist()]),
    }
    if actions:
        arrays["history.actions"] = np.concatenate(
            [np.array(a, np.int64) for a in table["actions"].to_pylist()])
    return arrays


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-sequences")
    run("ingest", "synthetic-histories", "--output", str(tmp / "all.parquet"), "--users", "300",
        "--items", "120", "--topics", "6", "--max-len", "20")
    table = pq.read_table(tmp / "all.parquet")
    # The request's histories: long enough for 3 candidates.
    long = table.filter(pa.compute.greater_equal(pa.compute.list_value_length(table["items"]), 6))
    pq.write_table(long.slice(0, USERS), tmp / "rows.parquet")
    return tmp


def serve(checkpoint, *extra):
    server = subprocess.Popen([ember_bin(), "serve", "--checkpoint", str(checkpoint),
                               "--model-name", "seq", "--http-port", "0", "--grpc-port", "0",
                               "--max-batch-size", str(USERS), *extra],
                              stderr=subprocess.PIPE, text=True)
    line = server.stderr.readline()
    match = re.search(r"on http://([\d.]+:\d+)/v2 and grpc://([\d.]+:\d+)", line)
    assert match, line
    return server, match.group(1), match.group(2)


def ask(address, grpc_address, arrays, outputs):
    """The outputs of one request of `arrays`: over HTTP (binary and JSON)
    and gRPC, which must agree bitwise."""
    answers = []
    http = httpclient.InferenceServerClient(address)
    for binary in (True, False):
        inputs = []
        for name, a in arrays.items():
            item = httpclient.InferInput(name, list(a.shape), "INT64")
            item.set_data_from_numpy(a, binary_data=binary)
            inputs.append(item)
        wanted = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs]
        result = http.infer("seq", inputs, outputs=wanted)
        answers.append({o: result.as_numpy(o) for o in outputs})
    grpc = grpcclient.InferenceServerClient(grpc_address)
    inputs = []
    for name, a in arrays.items():
        item = grpcclient.InferInput(name, list(a.shape), "INT64")
        item.set_data_from_numpy(a)
        inputs.append(item)
    result = grpc.infer("seq", inputs)
    answers.append({o: result.as_numpy(o) for o in outputs})
    for other in answers[1:]:
        for o in outputs:
            assert other[o].dtype == answers[0][o].dtype
            assert other[o].tobytes() == answers[0][o].tobytes(), o
    return answers[0], http.get_model_metadata("seq")


def stop(server):
    server.terminate()
    assert server.wait(timeout=30) == 0


def test_sasrec_serves_ember_predicts_top_items(data):
    run("train", "--model", "sasrec", "--data", str(data / "all.parquet"), "--epochs", "1",
        "--max-seq-len", "20", "--embedding-dim", "16", "--mini-batch-size", "64",
        "--checkpoint-dir", str(data / "sasrec"))
    run("predict", "--checkpoint", str(data / "sasrec"), "--data", str(data / "rows.parquet"),
        "--output", str(data / "sasrec.parquet"), "--mini-batch-size", str(USERS),
        "--top-k", str(TOP_K))
    predicted = pq.read_table(data / "sasrec.parquet")
    assert predicted.num_rows == USERS
    assert predicted.schema.field("items").type == pa.list_(pa.int64(), TOP_K)

    server, address, grpc_address = serve(data / "sasrec", "--top-k", str(TOP_K))
    try:
        rows = pq.read_table(data / "rows.parquet")
        got, metadata = ask(address, grpc_address, histories_arrays(rows, False),
                            ["items", "scores"])
        assert metadata["platform"] == "ember_sasrec"
        assert [o["shape"] for o in metadata["outputs"]] == [[-1, TOP_K], [-1, TOP_K]]
        items = np.array(predicted["items"].to_pylist(), np.int64)
        scores = np.array(predicted["scores"].to_pylist(), np.float32)
        assert got["items"].shape == (USERS, TOP_K)
        assert np.array_equal(got["items"], items)
        assert got["scores"].tobytes() == scores.tobytes()
        # Best first.
        assert (np.diff(got["scores"], axis=1) <= 0).all()
    finally:
        stop(server)


def test_hstu_ranking_serves_ember_predicts_candidate_logits(data):
    run("train", "--model", "hstu-ranking", "--data", str(data / "all.parquet"), "--epochs", "1",
        "--max-seq-len", "20", "--embedding-dim", "16", "--num-heads", "2",
        "--num-candidates", "3", "--mini-batch-size", "64",
        "--checkpoint-dir", str(data / "ranking"))
    run("predict", "--checkpoint", str(data / "ranking"), "--data", str(data / "rows.parquet"),
        "--output", str(data / "ranking.parquet"), "--mini-batch-size", str(USERS))
    predicted = pq.read_table(data / "ranking.parquet")
    logit = np.array(predicted["logit"].to_pylist(), np.float32)
    assert logit.shape == (USERS, 3 * 2)

    server, address, grpc_address = serve(data / "ranking")
    try:
        rows = pq.read_table(data / "rows.parquet")
        got, metadata = ask(address, grpc_address, histories_arrays(rows, True),
                            ["logit", "probability"])
        assert "history.actions" in [i["name"] for i in metadata["inputs"]]
        assert got["logit"].shape == (USERS, 3, 2)
        assert got["logit"].reshape(USERS, 6).tobytes() == logit.tobytes()
        probability = np.array(predicted["probability"].to_pylist(), np.float32)
        assert got["probability"].reshape(USERS, 6).tobytes() == probability.tobytes()
    finally:
        stop(server)
