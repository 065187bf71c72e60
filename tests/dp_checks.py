"""Shared pieces of the data-parallel tests (run inside the ranks): a pipelined GPT trained
for a few steps the way the trainer trains it, with today's optimizer (`.grad`,
`finalize_model_grads`, `ParallelAdamW`) or with contiguous buffers / the distributed
optimizer (`make_optimizer`), so that runs can be compared step by step."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

import tpcore
from checks import GPT_VARIANTS, GQA_VARIANTS, assert_close
from tpcore import parallel_state
from tpcore.optimizer.setup import DataParallelOptions, make_optimizer
from tpcore.pipeline_parallel import (
    activation_shape,
    build_gpt_stages,
    finalize_model_grads,
    forward_backward,
    gpt_forward_step,
    sync_tied_embeddings,
)
from tpcore.train import LossScaler
from train_checks import BETAS, EPS, WD

MICRO, SEQ = 2, 8
BASELINE = DataParallelOptions(contiguous_buffers=False)
BUFFERS = DataParallelOptions()
OVERLAP = DataParallelOptions(overlap_grad_reduce=True)
DISTRIBUTED = DataParallelOptions(use_distributed_optimizer=True)
DISTRIBUTED_OVERLAP = DataParallelOptions(
    use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
)


def config_for(variant: str, num_layers: int, **changes):
    return dataclasses.replace(
        {**GPT_VARIANTS, **GQA_VARIANTS}[variant], num_layers=num_layers, **changes
    )


def groups():
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_data_parallel_group(),
        parallel_state.get_pipeline_model_parallel_group(),
    )


def batches(config, m: int, dp: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """m micro-batches `(ids, target)` `[MICRO, SEQ]` per DP rank: `[dp][m]`."""
    g = torch.Generator().manual_seed(seed)
    make = lambda: torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=g)  # noqa: E731
    return [[(make(), make()) for _ in range(m)] for _ in range(dp)]


class Run:
    """This rank's chunks and optimizer, built from seed 0 at the current layout."""

    def __init__(
        self,
        config,
        options: DataParallelOptions,
        *,
        v: int = 1,
        dtype=torch.float32,
        loss_scale: float | None = None,
        schedule: str = "1f1b",
        prepare=None,
    ) -> None:
        tp_group, dp_group, pp_group = groups()
        torch.manual_seed(0)
        self.config, self.v, self.dtype, self.schedule = config, v, dtype, schedule
        self.chunks = build_gpt_stages(
            config, num_model_chunks=v, tp_group=tp_group, pp_group=pp_group, dtype=dtype
        )
        sync_tied_embeddings(self.chunks)
        if prepare is not None:
            prepare(self.chunks)  # freeze or add parameters before the optimizer sees them
        scaler = LossScaler(loss_scale, window=1000) if loss_scale else None
        self.opt, self.grads = make_optimizer(
            self.chunks,
            options,
            tp_group=tp_group,
            dp_group=dp_group,
            pp_group=pp_group,
            lr=1e-2,
            weight_decay=WD,
            betas=BETAS,
            eps=EPS,
            loss_scaler=scaler,
        )
        self.dp_group, self.tp_group, self.pp_group = dp_group, tp_group, pp_group

    def step(self, micro_batches, lr: float, clip: float) -> tuple[float, float, bool]:
        """One training step on this DP rank's micro-batches; (DP-mean loss, norm, skipped)."""
        m = len(micro_batches)
        shape = activation_shape(self.config, MICRO, SEQ, dist.get_world_size(self.tp_group))
        if self.grads is not None:
            self.grads.start_step(m)
        loss = forward_backward(
            gpt_forward_step(self.chunks, micro_batches, tensor_shape=shape),
            num_micro_batches=m,
            tensor_shape=shape,
            dtype=self.dtype,
            schedule=self.schedule,
            num_model_chunks=self.v,
            group=self.pp_group,
            loss_scale=self.opt.loss_scale,
        )
        if self.grads is not None:
            self.grads.finish_grad_sync()
        else:
            finalize_model_grads(self.chunks, tp_group=self.tp_group)
        norm, skipped = self.opt.step(lr, clip)
        dist.all_reduce(loss, group=self.dp_group)
        return float(loss) / dist.get_world_size(self.dp_group), norm, skipped

    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank (all gathers waited for), by name and chunk."""
        self.opt.finish_param_sync()
        return {
            f"{c}/{n}": p.detach().clone()
            for c, chunk in enumerate(self.chunks)
            for n, p in chunk.named_parameters()
        }


def step_alike(run: Run, base: Run, micro_batches, lr: float, clip: float) -> None:
    """One step of `run` and of `base` on the same micro-batches: the same gradient norm."""
    _, norm, _ = run.step(micro_batches, lr, clip)
    _, base_norm, _ = base.step(micro_batches, lr, clip)
    assert math.isclose(norm, base_norm, rel_tol=1e-5), (norm, base_norm)


def assert_same_params(run: Run, base: Run, what: str = "") -> None:
    """Every parameter of `run` equals `base`'s up to rounding."""
    got = run.params()
    for key, value in base.params().items():
        assert_close(got[key], value, f"{what}: {key}")


def setup(tp: int = 1, pp: int = 1, backend: str | None = None) -> None:
    tpcore.initialize_model_parallel(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, backend=backend
    )
