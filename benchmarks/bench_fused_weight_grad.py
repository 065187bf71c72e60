"""Weight gradient of the fused LM head + loss backward with bf16 weights, per chunk of tokens.

Before (tpcore up to 2026-11-22): grad_w(fp32) += mm(g^T, h) computed in bf16, i.e. a
[vocab/tp, hidden] bf16 temporary rounded once per chunk. Now: the chunk is widened to fp32
and accumulated with addmm_ into the fp32 buffer (on CUDA with torch >= 2.8, one cuBLAS GEMM
with bf16 inputs and an fp32 output instead). Prints time and the error against fp64.

    python benchmarks/bench_fused_weight_grad.py [--vocab 32768 --hidden 1024 --tokens 1024
                                                  --chunks 4]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32768, help="vocab/tp rows of the weight")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    g = [torch.randn(a.tokens, a.vocab).to(torch.bfloat16) * 1e-3 for _ in range(a.chunks)]
    h = [torch.randn(a.tokens, a.hidden).to(torch.bfloat16) for _ in range(a.chunks)]
    exact = sum(gi.double().t() @ hi.double() for gi, hi in zip(g, h))

    def before() -> torch.Tensor:
        w = torch.zeros(a.vocab, a.hidden)
        for gi, hi in zip(g, h):
            w.add_(torch.mm(gi.t(), hi))
        return w

    def after() -> torch.Tensor:
        w = torch.zeros(a.vocab, a.hidden)
        for gi, hi in zip(g, h):
            w.addmm_(gi.t().float(), hi.float())
        return w

    times: dict[str, list[float]] = {"before": [], "after": []}
    errors = {}
    for _ in range(a.rounds):  # alternate, so load changes hit both alike
        for name, fn in (("before", before), ("after", after)):
            t = time.perf_counter()
            w = fn()
            times[name].append(time.perf_counter() - t)
            errors[name] = ((w.double() - exact).abs().max() / exact.abs().max()).item()
    med = {k: sorted(v)[len(v) // 2] * 1000 for k, v in times.items()}
    print(
        f"{a.chunks} chunks of [{a.tokens} x {a.vocab}]^T [{a.tokens} x {a.hidden}], bf16, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    for name in ("before", "after"):
        print(
            f"  {name:6s}: {med[name]:8.1f} ms (median of {a.rounds}), max error vs fp64 "
            f"{errors[name]:.2e}"
        )
    print(f"  after / before time: {med['after'] / med['before']:.2f}x")


if __name__ == "__main__":
    main()
