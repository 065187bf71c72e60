"""tpcore's counter-based dropout (`tracked_dropout`) against `F.dropout`, same run, one process.

Eager: forward + backward of dropout on a tensor that requires grad (a GPT's hidden
activations `[s*b, h]` and attention probabilities `[b, heads, s, s]`). Compiled: the
residual pattern `r + dropout(x)` under `torch.compile` (inductor draws its own random
numbers and fuses them with the add; tpcore's op is opaque and is not fused). Median of
alternating rounds; the ratio is tpcore's time over torch's.

    python benchmarks/bench_dropout.py [--rounds 7] [--no-compile]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

import tpcore
from tpcore.tensor_parallel.random import get_rng_tracker

P = 0.1
SHAPES = {
    "hidden [1024 x 256]": (1024, 256),
    "hidden [8192 x 1024]": (8192, 1024),
    "attention probs [4, 8, 256, 256]": (4, 8, 256, 256),
}


def median_ms(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up (and compile)
    for _ in range(rounds):  # alternate, so load changes hit every contender alike
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls)
    return {k: sorted(v)[len(v) // 2] * 1000 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add("bench", 1234)  # a stream without a process group
    print(
        f"dropout p={P}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {a.rounds} rounds (ms)"
    )
    print("| case | dtype | F.dropout | tpcore | tpcore / torch |")
    print("|---|---|---:|---:|---:|")
    for label, shape in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            g = torch.randn(shape, dtype=dtype)
            calls = max(1, 2**22 // x.numel())

            def run(drop: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
                return lambda: torch.autograd.grad(drop(x), x, g)

            ms = median_ms(
                {
                    "torch": run(lambda t: F.dropout(t, P)),
                    "tpcore": run(lambda t: tpcore.tracked_dropout(t, P, "bench")),
                },
                a.rounds,
                calls,
            )
            print(
                f"| {label}, forward + backward | {str(dtype)[6:]} | {ms['torch']:.3f} | "
                f"{ms['tpcore']:.3f} | {ms['tpcore'] / ms['torch']:.2f} |"
            )
    if a.no_compile:
        return
    for label, shape in list(SHAPES.items())[:2]:
        x, r = torch.randn(shape), torch.randn(shape)
        torch._dynamo.reset()
        ours = torch.compile(lambda x, r: r + tpcore.tracked_dropout(x, P, "bench"), fullgraph=True)
        theirs = torch.compile(lambda x, r: r + F.dropout(x, P), fullgraph=True)
        calls = max(1, 2**22 // x.numel())
        ms = median_ms(
            {"torch": lambda: theirs(x, r), "tpcore": lambda: ours(x, r)}, a.rounds, calls
        )
        print(
            f"| {label}, compiled r + dropout(x), forward | float32 | {ms['torch']:.3f} | "
            f"{ms['tpcore']:.3f} | {ms['tpcore'] / ms['torch']:.2f} |"
        )


if __name__ == "__main__":
    main()
