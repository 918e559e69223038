"""Optimizers applied in backward, with TorchRec's call:
``apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)``.

Ember fuses one optimizer per collection into its backward scatter
(FBGEMM's fused TBE optimizers), so the call takes every table of a
collection at once. The classes it takes, and what each becomes:

- ``torch.optim.SGD`` (lr): Ember's SGD.
- ``torch.optim.Adagrad`` (lr, eps; torch's default eps 1e-10): Adagrad.
- ``RowWiseAdagrad`` (this module's, or ``torchrec.optim.RowWiseAdagrad``;
  lr, eps, default 1e-10): one accumulator per row, the mean of the row's
  squared gradient (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``).
- ``torch.optim.Adam`` (lr, betas, eps): Adam on the rows a batch touches
  (FBGEMM's sparse Adam: untouched rows' moments do not decay, unlike
  torch's dense Adam).

Options Ember does not implement (momentum, weight decay, lr decay, a
non-zero initial accumulator, amsgrad, ...) are refused with a ValueError
rather than ignored.
"""

from __future__ import annotations

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


def _refuse_unsupported(name: str, kwargs: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    for key, value in kwargs.items():
        if key in defaults and value != defaults[key]:
            raise ValueError(f"{name}: {key}={value!r} is not offered by Ember's fused {name}")
        if key not in defaults and key not in ("lr", "eps", "betas"):
            raise ValueError(f"{name}: unknown option {key}")


def table_optimizer(optimizer_class: type, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Ember's ``TableOptimizer`` (as a dict) for a torch optimizer class and its options."""
    kwargs = dict(kwargs)
    lr = float(kwargs.get("lr", 1e-3 if optimizer_class is torch.optim.Adam else 1e-2))
    if optimizer_class is torch.optim.SGD:
        _refuse_unsupported(
            "SGD", kwargs, {"momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False,
                            "maximize": False, "foreach": None, "differentiable": False}
        )
        return {"type": "sgd", "lr": lr}
    if optimizer_class is torch.optim.Adagrad:
        _refuse_unsupported(
            "Adagrad", kwargs, {"lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0,
                                "maximize": False, "foreach": None, "differentiable": False}
        )
        return {"type": "adagrad", "lr": lr, "eps": float(kwargs.get("eps", 1e-10))}
    if optimizer_class.__name__ == "RowWiseAdagrad":
        _refuse_unsupported(
            "RowWiseAdagrad", kwargs, {"lr_decay": 0, "weight_decay": 0,
                                       "initial_accumulator_value": 0, "maximize": False}
        )
        return {"type": "row_wise_adagrad", "lr": lr, "eps": float(kwargs.get("eps", 1e-10))}
    if optimizer_class is torch.optim.Adam:
        _refuse_unsupported(
            "Adam", kwargs, {"weight_decay": 0, "amsgrad": False, "maximize": False,
                             "foreach": None, "capturable": False, "differentiable": False,
                             "fused": None}
        )
        beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
        return {"type": "adam", "lr": lr, "beta1": float(beta1), "beta2": float(beta2),
                "eps": float(kwargs.get("eps", 1e-8))}
    raise ValueError(
        f"{optimizer_class.__name__} cannot be fused into Ember's backward: use "
        "torch.optim.SGD, torch.optim.Adagrad, ember.optim.RowWiseAdagrad or torch.optim.Adam"
    )


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
    from ember.modules import EmbeddingBagCollection

    spec = table_optimizer(optimizer_class, optimizer_kwargs)
    params = list(params)
    owners: Dict[int, Any] = {}
    for i, p in enumerate(params):
        ref = getattr(p, "_ember_collection", None)
        owner = ref() if ref is not None else None
        if owner is None:
            raise ValueError(
                f"params[{i}] is not a table of an ember.EmbeddingBagCollection: Ember fuses "
                "optimizers into its own tables only (use a torch optimizer for the rest)"
            )
        owners[id(owner)] = owner
    for owner in owners.values():
        assert isinstance(owner, EmbeddingBagCollection)
        weights = list(owner.parameters())
        listed = {id(p) for p in params}
        missing = [n for n, p in owner.named_parameters() if id(p) not in listed]
        if missing:
            raise ValueError(
                f"Ember fuses one optimizer per collection; these of its tables are not in "
                f"params: {missing}"
            )
        owner._collection.set_optimizer(json.dumps(spec))
        for w in weights:
            w._in_backward_optimizers = [_InBackward(spec)]


def in_backward_optimizer_filter(named_parameters, include: bool = False):
    """The named parameters with no optimizer applied in backward (with
    ``include=True``, those with one), as TorchRec's filter: the rest is for
    a dense optimizer."""
    for name, param in named_parameters:
        if hasattr(param, "_in_backward_optimizers") == include:
            yield name, param
