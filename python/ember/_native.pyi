"""Type stubs of ember._native, the Rust module under the Python layer."""

from typing import Any, List, Optional, Sequence, Tuple

__version__: str

class Tensor:
    """A 2-D row-major CPU tensor of Ember's memory, exported through DLPack
    (``torch.from_dlpack``, ``numpy.from_dlpack``) without a copy."""

    def __dlpack__(
        self,
        *,
        stream: Optional[Any] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    @property
    def shape(self) -> Tuple[int, int]: ...
    @property
    def dtype(self) -> str:
        """'float32', 'float16', 'bfloat16' or 'uint8' (quantized rows as stored)."""
    @property
    def data_ptr(self) -> int:
        """The address of the first value."""
    def tolist(self) -> List[List[float]]:
        """The values as lists (float32 tensors)."""

class Kjt:
    """A validated KeyedJaggedTensor: ids (int64/int32 arrays through DLPack,
    or lists), exactly one of lengths and offsets, optional float32 weights."""

    def __init__(
        self,
        keys: Sequence[str],
        values: Any,
        lengths: Optional[Any] = None,
        offsets: Optional[Any] = None,
        weights: Optional[Any] = None,
    ) -> None: ...
    def keys(self) -> List[str]: ...
    def stride(self) -> int: ...
    def num_values(self) -> int: ...
    def lengths(self) -> List[int]: ...
    def offsets(self) -> List[int]: ...

class Collection:
    """Embedding-bag tables (a JSON list of Ember's EmbeddingBagConfig) with the
    optimizer (Ember's TableOptimizer as JSON) fused into ``backward``."""

    def __init__(self, tables_json: str, optimizer_json: str, seed: int) -> None: ...
    def set_optimizer(self, optimizer_json: str) -> None: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def tables(self) -> str: ...
    @property
    def feature_names(self) -> List[str]: ...
    @property
    def feature_dims(self) -> List[int]: ...
    @property
    def width(self) -> int: ...
    @property
    def step(self) -> int: ...
    def forward(self, kjt: Kjt) -> Tensor:
        """Pooled lookup, ``[batch, width]`` float32; releases the GIL."""
    def backward(self, kjt: Kjt, grad: Any) -> None:
        """The fused update from d(loss)/d(output) (float32 ``[batch, width]``,
        read in place); releases the GIL."""
    def weight(self, name: str) -> Tensor:
        """A view of table ``name``'s rows."""
    def optimizer_state(self, name: str) -> Optional[Tensor]:
        """A view of table ``name``'s optimizer state, or None."""
