"""Optimizers applied in backward, with TorchRec's call:
``apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)``.

Ember fuses one optimizer per collection into its backward scatter
(FBGEMM's fused TBE optimizers), so the call takes every table of a
collection at once. The classes it takes (torch's, TorchRec's of the same
names, or subclasses), and what each becomes:

- ``SGD`` (lr): Ember's SGD.
- ``Adagrad`` (lr, eps): Adagrad.
- ``RowWiseAdagrad`` (this module's, or ``torchrec.optim.RowWiseAdagrad``;
  lr, eps): one accumulator per row, the mean of the row's squared
  gradient (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``).
- ``Adam`` (lr, betas, eps): Adam on the rows a batch touches (FBGEMM's
  sparse Adam: untouched rows' moments do not decay, unlike torch's dense
  Adam).

Options not given take the class's own defaults (torch's SGD: lr 1e-3;
Adagrad: lr 1e-2, eps 1e-10; Adam: lr 1e-3, eps 1e-8). Options Ember does
not implement (momentum, weight decay, lr decay, a non-zero initial
accumulator, amsgrad, ...) are refused with a ValueError unless off,
never ignored. The state starts fresh, and the step count
at 0.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Dict, Iterable

import torch


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad (TorchRec's ``torchrec.optim.RowWiseAdagrad``): per row,
    ``s += mean(g**2)``; ``w -= lr * g / (sqrt(s) + eps)``.

    Pass it to ``apply_optimizer_in_backward`` for Ember's tables; on
    ordinary torch parameters (2-D) it steps as written above.
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-2, eps: float = 1e-10) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=torch.float32)
                state["sum"].add_(grad.pow(2).mean(dim=1))
                std = state["sum"].sqrt().add_(group["eps"]).unsqueeze(1)
                p.addcdiv_(grad, std, value=-group["lr"])
        return loss


# The optimizers Ember fuses, by class name (torch's, TorchRec's, or a
# subclass of either), and the options each takes.
_KINDS = {"SGD": "sgd", "Adagrad": "adagrad", "RowWiseAdagrad": "row_wise_adagrad",
          "Adam": "adam"}
_TAKEN = {"sgd": ("lr",), "adagrad": ("lr", "eps"), "row_wise_adagrad": ("lr", "eps"),
          "adam": ("lr", "betas", "eps")}
# Options Ember has no counterpart of: each must be off.
_OFF = {"momentum": 0, "weight_decay": 0, "nesterov": False, "lr_decay": 0,
        "initial_accumulator_value": 0, "amsgrad": False, "maximize": False}
# How torch runs a step (or what only matters with an option that is off):
# nothing of the update's arithmetic.
_IMPLEMENTATION = {"foreach", "fused", "differentiable", "capturable",
                   "decoupled_weight_decay", "dampening"}


def _options(optimizer_class: type) -> Dict[str, Any]:
    """The class's options and defaults; for TorchRec's wrappers, which take
    ``**kwargs``, those of the torch class they wrap."""
    named = {
        n: p.default for n, p in inspect.signature(optimizer_class.__init__).parameters.items()
        if n not in ("self", "params")
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    torch_class = getattr(torch.optim, optimizer_class.__name__, None)
    if not named and torch_class is not None and torch_class is not optimizer_class:
        return _options(torch_class)
    return named


def table_optimizer(optimizer_class: type, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Ember's ``TableOptimizer`` (as a dict) for an optimizer class and its
    options, with the class's own defaults for those not given."""
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    kind = next((_KINDS[c.__name__] for c in getattr(optimizer_class, "__mro__", ())
                 if c.__name__ in _KINDS), None)
    if kind is None:
        raise ValueError(
            f"{name} cannot be fused into Ember's backward: use torch.optim.SGD, "
            "torch.optim.Adagrad, ember.optim.RowWiseAdagrad or torch.optim.Adam "
            "(or TorchRec's classes of those names)"
        )
    options = _options(optimizer_class)
    for key in kwargs:
        if key not in options:
            raise ValueError(f"{name}: unknown option {key}")
    values = {key: kwargs.get(key, default) for key, default in options.items()}
    for key, value in values.items():
        if key in _TAKEN[kind] or key in _IMPLEMENTATION:
            continue
        off = _OFF.get(key, options[key])
        if value != off:
            raise ValueError(f"{name}: {key}={value!r} is not offered by Ember's fused {name}")
    taken = {key: values.get(key) for key in _TAKEN[kind]}
    if any(v is inspect.Parameter.empty or v is None for v in taken.values()):
        raise ValueError(f"{name}: give {', '.join(_TAKEN[kind])}")
    spec: Dict[str, Any] = {"type": kind, "lr": float(taken["lr"])}
    if "eps" in taken:
        spec["eps"] = float(taken["eps"])
    if kind == "adam":
        beta1, beta2 = taken["betas"]
        spec.update(beta1=float(beta1), beta2=float(beta2))
    return spec


class _InBackward:
    """What ``_in_backward_optimizers`` holds on a table's weight (TorchRec's
    marker, read by ``in_backward_optimizer_filter``)."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"ember fused optimizer {self.spec}"


def apply_optimizer_in_backward(
    optimizer_class: type, params: Iterable[torch.Tensor], optimizer_kwargs: Dict[str, Any]
) -> None:
    """Fuses ``optimizer_class(**optimizer_kwargs)`` into the backward of the
    Ember collections whose tables are ``params`` (TorchRec's call). Every
    table of such a collection must be among ``params``: the optimizer is
    the collection's. The state starts fresh."""
    from ember.tables import EmberTables

    spec = table_optimizer(optimizer_class, optimizer_kwargs)
    params = list(params)
    owners: Dict[int, Any] = {}
    for i, p in enumerate(params):
        ref = getattr(p, "_ember_collection", None)
        owner = ref() if ref is not None else None
        if owner is None:
            raise ValueError(
                f"params[{i}] is not a table of an Ember collection: Ember fuses "
                "optimizers into its own tables only (use a torch optimizer for the rest)"
            )
        owners[id(owner)] = owner
    listed = {id(p) for p in params}
    # Every collection checked before any changes: all of them take the
    # optimizer, or none does.
    for owner in owners.values():
        assert isinstance(owner, EmberTables)
        missing = [n for n, p in owner.named_parameters() if id(p) not in listed]
        if missing:
            raise ValueError(
                f"Ember fuses one optimizer per collection; these of its tables are not in "
                f"params: {missing}"
            )
        if owner._collection.optimizer_state_viewed():
            raise RuntimeError(
                "the optimizer state is viewed by a live tensor: let go of the views "
                "(optimizer_state) before replacing the optimizer"
            )
    for owner in owners.values():
        owner._collection.set_optimizer(json.dumps(spec))
        for w in owner.parameters():
            w._in_backward_optimizers = [_InBackward(spec)]


def in_backward_optimizer_filter(named_parameters, include: bool = False):
    """The named parameters with no optimizer applied in backward (with
    ``include=True``, those with one), as TorchRec's filter: the rest is for
    a dense optimizer."""
    for name, param in named_parameters:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param
