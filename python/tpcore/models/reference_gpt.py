"""A plain-PyTorch GPT: the dense reference for tpcore's tensor-parallel GPT.

Same parameter names and math as `tpcore.models.GPTModel` at TP=1, so that
`GPTModel.from_dense` / `to_dense` convert between them. Activations are laid out
`[seq, batch, hidden]` inside, as in the TP model; inputs are ids `[batch, seq]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._module_utils import meta_embedding, to_empty
from ..moe import ReferenceMoE, reset_expert_biases
from ..tensor_parallel.initialization import draw_seed
from .common import (
    apply_rotary,
    attention_core,
    make_norm,
    mlp_activation,
    rotary_tables,
    scale_embedding,
)
from .config import GPTConfig
from .initialization import initialize_gpt_parameters
from .moe_block import moe_config

__all__ = ["ReferenceGPT"]


class DenseAttention(nn.Module):
    def __init__(self, config: GPTConfig, dtype=None, device=None) -> None:
        super().__init__()
        c = config
        self.config = c
        self.qkv = nn.Linear(
            c.hidden_size,
            (c.num_attention_heads + 2 * c.num_kv_heads) * c.head_dim,
            bias=c.qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.proj = nn.Linear(
            c.num_attention_heads * c.head_dim,
            c.hidden_size,
            bias=c.proj_bias,
            dtype=dtype,
            device=device,
        )
        if c.qk_norm:  # over each head, or over the whole projection (OLMoE)
            whole = c.qk_norm_scope == "projection"
            q_width, k_width = (c.num_attention_heads, c.num_kv_heads) if whole else (1, 1)
            self.q_norm = make_norm(c, dtype, device, q_width * c.head_dim)
            self.k_norm = make_norm(c, dtype, device, k_width * c.head_dim)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        c, (s, b) = self.config, x.shape[:2]
        q, k, v = self.qkv(x).split(
            [
                c.num_attention_heads * c.head_dim,
                c.num_kv_heads * c.head_dim,
                c.num_kv_heads * c.head_dim,
            ],
            -1,
        )
        if c.qk_norm and c.qk_norm_scope == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(s, b, c.num_attention_heads, c.head_dim)
        k, v = (t.view(s, b, c.num_kv_heads, c.head_dim) for t in (k, v))
        if c.qk_norm and c.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.proj(attention_core(q, k, v, c.attention_dropout if self.training else 0.0))


class DenseMLP(nn.Module):
    def __init__(self, config: GPTConfig, dtype=None, device=None, ffn: int | None = None) -> None:
        super().__init__()
        c = self.config = config
        ffn = c.ffn_hidden_size if ffn is None else ffn
        width = ffn * (2 if c.gated_mlp else 1)  # SwiGLU, GeGLU: [gate; up]
        self.fc1 = nn.Linear(c.hidden_size, width, bias=c.mlp_bias, dtype=dtype, device=device)
        self.fc2 = nn.Linear(ffn, c.hidden_size, bias=c.mlp_bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(mlp_activation(self.config, self.fc1(x)))


def _dense_moe(config: GPTConfig, dtype, device) -> ReferenceMoE:
    shared = config.moe_shared_expert_intermediate_size
    return ReferenceMoE(
        moe_config(config),
        dtype=dtype,
        device=device,
        shared_expert=None if shared is None else DenseMLP(config, dtype, device, shared),
    )


class DenseBlock(nn.Module):
    def __init__(self, config: GPTConfig, dtype=None, device=None, index: int = 0) -> None:
        super().__init__()
        self.input_norm = make_norm(config, dtype, device)
        self.attention = DenseAttention(config, dtype, device)
        self.post_attention_norm = make_norm(config, dtype, device)
        self.mlp = (
            _dense_moe(config, dtype, device)
            if config.is_moe_layer(index)
            else DenseMLP(config, dtype, device)
        )
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_norm(x), rope))
        return x + self.dropout(self.mlp(self.post_attention_norm(x)))


class DenseEmbedding(nn.Module):
    """Word (and learned position) embeddings, built on the meta device: ReferenceGPT
    draws them."""

    def __init__(self, config: GPTConfig, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.word = meta_embedding(config.vocab_size, config.hidden_size, dtype)
        if config.position_embedding == "learned":
            self.position = meta_embedding(
                config.max_position_embeddings, config.hidden_size, dtype
            )
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = scale_embedding(self.config, self.word(ids.t()))  # [s, b, h]
        if hasattr(self, "position"):
            x = x + self.position.weight[: ids.shape[1]].unsqueeze(1)
        return self.dropout(x)


class ReferenceGPT(nn.Module):
    """Dense GPT. ids `[batch, seq]` -> logits `[batch, seq, vocab]`, or the mean loss with targets.

    Initialised like `GPTModel` (`models/initialization.py`): one seed from the default
    generator, then each parameter drawn from (seed, name), so after the same
    `torch.manual_seed` it equals the merge of any TP size's `GPTModel` shards.
    """

    def __init__(self, config: GPTConfig, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.config = config
        # Built on meta (nn.Linear would draw its own init), then allocated and drawn once.
        self.embedding = DenseEmbedding(config, dtype)
        self.layers = nn.ModuleList(
            DenseBlock(config, dtype, "meta", i) for i in range(config.num_layers)
        )
        self.final_norm = make_norm(config, dtype, "meta")
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device="meta"
            )
        device = torch.empty(0, device=device).device  # None: the default device
        if device.type != "meta":
            to_empty(self, device)
            reset_expert_biases(self)
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """GPT-2 / Megatron init (`gpt_parameter_init`) from `seed`, by default one draw of
        the default generator."""
        initialize_gpt_parameters(self, self.config, seed=draw_seed() if seed is None else seed)

    def head_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.config.tie_embeddings else self.lm_head.weight

    def aux_loss(self) -> torch.Tensor | float:
        """The MoE layers' balancing and z losses of the last forward, summed (0 without
        MoE): add it to the loss before backward."""
        return sum(
            layer.mlp.aux_loss for layer in self.layers if isinstance(layer.mlp, ReferenceMoE)
        )

    def forward(
        self, ids: torch.Tensor, target: torch.Tensor | None = None, ignore_index: int = -100
    ) -> torch.Tensor:
        x = self.embedding(ids)
        rope = None
        if self.config.position_embedding == "rotary":
            c = self.config
            rope = rotary_tables(
                ids.shape[1], c.head_dim, c.rotary_base, x.device, x.dtype, c.rotary_scaling
            )
        for layer in self.layers:
            x = layer(x, rope)
        logits = F.linear(self.final_norm(x), self.head_weight()).transpose(0, 1)  # [b, s, V]
        if target is None:
            return logits
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index
        )
