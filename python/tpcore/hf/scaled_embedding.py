"""The vocab-parallel form of transformers' scaled word embeddings (Gemma's: the lookup
times a constant, `embed_scale` = sqrt(hidden))."""

from __future__ import annotations

import torch

from ..tensor_parallel import VocabParallelEmbedding

__all__ = ["ScaledVocabParallelEmbedding"]


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """`VocabParallelEmbedding(ids) * embed_scale`: ids `[...]` -> `[..., embedding_dim]`.

    The scale is rounded to the weight's dtype before the product, as transformers does
    (its buffer `.to(weight.dtype)`), so the result equals the dense module's bit for bit.
    """

    def __init__(self, *args, embed_scale: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.embed_scale = float(embed_scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # A Python float of the rounded value: no tensor made on the device each call.
        scale = float(torch.tensor(self.embed_scale).to(self.weight.dtype))
        return super().forward(ids) * scale

    def extra_repr(self) -> str:
        return super().extra_repr() + f", embed_scale={self.embed_scale}"
