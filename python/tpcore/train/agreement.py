"""Failing together: a step that may fail on some ranks only (a file one rank writes, a
folder rank 0 makes) ends with every rank learning who failed and why, so that no rank
goes on into a collective and waits there for a peer that has already left. And agreeing:
every rank checks that it was given the same training arguments as the others."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, TypeVar

import torch
import torch.distributed as dist

from .errors import CheckpointError

if TYPE_CHECKING:
    from .arguments import TrainArgs

__all__ = ["all_or_none", "check_same_arguments"]

T = TypeVar("T")
_MAX_MESSAGE = 600  # characters of each failed rank's error carried to the others


def all_or_none(
    fn: Callable[[], T],
    what: str,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    error_type: type[Exception] = CheckpointError,
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


# Paths may legitimately differ between hosts (node-local copies of the same data); only
# whether each is given is compared. Cosmetic flags that act on rank 0 alone are left out.
_PATH_FIELDS = (
    "data_path",
    "data_cache_path",
    "tokenizer",
    "load_hf",
    "save_hf",
    "log_dir",
    "save",
    "load",
)
_NOT_COMPARED = ("progress", "log_interval")


def check_same_arguments(args: TrainArgs) -> None:
    """Raise ValueError on every rank, naming each differing flag and its value on each rank,
    unless every rank got the same training arguments (`args`, a TrainArgs). A rank with
    another --seed (a per-rank environment or config file) would draw other replicated
    weights and dropout masks and train a model no rank agrees on, with exit status 0;
    another --train-iters or --save-interval would hang in a collective. One
    all-gather of the arguments, on the default group: call it before any other collective."""
    mine = {}
    for name, value in dataclasses.asdict(args).items():
        if name in _NOT_COMPARED:
            continue
        if name in _PATH_FIELDS and not (name == "tokenizer" and value == "byte"):
            value = "(a path)" if value is not None else None
        mine[name] = value
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differing = []
    for name in mine:
        values = [ranks[name] for ranks in everyone]
        if any(v != values[0] for v in values):
            by_value: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                by_value.setdefault(repr(value), []).append(rank)
            differing.append(
                f"--{name.replace('_', '-')}: "
                + ", ".join(f"{v} on rank(s) {r}" for v, r in by_value.items())
            )
    if differing:
        raise ValueError(
            "tpcore: the ranks were given different training arguments: "
            + "; ".join(differing)
            + (
                ". Launch every rank with the same flags and --config file (a per-rank environment "
                "variable or config?)"
            )
        )
