"""Unit tests of tpcore.train's checkpoints on the rank pool (world 4 = TP 2 x DP 2):
round trip, atomic leftovers, clear errors, loading at other TP sizes, the dense state dict."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist

from checks import GPT_VARIANTS as VARIANTS
from checks import GQA_VARIANTS, expect_error, param_specs, setup_tp
from tpcore.models import GPTModel, ReferenceGPT
from tpcore.tensor_parallel.shard_spec import unshard
from tpcore.train import CheckpointError, load_checkpoint, load_dense_state_dict, save_checkpoint
from train_checks import CLIP, LRS, make_adamw, tp_dp_groups, train_batch

# ---------------------------------------------------------------------------------------
# Checkpoints (rank pool: world 4 = TP 2 x DP 2)
# ---------------------------------------------------------------------------------------

CKPT_CONFIG = VARIANTS["llama"]


def _make(config, seed):
    torch.manual_seed(seed)
    model = GPTModel(config)
    return model, make_adamw(model, config)


def _train_steps(model, opt, steps, first=0):
    for step in range(first, first + steps):
        ids, target = train_batch(10 + step, model.config)
        model(ids, target).backward()
        opt.step(LRS[step % len(LRS)], CLIP)


def _dense_optimizer_state(opt, model):
    out, specs = {}, param_specs(model)
    for name, entry in opt.state_dict()["params"].items():
        for key, value in entry.items():
            out[f"{name}/{key}"] = value.clone() if key == "step" else unshard(value, specs[name])
    return out


def _barrier_after(rank, fn):
    if rank == 0:
        fn()
    dist.barrier()


def _ckpt_save_and_errors(rank, world, root):
    setup_tp(2, replicas=True)
    tp_group, dp_group = tp_dp_groups()
    config = CKPT_CONFIG
    save = os.path.join(root, "save")
    model, opt = _make(config, 0)
    _train_steps(model, opt, 2)
    path = save_checkpoint(
        save,
        2,
        model,
        opt,
        consumed_samples=8,
        tp_group=tp_group,
        dp_group=dp_group,
        extra={"note": "unit"},
    )
    assert path == os.path.join(save, "iter_0000002")
    if rank == 0:
        assert sorted(os.listdir(path)) == [
            "metadata.json",
            "model_tp00_pp00.pt",
            "model_tp01_pp00.pt",
        ] + [f"rng_rank{r:05d}.pt" for r in range(4)]
        ref = {"model": {n: p.detach().clone() for n, p in model.to_dense().named_parameters()}}
    else:
        model.to_dense()  # a collective
    ref_opt = _dense_optimizer_state(opt, model)
    if rank == 0:
        ref["optimizer"] = ref_opt
        torch.save(ref, os.path.join(root, "dense_ref.pt"))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())

    # Round trip into a freshly initialised model and optimizer.
    model2, opt2 = _make(config, 1)
    assert not torch.equal(
        model2.layers[0].attention.qkv.weight, model.layers[0].attention.qkv.weight
    )
    meta = load_checkpoint(save, model2, opt2, tp_group=tp_group)
    assert (
        meta["iteration"],
        meta["consumed_samples"],
        meta["note"],
        meta["tensor_parallel_size"],
    ) == (2, 8, "unit", 2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_model[k]), k
    loaded = opt2.state_dict()["params"]
    assert set(loaded) == set(saved_opt["params"])
    for name, entry in saved_opt["params"].items():
        assert set(loaded[name]) == set(entry) == {"exp_avg", "exp_avg_sq", "step"}, (
            name,
            set(loaded[name]),
        )
        for key, value in entry.items():
            assert torch.equal(loaded[name][key], value), (name, key)
    _train_steps(model, opt, 1, first=2)  # the restored state continues identically
    _train_steps(model2, opt2, 1, first=2)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), f"step after restore differs: {n}"

    # A save killed before its rename leaves iter_N.tmp/: load ignores it, the next save removes it.
    leftover = os.path.join(save, "iter_0000009.tmp")

    def make_leftover():
        os.makedirs(leftover)
        with open(os.path.join(leftover, "model_tp00_pp00.pt"), "wb") as f:
            f.write(b"partial")

    _barrier_after(rank, make_leftover)
    model3, opt3 = _make(config, 2)
    assert load_checkpoint(save, model3, opt3, tp_group=tp_group)["iteration"] == 2
    save_checkpoint(save, 3, model, opt, consumed_samples=12, tp_group=tp_group, dp_group=dp_group)
    assert not os.path.exists(leftover)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000003", "latest"]
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000003"

    # `latest` naming a directory that is not there, and a directory with no checkpoint.
    dangling, empty = os.path.join(root, "dangling"), os.path.join(root, "empty")

    def make_dangling():
        os.makedirs(dangling)
        os.makedirs(empty)
        with open(os.path.join(dangling, "latest"), "w") as f:
            f.write("iter_0000042\n")

    _barrier_after(rank, make_dangling)
    expect_error(
        CheckpointError,
        "not a complete checkpoint",
        load_checkpoint,
        dangling,
        model3,
        opt3,
        tp_group=tp_group,
    )
    expect_error(
        CheckpointError, "no checkpoint in", load_checkpoint, empty, model3, opt3, tp_group=tp_group
    )

    # A truncated shard: every rank reads it (TP rank 1 for the replicated parameters) and names it.
    corrupt = os.path.join(root, "corrupt")
    bad_file = os.path.join(corrupt, "model_tp00_pp00.pt")

    def make_corrupt():
        shutil.copytree(path, corrupt)
        size = os.path.getsize(bad_file)
        with open(bad_file, "r+b") as f:
            f.truncate(size // 2)

    _barrier_after(rank, make_corrupt)
    expect_error(
        CheckpointError,
        f"{bad_file} is corrupt",
        load_checkpoint,
        corrupt,
        model3,
        opt3,
        tp_group=tp_group,
    )

    # Another model shape: every differing field is listed.
    narrow = GPTModel(dataclasses.replace(config, hidden_size=32))
    expect_error(
        CheckpointError,
        "hidden_size: checkpoint 64, model 32",
        load_checkpoint,
        path,
        narrow,
        tp_group=tp_group,
    )
    scaled = GPTModel(
        dataclasses.replace(config, embedding_scale=8.0)
    )  # the same shapes, another function
    expect_error(
        CheckpointError,
        "embedding_scale: checkpoint None, model 8.0",
        load_checkpoint,
        path,
        scaled,
        tp_group=tp_group,
    )
    dist.barrier()


@pytest.fixture(scope="module")
def tp2_checkpoint(cpu_ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    cpu_ranks.run(_ckpt_save_and_errors, root)
    return root


def test_checkpoint_round_trip_and_errors(tp2_checkpoint):
    assert os.path.isfile(os.path.join(tp2_checkpoint, "dense_ref.pt"))


def _ckpt_reshard(rank, world, root, tp):
    setup_tp(tp, replicas=True)
    tp_group, _ = tp_dp_groups()
    config = CKPT_CONFIG
    model, opt = _make(config, 3)
    meta = load_checkpoint(
        os.path.join(root, "save", "iter_0000002"), model, opt, tp_group=tp_group
    )
    assert meta["tensor_parallel_size"] == 2 and meta["iteration"] == 2
    ref = torch.load(os.path.join(root, "dense_ref.pt"))
    dense = dict(model.to_dense().named_parameters())
    assert set(dense) == set(ref["model"])
    for name, want in ref["model"].items():
        assert torch.equal(dense[name].detach(), want), f"TP={tp}: {name}"
    got = _dense_optimizer_state(opt, model)
    assert set(got) == set(ref["optimizer"])
    for key, want in ref["optimizer"].items():
        assert torch.equal(got[key], want), f"TP={tp}: optimizer {key}"


@pytest.mark.parametrize("tp", [1, 4])
def test_tp2_checkpoint_loads_at_other_tp_sizes(cpu_ranks, tp2_checkpoint, tp):
    cpu_ranks.run(_ckpt_reshard, tp2_checkpoint, tp)


def test_load_dense_state_dict(tp2_checkpoint):
    config, state = load_dense_state_dict(os.path.join(tp2_checkpoint, "save", "iter_0000002"))
    assert config == CKPT_CONFIG
    ref = torch.load(os.path.join(tp2_checkpoint, "dense_ref.pt"))["model"]
    assert set(state) == set(ref)
    for name, want in ref.items():
        assert torch.equal(state[name], want), name
    ReferenceGPT(config).load_state_dict(state)  # the names and shapes of the dense model


def _torch_dist_round_trip(rank, world, root):
    """The torch_dist format at TP 2 x DP 2 with one KV head (copied on both TP ranks):
    exact round trip of weights and AdamW state; torch's `dcp_to_torch_save`,
    `load_dense_state_dict` and the Hugging Face export give the dense model; a damaged
    DCP file is named on every rank before anything is loaded."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tpcore.hf.gpt_bridge.checkpoint import checkpoint_to_hf

    setup_tp(2, replicas=True)
    tp_group, dp_group = tp_dp_groups()
    config = GQA_VARIANTS["llama_kv1"]
    model, opt = _make(config, 0)
    _train_steps(model, opt, 2)
    save = lambda d, fmt: save_checkpoint(  # noqa: E731
        os.path.join(root, d),
        2,
        model,
        opt,
        consumed_samples=8,
        tp_group=tp_group,
        dp_group=dp_group,
        ckpt_format=fmt,
    )
    path, torch_path = save("dist", "torch_dist"), save("plain", "torch")
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    dense = {n: p.detach().clone() for n, p in model.to_dense().named_parameters()}
    dense_opt = _dense_optimizer_state(opt, model)

    model2, opt2 = _make(config, 1)
    with torch.no_grad():  # what a model built without init may hold, vocabulary padding too
        for p in model2.parameters():
            p.fill_(float("nan"))
    meta = load_checkpoint(path, model2, opt2, tp_group=tp_group)
    assert (meta["version"], meta["ckpt_format"], meta["iteration"]) == (5, "torch_dist", 2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_model[k]), k
    for name, entry in saved_opt["params"].items():
        for key, value in entry.items():
            assert torch.equal(opt2.state_dict()["params"][name][key], value), (name, key)

    if rank == 0:
        files = sorted(os.listdir(path))
        assert set(meta["files"]) == set(files) - {"metadata.json"}, files
        assert ".metadata" in files and any(f.endswith(".distcp") for f in files), files
        dcp_to_torch_save(path, os.path.join(root, "dense.pt"))
        converted = torch.load(os.path.join(root, "dense.pt"))
        assert set(converted["model"]) == set(dense), sorted(converted["model"])
        for name, want in dense.items():
            assert torch.equal(converted["model"][name], want), name
        for key, want in dense_opt.items():
            name, state = key.split("/")
            got = converted["optimizer"]["state"][name][state]
            assert torch.equal(got, want), key
        config_read, state = load_dense_state_dict(path)
        assert config_read == config and set(state) == set(dense)
        for name, want in dense.items():
            assert torch.equal(state[name], want), name
        # tpcore-convert reads it as well.
        from tpcore.train.convert import load_dense_gpt
        from tpcore.train.convert import main as convert

        assert convert(["--load", path, "--output", os.path.join(root, "dense.safetensors")]) == 0
        exported, _ = load_dense_gpt(os.path.join(root, "dense.safetensors"))
        for name, got in exported.state_dict().items():
            assert torch.equal(got, dense[name]), name
        # The Hugging Face export reads both formats alike.
        import safetensors.torch

        for fmt, source in (("dist", path), ("plain", torch_path)):
            checkpoint_to_hf(source, os.path.join(root, f"hf_{fmt}"))
        a = safetensors.torch.load_file(os.path.join(root, "hf_dist", "model.safetensors"))
        b = safetensors.torch.load_file(os.path.join(root, "hf_plain", "model.safetensors"))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        # A damaged DCP file.
        shutil.copytree(path, os.path.join(root, "damaged"))
        victim = sorted(f for f in files if f.endswith(".distcp"))[-1]
        with open(os.path.join(root, "damaged", victim), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    model3, opt3 = _make(config, 2)
    before = {k: v.clone() for k, v in model3.state_dict().items()}
    expect_error(
        CheckpointError,
        "is corrupt: CRC-32",
        load_checkpoint,
        os.path.join(root, "damaged"),
        model3,
        opt3,
        tp_group=tp_group,
    )
    for k, v in model3.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was written by a refused load"


def test_torch_dist_round_trip_dense_and_damage(cpu_ranks, tmp_path):
    cpu_ranks.run(_torch_dist_round_trip, str(tmp_path))


def _weights_only_checkpoint_restarts_the_optimizer(rank, world, root):
    """bf16 weights loaded from a checkpoint without optimizer state: the fp32 masters must
    follow them, or the next step writes the old masters back over the loaded weights."""
    setup_tp(2, replicas=True)
    tp_group, dp_group = tp_dp_groups()
    config = CKPT_CONFIG
    torch.manual_seed(0)
    saved_model = GPTModel(config, dtype=torch.bfloat16)
    save = os.path.join(root, "weights_only")
    save_checkpoint(
        save, 1, saved_model, None, consumed_samples=0, tp_group=tp_group, dp_group=dp_group
    )
    torch.manual_seed(1)
    model = GPTModel(config, dtype=torch.bfloat16)
    opt = make_adamw(model, config)
    opt.step(LRS[0], CLIP)  # moments and masters of the old weights
    load_checkpoint(save, model, opt, tp_group=tp_group)
    assert not opt.adam.state, "the old weights' AdamW moments survived the load"
    ids, target = train_batch(0, config)
    model(ids, target).backward()
    opt.step(0.0, CLIP)  # lr 0, no weight decay effect: the weights must stay as loaded
    for (name, got), want in zip(model.named_parameters(), saved_model.parameters()):
        assert torch.equal(got.detach(), want.detach()), (
            f"{name} moved away from the loaded weights"
        )


def test_weights_only_checkpoint_restarts_the_optimizer(cpu_ranks, tmp_path):
    cpu_ranks.run(_weights_only_checkpoint_restarts_the_optimizer, str(tmp_path))


def _save_failure_and_missing_rng_fail_every_rank(rank, world, root):
    setup_tp(2, replicas=True)
    tp_group, dp_group = tp_dp_groups()
    model, opt = _make(CKPT_CONFIG, 0)
    # A save directory that cannot be made (a file stands there): rank 0 fails to prepare it.
    blocked = os.path.join(root, "blocked")
    if rank == 0:
        open(blocked, "w").close()
    dist.barrier()
    start = time.monotonic()
    error = (
        f"creating {blocked} failed: EEXIST"
        if rank == 0
        else "preparing failed on rank(s) [0]: rank 0:"
    )
    try:
        save_checkpoint(
            blocked, 1, model, opt, consumed_samples=0, tp_group=tp_group, dp_group=dp_group
        )
    except CheckpointError as e:  # every rank names the path and the cause
        assert (
            error in str(e)
            and f"{blocked} failed: EEXIST (File exists): a file stands where a folder should be"
            in str(e)
        ), e
    else:
        raise AssertionError("saving into a file did not raise")
    assert time.monotonic() - start < 20, "the other ranks waited for the failed one"
    # A missing RNG file of one rank: every rank raises, none goes on into training.
    save = os.path.join(root, "ok")
    path = save_checkpoint(
        save, 1, model, opt, consumed_samples=0, tp_group=tp_group, dp_group=dp_group
    )
    _barrier_after(rank, lambda: os.remove(os.path.join(path, "rng_rank00003.pt")))
    error = "rng_rank00003.pt is missing" if rank == 3 else "failed on rank(s) [3]"
    expect_error(CheckpointError, error, load_checkpoint, save, model, opt, tp_group=tp_group)
    dist.barrier()


def test_save_failure_and_missing_rng_fail_every_rank(cpu_ranks, tmp_path):
    cpu_ranks.run(_save_failure_and_missing_rng_fail_every_rank, str(tmp_path))
