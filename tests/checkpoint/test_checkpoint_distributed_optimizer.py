"""Checkpoints of the distributed optimizer: written sharded over DP (each DP rank its own
file, no gather), resumed at another (TP, PP, DP) layout, with or without the distributed
optimizer, in either direction, continuing the uninterrupted run's loss curve and ending
at its weights; the optimizer files' checksums and identities are checked like the shards'."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import assert_close
from dp_checks import BASELINE, BUFFERS, DISTRIBUTED, DISTRIBUTED_OVERLAP, Run, config_for, groups
from tpcore.train import CheckpointError, load_checkpoint, save_checkpoint

GLOBAL_MICRO = 4  # micro-batches per global batch, split over the DP ranks
STEPS, SAVED_AT = 4, 2
LRS = [1e-2, 5e-3, 2e-2, 1e-2]
OPTIONS = {
    "plain": BASELINE,
    "buffers": BUFFERS,
    "distributed": DISTRIBUTED,
    "distributed+overlap": DISTRIBUTED_OVERLAP,
}


def _micro_batches(config, step: int):
    """This DP rank's share of step `step`'s global batch (the same samples at any DP size)."""
    g = torch.Generator().manual_seed(step)
    all_micro = [
        (
            torch.randint(0, config.vocab_size, (2, 8), generator=g),
            torch.randint(0, config.vocab_size, (2, 8), generator=g),
        )
        for _ in range(GLOBAL_MICRO)
    ]
    dp_group = groups()[1]
    dp, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    return all_micro[rank * GLOBAL_MICRO // dp : (rank + 1) * GLOBAL_MICRO // dp]


def _layout(tp: int, pp: int) -> None:
    tpcore.destroy_model_parallel()
    tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)


def _train(run: Run, steps: range) -> list[float]:
    return [run.step(_micro_batches(run.config, s), LRS[s], 0.05)[0] for s in steps]


def _weights(run: Run) -> dict[str, torch.Tensor]:
    """This rank's pieces (the reference and the resumed run share the loading layout)."""
    run.opt.finish_param_sync()
    return {n: p.detach().clone() for c in run.chunks for n, p in c.named_parameters()}


def _resume(
    rank, world, root, save_layout, save_options, load_layout, load_options, ckpt_format, variant
):
    config = config_for(variant, 4)
    # Uninterrupted at the saving layout, saving at step 2.
    _layout(*save_layout)
    run = Run(config, OPTIONS[save_options])
    curve = _train(run, range(SAVED_AT))
    tp_group, dp_group, pp_group = groups()
    path = save_checkpoint(
        root,
        SAVED_AT,
        run.chunks,
        run.opt,
        consumed_samples=0,
        tp_group=tp_group,
        dp_group=dp_group,
        pp_group=pp_group,
        ckpt_format=ckpt_format,
    )
    curve += _train(run, range(SAVED_AT, STEPS))
    files = sorted(os.listdir(path))
    # Uninterrupted at the loading layout: the same function (layouts differ only by
    # rounding), for the weights.
    _layout(*load_layout)
    reference = Run(config, OPTIONS[load_options])
    assert all(
        math.isclose(a, b, rel_tol=1e-5) for a, b in zip(_train(reference, range(STEPS)), curve)
    )
    want = _weights(reference)
    # Resumed at the loading layout.
    resumed = Run(config, OPTIONS[load_options])
    tp_group, dp_group, pp_group = groups()
    load_checkpoint(path, resumed.chunks, resumed.opt, tp_group=tp_group, pp_group=pp_group)
    tail = _train(resumed, range(SAVED_AT, STEPS))
    for step, (got, expected) in enumerate(zip(tail, curve[SAVED_AT:]), SAVED_AT + 1):
        assert math.isclose(got, expected, rel_tol=1e-5), (
            f"step {step}: resumed loss {got}, uninterrupted {expected}"
        )
    got = _weights(resumed)
    for name, value in want.items():
        assert_close(
            got[name],
            value,
            f"{save_options} {save_layout} -> {load_options} {load_layout}: {name}",
        )
    return files


@pytest.mark.parametrize(
    "save_layout,save_options,load_layout,load_options,ckpt_format,variant",
    [
        ((2, 1), "distributed", (1, 1), "distributed+overlap", "torch", "gpt2"),  # DP 2 -> DP 4
        ((2, 1), "distributed+overlap", (4, 1), "distributed", "torch", "gpt2"),  # DP 2 -> DP 1
        ((2, 1), "distributed", (2, 1), "plain", "torch", "gpt2"),  # without it
        ((2, 1), "plain", (1, 1), "distributed", "torch", "gpt2"),  # a plain one, continued
        # PP 2 x DP 2 (tied embedding across stages) -> DP 4
        ((1, 2), "distributed+overlap", (1, 1), "buffers", "torch", "gpt2"),
        # torch_dist: TP 2 x DP 2 slices -> TP 1 x PP 2 x DP 2 without the distributed optimizer
        ((2, 1), "distributed", (1, 2), "plain", "torch_dist", "gpt2"),
        # torch_dist: PP 2 x DP 2, tied embedding, one KV head -> TP 4 (the head copied on
        # every rank, read into each rank's slices)
        ((1, 2), "distributed+overlap", (4, 1), "distributed", "torch_dist", "gemma"),
        # torch_dist: TP 2 x PP 2, one KV head copied over TP -> DP 4 slices
        ((2, 2), "plain", (1, 1), "distributed", "torch_dist", "llama_kv1"),
    ],
    ids=[
        "dp2-to-dp4",
        "dp2-to-dp1",
        "dp2-to-plain",
        "plain-to-dp4",
        "pp2dp2-to-buffers",
        "torch_dist-tp2dp2-to-pp2-plain",
        "torch_dist-pp2dp2-gemma-to-tp4",
        "torch_dist-tp2pp2-kv1-plain-to-dp4",
    ],
)
def test_resume_at_another_layout_continues_the_curve(
    cpu_ranks, tmp_path, save_layout, save_options, load_layout, load_options, ckpt_format, variant
):
    files = cpu_ranks.run(
        _resume,
        str(tmp_path),
        save_layout,
        save_options,
        load_layout,
        load_options,
        ckpt_format,
        variant,
    )[0]
    optim = [f for f in files if f.startswith("optim_")]
    if ckpt_format == "torch_dist":
        meta = json.loads((tmp_path / f"iter_{SAVED_AT:07d}" / "metadata.json").read_text())
        dcp_files = [f for f in files if f == ".metadata" or f.endswith(".distcp")]
        assert not optim and ".metadata" in dcp_files and len(dcp_files) > 1, files
        assert meta["version"] == 5 and meta["ckpt_format"] == "torch_dist"
        assert set(meta["files"]) == set(files) - {"metadata.json"}, (meta["files"], files)
    elif save_options.startswith("distributed"):
        tp, pp = save_layout
        dp = 4 // (tp * pp)
        assert optim == sorted(
            f"optim_tp{t:02d}_pp{p:02d}_dp{d:03d}.pt"
            for t in range(tp)
            for p in range(pp)
            for d in range(dp)
        )
        meta = json.loads((tmp_path / f"iter_{SAVED_AT:07d}" / "metadata.json").read_text())
        assert (
            meta["version"] == 4
            and meta["distributed_optimizer"]
            and all(f in meta["files"] for f in optim)
        )
        # No rank wrote the whole optimizer state of its (TP, PP) rank: each file about 1/DP of it.
        for prefix in {f[: len("optim_tp00_pp00")] for f in optim}:
            sizes = [
                os.path.getsize(tmp_path / f"iter_{SAVED_AT:07d}" / f)
                for f in optim
                if f.startswith(prefix)
            ]
            assert max(sizes) < 0.75 * sum(sizes), (prefix, sizes)
    else:
        assert not optim


def _load_damaged(rank, world, path, expect, verify=True):
    _layout(2, 1)
    run = Run(config_for("gpt2", 4), DISTRIBUTED)
    tp_group, _, pp_group = groups()
    try:
        load_checkpoint(
            path, run.chunks, run.opt, tp_group=tp_group, pp_group=pp_group, verify=verify
        )
    except CheckpointError as e:
        assert expect in str(e), str(e)
        return str(e)
    raise AssertionError("a damaged optimizer file was loaded")


def _save_distributed(rank, world, root):
    _layout(2, 1)
    run = Run(config_for("gpt2", 4), DISTRIBUTED)
    _train(run, range(1))
    tp_group, dp_group, pp_group = groups()
    return save_checkpoint(
        root,
        1,
        run.chunks,
        run.opt,
        consumed_samples=0,
        tp_group=tp_group,
        dp_group=dp_group,
        pp_group=pp_group,
    )


def test_damaged_or_swapped_optimizer_files_are_refused(cpu_ranks, tmp_path):
    path = cpu_ranks.run(_save_distributed, str(tmp_path))[0]
    a, b = (
        os.path.join(path, "optim_tp00_pp00_dp000.pt"),
        os.path.join(path, "optim_tp00_pp00_dp001.pt"),
    )
    with open(a, "r+b") as f:  # one flipped byte
        f.seek(os.path.getsize(a) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    cpu_ranks.run(_load_damaged, path, "optim_tp00_pp00_dp000.pt is corrupt")
    shutil.copyfile(
        b, a
    )  # a DP peer's file in its place: its size differs, and so (unchecked) does its identity
    cpu_ranks.run(_load_damaged, path, "optim_tp00_pp00_dp000.pt is corrupt")
    cpu_ranks.run(
        _load_damaged,
        path,
        (
            "expects at TP rank 0, PP rank 0, DP rank 0 (a file of another rank, save or run?): "
            "data_parallel_rank: file 1, metadata 0"
        ),
        False,
    )
