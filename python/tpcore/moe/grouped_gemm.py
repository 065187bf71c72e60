"""Grouped GEMM: every local expert's tokens through its own weight in one call.

`grouped_linear(x, weight, counts)`: `x [tokens, in]` holds the tokens of expert 0, then
expert 1, ... (`counts[e]` rows each, some possibly 0) and `weight [experts, out, in]`; row
block e of the result `[tokens, out]` is `x_e @ weight[e]^T`. Forward and both backward
products go through `torch._grouped_mm` (one C++ call per product on CPU, one kernel on CUDA)
where this torch, device and dtype have it and the shapes suit it (rows of a multiple of 16
bytes, some tokens), else through a loop over the experts.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["grouped_linear", "grouped_mm_available"]

# (device type, dtype) -> whether torch._grouped_mm ran there; probed once each.
_AVAILABLE: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for `dtype` on `device`'s type (tried once on a
    small problem; older torch versions, CUDA before sm90 and fp32 on CUDA lack it)."""
    key = (device.type, dtype)
    if key not in _AVAILABLE:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.zeros(16, 16, device=device, dtype=dtype)
                b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
                offsets = torch.tensor([8, 16], device=device, dtype=torch.int32)
                # the three layouts grouped_linear uses: forward, input and weight gradients
                torch._grouped_mm(a, b.transpose(1, 2), offs=offsets)
                torch._grouped_mm(a, b, offs=offsets)
                torch._grouped_mm(a.t(), a, offs=offsets)
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _AVAILABLE[key] = ok
    return _AVAILABLE[key]


def _suits_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes this problem: its kernels need every row (in, out)
    to be a multiple of 16 bytes (and on CUDA 16-byte aligned data); an empty batch goes
    through the loop, whose backward handles broadcast gradients of no rows."""
    if x.dtype != weight.dtype or x.shape[0] == 0:
        return False
    size = x.element_size()
    if (weight.shape[1] * size) % 16 or (weight.shape[2] * size) % 16:
        return False
    if x.is_cuda and (x.data_ptr() % 16 or weight.data_ptr() % 16):
        return False
    return grouped_mm_available(x.device, x.dtype)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):  # type: ignore[override]
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()  # a broadcast gradient (of a sum) has zero strides
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight, offs=offsets)
        if ctx.needs_input_grad[1]:
            # [out, tokens] x [tokens, in], cut along the tokens: [experts, out, in]
            grad_w = torch._grouped_mm(grad.t(), x, offs=offsets)
        return grad_x, grad_w, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """`x [tokens, in]` (expert-sorted, `counts[e]` rows of expert e), `weight [experts, out,
    in]` -> `[tokens, out]`, block e being `x_e @ weight[e]^T`."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"tpcore: grouped_linear: x {list(x.shape)} and weight {list(weight.shape)} must be "
            "[tokens, in] and [experts, out, in]"
        )
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"tpcore: grouped_linear: counts {list(counts)} must give the rows of each of the "
            f"{weight.shape[0]} experts and add up to the {x.shape[0]} tokens"
        )
    if _suits_grouped_mm(x, weight):
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return _GroupedLinear.apply(x.contiguous(), weight, offsets.to(x.device))
    blocks = x.split(list(counts))
    return torch.cat([block @ weight[e].t() for e, block in enumerate(blocks)])
