"""Load-balanced sequence slicing for context parallelism (CP).

With causal attention the later positions attend to more keys, so cutting a sequence into CP
contiguous pieces gives the last rank most of the work. Each sequence is cut instead into
`2 x CP` equal chunks and rank i holds chunks `i` and `2 CP - 1 - i` (Megatron-Core's and
torchtitan's load balancing): every rank then does the same causal work. `positions(...)`
are the true positions of a rank's tokens (what RoPE needs), `slice_sequence` takes a
rank's tokens (ids, labels, loss mask, activations) along a dim, `unslice_sequence` puts the
ranks' pieces back in order.
"""

from __future__ import annotations

import torch

__all__ = ["check_sequence", "positions", "slice_sequence", "unslice_sequence"]


def check_sequence(seq_len: int, cp: int) -> int:
    """The chunk length `seq_len / (2 cp)`; a ValueError naming both when it is not whole."""
    if not (isinstance(cp, int) and cp >= 1):
        raise ValueError(f"tpcore: context-parallel size must be an int >= 1, got {cp!r}")
    if seq_len <= 0 or seq_len % (2 * cp):
        raise ValueError(
            f"tpcore: sequence length {seq_len} is not divisible by 2 x context-parallel size "
            f"({2 * cp}): each rank holds two equal chunks of every sequence"
        )
    return seq_len // (2 * cp)


def positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """`[seq_len / cp]` int64: the positions of the tokens rank `rank` of `cp` holds, in the
    order it holds them (chunk `rank`, then chunk `2 cp - 1 - rank`)."""
    chunk = check_sequence(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"tpcore: rank {rank} is outside a context-parallel group of {cp}")
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat(
        [
            torch.arange(first, first + chunk, device=device),
            torch.arange(second, second + chunk, device=device),
        ]
    )


def slice_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s tokens of `x` along `dim` (the sequence): `[..., s, ...] -> [..., s/cp,
    ...]`, chunks `rank` and `2 cp - 1 - rank` of `2 cp`."""
    check_sequence(x.shape[dim], cp)
    if not 0 <= rank < cp:
        raise ValueError(f"tpcore: rank {rank} is outside a context-parallel group of {cp}")
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def unslice_sequence(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's `slice_sequence` piece, in rank order (the
    inverse of slicing each rank's share)."""
    cp = len(pieces)
    if cp == 0:
        raise ValueError("tpcore: unslice_sequence: no pieces")
    halves = [piece.chunk(2, dim) for piece in pieces]
    order = [halves[i][0] for i in range(cp)] + [halves[i][1] for i in reversed(range(cp))]
    return torch.cat(order, dim)
