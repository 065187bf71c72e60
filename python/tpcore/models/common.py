"""Pieces both GPTs use: norms and rotary embeddings (no parallelism in them)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.dropout import tracked_dropout
from .config import GPTConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim (Zhang & Sennrich 2019), in float32; the weight
    applies after the cast back to x's dtype (as Llama's), or before it with
    `weight_after_cast=False` (as OLMo 2's)."""

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype | None = None,
        device=None,
        *,
        weight_after_cast: bool = True,
    ) -> None:
        super().__init__()
        self.eps, self.weight_after_cast = eps, weight_after_cast
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_after_cast:
            return self.normalized(x).to(x.dtype) * self.weight
        return (self.weight * self.normalized(x)).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight) over the last dim, in float32, cast back after the weight
    (Gemma's); the weight starts at zero."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype | None = None, device=None
    ) -> None:
        super().__init__(size, eps, dtype=dtype, device=device)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: GPTConfig, dtype=None, device=None, size: int | None = None) -> nn.Module:
    """The config's norm over the last `size` features (default: hidden_size)."""
    size = config.hidden_size if size is None else size
    if config.norm == "rmsnorm":
        return RMSNorm(size, config.norm_eps, dtype=dtype, device=device)
    if config.norm == "gemma_rmsnorm":
        return GemmaRMSNorm(size, config.norm_eps, dtype=dtype, device=device)
    return nn.LayerNorm(size, eps=config.norm_eps, bias=config.bias, dtype=dtype, device=device)


def scale_embedding(config: GPTConfig, x: torch.Tensor) -> torch.Tensor:
    """The word embeddings' lookup times `config.embedding_scale`, rounded to x's dtype first (as
    Gemma's)."""
    if config.embedding_scale is None:
        return x
    return x * torch.tensor(config.embedding_scale, dtype=x.dtype, device=x.device)


def rotary_frequencies(
    head_dim: int, base: float, scaling: dict | None, device=None
) -> torch.Tensor:
    """The `head_dim/2` rotary frequencies (fp32), scaled as `GPTConfig.rotary_scaling` says."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":  # = positions divided by factor
        return inv_freq / factor
    # llama3: wavelengths longer than the original context / low_freq_factor are stretched by
    # `factor`, shorter than context / high_freq_factor kept, and the band between blended.
    context = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, stretched)


def rotary_tables(
    seq_len: int, head_dim: int, base: float, device, dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[seq, 1, 1, head_dim/2]` for positions 0..seq-1 (computed in fp32)."""
    inv_freq = rotary_frequencies(head_dim, base, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype)[:, None, None, :], angles.sin().to(dtype)[:, None, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of x `[seq, batch, heads, head_dim]` by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def mlp_activation(config: GPTConfig, h: torch.Tensor) -> torch.Tensor:
    """The MLP's nonlinearity on fc1's output `[..., f]` (SwiGLU, GeGLU: `[..., 2f]`, gate then
    up)."""
    if config.gated_mlp:  # a TP shard holds this rank's rows of both gate and up
        gate, up = h.chunk(2, dim=-1)
        return (
            F.silu(gate) if config.activation == "swiglu" else F.gelu(gate, approximate="tanh")
        ) * up
    return F.gelu(h, approximate="tanh" if config.activation == "gelu" else "none")


def _attention_tracked_dropout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, stream: str
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) in fp32, tracked dropout, times v: `[b, h, s, d]`."""
    s = q.shape[2]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(tracked_dropout(probs, dropout, stream), v)


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    dropout_stream: str | None = None,
) -> torch.Tensor:
    """Causal attention. q `[s, b, h, d]`, k / v `[t, b, kv, d]` (kv divides h) -> `[s, b, h*d]`.
    With t > s (decoding after cached tokens) the queries are the last s positions.

    Dropout on the probabilities draws from torch's generator (inside SDPA), or, with
    `dropout_stream`, from that RNG-tracker stream: then the probabilities `[b, h, s, s]` are
    materialised (Megatron's unfused core attention) so tpcore's traceable dropout applies."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    s, t = q.shape[2], k.shape[2]
    if t > s:  # query i is position t - s + i: it sees keys up to there
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    elif dropout > 0 and dropout_stream is not None:
        out = _attention_tracked_dropout(q, k, v, dropout, dropout_stream)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True
        )
    s, b = out.shape[2], out.shape[0]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
