"""The distributed optimizer (Megatron's `--use-distributed-optimizer`, ZeRO stage 1 over
the contiguous buffers): each DP rank owns a contiguous 1/DP slice of every gradient
bucket, and keeps fp32 master weights and AdamW moments only for that slice.

A step: the gradients were reduce-scattered (`DataParallelGrads(reduce_scatter=True)`),
so each rank holds the DP mean of its slice; it unscales them (fp16), takes the global
gradient norm (its slice's squares summed over DP, TP and PP), skips the step on every rank
alike when the norm is not finite, clips, updates its slice of the masters with AdamW
(no weight decay for 1-D parameters: biases and norms), writes them into its slice of the
parameter buffer and all-gathers the parameters bucket by bucket (`ParamGather`). The
update is the one `ParallelAdamW` makes, element for element.

MoE expert weights split over expert-parallel ranks live in buffers of their own, sliced
over the ranks holding the same experts (the expert-data-parallel group) instead of DP;
their squares in the norm are summed over that group and the expert-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.data_parallel import DataParallelGrads
from ..distributed.grad_buffer import GradBuffer
from ..distributed.param_gather import ParamGather
from .parallel_adamw import LossScaler

__all__ = ["DistributedAdamW"]


@dataclass
class _Piece:
    """The elements `[lo, hi)` of one parameter's flattened values that this rank owns."""

    name: str
    param: nn.Parameter
    buffer: GradBuffer
    lo: int
    hi: int
    master: torch.Tensor
    """`[hi - lo]` fp32: a view of the parameter itself when it is fp32, else a copy."""
    replicated: bool
    duplicate: bool
    expert: bool
    """Expert weights split over expert-parallel ranks (sliced over their own group)."""
    copied: tuple[int, int] | None = None
    """Elements of `[0, hi - lo)` copying what a lower TP rank holds (not counted in the norm)."""

    @property
    def grad(self) -> torch.Tensor:
        """`[hi - lo]` view of the reduced gradient in the buffer."""
        return self.param.main_grad.view(-1)[self.lo : self.hi]

    @property
    def value(self) -> torch.Tensor:
        """`[hi - lo]` view of the parameter (in the parameter buffer)."""
        return self.param.data.view(-1)[self.lo : self.hi]


class DistributedAdamW:
    """AdamW sharded over data parallelism; the same interface as `ParallelAdamW`
    (`step(lr, clip_grad)`, `loss_scale`, `scaler`, `state_dict`, `load_state_dict`,
    `reset_from_params`). `grads` holds the model's buffers (built with
    `reduce_scatter=True`); `overlap_param_gather` starts the parameter all-gathers after
    a step and waits for each bucket just before the next forward uses it."""

    def __init__(
        self,
        grads: DataParallelGrads,
        *,
        is_replicated: Callable[[str], bool],
        tp_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup | None = None,
        duplicates: Collection[str] = (),
        tp_copies: Callable[[str], tuple[int, int] | None] | None = None,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        loss_scaler: LossScaler | None = None,
        overlap_param_gather: bool = False,
        chunks: list[nn.Module] | None = None,
        ep_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not grads.reduce_scatter:
            raise ValueError(
                "tpcore: DistributedAdamW needs DataParallelGrads(reduce_scatter=True): each DP "
                "rank updates only its slice"
            )
        if overlap_param_gather and not chunks:
            raise ValueError(
                "tpcore: DistributedAdamW: overlap_param_gather needs the model `chunks` (its "
                "forward pre-hooks wait for the gathers)"
            )
        self.grads, self.tp_group, self.pp_group, self.scaler = (
            grads,
            tp_group,
            pp_group,
            loss_scaler,
        )
        self.dp_group, self.dp_rank = grads.dp_group, grads.dp_rank
        # Expert buffers are sliced over the ranks holding the same experts; their norm sums
        # over those and over the expert-parallel group (each rank other experts).
        self.expert_dp_group, self.ep_group = grads.expert_dp_group, ep_group
        self.has_experts = any(b.reduce_group is not self.dp_group for b in grads.buffers)
        if self.has_experts and ep_group is None:
            raise ValueError("tpcore: DistributedAdamW: expert weights need ep_group")
        self.pieces: list[_Piece] = []
        for buffer in grads.buffers:
            expert = buffer.reduce_group is not self.dp_group
            for p, _, lo, hi in buffer.shard_pieces(buffer.reduce_rank):
                name = buffer.entry(p).name
                flat = p.data.view(-1)[lo:hi]
                master = flat if p.dtype == torch.float32 else flat.float()
                span = tp_copies(name) if tp_copies else None
                copied = (
                    None
                    if span is None or max(lo, span[0]) >= min(hi, span[1])
                    else (max(lo, span[0]) - lo, min(hi, span[1]) - lo)
                )
                self.pieces.append(
                    _Piece(
                        name,
                        p,
                        buffer,
                        lo,
                        hi,
                        master,
                        is_replicated(name),
                        name in duplicates,
                        expert,
                        copied,
                    )
                )
        for piece in self.pieces:
            if buffer_grad_is_fp32(piece):
                piece.master.grad = piece.grad  # the optimizer reads the buffer itself: no copy
        decay = [x.master for x in self.pieces if x.param.dim() >= 2]
        no_decay = [x.master for x in self.pieces if x.param.dim() < 2]
        groups = [
            g
            for g in (
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            )
            if g["params"]
        ]
        # A rank whose slices are all padding (a tiny model on many ranks) owns nothing.
        self.adam = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps) if groups else None
        self.gather = ParamGather(
            chunks or [], grads.buffers, self.dp_group, overlap=overlap_param_gather
        )

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def finish_param_sync(self) -> None:
        """Wait for the parameter all-gathers still in flight: call before reading every
        parameter outside a forward pass (saving, sampling)."""
        self.gather.finish()

    def _norm(self) -> float:
        """The global gradient norm, each element counted once: this rank's slices, the
        TP-replicated ones from TP rank 0 only, the tied embedding's last-stage copy not at
        all; infinite when any element anywhere is not finite."""
        first = dist.get_rank(self.tp_group) == 0
        device = self.pieces[0].master.device if self.pieces else self.grads.buffers[0].device
        dense, experts = torch.zeros(2, device=device), torch.zeros(2, device=device)
        for piece in self.pieces:
            square = piece.master.grad.float().pow(2).sum()
            bad = (~torch.isfinite(square)).float()
            if piece.copied is not None:  # replicated KV heads: counted on their owner
                grad, (a, b) = piece.master.grad.float(), piece.copied
                square = grad[:a].pow(2).sum() + grad[b:].pow(2).sum()
            counted = (first or not piece.replicated) and not piece.duplicate
            target = experts if piece.expert else dense
            target += torch.stack([square if counted else square.new_zeros(()), bad])
        groups = [(dense, self.dp_group), (dense, self.tp_group)]
        if self.has_experts:
            groups += [(experts, self.expert_dp_group), (experts, self.ep_group)]
        for total, group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        total = dense + experts
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(total, group=self.pp_group)
        return math.inf if total[1].item() > 0 else math.sqrt(float(total[0].item()))

    def step(self, lr: float, clip_grad: float) -> tuple[float, bool]:
        """One update; returns (gradient norm before clipping, whether the step was skipped)."""
        if not self.grads.finished:
            raise RuntimeError(
                "tpcore: DistributedAdamW.step: call grads.finish_grad_sync() after the backward "
                "passes first"
            )
        self.gather.finish()  # the previous step's gathers write the parameter buffer
        for piece in self.pieces:
            if not buffer_grad_is_fp32(piece):
                piece.master.grad = piece.grad.float()
            if self.loss_scale != 1.0:
                piece.master.grad.mul_(1.0 / self.loss_scale)
        norm = self._norm()
        skipped = not math.isfinite(norm)  # the same on every rank: all skip alike
        if self.scaler:
            self.scaler.update(skipped)
        if not skipped:
            if clip_grad > 0 and norm > clip_grad:
                for piece in self.pieces:
                    piece.master.grad.mul_(clip_grad / (norm + 1e-6))
            if self.adam is not None:
                for group in self.adam.param_groups:
                    group["lr"] = lr
                self.adam.step()
            with torch.no_grad():
                for piece in self.pieces:
                    if (
                        piece.master is not piece.value
                        and piece.master.data_ptr() != piece.value.data_ptr()
                    ):
                        piece.value.copy_(piece.master)
            self.gather.launch()
        self.grads.zero_grad()
        return norm, skipped

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This DP rank's slices: {"shards": {name: {"lo", "hi", "numel", "exp_avg",
        "exp_avg_sq", "step"[, "master"]}}, "loss_scaler", "data_parallel_rank",
        "data_parallel_size"}; 1-D tensors of `hi - lo` elements each."""
        shards = {}
        for piece in self.pieces:
            entry = {"lo": piece.lo, "hi": piece.hi, "numel": piece.param.numel()}
            state = self.adam.state.get(piece.master, {}) if self.adam else {}
            entry.update({k: v.clone() if k == "step" else v for k, v in state.items()})
            if piece.param.dtype != torch.float32:
                entry["master"] = piece.master.detach()
            shards[piece.name] = entry
        return {
            "shards": shards,
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
            "data_parallel_rank": self.dp_rank,
            "data_parallel_size": self.grads.dp_size,
        }

    def reset_from_params(self) -> None:
        """Masters from the parameters' current values, no AdamW moments (weights loaded
        without optimizer state)."""
        self.gather.finish()
        with torch.no_grad():
            for piece in self.pieces:
                if piece.master.data_ptr() != piece.value.data_ptr():
                    piece.master.copy_(piece.value.float())
        if self.adam:
            self.adam.state.clear()

    def load_state_dict(self, state: dict) -> None:
        """Load `state`: either `ParallelAdamW`'s form ({"params": {name: tensors shaped like
        this rank's parameter}}, what checkpoints are read into, at any DP size) or this
        class's own `state_dict()` of the same layout. A collective over DP (the parameters
        are re-gathered: a fp32 run resumed from a low-precision one takes the masters)."""
        self.gather.finish()
        full = "params" in state
        entries = state["params"] if full else state["shards"]
        missing = [x.name for x in self.pieces if x.name not in entries]
        if missing:
            raise KeyError(f"tpcore: optimizer state lacks parameters {missing[:5]}")
        with torch.no_grad():
            for piece in self.pieces:
                entry = dict(entries[piece.name])
                if not full and (entry.pop("lo"), entry.pop("hi")) != (piece.lo, piece.hi):
                    raise ValueError(
                        f"tpcore: DistributedAdamW.load_state_dict: {piece.name}: the slices were "
                        "cut for another layout; load through a checkpoint"
                    )
                entry.pop("numel", None)
                take = (lambda t: t.reshape(-1)[piece.lo : piece.hi]) if full else (lambda t: t)
                master = entry.pop("master", None)
                if master is not None:
                    piece.master.copy_(take(master))
                elif piece.master.data_ptr() != piece.value.data_ptr():
                    piece.master.copy_(piece.value.float())
                if piece.master.data_ptr() != piece.value.data_ptr():
                    piece.value.copy_(piece.master)
                if self.adam is not None:
                    self.adam.state[piece.master] = {
                        k: v.clone()
                        if k == "step"
                        else take(v).to(piece.master.device, torch.float32).clone()
                        for k, v in entry.items()
                    }
        self.gather.launch()
        self.gather.finish()
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])


def buffer_grad_is_fp32(piece: _Piece) -> bool:
    return piece.buffer.grad_dtype == torch.float32
