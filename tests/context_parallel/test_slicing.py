"""The load-balanced sequence slicing of context parallelism against its definition, computed
here: rank i holds chunks i and 2 CP - 1 - i of 2 CP; the pieces put back give the sequence;
the positions are the tokens' own; every rank gets the same causal work."""

from __future__ import annotations

import pytest
import torch

from tpcore.context_parallel import check_sequence, positions, slice_sequence, unslice_sequence


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3])
def test_slices_positions_and_their_inverse(cp, chunk):
    seq = 2 * cp * chunk
    x = torch.arange(2 * seq * 3).view(2, seq, 3)  # [batch, seq, hidden]
    pieces = []
    for rank in range(cp):
        piece = slice_sequence(x, 1, cp, rank)
        want = list(range(rank * chunk, (rank + 1) * chunk)) + list(
            range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
        )
        assert torch.equal(piece, x[:, want]), (cp, rank)
        assert positions(seq, cp, rank).tolist() == want
        pieces.append(piece)
    assert torch.equal(unslice_sequence(pieces, 1), x)
    # Causal work: the query at position p attends to p + 1 keys; equal on every rank.
    work = {int((positions(seq, cp, r) + 1).sum()) for r in range(cp)}
    assert len(work) == 1, work


def test_bad_sizes_raise_naming_them():
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2 x context"):
        check_sequence(6, 2)
    with pytest.raises(ValueError, match="outside a context-parallel group of 2"):
        positions(8, 2, 2)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        slice_sequence(torch.zeros(4), 0, 0, 0)
    with pytest.raises(ValueError, match="not divisible"):
        slice_sequence(torch.zeros(2, 10), 1, 3, 0)
