"""Mixture-of-experts weights in tpcore's "torch" checkpoint format: one file per pipeline
stage and expert-parallel rank.

An MoE layer's expert weights `[experts, ...]` split over the expert-parallel group (shard
spec axis "expert"), which is laid across the TP x DP ranks of a stage: the (TP, PP) model
files, written by DP rank 0, would hold only the experts of the EP ranks that happen to be
DP rank 0. So expert weights go into files of their own:

    experts_pp00_ep000.pt   {"model": EP rank 0's expert weights on stage 0 (full-model
                            names), "optimizer": their AdamW state, "identity": ...}

each written by the first rank of its expert-data-parallel group (the ranks that hold the
same experts); at EP 1 (every rank holds every expert) by the writer of `model_tp00_ppSS`.
Loading at any EP, TP, PP and DP size copies from each file the experts this rank holds
(`copy_overlap` along the experts, as the model files are read along TP).

The distributed optimizer slices expert weights over the ranks holding the same experts (at
EP 1 over DP), not over DP as the rest; each of those ranks writes its slices:

    experts_optim_pp00_ep000_edp001.pt   {"shards": {name: {"lo", "hi", ...}}, "identity"}

(the layout of `optimizer_slices`; `lo`/`hi` index the flattened `[experts/EP, ...]` piece
of the expert file of the same EP rank; "expert_data_parallel_size" in the metadata says how
many slice files each EP rank has), and the expert file's optimizer entry says so instead of
holding the state. Loaders put the slices back together one tensor at a time
(`SavedSlices`), with or without the distributed optimizer, at any layout.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..parallel_state import (
    get_expert_data_parallel_group,
    get_expert_model_parallel_world_size,
    is_initialized,
)
from ..pipeline_parallel.layout import ParallelLayout
from ..tensor_parallel.shard_spec import ShardSpec, shard_spec, shares_indices
from .errors import CheckpointError
from .integrity import check_identity
from .optimizer_slices import SavedSlices
from .shard_reading import (
    MappedFile,
    add_optimizer_targets,
    copy_from,
    model_pieces,
    optimizer_pieces,
    require_files,
    shard_opener,
)

__all__ = [
    "expert_file",
    "expert_slice_file",
    "expert_slicing",
    "expert_slices",
    "expert_names",
    "expert_parallel_of",
    "expert_parallel_size",
    "writes_experts",
    "expert_state",
    "expert_files",
    "plan_experts",
    "read_experts",
    "read_dense_experts",
]


def expert_file(directory: str, pp_rank: int, ep_rank: int) -> str:
    return os.path.join(directory, f"experts_pp{pp_rank:02d}_ep{ep_rank:03d}.pt")


def expert_slice_file(directory: str, pp_rank: int, ep_rank: int, slice_rank: int) -> str:
    return os.path.join(
        directory, f"experts_optim_pp{pp_rank:02d}_ep{ep_rank:03d}_edp{slice_rank:03d}.pt"
    )


def expert_names(specs: dict[str, ShardSpec]) -> set[str]:
    """The names among `specs` of expert weights (split along the experts)."""
    return {name for name, spec in specs.items() if spec.axis == "expert"}


def expert_parallel_of(chunks: Sequence[nn.Module]) -> tuple[int, int] | None:
    """(EP rank, EP size) of this rank's expert weights; None for a model without experts."""
    for chunk in chunks:
        for p in chunk.parameters():
            spec = shard_spec(p)
            if spec.axis == "expert":
                return spec.tp_rank, spec.tp_size
    return None


def expert_parallel_size(chunks: Sequence[nn.Module]) -> int | None:
    """The model's EP size, None without experts; the same on every rank: from this rank's
    expert weights, or on a pipeline stage without MoE layers from the expert-parallel group."""
    if getattr(chunks[0].config, "num_experts", None) is None:
        return None
    mine = expert_parallel_of(chunks)
    if mine is not None:
        return mine[1]
    return get_expert_model_parallel_world_size() if is_initialized() else 1


def writes_experts(
    chunks: Sequence[nn.Module], tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup
) -> bool:
    """Whether this rank writes its stage's file of its EP rank: the first rank of its
    expert-data-parallel group, or at EP 1 the writer of the stage's TP rank 0 model file."""
    ep = expert_parallel_of(chunks)
    if ep is None:
        return False
    if ep[1] == 1:
        return dist.get_rank(tp_group) == 0 and dist.get_rank(dp_group) == 0
    return dist.get_rank(get_expert_data_parallel_group()) == 0


def expert_slicing(
    ep_size: int, tp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup
) -> tuple[int | None, int]:
    """How the distributed optimizer slices expert weights: (this rank's slice, the number
    of slices). At EP > 1 over the expert-data-parallel group; at EP 1 (expert weights are
    then in the dense buffers) over `dp_group`, the TP ranks holding copies, of which TP
    rank 0 writes (slice None on the others). The count is the same on every rank."""
    if ep_size > 1:
        group = get_expert_data_parallel_group()
        return dist.get_rank(group), dist.get_world_size(group)
    writes = dist.get_rank(tp_group) == 0
    return (dist.get_rank(dp_group) if writes else None), dist.get_world_size(dp_group)


def expert_state(
    model: dict, optimizer_state: dict | None, experts: set[str], slices: int | None = None
) -> dict:
    """The expert file's payload: the expert entries of a (TP, PP) shard's `model` tensors
    and of its optimizer state (None without an optimizer); with a distributed optimizer
    (`slices`: the number of expert slice files) that number in place of the state."""
    state = {"model": {name: t for name, t in model.items() if name in experts}}
    if optimizer_state is None:
        state["optimizer"] = None
    elif slices is not None:
        state["optimizer"] = {"params": {}, "data_parallel_size": slices}
    else:
        params = optimizer_state["params"]
        state["optimizer"] = {"params": {n: e for n, e in params.items() if n in experts}}
    return state


def expert_slices(
    directory: str, meta: dict, ep_rank: int, pp_rank: int, verify: bool, load: Callable
) -> SavedSlices:
    """The distributed optimizer's slice files of saved (EP rank, PP rank)'s experts."""
    count = meta["expert_data_parallel_size"]
    paths = [expert_slice_file(directory, pp_rank, ep_rank, d) for d in range(count)]

    def check(path: str, state: dict, slice_rank: int) -> None:
        check_identity(path, state, meta, None, pp_rank, dp_rank=slice_rank, ep_rank=ep_rank)

    return SavedSlices(paths, meta, verify, load, check)


def expert_files(
    directory: str, meta: dict, specs: dict[str, ShardSpec]
) -> dict[tuple[int, int], str]:
    """Every expert file of the checkpoint by (EP rank, PP rank): those of the stages holding
    expert weights (`specs`: the checkpoint's; {} without experts). Raises, alike on every
    rank, when one is missing."""
    layout = ParallelLayout.from_metadata(meta)
    stages = sorted({layout.pipeline_rank_of(name) for name in expert_names(specs)})
    ep = meta.get("expert_model_parallel_size", 1)
    files = {(e, p): expert_file(directory, p, e) for p in stages for e in range(ep)}
    return require_files(directory, files)


def plan_experts(
    saved: ParallelLayout,
    saved_ep: int,
    params: dict[str, torch.Tensor],
    specs: dict[str, ShardSpec],
    stored: dict[str, ShardSpec],
) -> dict[tuple[int, int], list[str]]:
    """(saved EP rank, PP rank) -> the expert weights of `params` (this rank's pieces,
    described by `specs`) to read from that file: the files holding experts they hold."""
    needed: dict[tuple[int, int], list[str]] = {}
    for name in params:
        sources = [
            r for r in range(saved_ep) if shares_indices(specs[name], stored[name].at(saved_ep, r))
        ]
        for r in sources:
            needed.setdefault((r, saved.pipeline_rank_of(name)), []).append(name)
    return needed


def read_experts(
    open_file: Callable[[tuple[int, int]], MappedFile],
    needed: dict[tuple[int, int], list[str]],
    saved: ParallelLayout,
    saved_ep: int,
    params: dict[str, torch.Tensor],
    specs: dict[str, ShardSpec],
    stored: dict[str, ShardSpec],
    state: dict | None,
    open_slices: Callable[[tuple[int, int]], SavedSlices] | None = None,
    frozen: bool = False,
) -> None:
    """Fill `params` (this rank's expert weights) from the expert files `needed` names
    (`plan_experts`), and, when `state` (the optimizer state being assembled from the model
    files) is given, add their AdamW state to it: from the expert file, or from the slice
    files `open_slices` opens at (EP rank, PP rank) when a distributed optimizer saved it.
    `frozen`: the checkpoint's run did not train the experts (LoRA adapters): no state."""
    experts = sorted(expert_names(stored))
    flat: dict[str, torch.Tensor] = {}
    for (ep_rank, pp_rank), wanted in sorted(needed.items(), key=lambda kv: kv[0][::-1]):
        file = open_file((ep_rank, pp_rank))  # one file mapped at a time
        names = saved.names_on(pp_rank, experts)
        file.check_names(names, [] if frozen else None)
        targets = {name: params[name] for name in wanted}
        copy_from(file, model_pieces, targets, specs, stored, ep_rank, saved_ep, "expert weight")
        if state is None or frozen:
            continue
        saved_opt, section = file.state["optimizer"], optimizer_pieces
        if saved_opt is None:
            raise CheckpointError(f"tpcore: {file.path} holds no optimizer state")
        if saved_opt.get("data_parallel_size"):
            slices = open_slices((ep_rank, pp_rank))
            saved_opt, section = slices.read_as(file.state["model"], names, wanted)
        add_optimizer_targets(state, flat, saved_opt, wanted, params)
        pieces = {key: t for key, t in flat.items() if key.split("/")[0] in targets}
        copy_from(file, section, pieces, specs, stored, ep_rank, saved_ep, "optimizer")


def read_dense_experts(
    directory: str,
    meta: dict,
    saved: ParallelLayout,
    specs: dict[str, ShardSpec],
    dense: dict[str, torch.Tensor],
    verify: bool,
) -> None:
    """Fill the full expert weights of `dense` from every expert file (`load_dense_state_dict`);
    a LoRA run's files hold no AdamW state of the (frozen) experts."""
    files = expert_files(directory, meta, specs)
    if not files:
        return
    open_file = shard_opener(meta, files, verify, experts=True)
    saved_ep = meta["expert_model_parallel_size"]
    experts = sorted(expert_names(specs))
    for ep_rank, pp_rank in sorted(files, key=lambda key: key[::-1]):
        stored = saved.names_on(pp_rank, experts)
        file = open_file((ep_rank, pp_rank))
        file.check_names(stored, [] if meta.get("lora") is not None else None)
        targets = {name: dense[name] for name in stored}
        copy_from(file, model_pieces, targets, specs, specs, ep_rank, saved_ep, "expert weight")
