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
Each bucket is divided by the DP size as it starts (the mean, computed during the
backward), and the results of finished reductions are put in place from the hooks, so that
what is left after the backward is the waiting for the last buckets.

A word embedding that is also the LM head in the same chunk (`lookup_and_head`) would be
complete only when the backward ends, since autograd sums its two uses. With overlap it
gets a bucket of its own, first in order, and its lookup's gradient goes to a sink
(`tensor_parallel/gradient_sink.py`), token by token, never as a `[vocab/tp, h]` table:
the bucket starts once the LM head's gradient of the last micro-batch is in. The last
lookup's gradient, which arrives later, is summed into the rows predicted from the ids in
that lookup's forward (the union over DP, started then) as it arrives, summed over DP after
the backward (`sparse_rows.py`) and added to the reduced bucket. A word embedding used only
for the lookup (`lookup_only`: untied, or a first pipeline stage's tied copy) has nothing
but such gradients, with or without overlap: they are added into `main_grad` row by row,
its bucket sends no dense reduction, and after the backward it is summed over DP (if DP > 1)
as the rows of all the step's lookups.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..tensor_parallel.gradient_sink import attach_gradient_sink
from ..tensor_parallel.shard_spec import shard_spec
from ..tensor_parallel.shared_grads import sum_in_place
from .grad_buffer import Bucket, GradBuffer, default_bucket_size
from .grad_hooks import detach_sinks, weak_hook, weak_sink, weak_use
from .sparse_rows import GatheredRows, RowUnion, add_token_rows, sum_touched_rows

__all__ = ["DataParallelGrads"]


class DataParallelGrads:
    """Contiguous `main_grad` buffers of `chunks` and their reduction over `dp_group`.

    Per step: `start_step(num_micro_batches)`, the forward/backward passes, then
    `finish_grad_sync()` (after it every `main_grad` holds the DP mean, summed over TP for
    sequence-parallel parameters and over `embedding_group` for the `tied` copies; with
    `reduce_scatter` only this DP rank's slice of each bucket is valid), then the optimizer,
    then `zero_grad()`. Frozen parameters (`requires_grad=False`) get no buffer.
    `lookup_and_head`: word embeddings each used as the lookup table and as the LM head of
    one chunk (used with `overlap_grad_reduce` only; see the module's docstring).
    `head_first`: parameters whose gradient is complete at the start of the backward though
    registered early (a last stage's copy of the tied embedding): first in bucket order.
    `lookup_only`: word embeddings used only for the lookup.
    `expert_dp_group`: with expert parallelism (expert weights split over EP > 1 ranks,
    shard spec axis "expert"), the ranks holding the same experts: expert gradients get
    buffers of their own, summed over that group and divided by the DP size (each
    expert saw tokens from every data-parallel rank of its expert-parallel group, so the sum
    over the group is the sum over DP of the ranks' gradients).
    `grad_divisor`: what the sums are divided by (default: `dp_group`'s size, the DP
    mean). Under context parallelism `dp_group` is the data-and-context group and the
    divisor the DP size alone: the CP ranks' gradients are shares of the same sequences',
    to be summed.
    """

    def __init__(
        self,
        chunks: nn.Module | Sequence[nn.Module],
        *,
        dp_group: dist.ProcessGroup,
        tp_group: dist.ProcessGroup | None = None,
        overlap_grad_reduce: bool = False,
        reduce_scatter: bool = False,
        grad_dtype: torch.dtype = torch.float32,
        bucket_size: int | None = None,
        tied: Sequence[nn.Parameter] = (),
        embedding_group: dist.ProcessGroup | None = None,
        lookup_and_head: Sequence[nn.Parameter] = (),
        head_first: Sequence[nn.Parameter] = (),
        lookup_only: Sequence[nn.Parameter] = (),
        expert_dp_group: dist.ProcessGroup | None = None,
        grad_divisor: int | None = None,
    ) -> None:
        chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
        self.dp_group, self.tp_group, self.embedding_group = dp_group, tp_group, embedding_group
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.grad_divisor = self.dp_size if grad_divisor is None else grad_divisor
        self.overlap, self.reduce_scatter = overlap_grad_reduce, reduce_scatter
        experts = {
            id(p)
            for c in chunks
            for p in c.parameters()
            if p.requires_grad and shard_spec(p).split_experts
        }
        if experts and expert_dp_group is None:
            raise ValueError(
                "tpcore: DataParallelGrads: expert weights split over expert-parallel ranks "
                "need expert_dp_group (parallel_state.get_expert_data_parallel_group())"
            )
        self.expert_dp_group = expert_dp_group
        embedding_sum = embedding_group is not None and dist.get_world_size(embedding_group) > 1
        # Frozen copies (fine-tuning adapters) have no buffer and nothing to sum.
        self.tied = [p for p in tied if p.requires_grad] if embedding_sum else []
        # Splitting the embedding's two uses only pays when its reduction can start early. A
        # lookup-only embedding always takes its gradient token by token (no [vocab, h]
        # table per micro-batch) and, at DP > 1, is summed over DP as rows.
        split_pays = overlap_grad_reduce and self.dp_size > 1
        self.split = [p for p in lookup_and_head if p.requires_grad] if split_pays else []
        self.lookup_only = [p for p in lookup_only if p.requires_grad]
        self._lookup_only_ids = {id(p) for p in self.lookup_only}
        first_ids = {id(p) for p in self.split} | {id(p) for p in head_first}
        if tp_group is None and any(
            p.requires_grad and shard_spec(p).partial_grad for c in chunks for p in c.parameters()
        ):
            raise ValueError(
                "tpcore: DataParallelGrads: parameters whose gradient is a share to sum over TP "
                "(sequence-parallel norms, LoRA adapters) need tp_group"
            )
        self.buffers: list[GradBuffer] = []
        self.chunk_buffers: list[list[GradBuffer]] = []
        for chunk in chunks:
            named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
            if not named:
                self.chunk_buffers.append([])
                continue
            size = bucket_size or default_bucket_size(named[0][1].device)
            mine = []
            kinds = dict.fromkeys((p.dtype, id(p) in experts) for _, p in named)
            for dtype, expert in kinds:
                group = [
                    (n, p)
                    for n, p in reversed(named)  # reverse order of use
                    if p.dtype == dtype and (id(p) in experts) == expert
                ]
                # An LM head's weight (a split embedding's too) is ready first: put it first.
                group = [x for x in group if id(x[1]) in first_ids] + [
                    x for x in group if id(x[1]) not in first_ids
                ]
                reduce_group = expert_dp_group if expert else dp_group
                buffer = GradBuffer(
                    group,
                    grad_dtype=grad_dtype,
                    bucket_size=size,
                    dp_size=dist.get_world_size(reduce_group),
                    separate=self.tied + self.split + self.lookup_only,
                    keep_params=reduce_scatter,
                    group=reduce_group,
                )
                mine.append(buffer)
            self.chunk_buffers.append(mine)
            self.buffers.extend(mine)
        self.params = [p for b in self.buffers for p in b.params]
        # gloo's reduce-scatter is an all-reduce of a clone plus a copy of the rank's chunk
        # at wait(), whose work never reports completion: an all-reduce in place on the
        # bucket sends the same bytes and leaves this rank's slice where it belongs.
        self._scatter_by_all_reduce = [
            reduce_scatter and dist.get_backend(b.reduce_group) == "gloo" for b in self.buffers
        ]
        self._index_of = {id(p): i for i, b in enumerate(self.buffers) for p in b.params}
        self._expected: int | None = None
        self._counts: dict[int, int] = {}
        self._waiting: list[list[int]] = []  # per buffer, per bucket: parameters not yet ready
        self._next: list[int] = []  # per buffer: index of the next bucket to start
        self._done: list[int] = []  # per buffer: buckets (from the first) whose result is in place
        self._pending: dict[tuple[int, int], comm.PendingCollective | None] = {}
        # id(split embedding) -> the lookup gradients that came after its bucket started:
        # summed into the predicted rows, or (rows [n], grads [n, h]) per lookup
        self._late: dict[int, GatheredRows | list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lookups: dict[int, int] = {}  # id(embedding) -> lookups in this step's forward passes
        self._union: dict[
            int, RowUnion
        ] = {}  # id(embedding) -> union of its rows, started in the last forward
        self._rows: dict[
            int, list[torch.Tensor]
        ] = {}  # id(lookup-only embedding) -> rows of each lookup
        self.rows_summed = 0
        """Rows of embeddings' lookup gradients summed over DP on their own (for tests)."""
        self.finished = False
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self)) for p in self.params]
        self._sinks = [(p, weak_sink(self, p)) for p in self.split + self.lookup_only]
        for p, sink in self._sinks:
            attach_gradient_sink(p, sink, weak_use(self, p))
        # Sinks go with their owner, so a model outlives its buffers unchanged.
        weakref.finalize(self, detach_sinks, self._sinks)
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
        # A lookup-only embedding is never "ready" (no accumulation hook): it holds nothing back.
        self._waiting = [
            [sum(id(q) not in self._lookup_only_ids for q in bucket.params) for bucket in b.buckets]
            for b in self.buffers
        ]
        self._next = [0] * len(self.buffers)
        self._done = [0] * len(self.buffers)
        self._pending = {}
        self._late, self._lookups, self._union, self._rows = {}, {}, {}, {}
        self.finished = False

    def start_step(self, num_micro_batches: int) -> None:
        """Before the step's first backward: each parameter's gradient will be accumulated
        `num_micro_batches` times; the last time makes it ready for reduction."""
        if num_micro_batches < 1:
            raise ValueError(
                "tpcore: DataParallelGrads.start_step: num_micro_batches must be >= 1, got "
                f"{num_micro_batches}"
            )
        self._expected = num_micro_batches
        self._lookups, self._union, self._rows = {}, {}, {}

    def _on_grad(self, p: nn.Parameter) -> None:
        """After autograd accumulated into `p.grad`: move it into `main_grad`."""
        if p.grad is None:
            return
        i = self._index_of[id(p)]
        entry = self.buffers[i].entry(p)
        if (i, entry.bucket) in self._pending:
            raise RuntimeError(
                f"tpcore: the gradient of {entry.name} arrived after its bucket's reduction "
                f"started (accumulated more than {self._expected} times this step: a second "
                "backward through it?); start_step() must get the number of backward passes "
                "through every parameter, or turn --overlap-grad-reduce off"
            )
        p.main_grad.add_(p.grad)
        p.grad = None
        self._counts[id(p)] += 1
        if self.overlap and self._expected is not None and self._counts[id(p)] == self._expected:
            self._waiting[i][entry.bucket] -= 1
            self._start_ready(i)
            self._complete_finished()

    def _on_lookup_grad(self, p: nn.Parameter, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """An embedding's lookup gradient, token by token (`rows` `[n]`, `grads` `[n, h]`):
        into `main_grad`, or, for a split embedding whose bucket's reduction has started,
        set aside for `finish_grad_sync`."""
        i = self._index_of[id(p)]
        entry = self.buffers[i].entry(p)
        if self.finished:
            raise RuntimeError(
                f"tpcore: the gradient of {entry.name} arrived after finish_grad_sync (a backward "
                "after the step's?)"
            )
        if id(p) in self._lookup_only_ids or (i, entry.bucket) not in self._pending:
            add_token_rows(p.main_grad, rows, grads)
            return
        late, union = self._late.get(id(p)), self._union.get(id(p))
        if late is None and union is not None and not grads.is_cuda:
            # Summed into the predicted rows now, in the backward, not after it. Not on a
            # GPU: that needs the union's size on the host (a sync in the backward), and the
            # sum after the backward is cheap there.
            gathered = union.gather(rows, grads, self.buffers[i].grad_dtype)
            if gathered is not None:
                self._late[id(p)] = gathered
                return
        if isinstance(late, GatheredRows):  # a second late lookup: its rows are tokens too
            late = [(late.index, late.values)]
        self._late[id(p)] = (late or []) + [(rows, grads)]

    def _on_lookup(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        """An embedding's lookup in a forward pass. At the step's last one, start the union
        over DP of the rows whose gradient will be summed after the backward, so that it is
        known when the backward ends: that lookup's rows for a split embedding (its gradient
        comes after the bucket started), every lookup's for a lookup-only one."""
        if self.dp_size == 1:  # nothing to sum over DP: no rows to predict
            return
        count = self._lookups[id(p)] = self._lookups.get(id(p), 0) + 1
        if id(p) in self._lookup_only_ids:
            self._rows.setdefault(id(p), []).append(rows)
        if count != self._expected:
            return
        if id(p) in self._lookup_only_ids:
            rows = torch.cat(self._rows[id(p)])
        self._union[id(p)] = RowUnion(p.shape[0], self.dp_group, rows=rows, async_op=True)

    def _start_ready(self, i: int) -> None:
        """Start, in order, the buckets of buffer `i` whose parameters are all ready."""
        buckets = self.buffers[i].buckets
        while self._next[i] < len(buckets) and self._waiting[i][self._next[i]] == 0:
            self._start(i, buckets[self._next[i]])
            self._next[i] += 1

    def _complete_finished(self) -> None:
        """Put in place, during the backward, the results of the reductions that are done."""
        for i, buffer in enumerate(self.buffers):
            while self._done[i] < self._next[i]:
                pending = self._pending[(i, self._done[i])]
                if pending is not None and not pending.is_completed():
                    break
                self._complete(i, buffer.buckets[self._done[i]])

    def _complete(self, i: int, bucket: Bucket) -> None:
        """Wait for bucket `bucket.index` of buffer `i` (the next one not completed) and put its
        result in place: with reduce-scatter, copy this rank's slice into the buffer."""
        pending = self._pending[(i, bucket.index)]
        if pending is not None:
            result = pending.wait()
            buffer = self.buffers[i]
            if self.reduce_scatter and not self._scatter_by_all_reduce[i]:
                lo, hi = bucket.shard(buffer.reduce_rank)
                buffer.grad_data[lo:hi].copy_(result)
            self._pending[(i, bucket.index)] = None  # started: a late gradient still raises
        self._done[i] += 1

    def _start(self, i: int, bucket: Bucket) -> None:
        group = self.buffers[i].reduce_group
        if len(bucket.params) == 1 and id(bucket.params[0]) in self._lookup_only_ids:
            self._pending[(i, bucket.index)] = None  # rows, summed after the backward
            return
        # The DP mean: scaled before the sum (exact for a power-of-two DP size), so that
        # with overlap this pass runs during the backward and not after it. (Expert
        # buffers: the sum over their group is the sum over DP, so the same divisor; their
        # group may hold TP peers even at DP 1.)
        if self.grad_divisor > 1:
            bucket.grad.div_(self.grad_divisor)
        if dist.get_world_size(group) == 1:
            self._pending[(i, bucket.index)] = None  # nothing to send
        elif self.reduce_scatter and not self._scatter_by_all_reduce[i]:
            self._pending[(i, bucket.index)] = comm.reduce_scatter_async(bucket.grad, 0, group)
        else:
            self._pending[(i, bucket.index)] = comm.all_reduce_inplace_async(bucket.grad, group)

    def finish_grad_sync(self) -> None:
        """Start the buckets not started yet (all of them without overlap), wait for every
        reduction (each is the DP mean), then sum sequence-parallel gradients over TP and the tied
        embedding's over the embedding group. Collectives: the same on every DP rank."""
        for i, buffer in enumerate(self.buffers):
            while self._next[i] < len(buffer.buckets):
                self._start(i, buffer.buckets[self._next[i]])
                self._next[i] += 1
        late = self._sum_late_lookups()
        for i, buffer in enumerate(self.buffers):
            while self._done[i] < len(buffer.buckets):
                self._complete(i, buffer.buckets[self._done[i]])
        for p in self.split:
            if id(p) in late:  # the DP mean, as the buckets'
                _add_rows(p.main_grad, *late[id(p)], scale=1 / self.grad_divisor)
        self._sum_lookup_only()
        self._sum_partial_grads()
        self._sum_tied()
        self.finished = True

    def _sum_late_lookups(self) -> dict[int, tuple[torch.Tensor | None, torch.Tensor]]:
        """Every split embedding's set-aside lookup gradient summed over DP, touched rows
        only: `id(p) -> (row index or None for all rows, values)`. Called on every DP rank
        alike, whether or not a gradient was set aside."""
        out = {}
        if self._expected is None:  # no step started: no bucket started early, nothing came late
            return out
        for p in self.split:
            dtype = self.buffers[self._index_of[id(p)]].grad_dtype
            union = self._union.pop(id(p), None)
            source = self._late.pop(id(p), None)
            if isinstance(source, GatheredRows):
                rows = source.index
            else:
                # The late lookups' tokens; none when nothing came late here (other ranks may
                # have some).
                tokens = source or [(p.new_zeros(0, dtype=torch.int64), p.new_zeros(0, p.shape[1]))]
                rows, grads = (torch.cat(t) for t in zip(*tokens))
                # Into the predicted rows, or, when they do not hold this rank's or are most of
                # the table, into a whole table.
                source = union.gather(rows, grads, dtype) if union is not None else None
                if source is None:
                    source = add_token_rows(
                        torch.zeros(p.shape, dtype=dtype, device=p.device), rows, grads
                    )
            summed = sum_touched_rows(source, self.dp_group, dtype, rows, union)
            if summed is not None:
                out[id(p)] = summed
                self.rows_summed += summed[1].shape[0]
        return out

    def _sum_lookup_only(self) -> None:
        """Every lookup-only embedding's gradient, the DP mean of the rows its lookups read.
        Called on every DP rank alike."""
        if self.dp_size == 1:  # main_grad holds the whole gradient already
            return
        for p in self.lookup_only:
            seen = self._rows.pop(id(p), [])
            # No lookup here this step: no rows (other ranks may have some).
            rows = torch.cat(seen) if seen else torch.zeros(0, dtype=torch.int64, device=p.device)
            union = self._union.pop(id(p), None)
            if union is not None and 2 * union.index().numel() >= p.shape[0]:
                # Most of the table (large batches): in place, as a dense bucket, no copies.
                p.main_grad.div_(self.grad_divisor)
                comm.all_reduce_inplace_async(p.main_grad, self.dp_group).wait()
                self.rows_summed += p.shape[0]
                continue
            dtype = self.buffers[self._index_of[id(p)]].grad_dtype
            summed = sum_touched_rows(p.main_grad, self.dp_group, dtype, rows, union)
            if summed is None:  # every rank's gradient is zero, this one's too
                continue
            index, values = summed
            # This rank's gradient is zero outside `index` (it holds every rank's rows): clear
            # those rows only, not the whole table (a pass over [vocab, h] after the backward).
            if index is None:
                p.main_grad.zero_()
            else:
                p.main_grad.index_fill_(0, index, 0)
            _add_rows(p.main_grad, index, values, scale=1 / self.grad_divisor)
            self.rows_summed += values.shape[0]

    def _sum_partial_grads(self) -> None:
        # Each TP rank gave only its share (its sequence shard; its slice of a LoRA layer): sum
        # over TP (after the DP mean; both are sums).
        sum_in_place(
            [p.main_grad for p in self.params if shard_spec(p).partial_grad], self.tp_group
        )

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
        detach_sinks(self._sinks)


def _add_rows(
    target: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor, scale: float
) -> None:
    if index is None:
        target.add_(values, alpha=scale)
    else:
        target.index_add_(0, index, values, alpha=scale)
