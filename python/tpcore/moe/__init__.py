"""Mixtures of experts: the top-k router, token dispatch over the expert-parallel group
(all-to-all or all-gather), grouped expert GEMMs, the MoE layer and its dense reference."""

from .dispatch import Permutation, all_gather, all_to_all, permute, unpermute
from .grouped_gemm import grouped_linear, grouped_mm_available
from .layer import ExpertWeights, MoEConfig, MoELayer, attach_aux_loss, reset_expert_biases
from .reference import ReferenceMoE
from .router import RouterConfig, Routing, route

__all__ = [
    "RouterConfig",
    "Routing",
    "route",
    "MoEConfig",
    "MoELayer",
    "ExpertWeights",
    "ReferenceMoE",
    "attach_aux_loss",
    "reset_expert_biases",
    "grouped_linear",
    "grouped_mm_available",
    "all_to_all",
    "all_gather",
    "Permutation",
    "permute",
    "unpermute",
]
