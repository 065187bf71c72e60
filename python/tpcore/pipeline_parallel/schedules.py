"""One global batch through the pipeline: m micro-batches, forward and backward passes
of this rank's model chunks in the order of `schedule_table`, messages between them.

    loss = forward_backward(step, num_micro_batches=m, tensor_shape=[s, b, h], dtype=torch.float32)

`step(chunk, micro, input)` runs model chunk `chunk` of this rank on micro-batch `micro`:
`input` is None on the first stage (which reads its own data), the previous stage's
activation elsewhere; it returns the activation to send on, or on the last stage the
micro-batch's loss, unscaled: `forward_backward` divides it by m, so the gradients are
those of the mean loss over the batch.
"""

from __future__ import annotations

import numbers
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .. import comm
from . import p2p
from .schedule_table import (
    BACKWARD,
    FORWARD,
    TAGS,
    Action,
    Message,
    boundary_messages,
    check_schedule,
    rank_units,
)

__all__ = ["forward_backward", "PipelineStats"]

ForwardStep = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]


@dataclass
class PipelineStats:
    """What one `forward_backward` call measured on this rank (pass one in to fill it)."""

    wait_s: float = 0.0
    """Seconds blocked in message batches: the bubble plus the transfers."""
    step_s: float = 0.0
    """Seconds of the whole call."""
    released_bytes: int = 0
    """Activation bytes freed right after their send (sum over micro-batches)."""


def _describe(msg: Message, p: int, v: int) -> str:
    what = "activation" if msg.kind == FORWARD else "gradient"
    where = lambda s: f"stage {s}" + (f" (pipeline rank {s % p}, chunk {s // p})" if v > 1 else "")  # noqa: E731
    return f"the {what} of micro-batch {msg.micro} from {where(msg.src)} to {where(msg.dst)}"


def _check_args(num_micro_batches, tensor_shape, dtype, loss_scale, schedule, p, v) -> list[int]:
    check_schedule(schedule, p, num_micro_batches, v)
    shape = list(tensor_shape)
    if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(
            f"tpcore: forward_backward: tensor_shape must be positive ints, got {tensor_shape!r}"
        )
    if not dtype.is_floating_point:
        raise ValueError(
            f"tpcore: forward_backward: activations must be floating point, got {dtype}"
        )
    if not loss_scale > 0:
        raise ValueError(f"tpcore: forward_backward: loss_scale must be > 0, got {loss_scale}")
    return shape


_AGREED = (
    "num_micro_batches",
    "num_model_chunks",
    "schedule",
    "forward_only",
    "loss_scale",
    "tensor_shape",
    "dtype",
    "check_shapes",
)


def _ints(shape) -> tuple[int, ...]:
    if not all(
        isinstance(d, numbers.Integral) for d in shape
    ):  # 4.0 is not 4 here: _check_args refuses it
        raise TypeError("not ints")
    return tuple(int(d) for d in shape)


def _plain(value, convert):
    """`convert(value)` (a list and a tuple, an int and a float alike), or `value` if that
    fails: bad input is reported after the ranks agree, on every rank."""
    try:
        return convert(value)
    except (TypeError, ValueError):
        return value


def _check_ranks_agree(group: dist.ProcessGroup, device: torch.device, values: tuple) -> None:
    """Raise on every rank of `group` alike unless all of them passed the same `values`
    (`_AGREED`, as given, checked or not): one all-gather of a few int64s per call (8 us
    on the shared-memory backend, 190 us on gloo, 2 CPU ranks on the test VM; on a GPU it
    also reads them back, a host sync per call). Ranks
    that disagree would otherwise wait on a message that never comes, or leave unread
    ones behind and return (forward_only on one rank only)."""
    codes = [zlib.crc32(repr(v).encode()) for v in values]  # hash() differs between processes
    everyone = comm.all_gather(
        torch.tensor(codes, dtype=torch.int64, device=device), 0, group
    ).view(-1, len(codes))
    rows = everyone.tolist()
    for i, name in enumerate(_AGREED):
        if len({row[i] for row in rows}) > 1:
            mine = values[i]
            raise ValueError(
                f"tpcore: forward_backward: the ranks of the pipeline group disagree on {name} "
                f"(this rank, {dist.get_rank(group)}, has {mine!r}; stage ranks with the same "
                f"value: {[r for r, row in enumerate(rows) if row[i] == codes[i]]}); call it with "
                "the same arguments on every rank"
            )


def forward_backward(
    forward_step: ForwardStep,
    *,
    num_micro_batches: int,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    schedule: str = "1f1b",
    num_model_chunks: int = 1,
    group: dist.ProcessGroup | None = None,
    forward_only: bool = False,
    loss_scale: float = 1.0,
    check_shapes: bool = True,
    release_sent_activations: bool = True,
    stats: PipelineStats | None = None,
) -> torch.Tensor:
    """Run `num_micro_batches` micro-batches forward (and backward unless `forward_only`)
    through the pipeline `group` (default: parallel_state's) with `schedule` ("gpipe",
    "1f1b" or "interleaved" with `num_model_chunks` > 1 chunks per rank). Call on every
    rank of the group with the same arguments; every check runs before the first message.

    Activations and gradients between stages are `tensor_shape` (`[s, b, h]`, `[s/tp, b, h]`
    with sequence parallelism) and `dtype`. Parameter gradients accumulate into `.grad`;
    the last stage's backward starts from `loss_scale` (fp16 loss scaling). With
    `release_sent_activations`, a sent activation keeps its autograd graph but not its
    storage (its stage's last op must not save its own output, true of residual blocks).
    Returns the mean micro-batch loss (float64, 0-dim) on every rank of the group.
    """
    start = time.perf_counter()
    group = p2p.resolve_pipeline_group(group)
    p, rank, v, m = (
        dist.get_world_size(group),
        dist.get_rank(group),
        num_model_chunks,
        num_micro_batches,
    )
    device = torch.device(device)
    if p > 1:
        _check_ranks_agree(
            group,
            device,
            (
                m,
                v,
                schedule,
                bool(forward_only),
                _plain(loss_scale, float),
                _plain(tensor_shape, _ints),
                str(dtype),
                bool(check_shapes),
            ),
        )
    shape = _check_args(m, tensor_shape, dtype, loss_scale, schedule, p, v)
    last_stage = p * v - 1
    units = rank_units(schedule, p, m, v, rank, forward_only)
    batches = boundary_messages(units, rank, p, v)

    inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations, by (chunk, micro)
    grads: dict[tuple[int, int], torch.Tensor] = {}  # received output gradients
    saved: dict[tuple[int, int], tuple] = {}  # (input, output) kept for the backward
    outgoing: dict[Message, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    wait_s, released = 0.0, 0

    def run(action: Action) -> None:
        nonlocal loss_sum
        key, stage = (action.chunk, action.micro), action.chunk * p + rank
        if action.kind == FORWARD:
            x = inputs.pop(key, None)
            with torch.no_grad() if forward_only else nullcontext():
                out = forward_step(action.chunk, action.micro, x)
            if stage == last_stage:
                if out.numel() != 1:
                    raise ValueError(
                        "tpcore: forward_backward: the last stage must return the micro-batch loss "
                        f"(one element), got shape {list(out.shape)}"
                    )
                out = out / m
                loss_sum = loss_sum + out.detach().double().reshape(())
            else:
                if list(out.shape) != shape or out.dtype != dtype:
                    raise ValueError(
                        f"tpcore: forward_backward: stage {stage} produced an activation "
                        f"{list(out.shape)} {out.dtype}, but the pipeline sends {shape} {dtype}"
                    )
                outgoing[Message(FORWARD, stage, stage + 1, action.micro)] = out
            if not forward_only:
                saved[key] = (x, out)
            return
        x, out = saved.pop(key)
        grad = grads.pop(key, None)
        if stage == last_stage and loss_scale != 1.0:
            grad = torch.full_like(out, loss_scale)
        p2p.backward_from(out, grad)
        if stage > 0:
            if x.grad is None:
                raise RuntimeError(
                    f"tpcore: forward_backward: the input of stage {stage} got no gradient; does "
                    "its output depend on it?"
                )
            outgoing[Message(BACKWARD, stage, stage - 1, action.micro)] = x.grad

    for b, (sends, recvs) in enumerate(batches):
        send_specs = [
            (outgoing[msg], msg.dst % p, TAGS[msg.kind], _describe(msg, p, v)) for msg in sends
        ]
        recv_specs = [(shape, msg.src % p, TAGS[msg.kind], _describe(msg, p, v)) for msg in recvs]
        if send_specs or recv_specs:
            t0 = time.perf_counter()
            received = p2p.batch_send_recv(
                send_specs,
                recv_specs,
                dtype=dtype,
                device=device,
                group=group,
                check_shapes=check_shapes,
            )
            wait_s += time.perf_counter() - t0
            for msg, t in zip(recvs, received):
                key = (msg.dst // p, msg.micro)
                if msg.kind == FORWARD:
                    inputs[key] = t if forward_only else t.requires_grad_()
                else:
                    grads[key] = t
        for msg in sends:
            sent = outgoing.pop(msg)
            if msg.kind == FORWARD and release_sent_activations and not forward_only:
                nbytes = sent.numel() * sent.element_size()
                if p2p.release_storage(sent):
                    released += nbytes
        if b < len(units):
            for action in units[b]:
                run(action)

    loss = comm.broadcast(loss_sum, p - 1, group)  # the last stage's loss, on every stage
    if stats is not None:
        stats.wait_s, stats.step_s, stats.released_bytes = (
            wait_s,
            time.perf_counter() - start,
            released,
        )
    return loss
