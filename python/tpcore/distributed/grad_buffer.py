"""Contiguous gradient buffers: every parameter's gradient is a view (`main_grad`) of one
flat buffer per (parameter dtype, gradient dtype), split into buckets in reverse order of
use, so that the bucket of the last layers is complete first and each bucket is reduced
over data parallelism as one collective.

With the distributed optimizer the parameters themselves move into a flat buffer of the
same layout (`param_data`), so that each bucket's parameters can be all-gathered at once.
Every bucket is padded to a multiple of the DP size: DP rank r owns the contiguous slice
`[r * n / dp, (r + 1) * n / dp)` of a bucket of n elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Bucket", "GradBuffer", "default_bucket_size", "BUCKET_ALIGNMENT"]

# Bucket sizes are multiples of this (x DP): slices start on 64-element boundaries, which
# keeps vectorised kernels and NCCL on aligned addresses.
BUCKET_ALIGNMENT = 64


def default_bucket_size(device: torch.device | str) -> int:
    """Elements per bucket when `--ddp-bucket-size` is not given: 40M on GPUs (Megatron's
    choice: large enough for NCCL's bandwidth), 1M on CPU, where a collective through
    shared memory reaches its bandwidth at a few MB and smaller buckets overlap sooner."""
    return 40_000_000 if torch.device(device).type == "cuda" else 1_000_000


@dataclass
class _Entry:
    """Where one parameter lives in its buffer."""

    name: str
    start: int
    """First element of the parameter in the buffer."""
    end: int
    """One past its last element."""
    bucket: int
    """Index of its bucket."""


class Bucket:
    """Buffer elements `[start, end)` (a multiple of the DP size): the gradients (and, with
    the distributed optimizer, the values) of `params`, reduced as one collective."""

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        start: int,
        end: int,
        grad_data: torch.Tensor,
        param_data: torch.Tensor | None,
        dp_size: int,
    ) -> None:
        self.index, self.params, self.start, self.end = index, params, start, end
        self.grad = grad_data[start:end]
        """`[end - start]` view of the gradient buffer."""
        self.param = param_data[start:end] if param_data is not None else None
        """`[end - start]` view of the parameter buffer (distributed optimizer only)."""
        self.dp_size = dp_size

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, dp_rank: int) -> tuple[int, int]:
        """Buffer offsets `[lo, hi)` of the slice DP rank `dp_rank` owns."""
        size = self.numel // self.dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


class GradBuffer:
    """One flat gradient buffer (and optionally parameter buffer) for parameters of one dtype.

    `params` are `(name, parameter)` in the order their gradients become ready (reverse
    order of use in the forward). A new bucket starts once the current one holds
    `bucket_size` elements, and around every parameter in `separate` (the tied word
    embedding: its own bucket, laid out alike on the first and the last pipeline stage, so
    that both stages' DP ranks own the same slice of it). Over the last `bucket_size`
    elements the limit is a quarter of that: the last bucket's reduction is the one nothing
    can overlap, so it is kept small."""

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        *,
        grad_dtype: torch.dtype,
        bucket_size: int,
        dp_size: int,
        separate: Sequence[nn.Parameter] = (),
        keep_params: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not params:
            raise ValueError("tpcore: GradBuffer: no parameters")
        if bucket_size < 1:
            raise ValueError(
                f"tpcore: GradBuffer: bucket_size must be >= 1 element, got {bucket_size}"
            )
        first = params[0][1]
        self.param_dtype, self.grad_dtype, self.dp_size = first.dtype, grad_dtype, dp_size
        self.reduce_group = group
        """The group this buffer is summed over (and, reduce-scattered, sliced over): the
        data-parallel group, or for MoE experts the ranks holding the same ones."""
        self.reduce_rank = dist.get_rank(group) if group is not None else 0
        """This rank's slice of each bucket."""
        self.device = first.device
        if any(p.dtype != self.param_dtype or p.device != self.device for _, p in params):
            raise ValueError(
                "tpcore: GradBuffer: parameters of one buffer must share dtype and device"
            )
        separate_ids = {id(p) for p in separate}
        pad = BUCKET_ALIGNMENT * dp_size
        groups: list[list[tuple[str, nn.Parameter]]] = [[]]
        left = sum(p.numel() for _, p in params)  # elements from this parameter on
        for name, p in params:
            alone = id(p) in separate_ids
            if alone and groups[-1]:
                groups.append([])
            groups[-1].append((name, p))
            left -= p.numel()
            limit = bucket_size if left >= bucket_size else max(1, bucket_size // 4)
            if alone or sum(q.numel() for _, q in groups[-1]) >= limit:
                groups.append([])
        groups = [g for g in groups if g]
        # Layout: each bucket's parameters back to back, the bucket padded to `pad`.
        self.entries: dict[int, _Entry] = {}  # id(parameter) -> where it lives
        spans, offset = [], 0
        for index, group in enumerate(groups):
            start = offset
            for name, p in group:
                self.entries[id(p)] = _Entry(name, offset, offset + p.numel(), index)
                offset += p.numel()
            offset = start + -(-(offset - start) // pad) * pad
            spans.append((start, offset))
        self.numel = offset
        self.grad_data = torch.zeros(offset, dtype=grad_dtype, device=self.device)
        """`[numel]`: every parameter's gradient (`main_grad` views), padding zero."""
        self.param_data = None
        if keep_params:
            # The parameters move into one flat tensor (their storage is replaced, the
            # Parameter objects stay), so a bucket's values can be all-gathered in place.
            self.param_data = torch.zeros(offset, dtype=self.param_dtype, device=self.device)
            for _, p in params:
                view = self.param_view(p)
                view.copy_(p.detach())
                p.data = view
        self.params = [p for _, p in params]
        for _, p in params:
            p.main_grad = self.grad_view(p)
        self.buckets = [
            Bucket(i, [p for _, p in group], lo, hi, self.grad_data, self.param_data, dp_size)
            for i, (group, (lo, hi)) in enumerate(zip(groups, spans))
        ]

    def entry(self, p: nn.Parameter) -> _Entry:
        return self.entries[id(p)]

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """`p`'s gradient: a view of the buffer shaped like `p`."""
        e = self.entries[id(p)]
        return self.grad_data[e.start : e.end].view(p.shape)

    def param_view(self, p: nn.Parameter) -> torch.Tensor:
        e = self.entries[id(p)]
        return self.param_data[e.start : e.end].view(p.shape)

    def shard_pieces(self, dp_rank: int) -> list[tuple[nn.Parameter, int, int, int]]:
        """`(parameter, bucket index, lo, hi)` for every parameter overlapping the slices DP
        rank `dp_rank` owns: elements `[lo, hi)` of the parameter's flattened values."""
        out = []
        for bucket in self.buckets:
            s0, s1 = bucket.shard(dp_rank)
            for p in bucket.params:
                e = self.entries[id(p)]
                lo, hi = max(e.start, s0), min(e.end, s1)
                if lo < hi:
                    out.append((p, bucket.index, lo - e.start, hi - e.start))
        return out

    def zero(self) -> None:
        self.grad_data.zero_()
