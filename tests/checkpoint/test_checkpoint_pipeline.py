"""Checkpoints of pipeline-parallel runs: one file per (TP, PP) rank with the tied embedding
stored once, loaded at other TP x PP x virtual-stage layouts. The loaded weights and every
AdamW tensor equal the dense merge of the saved files (plain torch.cat here) cut into this
rank's pieces; each rank opens only the files holding pieces it shares, allocates no full
tensor, and restores its RNG only when the layout is unchanged. A file that fails on some
ranks makes every rank raise."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import (
    GPT_VARIANTS,
    LargestAllocation,
    expect_error,
    gpt_rule,
    merge_pieces,
    ranks_sharing,
    slice_piece,
)
from tpcore import parallel_state
from tpcore.checkpoint import shard_reading
from tpcore.pipeline_parallel import (
    activation_shape,
    build_gpt_stages,
    duplicate_parameter_names,
    finalize_model_grads,
    forward_backward,
    gpt_forward_step,
    sync_tied_embeddings,
)
from tpcore.train import (
    CheckpointError,
    ParallelAdamW,
    load_checkpoint,
    load_dense_state_dict,
    save_checkpoint,
)

# llama: untied head, fp32; gpt2: tied embedding (on the first and last stage), bf16 with
# fp32 masters.
CASES = {"llama": torch.float32, "gpt2": torch.bfloat16}
MICRO, SEQ, M = 2, 8, 4
LAYOUTS = {
    "tp2pp2": (2, 2, 1),
    "tp1pp1": (1, 1, 1),
    "tp1pp2v2": (1, 2, 2),
}  # saved: (TP, PP, chunks per rank)


def _config(variant: str):
    return dataclasses.replace(GPT_VARIANTS[variant], num_layers=4)


def _build(variant: str, tp: int, pp: int, v: int, seed: int):
    """This rank's chunks and their ParallelAdamW at TP x PP (x v), initialised from `seed`."""
    tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    config, s = _config(variant), parallel_state.get_parallel_state()
    torch.manual_seed(seed)
    chunks = build_gpt_stages(config, num_model_chunks=v, dtype=CASES[variant])
    sync_tied_embeddings(chunks)
    opt = ParallelAdamW(
        chunks,
        is_replicated=lambda n: gpt_rule(n, config)[0] == "replicated",
        tp_group=s.tensor_group,
        dp_group=s.data_group,
        pp_group=s.pipeline_group,
        duplicates=duplicate_parameter_names(chunks),
        lr=1e-2,
        weight_decay=0.1,
    )
    return chunks, opt, s


def _save(rank, world, root, variant, layout):
    tp, pp, v = LAYOUTS[layout]
    chunks, opt, s = _build(variant, tp, pp, v, seed=0)
    g = torch.Generator().manual_seed(1 + dist.get_rank(s.data_group))
    for _ in range(2):  # AdamW state to save
        batches = [
            (ids, ids.roll(1, 1))
            for ids in (torch.randint(0, 50, (MICRO, SEQ), generator=g) for _ in range(M))
        ]
        forward_backward(
            gpt_forward_step(chunks, batches),
            num_micro_batches=M,
            tensor_shape=activation_shape(chunks[0].config, MICRO, SEQ, tp),
            dtype=CASES[variant],
            schedule="interleaved" if v > 1 else "1f1b",
            num_model_chunks=v,
        )
        finalize_model_grads(chunks)
        opt.step(1e-2, 1.0)
    save_checkpoint(
        os.path.join(root, f"{variant}-{layout}"),
        2,
        chunks,
        opt,
        consumed_samples=2,
        tp_group=s.tensor_group,
        dp_group=s.data_group,
        pp_group=s.pipeline_group,
    )


@pytest.fixture(scope="module")
def saved(cpu_ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pp-ckpt"))
    for variant in CASES:
        for layout in LAYOUTS:
            cpu_ranks.run(_save, root, variant, layout)
    return root


def _saved_files(directory: str) -> dict[tuple[int, int], dict]:
    """Every model file, read whole, by (TP rank, PP rank) parsed from its name."""
    files = {}
    for name in os.listdir(directory):
        if name.startswith("model_tp"):
            tp_rank, pp_rank = int(name[8:10]), int(name[13:15])
            files[tp_rank, pp_rank] = torch.load(os.path.join(directory, name), weights_only=True)
    return files


def _dense_merge(files: dict, config) -> tuple[dict, dict, dict]:
    """(full weights, full optimizer tensors by "name/key" and the step, PP rank of each name)
    merged from the files by plain concatenation; asserts every parameter is stored by
    exactly one pipeline rank (the tied embedding by the first)."""
    tp = 1 + max(t for t, _ in files)
    owner = {}
    for (t, p), state in files.items():
        for name in state["model"]:
            assert owner.setdefault(name, p) == p, (
                f"{name} is stored by pipeline ranks {owner[name]} and {p}"
            )
    assert owner["embedding.word.weight"] == 0
    weights, moments = {}, {}
    for name, p in owner.items():
        rule = gpt_rule(name, config)
        weights[name] = merge_pieces([files[t, p]["model"][name] for t in range(tp)], rule, config)
        for key, value in files[0, p]["optimizer"]["params"][name].items():
            moments[f"{name}/{key}"] = (
                value
                if key == "step"
                else merge_pieces(
                    [files[t, p]["optimizer"]["params"][name][key] for t in range(tp)], rule, config
                )
            )
    return weights, moments, owner


def _load(rank, world, root, variant, layout, tp, pp, v):
    directory = os.path.join(root, f"{variant}-{layout}", "iter_0000002")
    saved_tp, saved_pp, saved_v = LAYOUTS[layout]
    chunks, opt, s = _build(variant, tp, pp, v, seed=9)
    config, tp_rank = chunks[0].config, dist.get_rank(s.tensor_group)
    files = _saved_files(directory)
    assert len(files) == saved_tp * saved_pp
    weights, moments, owner = _dense_merge(files, config)
    opened, load = [], shard_reading.load_file
    shard_reading.load_file = lambda path, mmap=False: (
        opened.append(os.path.basename(path)) or load(path, mmap)
    )
    torch.manual_seed(77)
    before = torch.get_rng_state()
    try:
        with LargestAllocation() as seen:
            meta = load_checkpoint(
                directory, chunks, opt, tp_group=s.tensor_group, pp_group=s.pipeline_group
            )
    finally:
        shard_reading.load_file = load
    assert (
        meta["tensor_parallel_size"],
        meta["pipeline_parallel_size"],
        meta["virtual_pipeline_parallel_size"],
    ) == (saved_tp, saved_pp, saved_v)
    what = f"{variant} {layout} -> TP{tp} x PP{pp} x v{v}"
    mine = {name: p for chunk in chunks for name, p in chunk.named_parameters()}
    for name, p in mine.items():  # the last stage's tied copy too: from the first stage's file
        assert torch.equal(
            p.detach(), slice_piece(weights[name], gpt_rule(name, config), tp_rank, tp, config)
        ), f"{what}: {name}"
    state = opt.state_dict()["params"]
    assert set(state) == set(mine)
    for name, entry in state.items():
        assert set(entry) == {key.split("/")[1] for key in moments if key.split("/")[0] == name}, (
            f"{what}: {name} keys {set(entry)}"
        )
        for key, got in entry.items():
            want = moments[f"{name}/{key}"]
            want = (
                want
                if key == "step"
                else slice_piece(want, gpt_rule(name, config), tp_rank, tp, config)
            )
            assert torch.equal(got, want), f"{what}: optimizer {name}/{key}"
    # Only the files holding a piece this rank shares were opened; no full tensor was made.
    needed = {
        f"model_tp{t:02d}_pp{owner[name]:02d}.pt"
        for name in mine
        for t in ranks_sharing(
            weights[name].shape, gpt_rule(name, config), tp_rank, tp, saved_tp, config
        )
    }
    assert {name for name in opened if name.startswith("model_")} == needed, (
        f"{what}: opened {sorted(opened)}, needed {sorted(needed)}"
    )
    local = max(t.untyped_storage().nbytes() for entry in state.values() for t in entry.values())
    assert seen.largest <= local, (
        f"{what}: a {seen.largest}-byte tensor was allocated; the largest piece has {local}"
    )
    same_layout = (tp, pp, v) == (saved_tp, saved_pp, saved_v) and world == meta["world_size"]
    rng = torch.load(
        os.path.join(directory, f"rng_rank{dist.get_rank():05d}.pt"), weights_only=True
    )["cpu"]
    assert torch.equal(torch.get_rng_state(), rng if same_layout else before), (
        f"{what}: RNG restored: {not same_layout}"
    )
    return sorted(needed)


@pytest.mark.parametrize("variant", list(CASES))
@pytest.mark.parametrize(
    "layout,tp,pp,v",
    [
        ("tp2pp2", 2, 2, 1),  # round trip: the same layout, RNG restored
        ("tp2pp2", 1, 1, 1),
        ("tp1pp1", 1, 4, 1),
        ("tp2pp2", 1, 2, 1),
        ("tp2pp2", 1, 2, 2),
        ("tp1pp2v2", 4, 1, 1),
    ],
)
def test_reshard_equals_dense_merge_then_shard(cpu_ranks, saved, variant, layout, tp, pp, v):
    opened = cpu_ranks.run(_load, saved, variant, layout, tp, pp, v)
    if (layout, tp, pp, v) == (
        "tp2pp2",
        1,
        2,
        1,
    ):  # stage 0 reads the first stage's files; stage 1 its own (and the tied embedding)
        first, last = (
            ["model_tp00_pp00.pt", "model_tp01_pp00.pt"],
            ["model_tp00_pp01.pt", "model_tp01_pp01.pt"],
        )
        assert opened[0] == first and opened[2] == (
            sorted(first + last) if variant == "gpt2" else last
        ), opened


def test_files_hold_their_stage_and_the_tied_embedding_once(saved):
    files = _saved_files(os.path.join(saved, "gpt2-tp1pp2v2", "iter_0000002"))
    # Interleaved: rank 0 holds virtual stages 0 and 2 (layers 0 and 2), rank 1 stages 1 and 3.
    layers = {
        p: sorted({int(n.split(".")[1]) for n in files[0, p]["model"] if n.startswith("layers.")})
        for p in (0, 1)
    }
    assert layers == {0: [0, 2], 1: [1, 3]}, layers
    assert (
        "embedding.word.weight" in files[0, 0]["model"]
        and "embedding.word.weight" not in files[0, 1]["model"]
    )
    assert (
        "embedding.word.weight" not in files[0, 1]["optimizer"]["params"]
        and "final_norm.weight" in files[0, 1]["model"]
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_dense_state_dict_equals_the_merge(saved, layout):
    directory = os.path.join(saved, f"gpt2-{layout}", "iter_0000002")
    config, dense = load_dense_state_dict(directory)
    weights, _, _ = _dense_merge(_saved_files(directory), config)
    assert dense.keys() == weights.keys()
    assert all(torch.equal(t, weights[name]) for name, t in dense.items())


def _broken(rank, world, directory, match_here, match_elsewhere, failing_rank):
    chunks, opt, s = _build("llama", 2, 2, 1, seed=3)
    match = match_here if failing_rank in (None, dist.get_rank()) else match_elsewhere
    expect_error(
        CheckpointError,
        match,
        load_checkpoint,
        directory,
        chunks,
        opt,
        tp_group=s.tensor_group,
        pp_group=s.pipeline_group,
    )
    dist.barrier()  # every rank raised, none is left in a collective


def test_a_missing_or_corrupt_file_fails_every_rank(cpu_ranks, saved, tmp_path):
    import shutil

    directory = str(tmp_path / "broken")
    shutil.copytree(os.path.join(saved, "llama-tp2pp2", "iter_0000002"), directory)
    os.rename(os.path.join(directory, "model_tp01_pp01.pt"), os.path.join(tmp_path, "aside.pt"))
    cpu_ranks.run(_broken, directory, "is incomplete: model_tp01_pp01.pt missing", "", None)
    # Corrupt: only global rank 3 (TP rank 1 of the last stage) reads this file.
    with open(os.path.join(directory, "model_tp01_pp01.pt"), "wb") as f:
        f.write(b"not a checkpoint")
    cpu_ranks.run(_broken, directory, "model_tp01_pp01.pt is corrupt", "failed on rank(s) [3]", 3)
