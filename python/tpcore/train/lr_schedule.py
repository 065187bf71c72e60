"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr."""

from __future__ import annotations

import math

__all__ = ["learning_rate"]


def learning_rate(
    iteration: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, style: str
) -> float:
    """The learning rate of optimizer step `iteration` (0-based).

    Warmup rises linearly to `lr` over `warmup_iters` steps (step i uses lr * (i+1) / warmup);
    the decay then goes from `lr` to `min_lr` over steps [warmup_iters, decay_iters) and
    stays at `min_lr` afterwards.
    """
    if style not in ("cosine", "linear", "constant"):
        raise ValueError(f"tpcore: unknown lr decay style {style!r} (cosine, linear, constant)")
    if iteration < warmup_iters:
        return lr * (iteration + 1) / warmup_iters
    if style == "constant":
        return lr
    if iteration >= decay_iters:
        return min_lr
    progress = (iteration - warmup_iters) / (decay_iters - warmup_iters)
    factor = 1.0 - progress if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (lr - min_lr) * factor
