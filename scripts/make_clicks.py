#!/usr/bin/env python3
"""Writes a click log that is not Criteo-shaped, with pyarrow, for
`ember train --dataset-spec examples/data/clicks.spec.json` (docs/src/formats/
dataset-spec.md): a boolean label, float and int dense columns, a weighted
list<int64> history and a scalar item id sharing one table, and a user id.

    python3 scripts/make_clicks.py OUT_DIR [--rows N] [--files K] [--seed S]

The label follows a hidden logistic model of the features, so training on
it learns something (AUC well above 0.5).
"""
import argparse
import math
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq


def zipf(rng, n):
    """A power-law id in 0..n (a few ids carry most rows, as in click logs)."""
    return int(n ** rng.random()) - 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--row-group-size", type=int, default=2048)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    items, users = 5000, 1000
    item_effect = [rng.gauss(0, 1) for _ in range(items)]
    user_effect = [rng.gauss(0, 1) for _ in range(users)]
    os.makedirs(a.out, exist_ok=True)
    per_file = -(-a.rows // a.files)
    for f in range(a.files):
        n = min(per_file, a.rows - f * per_file)
        if n <= 0:
            break
        cols = {k: [] for k in ["clicked", "price", "score", "age", "history", "history_weights", "item", "user"]}
        for _ in range(n):
            price = rng.expovariate(1 / 20.0)
            score = rng.gauss(0, 1)
            age = rng.randrange(18, 80)
            item = zipf(rng, items)
            user = rng.randrange(users)
            hist = [zipf(rng, items) for _ in range(rng.randrange(6))]
            weights = [rng.uniform(0.1, 1.0) for _ in hist]
            hist_mean = sum(item_effect[h] * w for h, w in zip(hist, weights)) / max(len(hist), 1)
            logit = (item_effect[item] + user_effect[user] + hist_mean + 0.8 * score
                     - 0.02 * (age - 40) - 0.3 * math.log1p(price) + 0.5)
            cols["clicked"].append(rng.random() < 1 / (1 + math.exp(-logit)))
            cols["price"].append(price)
            # Some nulls, as real logs have: a missing score, a missing item.
            cols["score"].append(None if rng.random() < 0.05 else score)
            cols["age"].append(age)
            cols["history"].append(hist)
            cols["history_weights"].append(weights)
            cols["item"].append(None if rng.random() < 0.05 else item)
            cols["user"].append(user)
        table = pa.table(
            {
                "clicked": pa.array(cols["clicked"], pa.bool_()),
                "price": pa.array(cols["price"], pa.float64()),
                "score": pa.array(cols["score"], pa.float32()),
                "age": pa.array(cols["age"], pa.int64()),
                "history": pa.array(cols["history"], pa.list_(pa.int64())),
                "history_weights": pa.array(cols["history_weights"], pa.list_(pa.float32())),
                "item": pa.array(cols["item"], pa.int64()),
                "user": pa.array(cols["user"], pa.int64()),
            }
        )
        path = os.path.join(a.out, f"clicks-{f:05d}.parquet")
        tmp = os.path.join(a.out, f".clicks-{f:05d}.parquet.tmp")
        pq.write_table(table, tmp, row_group_size=a.row_group_size)
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
