"""Send the gradient of one use of a weight to a callback instead of `weight.grad`.

A tied word embedding is used twice: as the LM head, whose gradient is dense and complete
at the start of the backward pass, and as the lookup table, whose gradient is row-sparse
(only the rows of the batch's tokens) and complete only at its end. Autograd sums both
before the parameter's gradient hooks run, so a data-parallel reduction of that parameter
could only start when the backward ends. A layer that calls `route_gradient(weight)` for
one use lets its owner (`DataParallelGrads`) take that use's gradient apart: the LM head's
then reaches `weight.grad` early, and the lookup's goes to the sink.

Nothing changes while no sink is attached: `route_gradient` returns `weight` itself.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["attach_gradient_sink", "detach_gradient_sink", "route_gradient"]

_ATTRIBUTE = "_tpcore_gradient_sink"
_ON_USE = "_tpcore_gradient_sink_on_use"

GradientSink = Callable[[torch.Tensor, "torch.Tensor | None"], None]
"""`sink(grad, rows)`: the gradient of one use (shaped like the weight) and the rows of the
weight that use read (int64 `[n]`, possibly repeated; the gradient is zero elsewhere), or
None when the layer did not say."""


class _ToSink(torch.autograd.Function):
    """Identity on `weight` (passed detached); backward hands the gradient to `sink`.

    The weight enters detached, so this use adds no edge to the parameter's gradient
    accumulator, which therefore runs as soon as its other uses are done. `anchor`, a fresh
    empty tensor that requires grad, only makes the output differentiable."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, weight: torch.Tensor, sink: GradientSink, rows: torch.Tensor | None) -> torch.Tensor:
        ctx.sink, ctx.rows = sink, rows
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.sink(grad, ctx.rows)
        return None, None, None, None


def attach_gradient_sink(weight: torch.nn.Parameter, sink: GradientSink,
                         on_use: Callable[[torch.Tensor | None], None] | None = None) -> None:
    """From now on, the gradient of every use of `weight` that goes through
    `route_gradient` is passed to `sink(grad, rows)` and not accumulated into `weight.grad`;
    `on_use(rows)`, if given, is called at each such use in the forward pass."""
    if getattr(weight, _ATTRIBUTE, None) is not None:
        raise RuntimeError("tpcore: attach_gradient_sink: this parameter already has a gradient sink")
    setattr(weight, _ATTRIBUTE, sink)
    setattr(weight, _ON_USE, on_use)


def detach_gradient_sink(weight: torch.nn.Parameter) -> None:
    for name in (_ATTRIBUTE, _ON_USE):
        if hasattr(weight, name):
            delattr(weight, name)


def route_gradient(weight: torch.Tensor, rows: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """`weight` for a use whose gradient goes to the weight's sink, if it has one. `rows`,
    called only then, returns the rows this use reads (an embedding lookup's local ids)."""
    sink = getattr(weight, _ATTRIBUTE, None)
    if sink is None or not (weight.requires_grad and torch.is_grad_enabled()):
        return weight
    read = rows() if rows is not None else None
    on_use = getattr(weight, _ON_USE, None)
    if on_use is not None:
        on_use(read)
    anchor = torch.empty(0, device=weight.device, requires_grad=True)
    return _ToSink.apply(anchor, weight.detach(), sink, read)
