"""Process groups for tensor, context, pipeline, data and expert parallelism.

Ranks are laid out as in Megatron-LM: tensor-parallel ranks are adjacent, then
context-parallel, then data-parallel, then pipeline-parallel, so that

    global_rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

Context parallelism splits every sequence over `cp` ranks that hold the same weights, so
gradients are summed over CP as well as DP: the data-and-context group (`dp * cp` ranks of
one stage at the same TP rank) is what gradient reduction and the distributed optimizer use.

Expert parallelism (mixtures of experts) is laid over the same ranks as Megatron-Core's
"MoE parallel folding" with expert tensor parallelism 1: the `tp * cp * dp` ranks of a pipeline
stage are cut again into expert-parallel groups of `ep` adjacent ranks (each holds
`experts / ep` of every MoE layer's experts; tokens travel between them by all-to-all) and
expert-data-parallel groups of the ranks that hold the same experts (stride `ep`; expert
gradients are summed over it). So `ep` must divide `tp * cp * dp`, not only `dp`.

`rank_layout` computes the groups as plain lists (no processes needed);
`initialize_model_parallel` creates them on a live `torch.distributed` job and
keeps them in one `ParallelState` object. With pipeline parallelism the embedding
group joins each pipeline's first and last stage, which both hold the word embedding
when the LM head is tied to it. Layers take a group explicitly and
fall back to the tensor-parallel group set up here; nothing falls back to WORLD.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

# Imported now, before any group exists, on purpose: its functions take
# `group=group.WORLD` as a default argument, evaluated at import. Imported later (torch
# does, lazily, the first time an nn.Embedding is built) it captures the live default
# group, which then outlives destroy_process_group with its gloo threads; a thread still
# freeing a tensor while Python finalizes aborts the process.
import torch.distributed.nn  # noqa: E402,F401

from . import exit_hook, shm
from ._validation import check_positive_ints

__all__ = [
    "RankLayout",
    "ParallelState",
    "rank_layout",
    "initialize_model_parallel",
    "destroy_model_parallel",
    "shutdown",
    "is_initialized",
    "get_parallel_state",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_data_parallel_group",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_context_parallel_group",
    "get_context_parallel_world_size",
    "get_context_parallel_rank",
    "get_data_context_parallel_group",
    "get_tensor_context_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_embedding_group",
    "get_expert_model_parallel_group",
    "get_expert_model_parallel_world_size",
    "get_expert_model_parallel_rank",
    "get_expert_data_parallel_group",
    "resolve_tensor_group",
]


@dataclass(frozen=True)
class RankLayout:
    """Every group of each kind, as lists of global ranks."""

    tensor: list[list[int]]
    """Tensor-parallel groups: `tp` adjacent ranks each."""
    data: list[list[int]]
    """Data-parallel groups: same tp rank, cp rank and pp stage, stride `tp * cp`."""
    pipeline: list[list[int]]
    """Pipeline groups: one rank per stage, stride `tp * cp * dp`."""
    embedding: list[list[int]]
    """Embedding groups: the first and last rank of each pipeline group (one rank when pp = 1)."""
    expert: list[list[int]] = dataclasses.field(default_factory=list)
    """Expert-parallel groups: `ep` adjacent ranks of one pipeline stage."""
    expert_data: list[list[int]] = dataclasses.field(default_factory=list)
    """Expert-data-parallel groups: the ranks of one stage at the same expert-parallel rank."""
    context: list[list[int]] = dataclasses.field(default_factory=list)
    """Context-parallel groups: `cp` ranks at stride `tp` (each holds part of every sequence)."""
    data_context: list[list[int]] = dataclasses.field(default_factory=list)
    """Data-and-context groups: the `dp * cp` ranks of one stage at the same TP rank
    (gradients reduce over them); the data groups when cp is 1."""
    tensor_context: list[list[int]] = dataclasses.field(default_factory=list)
    """Tensor-and-context groups: `tp * cp` adjacent ranks, whose tokens together are one
    micro-batch's (MoE balancing losses count over them); none when cp is 1."""

    def groups_of(self, rank: int) -> tuple[list[int], list[int], list[int]]:
        """The (tensor, data, pipeline) groups that contain `rank`."""
        return tuple(
            next(g for g in kind if rank in g) for kind in (self.tensor, self.data, self.pipeline)
        )


def _check_sizes(
    world_size: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> int:
    check_positive_ints(
        "model parallel sizes",
        world_size=world_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        context_parallel_size=context_parallel_size,
    )
    model_size = tensor_parallel_size * context_parallel_size * pipeline_parallel_size
    if world_size % model_size != 0:
        cp = (
            f"context_parallel_size ({context_parallel_size}) x "
            if context_parallel_size > 1
            else ""
        )
        raise ValueError(
            f"tpcore: world size {world_size} is not divisible by "
            f"tensor_parallel_size ({tensor_parallel_size}) x {cp}"
            f"pipeline_parallel_size ({pipeline_parallel_size}) = {model_size}"
            + (
                " (one process: launch one per rank, e.g. torchrun --nproc_per_node N)"
                if world_size == 1
                else ""
            )
        )
    stage = world_size // pipeline_parallel_size
    if stage % expert_model_parallel_size:
        raise ValueError(
            f"tpcore: expert_model_parallel_size ({expert_model_parallel_size}) does not divide "
            f"the tensor x context x data parallel ranks of a pipeline stage ({stage} = "
            f"tensor_parallel_size {tensor_parallel_size} x context_parallel_size "
            f"{context_parallel_size} x data-parallel size {world_size // model_size}); "
            "expert parallelism is laid over those ranks"
        )
    return world_size // model_size


def rank_layout(
    world_size: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> RankLayout:
    """Megatron's rank order for `world_size` ranks: TP adjacent, then CP, then DP, then PP;
    expert groups (only when `expert_model_parallel_size > 1`) fold over each stage's ranks."""
    tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_model_parallel_size
    cp = context_parallel_size
    dp = _check_sizes(world_size, tp, pp, ep, cp)
    stage = tp * cp * dp  # ranks per pipeline stage
    tensor = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    coords = [(s, c, t) for s in range(pp) for c in range(cp) for t in range(tp)]
    data = [[s * stage + d * cp * tp + c * tp + t for d in range(dp)] for s, c, t in coords]
    context = [
        [s * stage + d * cp * tp + c * tp + t for c in range(cp)]
        for s in range(pp)
        for d in range(dp)
        for t in range(tp)
    ]
    data_context = [
        list(range(s * stage + t, (s + 1) * stage, tp)) for s in range(pp) for t in range(tp)
    ]
    tensor_context = [
        list(range(start, start + tp * cp)) for start in range(0, world_size, tp * cp)
    ]
    if cp == 1:  # no groups of one rank: CP 1 is "no context group", DP x CP is DP
        context, data_context, tensor_context = [], data, []
    pipeline = [[r + s * stage for s in range(pp)] for r in range(stage)]
    embedding = [sorted({g[0], g[-1]}) for g in pipeline]
    expert, expert_data = [], []
    if ep > 1:
        expert = [list(range(start, start + ep)) for start in range(0, world_size, ep)]
        expert_data = [
            list(range(s * stage + e, (s + 1) * stage, ep)) for s in range(pp) for e in range(ep)
        ]
    return RankLayout(
        tensor,
        data,
        pipeline,
        embedding,
        expert,
        expert_data,
        context,
        data_context,
        tensor_context,
    )


@dataclass
class ParallelState:
    """The live groups of this rank, created by `initialize_model_parallel`."""

    tensor_group: dist.ProcessGroup
    data_group: dist.ProcessGroup
    pipeline_group: dist.ProcessGroup
    layout: RankLayout
    embedding_group: dist.ProcessGroup | None = None
    """First and last pipeline stage of this rank's pipeline; None on the stages between."""
    expert_group: dist.ProcessGroup | None = None
    """This rank's expert-parallel group; None when expert_model_parallel_size is 1."""
    expert_data_group: dist.ProcessGroup | None = None
    """The ranks holding the same experts as this one; None when expert_model_parallel_size
    is 1 (then every rank holds every expert: expert gradients are summed like the others)."""
    context_group: dist.ProcessGroup | None = None
    """This rank's context-parallel group (one rank when context_parallel_size is 1)."""
    data_context_group: dist.ProcessGroup | None = None
    """The data-parallel ranks of every context-parallel rank: where gradients reduce (the
    data group when context_parallel_size is 1)."""
    tensor_context_group: dist.ProcessGroup | None = None
    """The tensor- and context-parallel ranks holding one micro-batch's tokens; None when
    context_parallel_size is 1."""


_STATE: ParallelState | None = None


# Every group made so far, by (ranks, timeout, backend), for the current default group.
# destroy_model_parallel cannot free subgroups safely (see there), so re-initializing
# with a layout seen before reuses its groups: without this each re-initialization
# leaks a group per rank set (with gloo, threads that keep polling).
# Weak references: c10d's registry keeps the groups alive until destroy_process_group,
# and after it nothing of tpcore may. A gloo group that outlives it keeps its worker
# threads, and a worker that frees a tensor after Python has begun finalizing aborts
# the process ("terminate called without an active exception").
# Ranks outside a group get torch's non-member marker, kept as it is.
_GROUPS: dict[tuple, weakref.ref | object] = {}
_GROUPS_WORLD: list[weakref.ref | None] = [None]  # the default group _GROUPS belongs to


def _new_group(
    ranks: list[int], timeout: timedelta | None, backend: str | None
) -> dist.ProcessGroup:
    """A group of `ranks`, created collectively (every rank calls in the same order)."""
    world = _GROUPS_WORLD[0]
    if world is None or world() is not dist.group.WORLD:  # a new default group: old groups are dead
        _GROUPS.clear()
        _GROUPS_WORLD[0] = weakref.ref(dist.group.WORLD)
    key = (tuple(ranks), timeout, backend)
    entry = _GROUPS.get(key)
    if entry is None:
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        _GROUPS[key] = weakref.ref(group) if isinstance(group, dist.ProcessGroup) else group
        return group
    if not isinstance(entry, weakref.ref):
        return entry
    group = entry()
    if group is None:  # only a subgroup destroyed by hand gets here; its peers would not notice
        raise RuntimeError(
            f"tpcore: the process group of ranks {list(ranks)} was destroyed "
            "while the default group lives; tpcore's groups are released only "
            "with the default group (torch.distributed.destroy_process_group())"
        )
    return group


def _settings(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    expert_model_parallel_size: int,
    context_parallel_size: int,
    timeout: timedelta | None,
    backend: str | None,
) -> dict[str, str]:
    """What every rank must agree on before the first group: the arguments and the TPCORE_*
    environment that picks the groups' backends and segment layouts (as given, unparsed)."""
    settings = {
        "tensor_parallel_size": repr(tensor_parallel_size),
        "pipeline_parallel_size": repr(pipeline_parallel_size),
        "expert_model_parallel_size": repr(expert_model_parallel_size),
        "context_parallel_size": repr(context_parallel_size),
        "timeout": repr(timeout),
        "backend": repr(backend),
    }
    settings.update(
        {
            k: repr(v)
            for k, v in sorted(os.environ.items())
            if k.startswith(("TPCORE_SHM_", "TPCORE_CPU_BACKEND", "TPCORE_CHECK_INPUTS"))
        }
    )
    return settings


def _agree(settings: dict[str, str]) -> list[str] | None:
    """Check that every rank passed the same `settings`; return every rank's host identity.

    One object gather on the default group where it can gather on CPU (gloo, tpcore);
    elsewhere (an NCCL-only default group) nothing is checked and None is returned. A
    disagreement raises on every rank alike, before any group exists: ranks that made
    different groups would wait on each other until the store's timeout."""
    default = dist.get_backend()
    if (
        default not in ("gloo", shm.BACKEND_NAME)
        and "cpu:gloo" not in default
        and "cpu:tpcore" not in default
    ):
        return None
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (settings, shm.host_id()))
    for key in dict.fromkeys(k for mine, _ in everyone for k in mine):
        values = [mine.get(key, "unset") for mine, _ in everyone]
        if len(set(values)) > 1:
            ranks_of: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                ranks_of.setdefault(v, []).append(r)
            shown = "; ".join(f"{v} on ranks {_short(r)}" for v, r in ranks_of.items())
            raise ValueError(
                f"tpcore: initialize_model_parallel: the ranks disagree on {key} ({shown}); every "
                "rank must call it with the same arguments and the same TPCORE_* environment"
            )
    return [host for _, host in everyone]


def _short(ranks: list[int]) -> str:
    return (
        str(ranks)
        if len(ranks) <= 8
        else f"[{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} ranks)]"
    )


def _default_timeout() -> timedelta | None:
    """The default group's timeout: torch gives a group made without one 30 minutes, not
    the default group's (so a rank waiting on a failed peer would hang that long)."""
    for device in ("cpu", "cuda"):
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, ValueError, AttributeError):
            continue
    return None


def initialize_model_parallel(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    *,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    timeout: timedelta | None = None,
    backend: str | None = None,
) -> ParallelState:
    """Create the tensor / data / pipeline groups; data-parallel size is derived. With
    `expert_model_parallel_size > 1` also the expert and expert-data groups, with
    `context_parallel_size > 1` the context and data-and-context groups (module doc).

    Call after `torch.distributed.init_process_group`, on every rank, with the same
    arguments. With `backend=None`, groups whose ranks share a host use the shared-memory
    `tpcore` backend for CPU tensors (`tpcore.shm`; `TPCORE_CPU_BACKEND=gloo` opts out), the
    others the default group's backend. Raises on every rank alike (before creating any
    group) when the sizes do not fit the world or when groups already exist.
    """
    global _STATE
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "tpcore: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) before initialize_model_parallel()"
        )
    # The ranks compare their arguments first: a check below that failed on one rank only
    # would leave the others waiting in the first group's creation.
    settings = _settings(
        tensor_parallel_size,
        pipeline_parallel_size,
        expert_model_parallel_size,
        context_parallel_size,
        timeout,
        backend,
    )
    hosts = _agree({**settings, "already initialized": repr(_STATE is not None)})
    if _STATE is not None:
        raise RuntimeError(
            "tpcore: model parallel groups are already initialized; "
            "call destroy_model_parallel() first to re-create them"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(
        world_size,
        tensor_parallel_size,
        pipeline_parallel_size,
        expert_model_parallel_size,
        context_parallel_size,
    )
    hosts = None if backend is not None or hosts is None or shm.opted_out() else hosts
    timeout = timeout if timeout is not None else _default_timeout()
    mine = {}
    # Every rank must create every group, in the same order, even those it is not in.
    # (With pp <= 2 the embedding groups are the pipeline groups and are reused as such.)
    kinds = ("tensor", "data", "pipeline", "embedding", "expert", "expert_data", "context")
    if context_parallel_size > 1:
        kinds += ("data_context", "tensor_context")
    for kind in kinds:
        for ranks in getattr(layout, kind):
            group = _new_group(ranks, timeout, backend or shm.cpu_backend_for(ranks, hosts))
            if rank in ranks:
                mine[kind] = group
    _STATE = ParallelState(
        mine["tensor"],
        mine["data"],
        mine["pipeline"],
        layout,
        mine.get("embedding"),
        mine.get("expert"),
        mine.get("expert_data"),
        mine.get("context"),
        mine.get("data_context", mine["data"]),
        mine.get("tensor_context"),
    )
    exit_hook.register()  # a program that ends without shutdown() must not abort at exit
    return _STATE


def destroy_model_parallel() -> None:
    """Forget the groups made by `initialize_model_parallel` (a no-op if none).

    The groups are not torn down one by one: on some torch versions destroying a
    subgroup and creating new ones makes the new groups reuse its store keys and hang.
    They are released with the default group (`torch.distributed.destroy_process_group()`);
    until then a later `initialize_model_parallel` with the same layout reuses them.
    """
    global _STATE
    _STATE = None


def shutdown(barrier: bool = True) -> None:
    """End a distributed run: forget tpcore's groups and destroy the default group (a no-op
    for what is not initialised). Call it on every rank, last thing.

    With `barrier=True` (a normal exit) every rank first waits for the others: on gloo a
    rank that destroys its group while a peer still talks to it can make the peer abort
    ("terminate called without an active exception", seen with torch 2.4). Pass
    `barrier=False` when leaving on an error, since a failed peer may never arrive.
    """
    destroy_model_parallel()
    exit_hook.unpin_default_group()  # else its gloo threads outlive the default group
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    # Free now, while Python is whole, what only a reference cycle (a model with hooks,
    # say) still holds of the groups: their gloo threads are joined here, not during
    # interpreter shutdown, where a thread that needs the GIL aborts the process.
    gc.collect()


def is_initialized() -> bool:
    """Whether `initialize_model_parallel` has run (and not been destroyed)."""
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    """The current groups; raises a clear error when none are set up."""
    if _STATE is None:
        raise RuntimeError(
            "tpcore: model parallel groups are not initialized; call "
            "tpcore.initialize_model_parallel(tensor_parallel_size=...) first, "
            "or pass group= explicitly"
        )
    return _STATE


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return get_parallel_state().tensor_group


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(get_tensor_model_parallel_group())


def get_data_parallel_group() -> dist.ProcessGroup:
    return get_parallel_state().data_group


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(get_data_parallel_group())


def get_context_parallel_group() -> dist.ProcessGroup | None:
    """This rank's context-parallel group; None when context_parallel_size is 1."""
    return get_parallel_state().context_group


def get_context_parallel_world_size() -> int:
    group = get_context_parallel_group()
    return 1 if group is None else dist.get_world_size(group)


def get_context_parallel_rank() -> int:
    group = get_context_parallel_group()
    return 0 if group is None else dist.get_rank(group)


def get_data_context_parallel_group() -> dist.ProcessGroup:
    """The data-parallel ranks of every context-parallel rank of this stage and TP rank
    (Megatron's `get_data_parallel_group(with_context_parallel=True)`): gradients are
    summed over CP and averaged over DP across it. The data group when CP is 1."""
    return get_parallel_state().data_context_group


def get_tensor_context_parallel_group() -> dist.ProcessGroup | None:
    """The `tp * cp` ranks that hold one micro-batch's tokens (MoE balancing losses count
    over them); None when context_parallel_size is 1."""
    return get_parallel_state().tensor_context_group


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return get_parallel_state().pipeline_group


def get_pipeline_model_parallel_world_size() -> int:
    return dist.get_world_size(get_pipeline_model_parallel_group())


def get_pipeline_model_parallel_rank() -> int:
    return dist.get_rank(get_pipeline_model_parallel_group())


def is_pipeline_first_stage() -> bool:
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage() -> bool:
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_embedding_group() -> dist.ProcessGroup:
    """The group of this pipeline's first and last stage (tied embedding gradients are
    summed over it); raises on a stage between them, which holds no embedding."""
    group = get_parallel_state().embedding_group
    if group is None:
        raise RuntimeError(
            f"tpcore: pipeline stage {get_pipeline_model_parallel_rank()} is "
            "neither the first nor the last stage, so it is in no embedding group"
        )
    return group


def get_expert_model_parallel_group() -> dist.ProcessGroup | None:
    """This rank's expert-parallel group; None when expert_model_parallel_size is 1."""
    return get_parallel_state().expert_group


def get_expert_model_parallel_world_size() -> int:
    group = get_expert_model_parallel_group()
    return 1 if group is None else dist.get_world_size(group)


def get_expert_model_parallel_rank() -> int:
    group = get_expert_model_parallel_group()
    return 0 if group is None else dist.get_rank(group)


def get_expert_data_parallel_group() -> dist.ProcessGroup | None:
    """The ranks holding this rank's experts; None when expert_model_parallel_size is 1."""
    return get_parallel_state().expert_data_group


def resolve_group(
    group: dist.ProcessGroup | None, default: Callable[[], dist.ProcessGroup], what: str
) -> dist.ProcessGroup:
    """`group`, or `default()` when None; a clear error when neither is usable (`what` names
    the kind of group in the message: "process", "pipeline")."""
    if group is None:
        group = default()
        live_group_name(group)  # a bare destroy_process_group() leaves tpcore's groups stale
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"tpcore: this rank is not a member of the {what} group passed as group=")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"tpcore: group= must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    live_group_name(group)
    return group


def live_group_name(group: dist.ProcessGroup) -> str:
    """`group`'s name, which tpcore's C++ ops resolve, after checking that it still names
    `group`: torch reuses names once `destroy_process_group` ran, so a layer kept across a
    new default group would otherwise talk on whatever group now has its name."""
    name = group.group_name
    # checked eagerly; a compiled graph is rebuilt with its groups
    if not torch.compiler.is_compiling():
        try:
            current = dist.distributed_c10d._resolve_process_group(name)
        except (RuntimeError, ValueError, KeyError):
            current = None
        if current is not group:
            raise RuntimeError(
                f"tpcore: the process group {name!r} this layer or call uses was destroyed "
                "(destroy_process_group); build the layer again after initialize_model_parallel"
            )
    return name


def resolve_tensor_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`group`, or the tensor-parallel group when None; a clear error when neither is usable."""
    return resolve_group(group, get_tensor_model_parallel_group, "process")
