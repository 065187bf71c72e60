"""Column/Row-parallel linear vs nn.Linear, and TP=2 vs TP=1 for a large MLP.

    python benchmarks/bench_linear.py [--device cpu|cuda] [--tokens 2048] [--hidden 1024]

Part 1 (TP=1, one process): forward+backward time of ColumnParallelLinear and
RowParallelLinear against nn.Linear of the same shape, printed as a ratio
(goal: overhead under 5%). Part 2: a hidden -> 4*hidden -> hidden MLP step on
2 ranks (TP=2) against 1 rank (TP=1), on the same machine. Times are medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from ranks import init_ranks, run_on_ranks
from torch import nn

import tpcore


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(
    module: nn.Module, x: torch.Tensor, device: str, iters: int, warmup: int = 3
) -> float:
    """Median seconds of one forward + backward of `module` on `x`."""
    times = []
    for i in range(warmup + iters):
        _sync(device)
        start = time.perf_counter()
        out = module(x)
        out.backward(torch.ones_like(out))
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
        x.grad = None
    return statistics.median(times)


def layer_overhead(args) -> None:
    device, dtype = args.device, torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        init_ranks(0, 1, os.path.join(tmp, "store"), device)
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
        print(
            f"## TP=1 layer overhead: tokens={args.tokens}, {args.hidden} -> "
            f"{4 * args.hidden}, {device}, fp32"
        )
        print("| layer | nn.Linear ms | tpcore ms | ratio tpcore/nn.Linear |")
        print("|---|---|---|---|")
        for name, cls, kwargs in (
            ("ColumnParallelLinear", tpcore.ColumnParallelLinear, {}),
            ("RowParallelLinear", tpcore.RowParallelLinear, {"input_is_parallel": True}),
        ):
            torch.manual_seed(0)
            dense = nn.Linear(args.hidden, 4 * args.hidden, device=device, dtype=dtype)
            layer = cls.from_dense(dense, **kwargs)
            # Interleave the two so that drift in machine speed affects both alike.
            base, ours = [], []
            for _ in range(args.rounds):
                base.append(time_fwd_bwd(dense, x, device, args.iters))
                ours.append(time_fwd_bwd(layer, x, device, args.iters))
            b, o = statistics.median(base), statistics.median(ours)
            print(f"| {name} | {b * 1e3:.2f} | {o * 1e3:.2f} | {o / b:.3f} |")
        tpcore.destroy_model_parallel()
        dist.destroy_process_group()


def _mlp_worker(rank: int, world: int, store_path: str, args, threads: int, results) -> None:
    torch.set_num_threads(threads)
    init_ranks(rank, world, store_path, args.device)
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    torch.manual_seed(0)
    h = args.hidden
    up = tpcore.ColumnParallelLinear(h, 4 * h, device=device)
    down = tpcore.RowParallelLinear(4 * h, h, input_is_parallel=True, device=device)
    mlp = nn.Sequential(up, nn.GELU(), down)
    x = torch.randn(args.tokens, h, device=device, requires_grad=True)
    dist.barrier()
    seconds = time_fwd_bwd(mlp, x, args.device, args.iters)
    results.put((rank, seconds))
    tpcore.destroy_model_parallel()
    dist.destroy_process_group()


def _mlp_step_time(world: int, threads: int, args) -> float:
    # A step is done when the slowest rank is.
    return max(run_on_ranks(_mlp_worker, world, args, threads))


def mlp_scaling(args) -> None:
    cores = os.cpu_count() or 1
    # Same hardware both ways: TP=1 gets every core, each TP=2 rank half of them.
    t1 = _mlp_step_time(1, cores, args)
    t2 = _mlp_step_time(2, max(1, cores // 2), args)
    print(
        f"\n## MLP {args.hidden} -> {4 * args.hidden} -> {args.hidden}, "
        f"tokens={args.tokens}, {args.device}, fp32, fwd+bwd"
    )
    print("| TP | ranks x threads | step ms | speed-up vs TP=1 |")
    print("|---|---|---|---|")
    print(f"| 1 | 1 x {cores} | {t1 * 1e3:.1f} | 1.00 |")
    print(f"| 2 | 2 x {max(1, cores // 2)} | {t2 * 1e3:.1f} | {t1 / t2:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternating rounds of baseline and tpcore"
    )
    parser.add_argument("--skip-mlp", action="store_true", help="only the TP=1 layer comparison")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, tpcore built with CUDA: {tpcore.built_with_cuda()}, "
        f"{os.cpu_count()} CPU cores"
    )
    layer_overhead(args)
    if not args.skip_mlp:
        if args.device == "cuda" and torch.cuda.device_count() < 2:
            print("\n(MLP TP=2 vs TP=1 skipped: needs 2 GPUs)")
        else:
            mlp_scaling(args)


if __name__ == "__main__":
    main()
