"""The vocab-parallel LM head that replaces a Hugging Face model's output projection."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ...tensor_parallel import ColumnParallelLinear, gather_from_tensor_parallel

__all__ = ["VocabParallelLMHead", "local_logits", "find_lm_head"]


class VocabParallelLMHead(ColumnParallelLinear):
    """`hidden @ W^T (+ b)` with W split along the vocabulary: each rank holds rows
    `[rank * rows, (rank + 1) * rows)` of the table zero-padded to `rows * tp` (the same
    rows as the vocab-parallel embedding, so a tied head shares its weight).

    Shapes: weight `[rows, hidden]`, bias `[rows]`; input `[..., hidden]` replicated;
    output `[..., vocab]` gathered over the TP group (what HF's heads return), or this
    rank's `[..., rows]` shard while `local_logits(model)` is active.
    """

    def __init__(
        self,
        in_features: int,
        padded_vocab_size: int,
        bias: bool = False,
        *,
        vocab_size: int,
        **kwargs,
    ) -> None:
        super().__init__(in_features, padded_vocab_size, bias, gather_output=False, **kwargs)
        if not 0 < vocab_size <= padded_vocab_size:
            raise ValueError(
                f"tpcore.hf: VocabParallelLMHead: vocab_size {vocab_size} is outside (0, "
                f"{padded_vocab_size}]"
            )
        self.vocab_size = vocab_size
        self.gather_logits = True

    @property
    def vocab_start(self) -> int:
        """The global id of this rank's first row."""
        return self.tp_rank * self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = super().forward(hidden)
        if not self.gather_logits:
            return local
        return gather_from_tensor_parallel(local, self.group)[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", vocab_size={self.vocab_size}"


def find_lm_head(model: nn.Module) -> VocabParallelLMHead:
    """The model's vocab-parallel head; a ValueError when `model` was not parallelized by
    tpcore.hf."""
    heads = [m for m in model.modules() if isinstance(m, VocabParallelLMHead)]
    if len(heads) != 1:
        raise ValueError(
            f"tpcore.hf: expected one VocabParallelLMHead in {type(model).__name__}, found "
            f"{len(heads)}; parallelize the model with tpcore.hf.parallelize / from_pretrained "
            "first"
        )
    return heads[0]


@contextmanager
def local_logits(model: nn.Module) -> Iterator[VocabParallelLMHead]:
    """Within the block the model's head returns this rank's logit shard `[..., rows]`."""
    head = find_lm_head(model)
    head.gather_logits = False
    try:
        yield head
    finally:
        head.gather_logits = True
