"""tpcore's "torch" checkpoint format with mixture-of-experts layers: expert weights in files
of their own per pipeline stage and expert-parallel rank (`checkpoint.expert_files`),
resharded on load.

A GPT with a dense layer and an MoE layer (4 experts, a gated shared expert) takes two AdamW
steps and is saved at TP x EP = 2 x 2 and 1 x 4 on 4 ranks. Loaded at TP x EP 1 x 1, 2 x 1,
1 x 2, 2 x 2 and 1 x 4, every parameter equals this rank's slice (`shard`) of the saved
model's full tensor (`to_dense()` at save time), and the AdamW state of every expert weight
equals its slice of the concatenation of the saved expert files, read with torch.load here.
`load_dense_state_dict` gives the full model; `checkpoint_to_hf` writes the tensors
`export_hf` wrote from the running model.

With the distributed optimizer (saved at TP x EP 2 x 2, 1 x 4 and 2 x 1: expert slices over
the expert-data-parallel group, and at EP 1 over DP), each rank's slices of the expert
weights' AdamW state are gathered at save time into the full tensors (from the optimizer's
own `state_dict`, not the checkpoint); loaded at five layouts, with the plain and the
distributed optimizer, this rank's state equals its slice of those.

Bad input: a missing expert file, a missing expert slice file and one of another rank in its
place are named on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

import tpcore
from checks import MOE_GPT as MOE
from checks import expect_error
from tpcore import parallel_state
from tpcore.models import GPTModel
from tpcore.tensor_parallel.shard_spec import shard, shard_spec
from tpcore.train import CheckpointError, load_checkpoint, load_dense_state_dict, save_checkpoint
from train_checks import adamw_steps, make_optimizer_for

safetensors = pytest.importorskip("safetensors.torch")

SAVED = [(2, 2), (1, 4)]  # (TP, EP) on 4 ranks
LOADED = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]
SAVED_DIST = [(2, 2), (1, 4), (2, 1)]  # with the distributed optimizer
LOADED_DIST = [(1, 1, False), (2, 1, True), (1, 2, True), (2, 2, False), (1, 4, True)]


def _setup(tp: int, ep: int, seed: int, distributed: bool = False):
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    model = GPTModel(MOE)
    opt, grads = make_optimizer_for(model, distributed)
    groups = dict(
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )
    return model, opt, grads, groups


def _folder(root: str, tp: int, ep: int, distributed: bool = False) -> str:
    return os.path.join(root, f"tp{tp}_ep{ep}" + ("_dist" if distributed else ""))


def _gathered_expert_state(model, opt) -> dict | None:
    """The distributed optimizer's AdamW state of every expert weight as full `[experts, ...]`
    tensors (on rank 0; None elsewhere), put together from every rank's `state_dict` slices."""
    shards = opt.state_dict()["shards"]  # a rank whose slice of a weight is empty has no entry
    mine = {}
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        if spec.axis == "expert":
            mine[name] = (spec.tp_rank, spec.tp_size, tuple(p.shape), shards.get(name))
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if torch.distributed.get_rank() != 0:
        return None
    full = {}
    for name in mine:
        ep_size, shape = everyone[0][name][1], everyone[0][name][2]
        entries = [(part[name][0], part[name][3]) for part in everyone if part[name][3]]
        for key in ("exp_avg", "exp_avg_sq"):
            pieces = [torch.full((math.prod(shape),), float("nan")) for _ in range(ep_size)]
            for ep_rank, entry in entries:
                pieces[ep_rank][entry["lo"] : entry["hi"]] = entry[key]
            full[f"{name}/{key}"] = torch.cat([x.view(shape) for x in pieces])
            assert not full[f"{name}/{key}"].isnan().any(), f"{name}/{key}: a slice is missing"
        full[f"{name}/step"] = entries[0][1]["step"]
    return full


def _save(rank, world, root, tp, ep, distributed=False):
    model, opt, grads, groups = _setup(tp, ep, 0, distributed)
    adamw_steps(model, opt, grads)
    folder = _folder(root, tp, ep, distributed)
    save_checkpoint(folder, 2, model, opt, consumed_samples=4, **groups)
    dense = model.to_dense().state_dict()
    from tpcore.hf.gpt_bridge import export_hf

    if not distributed:
        export_hf(model, os.path.join(root, f"hf_tp{tp}_ep{ep}"))
    expert_state = _gathered_expert_state(model, opt) if distributed else None
    if rank == 0:
        torch.save(dense, folder + "_dense.pt")
        if distributed:
            torch.save(expert_state, folder + "_expert_state.pt")
    return sorted(os.listdir(os.path.join(folder, "iter_0000002")))


@pytest.fixture(scope="module")
def saved(cpu_ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("experts"))
    for tp, ep in SAVED:
        files = cpu_ranks.run(_save, root, tp, ep)[0]
        experts = [f for f in files if f.startswith("experts_")]
        assert experts == [f"experts_pp00_ep{e:03d}.pt" for e in range(ep)], files
        models = [f for f in files if f.startswith("model_")]
        assert models == [f"model_tp{t:02d}_pp00.pt" for t in range(tp)], files
    for tp, ep in SAVED_DIST:
        files = cpu_ranks.run(_save, root, tp, ep, True)[0]
        slices = 4 // ep if ep > 1 else 4 // tp  # the ranks holding the same experts; at EP 1 DP
        want = [
            f"experts_optim_pp00_ep{e:03d}_edp{d:03d}.pt" for e in range(ep) for d in range(slices)
        ]
        assert [f for f in files if f.startswith("experts_optim")] == want, files
    return root


def _load(rank, world, root, saved_tp, saved_ep, tp, ep):
    model, opt, _, groups = _setup(tp, ep, 5)  # other weights than the saved ones
    iteration = os.path.join(_folder(root, saved_tp, saved_ep), "iter_0000002")
    load_checkpoint(iteration, model, opt, tp_group=groups["tp_group"])
    what = f"TP {saved_tp} x EP {saved_ep} -> TP {tp} x EP {ep}"
    _check_params(model, _folder(root, saved_tp, saved_ep) + "_dense.pt", what)
    files = [
        torch.load(os.path.join(iteration, f"experts_pp00_ep{e:03d}.pt"), weights_only=True)
        for e in range(saved_ep)
    ]
    full = {}
    for name in files[0]["model"]:
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}/{key}"] = torch.cat([f["optimizer"]["params"][name][key] for f in files])
        full[f"{name}/step"] = files[0]["optimizer"]["params"][name]["step"]
    assert _check_expert_state(model, opt, full, what) == 4  # the MoE layer's fc1 and fc2
    return True


def _check_params(model, dense_path: str, what: str) -> None:
    dense = torch.load(dense_path)
    for name, p in model.named_parameters():
        want = shard(dense[name], shard_spec(p))
        assert torch.equal(p.detach(), want), f"{what}: {name}"


def _check_expert_state(model, opt, full: dict, what: str) -> None:
    """This rank's AdamW state of every expert weight (the plain optimizer's whole tensors,
    the distributed one's slices) equals its slice of `full` ("name/key" -> `[experts, ...]`)."""
    state = opt.state_dict()
    checked = 0
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        if spec.axis != "expert":
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            want = shard(full[f"{name}/{key}"], spec)
            if "shards" in state:  # the distributed optimizer: this rank's slice, if any
                entry = state["shards"].get(name)
                if entry is None:
                    continue
                got, want = entry[key], want.reshape(-1)[entry["lo"] : entry["hi"]]
                step = entry["step"]
            else:
                got, step = state["params"][name][key], state["params"][name]["step"]
            assert torch.equal(got, want), f"{what}: {name}/{key}"
            assert step == full[f"{name}/step"], f"{what}: {name}/step"
            checked += 1
    return checked


def _load_distributed_save(rank, world, root, saved_tp, saved_ep, tp, ep, distributed):
    model, opt, _, groups = _setup(tp, ep, 5, distributed)
    folder = _folder(root, saved_tp, saved_ep, True)
    load_checkpoint(os.path.join(folder, "iter_0000002"), model, opt, tp_group=groups["tp_group"])
    what = (
        f"TP {saved_tp} x EP {saved_ep} (distributed optimizer) -> TP {tp} x EP {ep} "
        f"({'distributed' if distributed else 'plain'} optimizer)"
    )
    _check_params(model, folder + "_dense.pt", what)
    return _check_expert_state(model, opt, torch.load(folder + "_expert_state.pt"), what)


@pytest.mark.parametrize("tp,ep,distributed", LOADED_DIST)
@pytest.mark.parametrize("saved_tp,saved_ep", SAVED_DIST)
def test_distributed_optimizer_expert_slices_reshard_on_load(
    cpu_ranks, saved, saved_tp, saved_ep, tp, ep, distributed
):
    checked = cpu_ranks.run(_load_distributed_save, saved, saved_tp, saved_ep, tp, ep, distributed)
    # every rank's fc1 and fc2 (two tensors each); with the distributed optimizer each element
    # on one rank of those holding the same experts (and every slice of them somewhere)
    assert min(checked) == 4 if not distributed else sum(checked) >= 4 * ep


@pytest.mark.parametrize("tp,ep", LOADED)
@pytest.mark.parametrize("saved_tp,saved_ep", SAVED)
def test_experts_reshard_on_load(cpu_ranks, saved, saved_tp, saved_ep, tp, ep):
    assert all(cpu_ranks.run(_load, saved, saved_tp, saved_ep, tp, ep))


@pytest.mark.parametrize("saved_tp,saved_ep", SAVED)
def test_dense_state_and_hf_export_of_the_checkpoint(saved, tmp_path, saved_tp, saved_ep):
    from tpcore.hf.gpt_bridge.checkpoint import checkpoint_to_hf

    iteration = os.path.join(_folder(saved, saved_tp, saved_ep), "iter_0000002")
    config, state = load_dense_state_dict(iteration)
    want = torch.load(_folder(saved, saved_tp, saved_ep) + "_dense.pt")
    assert config == dataclasses.replace(MOE) and state.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    checkpoint_to_hf(iteration, str(tmp_path / "hf"))
    ours = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    theirs = safetensors.load_file(
        os.path.join(saved, f"hf_tp{saved_tp}_ep{saved_ep}", "model.safetensors")
    )
    assert ours.keys() == theirs.keys() and any("experts.3" in k for k in ours)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key


def _missing_expert_file(rank, world, root):
    model, opt, _, groups = _setup(2, 2, 5)
    iteration = os.path.join(root, "iter_0000002")
    expect_error(
        CheckpointError,
        "is incomplete: experts_pp00_ep001.pt missing",
        load_checkpoint,
        iteration,
        model,
        opt,
        tp_group=groups["tp_group"],
    )
    return True


def _bad_expert_slice_file(rank, world, root, error, verify=True):
    model, opt, _, groups = _setup(1, 2, 5, distributed=True)
    expect_error(
        CheckpointError,
        error,
        load_checkpoint,
        os.path.join(root, "iter_0000002"),
        model,
        opt,
        tp_group=groups["tp_group"],
        verify=verify,
    )
    return True


def test_bad_input_fails_every_rank(cpu_ranks, saved, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(_folder(saved, 2, 2), copy)
    os.remove(copy / "iter_0000002" / "experts_pp00_ep001.pt")
    assert all(cpu_ranks.run(_missing_expert_file, str(copy)))
    copy = tmp_path / "copy_dist"
    shutil.copytree(_folder(saved, 2, 2, True), copy)
    slices = copy / "iter_0000002"
    # a slice file of another rank in place of one: its identity names it (checksums off)
    shutil.copyfile(
        slices / "experts_optim_pp00_ep001_edp001.pt", slices / "experts_optim_pp00_ep001_edp000.pt"
    )
    wrong = (
        "experts_optim_pp00_ep001_edp000.pt is not the shard this checkpoint expects at EP rank "
        "1, PP rank 0, DP rank 0 (a file of another rank, save or run?): data_parallel_rank: "
        "file 1, metadata 0"
    )
    assert all(cpu_ranks.run(_bad_expert_slice_file, str(copy), wrong, False))
    os.remove(slices / "experts_optim_pp00_ep001_edp001.pt")
    missing = (
        "is incomplete: experts_optim_pp00_ep001_edp001.pt missing (distributed optimizer state)"
    )
    assert all(cpu_ranks.run(_bad_expert_slice_file, str(copy), missing))
