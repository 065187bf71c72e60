"""Agreeing: every rank checks that it was given the same training arguments as the others."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from .arguments import TrainArgs

__all__ = ["check_same_arguments"]

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
