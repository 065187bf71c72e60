"""Helpers on nn.Modules shared by tpcore's layers and models."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn


def to_empty(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)`: uninitialized tensors of the same shapes and dtypes
    on `device`. torch's own takes `empty_like` of each tensor, which for a meta tensor runs
    torch's Python reference, which imports torch.fx's symbolic shapes and sympy at its first
    call: 1.5 s of CPU in every process that builds a model. A contiguous tensor (every
    parameter and buffer tpcore makes) gets `torch.empty`, the same layout; any other keeps
    torch's `empty_like` and its rule for strides."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return torch.empty(t.size(), dtype=t.dtype, device=device)
        return torch.empty_like(t, device=device)

    return module._apply(empty)


def to_empty_keeping_attributes(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`to_empty(module, device)`, keeping the attributes tpcore sets on parameters
    (`shard_spec`, `sequence_parallel`): moving off the meta device makes new
    Parameter objects, which would drop them."""
    attributes = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    to_empty(module, device)
    for name, p in module.named_parameters():
        p.__dict__.update(attributes[name])
    return module


def meta_embedding(
    num_embeddings: int,
    embedding_dim: int,
    dtype: torch.dtype | None = None,
    padding_idx: int | None = None,
) -> nn.Embedding:
    """`nn.Embedding(num_embeddings, embedding_dim)` on the meta device, weight
    `[num_embeddings, embedding_dim]` not drawn (its owner draws or loads it after
    `to_empty`). nn.Embedding's own init would run `normal_` on the meta tensor, which torch
    implements in Python and which imports torch._dynamo and sympy: 2 s of CPU in every
    process that builds a model and trains nothing (generate, convert, the plots)."""
    weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")
    return nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, _weight=weight)


class SharesProcessGroups:
    """Mixed into tpcore's modules that hold a process group: `copy.deepcopy` gives a copy
    that shares the group and copies everything else (weights, buffers, submodules). A
    group is a handle on the ranks' communicator, which cannot be copied; before this,
    deep-copying a split model (a reference model for DPO, an EMA copy) raised "cannot
    pickle ProcessGroup". The parameters keep the attributes tpcore sets on them
    (`sequence_parallel`, `shard_spec`), which torch's Parameter copy drops; a
    trainer's `main_grad` buffer is left behind."""

    def __deepcopy__(self, memo: dict) -> "SharesProcessGroups":
        for value in vars(self).values():
            if isinstance(value, dist.ProcessGroup):
                memo.setdefault(id(value), value)
        for p in self.parameters():
            if id(p) not in memo:
                clone = copy.deepcopy(p, memo)
                clone.__dict__.update(
                    {k: copy.deepcopy(v, memo) for k, v in p.__dict__.items() if k != "main_grad"}
                )
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone
