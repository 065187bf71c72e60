"""Baseline for the benchmarks: Megatron-LM's vocab-parallel cross-entropy algorithm,
written here in plain PyTorch from its description (Shoeybi et al. 2019): three
all-reduces in the forward (max, target logit, sum of exps) and the softmax saved
for the backward. Not part of tpcore."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tpcore


class _MegatronCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        rank = dist.get_rank(group)
        local = logits.shape[-1]
        start = rank * local
        logits_max = logits.max(-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + local)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax, kept for backward
        ctx.save_for_backward(exp, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None


def megatron_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss [tokens] of logits [tokens, vocab/tp] on the TP group."""
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    return _MegatronCrossEntropy.apply(logits, target, group)
