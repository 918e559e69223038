"""``EmbeddingBagCollection``: Ember's tables as a torch module, with TorchRec's
constructor, output (``KeyedTensor``) and ``state_dict`` names.

The pooled lookup and its backward run in Ember (the GIL released). The
backward hands d(loss)/d(pooled) to Ember, which applies the collection's
fused optimizer inside the scatter: TorchRec's apply-optimizer-in-backward
model, so the tables never get a ``.grad``. Choose the optimizer with
``ember.optim.apply_optimizer_in_backward`` (TorchRec's call), or pass
``optimizer=`` here.

The weights are ``torch.nn.Parameter``s over Ember's own rows (through
DLPack, no copy): ``state_dict()`` reads them and ``load_state_dict()``
writes them in place, with TorchRec's names ``embedding_bags.<table>.weight``.
"""

from __future__ import annotations

import json
import weakref
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ember import _native
from ember.configs import DataType, EmbeddingBagConfig, tables_json
from ember.sparse import KeyedJaggedTensor


class KeyedTensor:
    """Pooled embeddings of a batch, features side by side (TorchRec's
    ``KeyedTensor`` with ``key_dim=1``): ``values()`` is ``[batch, sum(length_per_key)]``."""

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
    ) -> None:
        if key_dim != 1:
            raise ValueError("Ember's KeyedTensor is keyed along dim 1")
        if len(keys) != len(length_per_key):
            raise ValueError(f"{len(keys)} keys but {len(length_per_key)} lengths")
        if values.dim() != 2 or values.shape[1] != sum(length_per_key):
            raise ValueError(
                f"values of shape {tuple(values.shape)} do not hold features of "
                f"widths {list(length_per_key)}"
            )
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        self._values = values

    def keys(self) -> List[str]:
        """The feature names, in output order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """``[batch, width]`` pooled values."""
        return self._values

    def key_dim(self) -> int:
        """The dimension the keys split (always 1)."""
        return 1

    def length_per_key(self) -> List[int]:
        """Each feature's width."""
        return list(self._length_per_key)

    def offset_per_key(self) -> List[int]:
        """Each feature's first column, then the width."""
        offsets = [0]
        for length in self._length_per_key:
            offsets.append(offsets[-1] + length)
        return offsets

    def to_dict(self) -> Dict[str, torch.Tensor]:
        """Each feature's ``[batch, dim]`` columns (views, differentiable)."""
        return dict(zip(self._keys, torch.split(self._values, self._length_per_key, dim=1)))

    def __getitem__(self, key: str) -> torch.Tensor:
        at = self._keys.index(key)
        offsets = self.offset_per_key()
        return self._values[:, offsets[at] : offsets[at + 1]]

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, values={tuple(self._values.shape)})"


class _PooledLookup(torch.autograd.Function):
    """Ember's forward, and its backward with the optimizer fused in. The
    weights are inputs only so that autograd calls the backward; they get
    no gradient (the update is already applied)."""

    @staticmethod
    def forward(ctx, collection, kjt, *weights):  # type: ignore[override]
        ctx.collection = collection
        ctx.kjt = kjt
        ctx.weights = weights
        return torch.from_dlpack(collection.forward(kjt))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if json.loads(ctx.collection.optimizer)["type"] == "none":
            raise RuntimeError(
                "ember.EmbeddingBagCollection: no optimizer to apply in backward: call "
                "ember.optim.apply_optimizer_in_backward(...) on its parameters (or pass "
                "optimizer=), or freeze it with requires_grad_(False)"
            )
        grad = grad.detach().to(torch.float32).contiguous()
        ctx.collection.backward(ctx.kjt, grad)
        # The rows changed in place: torch's version counters say so, so a
        # graph that saved a table's weight refuses a stale backward.
        for weight in ctx.weights:
            torch.autograd.graph.increment_version(weight)
        return (None, None) + (None,) * len(ctx.weights)


class EmbeddingBagCollection(nn.Module):
    """Embedding-bag tables (TorchRec's ``EmbeddingBagCollection``).

    ``forward(features)`` pools every table's features of a
    ``KeyedJaggedTensor`` into a ``KeyedTensor``, features in the tables'
    order, then each table's ``feature_names``. Rows start uniform in each
    table's init range, drawn from ``seed``.

    ``optimizer`` is an optimizer class and its keyword arguments, as for
    ``ember.optim.apply_optimizer_in_backward``; None leaves the tables
    without one until that call.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        *,
        seed: int = 0,
        optimizer: Optional[tuple] = None,
    ) -> None:
        super().__init__()
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(
                f"ember.EmbeddingBagCollection runs on the CPU; device {device} is not offered"
            )
        self._embedding_bag_configs = list(tables)
        self._is_weighted = bool(is_weighted)
        self._collection = _native.Collection(
            tables_json(self._embedding_bag_configs), '{"type": "none"}', int(seed)
        )
        self.embedding_bags = nn.ModuleDict()
        for config in self._embedding_bag_configs:
            table = nn.Module()
            weight = torch.from_dlpack(self._collection.weight(config.name))
            # The inference types' rows are bytes as stored: no gradient.
            trainable = config.data_type in (DataType.FP32, DataType.FP16, DataType.BF16)
            param = nn.Parameter(weight, requires_grad=trainable)
            # A weak reference: the module owns its tables, not the reverse.
            param._ember_collection = weakref.ref(self)
            table.register_parameter("weight", param)
            self.embedding_bags[config.name] = table
        if optimizer is not None:
            from ember.optim import apply_optimizer_in_backward

            optimizer_class, kwargs = optimizer
            apply_optimizer_in_backward(optimizer_class, self.parameters(), kwargs)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The pooled lookup of ``features``; differentiable when the tables
        require grad (then ``loss.backward()`` updates them)."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"expected an ember.KeyedJaggedTensor, got {type(features).__name__}"
            )
        native = features._native_for(self._is_weighted)
        weights = [t.weight for t in self.embedding_bags.values()]
        training = [w.requires_grad for w in weights]
        if torch.is_grad_enabled() and any(training):
            if not all(training):
                frozen = [n for n, w in zip(self.embedding_bags, weights) if not w.requires_grad]
                raise ValueError(
                    f"tables {frozen} are frozen and the others are not: the fused optimizer "
                    "updates a collection's tables together; freeze all of them "
                    "(requires_grad_(False)) or none, or put them in collections of their own"
                )
            values = _PooledLookup.apply(self._collection, native, *weights)
        else:
            values = torch.from_dlpack(self._collection.forward(native))
        return KeyedTensor(
            self._collection.feature_names, self._collection.feature_dims, values
        )

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() and the like would copy the tables away from
        # Ember's rows, which the lookups keep reading: refused.
        for name, table in self.embedding_bags.items():
            weight = table.weight
            converted = fn(weight)
            if converted.data_ptr() != weight.data_ptr() or converted.dtype != weight.dtype:
                raise ValueError(
                    f"ember.EmbeddingBagCollection: table '{name}' stays in Ember's memory, in "
                    f"its data type on the CPU ({weight.dtype}): choose the type with "
                    "EmbeddingBagConfig(data_type=...)"
                )
        return super()._apply(fn, recurse)

    def share_memory(self):
        raise ValueError(
            "ember.EmbeddingBagCollection: the tables are Ember's memory and cannot move into "
            "shared memory; share the module between threads instead"
        )

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """TorchRec's state dict (``embedding_bags.<table>.weight``), copied into
        Ember's rows in place; ``assign=True`` is refused (it would put other
        tensors where Ember's rows are)."""
        if assign:
            raise ValueError(
                "ember.EmbeddingBagCollection.load_state_dict: assign=True would detach the "
                "tables from Ember's rows; load with the default assign=False"
            )
        return super().load_state_dict(state_dict, strict=strict)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The tables' configs."""
        return list(self._embedding_bag_configs)

    def is_weighted(self) -> bool:
        """Whether the features' per-id weights are pooled (TorchRec's flag): a
        weighted collection requires them; an unweighted one ignores them."""
        return self._is_weighted

    @property
    def fused_optimizer(self) -> dict:
        """The optimizer applied in backward (Ember's ``TableOptimizer`` as a dict)."""
        return json.loads(self._collection.optimizer)

    def optimizer_state(self, table: str) -> Optional[torch.Tensor]:
        """Table ``table``'s optimizer state, a view over Ember's (Adagrad: one
        float per weight; row-wise Adagrad: one per row, TorchRec's
        ``momentum1``; Adam: ``[m | v]`` per row); None without state."""
        state = self._collection.optimizer_state(table)
        return None if state is None else torch.from_dlpack(state)

    @property
    def step(self) -> int:
        """Backward updates applied so far."""
        return self._collection.step
