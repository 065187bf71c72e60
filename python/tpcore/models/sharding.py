"""How each GPT parameter splits over tensor-parallel ranks, both ways.

A rule is `("parts", dim, sizes, units)`: the full tensor is the concatenation along `dim`
of parts of `sizes`, part k made of `units[k]` indivisible pieces (heads, or rows), and
every rank holds its chunk of each part, concatenated in the same order. This keeps whole
heads of Q, K and V (and matching rows of SwiGLU's gate and up) together on a rank;
chunking a fused QKV weight as one block would mix them. A part with fewer units than
ranks (grouped-query attention with fewer KV heads than TP, as `tpcore.hf` does it) is cut
into one chunk per unit and each chunk is replicated over `tp / units` adjacent ranks: rank
r holds chunk `r * units // tp`. The first rank of each such group "owns" its copy: loaders
read a chunk from its owner only, so the dense tensor is read and written once. `("vocab",)`
is the vocabulary split with padding rows, `("replicated",)` the full tensor everywhere.

`piece_ranges` says where a rank's piece lies in the full tensor without building either,
and `copy_overlap` copies between pieces of two TP sizes through it: what sharded
initialisation and checkpoint resharding use so that no rank holds a full tensor;
`shares_indices` says ahead whether two pieces overlap at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..tensor_parallel.embedding import pad_vocab_size, vocab_shard
from .config import GPTConfig

Rule = tuple


def rule_for(name: str, config: GPTConfig) -> Rule:
    """The rule of the parameter called `name` (names as in ReferenceGPT / GPTModel)."""
    c = config
    if name in ("embedding.word.weight", "lm_head.weight"):
        return ("vocab",)
    if name.endswith(("attention.qkv.weight", "attention.qkv.bias")):
        heads = [c.num_attention_heads, c.num_kv_heads, c.num_kv_heads]
        return ("parts", 0, [n * c.head_dim for n in heads], heads)
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        sizes = [c.ffn_hidden_size] * (2 if c.gated_mlp else 1)
        return ("parts", 0, sizes, sizes)
    if name.endswith("attention.proj.weight"):
        return ("parts", 1, [c.num_attention_heads * c.head_dim], [c.num_attention_heads])
    if name.endswith("mlp.fc2.weight"):
        return ("parts", 1, [c.ffn_hidden_size], [c.ffn_hidden_size])
    return ("replicated",)


def part_chunks(units: int, tp: int) -> int:
    """Into how many chunks a part of `units` whole units is cut at TP size `tp`: `tp`, or
    one per unit (each replicated over `tp // units` ranks) when fewer units divide `tp`."""
    if units % tp == 0:
        return tp
    if tp % units == 0:
        return units
    raise ValueError(f"tpcore: a part of {units} heads cannot be split over the tensor-parallel size {tp} (neither divides the other)")


def _chunk_of(units: int, rank: int, tp: int) -> tuple[int, int, bool]:
    """(chunk index rank holds, number of chunks, whether rank owns it: first of its copies)."""
    n = part_chunks(units, tp)
    return rank * n // tp, n, rank % (tp // n) == 0


def tp_copy_range(name: str, config: GPTConfig, rank: int, tp: int) -> tuple[int, int] | None:
    """The flat elements `[lo, hi)` of rank's piece of `name` that copy what a lower TP rank
    (the chunk's owner) holds: a gradient norm counts them there only. None when none do."""
    rule = rule_for(name, config)
    if rule[0] != "parts" or rule[1] != 0:
        return None
    row = 1 if name.endswith("bias") else config.hidden_size  # the parts split dim 0: rows
    local, lo = 0, None
    for size, u in zip(rule[2], rule[3]):  # the copied parts (K and V) come last
        _, n, owner = _chunk_of(u, rank, tp)
        if not owner and lo is None:
            lo = local
        local += size // n
    return None if lo is None else (lo * row, local * row)


def shard(full: torch.Tensor, rule: Rule, rank: int, tp: int, rows: int) -> torch.Tensor:
    """This rank's piece of `full`; `rows` is the local vocabulary size for the vocab rule."""
    if rule[0] == "replicated":
        return full
    if rule[0] == "vocab":
        return vocab_shard(full, rank, rows)
    _, dim, sizes, units = rule
    pieces = []
    for part, u in zip(full.split(sizes, dim), units):
        index, n, _ = _chunk_of(u, rank, tp)
        pieces.append(part.chunk(n, dim)[index])
    return torch.cat(pieces, dim)


def piece_shape(name: str, config: GPTConfig, full: torch.Size | tuple[int, ...], tp: int) -> torch.Size:
    """The shape of each TP rank's piece of parameter `name` of shape `full` at TP size `tp`
    (the same on every rank; vocabulary padding rows included), built from no tensor."""
    rows = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by) // tp
    return shard(torch.empty(full, device="meta"), rule_for(name, config), 0, tp, rows).shape


def merged_views(pieces: list[torch.Tensor], rule: Rule, vocab_size: int, part: int | None = None) -> tuple[int, list[torch.Tensor]]:
    """The full tensor (or its part number `part`) as `(dim, views)`: views of `pieces`
    (every rank's piece, in rank order) whose concatenation along `dim` it is. What `merge`
    concatenates; a streaming writer writes the views in turn and never builds the whole."""
    if rule[0] == "replicated":
        return 0, [pieces[0]]
    if rule[0] == "vocab":  # the padding rows past the vocabulary are left out
        views, left = [], vocab_size
        for piece in pieces:
            if left > 0:
                views.append(piece[: min(left, piece.shape[0])])
                left -= views[-1].shape[0]
        return 0, views
    _, dim, sizes, units = rule
    tp = len(pieces)
    counts = [part_chunks(u, tp) for u in units]
    split = [p.split([s // n for s, n in zip(sizes, counts)], dim) for p in pieces]  # [rank][part]
    parts = range(len(sizes)) if part is None else [part]
    # A replicated chunk is taken from its owner, the first of the ranks holding it.
    return dim, [split[j * tp // counts[k]][k] for k in parts for j in range(counts[k])]


def merge(pieces: list[torch.Tensor], rule: Rule, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (the inverse of `shard`)."""
    if rule[0] == "replicated":
        return pieces[0]
    dim, views = merged_views(pieces, rule, vocab_size)
    return torch.cat(views, dim)


def unshard(local: torch.Tensor, rule: Rule, group: dist.ProcessGroup, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's piece (a collective for sharded rules)."""
    if rule[0] == "replicated":
        return local
    dim = 0 if rule[0] == "vocab" else rule[1]
    gathered = comm.all_gather(local, dim, group)
    return merge(list(gathered.chunk(dist.get_world_size(group), dim)), rule, vocab_size)


def piece_ranges(
    rule: Rule, rank: int, tp: int, full_shape: torch.Size | tuple[int, ...], rows: int, *, owned: bool = False
) -> tuple[int, list[tuple[int, int, int]]]:
    """Where rank's piece lies in the full tensor, without building either:
    `(dim, [(local start, global start, length)])` along the split dim. Local rows no
    range covers are vocabulary padding (zero). `rows` is the local vocabulary size.
    `owned`: leave out the replicated chunks rank holds but does not own (read those
    from their owner, so that each index has one source)."""
    if rule[0] == "replicated":
        return 0, [(0, 0, full_shape[0])] if len(full_shape) else []
    if rule[0] == "vocab":
        start = rank * rows
        real = max(0, min(rows, full_shape[0] - start))
        return 0, [(0, start, real)] if real else []
    _, dim, sizes, units = rule
    ranges, local, offset = [], 0, 0
    for size, u in zip(sizes, units):
        index, chunks, owner = _chunk_of(u, rank, tp)
        n = size // chunks
        if owner or not owned:
            ranges.append((local, offset + index * n, n))
        local, offset = local + n, offset + size
    return dim, ranges


def full_shape(rule: Rule, local_shape: torch.Size | tuple[int, ...], tp: int, vocab_size: int) -> tuple[int, ...]:
    """The full tensor's shape, from a piece's shape at TP size `tp`."""
    if rule[0] == "replicated":
        return tuple(local_shape)
    if rule[0] == "vocab":
        return (vocab_size, *local_shape[1:])
    shape = list(local_shape)
    shape[rule[1]] = sum(rule[2])
    return tuple(shape)


def copy_overlap(
    out: torch.Tensor,
    rule: Rule,
    rank: int,
    tp: int,
    piece: torch.Tensor,
    piece_rank: int,
    piece_tp: int,
    *,
    vocab_size: int,
    make_vocab_size_divisible_by: int,
) -> bool:
    """Copy into `out` (rank `rank`'s piece at TP size `tp`; a full tensor when tp is 1 and
    it has no padding rows) the indices it shares with `piece` (rank `piece_rank`'s piece
    at `piece_tp`, e.g. from a checkpoint of another TP size). Only the overlap is read,
    so `piece` can be memory-mapped. Padding rows of `out` are zeroed. Call once per
    saved piece; a replicated tensor is taken from piece rank 0. Returns whether any
    index was shared."""
    full = full_shape(rule, out.shape, tp, vocab_size)

    def rows(size: int) -> int:
        return pad_vocab_size(vocab_size, size, make_vocab_size_divisible_by) // size

    dim, mine = piece_ranges(rule, rank, tp, full, rows(tp))
    _, every = piece_ranges(rule, piece_rank, piece_tp, full, rows(piece_tp))
    _, theirs = piece_ranges(rule, piece_rank, piece_tp, full, rows(piece_tp), owned=True)
    expected = list(full)
    if expected:
        expected[dim] = rows(piece_tp) if rule[0] == "vocab" else sum(n for _, _, n in every)
    if list(piece.shape) != expected:
        raise ValueError(f"tpcore: piece of rank {piece_rank} of {piece_tp} has shape {list(piece.shape)}, expected {expected}")
    if rule[0] == "replicated" and piece_rank != 0:
        return False
    copied = False
    with torch.no_grad():
        if rule[0] == "vocab":  # rows past the vocabulary
            covered = sum(n for _, _, n in mine)
            out.narrow(0, covered, out.shape[0] - covered).zero_()
        for local, start, length in mine:
            for their_local, their_start, their_length in theirs:
                a, b = max(start, their_start), min(start + length, their_start + their_length)
                if a < b:
                    out.narrow(dim, local + a - start, b - a).copy_(piece.narrow(dim, their_local + a - their_start, b - a))
                    copied = True
    return copied


def shares_indices(
    out_shape: torch.Size | tuple[int, ...],
    rule: Rule,
    rank: int,
    tp: int,
    piece_rank: int,
    piece_tp: int,
    *,
    vocab_size: int,
    make_vocab_size_divisible_by: int,
) -> bool:
    """Whether `copy_overlap` into a piece of `out_shape` (rank `rank` at TP size `tp`)
    would copy anything from rank `piece_rank`'s piece at `piece_tp`, known without either
    tensor: a loader opens only the saved files it needs."""
    if rule[0] == "replicated":
        return piece_rank == 0
    full = full_shape(rule, out_shape, tp, vocab_size)

    def rows(size: int) -> int:
        return pad_vocab_size(vocab_size, size, make_vocab_size_divisible_by) // size

    _, mine = piece_ranges(rule, rank, tp, full, rows(tp))
    _, theirs = piece_ranges(rule, piece_rank, piece_tp, full, rows(piece_tp), owned=True)
    return any(max(start, s) < min(start + n, s + m) for _, start, n in mine for _, s, m in theirs)
