"""Failing together: a step that may fail on some ranks only (a file one rank writes, a
folder rank 0 makes) ends with every rank learning who failed and why, so that no rank
goes on into a collective and waits there for a peer that has already left."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

__all__ = ["all_or_none"]

T = TypeVar("T")
_MAX_MESSAGE = 600  # characters of each failed rank's error carried to the others


def all_or_none(
    fn: Callable[[], T],
    what: str,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    error_type: type[Exception] = RuntimeError,
) -> T:
    """Run `fn` on this rank and return its result, or raise on every rank of `group`
    (default: all) if it failed on any. A rank that failed raises its own error; the others
    raise `error_type` saying "`what` failed on rank(s) [...]" followed by each failed
    rank's message. One all-reduce of per-rank flags when all went well; one all-gather of
    the messages more when some failed (every rank knows then, so all of them join it)."""
    error, result = None, None
    try:
        result = fn()
    except Exception as e:
        error = e
    flags = torch.zeros(dist.get_world_size(group), device=device)
    flags[dist.get_rank(group)] = float(error is not None)
    dist.all_reduce(flags, group=group)
    if not flags.any():
        return result
    messages: list = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"[:_MAX_MESSAGE]
    dist.all_gather_object(messages, mine, group=group)
    if error is not None:
        raise error
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    failed = [(r, m) for r, m in zip(ranks, messages) if m is not None]
    details = "; ".join(f"rank {r}: {m}" for r, m in failed)
    raise error_type(f"tpcore: {what} failed on rank(s) {[r for r, _ in failed]}: {details}")
