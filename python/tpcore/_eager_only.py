"""`eager_only`: functions that torch.compile runs eagerly, behind one graph break."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable)


def eager_only(fn: Fn) -> Fn:
    """`fn`, which dynamo does not trace: under torch.compile the call is a graph break and
    `fn` runs eagerly; outside it, `fn` is called directly.

    Why not `torch.compiler.disable` alone: it imports torch._dynamo when it decorates, and
    torch's lazy form of it (`torch._disable_dynamo`) at the first call, eager calls
    included: 2 s of CPU in every process that never compiles (each rank of an eager
    trainer whose tied embedding routes its gradient to a sink paid it at its first step).
    The wrapper asks `torch.compiler.is_compiling()`, which dynamo reads as True while it
    traces, and reaches dynamo only then."""
    disabled = getattr(torch, "_disable_dynamo", torch.compiler.disable)(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
