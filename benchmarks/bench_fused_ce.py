"""Fused LM head + cross-entropy vs F.linear + F.cross_entropy at TP=1, on CPU: time and
peak extra memory (goal: >= 10x less memory at vocab 131072). Run by
`bench_cross_entropy.py --fused`, or alone: `python benchmarks/bench_fused_ce.py [--quick]`.
Each contender runs in a fresh process (memory = peak RSS above the inputs during the
first step); time = median of `--iters` steps after a warm-up step.
"""

from __future__ import annotations

import argparse
import os

from ranks import init_ranks, run_on_ranks


def _fused_case(rank, world, store, args, impl, tokens, vocab, hidden, results):
    import torch
    import torch.nn.functional as F
    from bench_cross_entropy import _reset_peak_rss, _rss, _timed

    import tpcore

    torch.set_num_threads(os.cpu_count() or 1)
    init_ranks(rank, world, store, "cpu")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    if impl == "fused":
        fn = lambda: tpcore.vocab_parallel_linear_cross_entropy(h, w, target)  # noqa: E731
    else:
        fn = lambda: F.cross_entropy(F.linear(h, w), target)  # noqa: E731

    def step():
        h.grad = w.grad = None
        fn().backward()

    _reset_peak_rss()
    start = _rss()[0]
    step()
    extra = _rss()[1] - start
    results.put((rank, (_timed(step, "cpu", args.iters), extra)))


def report_fused(args) -> None:
    scale = 8 if args.quick else 1
    tokens, hidden, vocab = 2048 // scale, 256, 131072
    print(
        f"\n## Fused LM head + CE vs F.linear + F.cross_entropy, TP=1, tokens {tokens}, "
        f"hidden {hidden}, vocab {vocab}, fp32"
    )
    print(
        "| unfused ms | fused ms | time ratio unfused/fused | unfused peak extra MiB | "
        "fused peak extra MiB | memory ratio |"
    )
    print("|---|---|---|---|---|---|")
    base = run_on_ranks(_fused_case, 1, args, "unfused", tokens, vocab, hidden)[0]
    ours = run_on_ranks(_fused_case, 1, args, "fused", tokens, vocab, hidden)[0]
    print(
        f"| {base[0] * 1e3:.1f} | {ours[0] * 1e3:.1f} | {base[0] / ours[0]:.2f} | "
        f"{base[1] / 2**20:.0f} "
        f"| {ours[1] / 2**20:.0f} | {base[1] / max(ours[1], 1):.1f}x |"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    report_fused(parser.parse_args())
