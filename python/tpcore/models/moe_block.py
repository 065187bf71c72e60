"""GPT's MoE blocks: the `MoEConfig` a GPTConfig gives, and the MoE MLP of either GPT."""

from __future__ import annotations

from functools import partial

from ..moe import MoEConfig, RouterConfig
from .common import mlp_activation
from .config import GPTConfig

__all__ = ["moe_config"]


def moe_config(config: GPTConfig) -> MoEConfig:
    """The settings of `config`'s MoE layers (its `moe_*` fields)."""
    c = config
    balancing = c.moe_router_load_balancing_type == "aux_loss"
    routing = RouterConfig(
        num_experts=c.num_experts,
        top_k=c.moe_router_topk,
        score=c.moe_router_score_function,
        normalize_topk=c.moe_norm_topk_prob,
        scaling_factor=c.moe_router_topk_scaling_factor,
        capacity_factor=c.moe_expert_capacity_factor,
        aux_loss_coeff=c.moe_aux_loss_coeff if balancing else 0.0,
        z_loss_coeff=c.moe_z_loss_coeff,
    )
    return MoEConfig(
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.moe_ffn_hidden_size,
        routing=routing,
        activation=partial(mlp_activation, c),
        gated=c.gated_mlp,
        sequence_parallel=c.sequence_parallel,
        dispatcher=c.moe_token_dispatcher_type,
        grouped_gemm=c.moe_grouped_gemm,
        shared_expert_gate=c.moe_shared_expert_gate,
        expert_bias_update_rate=(
            c.moe_router_bias_update_rate if c.moe_router_enable_expert_bias else None
        ),
    )
