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

import os
from typing import Dict, List, Optional, Sequence, Union

import torch

from ember import _native
from ember.configs import EmbeddingBagConfig
from ember.sparse import KeyedJaggedTensor
from ember.tables import EmberTables, bump_versions, check_optimizer


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
        check_optimizer(ctx.collection, "EmbeddingBagCollection")
        ctx.collection.backward(ctx.kjt, grad.detach().to(torch.float32).contiguous())
        bump_versions(ctx.weights)
        return (None, None) + (None,) * len(ctx.weights)


class EmbeddingBagCollection(EmberTables):
    """Embedding-bag tables (TorchRec's ``EmbeddingBagCollection``).

    ``forward(features)`` pools every table's features of a
    ``KeyedJaggedTensor`` into a ``KeyedTensor``, features in the tables'
    order, then each table's ``feature_names``. Rows start uniform in each
    table's init range, drawn from ``seed``.

    ``optimizer`` is an optimizer class and its keyword arguments, as for
    ``ember.optim.apply_optimizer_in_backward``; None leaves the tables
    without one until that call.

    With ``disk_dir``, the tables live on Ember's disk tier: their rows
    (and optimizer state) in files there, behind an in-memory cache of
    ``cache_rows`` rows per table; a lookup brings its rows into the caches
    first. The optimizer is then given here (the files hold its state);
    the tables are not parameters (``state_dict`` is refused: use
    ``save_checkpoint``), and lookups train whenever grad is enabled.

    Tables whose config has ``kv`` (Ember's key-value tables) take raw
    64-bit ids, found through a map with admission and eviction; they are
    staged as disk-tier tables are (the optimizer given here, no
    parameters), and ``eval()`` stops admitting new ids.

    ``shard_over=N`` shards the tables over N devices of this process, each
    a thread, by Ember's planner (TorchRec's ``DistributedModelParallel``
    with its default planner, without a process group); ``plan=`` shards
    them by a plan of your own (``ember.sharding.plan``, or ``ember plan
    --json``). Each lookup routes ids to their shards and pools there; the
    backward updates each shard where it lives. The optimizer is then given
    here, the tables are not parameters, and ``state_dict()`` gathers a copy
    of each table under TorchRec's names (``load_state_dict`` writes one
    back); ``plan`` says where each table went. Sharded tables are in RAM
    and indexed by id (neither the disk tier nor key-value tables).
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        *,
        seed: int = 0,
        optimizer: Optional[tuple] = None,
        disk_dir: Optional[Union[str, os.PathLike]] = None,
        cache_rows: Optional[int] = None,
        shard_over: Optional[int] = None,
        plan: Optional[dict] = None,
    ) -> None:
        super().__init__()
        self._embedding_bag_configs = list(tables)
        self._is_weighted = bool(is_weighted)
        if shard_over is not None:
            if plan is not None:
                raise ValueError("give shard_over (the planner's plan) or plan, not both")
            from ember.sharding import plan as planner

            plan = planner(self._embedding_bag_configs, shard_over, optimizer=optimizer)
        self._build(_native.Collection, self._embedding_bag_configs, EmbeddingBagConfig,
                    "embedding_bags", device=device, seed=seed, optimizer=optimizer,
                    disk_dir=disk_dir, cache_rows=cache_rows, plan=plan)

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The pooled lookup of ``features``; differentiable when the tables
        require grad (then ``loss.backward()`` updates them)."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"expected an ember.KeyedJaggedTensor, got {type(features).__name__}"
            )
        native = features._native_for(self._is_weighted)
        weights = self._trained_weights()
        if weights is not None:
            values = _PooledLookup.apply(self._collection, native, *weights)
        else:
            values = torch.from_dlpack(self._collection.forward(native))
        return KeyedTensor(
            self._collection.feature_names, self._collection.feature_dims, values
        )

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The tables' configs."""
        return list(self._embedding_bag_configs)

    def is_weighted(self) -> bool:
        """Whether the features' per-id weights are pooled (TorchRec's flag): a
        weighted collection requires them; an unweighted one ignores them."""
        return self._is_weighted
