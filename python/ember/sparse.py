"""``KeyedJaggedTensor``: a batch of sparse features in TorchRec's layout
(key-major values, with lengths or offsets, optional per-value weights).

Values may be torch tensors, numpy arrays (read through DLPack) or lists.
The batch is validated when built, with Ember's checks and messages
(``ValueError``), and its ids are copied once into the batch Ember looks
up: changing the given tensors afterwards does not change the batch.
``values()``, ``lengths()``, ``offsets()`` and ``weights()`` return what
was given (a list stays a list).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ember import _native


class KeyedJaggedTensor:
    """Sparse features of a batch (TorchRec's ``KeyedJaggedTensor``).

    ``values`` holds every id, key by key; ``lengths`` one count per (key,
    sample), key-major, or ``offsets`` (``len(keys) * batch + 1`` of them);
    ``weights`` one float per id (weighted features), or None.
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: Any,
        weights: Optional[Any] = None,
        lengths: Optional[Any] = None,
        offsets: Optional[Any] = None,
        stride: Optional[int] = None,
    ) -> None:
        if isinstance(keys, str):
            raise TypeError(f"keys: expected a list of feature names, got the string {keys!r}")
        self._keys = [str(k) for k in keys]
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._unweighted: Optional[_native.Kjt] = None
        if lengths is not None:
            self._native = _native.Kjt(self._keys, values, lengths=lengths, weights=weights)
        else:
            self._native = _native.Kjt(self._keys, values, offsets=offsets, weights=weights)
        if stride is not None and stride != self._native.stride():
            raise ValueError(
                f"stride {stride} given, but the lengths describe {self._native.stride()} samples"
            )

    @classmethod
    def _from_native(cls, native: "_native.Kjt") -> "KeyedJaggedTensor":
        """A batch Ember made (the loader's): its arrays as torch tensors when
        torch is installed, else as Ember's DLPack tensors, made on first use."""
        kjt = cls.__new__(cls)
        kjt._keys = native.keys()
        kjt._native = native
        kjt._unweighted = None
        kjt._values = _Lazy(native.values_tensor)
        kjt._lengths = _Lazy(native.lengths_tensor)
        kjt._offsets = _Lazy(native.offsets_tensor)
        kjt._weights = _Lazy(native.weights_tensor) if native.has_weights() else None
        return kjt

    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str], values: Any, lengths: Any, weights: Optional[Any] = None
    ) -> "KeyedJaggedTensor":
        """From one length per (key, sample), key-major."""
        return KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths)

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str], values: Any, offsets: Any, weights: Optional[Any] = None
    ) -> "KeyedJaggedTensor":
        """From ``len(keys) * batch + 1`` offsets into the values."""
        return KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets)

    def _native_for(self, weighted: bool) -> "_native.Kjt":
        """The batch for a collection that pools weights (``weighted``) or
        ignores them, as TorchRec's ``is_weighted``."""
        if weighted:
            if self._weights is None:
                raise ValueError(
                    "the collection is weighted (is_weighted=True) but the batch has no weights"
                )
            return self._native
        if self._weights is None:
            return self._native
        if self._unweighted is None:
            self._unweighted = self._native.without_weights()
        return self._unweighted

    def keys(self) -> List[str]:
        """The feature names, in input order."""
        return list(self._keys)

    def values(self) -> Any:
        """The ids, as given (a batch of the loader's: an int64 tensor)."""
        self._values = _resolve(self._values)
        return self._values

    def weights(self) -> Any:
        """The per-id weights; raises when the features are unweighted."""
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        self._weights = _resolve(self._weights)
        return self._weights

    def weights_or_none(self) -> Optional[Any]:
        """The per-id weights, or None."""
        return None if self._weights is None else self.weights()

    def lengths(self) -> Any:
        """One length per (key, sample), key-major: as given, an int64 tensor for a
        batch of the loader's, or else computed as a list."""
        self._lengths = _resolve(self._lengths)
        return self._lengths if self._lengths is not None else self._native.lengths()

    def offsets(self) -> Any:
        """``len(keys) * stride() + 1`` offsets: as given, an int64 tensor for a
        batch of the loader's, or else computed as a list."""
        self._offsets = _resolve(self._offsets)
        return self._offsets if self._offsets is not None else self._native.offsets()

    def stride(self) -> int:
        """The batch size."""
        return self._native.stride()

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self.stride()}, "
            f"values={self._native.num_values()})"
        )


class _Lazy:
    """An array of a batch Ember made, converted when first asked for."""

    def __init__(self, make) -> None:
        self.make = make


def _resolve(value: Any) -> Any:
    if not isinstance(value, _Lazy):
        return value
    tensor = value.make()
    try:
        import torch
    except ImportError:
        return tensor
    return torch.from_dlpack(tensor)
