"""End-to-end pretraining runs launched like users launch them (torchrun's environment, from
warm processes: launch.torchrun, which also kills the killed runs' ranks), compared with
each other: TP=2 vs TP=1 vs DP=2 vs PP=2 vs TP=2 x PP=2 on the same global batch, killed-and-
resumed runs (TP=2, PP=2) vs uninterrupted ones, TP=2, PP=2 and TP=2 x PP=2 checkpoints
continued at TP=1 x PP=1, and a TP=2 x PP=2 checkpoint through tpcore-convert and generate.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from checks import gpt_rule, merge_pieces
from harness import REPO_ROOT
from launch import torchrun
from tpcore.data import load_tokenizer
from tpcore.models import generate
from tpcore.train import export_safetensors, load_dense_gpt
from train_runs import (  # noqa: F401 (fixtures)
    EVAL_INTERVAL,
    FLAGS,
    ITERS,
    RUN_TIMEOUT_S,
    SCRIPT,
    assert_same_curves,
    tp1_run,
    tp2_run,
    train,
    workdir,
)


def test_training_lowers_loss_and_writes_outputs(workdir, tp2_run):
    rows, stdout = tp2_run
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-10:]) / 10
    assert last < first - 1.5, (first, last)  # starts near ln(257) = 5.55
    valid = [r["valid_loss"] for r in rows if r["valid_loss"] == r["valid_loss"]]
    assert len(valid) == ITERS // EVAL_INTERVAL and valid[-1] < valid[0]
    ckpt = workdir / "tp2"
    assert (ckpt / "latest").read_text().strip() == f"iter_{ITERS:07d}"
    names = sorted(os.listdir(ckpt / f"iter_{ITERS:07d}"))
    assert names == [
        "metadata.json",
        "model_tp00_pp00.pt",
        "model_tp01_pp00.pt",
        "rng_rank00000.pt",
        "rng_rank00001.pt",
    ], names
    meta = json.loads((ckpt / f"iter_{ITERS:07d}" / "metadata.json").read_text())
    assert (
        meta["iteration"] == ITERS
        and meta["consumed_samples"] == ITERS * 4
        and meta["tensor_parallel_size"] == 2
    )
    assert (ckpt / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tpcore: sample" in stdout


def test_tp1_and_tp2_give_the_same_curve(tp1_run, tp2_run):
    assert_same_curves(tp1_run[0], tp2_run[0][: len(tp1_run[0])], exact=False)


def test_dp2_equals_dp1_with_the_same_global_batch(workdir, tp1_run):
    # DP=2 x TP=1, one sample per rank per micro step, two micro steps: global batch 4 as before.
    rows, stdout = train(workdir, "dp2", 2, "--micro-batch-size", "1", "--exit-interval", "20")
    assert "TP 1 x DP 2" in stdout and "accumulation 2" in stdout
    assert_same_curves(rows, tp1_run[0], exact=False)


def _kill_after_first_save(workdir, nproc: int, save, *extra: str) -> int:
    """Start a run that saves every 10 steps, SIGKILL every rank as soon as the first
    checkpoint is in place (anywhere: mid-step or mid-save); returns the iteration of the
    newest complete checkpoint."""
    flags = FLAGS + [
        "--data-path",
        str(workdir / "corpus"),
        "--save",
        str(save),
        "--save-interval",
        "10",
        *extra,
    ]
    killed = []

    def kill_once_saved(run) -> None:
        if not killed and (save / "latest").exists():
            for pid in run.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.append(True)

    proc = torchrun([SCRIPT, *flags], nproc, timeout=RUN_TIMEOUT_S, watch=kill_once_saved)
    assert killed, f"the run ended before its first checkpoint:\n{proc.stderr[-3000:]}"
    return int((save / "latest").read_text().strip().removeprefix("iter_"))


def test_killed_run_resumes_on_the_same_curve(workdir, tp2_run):
    save = workdir / "killed"
    killed_at = _kill_after_first_save(workdir, 2, save, "--tensor-parallel-size", "2")
    assert 10 <= killed_at < ITERS, killed_at

    rows, stdout = train(
        workdir,
        "killed",
        2,
        "--tensor-parallel-size",
        "2",
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "10",
    )
    assert f"at iteration {killed_at}" in stdout
    assert_same_curves(rows, tp2_run[0], exact=True)  # rows 1..killed_at come from the killed run


def test_tp2_checkpoint_continues_at_tp1(workdir, tp2_run):
    rows, stdout = train(
        workdir,
        "reshard",
        1,
        "--load",
        str(workdir / "tp2" / "iter_0000020"),
        "--exit-interval",
        "5",
    )
    assert "at iteration 20" in stdout
    assert_same_curves(
        rows[-5:], tp2_run[0][20:25], exact=False
    )  # weights and AdamW state resharded


def _fails_on_both_ranks(workdir, message: str, *extra: str) -> None:
    """A 2-rank TP=2 run with `extra` flags exits non-zero with `message` from each rank."""
    flags = FLAGS + ["--data-path", str(workdir / "corpus"), "--tensor-parallel-size", "2", *extra]
    proc = torchrun([SCRIPT, *flags], 2, timeout=RUN_TIMEOUT_S)
    assert proc.returncode != 0
    assert proc.stderr.count(message) >= 2, proc.stderr[-2000:]


def test_resuming_with_another_global_batch_is_refused(workdir, tp2_run):
    """The data position is step x global batch: a changed global batch would skip or repeat
    samples."""
    _fails_on_both_ranks(
        workdir,
        "resume with that --global-batch-size, not 8",
        "--global-batch-size",
        "8",
        "--load",
        str(workdir / "tp2" / "iter_0000020"),
        "--log-dir",
        str(workdir / "regrouped"),
    )


def test_bad_arguments_fail_fast_on_every_rank(workdir):
    _fails_on_both_ranks(
        workdir,
        "hidden_size 32 is not divisible by num_attention_heads 3",
        "--num-attention-heads",
        "3",
    )


def test_autocast_bf16_run_trains_alongside_fp32(workdir, tp2_run):
    """--autocast bf16 (fp32 weights, bf16 compute) follows the fp32 run's curve at bf16
    precision."""
    rows, stdout = train(
        workdir,
        "autocast",
        2,
        "--tensor-parallel-size",
        "2",
        "--autocast",
        "bf16",
        "--exit-interval",
        "40",
    )
    assert "float32 autocast bf16" in stdout
    loss = torch.tensor([r["loss"] for r in rows], dtype=torch.float64)
    fp32 = torch.tensor([r["loss"] for r in tp2_run[0][:40]], dtype=torch.float64)
    assert loss.isfinite().all() and loss[-5:].mean() < loss[0] - 1.0, loss
    # Step 1 sees identical weights: only bf16 compute separates the two losses.
    torch.testing.assert_close(loss[0], fp32[0], rtol=2 * 2**-7, atol=0)


PP2 = ["--pipeline-model-parallel-size", "2"]
PP_ITERS = 30


@pytest.fixture(scope="module")
def pp2_run(workdir):
    """Two pipeline stages of one layer each, 1F1B over the 2 micro-batches of each global
    batch, checkpoints every 10 steps, a sample at the end."""
    return train(
        workdir,
        "pp2",
        2,
        *PP2,
        "--exit-interval",
        str(PP_ITERS),
        "--save",
        str(workdir / "pp2"),
        "--save-interval",
        "10",
        "--sample-tokens",
        "10",
    )


def test_pp2_gives_the_same_curve_as_pp1(pp2_run, tp1_run):
    rows, stdout = pp2_run
    assert (
        "TP 1 x DP 1 x PP 2 (1f1b, 1 chunk(s) per rank)" in stdout and "accumulation 2" in stdout
    ), stdout[:2000]
    assert "tpcore: sample" in stdout  # generated on the first stage from the gathered model
    assert_same_curves(rows[: len(tp1_run[0])], tp1_run[0], exact=False)


def test_killed_pp2_run_resumes_on_the_same_curve(workdir, pp2_run):
    save = workdir / "pp2_killed"
    killed_at = _kill_after_first_save(workdir, 2, save, *PP2)
    assert 10 <= killed_at < PP_ITERS, killed_at
    names = sorted(os.listdir(save / f"iter_{killed_at:07d}"))
    assert names == [
        "metadata.json",
        "model_tp00_pp00.pt",
        "model_tp00_pp01.pt",
        "rng_rank00000.pt",
        "rng_rank00001.pt",
    ], names
    rows, stdout = train(
        workdir,
        "pp2_killed",
        2,
        *PP2,
        "--save",
        str(save),
        "--load",
        str(save),
        "--exit-interval",
        str(PP_ITERS - killed_at),
    )
    assert f"at iteration {killed_at}" in stdout
    assert_same_curves(rows, pp2_run[0], exact=True)


def test_pp2_checkpoint_continues_at_pp1(workdir, pp2_run):
    rows, stdout = train(
        workdir,
        "pp2_to_pp1",
        1,
        "--load",
        str(workdir / "pp2" / "iter_0000010"),
        "--exit-interval",
        "5",
    )
    assert "at iteration 10" in stdout
    assert_same_curves(rows[-5:], pp2_run[0][10:15], exact=False)


@pytest.fixture(scope="module")
def tp2_pp2_run(workdir):
    """4 ranks: TP=2 inside each pair, 2 pipeline stages; 15 steps, checkpoints at 10 and 15."""
    return train(
        workdir,
        "tp2pp2",
        4,
        "--tensor-parallel-size",
        "2",
        *PP2,
        "--exit-interval",
        "15",
        "--save",
        str(workdir / "tp2pp2"),
        "--save-interval",
        "10",
    )


def test_tp2_pp2_checkpoint_continues_at_tp1_pp1(workdir, tp2_pp2_run, tp1_run):
    assert_same_curves(tp2_pp2_run[0], tp1_run[0][:15], exact=False)
    rows, stdout = train(
        workdir,
        "tp2pp2_to_tp1",
        1,
        "--load",
        str(workdir / "tp2pp2" / "iter_0000010"),
        "--exit-interval",
        "5",
    )
    assert "at iteration 10" in stdout
    assert_same_curves(rows[-5:], tp2_pp2_run[0][10:15], exact=False)


def test_torch_dist_checkpoint_resumes_at_another_layout(workdir, tp1_run):
    """--ckpt-format torch_dist: written at TP 2 x DP 2 with the distributed optimizer,
    resumed at PP 2 without it, on the uninterrupted curve."""
    save = workdir / "torch_dist"
    first, _ = train(
        workdir,
        "torch_dist",
        4,
        "--tensor-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--ckpt-format",
        "torch_dist",
        "--save",
        str(save),
        "--save-interval",
        "10",
        "--exit-interval",
        "10",
    )
    assert_same_curves(first, tp1_run[0][:10], exact=False)
    assert (save / "iter_0000010" / ".metadata").is_file()
    rows, stdout = train(
        workdir, "torch_dist_pp2", 2, *PP2, "--load", str(save), "--exit-interval", "10"
    )
    assert "at iteration 10" in stdout
    assert_same_curves(rows[-10:], tp1_run[0][10:20], exact=False)


def test_convert_and_generate_read_a_tp2_pp2_checkpoint(workdir, tp2_pp2_run, tmp_path):
    pytest.importorskip("safetensors")  # tpcore-convert's optional dependency
    ckpt = workdir / "tp2pp2" / "iter_0000015"
    model, meta = load_dense_gpt(export_safetensors(str(ckpt), str(tmp_path / "gpt.safetensors")))
    files = {
        (t, p): torch.load(ckpt / f"model_tp{t:02d}_pp{p:02d}.pt", weights_only=True)["model"]
        for t in (0, 1)
        for p in (0, 1)
    }
    assert meta["iteration"] == "15"
    for (
        name,
        got,
    ) in (
        model.state_dict().items()
    ):  # the dense model is the shards merged, each from the one stage storing it
        (stage,) = [p for p in (0, 1) if name in files[0, p]]
        assert torch.equal(
            got,
            merge_pieces(
                [files[t, stage][name] for t in (0, 1)], gpt_rule(name, model.config), model.config
            ),
        ), name
    tokenizer = load_tokenizer("byte")
    expected = generate(
        model, torch.tensor([tokenizer.encode("the ")]), 12, greedy=True, eod=tokenizer.eod
    )
    script = str(REPO_ROOT / "examples" / "generate.py")
    flags = [
        "--load",
        str(ckpt),
        "--prompt",
        "the ",
        "--max-new-tokens",
        "12",
        "--greedy",
        "--device",
        "cpu",
    ]
    proc = subprocess.run(
        [sys.executable, script, *flags], capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == tokenizer.decode(expected[0].tolist()) + "\n"
