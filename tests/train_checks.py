"""Shared pieces of the optimizer and checkpoint unit tests: a small batch, the TP / DP
groups of the current layout, and the AdamW settings both files use."""

from __future__ import annotations

import torch

import tpcore
from checks import param_specs
from tpcore import parallel_state
from tpcore.models import GPTConfig
from tpcore.optimizer.setup import DataParallelOptions, make_optimizer
from tpcore.train import ParallelAdamW

BATCH, SEQ = 2, 8
BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-3, 0.1, 0.05
LRS = [1e-2, 5e-3, 2e-2]


def train_batch(
    seed: int, config: GPTConfig, batch: int = BATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (ids, target), each `[batch, SEQ]`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, SEQ), generator=g), torch.randint(
        0, config.vocab_size, (batch, SEQ), generator=g
    )


def tp_dp_groups():
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_data_parallel_group(),
    )


def make_adamw(model, config: GPTConfig, **kw) -> ParallelAdamW:
    tp_group, dp_group = tp_dp_groups()
    specs = param_specs(model)
    return ParallelAdamW(
        model,
        is_replicated=lambda n: specs[n].kind == "replicated",
        tp_group=tp_group,
        dp_group=dp_group,
        tp_copies=lambda n: specs[n].copied_elements(),
        lr=LRS[0],
        weight_decay=WD,
        betas=BETAS,
        eps=EPS,
        **kw,
    )


def make_optimizer_for(model, distributed: bool):
    """(optimizer, grads) for `model` on the current layout's TP and DP groups, as the trainer
    makes them: ParallelAdamW (grads None), or with `distributed` contiguous gradient buffers
    (grads) and the distributed optimizer."""
    tp_group, dp_group = tp_dp_groups()
    options = DataParallelOptions(
        contiguous_buffers=distributed, use_distributed_optimizer=distributed
    )
    return make_optimizer(
        [model],
        options,
        tp_group=tp_group,
        dp_group=dp_group,
        pp_group=None,
        lr=LRS[0],
        weight_decay=WD,
        betas=BETAS,
        eps=EPS,
        loss_scaler=None,
    )


def adamw_steps(model, opt, grads, steps: int = 2) -> None:
    """`steps` AdamW steps of `model` on random batches, each DP rank its own, the gradients
    reduced as the trainer reduces them."""
    config = model.config
    for step in range(steps):
        ids, target = train_batch(100 * step + parallel_state.get_data_parallel_rank(), config)
        model(ids, target).backward()
        if grads is not None:
            grads.finish_grad_sync()  # sums the TP shares too
        else:
            tpcore.sum_partial_grads(model)  # what the trainer's finalize_model_grads does
        opt.step(LRS[0], CLIP)
        opt.zero_grad()
