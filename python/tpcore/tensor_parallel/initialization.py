"""Sharded, TP-size invariant initialisation: every rank draws only its own slices.

A full tensor is cut into fixed tiles whose grid does not depend on the TP size
(`[128, 512]` for matrices, `[65536]` for vectors, `[1, ..., 1, 128, 512]` beyond).
Each tile is drawn on CPU from its own `torch.Generator`, seeded by a hash of
(seed, key, tile index), so a rank can draw any tile without the others: it draws the
tiles that meet its slice and copies the intersections into its parameter, on any
device. The same (seed, key) therefore gives the same numbers for the same indices at
every TP size and on CPU and CUDA alike, and no temporary is larger than a tile.
Tiles are drawn in float32 (float64 for float64 parameters) and then cast, so a bf16
model is the rounding of the fp32 one.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = [
    "ShardedInit",
    "init_shard_",
    "draw_seed",
    "check_init_method",
    "Range",
    "TILE_2D",
    "TILE_1D",
]

TILE_2D = (128, 512)
"""Tile of a matrix `[rows, cols]` (and of the last two dims of higher-rank tensors)."""
TILE_1D = 65536
"""Tile of a vector."""

Range = tuple[int, int, int]
"""`(local start, global start, length)` along the split dim: `local[l:l+n] = full[g:g+n]`."""


@dataclass(frozen=True)
class ShardedInit:
    """A distribution that any rank can draw for its own slice of a full tensor.

    `fill(tile, generator)` fills a CPU float tile in place, drawing only from `generator`
    (it must not depend on the tile's position). Use the constructors below or wrap your
    own, e.g. `ShardedInit(lambda t, g: t.normal_(0, 0.02, generator=g).clamp_(-0.04, 0.04))`.
    """

    fill: Callable[[torch.Tensor, torch.Generator], object]
    description: str = "custom"

    @staticmethod
    def normal(std: float, mean: float = 0.0) -> "ShardedInit":
        return ShardedInit(
            lambda t, g: t.normal_(mean, std, generator=g), f"normal(mean={mean}, std={std})"
        )

    @staticmethod
    def uniform(low: float, high: float) -> "ShardedInit":
        return ShardedInit(
            lambda t, g: t.uniform_(low, high, generator=g), f"uniform({low}, {high})"
        )

    @staticmethod
    def constant(value: float) -> "ShardedInit":
        return ShardedInit(lambda t, g: t.fill_(value), f"constant({value})")

    def __repr__(self) -> str:
        return f"ShardedInit.{self.description}"


def check_init_method(owner: str, init_method: object) -> None:
    """Raise a ValueError unless `init_method` is None, a ShardedInit, "dense" or a callable."""
    if init_method is None or isinstance(init_method, ShardedInit) or callable(init_method):
        return
    if isinstance(init_method, str) and init_method == "dense":
        return
    raise ValueError(
        f"tpcore: {owner}: init_method must be None, a "
        f"ShardedInit, 'dense' or a callable, got {init_method!r}"
    )


def draw_seed() -> int:
    """One draw of the default CPU generator: the seed of a layer or model, so that
    `torch.manual_seed(s)` before building gives the same weights on every rank."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu").item())


def _tile_seed(seed: int, key: str, index: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(f"{seed}|{key}|{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: a valid manual_seed


def _tile_shape(ndim: int) -> tuple[int, ...]:
    if ndim == 1:
        return (TILE_1D,)
    return (1,) * (ndim - 2) + TILE_2D


def init_shard_(
    out: torch.Tensor,
    init: ShardedInit,
    *,
    seed: int,
    key: str,
    full_shape: Sequence[int],
    dim: int = 0,
    ranges: Sequence[Range] | None = None,
) -> torch.Tensor:
    """Fill `out`, this rank's piece of a full tensor of `full_shape`, with `init`'s draw.

    `out` holds, along `dim`, the full tensor's `ranges` (`(local, global, length)`;
    None: `out` is the full tensor) and the full extent along every other dim. Local
    positions along `dim` that no range covers (padding rows) are zeroed. Only the
    tiles that meet the ranges are drawn. Returns `out`.
    """
    full_shape = tuple(full_shape)
    if ranges is None:
        ranges = [(0, 0, full_shape[dim])] if full_shape else []
    expected = list(full_shape)
    if full_shape:
        expected[dim] = out.shape[dim]
    if list(out.shape) != expected:
        raise ValueError(
            f"tpcore: init_shard_: {key}: piece shape {list(out.shape)} does "
            f"not fit full shape {list(full_shape)} split along dim {dim}"
        )
    ranges = [r for r in ranges if r[2] > 0]
    for local, start, length in ranges:
        if (
            local < 0
            or local + length > out.shape[dim]
            or start < 0
            or start + length > full_shape[dim]
        ):
            raise ValueError(
                f"tpcore: init_shard_: {key}: range {(local, start, length)} "
                "is outside the piece or the full tensor"
            )
    tile_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    generator = torch.Generator()
    with torch.no_grad():
        if not full_shape:  # a scalar: one tile of one element
            generator.manual_seed(_tile_seed(seed, key, ()))
            tile = torch.empty((), dtype=tile_dtype)
            init.fill(tile, generator)
            return out.copy_(tile)
        _zero_uncovered(out, dim, ranges)
        tile_shape = _tile_shape(len(full_shape))
        per_dim = [range(-(-n // t)) for n, t in zip(full_shape, tile_shape)]
        size = tile_shape[dim]
        per_dim[dim] = sorted(
            {i for _, g, n in ranges for i in range(g // size, (g + n - 1) // size + 1)}
        )
        for index in itertools.product(*per_dim):
            lo = [i * t for i, t in zip(index, tile_shape)]
            shape = [min(t, n - s) for t, n, s in zip(tile_shape, full_shape, lo)]
            generator.manual_seed(_tile_seed(seed, key, index))
            tile = torch.empty(shape, dtype=tile_dtype)
            init.fill(tile, generator)
            for local, start, length in ranges:
                a, b = max(start, lo[dim]), min(start + length, lo[dim] + shape[dim])
                if a < b:
                    piece = tile.narrow(dim, a - lo[dim], b - a)
                    target = out
                    for d, (s, n) in enumerate(zip(lo, shape)):
                        target = (
                            target.narrow(d, local + a - start, b - a)
                            if d == dim
                            else target.narrow(d, s, n)
                        )
                    target.copy_(piece)
    return out


def _zero_uncovered(out: torch.Tensor, dim: int, ranges: Sequence[Range]) -> None:
    covered = sorted((local, local + n) for local, _, n in ranges)
    position = 0
    for a, b in covered + [(out.shape[dim], out.shape[dim])]:
        if a > position:
            out.narrow(dim, position, a - position).zero_()
        position = max(position, b)
