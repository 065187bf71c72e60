"""Send the gradient of one use of a weight to a callback instead of `weight.grad`.

A tied word embedding is used twice: as the LM head, whose gradient is dense and complete
at the start of the backward pass, and as the lookup table, whose gradient is row-sparse
(only the rows of the batch's tokens) and complete only at its end. Autograd sums both
before the parameter's gradient hooks run, so a data-parallel reduction of that parameter
could only start when the backward ends. A layer that calls `route_gradient(weight)` for
one use lets its owner (`DataParallelGrads`) take that use's gradient apart: the LM head's
then reaches `weight.grad` early, and the lookup's goes to the sink.

Nothing changes while no sink is attached: `route_gradient` returns `weight` itself (and
torch.compile traces through it). With a sink attached:
- the routed use runs eagerly (`torch.compiler.disable`: a graph break under torch.compile,
  an error with `fullgraph=True`);
- the weight enters that use detached, so `torch.autograd.grad(loss, weight)` and
  `backward(inputs=[weight])` do not see its gradient, which only the sink gets.
Sinks are kept in a registry by the parameter's id (an entry goes when its parameter
dies), not on the parameter: a deep copy of the model does not share its sinks.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

__all__ = ["attach_gradient_sink", "detach_gradient_sink", "route_gradient"]

GradientSink = Callable[[torch.Tensor, "torch.Tensor | None"], None]
"""`sink(grad, rows)`: the gradient of one use (shaped like the weight) and the rows of the
weight that use read (int64 `[n]`, possibly repeated, `weight.shape[0]` meaning none; the
gradient is zero elsewhere), or None when the layer did not say."""

OnUse = Callable[["torch.Tensor | None"], None]

# id(parameter) -> (weak reference to it, sink, on_use, finalizer dropping the entry when
# the parameter dies). route_gradient returns at once while the registry is empty: all that
# torch.compile sees of it in a model without sinks. (A WeakKeyDictionary cannot hold
# tensors: it compares keys with ==, which is elementwise.)
_SINKS: dict[int, tuple] = {}


def _forget(key: int) -> None:
    _SINKS.pop(key, None)


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


def attach_gradient_sink(weight: torch.nn.Parameter, sink: GradientSink, on_use: OnUse | None = None) -> None:
    """From now on, the gradient of every use of `weight` that goes through
    `route_gradient` is passed to `sink(grad, rows)` and not accumulated into `weight.grad`;
    `on_use(rows)`, if given, is called at each such use in the forward pass."""
    if _entry(weight) is not None:
        raise RuntimeError("tpcore: attach_gradient_sink: this parameter already has a gradient sink")
    _SINKS[id(weight)] = (weakref.ref(weight), sink, on_use, weakref.finalize(weight, _forget, id(weight)))


def detach_gradient_sink(weight: torch.nn.Parameter) -> None:
    entry = _entry(weight)
    if entry is not None:
        entry[3].detach()
        del _SINKS[id(weight)]


def _entry(weight: torch.Tensor) -> tuple | None:
    entry = _SINKS.get(id(weight))
    return entry if entry is not None and entry[0]() is weight else None


def route_gradient(weight: torch.Tensor, rows: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """`weight` for a use whose gradient goes to the weight's sink, if it has one. `rows`,
    called only then, returns the rows this use reads (an embedding lookup's local ids)."""
    if not _SINKS:
        return weight
    return _route(weight, rows)


@torch.compiler.disable
def _route(weight: torch.Tensor, rows: Callable[[], torch.Tensor] | None) -> torch.Tensor:
    entry = _entry(weight)
    if entry is None or not (weight.requires_grad and torch.is_grad_enabled()):
        return weight
    _, sink, on_use, _ = entry
    read = rows() if rows is not None else None
    if on_use is not None:
        on_use(read)
    anchor = torch.empty(0, device=weight.device, requires_grad=True)
    return _ToSink.apply(anchor, weight.detach(), sink, read)
