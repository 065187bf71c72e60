"""Loading a checkpoint at another TP size copies only the shared index ranges: the result
equals merging every saved shard into the dense tensors and cutting this rank's piece
(computed here with plain torch.cat / chunk), for the weights and the AdamW state, and
no rank allocates a full tensor on the way."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from checks import (
    GPT_VARIANTS,
    GQA_VARIANTS,
    LargestAllocation,
    expect_error,
    gpt_rule,
    merge_pieces,
    ranks_sharing,
    setup_tp,
    slice_piece,
)
from tpcore import parallel_state
from tpcore.checkpoint import shard_reading
from tpcore.models import GPTModel
from tpcore.train import (
    CheckpointError,
    ParallelAdamW,
    load_checkpoint,
    load_dense_state_dict,
    save_checkpoint,
)

# llama: untied head, GQA, SwiGLU (every "parts" rule), fp32; gpt2: tied, bf16 (fp32 masters);
# llama_kv2: 2 KV heads, copied on 2 ranks at TP 4 (read from the first copy's file only).
CASES = {"llama": torch.float32, "gpt2": torch.bfloat16, "llama_kv2": torch.float32}
VARIANTS = {**GPT_VARIANTS, **GQA_VARIANTS}
REMAP_BYTES = shard_reading.MappedFile.REMAP_BYTES


def _make(variant: str, seed: int):
    torch.manual_seed(seed)
    config = VARIANTS[variant]
    model = GPTModel(config, dtype=CASES[variant])
    tp_group, dp_group = (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_data_parallel_group(),
    )
    opt = ParallelAdamW(
        model,
        is_replicated=lambda n: gpt_rule(n, config)[0] == "replicated",
        tp_group=tp_group,
        dp_group=dp_group,
        lr=1e-2,
        weight_decay=0.1,
    )
    return model, opt


def _save(rank, world, root, variant, tp):
    setup_tp(tp, replicas=True)
    model, opt = _make(variant, 0)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=g)
        model(ids, ids.roll(1, 1)).backward()
        opt.step(1e-2, 1.0)
    save_checkpoint(
        os.path.join(root, f"{variant}-tp{tp}"),
        2,
        model,
        opt,
        consumed_samples=4,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )


@pytest.fixture(scope="module")
def saved(cpu_ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    for variant in CASES:
        for tp in (1, 2, 4):
            cpu_ranks.run(_save, root, variant, tp)
    return root


def _reshard(rank, world, root, variant, saved_tp, tp, remap_bytes=None):
    tp_rank, tp = setup_tp(tp, replicas=True)
    directory = os.path.join(root, f"{variant}-tp{saved_tp}", "iter_0000002")
    files = [
        torch.load(os.path.join(directory, f"model_tp{r:02d}_pp00.pt"), weights_only=True)
        for r in range(saved_tp)
    ]
    model, opt = _make(variant, 9)
    config = model.config
    opened, load = [], shard_reading.load_file
    shard_reading.load_file = lambda path, mmap=False: opened.append(path) or load(path, mmap)
    if remap_bytes is not None:  # map the files afresh after every piece
        shard_reading.MappedFile.REMAP_BYTES = remap_bytes
    try:
        with LargestAllocation() as seen:
            meta = load_checkpoint(
                directory, model, opt, tp_group=parallel_state.get_tensor_model_parallel_group()
            )
    finally:
        shard_reading.load_file, shard_reading.MappedFile.REMAP_BYTES = load, REMAP_BYTES
    assert meta["tensor_parallel_size"] == saved_tp
    what = f"{variant} TP {saved_tp} -> {tp}"
    # Only the files holding a piece this rank shares are opened (again after each remap).
    full = {
        name: merge_pieces([f["model"][name] for f in files], gpt_rule(name, config), config)
        for name in files[0]["model"]
    }
    needed = {
        r
        for name in full
        for r in ranks_sharing(
            full[name].shape, gpt_rule(name, config), tp_rank, tp, saved_tp, config
        )
    }
    opened = [
        path for path in opened if os.path.basename(path).startswith("model_")
    ]  # not the RNG files
    assert set(opened) == {os.path.join(directory, f"model_tp{r:02d}_pp00.pt") for r in needed}, (
        f"{what}: opened {sorted(opened)}"
    )
    assert remap_bytes is None or len(opened) > 4 * len(needed), len(opened)
    for name, p in model.named_parameters():
        rule = gpt_rule(name, config)
        want = slice_piece(full[name], rule, tp_rank, tp, config)
        assert torch.equal(p.detach(), want.to(p.dtype)), f"{what}: {name}"
    state = opt.state_dict()["params"]
    keys = set()
    for name, entry in files[0]["optimizer"]["params"].items():
        rule = gpt_rule(name, config)
        assert set(state[name]) == set(entry), name
        for key, value in entry.items():
            keys.add(key)
            want = (
                value
                if key == "step"
                else slice_piece(
                    merge_pieces(
                        [f["optimizer"]["params"][name][key] for f in files], rule, config
                    ),
                    rule,
                    tp_rank,
                    tp,
                    config,
                )
            )
            assert torch.equal(state[name][key], want), f"{what}: optimizer {name}/{key}"
    assert keys == (
        {"exp_avg", "exp_avg_sq", "step", "master"}
        if CASES[variant] == torch.bfloat16
        else {"exp_avg", "exp_avg_sq", "step"}
    )
    local = max(t.untyped_storage().nbytes() for entry in state.values() for t in entry.values())
    assert seen.largest <= local, (
        f"{what}: a {seen.largest}-byte tensor was allocated; the largest piece has {local}"
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("saved_tp", [1, 2, 4])
@pytest.mark.parametrize("variant", list(CASES))
def test_sliced_reshard_equals_merge_then_shard(cpu_ranks, saved, variant, saved_tp, tp):
    cpu_ranks.run(_reshard, saved, variant, saved_tp, tp)


@pytest.mark.parametrize("saved_tp,tp", [(1, 4), (4, 2)])
def test_reshard_with_the_files_mapped_afresh_after_every_piece(cpu_ranks, saved, saved_tp, tp):
    cpu_ranks.run(_reshard, saved, "llama", saved_tp, tp, 1)


@pytest.mark.parametrize("saved_tp", [1, 4])
def test_load_dense_state_dict_equals_the_merge(saved, saved_tp):
    directory = os.path.join(saved, f"llama-tp{saved_tp}", "iter_0000002")
    files = [
        torch.load(os.path.join(directory, f"model_tp{r:02d}_pp00.pt"), weights_only=True)["model"]
        for r in range(saved_tp)
    ]
    config, state = load_dense_state_dict(directory)
    assert set(state) == set(files[0])
    for name, got in state.items():
        assert torch.equal(
            got, merge_pieces([f[name] for f in files], gpt_rule(name, config), config)
        ), name


def _bad_piece(rank, world, path):
    setup_tp(2, replicas=True)
    model, opt = _make("llama", 0)
    expect_error(
        CheckpointError,
        (
            "model_tp00_pp00.pt: model parameter layers.0.mlp.fc1.weight: "
            "piece of rank 0 of 1 has shape [96, 64]"
        ),
        load_checkpoint,
        path,
        model,
        opt,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
    )
    dist.barrier()  # nothing above ran a collective: every rank raised alike


def test_a_piece_of_the_wrong_shape_names_file_and_parameter(cpu_ranks, saved, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(os.path.join(saved, "llama-tp1", "iter_0000002"), bad)
    state = torch.load(os.path.join(bad, "model_tp00_pp00.pt"), weights_only=True)
    state["model"]["layers.0.mlp.fc1.weight"] = state["model"]["layers.0.mlp.fc1.weight"][
        :96
    ].clone()
    torch.save(state, os.path.join(bad, "model_tp00_pp00.pt"))
    _record_checksum(
        bad, "model_tp00_pp00.pt"
    )  # consistent on disk: the shape check is what must catch it
    cpu_ranks.run(_bad_piece, bad)


def _record_checksum(directory: str, name: str) -> None:
    """Make the metadata record the file's current size and CRC-32 (as a buggy writer would)."""
    import json

    from tpcore.checkpoint.integrity import file_checksum

    with open(os.path.join(directory, "metadata.json")) as f:
        meta = json.load(f)
    meta["files"][name] = file_checksum(os.path.join(directory, name))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump(meta, f)


def _as_format_1(directory: str, out: str) -> str:
    """A copy of a TP-only checkpoint in format 1: files model_tpRR.pt, no pipeline fields."""
    import json
    import shutil

    shutil.copytree(directory, out)
    for name in os.listdir(out):
        if name.startswith("model_"):
            os.rename(os.path.join(out, name), os.path.join(out, name.replace("_pp00", "")))
    with open(os.path.join(out, "metadata.json")) as f:
        meta = json.load(f)
    meta["version"] = 1
    for key in (
        "pipeline_parallel_size",
        "virtual_pipeline_parallel_size",
        "pipeline_stage_layers",
    ):
        del meta[key]
    with open(os.path.join(out, "metadata.json"), "w") as f:
        json.dump(meta, f)
    return out


def _load_formats(rank, world, v1, v2, tp):
    setup_tp(tp, replicas=True)
    group = parallel_state.get_tensor_model_parallel_group()
    (a, opt_a), (b, opt_b) = _make("llama", 5), _make("llama", 6)
    rng = []
    for path, model, opt in ((v2, a, opt_a), (v1, b, opt_b)):
        torch.manual_seed(0)
        load_checkpoint(path, model, opt, tp_group=group)
        rng.append(torch.get_rng_state())
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    state_a, state_b = opt_a.state_dict()["params"], opt_b.state_dict()["params"]
    for name, entry in state_a.items():
        assert all(torch.equal(value, state_b[name][key]) for key, value in entry.items()), name
    assert torch.equal(rng[0], rng[1]) and (tp == 2) == (
        not torch.equal(rng[0], torch.manual_seed(0).get_state())
    )  # restored at TP 2 only


def test_format_1_checkpoints_still_load(cpu_ranks, saved, tmp_path):
    v2 = os.path.join(saved, "llama-tp2", "iter_0000002")
    v1 = _as_format_1(v2, str(tmp_path / "v1"))
    assert sorted(n for n in os.listdir(v1) if n.startswith("model_")) == [
        "model_tp00.pt",
        "model_tp01.pt",
    ]
    for tp in (2, 4):
        cpu_ranks.run(_load_formats, v1, v2, tp)
    (_, dense_v1), (_, dense_v2) = load_dense_state_dict(v1), load_dense_state_dict(v2)
    assert (
        all(torch.equal(t, dense_v2[name]) for name, t in dense_v1.items())
        and dense_v1.keys() == dense_v2.keys()
    )


def test_unknown_format_version_is_refused(saved, tmp_path):
    import json
    import shutil

    bad = str(tmp_path / "v5")
    shutil.copytree(os.path.join(saved, "llama-tp1", "iter_0000002"), bad)
    with open(os.path.join(bad, "metadata.json")) as f:
        meta = json.load(f)
    with open(os.path.join(bad, "metadata.json"), "w") as f:
        json.dump({**meta, "version": 6}, f)
    with pytest.raises(
        CheckpointError, match="of version 6; this tpcore reads versions 1, 2, 3, 4, 5"
    ):
        load_dense_state_dict(bad)
