"""Gradient reduction over data parallelism from contiguous buffers, optionally overlapped
with the backward pass (Megatron's `--overlap-grad-reduce`).

Every trainable parameter of every model chunk gets a `main_grad` view of a `GradBuffer`
(one per chunk and parameter dtype). A hook after each gradient accumulation adds the
fresh `.grad` into `main_grad` and drops it, so micro-batches accumulate in place (fp32 by
default) and no `.grad` outlives its accumulation. With overlap, a parameter is ready once
its gradient has been accumulated once per micro-batch of the step; when every parameter
of a bucket is ready the bucket's reduction (all-reduce, or reduce-scatter for the
distributed optimizer) is started asynchronously. Buckets start strictly in order within a
buffer, so every DP rank issues the same collectives in the same order even when a
parameter is unused (its bucket then starts in `finish_grad_sync`, with the ones after it).
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from .grad_buffer import Bucket, GradBuffer, default_bucket_size

__all__ = ["DataParallelGrads"]


class DataParallelGrads:
    """Contiguous `main_grad` buffers of `chunks` and their reduction over `dp_group`.

    Per step: `start_step(num_micro_batches)`, the forward/backward passes, then
    `finish_grad_sync()` (after it every `main_grad` holds the DP mean, summed over TP for
    sequence-parallel parameters and over `embedding_group` for the `tied` copies; with
    `reduce_scatter` only this DP rank's slice of each bucket is valid), then the optimizer,
    then `zero_grad()`. Frozen parameters (`requires_grad=False`) get no buffer.
    """

    def __init__(
        self, chunks: nn.Module | Sequence[nn.Module], *, dp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None = None,
        overlap_grad_reduce: bool = False, reduce_scatter: bool = False, grad_dtype: torch.dtype = torch.float32,
        bucket_size: int | None = None, tied: Sequence[nn.Parameter] = (), embedding_group: dist.ProcessGroup | None = None,
    ) -> None:
        chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
        self.dp_group, self.tp_group, self.embedding_group = dp_group, tp_group, embedding_group
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.overlap, self.reduce_scatter = overlap_grad_reduce, reduce_scatter
        embedding_sum = embedding_group is not None and dist.get_world_size(embedding_group) > 1
        self.tied = list(tied) if embedding_sum else []
        if any(getattr(p, "sequence_parallel", False) for c in chunks for p in c.parameters()) and tp_group is None:
            raise ValueError("tpcore: DataParallelGrads: sequence-parallel parameters need tp_group (their gradients are summed over TP)")
        self.buffers: list[GradBuffer] = []
        self.chunk_buffers: list[list[GradBuffer]] = []
        for chunk in chunks:
            named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
            if not named:
                self.chunk_buffers.append([])
                continue
            size = bucket_size or default_bucket_size(named[0][1].device)
            mine = []
            for dtype in dict.fromkeys(p.dtype for _, p in named):
                group = [(n, p) for n, p in reversed(named) if p.dtype == dtype]  # reverse order of use
                mine.append(GradBuffer(group, grad_dtype=grad_dtype, bucket_size=size, dp_size=self.dp_size,
                                       separate=self.tied, keep_params=reduce_scatter))
            self.chunk_buffers.append(mine)
            self.buffers.extend(mine)
        self.params = [p for b in self.buffers for p in b.params]
        self._index_of = {id(p): i for i, b in enumerate(self.buffers) for p in b.params}
        self._expected: int | None = None
        self._counts: dict[int, int] = {}
        self._waiting: list[list[int]] = []  # per buffer, per bucket: parameters not yet ready
        self._next: list[int] = []  # per buffer: index of the next bucket to start
        self._pending: dict[tuple[int, int], comm.PendingCollective | None] = {}
        self.finished = False
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self)) for p in self.params]
        self._reset()

    @property
    def num_buckets(self) -> int:
        return sum(len(b.buckets) for b in self.buffers)

    @property
    def buckets_started(self) -> int:
        """Buckets whose reduction has started this step (all of them after `finish_grad_sync`)."""
        return sum(self._next)

    # -- per step -------------------------------------------------------------------------

    def _reset(self) -> None:
        self._counts = {id(p): 0 for p in self.params}
        self._waiting = [[len(bucket.params) for bucket in b.buckets] for b in self.buffers]
        self._next = [0] * len(self.buffers)
        self._pending = {}
        self.finished = False

    def start_step(self, num_micro_batches: int) -> None:
        """Before the step's first backward: each parameter's gradient will be accumulated
        `num_micro_batches` times; the last time makes it ready for reduction."""
        if num_micro_batches < 1:
            raise ValueError(f"tpcore: DataParallelGrads.start_step: num_micro_batches must be >= 1, got {num_micro_batches}")
        self._expected = num_micro_batches

    def _on_grad(self, p: nn.Parameter) -> None:
        """After autograd accumulated into `p.grad`: move it into `main_grad`."""
        if p.grad is None:
            return
        i = self._index_of[id(p)]
        entry = self.buffers[i].entry(p)
        if (i, entry.bucket) in self._pending:
            raise RuntimeError(
                f"tpcore: the gradient of {entry.name} arrived after its bucket's reduction started (accumulated more than "
                f"{self._expected} times this step: a second backward through it?); start_step() must get the number of "
                "backward passes through every parameter, or turn --overlap-grad-reduce off"
            )
        p.main_grad.add_(p.grad)
        p.grad = None
        self._counts[id(p)] += 1
        if self.overlap and self._expected is not None and self._counts[id(p)] == self._expected:
            self._waiting[i][entry.bucket] -= 1
            self._start_ready(i)

    def _start_ready(self, i: int) -> None:
        """Start, in order, the buckets of buffer `i` whose parameters are all ready."""
        buckets = self.buffers[i].buckets
        while self._next[i] < len(buckets) and self._waiting[i][self._next[i]] == 0:
            self._start(i, buckets[self._next[i]])
            self._next[i] += 1

    def _start(self, i: int, bucket: Bucket) -> None:
        if self.dp_size == 1:
            self._pending[(i, bucket.index)] = None
        elif self.reduce_scatter:
            self._pending[(i, bucket.index)] = comm.reduce_scatter_async(bucket.grad, 0, self.dp_group)
        else:
            self._pending[(i, bucket.index)] = comm.all_reduce_inplace_async(bucket.grad, self.dp_group)

    def finish_grad_sync(self) -> None:
        """Start the buckets not started yet (all of them without overlap), wait for every
        reduction, average over DP, then sum sequence-parallel gradients over TP and the tied
        embedding's over the embedding group. Collectives: the same on every DP rank."""
        for i, buffer in enumerate(self.buffers):
            while self._next[i] < len(buffer.buckets):
                self._start(i, buffer.buckets[self._next[i]])
                self._next[i] += 1
        for i, buffer in enumerate(self.buffers):
            for bucket in buffer.buckets:
                pending = self._pending[(i, bucket.index)]
                if pending is None:
                    continue
                result = pending.wait()
                if self.reduce_scatter:
                    lo, hi = bucket.shard(self.dp_rank)
                    buffer.grad_data[lo:hi].copy_(result).div_(self.dp_size)
                else:
                    bucket.grad.div_(self.dp_size)
        self._pending = {k: None for k in self._pending}  # started: a late gradient still raises
        self._sum_sequence_parallel()
        self._sum_tied()
        self.finished = True

    def _sum_sequence_parallel(self) -> None:
        # Each TP rank saw only its sequence shard: sum over TP (after the DP mean; both are sums).
        grads = [p.main_grad for p in self.params if getattr(p, "sequence_parallel", False)]
        if not grads or dist.get_world_size(self.tp_group) == 1:
            return
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.tp_group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    def _sum_tied(self) -> None:
        # The first and last stage's copies of the tied embedding take the same (summed) step.
        # With reduce-scatter only this DP rank's slice is valid, and the bucket holding the
        # embedding alone is laid out alike on both stages, so that slice is summed.
        for p in self.tied:
            buffer = self.buffers[self._index_of[id(p)]]
            if self.reduce_scatter:
                e = buffer.entry(p)
                lo, hi = buffer.buckets[e.bucket].shard(self.dp_rank)
                lo, hi = max(lo, e.start), min(hi, e.end)
                if lo < hi:
                    piece = buffer.grad_data[lo:hi]
                    piece.copy_(comm.all_reduce(piece, self.embedding_group))
            else:
                p.main_grad.copy_(comm.all_reduce(p.main_grad, self.embedding_group))

    def zero_grad(self) -> None:
        """After the optimizer step: empty every buffer for the next step."""
        for buffer in self.buffers:
            buffer.zero()
        for p in self.params:
            p.grad = None
        self._reset()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _weak_hook(grads: DataParallelGrads) -> Callable[[nn.Parameter], None]:
    """`grads._on_grad` without a strong reference to `grads`. A parameter's hooks live in
    C++, where Python's garbage collector cannot see them: a bound method there would make
    parameter -> hook -> grads -> parameter a cycle nothing frees, keeping the model, the
    buffers and the process groups alive until the interpreter exits."""
    ref = weakref.ref(grads)

    def hook(p: nn.Parameter) -> None:
        owner = ref()
        if owner is not None:
            owner._on_grad(p)

    return hook
