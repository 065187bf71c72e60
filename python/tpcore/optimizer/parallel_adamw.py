"""AdamW over data-, tensor- and pipeline-parallel ranks: DP gradient averaging, a global
gradient norm over TP and PP with clipping, fp32 master weights for bf16/fp16 models,
dynamic loss scaling."""

from __future__ import annotations

import math
from typing import Callable, Collection, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm

__all__ = ["LossScaler", "ParallelAdamW", "average_data_parallel_grads", "grad_norm"]


def average_data_parallel_grads(
    grads: list[torch.Tensor], dp_group: dist.ProcessGroup | None, divisor: int | None = None
) -> None:
    """Replace each gradient by its sum over `dp_group` divided by `divisor` (default the
    group's size: the mean), in one fp32 all-reduce for all."""
    size = 1 if dp_group is None else dist.get_world_size(dp_group)
    divisor = size if divisor is None else divisor
    if (size == 1 and divisor == 1) or not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    if size > 1:
        flat = comm.all_reduce(flat, dp_group)
    flat = flat.div_(divisor)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def grad_norm(
    grads: list[torch.Tensor],
    replicated: list[bool],
    tp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup | None = None,
    duplicate: list[bool] | None = None,
    copies: list[tuple[int, int] | None] | None = None,
    expert: list[bool] | None = None,
    ep_group: dist.ProcessGroup | None = None,
) -> float:
    """L2 norm of the full model's gradient: sharded gradients summed over TP, replicated
    ones (identical on every TP rank) counted once, from TP rank 0; with `pp_group`, summed
    over the pipeline stages too, where `duplicate` marks gradients that are copies of one
    counted on another stage (the tied embedding's last-stage copy). `copies[i]`: the flat
    elements `[lo, hi)` of gradient i that copy ones a lower TP rank counts (KV heads
    replicated over TP, `ShardSpec.copied_elements`), or None. `expert[i]`: gradient i is
    of MoE expert weights split over `ep_group` (each rank of it holds other experts,
    whatever its TP rank): summed over that group instead of TP. Infinite when any gradient
    on any rank holds inf or NaN, replicated and duplicate ones included."""
    first = dist.get_rank(tp_group) == 0
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), device=device)
    expert_squares = torch.zeros((), device=device)
    bad = torch.zeros((), device=device)
    n = len(grads)
    for g, rep, dup, span, exp in zip(
        grads, replicated, duplicate or [False] * n, copies or [None] * n, expert or [False] * n
    ):
        square = g.float().pow(2).sum()
        bad += (~torch.isfinite(square)).float()  # checked on every rank, counted or not
        if span is not None:  # leave out the copied elements
            flat = g.reshape(-1).float()
            square = flat[: span[0]].pow(2).sum() + flat[span[1] :].pow(2).sum()
        if exp:
            expert_squares += square
        elif (first or not rep) and not dup:
            squares += square
    total = comm.all_reduce(torch.stack([squares, bad]), tp_group)  # one collective for both
    if expert is not None and any(expert):
        if ep_group is None:
            raise ValueError("tpcore: grad_norm: expert gradients need ep_group")
        total = total + torch.stack([comm.all_reduce(expert_squares, ep_group), bad.new_zeros(())])
    if pp_group is not None:
        total = comm.all_reduce(total, pp_group)
    return math.inf if total[1].item() > 0 else math.sqrt(float(total[0].item()))


class LossScaler:
    """fp16 dynamic loss scale: halves on an overflow (the step is skipped), doubles after
    `window` clean steps."""

    def __init__(
        self, initial: float = 2.0**16, window: int = 1000, min_scale: float = 1.0
    ) -> None:
        self.scale, self.window, self.min_scale, self.clean_steps = (
            float(initial),
            window,
            min_scale,
            0,
        )

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean_steps = max(self.scale / 2, self.min_scale), 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale, self.clean_steps = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


class ParallelAdamW:
    """AdamW for a tensor/data/pipeline-parallel model (one module, or this rank's
    pipeline chunks, whose parameter names must differ).

    `step()` averages gradients over DP, unscales them (fp16), skips the step when any
    gradient is not finite (on every rank alike), clips the TP-aware global norm, and
    updates fp32 master weights that are copied back into bf16/fp16 parameters.
    Biases and norm weights (1-D parameters) get no weight decay. The state dict is keyed
    by parameter name, so a checkpoint can be resharded to another TP size. With
    pipeline parallelism pass `pp_group` and the names of `duplicates` (parameters whose
    gradient is a copy of one on another stage) so the norm counts each parameter once;
    `tp_copies(name)` gives the flat range of a parameter copying what a lower TP rank
    holds (replicated KV heads: `ShardSpec.copied_elements`), or None.

    With `grads` (a `DataParallelGrads` over the same model, all-reducing) the gradients are
    read from its contiguous buffers (`main_grad`, already averaged over DP by its
    `finish_grad_sync()`, which must run before `step`) instead of `.grad`.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        *,
        is_replicated: Callable[[str], bool],
        tp_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup | None = None,
        duplicates: Collection[str] = (),
        tp_copies: Callable[[str], tuple[int, int] | None] | None = None,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        loss_scaler: LossScaler | None = None,
        grads=None,
        is_expert: Callable[[str], bool] | None = None,
        ep_group: dist.ProcessGroup | None = None,
        expert_dp_group: dist.ProcessGroup | None = None,
        grad_divisor: int | None = None,
    ) -> None:
        if grads is not None and grads.reduce_scatter:
            raise ValueError(
                "tpcore: ParallelAdamW needs all-reduced gradients; reduce-scattered buffers are "
                "for DistributedAdamW"
            )
        self.grads = grads
        modules = [model] if isinstance(model, nn.Module) else list(model)
        named = [
            (n, p) for module in modules for n, p in module.named_parameters() if p.requires_grad
        ]
        self.names = [n for n, _ in named]
        if len(set(self.names)) != len(self.names):
            raise ValueError(
                "tpcore: ParallelAdamW: parameter names repeat across the model chunks"
            )
        self.params = [p for _, p in named]
        self.replicated = [is_replicated(n) for n in self.names]
        self.duplicate = [n in duplicates for n in self.names]
        self.copies = [tp_copies(n) if tp_copies else None for n in self.names]
        self.expert = [bool(is_expert and is_expert(n)) for n in self.names]
        self.ep_group, self.expert_dp_group = ep_group, expert_dp_group
        if any(self.expert) and (ep_group is None or expert_dp_group is None):
            raise ValueError(
                "tpcore: ParallelAdamW: expert weights split over expert-parallel ranks need "
                "ep_group and expert_dp_group"
            )
        self.pp_group = pp_group
        # fp32 parameters are their own master; low-precision ones get an fp32 copy.
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_()
            for p in self.params
        ]
        self.tp_group, self.dp_group, self.scaler = tp_group, dp_group, loss_scaler
        # The gradients' sums over dp_group are divided by this: its size (the DP mean), or
        # under context parallelism (dp_group: DP x CP) the DP size, CP ranks' being shares.
        self.grad_divisor = dist.get_world_size(dp_group) if grad_divisor is None else grad_divisor
        decay = [m for m in self.masters if m.dim() >= 2]
        no_decay = [m for m in self.masters if m.dim() < 2]
        self.adam = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            eps=eps,
        )

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None
        if self.grads is not None:
            self.grads.zero_grad()

    def finish_param_sync(self) -> None:
        """Nothing to wait for: every DP rank updates every parameter itself."""

    def _gather_grads(self) -> None:
        """Point each master's .grad at the DP mean of its gradient."""
        if self.grads is not None:
            if not self.grads.finished:
                raise RuntimeError(
                    "tpcore: ParallelAdamW.step: call grads.finish_grad_sync() after the backward "
                    "passes first"
                )
            for p, m in zip(self.params, self.masters):
                # A view of the buffer when it is fp32 (no copy); unscaling and clipping
                # then work in the buffer, which zero_grad() empties afterwards.
                m.grad = p.main_grad if p.main_grad.dtype == torch.float32 else p.main_grad.float()
            return
        for p in self.params:
            if p.grad is None:  # unused parameter: a zero gradient keeps ranks in step
                p.grad = torch.zeros_like(p)
        dense = [p.grad for p, e in zip(self.params, self.expert) if not e]
        average_data_parallel_grads(dense, self.dp_group, self.grad_divisor)
        # Expert weights: the sum over the ranks holding them is the sum over DP.
        experts = [p.grad for p, e in zip(self.params, self.expert) if e]
        average_data_parallel_grads(experts, self.expert_dp_group, self.grad_divisor)
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float() if m is not p else p.grad

    def step(self, lr: float, clip_grad: float) -> tuple[float, bool]:
        """One update; returns (gradient norm before clipping, whether the step was skipped)."""
        self._gather_grads()
        inv_scale = 1.0 / self.loss_scale
        for m in self.masters:
            if inv_scale != 1.0:
                m.grad.mul_(inv_scale)
        norm = grad_norm(
            [m.grad for m in self.masters],
            self.replicated,
            self.tp_group,
            self.pp_group,
            self.duplicate,
            self.copies,
            self.expert,
            self.ep_group,
        )
        skipped = not math.isfinite(norm)  # the norm is the same on every rank: all skip alike
        if self.scaler:
            self.scaler.update(skipped)
        if skipped:
            self.zero_grad()
            return norm, True
        if clip_grad > 0 and norm > clip_grad:
            for m in self.masters:
                m.grad.mul_(clip_grad / (norm + 1e-6))
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)
        self.zero_grad()
        return norm, False

    def state_dict(self) -> dict:
        """{"params": {name: {"exp_avg", "exp_avg_sq", "step"[, "master"]}}, "loss_scaler": ...}."""
        params = {}
        for name, p, m in zip(self.names, self.params, self.masters):
            entry = {k: v for k, v in self.adam.state.get(m, {}).items()}
            if m is not p:
                entry["master"] = m.detach()
            params[name] = entry
        return {"params": params, "loss_scaler": self.scaler.state_dict() if self.scaler else None}

    def reset_from_params(self) -> None:
        """Start afresh from the parameters' current values: fp32 masters copied from them,
        no AdamW moments (after loading weights from a checkpoint without optimizer state;
        stale masters would overwrite the loaded weights at the next step)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    m.copy_(p.float())
        self.adam.state.clear()

    def load_state_dict(self, state: dict) -> None:
        missing = [n for n in self.names if n not in state["params"]]
        if missing:
            raise KeyError(f"tpcore: optimizer checkpoint lacks parameters {missing[:5]}")
        with torch.no_grad():
            for name, p, m in zip(self.names, self.params, self.masters):
                entry = dict(state["params"][name])
                master = entry.pop("master", None)
                if m is not p:  # fp32 master from the checkpoint, else from the loaded weights
                    m.copy_(master if master is not None else p.float())
                elif (
                    master is not None
                ):  # a low-precision run resumed in fp32: its master is the better copy
                    p.copy_(master)
                self.adam.state[m] = {
                    k: v.to(m.device) if k != "step" else v.clone() for k, v in entry.items()
                }
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
