"""Activation recomputation that replays the RNG: dropout masks match on recompute.

`checkpoint(fn, x)` keeps only `x` from the forward and reruns `fn` in the backward,
with the CPU/CUDA generators and the model-parallel tracker put back as they were, so
dropout draws the same masks and the C++ collectives inside run again, in the same
order on every rank.
"""

from __future__ import annotations

from typing import Callable

import torch

from .random import device_rng_states, get_rng_tracker, set_device_rng_states

__all__ = ["checkpoint"]


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.rng = device_rng_states()
        ctx.tracker = get_rng_tracker().get_states()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        tracker = get_rng_tracker()
        now, now_tracker = device_rng_states(), tracker.get_states()
        set_device_rng_states(ctx.rng)
        tracker.set_states(ctx.tracker)
        try:
            x = x.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(x)
        finally:
            set_device_rng_states(now)
            tracker.set_states(now_tracker)
        torch.autograd.backward(out, grad)
        return None, x.grad


def checkpoint(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` whose intermediate activations are recomputed in the backward, not stored."""
    return _Checkpoint.apply(fn, x)
