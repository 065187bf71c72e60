"""Send the gradient of an embedding lookup to a callback, token by token, instead of
`weight.grad`.

A tied word embedding is used twice: as the LM head, whose gradient is dense and complete
at the start of the backward pass, and as the lookup table, whose gradient is row-sparse
(only the rows of the batch's tokens) and complete only at its end. Autograd sums both
before the parameter's gradient hooks run, so a data-parallel reduction of that parameter
could only start when the backward ends. A lookup that goes through `route_lookup_gradient`
lets the weight's owner (`DataParallelGrads`) take that use apart: the LM head's gradient
then reaches `weight.grad` early, and the lookup's goes to the sink as the gradient of each
token's row, `[tokens, h]`, never as a `[vocab/tp, h]` table (zero outside a few rows, it
would cost a pass over the whole table per micro-batch).

Nothing changes while no sink is attached: `has_gradient_sink` is False at once, and the
layer runs as before (torch.compile traces it). With a sink attached:
- the routed lookup runs eagerly (`torch.compiler.disable`: a graph break under
  torch.compile, an error with `fullgraph=True`);
- the lookup reads the weight detached, so `torch.autograd.grad(loss, weight)` and
  `backward(inputs=[weight])` do not see its gradient, which only the sink gets.
Sinks are kept in a registry by the parameter's id (an entry goes when its parameter
dies), not on the parameter: a deep copy of the model does not share its sinks.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

__all__ = [
    "attach_gradient_sink",
    "detach_gradient_sink",
    "has_gradient_sink",
    "route_lookup_gradient",
]

GradientSink = Callable[[torch.Tensor, torch.Tensor], None]
"""`sink(rows, grads)`: `rows` int64 `[n]`, the row of the weight each token read
(`weight.shape[0]` for none: another rank's id, or the padding id), and `grads` `[n, h]`,
the gradient of each token's row (ignored where `rows` is none)."""

OnUse = Callable[[torch.Tensor], None]
"""`on_use(rows)`: called at each routed lookup in the forward pass, `rows` as above."""

# id(parameter) -> (weak reference to it, sink, on_use, finalizer dropping the entry when
# the parameter dies). has_gradient_sink returns at once while the registry is empty: all
# that torch.compile sees of it in a model without sinks. (A WeakKeyDictionary cannot hold
# tensors: it compares keys with ==, which is elementwise.)
_SINKS: dict[int, tuple] = {}


def _forget(key: int) -> None:
    _SINKS.pop(key, None)


class _LookupToSink(torch.autograd.Function):
    """The lookup `lookup()` (of the detached weight); backward hands the gradient of each
    token's row to `sink`. `anchor`, a fresh empty tensor that requires grad, only makes the
    output differentiable. The output is the lookup's own tensor, not a view, so that
    in-place changes to it (`x += positions`) work as without a sink."""

    @staticmethod
    def forward(
        ctx,
        anchor: torch.Tensor,
        lookup: Callable[[], torch.Tensor],
        sink: GradientSink,
        rows: torch.Tensor,
        gather: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        ctx.sink, ctx.rows, ctx.gather = sink, rows, gather
        return lookup()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        if ctx.gather is not None:
            grad = ctx.gather(grad)
        ctx.sink(ctx.rows, grad.reshape(-1, grad.shape[-1]))
        return None, None, None, None, None


def attach_gradient_sink(
    weight: torch.nn.Parameter, sink: GradientSink, on_use: OnUse | None = None
) -> None:
    """From now on, the gradient of every lookup of `weight` that goes through
    `route_lookup_gradient` is passed to `sink(rows, grads)` and not accumulated into
    `weight.grad`; `on_use(rows)`, if given, is called at each such lookup."""
    if _entry(weight) is not None:
        raise RuntimeError(
            "tpcore: attach_gradient_sink: this parameter already has a gradient sink"
        )
    _SINKS[id(weight)] = (
        weakref.ref(weight),
        sink,
        on_use,
        weakref.finalize(weight, _forget, id(weight)),
    )


def detach_gradient_sink(weight: torch.nn.Parameter, sink: GradientSink | None = None) -> None:
    """Give `weight`'s lookup gradients back to autograd; with `sink`, only if that is the
    sink attached (an owner going away leaves a newer owner's sink alone)."""
    entry = _entry(weight)
    if entry is not None and (sink is None or entry[1] is sink):
        entry[3].detach()
        del _SINKS[id(weight)]


def _entry(weight: torch.Tensor) -> tuple | None:
    entry = _SINKS.get(id(weight))
    return entry if entry is not None and entry[0]() is weight else None


def has_gradient_sink(weight: torch.Tensor) -> bool:
    """Whether a lookup of `weight` should go through `route_lookup_gradient` (a sink is
    attached, and the weight would get a gradient)."""
    if not _SINKS:
        return False
    return _entry(weight) is not None and weight.requires_grad and torch.is_grad_enabled()


def route_lookup_gradient(
    weight: torch.Tensor,
    lookup: Callable[[], torch.Tensor],
    rows: torch.Tensor,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """`lookup()`, a lookup of `weight.detach()`, made differentiable so that its gradient
    goes to the weight's sink: `rows` `[n]` as the sink takes them, in the order of the
    output's tokens once `gather` (if given) has been applied to the output's gradient
    (sequence parallelism: the all-gather of the lookup's own backward)."""
    entry = _entry(weight)
    if entry is None:
        raise RuntimeError(
            "tpcore: route_lookup_gradient: this weight has "
            "no gradient sink (check has_gradient_sink first)"
        )
    _, sink, on_use, _ = entry
    if on_use is not None:
        on_use(rows)
    anchor = torch.empty(0, device=weight.device, requires_grad=True)
    return _LookupToSink.apply(anchor, lookup, sink, rows, gather)
