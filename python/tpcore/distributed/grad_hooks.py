"""Callbacks that tie autograd to a `DataParallelGrads` without keeping it alive.

A parameter's hooks and a weight's gradient sink live where Python's garbage collector
cannot see them (C++, or a module-level registry): a bound method there would make
parameter -> hook -> buffers -> parameter a cycle nothing frees, keeping the model, the
buffers and the process groups alive until the interpreter exits. These hold weak
references; once the owner is gone they do what autograd would do without it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..tensor_parallel.gradient_sink import detach_gradient_sink
from .sparse_rows import add_token_rows

if TYPE_CHECKING:
    from .data_parallel import DataParallelGrads

__all__ = ["detach_sinks", "weak_hook", "weak_sink", "weak_use"]


def detach_sinks(sinks: list[tuple[nn.Parameter, Callable]]) -> None:
    """Give the lookup gradients back to autograd: each `(parameter, sink)`, if that sink is
    still the one attached (a newer owner's is left alone)."""
    for p, sink in sinks:
        detach_gradient_sink(p, sink)


def weak_sink(
    grads: DataParallelGrads, p: nn.Parameter
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`grads._on_lookup_grad` for `p`, without strong references (see `weak_hook`). Once
    `grads` is gone the gradient goes back to `p.grad`, as without a sink."""
    ref, param = weakref.ref(grads), weakref.ref(p)

    def sink(rows: torch.Tensor, token_grads: torch.Tensor) -> None:
        owner, target = ref(), param()
        if target is None:
            return
        if owner is not None:
            owner._on_lookup_grad(target, rows, token_grads)
        else:  # a backward in flight when the buffers went: as without a sink
            grad = add_token_rows(torch.zeros_like(target), rows, token_grads)
            target.grad = grad if target.grad is None else target.grad + grad

    return sink


def weak_use(grads: DataParallelGrads, p: nn.Parameter) -> Callable[[torch.Tensor], None]:
    """`grads._on_lookup` for `p`, without strong references (see `weak_hook`)."""
    ref, param = weakref.ref(grads), weakref.ref(p)

    def on_use(rows: torch.Tensor) -> None:
        owner, target = ref(), param()
        if owner is not None and target is not None:
            owner._on_lookup(target, rows)

    return on_use


def weak_hook(grads: DataParallelGrads) -> Callable[[nn.Parameter], None]:
    """`grads._on_grad`, for every parameter's post-accumulation hook, without a strong
    reference to `grads`."""
    ref = weakref.ref(grads)

    def hook(p: nn.Parameter) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad(p)

    return hook
