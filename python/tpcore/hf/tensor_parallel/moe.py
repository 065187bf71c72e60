"""Sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) split over the tensor-parallel group.

Every rank holds every expert, each cut along its intermediate features (plan.py), so
each rank routes every token exactly as the dense model and its experts' output is a
partial sum. The block then needs one f and one g, as an MLP does, placed around the
whole block rather than each expert:

- input: f (identity; backward: all-reduce), since the router's share of the input's
  gradient is partial too: the routing weights multiply partial expert outputs;
- output: g (all-reduce; backward: identity);
- the router stays replicated: its weight's gradient is summed over TP in backward, like
  a head norm's (grads.py);
- a shared expert (Qwen2-MoE) is cut like the routed ones and issues no collective of its
  own; modules that scale its partial output (its sigmoid gate) stay replicated with their
  gradients summed, as the router;
- the router logits the model returns (for the load-balancing loss, which every rank
  computes whole) pass through an identity whose backward divides by TP, so the sums
  above count that loss once.

Router jitter noise (Mixtral's `router_jitter_noise`, training only) would draw different
noise on each rank and route tokens differently: a training forward with it raises.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...tensor_parallel.mappings import copy_to_tensor_parallel, reduce_from_tensor_parallel
from .grads import hook_parameters
from .moe_plan import grouped_gemm_refusal

__all__ = ["install_moe_blocks"]


class _ScaleGrad(torch.autograd.Function):
    """Identity; backward: the gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _hook_block(
    block: nn.Module, name: str, experts: nn.Module, experts_name: str, group: dist.ProcessGroup
) -> None:
    tp_size = dist.get_world_size(group)

    def before(
        module: nn.Module, args, kwargs
    ):  # checks every rank passes alike: same mode, config and dtype
        if module.training and getattr(module, "jitter_noise", 0) > 0:
            raise RuntimeError(
                f"tpcore.hf: MoE block {name!r} trains with router jitter noise "
                f"({module.jitter_noise}), which each tensor-parallel rank would draw differently; "
                "set config.router_jitter_noise = 0 before loading"
            )
        # Checked at planning too; again here for a model cast to another dtype after the split.
        refusal = grouped_gemm_refusal(
            experts_name,
            experts.down_proj.shape[-1],
            experts.down_proj.dtype,
            getattr(experts, "config", None),
            tp_size,
        )
        if refusal:
            raise RuntimeError(refusal)
        if args:
            return (copy_to_tensor_parallel(args[0], group), *args[1:]), kwargs
        return args, {
            **kwargs,
            "hidden_states": copy_to_tensor_parallel(kwargs["hidden_states"], group),
        }

    def after(module: nn.Module, args, output):
        if isinstance(output, tuple):  # (hidden states, router logits) in some releases
            return (reduce_from_tensor_parallel(output[0], group), *output[1:])
        return reduce_from_tensor_parallel(output, group)

    block.register_forward_pre_hook(before, with_kwargs=True)
    block.register_forward_hook(after)


def _hook_router(router: nn.Module, tp_size: int) -> None:
    def after(module: nn.Module, args, output):
        if isinstance(output, tuple) and torch.is_tensor(output[0]) and output[0].requires_grad:
            return (_ScaleGrad.apply(output[0], 1.0 / tp_size), *output[1:])
        return None

    # First of the forward hooks: transformers' output recorders (router_logits) must see the
    # scaled logits.
    router.register_forward_hook(after, prepend=True)


def install_moe_blocks(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Hook the sparse MoE blocks of `model.tpcore_plan` (see the module docstring)."""
    plan = model.tpcore_plan
    if plan.layout.tp_size == 1:
        return
    for block_name, router_name, experts_name in plan.moe_blocks:
        router = model.get_submodule(router_name)
        _hook_block(
            model.get_submodule(block_name),
            block_name,
            model.get_submodule(experts_name),
            experts_name,
            group,
        )
        hook_parameters(router, lambda p: copy_to_tensor_parallel(p, group))
        _hook_router(router, plan.layout.tp_size)
    for name in plan.moe_summed:
        hook_parameters(model.get_submodule(name), lambda p: copy_to_tensor_parallel(p, group))
