"""Accuracy of the fp32 cross-entropy gradient at large vocabularies: tpcore and
F.cross_entropy against the same loss computed in float64, on the same logits.

    python benchmarks/bench_ce_precision.py

This is why tests/tensor_parallel/test_kernels_at_scale.py judges the kernels against fp64,
not against torch's own fp32 result. One process, TP=1, CPU.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcore

SHAPES = ((2048, 32768), (512, 131072), (256, 262144))  # (tokens, vocab)


def _grad(loss_fn, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    x = logits.clone().requires_grad_(True)
    loss_fn(x, target).backward()
    return x.grad


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    tpcore.initialize_model_parallel(1)
    print(
        "| tokens | vocab | contender | max abs error | / max abs gradient | max relative "
        "error (|g| > 1e-4 max) |"
    )
    print("|---|---|---|---|---|---|")
    for tokens, vocab in SHAPES:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(tokens, vocab, generator=g) * 4
        target = torch.randint(0, vocab, (tokens,), generator=g)
        ref = _grad(F.cross_entropy, logits.double(), target)
        big = ref.abs() > 1e-4 * ref.abs().max()
        for name, fn in (
            ("F.cross_entropy fp32", F.cross_entropy),
            ("tpcore fp32", tpcore.vocab_parallel_cross_entropy),
        ):
            err = (_grad(fn, logits, target).double() - ref).abs()
            rel = (err / ref.abs())[big].max()
            print(
                f"| {tokens} | {vocab} | {name} | {err.max():.3g} | "
                f"{err.max() / ref.abs().max():.3g} | {rel:.3g} |"
            )
    tpcore.shutdown()


if __name__ == "__main__":
    main()
