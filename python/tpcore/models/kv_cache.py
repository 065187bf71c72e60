"""The keys and values a `GPTModel` has computed, kept between decoding steps.

Each layer's cache is `[max_length, batch, kv_heads/tp, head_dim]` for keys and for values
(this rank's KV heads only), allocated at the first step; `GPTModel.decode` appends the
new tokens' keys and values (after rotary and the k norm) and attends over everything
cached so far, so a step costs one token's GEMMs instead of the whole window's.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of up to `max_length` tokens per layer (`length` of them filled)."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"tpcore: KVCache: max_length must be >= 1, got {max_length}")
        self.max_length, self.length = max_length, 0
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s keys and values `[s, b, kv, d]` of the tokens after the
        `length` cached ones; returns all of them, `[length + s, b, kv, d]` each. The
        length moves on at `advance`, once every layer has appended."""
        s = k.shape[0]
        if self.length + s > self.max_length:
            raise ValueError(
                f"tpcore: KVCache: {self.length} cached + {s} new tokens exceed its "
                f"{self.max_length}"
            )
        if layer not in self._layers:
            shape = (self.max_length, *k.shape[1:])
            self._layers[layer] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self._layers[layer]
        keys[self.length : self.length + s] = k
        values[self.length : self.length + s] = v
        return keys[: self.length + s], values[: self.length + s]

    def advance(self, tokens: int) -> None:
        self.length += tokens
