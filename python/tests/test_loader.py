"""Ember's Parquet loader from Python, on files pyarrow writes: the Criteo
schema and a spec of one's own, epochs, resumption, shuffles, errors."""

import math

import pytest
import torch

import ember
from ember import EmbeddingBagCollection, EmbeddingBagConfig
from ember.data import ParquetLoader
from ember.optim import RowWiseAdagrad

from conftest import require

pa = require("pyarrow")
pq = require("pyarrow.parquet")

ROWS = 10


def criteo_tables(rows=100):
    return [EmbeddingBagConfig(num_embeddings=rows, embedding_dim=4, name=f"t_cat_{j}",
                               feature_names=[f"cat_{j}"]) for j in range(26)]


@pytest.fixture
def criteo_dir(tmp_path):
    columns = {"label": pa.array([i % 2 for i in range(ROWS)], pa.int8())}
    columns.update({f"int_{j}": pa.array([i + j for i in range(ROWS)], pa.int32())
                    for j in range(13)})
    columns.update({f"cat_{j}": pa.array([i * 37 + j for i in range(ROWS)], pa.int64())
                    for j in range(26)})
    pq.write_table(pa.table(columns), tmp_path / "part-0.parquet", row_group_size=4)
    return tmp_path


def test_criteo_batches_hold_the_files_values(criteo_dir):
    loader = ParquetLoader([criteo_dir], batch_size=4, tables=criteo_tables())
    assert len(loader) == 3 and loader.num_dense == 13
    assert loader.keys() == [f"cat_{j}" for j in range(26)]
    batches = list(loader)
    assert [b[2].shape[0] for b in batches] == [4, 4, 2]
    dense = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[2] for b in batches])
    assert dense.dtype == torch.float32 and dense.shape == (ROWS, 13)
    expected = torch.tensor([[math.log1p(i + j) for j in range(13)] for i in range(ROWS)])
    torch.testing.assert_close(dense, expected)
    assert labels.tolist() == [float(i % 2) for i in range(ROWS)]
    # Ids key-major within a batch, reduced modulo the table's rows.
    kjt = batches[0][1]
    assert kjt.keys() == [f"cat_{j}" for j in range(26)] and kjt.stride() == 4
    values = kjt.values()
    assert values.dtype == torch.int64
    assert values[:4].tolist() == [(i * 37) % 100 for i in range(4)]
    assert values[4:8].tolist() == [(i * 37 + 1) % 100 for i in range(4)]
    assert kjt.lengths().tolist() == [1] * (26 * 4)
    assert kjt.weights_or_none() is None


def test_epochs_resume_and_shuffle(tmp_path):
    # 12 row groups of 2 rows, each row told apart by its first dense value.
    columns = {"label": pa.array([i % 2 for i in range(24)], pa.int8())}
    columns.update({f"int_{j}": pa.array([i * 100 + j for i in range(24)], pa.int32())
                    for j in range(13)})
    columns.update({f"cat_{j}": pa.array([i for i in range(24)], pa.int64()) for j in range(26)})
    pq.write_table(pa.table(columns), tmp_path / "part.parquet", row_group_size=2)
    rows = lambda batches: [round(math.expm1(float(x))) // 100 for b in batches for x in b[0][:, 0]]
    plain = ParquetLoader([tmp_path], batch_size=4, tables=criteo_tables())
    assert rows(plain) == list(range(24))
    loader = ParquetLoader([tmp_path], batch_size=4, tables=criteo_tables(), shuffle_seed=3)
    first, second = rows(loader.epoch(0)), rows(loader.epoch(1))
    assert sorted(first) == sorted(second) == list(range(24))
    assert first != list(range(24)) and second != first  # row groups shuffled, per epoch
    assert rows(loader.epoch(0)) == first  # the same seed, the same order
    assert rows(loader.epoch(0, skip=2)) == first[8:]
    assert len(ParquetLoader([tmp_path], batch_size=5, tables=criteo_tables())) == 5
    dropped = ParquetLoader([tmp_path], batch_size=5, tables=criteo_tables(), drop_last=True)
    assert len(dropped) == 4 and len(list(dropped)) == 4


def test_a_spec_of_ones_own_with_multi_hot_weighted_features(tmp_path):
    pq.write_table(pa.table({
        "clicked": pa.array([1, 0, 1], pa.int8()),
        "price": pa.array([1.0, 2.0, 3.0], pa.float32()),
        "history": pa.array([[1, 2], [], [3]], pa.list_(pa.int64())),
        "history_weights": pa.array([[0.5, 1.0], [], [2.0]], pa.list_(pa.float32())),
    }), tmp_path / "clicks.parquet")
    spec = {
        "label": "clicked",
        "dense": [{"column": "price"}],
        "dense_transform": "identity",
        "sparse": [{"column": "history", "weights": "history_weights"}],
        "tables": [{"name": "t", "num_embeddings": 10, "embedding_dim": 4,
                    "feature_names": ["history"]}],
    }
    (dense, kjt, labels), = list(ParquetLoader([tmp_path], batch_size=3, spec=spec))
    assert dense.flatten().tolist() == [1.0, 2.0, 3.0]
    assert kjt.values().tolist() == [1, 2, 3] and kjt.lengths().tolist() == [2, 0, 1]
    assert kjt.weights().tolist() == [0.5, 1.0, 2.0]
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=10, embedding_dim=4,
                                                     name="t", feature_names=["history"])],
                                 is_weighted=True)
    with torch.no_grad():
        pooled = ebc(kjt).values()
    weight = ebc.embedding_bags["t"].weight
    torch.testing.assert_close(pooled[0], 0.5 * weight[1] + 1.0 * weight[2])


def test_training_from_the_loader(criteo_dir):
    tables = criteo_tables()
    ebc = EmbeddingBagCollection(tables, optimizer=(RowWiseAdagrad, {"lr": 0.1}))
    head = torch.nn.Linear(13 + 26 * 4, 1)
    for dense, kjt, labels in ParquetLoader([criteo_dir], batch_size=4, tables=tables):
        logits = head(torch.cat([dense, ebc(kjt).values()], dim=1)).squeeze(1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
    assert ebc.step == 3


def test_bad_files_and_options_raise_clear_exceptions(tmp_path, criteo_dir):
    with pytest.raises(OSError, match="nowhere.parquet"):
        ParquetLoader([tmp_path / "nowhere.parquet"], batch_size=4, tables=criteo_tables())
    bad = tmp_path / "bad"
    bad.mkdir()
    columns = {"label": pa.array([1], pa.int8())}
    columns.update({f"int_{j}": pa.array([1], pa.int32()) for j in range(13)})
    columns.update({f"cat_{j}": pa.array(["x"], pa.string()) for j in range(26)})
    pq.write_table(pa.table(columns), bad / "part.parquet")
    with pytest.raises(ValueError, match="part.parquet: column 'cat_0'"):
        ParquetLoader([bad], batch_size=4, tables=criteo_tables())
    with pytest.raises(ValueError, match="batch size 0"):
        ParquetLoader([criteo_dir], batch_size=0, tables=criteo_tables())
    with pytest.raises(ValueError, match="give a dataset spec"):
        ParquetLoader([criteo_dir], batch_size=4)
