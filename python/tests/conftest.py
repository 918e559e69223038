"""Shared fixtures: small tables and batches."""

import importlib
import os

import pytest

torch = pytest.importorskip("torch")

from ember import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType  # noqa: E402


def tables(pooling=PoolingType.SUM):
    """Two tables, the second shared by two features."""
    return [
        EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="t0", feature_names=["f0"],
                           pooling=pooling),
        EmbeddingBagConfig(num_embeddings=80, embedding_dim=8, name="t1",
                           feature_names=["f1", "f2"], pooling=pooling),
    ]


def batch(seed, size=16, rows=(50, 80, 80), max_len=4, weighted=False):
    """A random batch over features f0, f1, f2 (empty bags and repeated ids included)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (3 * size,), generator=g)
    values = torch.cat([
        torch.randint(0, rows[k], (int(lengths[k * size:(k + 1) * size].sum()),), generator=g)
        for k in range(3)
    ])
    weights = torch.rand(values.shape[0], generator=g) if weighted else None
    return KeyedJaggedTensor(["f0", "f1", "f2"], values, weights=weights, lengths=lengths)


def require(module: str):
    """Imports `module`, skipping the test without it, unless the environment
    says the suite must run whole (CI: EMBER_REQUIRE_TORCHREC=1)."""
    if os.environ.get("EMBER_REQUIRE_TORCHREC") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)
