"""All-gather of updated parameters over data parallelism, bucket by bucket, optionally
overlapped with the next forward pass (Megatron's `--overlap-param-gather`).

After the distributed optimizer's step each DP rank holds fresh values only for its slice
of every bucket of the parameter buffers. `launch()` all-gathers every bucket: at once
and waited, or (overlap) started asynchronously, each one waited just before its first use:
forward pre-hooks on every module that owns parameters wait for the buckets holding them.
A parameter read by a module whose own forward never runs (an LM head reading the word
embedding's weight) is waited for by its model chunk's pre-hook instead.

Gathers are started in the order their buckets were first needed in the forward passes
since the previous launch (the same on every DP rank: they run the same modules), so the
bucket needed first is started first; before any forward has run, in reverse bucket order.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
from torch import nn

from .. import comm
from .grad_buffer import GradBuffer

__all__ = ["ParamGather"]

Key = tuple[int, int]  # (buffer index, bucket index)


class ParamGather:
    """The all-gathers of `buffers` (which own the parameters of `chunks`) over `dp_group`,
    or over a buffer's own `reduce_group` where it has one (expert weights: the ranks holding
    the same experts)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        buffers: Sequence[GradBuffer],
        dp_group: dist.ProcessGroup,
        *,
        overlap: bool,
    ) -> None:
        self.buffers, self.dp_group, self.overlap = list(buffers), dp_group, overlap
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self._key_of = {
            id(p): (i, b.entry(p).bucket) for i, b in enumerate(self.buffers) for p in b.params
        }
        self._default = [
            (i, bucket.index) for i, b in enumerate(self.buffers) for bucket in reversed(b.buckets)
        ]
        self._pending: dict[Key, comm.PendingCollective] = {}
        self._launched: list[Key] = []  # launch order of the pending gathers
        self._used: list[Key] = []  # first-use order since the last launch
        self._seen_modules: set[int] = set()
        self._hooks = []
        if overlap:
            for chunk in chunks:
                self._hooks.append(chunk.register_forward_pre_hook(self._chunk_hook(chunk)))
                for module in chunk.modules():
                    keys = self._keys(module.parameters(recurse=False))
                    if keys:
                        self._hooks.append(
                            module.register_forward_pre_hook(self._module_hook(module, keys))
                        )

    def _keys(self, params) -> list[Key]:
        return list(dict.fromkeys(self._key_of[id(p)] for p in params if id(p) in self._key_of))

    def _module_hook(self, module: nn.Module, keys: list[Key]):
        def hook(_module, _args) -> None:
            self._seen_modules.add(id(module))
            self._use(keys)

        return hook

    def _chunk_hook(self, chunk: nn.Module):
        def hook(_module, _args) -> None:
            # Parameters of modules that have not run in a forward so far: waited now.
            unseen = [
                p
                for m in chunk.modules()
                if id(m) not in self._seen_modules
                for p in m.parameters(recurse=False)
            ]
            self._use(self._keys(unseen))

        return hook

    def _use(self, keys: list[Key]) -> None:
        for key in keys:
            if key not in self._used:
                self._used.append(key)
            if key in self._pending:
                self._wait_through(key)

    def _wait_through(self, key: Key) -> None:
        """Wait for `key`'s gather and every gather launched before it (in launch order)."""
        while self._launched:
            first = self._launched.pop(0)
            bucket = self.buffers[first[0]].buckets[first[1]]
            bucket.param.copy_(self._pending.pop(first).wait())
            if first == key:
                return

    def launch(self) -> None:
        """All-gather every bucket's parameters (each rank contributes its slice): started
        and waited now, or with overlap started only. A collective over the DP group."""
        self.finish()
        order = [k for k in self._used if k in self._key_set()] + [
            k for k in self._default if k not in self._used
        ]
        self._used = []
        for key in order:
            buffer = self.buffers[key[0]]
            group = self.dp_group if buffer.reduce_group is None else buffer.reduce_group
            if dist.get_world_size(group) == 1:
                continue
            bucket = buffer.buckets[key[1]]
            lo, hi = bucket.shard(dist.get_rank(group))
            pending = comm.all_gather_async(buffer.param_data[lo:hi], 0, group)
            if self.overlap:
                self._pending[key] = pending
                self._launched.append(key)
            else:
                bucket.param.copy_(pending.wait())

    def _key_set(self) -> set[Key]:
        return set(self._default)

    def finish(self) -> None:
        """Wait for every gather still in flight (before anything reads all parameters)."""
        if self._launched:
            self._wait_through(self._launched[-1])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
