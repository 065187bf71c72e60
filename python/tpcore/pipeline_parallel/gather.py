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

__all__ = ["gather_model_on_first_stage"]

_FIRST_TAG = 16  # message tags 16, 17, ...: one per parameter, above the schedules' tags


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
    tags = {
        name: _FIRST_TAG + i
        for i, name in enumerate(ReferenceGPT(first.config, device="meta").state_dict())
    }
    mine = {
        name: p.detach()
        for chunk in chunks
        for name, p in chunk.named_parameters()
        if name not in duplicate_parameter_names(chunks)
    }
    if rank != 0:
        sends = [(t.contiguous(), 0, tags[name], name) for name, t in mine.items()]
        p2p.batch_send_recv(sends, [], dtype=param.dtype, device=param.device, group=pp_group)
        return None
    model = GPTModel(
        first.config, group=first.group, dtype=param.dtype, device=param.device, _init=False
    )
    received = [(name, p) for name, p in model.named_parameters() if name not in mine]
    recvs = [
        (list(p.shape), layout.pipeline_rank_of(name), tags[name], name) for name, p in received
    ]
    tensors = p2p.batch_send_recv([], recvs, dtype=param.dtype, device=param.device, group=pp_group)
    with torch.no_grad():
        for (_, p), t in zip(received, tensors):
            p.copy_(t)
        for name, p in model.named_parameters():
            if name in mine:
                p.copy_(mine[name])
    return model
