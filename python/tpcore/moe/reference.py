"""The dense reference of `MoELayer`: every expert on one rank, a plain loop over them.

Same parameter names and math as `MoELayer` with one rank (ReferenceGPT's MoE blocks): each
expert runs on the tokens routed to it, its output times the routing weight is added to
theirs. It holds the whole `[experts, ...]` weights; the loss `aux_loss` of the last forward
(balancing plus z-loss) is kept for the caller to add to its loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layer import MoEConfig
from .router import route

__all__ = ["ReferenceMoE"]


class ReferenceMoE(nn.Module):
    """`[s, b, h] -> [s, b, h]` with every expert here; `shared_expert` as in MoELayer."""

    def __init__(
        self,
        config: MoEConfig,
        *,
        dtype: torch.dtype | None = None,
        device=None,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        c, experts = config, config.routing.num_experts
        self.config = c
        rows = c.ffn_hidden_size * (2 if c.gated else 1)
        self.router = nn.Linear(c.hidden_size, experts, bias=False, dtype=dtype, device=device)
        if c.expert_bias_update_rate is not None:
            self.router.register_buffer("expert_bias", torch.zeros(experts, device=device))
        self.experts = nn.Module()
        for name, shape in (
            ("fc1", (experts, rows, c.hidden_size)),
            ("fc2", (experts, c.hidden_size, c.ffn_hidden_size)),
        ):
            holder = nn.Module()
            holder.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            self.experts.add_module(name, holder)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            if c.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(
                    c.hidden_size, 1, bias=False, dtype=dtype, device=device
                )
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        tokens = x.reshape(-1, x.shape[-1])
        logits = F.linear(tokens.float(), self.router.weight.float())
        routing = route(logits, c.routing, getattr(self.router, "expert_bias", None))
        self.aux_loss = routing.aux_loss + routing.z_loss
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
        fc1, fc2 = self.experts.fc1.weight, self.experts.fc2.weight
        for e in range(c.routing.num_experts):
            token, slot = (routing.experts == e).nonzero(as_tuple=True)
            y = c.activation(tokens[token] @ fc1[e].t()) @ fc2[e].t()
            out = out.index_add(0, token, y.float() * routing.weights[token, slot, None])
        out = out.to(x.dtype).view(x.shape)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x)
            if c.shared_expert_gate:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        return out
