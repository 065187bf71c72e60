"""Dropout drawn from the RNG tracker's counter streams (`tpcore.tracked_dropout`).

The mask of a call is a pure function of a `[seed, offset]` snapshot of the stream
(Philox4x32-10, csrc/kernels/philox.h): the `tpcore::dropout` operator saves that snapshot,
not the mask, and its backward applies the same mask to the gradient. Because no torch
generator state is read or swapped, `torch.compile(fullgraph=True)` traces it, compiled and
eager runs draw the same masks, activation recompute replays them, and a CPU and a GPU with
the same seed drop the same elements. Element i of a call is dropped when word i % 4 of
Philox block (offset / 4 + i / 4) is below p * 2^32, i counting in row-major order.
"""

from __future__ import annotations

import torch

from .. import _op_entry
from .random import MODEL_PARALLEL_RNG, REPLICATED_RNG, get_rng_tracker

__all__ = ["tracked_dropout", "region_dropout"]


def tracked_dropout(
    x: torch.Tensor, p: float, stream: str = MODEL_PARALLEL_RNG, training: bool = True
) -> torch.Tensor:
    """`F.dropout(x, p)` (any shape and floating dtype; the result is contiguous) with the mask
    from the tracker's counter `stream`: `MODEL_PARALLEL_RNG` (differs across TP ranks: a
    tensor-parallel or sequence-parallel region) or `REPLICATED_RNG` (identical on them: a
    replicated activation). Needs `tpcore.model_parallel_manual_seed(seed)` first."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"tpcore: tracked_dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    state = get_rng_tracker().draw(stream, x.numel(), x.device)
    return _op_entry.dropout(x, state, p)


def region_dropout(x: torch.Tensor, p: float, training: bool, per_tp_rank: bool) -> torch.Tensor:
    """Dropout whose mask differs across TP ranks when `per_tp_rank` (a TP or sequence-
    parallel region: the model-parallel stream), and is identical on them otherwise (the
    replicated stream; torch's generator where model_parallel_manual_seed was not called)."""
    if not training or p == 0:
        return x
    if not per_tp_rank and not get_rng_tracker().has_counter(REPLICATED_RNG):
        return torch.nn.functional.dropout(x, p)
    return tracked_dropout(x, p, MODEL_PARALLEL_RNG if per_tp_rank else REPLICATED_RNG)
