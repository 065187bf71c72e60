"""tpcore's "torch" checkpoint format with mixture-of-experts layers: expert weights in files
of their own per pipeline stage and expert-parallel rank (`checkpoint.expert_files`),
resharded on load.

A GPT with a dense layer and an MoE layer (4 experts, a gated shared expert) takes two AdamW
steps and is saved at TP x EP = 2 x 2 and 1 x 4 on 4 ranks. Loaded at TP x EP 1 x 1, 2 x 1,
1 x 2, 2 x 2 and 1 x 4, every parameter equals this rank's slice (`shard`) of the saved
model's full tensor (`to_dense()` at save time), and the AdamW state of every expert weight
equals its slice of the concatenation of the saved expert files, read with torch.load here.
`load_dense_state_dict` gives the full model; `checkpoint_to_hf` writes the tensors
`export_hf` wrote from the running model. Bad input: a missing expert file is named on every
rank; the distributed optimizer's expert slices are refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import tpcore
from checks import MOE_GPT as MOE
from checks import expect_error
from tpcore import parallel_state
from tpcore.models import GPTModel
from tpcore.optimizer.setup import DataParallelOptions, make_optimizer
from tpcore.tensor_parallel.shard_spec import shard, shard_spec
from tpcore.train import CheckpointError, load_checkpoint, load_dense_state_dict, save_checkpoint

safetensors = pytest.importorskip("safetensors.torch")

SAVED = [(2, 2), (1, 4)]  # (TP, EP) on 4 ranks
LOADED = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]


def _setup(tp: int, ep: int, seed: int, distributed: bool = False):
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    model = GPTModel(MOE)
    groups = dict(
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )
    options = DataParallelOptions(
        contiguous_buffers=distributed, use_distributed_optimizer=distributed
    )
    opt, grads = make_optimizer(
        [model],
        options,
        **groups,
        pp_group=None,
        lr=1e-2,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        eps=1e-8,
        loss_scaler=None,
    )
    return model, opt, grads, groups


def _save(rank, world, root, tp, ep):
    model, opt, _, groups = _setup(tp, ep, 0)
    g = torch.Generator().manual_seed(1 + parallel_state.get_data_parallel_rank())
    for _ in range(2):
        ids = torch.randint(0, MOE.vocab_size, (2, 8), generator=g)
        model(ids, ids.roll(1, 1)).backward()
        opt.step(1e-2, 1.0)
        opt.zero_grad()
    folder = os.path.join(root, f"tp{tp}_ep{ep}")
    save_checkpoint(folder, 2, model, opt, consumed_samples=4, **groups)
    dense = model.to_dense().state_dict()
    from tpcore.hf.gpt_bridge import export_hf

    export_hf(model, os.path.join(root, f"hf_tp{tp}_ep{ep}"))
    if rank == 0:
        torch.save(dense, os.path.join(root, f"dense_tp{tp}_ep{ep}.pt"))
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
    return root


def _load(rank, world, root, saved_tp, saved_ep, tp, ep):
    model, opt, _, groups = _setup(tp, ep, 5)  # other weights than the saved ones
    iteration = os.path.join(root, f"tp{saved_tp}_ep{saved_ep}", "iter_0000002")
    load_checkpoint(iteration, model, opt, tp_group=groups["tp_group"])
    dense = torch.load(os.path.join(root, f"dense_tp{saved_tp}_ep{saved_ep}.pt"))
    what = f"TP {saved_tp} x EP {saved_ep} -> TP {tp} x EP {ep}"
    for name, p in model.named_parameters():
        want = shard(dense[name], shard_spec(p))
        assert torch.equal(p.detach(), want), f"{what}: {name}"
    files = [
        torch.load(os.path.join(iteration, f"experts_pp00_ep{e:03d}.pt"), weights_only=True)
        for e in range(saved_ep)
    ]
    state = opt.state_dict()["params"]
    checked = 0
    for name, p in model.named_parameters():
        if shard_spec(p).axis != "expert":
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.cat([f["optimizer"]["params"][name][key] for f in files])
            assert torch.equal(state[name][key], shard(full, shard_spec(p))), (
                f"{what}: {name}/{key}"
            )
            checked += 1
        assert state[name]["step"] == files[0]["optimizer"]["params"][name]["step"]
    assert checked == 4  # fc1 and fc2 of the MoE layer's experts
    return True


@pytest.mark.parametrize("tp,ep", LOADED)
@pytest.mark.parametrize("saved_tp,saved_ep", SAVED)
def test_experts_reshard_on_load(cpu_ranks, saved, saved_tp, saved_ep, tp, ep):
    assert all(cpu_ranks.run(_load, saved, saved_tp, saved_ep, tp, ep))


@pytest.mark.parametrize("saved_tp,saved_ep", SAVED)
def test_dense_state_and_hf_export_of_the_checkpoint(saved, tmp_path, saved_tp, saved_ep):
    from tpcore.hf.gpt_bridge.checkpoint import checkpoint_to_hf

    iteration = os.path.join(saved, f"tp{saved_tp}_ep{saved_ep}", "iter_0000002")
    config, state = load_dense_state_dict(iteration)
    want = torch.load(os.path.join(saved, f"dense_tp{saved_tp}_ep{saved_ep}.pt"))
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


def _distributed_optimizer_refused(rank, world, root):
    model, opt, grads, groups = _setup(1, 2, 0, distributed=True)
    expect_error(
        NotImplementedError,
        "torch format does not hold the distributed optimizer's slices of mixture-of-experts "
        "weights yet (use ckpt_format='torch_dist')",
        save_checkpoint,
        root,
        1,
        model,
        opt,
        consumed_samples=0,
        **groups,
    )
    return True


def test_bad_input_fails_every_rank(cpu_ranks, saved, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(saved, "tp2_ep2"), copy)
    os.remove(copy / "iter_0000002" / "experts_pp00_ep001.pt")
    assert all(cpu_ranks.run(_missing_expert_file, str(copy)))
    assert all(cpu_ranks.run(_distributed_optimizer_refused, str(tmp_path / "dist")))
    assert not (tmp_path / "dist").exists()
