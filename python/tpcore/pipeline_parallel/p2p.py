"""Point-to-point messages between pipeline stages (the C++ in csrc/comm/p2p.cpp).

Ranks are ranks of the pipeline group: stage r sends activations forward to r + 1 and
gradients backward to r - 1. A batch posts every message before waiting on any, so the
fused exchanges (send forward + receive backward, send backward + receive forward) cannot
deadlock on gloo or NCCL. The receiver gives the shape it expects (computed from the
model config, e.g. `[s, b, h]` or `[s/tp, b, h]` with sequence parallelism); with
`check_shapes` a small header sent ahead of each payload turns a mismatch into a
ValueError naming the message and both shapes, before any payload moves.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .. import _C
from ..parallel_state import get_pipeline_model_parallel_group, resolve_group

__all__ = [
    "batch_send_recv",
    "send_forward",
    "recv_forward",
    "send_backward",
    "recv_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "release_storage",
    "backward_from",
]

# Message tags by kind, shared with the schedules: gloo matches per tag.
FORWARD_TAG, BACKWARD_TAG = 1, 2

Send = tuple[torch.Tensor, int, int, str]
"""(tensor, peer rank in the pipeline group, tag, what it is — for error messages)"""
Recv = tuple[Sequence[int], int, int, str]
"""(expected shape, peer rank in the pipeline group, tag, what it is)"""


def resolve_pipeline_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`group`, or the pipeline group of `parallel_state`; a clear error when neither is usable."""
    return resolve_group(group, get_pipeline_model_parallel_group, "pipeline")


def batch_send_recv(
    sends: Sequence[Send],
    recvs: Sequence[Recv],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    check_shapes: bool = True,
) -> list[torch.Tensor]:
    """Post all `sends` and `recvs` at once, wait for all; the received tensors in `recvs` order."""
    group = resolve_pipeline_group(group)
    sends = [(t, int(peer), int(tag), what) for t, peer, tag, what in sends]
    recvs = [
        ([int(d) for d in shape], int(peer), int(tag), what) for shape, peer, tag, what in recvs
    ]
    return _C.batch_isend_irecv(group, sends, recvs, dtype, torch.device(device), check_shapes)


def _neighbour(group: dist.ProcessGroup, step: int, what: str) -> int:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    peer = rank + step
    if not 0 <= peer < size:
        raise ValueError(
            f"tpcore: pipeline stage {rank} of {size} has no {'next' if step > 0 else 'previous'} "
            f"stage to {what}"
        )
    return peer


def send_forward(
    output: torch.Tensor, *, group: dist.ProcessGroup | None = None, check_shapes: bool = True
) -> None:
    """Send this stage's output `[s(/tp), b, h]` to the next stage."""
    group = resolve_pipeline_group(group)
    peer = _neighbour(group, 1, "send an activation to")
    batch_send_recv(
        [(output, peer, FORWARD_TAG, "an activation")],
        [],
        dtype=output.dtype,
        device=output.device,
        group=group,
        check_shapes=check_shapes,
    )


def recv_forward(
    shape: Sequence[int],
    *,
    dtype: torch.dtype,
    device="cpu",
    group: dist.ProcessGroup | None = None,
    check_shapes: bool = True,
) -> torch.Tensor:
    """The previous stage's output, of the `shape` this stage expects."""
    group = resolve_pipeline_group(group)
    peer = _neighbour(group, -1, "receive an activation from")
    return batch_send_recv(
        [],
        [(shape, peer, FORWARD_TAG, "an activation")],
        dtype=dtype,
        device=device,
        group=group,
        check_shapes=check_shapes,
    )[0]


def send_backward(
    grad: torch.Tensor, *, group: dist.ProcessGroup | None = None, check_shapes: bool = True
) -> None:
    """Send the gradient of this stage's input to the previous stage."""
    group = resolve_pipeline_group(group)
    peer = _neighbour(group, -1, "send a gradient to")
    batch_send_recv(
        [(grad, peer, BACKWARD_TAG, "a gradient")],
        [],
        dtype=grad.dtype,
        device=grad.device,
        group=group,
        check_shapes=check_shapes,
    )


def recv_backward(
    shape: Sequence[int],
    *,
    dtype: torch.dtype,
    device="cpu",
    group: dist.ProcessGroup | None = None,
    check_shapes: bool = True,
) -> torch.Tensor:
    """The gradient of this stage's output, from the next stage."""
    group = resolve_pipeline_group(group)
    peer = _neighbour(group, 1, "receive a gradient from")
    return batch_send_recv(
        [],
        [(shape, peer, BACKWARD_TAG, "a gradient")],
        dtype=dtype,
        device=device,
        group=group,
        check_shapes=check_shapes,
    )[0]


def send_forward_recv_backward(
    output: torch.Tensor,
    grad_shape: Sequence[int] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    check_shapes: bool = True,
) -> torch.Tensor:
    """Send `output` to the next stage and receive the gradient of an earlier output from it,
    in one batch (1F1B's steady state after a forward). `grad_shape` defaults to `output`'s."""
    group = resolve_pipeline_group(group)
    peer = _neighbour(group, 1, "exchange with")
    shape = list(output.shape) if grad_shape is None else grad_shape
    return batch_send_recv(
        [(output, peer, FORWARD_TAG, "an activation")],
        [(shape, peer, BACKWARD_TAG, "a gradient")],
        dtype=output.dtype,
        device=output.device,
        group=group,
        check_shapes=check_shapes,
    )[0]


def send_backward_recv_forward(
    grad: torch.Tensor,
    activation_shape: Sequence[int] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    check_shapes: bool = True,
) -> torch.Tensor:
    """Send `grad` to the previous stage and receive its next activation, in one batch
    (1F1B's steady state after a backward). `activation_shape` defaults to `grad`'s."""
    group = resolve_pipeline_group(group)
    peer = _neighbour(group, -1, "exchange with")
    shape = list(grad.shape) if activation_shape is None else activation_shape
    return batch_send_recv(
        [(grad, peer, BACKWARD_TAG, "a gradient")],
        [(shape, peer, FORWARD_TAG, "an activation")],
        dtype=grad.dtype,
        device=grad.device,
        group=group,
        check_shapes=check_shapes,
    )[0]


def release_storage(tensor: torch.Tensor) -> bool:
    """Swap the storage of a sent activation for one element (Megatron's
    deallocate_output_tensor): its autograd graph stays, its memory goes. Returns False
    (and does nothing) for views and tensors of at most one element. Back-propagate
    through it with `backward_from`."""
    return _C.release_storage(tensor)


def backward_from(output: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    """`torch.autograd.backward(output, grad)` that also works after `release_storage(output)`."""
    _C.backward_from(output, grad)
