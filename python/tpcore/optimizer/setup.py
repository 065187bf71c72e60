"""Building the optimizer of a run from its data-parallel choices: today's `ParallelAdamW`
over `.grad`, the same over contiguous gradient buffers (optionally reduced during the
backward), or the `DistributedAdamW` (optionally gathering parameters during the forward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.data_parallel import DataParallelGrads
from ..parallel_state import get_parallel_state
from ..pipeline_parallel import (
    duplicate_parameter_names,
    head_only_tied_weights,
    lookup_and_head_weights,
    lookup_only_weights,
    tied_embedding_copies,
)
from ..tensor_parallel.shard_spec import shard_spec
from .distributed_adamw import DistributedAdamW
from .parallel_adamw import LossScaler, ParallelAdamW

__all__ = ["DataParallelOptions", "make_optimizer"]


@dataclass(frozen=True)
class DataParallelOptions:
    """How gradients and optimizer state are handled over data parallelism."""

    contiguous_buffers: bool = True
    """Gradients accumulate in flat `main_grad` buffers reduced bucket by bucket (False:
    today's `.grad` tensors, concatenated and all-reduced in the step)."""
    overlap_grad_reduce: bool = False
    """Start each bucket's reduction from the backward pass as soon as it is complete."""
    use_distributed_optimizer: bool = False
    """Shard fp32 masters and AdamW moments over DP; reduce-scatter gradients, all-gather
    parameters."""
    overlap_param_gather: bool = False
    """Start the parameter all-gathers after the step, wait for each bucket at its first use."""
    grad_reduce_in_bf16: bool = False
    """Gradient buffers (accumulation and reduction) in bf16 instead of fp32."""
    bucket_size: int | None = None
    """Elements per bucket (None: `grad_buffer.default_bucket_size`)."""

    def __post_init__(self) -> None:
        problems = []
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            problems.append(
                "--overlap-param-gather needs --use-distributed-optimizer (only sharded parameters "
                "are gathered)"
            )
        needs = [
            flag
            for flag, on in (
                ("--overlap-grad-reduce", self.overlap_grad_reduce),
                ("--use-distributed-optimizer", self.use_distributed_optimizer),
                ("--grad-reduce-in-bf16", self.grad_reduce_in_bf16),
            )
            if on
        ]
        if needs and not self.contiguous_buffers:
            problems.append(f"{', '.join(needs)} need(s) the contiguous gradient buffers")
        if self.bucket_size is not None and (
            not isinstance(self.bucket_size, int)
            or isinstance(self.bucket_size, bool)
            or self.bucket_size < 1
        ):
            problems.append(
                f"--ddp-bucket-size must be an int >= 1 (elements), got {self.bucket_size!r}"
            )
        if problems:
            raise ValueError("tpcore: " + "; ".join(problems))


def make_optimizer(
    chunks: Sequence[nn.Module],
    options: DataParallelOptions,
    *,
    tp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup | None,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    loss_scaler: LossScaler | None,
    embedding_group: dist.ProcessGroup | None = None,
    grad_divisor: int | None = None,
) -> tuple[ParallelAdamW | DistributedAdamW, DataParallelGrads | None]:
    """(optimizer, gradient buffers or None) for this rank's GPT `chunks`. With buffers, each
    step is `grads.start_step(m)`, the backward passes, `grads.finish_grad_sync()` (in place
    of `finalize_model_grads`), then `optimizer.step(...)`. Gradients are summed over
    `dp_group` and divided by `grad_divisor` (default its size); with context parallelism
    pass the data-and-context group and the DP size."""
    chunks = list(chunks)
    specs = {name: shard_spec(p) for chunk in chunks for name, p in chunk.named_parameters()}
    # Expert weights split over EP > 1 ranks have their own reduction group and norm; at EP 1
    # every rank holds every expert, replicated over TP like a norm's weight.
    state = get_parallel_state()
    experts = {n for n, s in specs.items() if s.split_experts}
    expert_groups = dict(ep_group=state.expert_group, expert_dp_group=state.expert_data_group)
    common = dict(
        is_replicated=lambda name: specs[name].same_on_tp_ranks,
        tp_group=tp_group,
        pp_group=pp_group,
        tp_copies=lambda name: specs[name].copied_elements(),
        duplicates=duplicate_parameter_names(chunks),
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        loss_scaler=loss_scaler,
    )
    if not options.contiguous_buffers:
        return ParallelAdamW(
            chunks,
            dp_group=dp_group,
            is_expert=experts.__contains__,
            grad_divisor=grad_divisor,
            **expert_groups,
            **common,
        ), None
    tied = tied_embedding_copies(chunks)
    if tied and embedding_group is None and get_parallel_state().embedding_group is not None:
        embedding_group = get_parallel_state().embedding_group
    grads = DataParallelGrads(
        chunks,
        dp_group=dp_group,
        tp_group=tp_group,
        overlap_grad_reduce=options.overlap_grad_reduce,
        reduce_scatter=options.use_distributed_optimizer,
        grad_dtype=torch.bfloat16 if options.grad_reduce_in_bf16 else torch.float32,
        bucket_size=options.bucket_size,
        tied=tied,
        embedding_group=embedding_group if tied else None,
        lookup_and_head=lookup_and_head_weights(chunks),
        head_first=head_only_tied_weights(chunks),
        lookup_only=lookup_only_weights(chunks),
        expert_dp_group=state.expert_data_group,
        grad_divisor=grad_divisor,
    )
    if options.use_distributed_optimizer:
        return DistributedAdamW(
            grads,
            overlap_param_gather=options.overlap_param_gather,
            chunks=chunks,
            ep_group=state.expert_group,
            **common,
        ), grads
    return ParallelAdamW(
        chunks,
        dp_group=dp_group,
        grads=grads,
        is_expert=experts.__contains__,
        grad_divisor=grad_divisor,
        **expert_groups,
        **common,
    ), grads
