"""What Ember's torch modules share: tables whose weights are
``torch.nn.Parameter``s over Ember's own rows (through DLPack, no copy),
sharded tables whose state dict is gathered, the fused optimizer's checks,
and the refusals of what would copy the tables away from Ember's memory."""

from __future__ import annotations

import json
import os
import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn

from ember.configs import DataType, tables_json


def check_optimizer(collection, module_name: str) -> None:
    """Refuses a backward with no optimizer to apply (the tables would stay
    as they were, silently)."""
    if json.loads(collection.optimizer)["type"] != "none":
        return
    if collection.staged or getattr(collection, "plan", None) is not None:
        # No parameters: the optimizer can only come with the tables.
        raise RuntimeError(
            f"ember.{module_name}: no optimizer to apply in backward: its tables (staged "
            "or sharded) are not parameters, so pass optimizer= when building it, or look "
            "up under torch.no_grad()"
        )
    raise RuntimeError(
        f"ember.{module_name}: no optimizer to apply in backward: call "
        "ember.optim.apply_optimizer_in_backward(...) on its parameters (or pass "
        "optimizer=), or freeze it with requires_grad_(False)"
    )


def bump_versions(weights) -> None:
    """The rows changed in place: torch's version counters say so, so a graph
    that saved a table's weight refuses a stale backward."""
    for weight in weights:
        torch.autograd.graph.increment_version(weight)


def fused_at_build(unviewed: bool, optimizer) -> Tuple[str, Optional[tuple]]:
    """The optimizer the native collection is built with (JSON), and the one
    left to apply afterwards: staged tables (on the disk tier, or keyed by
    raw ids) and sharded ones have no parameters to apply one to, so it is
    chosen when the tables are made."""
    if not unviewed or optimizer is None:
        return '{"type": "none"}', optimizer
    from ember.sharding import optimizer_json

    return optimizer_json(optimizer), None


class EmberTables(nn.Module):
    """A module of Ember's tables: ``self._collection`` (native) and one
    ``<attr>.<table>.weight`` parameter a table, TorchRec's names."""

    def _build(self, native_class, configs, kind: type, attr: str, *, device, seed: int,
               optimizer, disk_dir, cache_rows, plan: Optional[dict] = None) -> None:
        """Makes the native collection of ``configs`` (all of ``kind``),
        sharded by ``plan`` if given, and registers its tables under
        ``attr``: what both modules' constructors do."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(
                f"ember.{type(self).__name__} runs on the CPU; device {device} is not offered"
            )
        staged = disk_dir is not None or any(t.kv is not None for t in configs)
        fused, optimizer = fused_at_build(staged or plan is not None, optimizer)
        sharding = () if plan is None else (json.dumps(plan),)
        collection = native_class(
            tables_json(configs, kind), fused, int(seed),
            None if disk_dir is None else os.fspath(disk_dir), cache_rows, *sharding,
        )
        self._register_tables(collection, configs, attr, optimizer)

    def _register_tables(self, collection, configs, attr: str, optimizer) -> None:
        self._collection = collection
        self._tables_attr = attr
        self._table_names = [c.name for c in configs]
        tables = nn.ModuleDict()
        if collection.staged or self._sharded():
            # The rows are in files behind caches, found by id through a
            # map, or in pieces on the devices: no array indexed by id to
            # make parameters of. Autograd reaches the backward through this
            # empty tensor instead; the optimizer came with the collection.
            self._anchor = torch.zeros(0, requires_grad=True)
            setattr(self, attr, tables)
            return
        self._anchor = None
        for config in configs:
            table = nn.Module()
            weight = torch.from_dlpack(collection.weight(config.name))
            # The inference types' rows are bytes as stored: no gradient.
            trainable = config.data_type in (DataType.FP32, DataType.FP16, DataType.BF16)
            param = nn.Parameter(weight, requires_grad=trainable)
            # A weak reference: the module owns its tables, not the reverse.
            param._ember_collection = weakref.ref(self)
            table.register_parameter("weight", param)
            tables[config.name] = table
        setattr(self, attr, tables)
        if optimizer is not None:
            from ember.optim import apply_optimizer_in_backward

            optimizer_class, kwargs = optimizer
            apply_optimizer_in_backward(optimizer_class, self.parameters(), kwargs)

    def _tables(self) -> nn.ModuleDict:
        return getattr(self, self._tables_attr)

    def _sharded(self) -> bool:
        return getattr(self._collection, "plan", None) is not None

    @property
    def plan(self) -> Optional[dict]:
        """The plan the tables are sharded by (see ``ember.sharding``); None
        when they are whole in this module."""
        plan = getattr(self._collection, "plan", None)
        return None if plan is None else json.loads(plan)

    def _trained_weights(self) -> Optional[List[torch.Tensor]]:
        """The tables' weights when this lookup trains them (grad enabled and
        the tables not frozen); None when it does not. Staged tables train
        whenever grad is enabled."""
        if self._anchor is not None:
            return [self._anchor] if torch.is_grad_enabled() else None
        weights = [t.weight for t in self._tables().values()]
        training = [w.requires_grad for w in weights]
        if not (torch.is_grad_enabled() and any(training)):
            return None
        if not all(training):
            frozen = [n for n, w in zip(self._tables(), weights) if not w.requires_grad]
            raise ValueError(
                f"tables {frozen} are frozen and the others are not: the fused optimizer "
                "updates a collection's tables together; freeze all of them "
                "(requires_grad_(False)) or none, or put them in collections of their own"
            )
        return weights

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() and the like would copy the tables away from
        # Ember's rows, which the lookups keep reading: refused. Staged and
        # sharded tables have no parameters: their anchor stands for them.
        if self._anchor is not None:
            converted = fn(self._anchor)
            if converted.dtype != self._anchor.dtype or converted.device != self._anchor.device:
                raise ValueError(
                    f"ember.{type(self).__name__}: the tables stay in Ember's memory, on the "
                    "CPU in their data type: choose the type with the tables' configs "
                    "(data_type=...)"
                )
        for name, table in self._tables().items():
            weight = table.weight
            converted = fn(weight)
            if converted.data_ptr() != weight.data_ptr() or converted.dtype != weight.dtype:
                raise ValueError(
                    f"ember.{type(self).__name__}: table '{name}' stays in Ember's memory, in "
                    f"its data type on the CPU ({weight.dtype}): choose the type with the "
                    "table's config (data_type=...)"
                )
        return super()._apply(fn, recurse)

    def share_memory(self):
        raise ValueError(
            f"ember.{type(self).__name__}: the tables are Ember's memory and cannot move into "
            "shared memory; share the module between threads instead"
        )

    def _refuse_staged(self, what: str) -> None:
        if self._collection.staged:
            raise ValueError(
                f"ember.{type(self).__name__}.{what}: the tables are on the disk tier or keyed "
                "by raw ids, not in tensors indexed by id: use save_checkpoint and "
                "load_checkpoint"
            )

    def _weight_key(self, prefix: str, name: str) -> str:
        return f"{prefix}{self._tables_attr}.{name}.weight"

    def train(self, mode: bool = True):
        """Training mode (key-value tables admit new ids) or evaluation (new
        ids read the fallback, and nothing is admitted)."""
        self._collection.set_training(bool(mode))
        return super().train(mode)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The hook torch calls for this module whether its state dict is
        # asked for or a parent's: staged tables refuse there, sharded ones
        # write their gathered copies under the parameters' names.
        self._refuse_staged("state_dict")
        if self._sharded():
            whole = self._collection.gathered()
            for name in self._table_names:
                destination[self._weight_key(prefix, name)] = torch.from_dlpack(
                    whole.weight(name))
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        self._refuse_staged("load_state_dict")
        if local_metadata.get("assign_to_params_buffers"):
            # A parent's load_state_dict(assign=True) reaches here too.
            self._refuse_assign()
        if self._sharded():
            self._load_sharded(state_dict, prefix, missing_keys, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def _load_sharded(self, state_dict, prefix, missing_keys, error_msgs) -> None:
        """Sharded tables gathered, the given ones written, and sharded again
        by the same plan; as torch loads parameters, a table missing or of
        the wrong shape is reported and the others load. The keys are taken
        out, so the (empty) table modules do not call them unexpected."""
        keys = {name: self._weight_key(prefix, name) for name in self._table_names}
        given = {name: state_dict.pop(key) for name, key in keys.items() if key in state_dict}
        missing_keys.extend(key for name, key in keys.items() if name not in given)
        if not given:
            return
        whole = self._collection.gathered()
        loaded = 0
        for name, value in given.items():
            target = torch.from_dlpack(whole.weight(name))
            if tuple(value.shape) != tuple(target.shape):
                error_msgs.append(
                    f"size mismatch for {keys[name]}: copying a param with shape "
                    f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                    f"{tuple(target.shape)}.")
                continue
            with torch.no_grad():
                target.copy_(value)
            loaded += 1
        if loaded:
            self._collection.reshard_from(whole)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """TorchRec's state dict, copied into Ember's rows in place (sharded
        tables: gathered, written and sharded again); ``assign=True`` is
        refused (it would put other tensors where Ember's rows are), and so
        is a collection of staged tables."""
        if assign:
            self._refuse_assign()
        return super().load_state_dict(state_dict, strict=strict)

    def _refuse_assign(self) -> None:
        raise ValueError(
            f"ember.{type(self).__name__}.load_state_dict: assign=True would detach the "
            "tables from Ember's rows; load with the default assign=False"
        )

    @property
    def fused_optimizer(self) -> dict:
        """The optimizer applied in backward (Ember's ``TableOptimizer`` as a dict)."""
        return json.loads(self._collection.optimizer)

    def optimizer_state(self, table: str) -> Optional[torch.Tensor]:
        """Table ``table``'s optimizer state, a view over Ember's (Adagrad: one
        float per weight; row-wise Adagrad: one per row, TorchRec's
        ``momentum1``; Adam: ``[m | v]`` per row); None without state.
        Sharded tables give a gathered copy."""
        owner = self._collection.gathered() if self._sharded() else self._collection
        state = owner.optimizer_state(table)
        return None if state is None else torch.from_dlpack(state)

    @property
    def step(self) -> int:
        """Backward updates applied so far."""
        return self._collection.step

    def save_checkpoint(self, path) -> None:
        """Writes the tables, their optimizer state and the step count to
        ``path``, Ember's checkpoint format (safetensors with TorchRec's
        names, as Ember's Trainer writes; whole or not at all)."""
        self._collection.save(os.fspath(path))

    def load_checkpoint(self, path) -> None:
        """Reads a checkpoint ``save_checkpoint`` (or Ember's Rust API) wrote
        into the tables, in place: the rows, the step count, and the
        optimizer state when the saved optimizer is of this module's kind
        (choose the optimizer first)."""
        self._collection.load(os.fspath(path))
