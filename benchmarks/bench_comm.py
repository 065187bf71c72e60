"""Collectives on one host: the `tpcore` shared-memory backend against gloo and DeepSpeed's
CPU shared-memory all-reduce, in the same processes, with the machine's copy bandwidth
measured in the same run.

    python benchmarks/bench_comm.py                    # 2 and 4 ranks, 4 B to 64 MiB
    python benchmarks/bench_comm.py --worlds 2 --max-bytes 1048576
    python benchmarks/bench_comm.py --ops all_to_all_uneven
    python benchmarks/bench_comm.py --tune             # slot size and two-step threshold sweep

Contenders, fp32, one thread per rank:
- `tpcore.comm`: what tpcore's layers call (C++; the backend is called directly). Its
  all-gather and reduce-scatter return a fresh output, the `dist.*` calls write into a
  preallocated one: an output over glibc's 32 MiB mmap threshold is mapped and page-faulted
  on every call (a 128 MiB all-gather output: about 60 ms on the 2-core VM, 8 ms into a
  preallocated tensor),
- `dist.*` on a `tpcore` group: what any torch.distributed program gets,
- `dist.*` on a gloo group,
- DeepSpeed's `inference_all_reduce` (all-reduce only; `pip install deepspeed`, else skipped),
- for all-reduce, `tpcore C++ loop`: the transport alone, calls made from C++.
`all_to_all_uneven` is `all_to_all_single` with the uneven splits of MoE token dispatch: rank r
sends rank d a part proportional to 1 + (r + d) mod world, its input about the size given.
Each figure is the median over rounds that alternate the contenders (so drift in the
machine's speed hits all alike) of the mean time per call on rank 0. Bus bandwidth follows
NCCL's convention: all-reduce S * 2(n-1)/n / t, all-gather and reduce-scatter S * (n-1)/n / t
(S the whole gathered / reduced-from size), broadcast S / t, from the faster tpcore path;
the copy bandwidth is rank 0's alone (64 MiB fp32 `copy_`, best of 5) while the others wait.
The header also gives each rank's copy bandwidth while all ranks copy at once: the share of
the cores and memory bus a rank of a collective has (on the 2-core VM, about half).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ranks import run_on_ranks  # noqa: E402

SIZES = [4, 64, 1 << 10, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_uneven"]
ROUNDS = 5
CALIBRATION_CALLS = 4


def _time_calls(fn, budget_s: float, max_calls: int = 20000, agree=None) -> tuple[int, float]:
    """(calls, seconds) of back-to-back calls: enough calls to fill about `budget_s`.
    `agree(n)` makes every rank use the same count (collectives must match)."""
    fn()
    # The cost of a call from a few: a single collective can return at once on the rank that
    # arrived last, and a count sized from it (20,000 calls of gloo's 4 ms at 4 ranks) made
    # one measurement take minutes.
    start = time.perf_counter()
    for _ in range(CALIBRATION_CALLS):
        fn()
    one = max((time.perf_counter() - start) / CALIBRATION_CALLS, 1e-7)
    calls = int(min(max_calls, max(3, budget_s / one)))
    if agree is not None:
        calls = agree(calls)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls, time.perf_counter() - start


def _copy_gbps() -> float:
    """This process's memory copy bandwidth (bytes copied per second), 64 MiB fp32."""
    import torch

    src, dst = torch.ones(16 << 20), torch.empty(16 << 20)
    times = []
    for _ in range(5):
        calls, seconds = _time_calls(lambda: dst.copy_(src), 0.2, 100)
        times.append(seconds / calls)
    return (64 << 20) / min(times) / 1e9


def _contenders(op: str, nbytes: int, world: int, rank: int, groups: dict, ds_all_reduce):
    """name -> zero-argument call, for `op` on `nbytes` (the per-rank input size)."""
    import torch
    import torch.distributed as dist

    import tpcore
    from tpcore import _C

    n = max(1, nbytes // 4)
    shm, gloo = groups["tpcore"], groups["gloo"]
    if op == "all_reduce":
        x = torch.ones(n)
        out = {
            "tpcore.comm": lambda: _C.all_reduce_inplace_async(x, shm).wait(),
            "dist on tpcore": lambda: dist.all_reduce(x, group=shm),
            "gloo": lambda: dist.all_reduce(x, group=gloo),
        }
        if ds_all_reduce is not None:
            out["DeepSpeed shm"] = lambda: ds_all_reduce(x)
        return out
    if op == "all_gather":
        x, y = torch.ones(n), torch.empty(world * n)
        return {
            "tpcore.comm": lambda: tpcore.comm.all_gather(x, 0, shm),
            "dist on tpcore": lambda: dist.all_gather_into_tensor(y, x, group=shm),
            "gloo": lambda: dist.all_gather_into_tensor(y, x, group=gloo),
        }
    if op == "reduce_scatter":
        x, y = torch.ones(world * n), torch.empty(n)
        return {
            "tpcore.comm": lambda: tpcore.comm.reduce_scatter(x, 0, shm),
            "dist on tpcore": lambda: dist.reduce_scatter_tensor(y, x, group=shm),
            "gloo": lambda: dist.reduce_scatter_tensor(y, x, group=gloo),
        }
    if op == "all_to_all_uneven":  # MoE dispatch: rank r sends rank d (1 + (r + d) % world) parts
        weights = [[1 + (r + d) % world for d in range(world)] for r in range(world)]
        part = max(1, n // sum(weights[rank]))
        ins = [w * part for w in weights[rank]]
        outs = [weights[r][rank] * part for r in range(world)]
        x, y = torch.ones(sum(ins)), torch.empty(sum(outs))
        return {
            "dist on tpcore": lambda: dist.all_to_all_single(y, x, outs, ins, group=shm),
            "gloo": lambda: dist.all_to_all_single(y, x, outs, ins, group=gloo),
        }
    x = torch.ones(n)
    return {
        "dist on tpcore": lambda: dist.broadcast(x, src=0, group=shm),
        "gloo": lambda: dist.broadcast(x, src=0, group=gloo),
    }


def _case(rank, world, store, sizes, ops, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import tpcore
    from tpcore import _C

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=900),
    )
    ranks = list(range(world))
    groups = {
        "tpcore": dist.new_group(ranks, backend="tpcore"),
        "gloo": dist.new_group(ranks, backend="gloo"),
    }
    try:
        import deepspeed_shm

        ds_all_reduce, ds_note = deepspeed_shm.setup(rank, world)
    except ImportError as e:
        ds_all_reduce, ds_note = None, f"benchmarks/deepspeed_shm.py not importable: {e}"
    # Rank 0 alone (the others wait): one process's copy bandwidth, the same in every case.
    dist.barrier(group=groups["gloo"])
    copy = _copy_gbps() if rank == 0 else 0.0
    dist.barrier(group=groups["gloo"])
    # Every rank at once: what each gets when they share the cores and the memory bus, as
    # the ranks of a collective do.
    shared = torch.tensor([_copy_gbps()], dtype=torch.float64)
    dist.all_reduce(shared, group=groups["gloo"])
    copy = (copy, shared.item() / world)

    def agree(calls: int) -> int:  # the smallest count any rank asks for: the budget holds
        t = torch.tensor([calls])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups["gloo"])
        return int(t.item())

    table = {}
    for op in ops:
        for nbytes in sizes:
            contenders = _contenders(op, nbytes, world, rank, groups, ds_all_reduce)
            if op == "all_reduce":
                x = torch.ones(max(1, nbytes // 4))
                contenders["tpcore C++ loop"] = lambda x=x: None
            # Gloo's large messages are slow: a smaller budget keeps the run short.
            budget = 0.05 if nbytes >= (4 << 20) else 0.1
            rounds = {name: [] for name in contenders}
            for _ in range(ROUNDS):
                for name, fn in contenders.items():
                    dist.barrier(group=groups["gloo"])
                    if name == "tpcore C++ loop":
                        calls = agree(max(3, int(budget / max(rounds["tpcore.comm"][-1], 1e-7))))
                        rounds[name].append(
                            _C._shm_all_reduce_loop(groups["tpcore"], x, calls) / calls
                        )
                        continue
                    calls, seconds = _time_calls(fn, budget, agree=agree)
                    rounds[name].append(seconds / calls)
            table[(op, nbytes)] = {name: statistics.median(v) for name, v in rounds.items()}
    dist.barrier(group=groups["gloo"])
    tpcore.shutdown()
    results.put((rank, (table, copy, ds_note)))


def _tune_case(rank, world, store, slots, two_steps, sizes, results):
    """The transport alone (C++ loop, best of 3) per slot size and two-step threshold."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import tpcore  # noqa: F401 - registers the backend
    from tpcore import _C

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    rows = {}
    for slot in slots:
        for two_step in two_steps:
            os.environ.update(
                TPCORE_SHM_SLOT_BYTES=str(slot), TPCORE_SHM_TWO_STEP_BYTES=str(two_step)
            )
            group = dist.new_group(list(range(world)), backend="tpcore")
            for nbytes in sizes:
                x = torch.ones(nbytes // 4)
                iters = max(5, int(0.3e9 / nbytes / 4))
                _C._shm_all_reduce_loop(group, x, 3)
                rows[(slot, two_step, nbytes)] = min(
                    _C._shm_all_reduce_loop(group, x, iters) / iters for _ in range(3)
                )
    dist.destroy_process_group()
    results.put((rank, rows))


def tune(worlds: list[int]) -> None:
    """Sweep of the slot size and of the two-step threshold (the defaults come from it)."""
    slots = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    sizes = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    for world in worlds:
        two_steps = [32 << 10, 1 << 40] if world > 2 else [1 << 40]
        rows = run_on_ranks(_tune_case, world, slots, two_steps, sizes)[0]
        print(f"\n### all-reduce, {world} ranks, transport alone (us per call)\n")
        print("| slot | two-step from | " + " | ".join(_fmt_bytes(n) for n in sizes) + " |")
        print("|---|---|" + "---|" * len(sizes))
        for slot in slots:
            for two_step in two_steps:
                label = _fmt_bytes(two_step) if two_step < (1 << 40) else "never"
                print(
                    f"| {_fmt_bytes(slot)} | {label} | "
                    + " | ".join(_fmt_us(rows[(slot, two_step, n)]) for n in sizes)
                    + " |"
                )


def _bus_factor(op: str, world: int) -> float:
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter", "all_to_all_uneven"):
        return (world - 1) / world
    return 1.0


def _fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def _fmt_us(s: float | None) -> str:
    return "-" if s is None else (f"{s * 1e6:.2f}" if s < 1e-4 else f"{s * 1e6:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    parser.add_argument(
        "--tune", action="store_true", help="sweep slot sizes and the two-step threshold instead"
    )
    args = parser.parse_args()
    if args.tune:
        tune(args.worlds)
        return
    sizes = [s for s in SIZES if s <= args.max_bytes]
    print(f"cores: {os.cpu_count()}, load average before: {os.getloadavg()[0]:.2f}")
    for world in args.worlds:
        table, (copy, shared_copy), ds_note = run_on_ranks(
            _case, world, sizes, args.ops, timeout=3600
        )[0]
        print(
            f"\n## {world} ranks (copy bandwidth of one rank, measured in this run: "
            f"{copy:.1f} GB/s; "
            f"of each rank while all {world} copy at once: {shared_copy:.1f} GB/s)"
        )
        print(f"DeepSpeed: {ds_note}")
        for op in args.ops:
            names = list(next(v for (o, _), v in table.items() if o == op))
            print(f"\n### {op} (us per call; the input on each rank is the size given)\n")
            print(
                "| size | "
                + " | ".join(names)
                + " | tpcore vs gloo | tpcore bus bandwidth GB/s (% of copy) |"
            )
            print("|---|" + "---|" * (len(names) + 2))
            for nbytes in sizes:
                row = table[(op, nbytes)]
                # The faster of the two tpcore paths: tpcore.comm allocates its output (page
                # faults on fresh memory dominate from 16 MiB), dist.* writes into a given one.
                best = min(row.get("tpcore.comm", float("inf")), row["dist on tpcore"])
                total = nbytes * (world if op in ("all_gather", "reduce_scatter") else 1)
                bus = total * _bus_factor(op, world) / best / 1e9
                cells = " | ".join(_fmt_us(row.get(name)) for name in names)
                print(
                    f"| {_fmt_bytes(nbytes)} | {cells} | {row['gloo'] / best:.1f}x | "
                    f"{bus:.2f} ({100 * bus / copy:.0f}%) |"
                )
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
