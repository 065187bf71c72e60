"""The top-k router of a mixture-of-experts layer (Megatron-Core's `TopKRouter` semantics).

`route(logits, config)` turns the router's logits `[tokens, experts]` into each token's
experts and weights:
- `score="softmax"` (Mixtral, Qwen-MoE, OLMoE): softmax over all experts, in float32, then
  the k largest; `normalize_topk` rescales the k weights to sum to one (Mixtral, Qwen3-MoE's
  `norm_topk_prob`; Qwen2-MoE leaves them).
- `score="sigmoid"` (DeepSeek-V3): sigmoid scores; the k experts are chosen by score plus a
  per-expert bias (the bias balances the load and changes only the choice, not the weights);
  the chosen scores are normalized when `normalize_topk`; times `scaling_factor`.
- `capacity_factor` (optional; None: dropless): each expert takes at most
  `ceil(tokens * k / experts * capacity_factor)` tokens, those of largest weight (Megatron's
  "probs" drop policy); a dropped route gets weight 0 and expert -1.

Two auxiliary losses, each a scalar to add to the language-model loss:
- load balancing (Switch Transformer, as Megatron computes it):
  `coeff * experts * sum_e f_e P_e`, `f_e` the fraction of the tokens' k routes that go to e,
  `P_e` the mean softmax probability of e over the tokens. transformers' Mixtral computes k
  times this (its `f_e` counts tokens, not routes).
- z-loss (ST-MoE): `coeff * mean over tokens of logsumexp(logits)^2`.
With `token_group`, the tokens of one batch are spread over that group's ranks (an MoE layer
under tensor parallelism routes its 1/tp of them): `f_e` counts the routes of every rank, and
each rank returns its share of the losses over all the tokens (their sum over the group is
the loss a single rank would compute over all of them), so backward on each share gives each
rank's logits their exact gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["RouterConfig", "Routing", "route"]


@dataclass(frozen=True)
class RouterConfig:
    """How tokens pick their experts."""

    num_experts: int
    """Experts in the layer."""
    top_k: int
    """Experts per token."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """The score function over the router's logits."""
    normalize_topk: bool = True
    """Rescale each token's k weights to sum to one."""
    scaling_factor: float = 1.0
    """Multiplies the weights (DeepSeek-V3's routed_scaling_factor)."""
    capacity_factor: float | None = None
    """Tokens per expert at most `ceil(tokens * k / experts * factor)`; None: no dropping."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (0: not computed)."""
    z_loss_coeff: float = 0.0
    """Coefficient of the router z-loss (0: not computed)."""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"tpcore: RouterConfig: {what}")

        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name} must be an int >= 1, got {value!r}",
            )
        need(
            self.top_k <= self.num_experts,
            f"top_k {self.top_k} exceeds num_experts {self.num_experts}",
        )
        need(
            self.score in ("softmax", "sigmoid"),
            f"score must be softmax or sigmoid, got {self.score!r}",
        )
        need(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"capacity_factor must be > 0 or None, got {self.capacity_factor!r}",
        )
        for name in ("scaling_factor", "aux_loss_coeff", "z_loss_coeff"):
            value = getattr(self, name)
            need(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0")

    def capacity(self, tokens: int) -> int | None:
        """Tokens one expert takes at most, for `tokens` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(tokens * self.top_k / self.num_experts * self.capacity_factor)


@dataclass
class Routing:
    """The router's decision for `[tokens]` tokens."""

    experts: torch.Tensor
    """`[tokens, k]` int64: each token's experts (-1: a route dropped for capacity)."""
    weights: torch.Tensor
    """`[tokens, k]` float32: the weight of each route's expert output (0 when dropped)."""
    tokens_per_expert: torch.Tensor
    """`[experts]` int64: routes each expert takes (after dropping)."""
    aux_loss: torch.Tensor
    """Scalar: load-balancing loss times its coefficient (0 when the coefficient is 0)."""
    z_loss: torch.Tensor
    """Scalar: z-loss times its coefficient (0 when the coefficient is 0)."""


def route(
    logits: torch.Tensor,
    config: RouterConfig,
    expert_bias: torch.Tensor | None = None,
    *,
    token_group: dist.ProcessGroup | None = None,
) -> Routing:
    """Route tokens whose router logits are `logits` `[tokens, experts]` (computed in float32
    here, whatever their dtype). `expert_bias` `[experts]`: added to the sigmoid scores for
    choosing only (DeepSeek-V3's load balancing); not allowed with softmax. `token_group`:
    the group over whose ranks the batch's tokens are spread, each with as many (see the
    module doc; a collective over it when a loss is computed)."""
    if logits.dim() != 2 or logits.shape[1] != config.num_experts:
        raise ValueError(
            f"tpcore: route: logits must be [tokens, {config.num_experts}], got "
            f"{list(logits.shape)}"
        )
    if expert_bias is not None and config.score != "sigmoid":
        raise ValueError("tpcore: route: expert_bias is for the sigmoid score function")
    logits = logits.float()
    k = config.top_k
    if config.score == "softmax":
        scores = torch.softmax(logits, dim=-1)
        weights, experts = scores.topk(k, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias.float()
        experts = choice.topk(k, dim=-1).indices
        weights = scores.gather(-1, experts)
    if config.normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    weights = weights * config.scaling_factor

    tokens = logits.shape[0]
    chosen = experts  # before any dropping: what the balancing loss counts
    capacity = config.capacity(tokens)
    if capacity is not None:
        experts, weights = _drop_over_capacity(experts, weights, capacity, config.num_experts)
    # counted without a boolean mask (no host synchronisation on a GPU): dropped routes weigh 0
    kept = (experts >= 0).reshape(-1).to(torch.int64)
    tokens_per_expert = torch.bincount(
        experts.clamp_min(0).reshape(-1), weights=kept, minlength=config.num_experts
    ).to(torch.int64)

    spread = 1 if token_group is None else dist.get_world_size(token_group)
    everyone = tokens * spread  # the batch's tokens over the group
    zero = logits.new_zeros(())
    aux = zero
    if config.aux_loss_coeff > 0 and everyone > 0:
        # Megatron's: the routes chosen before any dropping, the probabilities of all experts
        # (sigmoid scores normalized over each token's experts).
        counts = torch.bincount(chosen.reshape(-1), minlength=config.num_experts)
        if spread > 1:
            dist.all_reduce(counts, group=token_group)
        probs = scores if config.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        fraction = counts.float() / (everyone * k)
        mean_probs = probs.sum(0) / everyone  # this rank's share of the mean
        aux = config.aux_loss_coeff * config.num_experts * (fraction * mean_probs).sum()
    z = zero
    if config.z_loss_coeff > 0 and everyone > 0:
        z = config.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum() / everyone
    return Routing(experts, weights, tokens_per_expert, aux, z)


def _drop_over_capacity(
    experts: torch.Tensor, weights: torch.Tensor, capacity: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert keeps its `capacity` routes of largest weight (ties: the earlier token)."""
    tokens, k = experts.shape
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
    # Order routes by expert, then by weight descending, then by token: rank within expert.
    order = torch.argsort(flat_w, descending=True, stable=True)
    order = order[torch.argsort(flat_e[order], stable=True)]
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
    keep = (rank < capacity).view(tokens, k)
    return experts.where(keep, -1), weights.where(keep, 0.0)
