"""The whole model of a pipeline-parallel run, gathered on its first stage for sampling.

Generation needs every layer for every token; rather than pushing each step through the
pipeline, the stages send their pieces once to the first stage, which then holds this
TP rank's shard of the full-depth `GPTModel` and generates as a run without pipeline
parallelism does (a TP collective within the first stage). The other stages are done.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..models import GPTModel, ReferenceGPT
from . import duplicate_parameter_names, p2p
from .layout import current_layout

__all__ = ["gather_model_on_first_stage", "stage_tags", "move_to_first_stage"]

_FIRST_TAG = 16  # message tags 16, 17, ...: one per parameter, above the schedules' tags
_MAX_TAG = 1 << 15  # tags stay below the 2**16 the backends allow


def stage_tags(config) -> dict[str, int]:
    """A point-to-point tag for every parameter name of the whole GPT, in the dense model's
    order, above the schedules' tags (they wrap past 2**15: a caller with many parameters
    in flight at once must keep them fewer than that)."""
    names = ReferenceGPT(config, device="meta").state_dict()
    return {name: _FIRST_TAG + i % (_MAX_TAG - _FIRST_TAG) for i, name in enumerate(names)}


def move_to_first_stage(
    items: Sequence[tuple[str, torch.Tensor | None, Sequence[int], int, int]],
    *,
    pp_group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor | None]:
    """Bring tensors from the pipeline ranks that own them to pipeline rank 0, in one batch
    of messages. `items`: `(name, tensor, shape, owner, tag)`, the tensor given on its
    owner (None elsewhere). Returns, on rank 0, every item's tensor (its own as given); on
    the others, None for each. Call on every rank of `pp_group` with the same items."""
    rank = dist.get_rank(pp_group)
    sends = [
        (t.contiguous(), 0, tag, name)
        for name, t, _, owner, tag in items
        if owner == rank and rank != 0
    ]
    recvs = [
        (list(shape), owner, tag, name)
        for name, _, shape, owner, tag in items
        if owner != 0 and rank == 0
    ]
    received = iter(
        p2p.batch_send_recv(sends, recvs, dtype=dtype, device=device, group=pp_group)
        if sends or recvs
        else []
    )
    if rank != 0:
        return [None] * len(items)
    return [t if owner == 0 else next(received) for _, t, _, owner, _ in items]


def gather_model_on_first_stage(
    chunks: Sequence[GPTModel], *, pp_group: dist.ProcessGroup | None = None
) -> GPTModel | None:
    """This TP rank's shard of the full-depth model, on the first pipeline stage; None on
    the others. A collective over `pp_group` (call on every stage). Without pipeline
    parallelism the model itself is returned. Parameters are copies, in the chunks' dtype,
    on their device; the tied word embedding is the first stage's copy."""
    chunks, pp_group = list(chunks), p2p.resolve_pipeline_group(pp_group)
    first = chunks[0]
    layout = current_layout(chunks, tp_group=first.group, pp_group=pp_group)
    if layout.pipeline_parallel_size == 1 and len(chunks) == 1:
        return first
    rank = dist.get_rank(pp_group)
    param = next(first.parameters())
    tags = stage_tags(first.config)
    skip = duplicate_parameter_names(chunks)
    mine = {
        name: p.detach()
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if name not in skip
    }
    # (a model on the meta device, for the shapes: every rank knows what rank 0 receives)
    meta = GPTModel(first.config, group=first.group, dtype=param.dtype, device="meta", _init=False)
    shapes = {name: list(p.shape) for name, p in meta.named_parameters()}
    items = [
        (name, mine.get(name), shapes[name], layout.pipeline_rank_of(name), tags[name])
        for name in shapes
    ]
    tensors = move_to_first_stage(items, pp_group=pp_group, dtype=param.dtype, device=param.device)
    if rank != 0:
        return None
    model = GPTModel(
        first.config, group=first.group, dtype=param.dtype, device=param.device, _init=False
    )
    with torch.no_grad():
        for (name, *_), t in zip(items, tensors):
            model.get_parameter(name).copy_(t)
    return model
