"""Table configs with TorchRec's names and defaults (``torchrec.EmbeddingBagConfig``,
``torchrec.PoolingType``, ``torchrec.DataType``)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import List, Optional


class PoolingType(enum.Enum):
    """How a bag's rows combine (TorchRec's ``PoolingType``)."""

    SUM = "SUM"
    MEAN = "MEAN"


class DataType(enum.Enum):
    """A table's row type (TorchRec's ``DataType``; FP8 and MXFP4 are Ember's).

    FP32, FP16 and BF16 tables train; the others are for inference.
    """

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"
    INT8 = "INT8"
    INT4 = "INT4"
    FP8 = "FP8"
    MXFP4 = "MXFP4"


@dataclass
class EmbeddingBagConfig:
    """One table and the features that look it up (TorchRec's fields, in its order).

    ``weight_init_min``/``weight_init_max`` default to -/+ sqrt(1 / num_embeddings),
    as in TorchRec.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    pooling: PoolingType = PoolingType.SUM
    # Ember's: rows found by the raw 64-bit id through a map, with
    # admission and eviction (Ember's KvConfig as a dict; {} for its
    # defaults). None: the id is the row.
    kv: Optional[dict] = None

    def _to_ember(self) -> dict:
        """The config as Ember's ``EmbeddingBagConfig`` reads it (JSON)."""
        if not isinstance(self.data_type, DataType):
            raise ValueError(f"table '{self.name}': data_type must be an ember.DataType")
        if not isinstance(self.pooling, PoolingType):
            raise ValueError(
                f"table '{self.name}': pooling must be ember.PoolingType.SUM or MEAN"
            )
        for field_name in ("num_embeddings", "embedding_dim"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"table '{self.name}': {field_name} must be a non-negative int, got {value!r}"
                )
        config = {
            "name": self.name,
            "num_embeddings": int(self.num_embeddings),
            "embedding_dim": int(self.embedding_dim),
            "feature_names": [str(f) for f in self.feature_names],
            "pooling": self.pooling.value.lower(),
            "weight_init_min": self.weight_init_min,
            "weight_init_max": self.weight_init_max,
            "data_type": self.data_type.value.lower(),
        }
        if self.kv is not None:
            config["kv"] = dict(self.kv)
        return config


@dataclass
class EmbeddingConfig:
    """One table read unpooled, every id's row in place (TorchRec's
    ``EmbeddingConfig``: its fields, in its order; no pooling). The tables of
    one collection share a dim."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: DataType = DataType.FP32
    feature_names: List[str] = field(default_factory=list)
    weight_init_max: Optional[float] = None
    weight_init_min: Optional[float] = None
    # Ember's key-value tables, as EmbeddingBagConfig's.
    kv: Optional[dict] = None

    def _to_ember(self) -> dict:
        """The config as Ember's ``EmbeddingConfig`` reads it (JSON)."""
        bag = EmbeddingBagConfig(self.num_embeddings, self.embedding_dim, self.name,
                                 self.data_type, self.feature_names, self.weight_init_max,
                                 self.weight_init_min, kv=self.kv)._to_ember()
        del bag["pooling"]
        return bag


def tables_json(tables: list, kind: type = EmbeddingBagConfig) -> str:
    """Configs (all of ``kind``) as the JSON list the native collection takes."""
    for i, table in enumerate(tables):
        if not isinstance(table, kind):
            raise TypeError(
                f"tables[{i}]: expected an ember.{kind.__name__}, got {type(table).__name__}"
            )
    return json.dumps([t._to_ember() for t in tables])


def table_optimizer_spec(spec) -> dict:
    """A table optimizer given as Ember's ``TableOptimizer`` dict, or as an
    optimizer class and its keyword arguments (as for
    ``ember.optim.apply_optimizer_in_backward``), as the dict."""
    if isinstance(spec, dict):
        return dict(spec)
    from ember.optim import table_optimizer

    optimizer_class, kwargs = spec
    return table_optimizer(optimizer_class, kwargs)
