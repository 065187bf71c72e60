"""Activation recomputation that replays the RNG: dropout masks match on recompute.

`checkpoint(fn, *args)` keeps only the inputs from the forward and reruns `fn` in the
backward. It is `torch.utils.checkpoint` (non-reentrant), which restores the CPU / CUDA
generators and the autocast state and gives gradients to parameters used inside `fn`
even when no input requires grad, plus the model-parallel RNG tracker: its generator states
and dropout counters are put back as they were during the forward, so dropout in TP regions
draws the same masks. The C++ collectives inside `fn` run again, in the same order on every
rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint

try:  # the public selective-checkpoint API (torch 2.4 has only a private one)
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
except ImportError:
    CheckpointPolicy = create_selective_checkpoint_contexts = None

from .random import get_rng_tracker

__all__ = ["checkpoint"]


def _tracker_contexts() -> tuple[
    contextlib.AbstractContextManager, contextlib.AbstractContextManager
]:
    """(forward context, recompute context): the first records the tracker's states as the
    forward starts, the second swaps them in for the recompute and restores the live ones."""
    tracker = get_rng_tracker()
    recorded: dict = {}
    recorded_counters: dict = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        recorded.update(tracker.get_states())
        recorded_counters.update(tracker.counter_snapshot())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        live, live_counters = tracker.get_states(), tracker.counter_snapshot()
        tracker.set_states(recorded)
        tracker.restore_counters(recorded_counters)
        try:
            yield
        finally:
            tracker.set_states(live)
            tracker.restore_counters(live_counters)

    return forward(), recompute()


def _save_rng_snapshots(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op is torch.ops.tpcore.rng_state_copy.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_rng_snapshots() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_save_rng_snapshots)


def checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` whose intermediate activations are recomputed in the backward, not stored."""
    if torch.compiler.is_compiling():
        # Compiled, the recompute is planned by AOTAutograd, which keeps random ops' results
        # rather than redrawing them. tracked_dropout's masks are functions of the counter
        # snapshots its draws copy, which must be kept too (recomputed, they would read the
        # counters as advanced by the whole step): the policy saves them. Forks do not trace
        # (they swap generator states), so nothing else of the tracker's needs replaying.
        # torch 2.4: compiled recompute without dropout only
        if create_selective_checkpoint_contexts is None:
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, context_fn=_keep_rng_snapshots
        )
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=_tracker_contexts
    )
