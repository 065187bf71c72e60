"""Vocab-parallel cross-entropy: time and memory against what users would use instead.

    python benchmarks/bench_cross_entropy.py [--device cpu|cuda] [--quick]

1. TP=1: forward+backward of tpcore.vocab_parallel_cross_entropy vs F.cross_entropy,
   time and peak extra memory (goal on CPU: >= 2x faster, extra memory <= one
   logits-sized buffer, the gradient).
2. TP=2 (2 ranks): vs Megatron-LM's algorithm written in plain PyTorch below
   (three all-reduces, softmax saved for backward). Goal: >= 2x faster.
3. Fused LM head + CE vs F.linear + F.cross_entropy: peak extra memory (goal >= 10x
   less at vocab 131072) and time.
4. On CUDA: achieved bandwidth of the CE kernels against a device copy's bandwidth
   (the floor: read logits twice, write the gradient once).

Each case runs in a fresh process so peak memory (RSS on CPU, the CUDA allocator's
peak on GPU) is its own. Times are medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from ranks import init_ranks, run_on_ranks


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Meter:
    """Peak memory above a starting point, on CPU (RSS high-water mark) or CUDA."""

    def __init__(self, device: str) -> None:
        import torch

        self.device, self.torch = device, torch
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            # Measured in a fresh process right after the inputs are made, so the
            # high-water mark so far is about the current size.
            self.start = _rss_bytes()

    def peak_extra(self) -> int:
        if self.device == "cuda":
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() - self.start
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.start


def _timed(fn, device: str, iters: int) -> float:
    import torch

    times = []
    for i in range(iters + 1):  # the first run warms up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ce_case(rank, world, store, args, impl, tokens, vocab, results):
    """One (implementation, shape) case: memory of the first fwd+bwd, then its median time."""
    import torch
    import torch.nn.functional as F

    import tpcore
    from megatron_ce import megatron_cross_entropy

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_ranks(rank, world, store, args.device)
    g = torch.Generator().manual_seed(rank)
    local = vocab // world
    logits = torch.randn(tokens, local, generator=g).to(args.device).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).to(args.device)
    fns = {
        "F.cross_entropy": lambda: F.cross_entropy(logits, target),
        "tpcore": lambda: tpcore.vocab_parallel_cross_entropy(logits, target),
        "megatron": lambda: megatron_cross_entropy(logits, target).mean(),
    }
    fn = fns[impl]

    def step():
        logits.grad = None
        fn().backward()

    meter = Meter(args.device)
    step()
    extra = meter.peak_extra()
    seconds = _timed(step, args.device, args.iters)
    results.put((rank, (seconds, extra, logits.numel() * logits.element_size())))


def _fused_case(rank, world, store, args, impl, tokens, vocab, hidden, results):
    import torch
    import torch.nn.functional as F

    import tpcore

    torch.set_num_threads(os.cpu_count() or 1)
    init_ranks(rank, world, store, args.device)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(args.device).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(args.device).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=g).to(args.device)
    if impl == "fused":
        fn = lambda: tpcore.vocab_parallel_linear_cross_entropy(h, w, target)  # noqa: E731
    else:
        fn = lambda: F.cross_entropy(F.linear(h, w), target)  # noqa: E731

    def step():
        h.grad = w.grad = None
        fn().backward()

    meter = Meter(args.device)
    step()
    extra = meter.peak_extra()
    seconds = _timed(step, args.device, args.iters)
    results.put((rank, (seconds, extra, tokens * vocab * 4)))


def _spawn(target, world: int, *case) -> tuple[float, int, int]:
    """Run a case on `world` fresh ranks; returns (slowest time, largest peak, logits bytes)."""
    rows = run_on_ranks(target, world, *case)
    return max(r[0] for r in rows), max(r[1] for r in rows), rows[0][2]


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    args = parser.parse_args()
    scale = 8 if args.quick else 1
    print(f"torch {torch.__version__}, {args.device}, {os.cpu_count()} CPU cores, fp32, medians of {args.iters}")

    print("\n## 1. TP=1: tpcore vs F.cross_entropy, forward+backward")
    print("| tokens | vocab | F.cross_entropy ms | tpcore ms | speed-up | F.ce peak extra MiB | tpcore peak extra MiB | logits MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens, vocab in ((8192 // scale, 32768), (2048 // scale, 131072)):
        base = _spawn(_ce_case, 1, args, "F.cross_entropy", tokens, vocab)
        ours = _spawn(_ce_case, 1, args, "tpcore", tokens, vocab)
        print(
            f"| {tokens} | {vocab} | {base[0] * 1e3:.1f} | {ours[0] * 1e3:.1f} | {base[0] / ours[0]:.2f}x "
            f"| {_mib(base[1])} | {_mib(ours[1])} | {_mib(ours[2])} |"
        )

    world = 2
    if args.device == "cpu" or torch.cuda.device_count() >= world:
        print("\n## 2. TP=2 (2 ranks): tpcore vs Megatron-style PyTorch (3 all-reduces, saved softmax)")
        print("| tokens | vocab | megatron-style ms | tpcore ms | speed-up |")
        print("|---|---|---|---|---|")
        for tokens, vocab in ((8192 // scale, 32768), (2048 // scale, 131072)):
            base = _spawn(_ce_case, world, args, "megatron", tokens, vocab)
            ours = _spawn(_ce_case, world, args, "tpcore", tokens, vocab)
            print(f"| {tokens} | {vocab} | {base[0] * 1e3:.1f} | {ours[0] * 1e3:.1f} | {base[0] / ours[0]:.2f}x |")
    else:
        print("\n(2. TP=2 skipped: needs 2 GPUs)")

    print("\n## 3. TP=1: fused LM head + CE vs F.linear + F.cross_entropy")
    print("| tokens | hidden | vocab | unfused ms | fused ms | unfused peak extra MiB | fused peak extra MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    tokens, hidden, vocab = 2048 // scale, 256, 131072
    base = _spawn(_fused_case, 1, args, "unfused", tokens, vocab, hidden)
    ours = _spawn(_fused_case, 1, args, "fused", tokens, vocab, hidden)
    print(
        f"| {tokens} | {hidden} | {vocab} | {base[0] * 1e3:.1f} | {ours[0] * 1e3:.1f} "
        f"| {_mib(base[1])} | {_mib(ours[1])} | {base[1] / max(ours[1], 1):.1f}x |"
    )

    if args.device == "cuda":
        from bench_ce_bandwidth import report_bandwidth

        report_bandwidth(args)


if __name__ == "__main__":
    main()
