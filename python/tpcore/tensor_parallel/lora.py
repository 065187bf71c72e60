"""LoRA adapters on tensor-parallel linear layers (Hu et al. 2021), split like their layer.

`add_lora(model, rank=8, alpha=16, target_modules=["qkv", "fc1"])` gives every matching
ColumnParallelLinear / RowParallelLinear an adapter (`layer.lora`, parameters `lora.A` and
`lora.B`) and freezes every other parameter. The layer then computes
`y = x W^T + b + scale * dropout(x) A^T B^T`, scale = alpha / rank (alpha / sqrt(rank) with
rsLoRA). A starts as `nn.Linear`'s weight draw (TP-size invariant, like the layers' own
weights) and B at zero, as in PEFT, so a new adapter changes nothing.

The halves are split so that the adapter adds no collective to its layer:
- column layer (W `[out/tp, in]`): A `[r, in]` replicated, B `[out/tp, r]` split like W's
  rows. The adapter reads the layer's input after f (or after the sequence all-gather), so
  its input gradient joins the base's in the layer's one backward all-reduce
  (reduce-scatter).
- row layer (W `[out, in/tp]`): A `[r, in/tp]` split like W's columns, B `[out, r]`
  replicated. `B (x_s A_s^T)` is added to the layer's partial output before its all-reduce
  (reduce-scatter): the sum over ranks of `B (x_s A_s^T)` is `B (x A^T)`.

The replicated half (column A, row B) gets only this rank's share of its gradient (column:
from `dy_s B_s`; row: from `x_s A_s^T`). Its shard spec says `partial_grad`, like the norms'
under sequence parallelism, and `sum_partial_grads` sums all such gradients over TP in one
all-reduce per step: the trainer's gradient reduction and `finalize_model_grads` call it;
a script driving layers itself calls it after backward.

A fused layer (GPTModel's q|k|v and gate|up: named parts in its weight's shard spec) gets one
adapter per part, as separate q / k / v projections have in PEFT: A stacks the parts' A's
`[parts * r, in]`, B holds each part's rows of that part's B, and part p's rows read only
columns `[p r, (p + 1) r)` of `x A^T`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import _op_entry
from ..parallel_state import live_group_name
from .dropout import region_dropout
from .initialization import ShardedInit, draw_seed, init_shard_
from .shard_spec import ShardSpec, part_chunks, set_shard_spec, shard_spec

if TYPE_CHECKING:
    from .layers import ColumnParallelLinear, RowParallelLinear, _ParallelLinear

__all__ = ["LoRAAdapter"]


class LoRAAdapter(nn.Module):
    """The low-rank update `scale * B A` of one parallel layer's weight.

    Shapes: column layer A `[parts * r, in]` (replicated), B `[out/tp, r]`; row layer
    A `[r, in/tp]`, B `[out, r]` (replicated). `per_part=False` gives a fused column layer
    one adapter over all its parts (A `[r, in]`, PEFT's layout on Phi-3's qkv_proj), B still
    split like the weight's rows. `dtype` is the adapters' (default the layer's): adapters in
    float32 over a bfloat16 layer compute their product in float32 and add it to the
    layer's output before it is rounded, as PEFT does.
    """

    def __init__(
        self,
        layer: _ParallelLinear,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        dtype: torch.dtype | None = None,
        per_part: bool = True,
    ) -> None:
        super().__init__()
        check_lora_options(rank, alpha, dropout)
        self.column = layer.shard_dim == 0  # a ColumnParallelLinear (else a row layer)
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        self.use_rslora = use_rslora
        self.scale = alpha / (math.sqrt(rank) if use_rslora else rank)
        self.merged = False
        weight_spec = shard_spec(layer.weight)  # every parallel layer sets one
        out_features, in_features = weight_spec.global_shape
        placement = dict(tp_size=layer.tp_size, tp_rank=layer.tp_rank, group=layer.group)
        if self.column:
            # This rank's rows of each part of B (one group: one adapter over every part).
            self.part_rows = (
                [p.size // part_chunks(p.units, layer.tp_size) for p in weight_spec.parts]
                if per_part
                else [layer.weight.shape[0]]
            )
            a_rows = len(self.part_rows) * rank
            a_spec = ShardSpec((a_rows, in_features), partial_grad=True, **placement)
            b_spec = dataclasses.replace(weight_spec, global_shape=(out_features, rank))
        else:
            self.part_rows = [layer.weight.shape[0]]
            a_spec = dataclasses.replace(weight_spec, global_shape=(rank, in_features))
            b_spec = ShardSpec((out_features, rank), partial_grad=True, **placement)
        dtype = dtype or layer.weight.dtype
        device = layer.weight.device
        self.A = nn.Parameter(torch.empty(a_spec.local_shape, dtype=dtype, device=device))
        self.B = nn.Parameter(torch.zeros(b_spec.local_shape, dtype=dtype, device=device))
        set_shard_spec(self.A, a_spec)
        set_shard_spec(self.B, b_spec)
        if device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """A from `nn.Linear`'s draw (uniform over +-1/sqrt(in), this rank's slice only),
        B zero: a new adapter adds nothing."""
        spec = shard_spec(self.A)
        bound = 1 / math.sqrt(spec.global_shape[1])
        split = spec.kind == "parts"  # a row layer's A: this rank's columns only
        with torch.no_grad():
            init_shard_(
                self.A,
                ShardedInit.uniform(-bound, bound),
                seed=draw_seed(),
                key="lora_A",
                full_shape=spec.global_shape,
                dim=spec.dim if split else 0,
                ranges=spec.ranges()[1] if split else None,
            )
            self.B.zero_()

    def delta(self, x: torch.Tensor, B: torch.Tensor | None = None) -> torch.Tensor:
        """`scale * dropout(x) A^T B^T` in the adapters' dtype: `[..., out/tp]` for a column
        layer's input `[..., in]`, this rank's partial `[..., out]` for a row layer's
        `[..., in/tp]`. `B` replaces `self.B` (a view whose gradient is summed, GQA's copies)."""
        B = self.B if B is None else B
        # The column layer's input is replicated over TP: one mask on every rank. The row
        # layer's is this rank's slice of the features: its own mask.
        x = region_dropout(x, self.dropout, self.training, per_tp_rank=not self.column)
        h = F.linear(x.to(self.A.dtype), self.A)
        if len(self.part_rows) == 1:
            return F.linear(h, B) * self.scale
        pieces = zip(h.split(self.rank, -1), B.split(self.part_rows, 0))
        return torch.cat([F.linear(hp, Bp) for hp, Bp in pieces], -1) * self.scale

    def weight_delta(self) -> torch.Tensor:
        """`scale * B A` as this rank's piece of the layer's weight (the same shape)."""
        return weight_delta(self.A, self.B, self.scale, self.part_rows)

    def extra_repr(self) -> str:
        rslora = ", rslora" if self.use_rslora else ""
        return (
            f"rank={self.rank}, alpha={self.alpha:g}{rslora}, dropout={self.dropout:g}, "
            f"parts={len(self.part_rows)}, merged={self.merged}"
        )


def weight_delta(
    A: torch.Tensor, B: torch.Tensor, scale: float, part_rows: Sequence[int]
) -> torch.Tensor:
    """`scale * B A` per part: B's rows in parts of `part_rows`, part p times A's rows
    `[p r, (p + 1) r)` (one part: the plain product). Whole tensors or one rank's pieces."""
    if len(part_rows) == 1:
        return B @ A * scale
    rank = A.shape[0] // len(part_rows)
    pieces = zip(B.split(list(part_rows), 0), A.split(rank, 0))
    return torch.cat([Bp @ Ap for Bp, Ap in pieces], 0) * scale


def check_lora_options(rank: int, alpha: float, dropout: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"tpcore: LoRA rank must be a positive int, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"tpcore: LoRA alpha must be a positive number, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"tpcore: LoRA dropout must be in [0, 1), got {dropout!r}")


def active_adapter(layer: _ParallelLinear) -> LoRAAdapter | None:
    """The layer's adapter when its forward must add it (present and not merged)."""
    adapter = layer._modules.get("lora")
    return adapter if adapter is not None and not adapter.merged else None


def _check_input(layer: _ParallelLinear, x: torch.Tensor, features: int) -> None:
    """The base layers' own check, made here before the adapter path's first collective."""
    if x.dim() == 0 or x.shape[-1] != features:
        raise ValueError(
            f"tpcore: {type(layer).__name__} with LoRA: input of shape {list(x.shape)}, "
            f"expected [..., {features}]"
        )


def column_forward(
    layer: ColumnParallelLinear,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    B: torch.Tensor,
) -> torch.Tensor:
    """A column layer's output with its adapter: `[..., out/tp]` (or gathered)."""
    _check_input(layer, x, layer.in_features)
    group = live_group_name(layer.group)
    if layer.sequence_parallel:  # [s/tp, b, in] -> [s, b, in]; backward reduce-scatters
        x = _op_entry.gather_from_sequence_parallel(x, group, True)
    else:  # f: backward sums the base's and the adapter's input gradients in one all-reduce
        x = _op_entry.copy_to_tensor_parallel(x, group)
    y = (F.linear(x, weight, bias) + layer.lora.delta(x, B)).to(x.dtype)
    return _op_entry.gather_from_tensor_parallel(y, group) if layer.gather_output else y


def row_forward(
    layer: RowParallelLinear, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A row layer's output with its adapter: `[..., out]` (or `[s/tp, b, out]`)."""
    split = layer.input_is_parallel
    _check_input(layer, x, layer.in_features // layer.tp_size if split else layer.in_features)
    group = live_group_name(layer.group)
    if not layer.input_is_parallel:
        x = _op_entry.scatter_to_tensor_parallel(x, group)
    partial = (F.linear(x, layer.weight) + layer.lora.delta(x)).to(x.dtype)
    if layer.sequence_parallel:
        y = _op_entry.reduce_scatter_to_sequence_parallel(partial, group)
        if bias is not None:  # added to a sequence shard: its gradient summed through f
            bias = _op_entry.copy_to_tensor_parallel(bias, group)
    else:
        y = _op_entry.reduce_from_tensor_parallel(partial, group)
    return y if bias is None else y + bias
