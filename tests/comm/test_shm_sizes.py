"""A search over message sizes for the `tpcore` shared-memory backend, against gloo on the
same inputs.

Sizes are drawn around every boundary the backend's algorithms have: multiples of the group
size, the 16-element parts of the two-step all-reduce, the slot (one step's chunk) of each
op, the two-step threshold, the reduce loops' vector widths, each +-0..7. Every op that
splits a message among ranks (all_reduce, reduce_scatter, all_gather, all_to_all) and
broadcast, every dtype, groups of 2-4 ranks (2-8 with ``--long``), groups that are a subset
of the world, and two groups running at once; a small slot (many steps, boundaries at small
sizes) and the default one. Every rank's result must equal gloo's bit for bit where the
arithmetic is exact (integers, and floats holding small integers, whose sums are exact in
any order), within rounding for random floats, and be identical on every rank bit for bit.

gloo's result is computed once per batch: the cases of one (group, dtype) are laid end to
end and gloo all-reduces (or all-gathers) them in one call, since those ops act on each
element on its own.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading

import pytest
import torch
import torch.distributed as dist

import tpcore

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
]
SMALL = {
    # many steps at small sizes; two-step all-reduce from 64 float32 elements; streaming stores
    "TPCORE_SHM_SLOT_BYTES": "1024",
    "TPCORE_SHM_TWO_STEP_BYTES": "256",
    "TPCORE_SHM_STREAM_BYTES": "1",
}
DEFAULT = {"TPCORE_SHM_SLOT_BYTES": str(256 << 10), "TPCORE_SHM_TWO_STEP_BYTES": str(32 << 10)}
# Cases per (op, group, slot, dtype): the CI draw, and --long's.
DRAWS = {False: 4, True: 40}
OPS = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"]
REDUCE_OPS = ["sum", "max", "min", "product", "avg"]


def _settings(env: dict[str, str]) -> tuple[int, int]:
    return int(env["TPCORE_SHM_SLOT_BYTES"]), int(env["TPCORE_SHM_TWO_STEP_BYTES"])


def boundaries(op: str, k: int, es: int, slot_bytes: int, two_step_bytes: int) -> list[int]:
    """Sizes (elements per rank's part, or of the whole tensor for all_reduce and broadcast)
    around the places where the algorithm of `op` changes its split, each +-0..7."""
    per = slot_bytes // es  # elements of one step of all_reduce, all_gather, broadcast
    points = {1, 8, 16, 32, 64, k, 16 * k, 32 * k, per, 2 * per, 3 * per}
    if op == "all_reduce":
        # the two-step threshold, and chunks whose world parts of 16 elements are a
        # multiple of 16 (where the last part was dropped) after whole steps
        points |= {-(-two_step_bytes // es), 2 * per // k}
        points |= {j * per + 16 * k * i for j in range(4) for i in (1, 2, 3, per // (16 * k))}
    if op == "reduce_scatter" and k > 1:
        points |= {j * (per // (k - 1)) for j in (1, 2, 3)}
    if op == "all_to_all":
        points |= {j * (slot_bytes // k) // es for j in (1, 2, 3)}
    return sorted({p + d for p in points for d in range(-7, 8) if p + d >= 0})


def _inputs(
    r: int, n: int, dtype: torch.dtype, seed: int, exact: bool, reduce_op: str
) -> torch.Tensor:
    """Rank r's input: small integers (exact in every order and dtype), or random floats."""
    g = torch.Generator().manual_seed(seed * 1000 + r)
    if exact or not dtype.is_floating_point:
        lo, hi = (-2, 3) if reduce_op == "product" else (-8, 9)
        if dtype == torch.uint8:
            lo = 0
        return torch.randint(lo, hi, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


class _env:
    def __init__(self, values: dict[str, str]) -> None:
        self.values, self.saved = values, {}

    def __enter__(self):
        for key, value in self.values.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _cases(
    layout: tuple[int, ...], slot_name: str, env: dict[str, str], seed: int, draws: int
) -> list[tuple]:
    """The cases one group runs, drawn the same way on every rank:
    (op, reduce op, dtype, n, exact, seed)."""
    rng = random.Random(f"{seed}/{layout}/{slot_name}")
    k = len(layout)
    slot_bytes, two_step_bytes = _settings(env)
    cases = []
    for dtype in DTYPES:
        es = torch.empty(0, dtype=dtype).element_size()
        for op in OPS:
            sizes = boundaries(op, k, es, slot_bytes, two_step_bytes)
            for n in rng.sample(sizes, min(draws, len(sizes))):
                reduce_op = "sum"
                if op in ("all_reduce", "reduce_scatter"):
                    reduce_op = rng.choice(
                        REDUCE_OPS if dtype.is_floating_point else REDUCE_OPS[:4]
                    )
                exact = rng.random() < 0.5
                cases.append((op, reduce_op, dtype, n, exact, rng.randrange(1 << 30)))
    return cases


def _run_shm(case: tuple, me: int, k: int, group) -> torch.Tensor:
    """The case on the shared-memory group: the flat result."""
    op, reduce_op, dtype, n, exact, seed = case
    reduce = getattr(dist.ReduceOp, reduce_op.upper())
    if op == "all_reduce":
        t = _inputs(me, n, dtype, seed, exact, reduce_op)
        dist.all_reduce(t, op=reduce, group=group)
        return t
    if op == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(
            out, _inputs(me, k * n, dtype, seed, exact, reduce_op), op=reduce, group=group
        )
        return out
    if op == "all_gather":
        out = torch.empty(k * n, dtype=dtype)
        dist.all_gather_into_tensor(out, _inputs(me, n, dtype, seed, exact, reduce_op), group=group)
        return out
    if op == "all_to_all":
        out = torch.empty(k * n, dtype=dtype)
        dist.all_to_all_single(out, _inputs(me, k * n, dtype, seed, exact, reduce_op), group=group)
        return out
    root = seed % k
    t = _inputs(me, n, dtype, seed, exact, reduce_op)
    dist.broadcast(t, src=dist.get_global_rank(group, root), group=group)
    return t


def _gloo_dtype(t: torch.Tensor) -> torch.Tensor:
    """gloo has no int16: its inputs (small integers) go as int32."""
    return t.to(torch.int32) if t.dtype == torch.int16 else t


def _reference(cases: list[tuple], me: int, k: int, gloo) -> list[torch.Tensor]:
    """gloo's results for `cases` (all of one dtype and reduce op), in one or two calls:
    all_reduce and reduce_scatter from one all_reduce of every input laid end to end, the
    rest from one all_gather."""
    reduced, gathered = (
        [c for c in cases if c[0] in ("all_reduce", "reduce_scatter")],
        [c for c in cases if c[0] not in ("all_reduce", "reduce_scatter")],
    )
    results = {}
    if reduced:
        reduce_op = reduced[0][1]
        parts = [
            _inputs(me, n if op == "all_reduce" else k * n, dtype, seed, exact, reduce_op)
            for op, _, dtype, n, exact, seed in reduced
        ]
        flat = _gloo_dtype(torch.cat(parts))
        # gloo has no AVG: its sum in float64 (exact for these inputs), divided by k
        gloo_op = (
            dist.ReduceOp.SUM if reduce_op == "avg" else getattr(dist.ReduceOp, reduce_op.upper())
        )
        if reduce_op == "avg":
            flat = flat.double()
        dist.all_reduce(flat, op=gloo_op, group=gloo)
        flat = (flat / k if reduce_op == "avg" else flat).to(cases[0][2])
        off = 0
        for case, part in zip(reduced, parts):
            whole = flat[off : off + part.numel()]
            off += part.numel()
            n = case[3]
            results[id(case)] = whole if case[0] == "all_reduce" else whole[me * n : (me + 1) * n]
    if gathered:
        parts = []
        for op, reduce_op, dtype, n, exact, seed in gathered:
            parts.append(
                _inputs(me, n if op != "all_to_all" else k * n, dtype, seed, exact, reduce_op)
            )
        flat = _gloo_dtype(torch.cat(parts))
        every = torch.empty(k * flat.numel(), dtype=flat.dtype)
        dist.all_gather_into_tensor(every, flat, group=gloo)
        every = every.view(k, -1).to(cases[0][2])
        off = 0
        for case, part in zip(gathered, parts):
            op, _, _, n, _, seed = case
            mine = every[:, off : off + part.numel()]
            off += part.numel()
            if op == "all_gather":
                results[id(case)] = mine.reshape(-1)
            elif op == "all_to_all":
                results[id(case)] = mine.reshape(k, k, n)[:, me].reshape(-1)
            else:
                results[id(case)] = mine[seed % k]
    return [results[id(c)] for c in cases]


TOL = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _compare(got: torch.Tensor, want: torch.Tensor, case: tuple, where: str) -> None:
    op, reduce_op, dtype, n, exact, _ = case
    what = f"{where}: {op} {reduce_op} {dtype} n={n} {'exact' if exact else 'random'}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    moves_only = op in ("all_gather", "all_to_all", "broadcast") or reduce_op in ("max", "min")
    # avg multiplies by 1 / k where the reference divides: one rounding apart
    if moves_only or not dtype.is_floating_point or (exact and reduce_op != "avg"):
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            raise AssertionError(
                f"{what}: {bad.numel()} of {got.numel()} elements differ from gloo's, "
                f"first at {bad[:8].tolist()}: "
                f"{got[bad[:4]].tolist()} != {want[bad[:4]].tolist()}"
            )
        return
    # Random floats summed in another order: within a few roundings of the dtype, relative to
    # the largest partial sum (a product of k randn values stays below ~50).
    scale = max(want.double().abs().max().item() if want.numel() else 0.0, 1.0)
    torch.testing.assert_close(
        got, want, rtol=4 * TOL[dtype], atol=4 * TOL[dtype] * scale, msg=lambda m: f"{what}: {m}"
    )


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _sweep_group(layout, slot_name, env, seed, draws, me, shm, gloo, digests, failures):
    k = len(layout)
    cases = _cases(layout, slot_name, env, seed, draws)
    where = f"group {list(layout)} {slot_name} slot, rank {me}"
    try:
        by_batch: dict[tuple, list] = {}
        for case in cases:
            by_batch.setdefault((case[2], case[1]), []).append(case)
        for batch in by_batch.values():
            got = [_run_shm(case, me, k, shm) for case in batch]
            want = _reference(batch, me, k, gloo)
            for case, g, w in zip(batch, got, want):
                _compare(g, w, case, where)
                digests.append((layout, slot_name, case[:5], _digest(g)))
    except BaseException as e:  # noqa: BLE001 - reported with the group's context
        failures.append(f"{where}: {e!r}"[:3000])


def _layouts(world: int) -> list[tuple]:
    """Groups to run: [0, k) for k = 2..world one at a time, subsets not starting at rank 0,
    and disjoint pairs running at once (each entry: groups run concurrently by threads)."""
    out = [[tuple(range(k))] for k in range(2, world + 1)]
    if world >= 4:
        out += [[tuple(range(1, world))], [(1, world - 1)], [(0, 1), (2, 3)]]
    return out


def _sweep(rank: int, world: int, seed: int, draws: int) -> list:
    digests, failures = [], []
    for slot_name, env in (("small", SMALL), ("default", DEFAULT)):
        for concurrent in _layouts(world):
            made = []
            for layout in concurrent:  # every rank makes every group, in the same order
                with _env(env):
                    shm = dist.new_group(list(layout), backend="tpcore")
                gloo = dist.new_group(list(layout), backend="gloo")
                made.append((layout, shm, gloo))
            threads = []
            for layout, shm, gloo in made:
                if rank not in layout:
                    continue
                assert tpcore.shm.shm_backend_of(shm) is not None
                args = (
                    layout,
                    slot_name,
                    env,
                    seed,
                    draws,
                    layout.index(rank),
                    shm,
                    gloo,
                    digests,
                    failures,
                )
                threads.append(threading.Thread(target=_sweep_group, args=args))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for _, shm, gloo in made:
                dist.destroy_process_group(shm)
                dist.destroy_process_group(gloo)
    assert not failures, "\n".join(failures[:10])
    return digests


def _check_ranks_agree(results: list) -> None:
    """Every member of a group got the same bits for every case."""
    seen: dict[tuple, tuple[int, str]] = {}
    for rank, digests in enumerate(results):
        for layout, slot_name, case, digest in digests:
            if case[0] in ("all_gather", "all_to_all", "reduce_scatter"):
                # each rank's output differs by design (all_gather's is compared to gloo's)
                continue
            key = (layout, slot_name, case)
            first = seen.setdefault(key, (rank, digest))
            assert first[1] == digest, (
                f"group {list(layout)} {slot_name} slot {case}: "
                f"rank {rank}'s result differs from rank {first[0]}'s"
            )


def test_sizes_around_every_boundary_match_gloo(cpu_ranks, long_tests):
    seed = int(os.environ.get("TPCORE_TEST_SEED", "44"))
    results = cpu_ranks.run(_sweep, seed, DRAWS[long_tests], timeout=900 if long_tests else 240)
    _check_ranks_agree(results)


@pytest.fixture(scope="module")
def eight_ranks(long_tests):
    from rank_pool import RankPool

    pool = RankPool(8 if long_tests else 5, backend="gloo")
    yield pool
    pool.close()


def test_sizes_at_more_ranks_than_cores(eight_ranks, long_tests):
    """Groups of 5 ranks (up to 8 with --long) on a 2-core machine: the same search."""
    seed = int(os.environ.get("TPCORE_TEST_SEED", "44"))
    results = eight_ranks.run(
        _sweep_wide, seed, DRAWS[long_tests] // 2, timeout=1800 if long_tests else 240
    )
    _check_ranks_agree(results)


def _sweep_wide(rank: int, world: int, seed: int, draws: int) -> list:
    digests, failures = [], []
    for slot_name, env in (("small", SMALL), ("default", DEFAULT)):
        for k in range(5, world + 1):
            layout = tuple(range(k))
            with _env(env):
                shm = dist.new_group(list(layout), backend="tpcore")
            gloo = dist.new_group(list(layout), backend="gloo")
            if rank in layout:
                _sweep_group(
                    layout, slot_name, env, seed, draws, rank, shm, gloo, digests, failures
                )
            dist.destroy_process_group(shm)
            dist.destroy_process_group(gloo)
    assert not failures, "\n".join(failures[:10])
    return digests
