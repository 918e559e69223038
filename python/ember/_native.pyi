"""Type stubs of ember._native, the Rust module under the Python layer."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__version__: str

class Tensor:
    """A row-major CPU tensor (1-D or 2-D) of Ember's memory, exported through
    DLPack (``torch.from_dlpack``, ``numpy.from_dlpack``) without a copy."""

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
    def shape(self) -> List[int]: ...
    @property
    def dtype(self) -> str:
        """'float32', 'float16', 'bfloat16', 'int64' or 'uint8' (quantized rows as stored)."""
    def data_ptr(self) -> int:
        """The address of the first value."""
    def tolist(self) -> Any:
        """The values as a list, or a list of rows (float32 and int64 tensors)."""

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
    def values_tensor(self) -> Tensor: ...
    def lengths_tensor(self) -> Tensor: ...
    def offsets_tensor(self) -> Tensor: ...
    def weights_tensor(self) -> Optional[Tensor]: ...
    def has_weights(self) -> bool: ...
    def without_weights(self) -> Kjt: ...

class Collection:
    """Embedding-bag tables (a JSON list of Ember's EmbeddingBagConfig) with the
    optimizer (Ember's TableOptimizer as JSON) fused into ``backward``."""

    def __init__(self, tables_json: str, optimizer_json: str, seed: int) -> None: ...
    def set_optimizer(self, optimizer_json: str) -> None: ...
    def optimizer_state_viewed(self) -> bool: ...
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
    def save(self, path: str) -> None:
        """Ember's checkpoint of the tables, their optimizer state and step."""
    def load(self, path: str) -> None:
        """Loads Ember's checkpoint into the tables, in place."""

class SequenceCollection:
    """Embedding tables read unpooled (a JSON list of Ember's EmbeddingConfig,
    one dim) with the optimizer fused into ``backward``."""

    def __init__(self, tables_json: str, optimizer_json: str, seed: int) -> None: ...
    def set_optimizer(self, optimizer_json: str) -> None: ...
    def optimizer_state_viewed(self) -> bool: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def feature_names(self) -> List[str]: ...
    @property
    def dim(self) -> int: ...
    @property
    def step(self) -> int: ...
    def forward(self, kjt: Kjt) -> Tuple[Tensor, Tensor]:
        """Every id's row: ``[rows, dim]`` float32 and the ``features * batch + 1``
        row offsets (int64); releases the GIL."""
    def backward(self, kjt: Kjt, grad: Any) -> None:
        """The fused update from d(loss)/d(rows), float32 ``[rows, dim]``."""
    def weight(self, name: str) -> Tensor: ...
    def optimizer_state(self, name: str) -> Optional[Tensor]: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...

class Loader:
    """Parquet files read as batches by Ember's ``LoaderConfig`` (JSON)."""

    def __init__(self, paths: Sequence[str], config_json: str) -> None: ...
    def batches_per_epoch(self, epoch: int) -> int: ...
    @property
    def keys(self) -> List[str]: ...
    @property
    def num_dense(self) -> int: ...
    def epoch(self, epoch: int = 0, skip: int = 0) -> Epoch: ...

class Epoch:
    """One epoch's ``(dense, kjt, labels)`` batches; waiting releases the GIL."""

    def __iter__(self) -> Epoch: ...
    def __next__(self) -> Tuple[Tensor, Kjt, Tensor]: ...

def criteo_spec(tables_json: str) -> str:
    """The Criteo schema's dataset spec for these tables, as JSON."""

def read_spec(path: str) -> str:
    """A dataset spec file, checked, as JSON."""

class Dlrm:
    """Ember's DLRM from its ``DlrmConfig``, ``TableOptimizer`` and
    ``DenseOptimizerConfig`` (JSON)."""

    def __init__(
        self,
        config_json: str,
        table_optimizer_json: str,
        dense_optimizer_json: str,  # "null": Ember's defaults
        seed: int,
        shard_over: Optional[int] = None,
    ) -> None: ...
    def predict(self, dense: Any, kjt: Kjt) -> Tensor: ...
    def evaluate(self, data: Loader, batches: Optional[int] = None) -> Dict[str, Any]: ...
    def save(self, dir: str) -> Any:
        """The checkpoint's path (a pathlib.Path)."""
    def load(self, path: str) -> None: ...

class Trainer:
    """Ember's training loop."""

    def __init__(
        self,
        epochs: int = 1,
        max_steps: Optional[int] = None,
        eval_every: int = 0,
        eval_at_epoch_end: bool = True,
        checkpoint_dir: Optional[str] = None,
        checkpoint_every: int = 0,
        log_every: int = 100,
        pipeline: bool = True,
    ) -> None: ...
    def fit(
        self,
        model: Dlrm,
        train: Loader,
        eval: Optional[Loader] = None,
        on_event: Optional[Callable[[dict], None]] = None,
        resume: bool = False,
    ) -> Dict[str, Any]: ...
