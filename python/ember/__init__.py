"""Ember's embedding tables from Python, under TorchRec's names.

The core (configs, ``KeyedJaggedTensor``, the native collections,
``ember.data``, ``ember.train``) needs neither torch nor numpy.
``EmbeddingBagCollection``, ``KeyedTensor``, ``EmbeddingCollection``,
``JaggedTensor`` and ``ember.optim`` are torch modules and tensors: install
the ``torch`` extra.

    import torch
    from ember import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from ember.optim import RowWiseAdagrad, apply_optimizer_in_backward
"""

from ember import _native
from ember.configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from ember.sparse import KeyedJaggedTensor

__version__ = _native.__version__

__all__ = [
    "DataType",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "__version__",
]

_TORCH_NAMES = {
    "EmbeddingBagCollection": "ember.modules",
    "KeyedTensor": "ember.modules",
    "EmbeddingCollection": "ember.sequence",
    "JaggedTensor": "ember.sequence",
}


def __getattr__(name: str):
    # The torch parts load on first use, so `import ember` works without torch.
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'ember' has no attribute '{name}'")
    try:
        import importlib

        return getattr(importlib.import_module(module), name)
    except ImportError as error:
        if error.name == "torch":
            raise ImportError(
                f"ember.{name} is a torch module: install torch (pip install 'ember[torch]')"
            ) from error
        raise
