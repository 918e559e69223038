"""Writes the fixture `ember ingest criteo --multi-hot` is checked against:
the 200 real Criteo rows of tests/data/criteo_sample.csv expanded to MLPerf
DLRMv2's multi-hot ids by the MLPerf reference's own code: the one-hot to
multi-hot tables of `torchrec_dlrm/multi_hot.py`'s `Multihot` (drawn once
from NumPy's legacy generator seeded 0) and the lookup of
`scripts/materialize_synthetic_multihot_dataset.py` (`table[id % rows]`),
at small table sizes. The reference is not part of Ember: pass its
directory.

Usage (the peer environment: torch, torchrec, numpy):
    git clone https://github.com/facebookresearch/dlrm   # commit 090956e
    target/python-env/bin/python scripts/mlperf_multi_hot_fixture.py \
        dlrm/torchrec_dlrm tests/data/criteo_multi_hot.json
"""

import csv
import json
import sys

import torch

REFERENCE, OUTPUT = sys.argv[1], sys.argv[2]
sys.path.insert(0, REFERENCE)
from multi_hot import Multihot  # noqa: E402  (the reference's own class)

SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
# Small tables (MLPerf's own are up to 40M rows), a few below their bag size.
ROWS = [997, 390, 172, 74, 202, 3, 71, 15, 63, 1009, 306, 405, 10, 220, 119, 155, 4, 97, 14,
        2003, 1999, 401, 590, 129, 108, 36]

multihot = Multihot(multi_hot_sizes=SIZES, num_embeddings_per_feature=ROWS, batch_size=1,
                    collect_freqs_stats=False, dist_type="uniform")

with open("tests/data/criteo_sample.csv") as f:
    rows = list(csv.reader(f))[1:]
assert len(rows) == 200
features = []
for j, (table, n) in enumerate(zip(multihot.multi_hot_tables_l, ROWS)):
    column = []
    for row in rows:
        raw = row[14 + j]
        if raw == "":
            column.append(None)  # Ember keeps a missing id missing
            continue
        ids = torch.tensor([int(raw, 16) % n])
        column.append(torch.nn.functional.embedding(ids, table)[0].tolist())
    features.append(column)
with open(OUTPUT, "w") as f:
    json.dump({"reference": "facebookresearch/dlrm 090956e torchrec_dlrm/multi_hot.py",
               "sizes": SIZES, "rows": ROWS, "features": features}, f)
print(OUTPUT)
