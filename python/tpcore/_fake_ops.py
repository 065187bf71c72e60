"""Fake (meta) implementations of tpcore's primitive custom operators.

torch.compile, `torch.export` and FakeTensorMode run these instead of the C++ kernels: they
give each output's shape, dtype and device (every output is fresh and contiguous, as the
kernels' are) without communicating. The layer ops need none: they are
CompositeImplicitAutograd and decompose into these primitives and aten ops.
Schemas: csrc/ops/schemas.cpp.
"""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import _resolve_process_group

from . import _C  # noqa: F401  (loads the operators' schemas and kernels)


def _world(group: str) -> int:
    return _resolve_process_group(group).size()


def _split_shape(op: str, shape: list[int], dim: int, world: int) -> list[int]:
    if shape[dim] % world:
        raise ValueError(
            f"tpcore: {op}: dim {dim} of shape {shape} is not divisible by the group size {world}"
        )
    shape[dim] //= world
    return shape


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(t.shape)


def _none(like: torch.Tensor) -> torch.Tensor:
    """A masked-off gradient: the kernels return an empty [0] tensor for it."""
    return like.new_empty((0,))


@torch.library.register_fake("tpcore::all_reduce")
def _all_reduce(input: torch.Tensor, group: str) -> torch.Tensor:
    return _empty_like(input)


@torch.library.register_fake("tpcore::broadcast")
def _broadcast(input: torch.Tensor, src: int, group: str) -> torch.Tensor:
    return _empty_like(input)


@torch.library.register_fake("tpcore::all_gather")
def _all_gather(input: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    world = _world(group)
    if input.dim() == 0:  # gathered like a 1-element vector
        return input.new_empty((world,))
    shape = list(input.shape)
    shape[dim % input.dim()] *= world
    return input.new_empty(shape)


@torch.library.register_fake("tpcore::reduce_scatter")
def _reduce_scatter(input: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return input.new_empty(
        _split_shape("reduce_scatter", list(input.shape), dim % input.dim(), _world(group))
    )


@torch.library.register_fake("tpcore::split")
def _split(input: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return input.new_empty(
        _split_shape("split", list(input.shape), dim % input.dim(), _world(group))
    )


@torch.library.register_fake("tpcore::column_parallel_linear_backward")
def _column_backward(grad_output, input, weight, group, sequence_parallel, output_mask):
    grad_input = grad_output.new_empty(input.shape) if output_mask[0] else _none(grad_output)
    grad_weight = grad_output.new_empty(weight.shape) if output_mask[1] else _none(grad_output)
    grad_bias = grad_output.new_empty((weight.shape[0],)) if output_mask[2] else _none(grad_output)
    return grad_input, grad_weight, grad_bias


@torch.library.register_fake("tpcore::row_parallel_linear_forward")
def _row_forward(input, weight, group, sequence_parallel):
    shape = [*input.shape[:-1], weight.shape[0]]
    if sequence_parallel:
        shape = _split_shape("RowParallelLinear", shape, 0, _world(group))
    return input.new_empty(shape)


@torch.library.register_fake("tpcore::vocab_parallel_embedding_forward")
def _embedding_forward(ids, weight, group, num_embeddings, sequence_parallel):
    shape = [*ids.shape, weight.shape[1]]
    if sequence_parallel:
        shape = _split_shape("VocabParallelEmbedding", shape, 0, _world(group))
    return weight.new_empty(shape)


@torch.library.register_fake("tpcore::vocab_parallel_embedding_backward")
def _embedding_backward(grad, ids, rows, padding_idx, group, sequence_parallel):
    return grad.new_empty((rows, grad.shape[-1]))


def _token_stats(
    tokens: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse, mask): float32 [tokens] each."""
    return tuple(like.new_empty((tokens,), dtype=torch.float32) for _ in range(3))


@torch.library.register_fake("tpcore::cross_entropy_forward")
def _ce_forward(logits, target, group, vocab_size, label_smoothing, ignore_index, z_loss):
    return _token_stats(logits.shape[0], logits)


@torch.library.register_fake("tpcore::cross_entropy_backward")
def _ce_backward(logits, target, lse, scale, group, vocab_size, label_smoothing, z_loss):
    return _empty_like(logits)


@torch.library.register_fake("tpcore::linear_cross_entropy_forward")
def _linear_ce_forward(
    hidden, weight, target, group, vocab_size, label_smoothing, ignore_index, z_loss, chunk_size
):
    return _token_stats(hidden.shape[0], hidden)


@torch.library.register_fake("tpcore::linear_cross_entropy_backward")
def _linear_ce_backward(
    hidden,
    weight,
    target,
    lse,
    scale,
    group,
    vocab_size,
    label_smoothing,
    z_loss,
    chunk_size,
    output_mask,
):
    grad_hidden = _empty_like(hidden) if output_mask[0] else _none(hidden)
    grad_weight = _empty_like(weight) if output_mask[1] else _none(hidden)
    return grad_hidden, grad_weight


@torch.library.register_fake("tpcore::all_reduce_start")
def _all_reduce_start(input: torch.Tensor, group: str) -> torch.Tensor:
    return _empty_like(input)


@torch.library.register_fake("tpcore::all_gather_start")
def _all_gather_start(input: torch.Tensor, group: str) -> torch.Tensor:
    return _all_gather(input, 0, group)


@torch.library.register_fake("tpcore::reduce_scatter_start")
def _reduce_scatter_start(input: torch.Tensor, group: str) -> torch.Tensor:
    return _reduce_scatter(input, 0, group)


@torch.library.register_fake("tpcore::dropout_apply")
def _dropout_apply(input: torch.Tensor, rng_state: torch.Tensor, p: float) -> torch.Tensor:
    # The kernel's argument checks, so that a traced call fails where an eager one would.
    if not 0.0 <= p < 1.0:
        raise ValueError(f"tpcore: dropout: p must be in [0, 1), got {p}")
    if not input.dtype.is_floating_point:
        raise TypeError(
            f"tpcore: dropout: input must be a floating-point tensor, got {input.dtype}"
        )
    if rng_state.dtype != torch.int64 or rng_state.dim() != 1 or rng_state.numel() != 2:
        raise ValueError(
            "tpcore: dropout: rng_state must be an int64 tensor [2] holding (seed, "
            f"offset), got {rng_state.dtype} of shape {list(rng_state.shape)}"
        )
    if rng_state.device != input.device:
        raise ValueError(
            f"tpcore: dropout: rng_state is on {rng_state.device} "
            f"but the input is on {input.device}"
        )
    return _empty_like(input)


@torch.library.register_fake("tpcore::rng_state_copy")
def _rng_state_copy(counter: torch.Tensor) -> torch.Tensor:
    return _empty_like(counter)
