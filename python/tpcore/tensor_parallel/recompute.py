"""Activation recomputation that replays the RNG: dropout masks match on recompute.

`checkpoint(fn, *args)` keeps only the inputs from the forward and reruns `fn` in the
backward. It is `torch.utils.checkpoint` (non-reentrant), which restores the CPU / CUDA
generators and the autocast state and gives gradients to parameters used inside `fn`
even when no input requires grad, plus the model-parallel RNG tracker: its states are put
back as they were during the forward, so dropout in TP regions draws the same masks. The
C++ collectives inside `fn` run again, in the same order on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint

from .random import get_rng_tracker

__all__ = ["checkpoint"]


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward context, recompute context): the first records the tracker's states as the
    forward starts, the second swaps them in for the recompute and restores the live ones."""
    tracker = get_rng_tracker()
    recorded: dict = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        recorded.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        live = tracker.get_states()
        tracker.set_states(recorded)
        try:
            yield
        finally:
            tracker.set_states(live)

    return forward(), recompute()


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` whose intermediate activations are recomputed in the backward, not stored."""
    if torch.compiler.is_compiling():
        # Compiled, the recompute is planned by AOTAutograd, which keeps random ops' results
        # rather than redrawing them; the tracker's forks do not trace (they swap generator
        # states), so there is nothing of its to replay.
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_tracker_contexts)
