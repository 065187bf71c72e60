"""The MoE part of a training step's metrics: balancing and z losses and expert loads.

Each MoE layer sums its routing over the step's forwards (`MoELayer.take_routing_totals`);
one all-reduce over every rank turns them into the step's values: the losses are shares per
TP rank (summed), per micro-batch (averaged) and per data-parallel rank (averaged), summed
over the layers of every pipeline stage; the loads are each layer's tokens per expert over
the whole global batch, reported as the worst layer's max / mean, and what DeepSeek-V3's
balancing biases move by (`update_expert_biases`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..models import GPTModel

__all__ = [
    "MOE_COLUMNS",
    "set_aux_loss_scale",
    "moe_step_totals",
    "moe_step_metrics",
    "update_expert_biases",
    "discard_moe_totals",
]

MOE_COLUMNS = ["moe_aux_loss", "moe_z_loss", "moe_load_max_over_mean"]
"""metrics.csv's columns for MoE runs."""


def set_aux_loss_scale(chunks: Sequence[GPTModel], scale: float) -> None:
    """The gradient of the MoE losses in this step's backward: what the language-model loss
    of one micro-batch carries (loss scale / micro-batches)."""
    for chunk in chunks:
        chunk.set_moe_aux_loss_scale(scale)


def discard_moe_totals(chunks: Sequence[GPTModel]) -> None:
    """Forget the routing totals of forwards that are no training step (evaluation)."""
    for chunk in chunks:
        chunk.take_moe_totals()


def moe_step_totals(chunks: Sequence[GPTModel], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's routing, summed over every rank (a collective over all of them): the
    balancing and z losses `[2]` (shares, not yet averaged) and each layer's tokens per
    expert over the global batch `[layers, experts]` (zero rows for dense layers)."""
    config = chunks[0].config
    losses = torch.zeros(2, dtype=torch.float64, device=device)
    loads = torch.zeros(config.num_layers, config.num_experts, dtype=torch.float64, device=device)
    for chunk in chunks:
        for index, totals in chunk.take_moe_totals().items():
            if totals:
                losses += torch.stack([totals["aux_loss"], totals["z_loss"]]).double()
                loads[index] += totals["tokens_per_expert"].double()
    both = torch.cat([losses, loads.reshape(-1)])  # one all-reduce for both
    dist.all_reduce(both)
    return both[:2], both[2:].view_as(loads)


def update_expert_biases(chunks: Sequence[GPTModel], loads: torch.Tensor) -> None:
    """DeepSeek-V3's balancing step of every MoE layer that has a bias, from the step's
    loads `[layers, experts]` (`moe_step_totals`)."""
    for chunk in chunks:
        for index, layer in chunk.moe_layers().items():
            layer.update_expert_bias(loads[index])


def moe_step_metrics(
    losses: torch.Tensor, loads: torch.Tensor, micro_batches: int, dp_size: int
) -> dict[str, float]:
    """The step's MoE metrics (`MOE_COLUMNS`) from `moe_step_totals`."""
    losses = losses / (micro_batches * dp_size)
    used = loads[loads.sum(1) > 0]
    imbalance = (used.max(1).values / used.mean(1)).max().item() if used.numel() else 0.0
    return {
        "moe_aux_loss": losses[0].item(),
        "moe_z_loss": losses[1].item(),
        "moe_load_max_over_mean": imbalance,
    }
