"""The MoE part of a training step's metrics: balancing and z losses and expert loads.

Each MoE layer sums its routing over the step's forwards (`MoELayer.take_routing_totals`);
one all-reduce over every rank turns them into the step's values: the losses are shares per
TP rank (summed), per micro-batch (averaged) and per data-parallel rank (averaged), summed
over the layers of every pipeline stage; the loads are each layer's tokens per expert over
the whole global batch, reported as the worst layer's max / mean, and what DeepSeek-V3's
balancing biases move by (`MoELayer.update_expert_bias`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..models import GPTModel

__all__ = ["MOE_COLUMNS", "set_aux_loss_scale", "moe_step_metrics", "discard_moe_totals"]

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


def moe_step_metrics(
    chunks: Sequence[GPTModel], micro_batches: int, dp_size: int, device: str
) -> dict[str, float]:
    """The step's MoE metrics (`MOE_COLUMNS`); a collective over every rank. With
    DeepSeek-V3's balancing biases, each layer's bias then takes its step from the loads."""
    config = chunks[0].config
    losses = torch.zeros(2, dtype=torch.float64, device=device)
    loads = torch.zeros(config.num_layers, config.num_experts, dtype=torch.float64, device=device)
    for chunk in chunks:
        for index, totals in chunk.take_moe_totals().items():
            if totals:
                losses += torch.stack([totals["aux_loss"], totals["z_loss"]]).double()
                loads[index] += totals["tokens_per_expert"].double()
    dist.all_reduce(losses)
    dist.all_reduce(loads)
    for chunk in chunks:
        for name, layer in chunk.moe_layers().items():
            layer.update_expert_bias(loads[int(name.split(".")[1])])
    losses /= micro_batches * dp_size
    used = loads[loads.sum(1) > 0]
    imbalance = (used.max(1).values / used.mean(1)).max().item() if used.numel() else 0.0
    return {
        "moe_aux_loss": losses[0].item(),
        "moe_z_loss": losses[1].item(),
        "moe_load_max_over_mean": imbalance,
    }
