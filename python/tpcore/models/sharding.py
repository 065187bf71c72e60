"""How each GPT parameter splits over tensor-parallel ranks, both ways.

A rule is `("parts", dim, sizes)`: the full tensor is the concatenation along `dim` of
parts of `sizes` and every rank holds its chunk of each part, concatenated in the same
order. This keeps whole heads of Q, K and V (and matching rows of SwiGLU's gate and up)
together on a rank; chunking a fused QKV weight as one block would mix them. `("vocab",)`
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
        return ("parts", 0, [c.num_attention_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2)
    if name.endswith(("mlp.fc1.weight", "mlp.fc1.bias")):
        return ("parts", 0, [c.ffn_hidden_size] * (2 if c.activation == "swiglu" else 1))
    if name.endswith(("attention.proj.weight", "mlp.fc2.weight")):
        return ("parts", 1, [c.hidden_size if name.endswith("proj.weight") else c.ffn_hidden_size])
    return ("replicated",)


def shard(full: torch.Tensor, rule: Rule, rank: int, tp: int, rows: int) -> torch.Tensor:
    """This rank's piece of `full`; `rows` is the local vocabulary size for the vocab rule."""
    if rule[0] == "replicated":
        return full
    if rule[0] == "vocab":
        return vocab_shard(full, rank, rows)
    _, dim, sizes = rule
    return torch.cat([part.chunk(tp, dim)[rank] for part in full.split(sizes, dim)], dim)


def merge(pieces: list[torch.Tensor], rule: Rule, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (the inverse of `shard`)."""
    if rule[0] == "replicated":
        return pieces[0]
    if rule[0] == "vocab":
        return torch.cat(pieces, 0)[:vocab_size]
    _, dim, sizes = rule
    tp = len(pieces)
    split = [p.split([s // tp for s in sizes], dim) for p in pieces]  # [rank][part]
    return torch.cat([torch.cat([split[r][k] for r in range(tp)], dim) for k in range(len(sizes))], dim)


def unshard(local: torch.Tensor, rule: Rule, group: dist.ProcessGroup, vocab_size: int) -> torch.Tensor:
    """The full tensor from every rank's piece (a collective for sharded rules)."""
    if rule[0] == "replicated":
        return local
    dim = 0 if rule[0] == "vocab" else rule[1]
    gathered = comm.all_gather(local, dim, group)
    return merge(list(gathered.chunk(dist.get_world_size(group), dim)), rule, vocab_size)


def piece_ranges(rule: Rule, rank: int, tp: int, full_shape: torch.Size | tuple[int, ...], rows: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Where rank's piece lies in the full tensor, without building either:
    `(dim, [(local start, global start, length)])` along the split dim. Local rows no
    range covers are vocabulary padding (zero). `rows` is the local vocabulary size."""
    if rule[0] == "replicated":
        return 0, [(0, 0, full_shape[0])] if len(full_shape) else []
    if rule[0] == "vocab":
        start = rank * rows
        real = max(0, min(rows, full_shape[0] - start))
        return 0, [(0, start, real)] if real else []
    _, dim, sizes = rule
    ranges, local, offset = [], 0, 0
    for size in sizes:
        n = size // tp
        ranges.append((local, offset + rank * n, n))
        local, offset = local + n, offset + size
    return dim, ranges


def full_shape(rule: Rule, local_shape: torch.Size | tuple[int, ...], tp: int, vocab_size: int) -> tuple[int, ...]:
    """The full tensor's shape, from a piece's shape at TP size `tp`."""
    if rule[0] == "replicated":
        return tuple(local_shape)
    if rule[0] == "vocab":
        return (vocab_size, *local_shape[1:])
    shape = list(local_shape)
    shape[rule[1]] *= tp
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
    _, theirs = piece_ranges(rule, piece_rank, piece_tp, full, rows(piece_tp))
    expected = list(full)
    if expected:
        expected[dim] = rows(piece_tp) if rule[0] == "vocab" else sum(n for _, _, n in theirs)
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
    _, theirs = piece_ranges(rule, piece_rank, piece_tp, full, rows(piece_tp))
    return any(max(start, s) < min(start + n, s + m) for _, start, n in mine for _, s, m in theirs)
