"""``EmbeddingCollection``: Ember's tables read unpooled, every id's row in
its place in the sequence (TorchRec's ``EmbeddingCollection``, for user
histories and sequence models), returning one ``JaggedTensor`` a feature;
``loss.backward()`` applies the fused optimizer, as for the bags."""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Union

import torch

from ember import _native
from ember.configs import EmbeddingConfig
from ember.sparse import KeyedJaggedTensor
from ember.tables import EmberTables, bump_versions, check_optimizer


class JaggedTensor:
    """One feature's rows of a batch (TorchRec's ``JaggedTensor``, its
    arguments in its order): ``values()`` is ``[rows, dim]``; sample ``i``'s
    rows are ``values()[offsets()[i]:offsets()[i + 1]]``. Give lengths,
    offsets or both (then they must agree)."""

    def __init__(self, values: torch.Tensor, weights: Optional[torch.Tensor] = None,
                 lengths: Optional[torch.Tensor] = None,
                 offsets: Optional[torch.Tensor] = None) -> None:
        if lengths is None and offsets is None:
            raise ValueError("give lengths or offsets")
        if lengths is not None:
            lengths = torch.as_tensor(lengths, dtype=torch.int64)
            from_lengths = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            given = None if offsets is None else torch.as_tensor(offsets, dtype=torch.int64)
            if given is not None and not torch.equal(given, from_lengths):
                raise ValueError("the lengths and the offsets disagree")
            offsets = from_lengths
        self._values = values
        self._weights = weights
        self._offsets = torch.as_tensor(offsets, dtype=torch.int64)

    def values(self) -> torch.Tensor:
        """``[rows, dim]``."""
        return self._values

    def weights(self) -> torch.Tensor:
        """The per-row weights; raises when there are none."""
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> Optional[torch.Tensor]:
        """The per-row weights, or None."""
        return self._weights

    def offsets(self) -> torch.Tensor:
        """``batch + 1`` row offsets."""
        return self._offsets

    def lengths(self) -> torch.Tensor:
        """Rows per sample."""
        return self._offsets[1:] - self._offsets[:-1]

    def to_dense(self) -> List[torch.Tensor]:
        """Each sample's ``[len, dim]`` rows (views)."""
        bounds = self._offsets.tolist()
        return [self._values[a:b] for a, b in zip(bounds, bounds[1:])]

    def __repr__(self) -> str:
        return f"JaggedTensor(values={tuple(self._values.shape)}, samples={len(self._offsets) - 1})"


class _SequenceLookup(torch.autograd.Function):
    """Ember's unpooled forward (the rows, and their offsets, which carry no
    gradient) and its backward with the optimizer fused in (as the bags'
    ``_PooledLookup``)."""

    @staticmethod
    def forward(ctx, collection, kjt, *weights):  # type: ignore[override]
        ctx.collection = collection
        ctx.kjt = kjt
        ctx.weights = weights
        values, offsets = collection.forward(kjt)
        offsets = torch.from_dlpack(offsets)
        ctx.mark_non_differentiable(offsets)
        return torch.from_dlpack(values), offsets

    @staticmethod
    def backward(ctx, grad, _offsets_grad):  # type: ignore[override]
        check_optimizer(ctx.collection, "EmbeddingCollection")
        ctx.collection.backward(ctx.kjt, grad.detach().to(torch.float32).contiguous())
        bump_versions(ctx.weights)
        return (None, None) + (None,) * len(ctx.weights)


class EmbeddingCollection(EmberTables):
    """Embedding tables read unpooled (TorchRec's ``EmbeddingCollection``):
    ``forward(features)`` returns, for each of the tables' features (in the
    tables' order, then each table's ``feature_names``), a ``JaggedTensor``
    of every id's row in place. The tables share one dim. ``seed`` and
    ``optimizer`` as for ``EmbeddingBagCollection``; the state dict's names
    are TorchRec's, ``embeddings.<table>.weight``. ``disk_dir`` and
    ``cache_rows`` put the tables on the disk tier, as for
    ``EmbeddingBagCollection``."""

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        *,
        seed: int = 0,
        optimizer: Optional[tuple] = None,
        disk_dir: Optional[Union[str, os.PathLike]] = None,
        cache_rows: Optional[int] = None,
    ) -> None:
        super().__init__()
        if need_indices:
            raise ValueError("ember.EmbeddingCollection: need_indices is not offered")
        self._embedding_configs = list(tables)
        self._build(_native.SequenceCollection, self._embedding_configs, EmbeddingConfig,
                    "embeddings", device=device, seed=seed, optimizer=optimizer,
                    disk_dir=disk_dir, cache_rows=cache_rows)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """Every id's row of ``features``, a ``JaggedTensor`` a feature;
        differentiable when the tables require grad."""
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(
                f"expected an ember.KeyedJaggedTensor, got {type(features).__name__}"
            )
        native = features._native_for(False)
        weights = self._trained_weights()
        if weights is not None:
            values, offsets = _SequenceLookup.apply(self._collection, native, *weights)
        else:
            raw, raw_offsets = self._collection.forward(native)
            values, offsets = torch.from_dlpack(raw), torch.from_dlpack(raw_offsets)
        stride = native.stride()
        out = {}
        for f, name in enumerate(self._collection.feature_names):
            bounds = offsets[f * stride:(f + 1) * stride + 1]
            first, last = int(bounds[0]), int(bounds[-1])
            out[name] = JaggedTensor(values[first:last], offsets=bounds - first)
        return out

    def embedding_configs(self) -> List[EmbeddingConfig]:
        """The tables' configs."""
        return list(self._embedding_configs)

    def embedding_dim(self) -> int:
        """The tables' dim."""
        return self._collection.dim
