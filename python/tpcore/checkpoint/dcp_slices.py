"""The distributed optimizer's state in torch's distributed checkpoint (DCP), without
gathering it.

`DistributedAdamW` keeps, on each DP rank, the elements `[lo, hi)` of each parameter's
flattened TP piece. DCP stores boxes of the global tensor, so this rank's flat slice of a
`[rows, cols]` piece is cut into at most three boxes (the rest of its first row, the full
rows, the start of its last row), each cut again where the piece's ranges in the global
tensor end (fused parts, vocabulary padding; `ShardSpec.ranges`). The slice is copied into a
buffer of the rows it touches, and the buffer carries DCP's `CheckpointableTensor` fields
naming those boxes: extra memory is this rank's slice plus at most two rows per parameter,
never the TP piece. The names and global shapes are those of every other optimizer's state
(`state.<parameter>.exp_avg`, ...), so a checkpoint written with the distributed optimizer
loads without it and at another DP size, and the other way round.

Saving writes only the boxes this rank owns (one source per element: replicated norms from
TP rank 0, replicated key/value heads from their owner); loading reads every box of the
slice, copies included. An MoE layer's `[experts, rows, cols]` weights are stored as their
`[experts x rows, cols]` view (`shard_spec.as_rows`), as every optimizer's state of them is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..tensor_parallel.shard_spec import ShardSpec, as_rows, shard_spec

__all__ = ["slice_state_dict", "load_slice_state_dict", "has_checkpointable"]


def has_checkpointable() -> bool:
    """Whether this torch's DCP takes tensors carrying their global layout (torch 2.15+)."""
    try:
        from torch.distributed.checkpoint.protocol import CheckpointableTensor  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class _Cover:
    """What a flat slice `[lo, hi)` of a piece touches. 2-D `[rows, cols]` piece: rows
    `[row_lo, row_hi)`, held in a `[row_hi - row_lo, cols]` buffer with the slice at flat
    offset `lo - row_lo * cols`. 1-D piece: the slice itself is the buffer."""

    lo: int
    hi: int
    cols: int | None = None  # None: a 1-D piece

    @property
    def row_lo(self) -> int:
        return self.lo // self.cols

    @property
    def row_hi(self) -> int:
        return (self.hi - 1) // self.cols + 1

    @property
    def shape(self) -> tuple[int, ...]:
        if self.cols is None:
            return (self.hi - self.lo,)
        return (self.row_hi - self.row_lo, self.cols)

    @property
    def offset(self) -> int:
        """Where the slice starts in the flattened buffer."""
        return 0 if self.cols is None else self.lo - self.row_lo * self.cols


def _cover(shape: tuple[int, ...], lo: int, hi: int) -> _Cover:
    """What the flat slice `[lo, hi)` of a piece of `shape` touches; an N-D piece counts as
    its rows of the last dim (`shard_spec.as_rows`)."""
    if len(shape) == 1:
        return _Cover(lo, hi)
    return _Cover(lo, hi, shape[-1])


def _row_boxes(c: _Cover) -> list[tuple[int, int, int, int]]:
    """A 2-D slice as boxes of its piece, `(row, rows, col, cols)`: the rest of its first
    row, its full rows, the start of its last row (those that are not empty)."""
    first, last = c.lo - c.row_lo * c.cols, c.hi - (c.row_hi - 1) * c.cols
    if c.row_hi - c.row_lo == 1:
        return [(c.row_lo, 1, first, last - first)]
    full_lo = c.row_lo + (1 if first else 0)
    full_hi = c.row_hi - (1 if last < c.cols else 0)
    boxes = [(c.row_lo, 1, first, c.cols - first)] if first else []
    if full_hi > full_lo:
        boxes.append((full_lo, full_hi - full_lo, 0, c.cols))
    if last < c.cols:
        boxes.append((c.row_hi - 1, 1, 0, last))
    return boxes


def _clip(start: int, length: int, ranges) -> list[tuple[int, int, int]]:
    """`[start, start + length)` of the piece (along the split dim) cut by the piece's
    ranges in the global tensor: `(local start, global start, length)` of each part."""
    out = []
    for local_start, global_start, n in ranges:
        a, b = max(start, local_start), min(start + length, local_start + n)
        if a < b:
            out.append((a, a - local_start + global_start, b - a))
    return out


def _boxes(spec: ShardSpec, c: _Cover, owned: bool) -> list[tuple[tuple[int, ...], ...]]:
    """`(global offsets, buffer offsets, sizes)` of every box of the slice that lies in the
    global tensor (`owned`: in the ranges this rank owns)."""
    dim, ranges = spec.ranges(owned=owned)
    if c.cols is None:
        return [((g,), (a - c.lo,), (n,)) for a, g, n in _clip(c.lo, c.hi - c.lo, ranges)]
    out = []
    for row, rows, col, cols in _row_boxes(c):
        if dim == 0:
            for a, g, n in _clip(row, rows, ranges):
                out.append(((g, col), (a - c.row_lo, col), (n, cols)))
        else:
            for a, g, n in _clip(col, cols, ranges):
                out.append(((row, g), (row - c.row_lo, a), (rows, n)))
    return out


def _checkpointable(buffer: torch.Tensor, spec: ShardSpec, boxes) -> torch.Tensor:
    out = buffer.detach()
    out.global_shape = tuple(spec.global_shape)
    out.global_offsets = tuple(tuple(g) for g, _, _ in boxes)
    out.local_offsets = tuple(tuple(b) for _, b, _ in boxes)
    out.local_sizes = tuple(tuple(s) for _, _, s in boxes)
    return out


def _pieces(optimizer):
    """(piece, its state {key: 1-D tensor of hi - lo elements, "step"}) of every slice."""
    for piece in optimizer.pieces:
        state = optimizer.adam.state.get(piece.master, {}) if optimizer.adam else {}
        entry = {
            "exp_avg": state.get("exp_avg", torch.zeros_like(piece.master)),
            "exp_avg_sq": state.get("exp_avg_sq", torch.zeros_like(piece.master)),
            "step": state.get("step", torch.zeros((), dtype=torch.float32)),
        }
        if piece.param.dtype != torch.float32:
            entry["master"] = piece.master
        yield piece, entry


def slice_state_dict(optimizer, *, for_load: bool) -> dict:
    """`{"state": {name: {key: value}}}` of a DistributedAdamW's slices for DCP: tensors as
    row buffers carrying their boxes, the step as it is, plus the loss scaler. Saving
    (`for_load=False`) names only the boxes this rank owns; a parameter it owns none of is
    left out."""
    if not has_checkpointable():
        raise NotImplementedError(
            "tpcore: the distributed optimizer's state in DCP needs torch 2.15 or newer "
            "(DCP's CheckpointableTensor); save with the 'torch' format"
        )
    tp_rank = dist.get_rank(optimizer.tp_group)
    state = {}
    for piece, entry in _pieces(optimizer):
        spec = as_rows(shard_spec(piece.param))  # [experts, rows, cols]: as [rows, cols]
        if not for_load and spec.kind == "replicated" and tp_rank != 0:
            continue  # every TP rank holds the same replicated slice: TP rank 0 writes it
        cover = _cover(tuple(piece.param.shape), piece.lo, piece.hi)
        boxes = _boxes(spec, cover, owned=not for_load)
        if not boxes:
            continue
        out = {}
        for key, value in entry.items():
            if key == "step":
                out[key] = value
                continue
            buffer = torch.zeros(cover.shape, dtype=torch.float32, device=value.device)
            if not for_load:  # (loading: what no box covers, vocabulary padding, stays zero)
                buffer.view(-1)[cover.offset : cover.offset + value.numel()].copy_(value)
            out[key] = _checkpointable(buffer, spec, boxes)
        state[piece.name] = out
    result: dict = {"state": state}
    if optimizer.scaler is not None:
        result["loss_scaler"] = optimizer.scaler.state_dict()
    return result


def load_slice_state_dict(optimizer, state_dict: dict) -> None:
    """Write a loaded `slice_state_dict(optimizer, for_load=True)` into the optimizer (a
    collective over DP: the parameters are gathered again). A missing `master` (saved in
    fp32) is taken from the loaded parameters."""
    shards = {}
    for piece, entry in _pieces(optimizer):
        loaded = state_dict["state"].get(piece.name)
        if loaded is None:  # a slice of vocabulary padding only: nothing in the checkpoint
            shards[piece.name] = {"lo": piece.lo, "hi": piece.hi}
            continue
        cover = _cover(tuple(piece.param.shape), piece.lo, piece.hi)
        out = {"lo": piece.lo, "hi": piece.hi}
        for key, value in loaded.items():
            if key == "step":
                out[key] = value.clone() if torch.is_tensor(value) else torch.tensor(value)
            else:
                flat = value.reshape(-1)[cover.offset : cover.offset + piece.hi - piece.lo]
                out[key] = flat.clone()
        shards[piece.name] = out
    optimizer.load_state_dict({"shards": shards, "loss_scaler": state_dict.get("loss_scaler")})
