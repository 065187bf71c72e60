"""Vocab-parallel cross-entropy (forward and backward in C++/CUDA kernels)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _op_entry
from ..parallel_state import resolve_tensor_group

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_linear_cross_entropy"]

_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _loss_args(
    group: dist.ProcessGroup | None,
    vocab_size: int | None,
    label_smoothing: float,
    ignore_index: int,
    reduction: str,
    z_loss: float,
) -> tuple:
    """The arguments both C++ entry points share, after `group` and before their own."""
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"tpcore: reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}"
        )
    vocab = -1 if vocab_size is None else vocab_size
    return (
        resolve_tensor_group(group).group_name,
        vocab,
        label_smoothing,
        ignore_index,
        _REDUCTIONS[reduction],
        z_loss,
    )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Cross-entropy of logits sharded along the vocabulary over the TP group.

    Equal to
    `F.cross_entropy(gathered_logits[..., :vocab_size].flatten(0, -2), target.flatten(), ...)`
    with the same `label_smoothing` (over the global vocabulary, so the result does not
    depend on the TP size), `ignore_index` and `reduction`, plus `z_loss * logsumexp^2` per
    token when `z_loss > 0`.

    Shapes: logits `[..., vocab_padded/tp]` (float32, bfloat16 or float16; fp32 math),
    target `[...]` integer; returns a scalar, or `[...]` for `reduction="none"`.
    `vocab_size` is the real vocabulary when the sharded one is padded (default: all
    columns); padding columns are masked out of the softmax. One all-gather of per-token
    statistics in the forward, no collective in the backward. Nothing `[tokens, vocab]`-sized
    is saved beyond the logits; `inplace_backward=True` writes the gradient into the logits
    buffer as well (do not reuse the logits after backward then).
    """
    shared = _loss_args(group, vocab_size, label_smoothing, ignore_index, reduction, z_loss)
    return _op_entry.vocab_parallel_cross_entropy(logits, target, *shared, inplace_backward)


# Auto chunk size: this many bytes of logits per chunk (big enough for efficient GEMMs,
# small next to the full logits of a large vocabulary).
_CHUNK_BYTES = 64 << 20


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
) -> torch.Tensor:
    """LM head + vocab-parallel cross-entropy without materialising the logits.

    Equal to `vocab_parallel_cross_entropy(hidden @ weight.T, target, ...)` with the same
    options, but the logits `[tokens, vocab/tp]` are computed `chunk_size` tokens at a
    time and consumed at once; the backward recomputes each chunk. Peak extra memory is
    one chunk of logits (default: about 64 MiB worth of tokens).

    Shapes: hidden `[..., H]` (replicated over TP, e.g. the final norm's output), weight
    `[vocab_padded/tp, H]` (this rank's shard; may be the `VocabParallelEmbedding` weight,
    for tied embeddings), target `[...]`. The gradient of `hidden` is summed over TP
    inside (this function is also the f of the LM head).
    """
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_BYTES // max(1, weight.shape[0] * weight.element_size()))
    shared = _loss_args(group, vocab_size, label_smoothing, ignore_index, reduction, z_loss)
    return _op_entry.vocab_parallel_linear_cross_entropy(
        hidden, weight, target, *shared, chunk_size
    )
