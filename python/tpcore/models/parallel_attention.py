"""The tensor-parallel GPT's self-attention (`GPTModel`'s `layers.i.attention`).

One column-parallel QKV projection whose shard holds whole heads of Q, K and V for this rank
(GQA: whole kv heads when TP divides them, else a copy of the one kv head this rank's queries
use, its gradient summed over the copies: `gqa.py`), optional q / k norms (over each head,
replicated; or over the whole projection, split by head: `SplitRMSNorm`), rotary embeddings,
causal `scaled_dot_product_attention` (unfused with attention dropout:
`common.attention_core`) or, with a context-parallel group, attention across it
(`context_parallel_attention`), and a row-parallel output projection. Activations are
`[seq, batch, hidden]`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .. import _op_entry
from .._module_utils import SharesProcessGroups
from ..context_parallel import context_parallel_attention
from ..parallel_state import live_group_name
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..tensor_parallel.lora import active_adapter, column_forward
from ..tensor_parallel.mappings import copy_to_tensor_parallel
from ..tensor_parallel.random import MODEL_PARALLEL_RNG
from ..tensor_parallel.recompute import checkpoint
from ..tensor_parallel.shared_grads import sum_over_copies
from .common import apply_rotary, attention_core, make_norm
from .config import GPTConfig
from .gqa import kv_copies, replicated_kv_grad
from .kv_cache import KVCache
from .split_norm import SplitRMSNorm

__all__ = ["ParallelAttention"]


class ParallelAttention(SharesProcessGroups, nn.Module):
    def __init__(
        self,
        config: GPTConfig,
        group: dist.ProcessGroup,
        dtype: torch.dtype | None,
        context_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        c, tp = config, dist.get_world_size(group)
        self.config, self.group, self.tp_rank, self.tp_size = c, group, dist.get_rank(group), tp
        self.context_group = context_group
        # Fewer KV heads than ranks: one (replicated) KV head per rank.
        self.heads, self.kv_heads = c.num_attention_heads // tp, max(c.num_kv_heads // tp, 1)
        self.replicated_kv = kv_copies(c, tp) > 1
        common = dict(
            sequence_parallel=c.sequence_parallel, group=group, dtype=dtype, device="meta"
        )
        rows = (
            (self.heads + 2 * self.kv_heads) * c.head_dim * tp
        )  # the layer's "full" width, copies counted
        self.qkv = ColumnParallelLinear(c.hidden_size, rows, bias=c.qkv_bias, **common)
        self.proj = RowParallelLinear(
            c.num_attention_heads * c.head_dim,
            c.hidden_size,
            input_is_parallel=True,
            bias=c.proj_bias,
            **common,
        )
        # Not sequence-parallel: they see the whole sequence of this rank's heads. Over each
        # head: replicated weights. Over the projection: this rank's heads' slice of them.
        if c.qk_norm and c.qk_norm_scope == "projection":
            norm = dict(group=group, dtype=dtype, device="meta")
            self.q_norm = SplitRMSNorm(self.heads * c.head_dim, c.norm_eps, **norm)
            self.k_norm = SplitRMSNorm(self.kv_heads * c.head_dim, c.norm_eps, **norm)
        elif c.qk_norm:
            self.q_norm = make_norm(c, dtype, "meta", c.head_dim)
            self.k_norm = make_norm(c, dtype, "meta", c.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: tuple[KVCache, int] | None = None,
    ) -> torch.Tensor:
        qkv = self._qkv(x)  # [s, b, (h/tp + 2 kv/tp) d], the full sequence
        if cache is not None:  # decoding: no recompute, keys and values kept
            return self.proj(self._core(qkv, rope, cache))
        core = partial(self._core, rope=rope)
        # Selective recompute: the attention core's activations are rebuilt in backward.
        out = checkpoint(core, qkv) if self.config.recompute == "selective" else core(qkv)
        return self.proj(out)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        if not self.replicated_kv:
            return self.qkv(x)
        # The same GEMM, its weight and bias through replicated_kv_grad: copies of a KV head get the
        # summed gradient.
        c, layer = self.config, self.qkv
        weight, bias = (
            replicated_kv_grad(t, c, self.group, self.tp_size) for t in (layer.weight, layer.bias)
        )
        if (adapter := active_adapter(layer)) is not None:  # LoRA: B's K/V rows are copies too
            B = replicated_kv_grad(adapter.B, c, self.group, self.tp_size)
            return column_forward(layer, x, weight, bias, B)
        return _op_entry.column_parallel_linear(
            x, weight, bias, live_group_name(self.group), False, c.sequence_parallel
        )

    def _core(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        cache: tuple[KVCache, int] | None = None,
    ) -> torch.Tensor:
        d, (s, b) = self.config.head_dim, qkv.shape[:2]
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        projection_norms = self.config.qk_norm and self.config.qk_norm_scope == "projection"
        if projection_norms:
            q, k = self._projection_norms(q, k)
        q = q.view(s, b, self.heads, d)
        k, v = (t.view(s, b, self.kv_heads, d) for t in (k, v))
        if self.config.qk_norm and not projection_norms:
            q_params, k_params = self._summed_norm_parameters()
            q, k = (
                torch.func.functional_call(self.q_norm, q_params, (q,)),
                torch.func.functional_call(self.k_norm, k_params, (k,)),
            )
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:  # [cached + s] keys and values
            k, v = cache[0].append(cache[1], k, v)
        if self.context_group is not None and cache is None:  # (no attention dropout: check_cp)
            return context_parallel_attention(q, k, v, self.context_group, self.config.cp_comm_type)
        dropout = self.config.attention_dropout if self.training else 0.0
        # This rank's heads: its own dropout masks, from the model-parallel stream.
        return attention_core(q, k, v, dropout, MODEL_PARALLEL_RNG)

    def _projection_norms(
        self, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[s, b, h/tp x d]` and k `[s, b, kv/tp x d]` normalised over every rank's heads
        (`SplitRMSNorm`). A KV head copied over several ranks has its k-norm slice copied too:
        each copy's backward gives part of that slice's gradient, summed over the copies."""
        k_weight = sum_over_copies(
            self.k_norm.weight, self.group, kv_copies(self.config, self.tp_size)
        )
        k = torch.func.functional_call(self.k_norm, {"weight": k_weight}, (k,))
        return self.q_norm(q), k

    def _summed_norm_parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The q and k norms' parameters, for `functional_call`. The norms run over each head
        with weights shared by every head, and each rank holds some heads, so each rank's
        backward gives part of their gradient: all of them enter through one
        copy_to_tensor_parallel of their concatenation (identity; backward: one all-reduce
        over TP, not one per parameter), and `.grad` is the dense gradient on every rank.
        (KV heads copied over several ranks are normalised on each: their shares are summed
        as well, as the dense model's are.)"""
        norms = (self.q_norm, self.k_norm)
        if self.tp_size == 1:
            return tuple(dict(norm.named_parameters()) for norm in norms)
        named = [(i, n, p) for i, norm in enumerate(norms) for n, p in norm.named_parameters()]
        summed = copy_to_tensor_parallel(
            torch.cat([p.reshape(-1) for _, _, p in named]), self.group
        )
        pieces = summed.split([p.numel() for _, _, p in named])
        params: tuple[dict, dict] = ({}, {})
        for (i, n, p), piece in zip(named, pieces):
            params[i][n] = piece.view_as(p)
        return params
