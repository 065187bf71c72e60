"""Scaled word embeddings, vocab-parallel (Gemma's: the lookup times a constant,
`embed_scale` = sqrt(hidden)): GPTModel's with `embedding_scale`, and `tpcore.hf`'s
replacement of transformers' scaled embeddings."""

from __future__ import annotations

import torch

from .embedding import VocabParallelEmbedding

__all__ = ["ScaledVocabParallelEmbedding"]


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """`VocabParallelEmbedding(ids) * embed_scale`: ids `[...]` -> `[..., embedding_dim]`.

    The scale is rounded to the weight's dtype before the product, as transformers does
    (its buffer `.to(weight.dtype)`), so the result equals the dense module's bit for bit.
    """

    def __init__(self, *args, embed_scale: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.embed_scale = float(embed_scale)
        # The scale rounded to each dtype, as Python floats made here: no tensor on the device
        # per call, and nothing torch.compile would have to break its graph for.
        dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        self._scale_in = {d: float(torch.tensor(self.embed_scale).to(d)) for d in dtypes}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self._scale_in[self.weight.dtype]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", embed_scale={self.embed_scale}"
