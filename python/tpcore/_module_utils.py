"""Helpers on nn.Modules shared by tpcore's layers and models."""

from __future__ import annotations

import torch
from torch import nn


def to_empty_keeping_attributes(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device)`, keeping the attributes tpcore sets on parameters
    (`tensor_parallel_dim`, `sequence_parallel`): moving off the meta device makes new
    Parameter objects, which would drop them."""
    attributes = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        p.__dict__.update(attributes[name])
    return module
