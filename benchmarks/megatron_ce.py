"""Baselines for the benchmarks: Megatron-LM's vocab-parallel cross-entropy.

1. `megatron_cross_entropy`: its algorithm written here in plain PyTorch from its
   description (Shoeybi et al. 2019): three all-reduces in the forward (max, target
   logit, sum of exps) and the softmax saved for the backward, out of place.
2. `load_megatron_core()`: Megatron-LM's own implementation,
   `megatron.core.tensor_parallel.vocab_parallel_cross_entropy`, imported at run time
   from the `megatron-core` package when it is installed (never copied here). It works
   in place: the logits are overwritten by their softmax, then by their gradient.
Not part of tpcore.
"""

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
        predicted = (
            shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        )
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


def load_megatron_core(world: int):
    """Megatron-LM's own `vocab_parallel_cross_entropy(logits, target) -> [tokens]` on a
    TP group of `world` ranks (the whole job, which must already be initialised), or the
    reason it cannot run here as a string."""
    import logging
    import warnings

    # Its import pulls in torch.utils.cpp_extension, which logs that no CUDA runtime is found.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # It warns that Transformer Engine and Apex are missing; the loss needs neither.
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    except Exception as e:  # noqa: BLE001 - any import failure is the reason to report
        return f"megatron-core not importable: {type(e).__name__}: {e}"
    try:
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    except Exception as e:  # noqa: BLE001
        return (
            "megatron-core's parallel_state.initialize_model_parallel failed: "
            f"{type(e).__name__}: {e}"
        )
    return vocab_parallel_cross_entropy
