"""`all_to_all_single` with uneven splits on the `tpcore` shared-memory backend (what MoE token
dispatch sends): every rank's output against the rows a plain-PyTorch reference picks from
every rank's input. Pair sizes are drawn around each boundary of the algorithm: zero rows, one
row, and the bytes one step carries per destination (slot / group size) +-1 row, for a small
slot (many steps) and the default one, row widths of 1 and 3 elements, four dtypes, the whole
world and a 3-rank subgroup. Splits that disagree between ranks raise on every rank and leave
the group usable."""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

import tpcore
from checks import expect_error

SLOTS = {"small": 1024, "default": 256 << 10}
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


def _data(rank: int, rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(0, 100, (rows, cols), generator=g).to(dtype)


def _group(ranks: list[int], slot: int):
    os.environ["TPCORE_SHM_SLOT_BYTES"] = str(slot)
    try:
        return dist.new_group(ranks, backend="tpcore")
    finally:
        del os.environ["TPCORE_SHM_SLOT_BYTES"]


def _exchange(group, me: int, k: int, rows: list[list[int]], cols: int, dtype, seed: int):
    """One all_to_all_single of rows[s][d] rows from s to d; checks the output."""
    mine = _data(me, sum(rows[me]), cols, dtype, seed)
    out = torch.empty(sum(rows[s][me] for s in range(k)), cols, dtype=dtype)
    shm = tpcore.shm.shm_backend_of(group)
    before = shm.fast_ops
    dist.all_to_all_single(out, mine, [rows[s][me] for s in range(k)], rows[me], group=group)
    assert shm.fast_ops == before + 1, "the exchange did not run in shared memory"
    want = []
    for s in range(k):
        start = sum(rows[s][:me])
        want.append(_data(s, sum(rows[s]), cols, dtype, seed)[start : start + rows[s][me]])
    assert torch.equal(out, torch.cat(want)), f"rows {rows}, cols {cols}, {dtype}"


def _sweep(rank, world):
    cases = 0
    for layout in (list(range(world)), list(range(1, world))):
        for slot_name, slot in SLOTS.items():
            group = _group(layout, slot)  # every rank makes every group, in the same order
            if rank not in layout:
                continue
            k, me = len(layout), layout.index(rank)
            rng = random.Random(f"{layout}/{slot_name}")
            for dtype in DTYPES:
                for cols in (1, 3):
                    row_bytes = cols * torch.empty(0, dtype=dtype).element_size()
                    per = slot // k // row_bytes  # rows one step carries per destination
                    sizes = [0, 1, per - 1, per, per + 1, 2 * per + 1, 3 * per]
                    for draw in range(3):
                        rows = [[rng.choice(sizes) for _ in range(k)] for _ in range(k)]
                        _exchange(group, me, k, rows, cols, dtype, seed=draw)
                        cases += 1
            # Nothing to send at all; equal splits given as lists.
            _exchange(group, me, k, [[0] * k for _ in range(k)], 2, torch.float32, seed=7)
            _exchange(group, me, k, [[5] * k for _ in range(k)], 2, torch.float32, seed=8)
    return cases


def test_uneven_all_to_all_moves_the_right_rows(cpu_ranks):
    assert all(cases > 0 for cases in cpu_ranks.run(_sweep))


def _disagreeing(rank, world):
    group = _group(list(range(world)), SLOTS["small"])
    sends = [1] * world
    receives = [0 if rank == 0 else 1] + [1] * (world - 1)  # rank 0 expects nothing from rank 0
    expect_error(
        ValueError,
        "rank 0 sends rank 0 4 bytes, rank 0 expects 0 (input_split_sizes and "
        "output_split_sizes disagree)",
        dist.all_to_all_single,
        torch.empty(sum(receives)),
        torch.ones(world),
        receives,
        sends,
        group=group,
    )
    # Split sizes that do not add up to the tensor on one rank: that rank's call goes to gloo
    # (c10d's own check), the others' to shared memory: every rank learns of the mismatch.
    bad = [2] + [1] * (world - 1) if rank == 1 else [1] * world
    try:
        dist.all_to_all_single(torch.empty(world), torch.ones(world), [1] * world, bad, group=group)
        raised = None
    except (ValueError, RuntimeError) as e:
        raised = str(e)
    assert raised is not None, "a bad split was accepted"
    # The group still works.
    _exchange(group, rank, world, [[1] * world for _ in range(world)], 1, torch.float32, seed=1)
    return True


def test_disagreeing_splits_raise_on_every_rank(cpu_ranks):
    assert all(cpu_ranks.run(_disagreeing))
