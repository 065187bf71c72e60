"""The shard spec: how a parameter's local tensor is cut from its global (dense) tensor.

Every parameter a tpcore layer creates carries one (`param.shard_spec`). Checkpoints,
resharding, DCP, the Hugging Face bridge, the optimizers and the gradient norm read it, so
a new kind of layer needs no edit anywhere else. A spec is the logical tensor (global shape,
split dim, named parts, vocabulary padding: the same at every TP size) plus where this
piece sits (`tp_size`, `tp_rank`, `group`); `spec.at(tp, rank)` is the same tensor's piece
at another TP size, which is what resharding compares.

Kinds (`spec.kind`):
- "replicated": `dim` is None; every rank holds the whole tensor. With `partial_grad` each
  rank's gradient is only its share (sequence-parallel norms) and is summed over the group.
- "parts": split along `dim`. The global tensor is the concatenation along `dim` of its
  `parts` (q / k / v, gate / up, or one unnamed part); part k is made of `units`
  indivisible pieces (heads, rows) and every rank holds its chunk of each part, in part
  order. So the global layout does not depend on the TP size: whole heads of Q, K and V stay
  together on a rank. A part with fewer units than ranks (grouped-query attention with
  fewer KV heads than TP) is cut into one chunk per unit, each chunk replicated over
  `tp / units` adjacent ranks: rank r holds chunk `r * units // tp`, and the first rank of
  the copies owns it (a checkpoint reads and writes it once, a gradient norm counts it once).
- "vocab": rows split with padding: the global tensor has `global_shape[0]` real rows, the
  local one `pad_vocab_size(rows, tp, vocab_multiple) / tp`; rows past the real ones are
  padding (zero, in no checkpoint).

`axis` names the kind of group the split is over: "tensor" (the TP group), or "expert" (an
MoE layer's expert weights `[experts, ...]`, split along dim 0 over the expert-parallel
group; `tp_size` / `tp_rank` are then the EP size and rank). Expert weights are replicated
over the expert-data-parallel group, which sums their gradients (at EP 1, every rank holds
every expert and `partial_grad` sums their shares over TP).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from .. import comm
from .._validation import check_positive_ints

__all__ = [
    "pad_vocab_size",
    "Part",
    "ShardSpec",
    "shard_spec",
    "set_shard_spec",
    "shard",
    "merge",
    "merged_views",
    "unshard",
    "copy_overlap",
    "shares_indices",
    "part_chunks",
    "as_rows",
]


def pad_vocab_size(
    vocab_size: int, tensor_parallel_size: int, make_vocab_size_divisible_by: int = 128
) -> int:
    """`vocab_size` rounded up to a multiple of
    `make_vocab_size_divisible_by * tensor_parallel_size`."""
    check_positive_ints(
        "pad_vocab_size",
        vocab_size=vocab_size,
        tensor_parallel_size=tensor_parallel_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )
    multiple = make_vocab_size_divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class Part:
    """A named block of a fused tensor along the split dim."""

    name: str
    """"q", "k", "v", "gate", "up", or "" for a tensor of one part."""
    size: int
    """Its extent along the split dim in the global tensor."""
    units: int
    """Indivisible pieces it is made of (heads, or rows): a chunk never cuts one."""


def part_chunks(units: int, tp: int) -> int:
    """Into how many chunks a part of `units` whole units is cut at TP size `tp`: `tp`, or
    one per unit (each replicated over `tp // units` ranks) when fewer units divide `tp`."""
    if units % tp == 0:
        return tp
    if tp % units == 0:
        return units
    raise ValueError(
        f"tpcore: a part of {units} heads cannot be split over the "
        f"tensor-parallel size {tp} (neither divides the other)"
    )


@dataclass(frozen=True)
class ShardSpec:
    """How this rank's piece of a parameter is cut from the global tensor (see the module doc)."""

    global_shape: tuple[int, ...]
    """Shape of the dense tensor (vocabulary padding not counted)."""
    dim: int | None = None
    """The dim split over the group; None: replicated."""
    parts: tuple[Part, ...] = ()
    """The named parts along `dim` (default: one part of `global_shape[dim]` units)."""
    vocab_multiple: int | None = None
    """Set for a vocabulary split: rows are padded to a multiple of `vocab_multiple * tp`."""
    partial_grad: bool = False
    """Replicated, but each rank's gradient is a share to be summed over the group."""
    tp_size: int = 1
    """Ranks of the group the tensor is split over."""
    tp_rank: int = 0
    """This piece's rank in that group."""
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    """The group (for gathers); not part of the spec's identity."""
    axis: str = "tensor"
    """The kind of group the tensor is split over: "tensor" or "expert" (module doc)."""

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.global_shape)
        object.__setattr__(self, "global_shape", shape)
        if self.axis not in ("tensor", "expert"):
            raise ValueError(f"tpcore: ShardSpec: axis must be tensor or expert, got {self.axis!r}")
        if self.axis == "expert" and (self.dim != 0 or self.vocab_multiple is not None):
            raise ValueError("tpcore: ShardSpec: expert weights are split along dim 0")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"tpcore: ShardSpec: rank {self.tp_rank} is outside a group of {self.tp_size}"
            )
        if self.dim is None:
            if self.parts or self.vocab_multiple is not None:
                raise ValueError(
                    "tpcore: ShardSpec: a replicated tensor "
                    "(dim=None) has no parts and no vocabulary padding"
                )
            return
        if not 0 <= self.dim < len(shape):
            raise ValueError(
                f"tpcore: ShardSpec: dim {self.dim} is outside a tensor of shape {list(shape)}"
            )
        if self.vocab_multiple is not None:
            if self.dim != 0 or self.parts:
                raise ValueError(
                    "tpcore: ShardSpec: a vocabulary split is along dim 0, in one part"
                )
            return
        parts = self.parts or (Part("", shape[self.dim], shape[self.dim]),)
        object.__setattr__(self, "parts", tuple(parts))
        if sum(p.size for p in parts) != shape[self.dim]:
            raise ValueError(
                f"tpcore: ShardSpec: parts {[p.size for p in parts]} "
                f"do not add up to dim {self.dim} of {list(shape)}"
            )
        for p in parts:
            chunks = part_chunks(p.units, self.tp_size)
            if p.size % p.units or p.size % chunks:
                raise ValueError(
                    f"tpcore: ShardSpec: part {p.name!r} of size {p.size} "
                    f"is not {p.units} whole units in {chunks} chunks"
                )

    def __deepcopy__(self, memo: dict) -> "ShardSpec":
        return self  # immutable; its group cannot be copied

    @property
    def kind(self) -> str:
        """ "replicated", "vocab" or "parts"."""
        if self.dim is None:
            return "replicated"
        return "vocab" if self.vocab_multiple is not None else "parts"

    def at(self, tp_size: int, tp_rank: int, group: dist.ProcessGroup | None = None) -> "ShardSpec":
        """The same global tensor's piece on rank `tp_rank` of `tp_size`."""
        return dataclasses.replace(self, tp_size=tp_size, tp_rank=tp_rank, group=group)

    @property
    def split_experts(self) -> bool:
        """Expert weights split over more than one expert-parallel rank (their gradients are
        summed over the ranks holding the same experts, not over data parallelism)."""
        return self.axis == "expert" and self.tp_size > 1

    @property
    def same_on_tp_ranks(self) -> bool:
        """Every TP rank holds the whole tensor: replicated, or expert weights at EP 1 (a
        gradient norm counts it once)."""
        return self.kind == "replicated" or (self.axis == "expert" and self.tp_size == 1)

    @property
    def local_rows(self) -> int:
        """Rows of each rank's piece of a vocabulary split, padding included."""
        return (
            pad_vocab_size(self.global_shape[0], self.tp_size, self.vocab_multiple) // self.tp_size
        )

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.kind == "vocab":
            shape[0] = self.local_rows
        elif self.kind == "parts":
            shape[self.dim] = sum(p.size // part_chunks(p.units, self.tp_size) for p in self.parts)
        return tuple(shape)

    def ranges(self, *, owned: bool = False) -> tuple[int, list[tuple[int, int, int]]]:
        """Where this piece lies in the global tensor, along the split dim:
        `(dim, [(local start, global start, length)])`. Local rows no range covers are
        vocabulary padding. `owned`: leave out the replicated chunks this rank holds but
        does not own (read those from their owner, so that each index has one source)."""
        if self.kind == "replicated":
            return 0, [(0, 0, self.global_shape[0])] if self.global_shape else []
        if self.kind == "vocab":
            rows = self.local_rows
            start = self.tp_rank * rows
            real = max(0, min(rows, self.global_shape[0] - start))
            return 0, [(0, start, real)] if real else []
        ranges, local, offset = [], 0, 0
        for p in self.parts:
            chunks = part_chunks(p.units, self.tp_size)
            index, n = self.tp_rank * chunks // self.tp_size, p.size // chunks
            owner = self.tp_rank % (self.tp_size // chunks) == 0
            if owner or not owned:
                ranges.append((local, offset + index * n, n))
            local, offset = local + n, offset + p.size
        return self.dim, ranges

    def copied_elements(self) -> tuple[int, int] | None:
        """The flat elements `[lo, hi)` of this piece that copy what a lower rank (the owner
        of a replicated chunk) holds: a gradient norm counts them there only. None when
        none do. (The copied parts, K and V, come last.)"""
        if self.kind != "parts" or self.dim != 0:
            return None
        _, every = self.ranges()
        _, owned = self.ranges(owned=True)
        copied = [r for r in every if r not in owned]
        if not copied:
            return None
        row = math.prod(self.global_shape[1:])
        lo, hi = copied[0][0], copied[-1][0] + copied[-1][2]
        if sum(n for _, _, n in copied) != hi - lo:
            raise ValueError("tpcore: ShardSpec: copied chunks are not the last of the piece")
        return lo * row, hi * row

    def same_split(self, other: "ShardSpec") -> bool:
        """Whether `other` cuts the same global tensor along the same dim into the same parts
        (vocabulary padding, gradient handling and placement aside): pieces of one can be
        copied into pieces of the other."""
        return (
            self.global_shape,
            self.dim,
            self.parts,
            self.vocab_multiple is None,
            self.axis,
        ) == (other.global_shape, other.dim, other.parts, other.vocab_multiple is None, other.axis)

    def to_dict(self) -> dict:
        """The logical spec (no rank, no group), for JSON metadata."""
        out: dict = {"global_shape": list(self.global_shape), "dim": self.dim}
        if self.kind == "parts":
            out["parts"] = [[p.name, p.size, p.units] for p in self.parts]
        if self.vocab_multiple is not None:
            out["vocab_multiple"] = self.vocab_multiple
        if self.partial_grad:
            out["partial_grad"] = True
        if self.axis != "tensor":
            out["axis"] = self.axis
        return out

    @classmethod
    def from_dict(cls, data: dict, tp_size: int = 1, tp_rank: int = 0) -> "ShardSpec":
        parts = tuple(Part(str(n), int(s), int(u)) for n, s, u in data.get("parts", ()))
        return cls(
            tuple(data["global_shape"]),
            data["dim"],
            parts,
            data.get("vocab_multiple"),
            bool(data.get("partial_grad")),
            tp_size,
            tp_rank,
            axis=data.get("axis", "tensor"),
        )


def shard_spec(param: torch.Tensor) -> ShardSpec:
    """The spec `param` carries; a parameter without one (a plain torch module's) is
    replicated, its whole tensor on every rank."""
    spec = getattr(param, "shard_spec", None)
    return spec if spec is not None else ShardSpec(tuple(param.shape))


def set_shard_spec(param: torch.Tensor, spec: ShardSpec) -> None:
    """Attach `spec` to `param`, checking that it describes a tensor of param's shape."""
    if tuple(param.shape) != spec.local_shape:
        raise ValueError(
            f"tpcore: shard spec of local shape {list(spec.local_shape)} "
            f"attached to a parameter of shape {list(param.shape)}"
        )
    param.shard_spec = spec


def shard(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """`spec`'s piece of the global tensor `full` (zero padding rows of a vocabulary split)."""
    if tuple(full.shape) != spec.global_shape:
        raise ValueError(
            f"tpcore: shard: tensor of shape {list(full.shape)} "
            f"for a spec of global shape {list(spec.global_shape)}"
        )
    if spec.kind == "replicated":
        return full
    dim, ranges = spec.ranges()
    if spec.kind == "vocab":
        out = full.new_zeros(spec.local_shape)
        for local, start, n in ranges:
            out[local : local + n] = full[start : start + n]
        return out
    return torch.cat([full.narrow(dim, start, n) for _, start, n in ranges], dim)


def merged_views(
    pieces: Sequence[torch.Tensor], spec: ShardSpec, part: int | None = None
) -> tuple[int, list[torch.Tensor]]:
    """The global tensor (or its part number `part`) as `(dim, views)`: views of `pieces`
    (every rank's piece, in rank order, at `spec.tp_size`) whose concatenation along `dim`
    it is. A streaming writer writes the views in turn and never builds the whole."""
    if spec.kind == "replicated":
        return 0, [pieces[0]]
    tp = len(pieces)
    views: list[tuple[int, torch.Tensor]] = []  # (global start, view)
    for rank, piece in enumerate(pieces):
        dim, ranges = spec.at(tp, rank).ranges(owned=True)
        for index, (local, start, n) in enumerate(ranges):
            if part is None or spec.kind == "vocab" or _part_of(spec, start) == part:
                views.append((start, piece.narrow(dim, local, n)))
    views.sort(key=lambda item: item[0])
    return (0 if spec.kind == "vocab" else spec.dim), [v for _, v in views]


def _part_of(spec: ShardSpec, start: int) -> int:
    offset = 0
    for k, p in enumerate(spec.parts):
        if start < offset + p.size:
            return k
        offset += p.size
    raise ValueError(f"tpcore: index {start} is past the parts of {spec}")


def merge(pieces: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The global tensor from every rank's piece, in rank order (the inverse of `shard`)."""
    if spec.kind == "replicated":
        return pieces[0]
    dim, views = merged_views(pieces, spec)
    return torch.cat(views, dim)


def unshard(
    local: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global tensor from every rank's piece: a collective over `group` (default the
    spec's) for split tensors; `local` itself when replicated."""
    if spec.kind == "replicated":
        return local
    group = group if group is not None else spec.group
    if group is None and spec.tp_size == 1:  # the whole tensor is here (expert weights at EP 1)
        return merge([local], spec)
    if group is None:
        raise ValueError("tpcore: unshard: the spec names no group; pass group=")
    dim = spec.dim
    gathered = comm.all_gather(local.contiguous(), dim, group)
    return merge(list(gathered.chunk(dist.get_world_size(group), dim)), spec)


def copy_overlap(
    out: torch.Tensor, spec: ShardSpec, piece: torch.Tensor, piece_spec: ShardSpec
) -> bool:
    """Copy into `out` (the piece `spec` describes) the indices it shares with `piece` (the
    piece `piece_spec` describes: the same global tensor at another rank or TP size, e.g.
    from a checkpoint). Only the overlap is read, so `piece` can be memory-mapped. Padding
    rows of `out` are zeroed. Call once per saved piece; a replicated tensor is taken from
    piece rank 0. Returns whether any index was shared."""
    if list(piece.shape) != list(piece_spec.local_shape):
        raise ValueError(
            f"tpcore: piece of rank {piece_spec.tp_rank} of {piece_spec.tp_size} "
            f"has shape {list(piece.shape)}, expected {list(piece_spec.local_shape)}"
        )
    if spec.kind == "replicated" and piece_spec.tp_rank != 0:
        return False
    dim, mine = spec.ranges()
    _, theirs = piece_spec.ranges(owned=True)
    copied = False
    with torch.no_grad():
        if spec.kind == "vocab":  # rows past the vocabulary
            covered = sum(n for _, _, n in mine)
            out.narrow(0, covered, out.shape[0] - covered).zero_()
        for local, start, length in mine:
            for their_local, their_start, their_length in theirs:
                a, b = max(start, their_start), min(start + length, their_start + their_length)
                if a < b:
                    out.narrow(dim, local + a - start, b - a).copy_(
                        piece.narrow(dim, their_local + a - their_start, b - a)
                    )
                    copied = True
    return copied


def shares_indices(spec: ShardSpec, piece_spec: ShardSpec) -> bool:
    """Whether `copy_overlap` into `spec`'s piece would copy anything from `piece_spec`'s,
    known without either tensor: a loader opens only the saved files it needs."""
    if spec.kind == "replicated":
        return piece_spec.tp_rank == 0
    _, mine = spec.ranges()
    _, theirs = piece_spec.ranges(owned=True)
    return any(max(start, s) < min(start + n, s + m) for _, start, n in mine for _, s, m in theirs)


def as_rows(spec: ShardSpec) -> ShardSpec:
    """The spec of an N-D tensor (N > 2) seen as the 2-D `[prod(shape[:-1]), shape[-1]]` (a
    view of it): a split of dim 0 becomes a split of whole blocks of rows, each unit (an
    expert) its `prod(shape[1:-1])` rows. 1-D and 2-D specs are returned as they are. What
    handles matrices only (the distributed optimizer's checkpoint slices) handles an MoE
    layer's `[experts, rows, cols]` weights through it."""
    shape = spec.global_shape
    if len(shape) <= 2:
        return spec
    inner, rows = math.prod(shape[1:-1]), math.prod(shape[:-1])
    if spec.kind == "replicated":
        return dataclasses.replace(spec, global_shape=(rows, shape[-1]))
    if spec.dim != 0 or spec.kind != "parts":
        raise NotImplementedError(
            f"tpcore: a {len(shape)}-D tensor split along dim {spec.dim} has no 2-D row view"
        )
    parts = tuple(Part(p.name, p.size * inner, p.units) for p in spec.parts)
    return dataclasses.replace(spec, global_shape=(rows, shape[-1]), parts=parts)
