"""Ember's Parquet loader as a Python iterator of ``(dense, kjt, labels)``
batches: the files are read and decoded on Ember's threads, which run
while Python waits for the next batch (the GIL is released). The dense
values and the labels cross without copies; the ids are copied when first
asked for (``kjt.values()``), the batch Ember looks them up in being its
own.

    loader = ember.data.ParquetLoader(["train/"], batch_size=2048, tables=tables)
    for dense, kjt, labels in loader:          # one epoch
        ...
    for dense, kjt, labels in loader.epoch(1, skip=100):   # a resumed epoch
        ...

The columns come from a dataset spec (Ember's JSON: ``spec=`` a path or a
dict), or, without one, from the Criteo schema Ember's ingest writes
(``label``, ``int_0..12``, ``cat_0..25``) for ``tables``. With torch
installed, ``dense`` is a float32 tensor ``[batch, num_dense]``, ``labels``
float32 ``[batch]``, and the ids in ``kjt`` int64 tensors; without it, they
are Ember's DLPack tensors (``numpy.from_dlpack`` reads them).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

from ember import _native
from ember.configs import EmbeddingBagConfig, tables_json
from ember.sparse import KeyedJaggedTensor


def _tensor(native: Any) -> Any:
    try:
        import torch
    except ImportError:
        return native
    return torch.from_dlpack(native)


class Epoch:
    """One epoch's batches, in order."""

    def __init__(self, native: "_native.Epoch") -> None:
        self._native = native

    def __iter__(self) -> "Epoch":
        return self

    def __next__(self) -> Tuple[Any, KeyedJaggedTensor, Any]:
        dense, kjt, labels = next(self._native)
        return _tensor(dense), KeyedJaggedTensor._from_native(kjt), _tensor(labels)


class ParquetLoader:
    """Batches of Parquet files or directories (Ember's ``Loader``).

    Iterating the loader gives epoch 0 (the same shuffle each time);
    ``epoch(n)`` gives epoch ``n``, as Ember's Trainer numbers them.

    ``shuffle_seed`` shuffles each epoch's row groups; ``rank`` and
    ``world_size`` take every ``world_size``-th row group from ``rank``;
    ``threads`` decode in parallel, ``prefetch`` row groups and batches
    queued ahead of the consumer; ``labels=False`` reads files without a
    label column (labels are NaN).
    """

    def __init__(
        self,
        paths: Sequence[Union[str, os.PathLike]],
        batch_size: int,
        *,
        spec: Optional[Union[str, os.PathLike, dict]] = None,
        tables: Optional[List[EmbeddingBagConfig]] = None,
        shuffle_seed: Optional[int] = None,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        threads: int = 1,
        prefetch: int = 2,
        labels: bool = True,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if spec is None:
            if tables is None:
                raise ValueError("give a dataset spec (spec=) or the Criteo schema's tables (tables=)")
            spec_json = _native.criteo_spec(tables_json(tables))
        elif isinstance(spec, dict):
            spec_json = json.dumps(spec)
        else:
            spec_json = _native.read_spec(os.fspath(spec))
        config = {
            "batch_size": batch_size, "spec": json.loads(spec_json), "shuffle_seed": shuffle_seed,
            "drop_last": drop_last, "rank": rank, "world_size": world_size, "threads": threads,
            "prefetch": prefetch, "labels": labels,
        }
        self._native = _native.Loader([os.fspath(p) for p in paths], json.dumps(config))

    def epoch(self, epoch: int = 0, skip: int = 0) -> Epoch:
        """The batches of ``epoch`` (its shuffle), after its first ``skip``."""
        return Epoch(self._native.epoch(epoch, skip))

    def __iter__(self) -> Iterator[Tuple[Any, KeyedJaggedTensor, Any]]:
        return self.epoch(0)

    def __len__(self) -> int:
        return self._native.batches_per_epoch(0)

    def batches_per_epoch(self, epoch: int = 0) -> int:
        """Batches of ``epoch``, from the files' metadata."""
        return self._native.batches_per_epoch(epoch)

    def keys(self) -> List[str]:
        """The sparse features, in batch order."""
        return self._native.keys

    @property
    def num_dense(self) -> int:
        """Dense features per sample."""
        return self._native.num_dense
