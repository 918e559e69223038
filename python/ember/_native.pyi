"""Type stubs of ember._native, the Rust module under the Python layer."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

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

    def __init__(self, tables_json: str, optimizer_json: str, seed: int,
                 disk_dir: Optional[str] = None, cache_rows: Optional[int] = None,
                 plan_json: Optional[str] = None) -> None:
        """``disk_dir`` and ``cache_rows``: every table on the disk tier;
        ``plan_json`` (Ember's ShardingPlan): sharded over in-process devices."""
    def set_optimizer(self, optimizer_json: str) -> None: ...
    def optimizer_state_viewed(self) -> bool: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def tables(self) -> str: ...
    @property
    def staged(self) -> bool: ...
    def set_training(self, training: bool) -> None: ...
    @property
    def plan(self) -> Optional[str]:
        """The sharding plan (JSON), or None when the tables are whole."""
    def gathered(self) -> Collection:
        """Sharded tables copied whole into a new collection."""
    def reshard_from(self, whole: Collection) -> None:
        """Shards ``whole`` (from ``gathered``) in place of these shards."""
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

    def __init__(self, tables_json: str, optimizer_json: str, seed: int,
                 disk_dir: Optional[str] = None, cache_rows: Optional[int] = None) -> None: ...
    def set_optimizer(self, optimizer_json: str) -> None: ...
    def optimizer_state_viewed(self) -> bool: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def feature_names(self) -> List[str]: ...
    @property
    def staged(self) -> bool: ...
    def set_training(self, training: bool) -> None: ...
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

def plan(tables_json: str, devices: int, batch_size: int, pooling_factor: float,
         optimizer_json: str, sharding: Optional[str] = None,
         memory_bytes: Optional[int] = None) -> str:
    """The planner's ShardingPlan (JSON) of the tables over ``devices``."""

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
        optimization_json: Optional[str] = None,
        eval_every_fraction: Optional[float] = None,
        stop_at_auc: Optional[float] = None,
    ) -> None: ...
    def fit(
        self,
        model: Union[Dlrm, SequenceModel],
        train: Union[Loader, HistoryLoader],
        eval: Optional[Loader] = None,
        on_event: Optional[Callable[[dict], None]] = None,
        resume: bool = False,
    ) -> Dict[str, Any]: ...

class Histories:
    """Users' histories in time order (Ember's ``UserHistory``s)."""

    def __init__(self, items: Sequence[Sequence[int]],
                 timestamps: Optional[Sequence[Sequence[int]]] = None,
                 actions: Optional[Sequence[Sequence[int]]] = None) -> None: ...
    @staticmethod
    def read(path: str) -> Histories:
        """A user-history Parquet file (``ember ingest sequences``)."""
    def __len__(self) -> int: ...
    @property
    def num_items(self) -> int: ...
    def items(self, u: int) -> List[int]: ...
    def leave_out(self, held: int = 1) -> Tuple[Histories, Histories, Histories]:
        """``(train, valid, test)``, the references' evaluation split."""

class HistoryLoader:
    """Histories as a sequence model's training batches."""

    def batches_per_epoch(self, epoch: int) -> int: ...

class SequenceModel:
    """SASRec, HSTU retrieval or HSTU ranking (Ember's), made by its
    static constructors with every argument given (see ember.train)."""

    @staticmethod
    def sasrec(num_items: int, maxlen: int, hidden_units: int, num_blocks: int,
               num_heads: int, dropout_rate: float, lr: float, norm_first: bool, loss: str,
               num_negatives: int, temperature: float, seed: int) -> SequenceModel: ...
    @staticmethod
    def hstu_retrieval(num_items: int, max_sequence_len: int, embedding_dim: int,
                       num_blocks: int, num_heads: int, attention_dim: int, linear_dim: int,
                       num_negatives: int, negative_sampling: str, temperature: float,
                       dropout_rate: float, learning_rate: float,
                       seed: int) -> SequenceModel: ...
    @staticmethod
    def hstu_ranking(num_items: int, max_sequence_len: int, embedding_dim: int,
                     num_blocks: int, num_heads: int, attention_dim: int, linear_dim: int,
                     num_candidates: int, num_tasks: int, head_hidden: int,
                     dropout_rate: float, learning_rate: float,
                     table_optimizer_json: Optional[str], seed: int) -> SequenceModel: ...
    def loader(self, histories: Histories, batch_size: int = 128,
               shuffle_seed: Optional[int] = None, bucket_batches: int = 1) -> HistoryLoader: ...
    def evaluate(self, histories: Histories, negatives: Optional[int] = None,
                 top_k: int = 10) -> Dict[str, Any]: ...
    def save(self, dir: str) -> Any: ...
    def load(self, path: str) -> None: ...
