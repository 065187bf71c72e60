"""An RMS norm over features that tensor parallelism splits: q / k norms over the whole q (or
k) projection, every head at once, not each head (OLMoE, OLMo 2 and 3 in `tpcore.hf`;
GPTModel with `qk_norm_scope="projection"`).

Each rank holds its heads' features and the matching slice of the norm's weight. The mean
of squares needs every feature: each rank sums its own squares, one all-reduce of those
`[..., 1]` sums gives the total (its backward all-reduces too, since every rank's output
depends on every rank's features). With KV heads copied over several ranks (TP > KV
heads), each copy is counted once per rank holding it, so the total is divided by
`tp x local features` rather than the dense width: the same mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._module_utils import SharesProcessGroups
from ..parallel_state import resolve_tensor_group
from ..tensor_parallel.mappings import copy_to_tensor_parallel, reduce_from_tensor_parallel
from .common import RMSNorm

__all__ = ["SplitRMSNorm"]


class SplitRMSNorm(SharesProcessGroups, RMSNorm):
    """`RMSNorm` over a feature dim split over the TP group: the weight applied before
    casting back (as transformers' `Olmo2RMSNorm`), or after it with `weight_after_cast`
    (as `OlmoeRMSNorm`).

    Shapes: input `[..., features/tp]` (this rank's heads), weight `[features/tp]`; output
    like the input. The mean runs over all `features`.
    """

    def __init__(
        self,
        local_features: int,
        eps: float,
        *,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        weight_after_cast: bool = False,
    ) -> None:
        RMSNorm.__init__(
            self, local_features, eps, dtype, device, weight_after_cast=weight_after_cast
        )
        self.group = resolve_tensor_group(group)
        self.tp_size = dist.get_world_size(self.group)

    @property
    def variance_epsilon(self) -> float:
        """transformers' name for `eps`."""
        return self.eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32, the mean of squares over every rank's features."""
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:  # forward and backward: the sum over every rank
            squares = copy_to_tensor_parallel(
                reduce_from_tensor_parallel(squares, self.group), self.group
            )
        return xf * torch.rsqrt(squares / (xf.shape[-1] * self.tp_size) + self.eps)

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.weight.shape)} of {self.weight.shape[0] * self.tp_size}, eps={self.eps}"
        )
