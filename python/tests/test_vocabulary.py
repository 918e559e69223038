"""`ember ingest criteo --vocabulary-threshold T` against TorchRec's own
preprocessing: `BinaryCriteoUtils.tsv_to_npys` then `sparse_to_contiguous`
over the 200 real Criteo rows of tests/data, split into two day files (the
numbering runs across files in order). Every contiguous id must be
TorchRec's, and every table size its largest id plus one."""

import csv
import pathlib

import numpy as np
import pytest

from conftest import require
from test_metrics_torchrec import run

pq = require("pyarrow.parquet")
criteo = require("torchrec.datasets.criteo")

SAMPLE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "criteo_sample.csv"


def day_files(tmp_path):
    """The sample as raw Criteo day files: tab-separated, integers plain."""
    rows = list(csv.reader(open(SAMPLE)))[1:]
    plain = [[f[:-2] if f.endswith(".0") else f for f in r] for r in rows]
    days = []
    for k, part in enumerate((plain[:120], plain[120:])):
        path = tmp_path / f"day_{k}"
        path.write_text("".join("\t".join(r) + "\n" for r in part))
        days.append(path)
    return days


def torchrec_ids(days, tmp_path, threshold):
    """TorchRec's contiguous ids of each day, rows by 26 columns."""
    npys = tmp_path / f"npy{threshold}"
    npys.mkdir()
    sparse = []
    for day in days:
        stem = npys / day.name
        criteo.BinaryCriteoUtils.tsv_to_npys(
            str(day), f"{stem}_dense.npy", f"{stem}_sparse.npy", f"{stem}_labels.npy")
        sparse.append(f"{stem}_sparse.npy")
    criteo.BinaryCriteoUtils.sparse_to_contiguous(sparse, str(npys), threshold)
    return [np.load(npys / f"{day.name}_sparse_contig_freq.npy") for day in days]


@pytest.mark.parametrize("threshold,partitions", [(1, 1), (2, 1), (3, 1), (2, 5)])
def test_contiguous_ids_are_torchrecs(tmp_path, threshold, partitions):
    """Counted in memory, and spilled to partition files (5)."""
    days = day_files(tmp_path)
    want = torchrec_ids(days, tmp_path, threshold)
    out = tmp_path / f"out{threshold}"
    run("ingest", "criteo", *map(str, days), "--output", str(out),
        "--vocabulary-threshold", str(threshold), "--vocabulary-partitions", str(partitions))
    for day, ids in zip(days, want):
        table = pq.read_table(out / f"{day.name}-00000.parquet")
        got = np.stack([table.column(f"cat_{i}").to_numpy() for i in range(26)], axis=1)
        assert got.shape == ids.shape
        np.testing.assert_array_equal(got, ids, err_msg=day.name)
    import json
    info = json.loads((out / "_vocabulary.json").read_text())
    largest = np.concatenate(want).max(axis=0)
    assert info["num_embeddings_per_feature"] == [int(m) + 1 for m in largest]
    assert info["rows"] == 200
    assert info["partitions"] == partitions
    # The vocabulary files list each column's raw ids in contiguous order.
    voc = pq.read_table(out / "_vocabulary" / "cat_0.parquet").to_pydict()
    assert voc["id"] == list(range(2, 2 + len(voc["id"])))
    assert len(voc["id"]) == info["num_embeddings_per_feature"][0] - 2
