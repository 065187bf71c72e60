"""Tensor-parallel linear layers (Megatron-LM's column- and row-parallel linear).

Forward and backward run in C++ autograd functions behind custom operators
(`torch.ops.tpcore.column_parallel_linear`, ...: torch.compile traces them). Weights are
initialised TP-size invariant and sharded: a layer takes one seed from the default
generator and each rank draws only the tiles of its own slice (`initialization.py`),
so a layer made after `torch.manual_seed(s)` at TP=N holds exactly the slices of the
TP=1 layer made after the same seed, and no rank builds the full weight. Seed every
rank alike. `init_method="dense"` draws the full weight exactly as `nn.Linear` does
instead (equal to `nn.Linear` at TP=1; costs a full weight per rank).
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import _op_entry, comm
from .._module_utils import SharesProcessGroups, to_empty, to_empty_keeping_attributes
from .._validation import check_positive_ints
from ..parallel_state import live_group_name, resolve_tensor_group
from .initialization import ShardedInit, check_init_method, draw_seed, init_shard_
from .lora import active_adapter, column_forward, row_forward
from .shard_spec import ShardSpec, set_shard_spec

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "InitMethod"]

InitMethod = Union[ShardedInit, Callable[[torch.Tensor], object], Literal["dense"], None]
"""How a layer's weight starts (the `init_method` argument of the layers):

- None (default): sharded draw of `nn.Linear`'s distributions, weight and bias
  uniform(-1/sqrt(in), 1/sqrt(in)); each rank draws only its slice.
- a `ShardedInit` (e.g. `ShardedInit.normal(0.02)`): sharded draw of the weight, zero bias.
- "dense": the full weight and bias drawn from the default generator exactly as
  `nn.Linear.reset_parameters` does, this rank's slice kept: equal to `nn.Linear` made
  after the same seed at TP=1 (for tests). Builds the full `[out, in]` on every rank.
- a callable `init_method(full_weight)`: initialises the full `[out, in]` weight on CPU
  in place (Megatron's convention); the bias starts at zero. Builds the full weight on
  every rank: prefer a `ShardedInit` for large layers.
"""


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"tpcore: {what} ({numerator}) is not divisible "
            f"by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def _master_parameters(
    out_features: int, in_features: int, has_bias: bool, init_method: InitMethod, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full weight `[out, in]` and bias `[out]` on CPU, drawn from the default generator.

    `init_method="dense"` draws exactly as `nn.Linear.reset_parameters` does; a callable
    initialises the weight and the bias starts at zero (Megatron's convention).
    """
    weight = torch.empty(out_features, in_features, dtype=dtype)
    bias = torch.empty(out_features, dtype=dtype) if has_bias else None
    if init_method == "dense":
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(bias, -bound, bound)
    else:
        init_method(weight)
        if bias is not None:
            nn.init.zeros_(bias)
    return weight, bias


class _ParallelLinear(SharesProcessGroups, nn.Module):
    """Shared construction of the two layers; `shard_dim` is the weight dim split over TP."""

    shard_dim: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        skip_bias_add: bool,
        sequence_parallel: bool,
        group: dist.ProcessGroup | None,
        init_method: InitMethod,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        check_positive_ints(type(self).__name__, in_features=in_features, out_features=out_features)
        check_init_method(type(self).__name__, init_method)
        self.group = resolve_tensor_group(group)
        self.tp_size = dist.get_world_size(self.group)
        self.tp_rank = dist.get_rank(self.group)
        self.in_features, self.out_features = in_features, out_features
        self.skip_bias_add, self.sequence_parallel = skip_bias_add, sequence_parallel
        full = [out_features, in_features]
        what = ("out_features", "in_features")[self.shard_dim]
        full[self.shard_dim] = _divide(
            full[self.shard_dim], self.tp_size, f"{type(self).__name__} {what}"
        )
        dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(full, dtype=dtype, device=device))
        placement = dict(tp_size=self.tp_size, tp_rank=self.tp_rank, group=self.group)
        set_shard_spec(
            self.weight, ShardSpec((out_features, in_features), self.shard_dim, **placement)
        )
        bias_size = full[0]
        self.bias = (
            nn.Parameter(torch.empty(bias_size, dtype=dtype, device=device)) if bias else None
        )
        if self.bias is not None:
            # A column bias is sharded with the weight; a row bias is replicated (its
            # gradient is whole on every rank: the layer sums it under sequence parallelism).
            set_shard_spec(
                self.bias,
                ShardSpec((out_features,), 0 if self.shard_dim == 0 else None, **placement),
            )
        if self.weight.device.type != "meta":
            self._initialize(init_method)

    def _initialize(self, init_method: InitMethod) -> None:
        if init_method is not None and not isinstance(init_method, ShardedInit):
            has_bias = self.bias is not None
            self._load_master(
                *_master_parameters(
                    self.out_features, self.in_features, has_bias, init_method, self.weight.dtype
                )
            )
            return
        seed = draw_seed()
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform(a=sqrt(5)) and nn.Linear's bias
        weight_init = init_method or ShardedInit.uniform(-bound, bound)
        full = (self.out_features, self.in_features)
        n = self.weight.shape[self.shard_dim]
        mine = [(0, self.tp_rank * n, n)]
        init_shard_(
            self.weight,
            weight_init,
            seed=seed,
            key="weight",
            full_shape=full,
            dim=self.shard_dim,
            ranges=mine,
        )
        if self.bias is not None:
            bias_init = (
                ShardedInit.uniform(-bound, bound)
                if init_method is None
                else ShardedInit.constant(0.0)
            )
            init_shard_(
                self.bias,
                bias_init,
                seed=seed,
                key="bias",
                full_shape=full[:1],
                ranges=mine if self.shard_dim == 0 else None,
            )

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        return full.chunk(self.tp_size, dim)[self.tp_rank]

    def _load_master(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Keep this rank's slices of full parameters (same on every rank)."""
        with torch.no_grad():
            self.weight.copy_(self._shard(weight, self.shard_dim))
            if self.bias is not None:
                self.bias.copy_(self._shard(bias, 0) if self.shard_dim == 0 else bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, **kwargs) -> "_ParallelLinear":
        """The shards of `linear` for this rank (same dtype and device); kwargs as the
        constructor."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            dtype=linear.weight.dtype,
            device="meta",
            **kwargs,
        )
        to_empty_keeping_attributes(layer, linear.weight.device)
        layer._load_master(
            linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        )
        return layer

    def to_dense(self) -> nn.Linear:
        """The full `nn.Linear`, gathered from every rank (a collective: call on all TP ranks)."""
        dense = to_empty(
            nn.Linear(
                self.in_features,
                self.out_features,
                self.bias is not None,
                dtype=self.weight.dtype,
                device="meta",
            ),
            self.weight.device,
        )
        with torch.no_grad():
            dense.weight.copy_(comm.all_gather(self.weight.detach(), self.shard_dim, self.group))
            if self.bias is not None:
                bias = self.bias.detach()
                dense.bias.copy_(
                    comm.all_gather(bias, 0, self.group) if self.shard_dim == 0 else bias
                )
        return dense

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_size={self.tp_size}, weight_shard={list(self.weight.shape)}"
        )

    def _result(
        self, output: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        return (output, self.bias) if self.skip_bias_add else output

    def _forward_bias(self) -> torch.Tensor | None:
        return None if self.skip_bias_add else self.bias


class ColumnParallelLinear(_ParallelLinear):
    """`y = x W^T + b` with W split along its output features (columns of `x W^T`).

    Shapes: weight `[out/tp, in]`, bias `[out/tp]`; input `[..., in]` (the full
    features, replicated over TP); output `[..., out/tp]`, or `[..., out]` with
    `gather_output=True`. With `sequence_parallel=True` the input is this rank's
    sequence shard `[s/tp, b, in]`, gathered along dim 0 before the GEMM.
    Backward all-reduces the input gradient asynchronously while the weight
    gradient is computed. With `skip_bias_add=True` returns `(output, bias)`.
    """

    shard_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        init_method: InitMethod = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if gather_output and sequence_parallel:
            raise ValueError(
                "tpcore: ColumnParallelLinear: gather_output=True "
                "cannot be used with sequence_parallel=True"
            )
        super().__init__(
            in_features,
            out_features,
            bias,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
            group=group,
            init_method=init_method,
            dtype=dtype,
            device=device,
        )
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if (adapter := active_adapter(self)) is not None:  # LoRA (`lora.py`)
            out = column_forward(self, x, self.weight, self._forward_bias(), adapter.B)
            return self._result(out)
        out = _op_entry.column_parallel_linear(
            x,
            self.weight,
            self._forward_bias(),
            live_group_name(self.group),
            self.gather_output,
            self.sequence_parallel,
        )
        return self._result(out)


class RowParallelLinear(_ParallelLinear):
    """`y = x W^T + b` with W split along its input features (rows of W^T).

    Shapes: weight `[out, in/tp]`, bias `[out]` replicated and added after the
    reduction; input `[..., in/tp]` with `input_is_parallel=True`, else `[..., in]`
    (split here); output `[..., out]` summed over TP, or this rank's sequence shard
    `[s/tp, b, out]` (reduce-scatter) with `sequence_parallel=True`; the bias gradient is
    then summed over TP inside, so the layer is correct on its own.
    With `skip_bias_add=True` returns `(output, bias)` (with sequence parallelism the
    bias comes through f, so adding it to the shard keeps its gradient right).
    """

    shard_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        group: dist.ProcessGroup | None = None,
        init_method: InitMethod = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "tpcore: RowParallelLinear: sequence_parallel=True needs input_is_parallel=True"
            )
        super().__init__(
            in_features,
            out_features,
            bias,
            skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel,
            group=group,
            init_method=init_method,
            dtype=dtype,
            device=device,
        )
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if active_adapter(self) is not None:  # LoRA (`lora.py`)
            out = row_forward(self, x, self._forward_bias())
        else:
            out = _op_entry.row_parallel_linear(
                x,
                self.weight,
                self._forward_bias(),
                live_group_name(self.group),
                self.input_is_parallel,
                self.sequence_parallel,
            )
        if self.skip_bias_add and self.sequence_parallel and self.bias is not None:
            # The caller adds the bias to a sequence shard: hand it over through f, whose
            # backward sums its gradient over TP, so the bias stays correct on its own.
            return out, _op_entry.copy_to_tensor_parallel(self.bias, live_group_name(self.group))
        return self._result(out)
