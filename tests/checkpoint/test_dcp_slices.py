"""The boxes that present the distributed optimizer's flat DP slices to DCP (`dcp_slices`),
checked by brute force against the global tensor: for slices cut at every boundary a piece
has (row ends, fused parts, replicated key/value chunks, vocabulary padding), each box
holds exactly the slice's elements at their global place, and the boxes every (TP, DP)
rank owns cover each element of the global tensor exactly once."""

from __future__ import annotations

import itertools

import pytest
import torch

from tpcore.checkpoint.dcp_slices import _boxes, _cover
from tpcore.tensor_parallel.shard_spec import Part, ShardSpec, shard

SPECS = {
    "column": ShardSpec((12, 5), 0),
    "row": ShardSpec((6, 8), 1),
    "bias": ShardSpec((12,), 0),
    "replicated": ShardSpec((7,)),
    "replicated-2d": ShardSpec((3, 4)),
    # q of 4 heads, k and v of 1 head each (copied over TP ranks), head size 2
    "gqa-qkv": ShardSpec((12, 3), 0, (Part("q", 8, 4), Part("k", 2, 1), Part("v", 2, 1))),
    "gate-up": ShardSpec((8, 3), 0, (Part("gate", 4, 4), Part("up", 4, 4))),
    "vocab": ShardSpec((11, 3), 0, vocab_multiple=2),
}


def _region(spec: ShardSpec, shape, lo: int, hi: int, owned: bool):
    """(buffer filled from the global tensor through the boxes, coverage count per buffer
    element, the global tensor, the cover)."""
    full = torch.arange(1, 1 + torch.Size(spec.global_shape).numel()).view(spec.global_shape)
    cover = _cover(tuple(shape), lo, hi)
    buffer = torch.zeros(cover.shape, dtype=torch.long)
    count = torch.zeros(cover.shape, dtype=torch.long)
    seen = torch.zeros(spec.global_shape, dtype=torch.long)
    for g, b, s in _boxes(spec, cover, owned):
        dst = tuple(slice(o, o + n) for o, n in zip(b, s))
        src = tuple(slice(o, o + n) for o, n in zip(g, s))
        assert buffer[dst].shape == full[src].shape == torch.Size(s), (g, b, s)
        buffer[dst] = full[src]
        count[dst] += 1
        seen[src] += 1
    return buffer, count, seen, cover


def _cuts(n: int, cols: int) -> list[int]:
    """Slice ends around every row boundary of a piece of `n` elements."""
    points = {0, n}
    for edge in range(0, n + 1, cols):
        points.update(x for x in (edge - 1, edge, edge + 1) if 0 <= x <= n)
    return sorted(points)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_slice_reads_its_elements_at_their_global_place(name, tp):
    base = SPECS[name]
    for rank in range(tp):
        spec = base.at(tp, rank)
        full = torch.arange(1, 1 + torch.Size(spec.global_shape).numel()).view(spec.global_shape)
        piece = shard(full, spec).reshape(-1)  # 0 marks vocabulary padding
        cols = spec.local_shape[1] if len(spec.local_shape) == 2 else 1
        cuts = _cuts(piece.numel(), cols)
        for lo, hi in itertools.combinations(cuts, 2):
            buffer, count, _, cover = _region(spec, spec.local_shape, lo, hi, owned=False)
            got = buffer.view(-1)[cover.offset : cover.offset + hi - lo]
            times = count.view(-1)[cover.offset : cover.offset + hi - lo]
            want = piece[lo:hi]
            assert torch.equal(got, want), (name, tp, rank, lo, hi)
            assert torch.equal(times, (want != 0).long()), (name, tp, rank, lo, hi)
            # nothing lands outside the slice (the rest of its first and last rows)
            outside = count.view(-1).clone()
            outside[cover.offset : cover.offset + hi - lo] = 0
            assert not outside.any(), (name, tp, rank, lo, hi)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("tp,dp", [(2, 3), (4, 2), (1, 5)])
def test_owned_boxes_of_all_ranks_cover_the_global_tensor_once(name, tp, dp):
    base = SPECS[name]
    seen = torch.zeros(base.global_shape, dtype=torch.long)
    for rank in range(tp):
        spec = base.at(tp, rank)
        n = torch.Size(spec.local_shape).numel()
        if spec.kind == "replicated" and rank:
            continue  # saved by TP rank 0 only (slice_state_dict)
        # DP slices of uneven length, cut inside rows
        ends = [0] + [(n * (d + 1)) // dp + (1 if d < dp - 1 and n > dp else 0) for d in range(dp)]
        ends[-1] = n
        for lo, hi in zip(ends, ends[1:]):
            if lo < hi:
                seen += _region(spec, spec.local_shape, lo, hi, owned=True)[2]
    assert torch.equal(seen, torch.ones_like(seen)), (name, tp, dp, seen)
