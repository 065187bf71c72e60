"""The fixed costs behind small-batch decoding on CPU: a small gloo all-reduce between two
processes (torch.distributed vs tpcore.comm) and a tpcore linear at TP=1 vs nn.Linear.

    python benchmarks/bench_latency.py

Each figure is the best (linear) or median (all-reduce) of several rounds of back-to-back
calls, one thread per process, fp32.
"""

from __future__ import annotations

import statistics
import time

from ranks import init_ranks, run_on_ranks


def _per_call_us(fn, calls: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _all_reduce_case(rank, world, store, results):
    import torch
    import torch.distributed as dist

    import tpcore

    torch.set_num_threads(1)
    init_ranks(rank, world, store, "cpu")
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    x = torch.randn(1, 1, 1024)  # 4 KiB: one token's hidden state
    contenders = {
        "dist.all_reduce (in place)": lambda: dist.all_reduce(x, group=group),
        "tpcore.comm.all_reduce (out of place)": lambda: tpcore.comm.all_reduce(x, group),
    }
    rounds = {name: [] for name in contenders}
    for _ in range(6):  # alternate, so drift in the machine's speed hits both alike
        for name, fn in contenders.items():
            dist.barrier()
            rounds[name].append(_per_call_us(fn, 300, 20))
    dist.barrier()
    tpcore.shutdown()
    results.put((rank, {name: statistics.median(v) for name, v in rounds.items()}))


def _linear_case(rank, world, store, results):
    import torch

    import tpcore

    torch.set_num_threads(1)
    init_ranks(rank, world, store, "cpu")
    rows = []
    with torch.no_grad():
        for fan_in, fan_out in ((64, 64), (1024, 3072)):
            dense = torch.nn.Linear(fan_in, fan_out, bias=False)
            column = tpcore.ColumnParallelLinear.from_dense(dense, gather_output=True)
            x = torch.randn(1, 1, fan_in)
            best = {
                name: min(_per_call_us(lambda: f(x), 300, 20) for _ in range(5))
                for name, f in (("nn.Linear", dense), ("ColumnParallelLinear", column))
            }
            rows.append((fan_in, fan_out, best))
    tpcore.shutdown()
    results.put((rank, rows))


def main() -> None:
    reduce = run_on_ranks(_all_reduce_case, 2)[0]
    print(
        "| all-reduce of [1, 1, 1024] fp32, 2 processes | us per call (median of 6 rounds of 300) |"
    )
    print("|---|---|")
    for name, us in reduce.items():
        print(f"| {name} | {us:.0f} |")
    print(
        "\n| linear, input [1, 1, in], TP=1, no grad | nn.Linear us | ColumnParallelLinear "
        "us | difference us |"
    )
    print("|---|---|---|---|")
    for fan_in, fan_out, best in run_on_ranks(_linear_case, 1)[0]:
        ours, ref = best["ColumnParallelLinear"], best["nn.Linear"]
        print(f"| {fan_in} -> {fan_out} | {ref:.1f} | {ours:.1f} | {ours - ref:+.1f} |")


if __name__ == "__main__":
    main()
