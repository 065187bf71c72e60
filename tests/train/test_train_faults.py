"""The trainer under faults (issue 22), launched like users launch it (torchrun's
environment, 2 ranks forked warm: launch.torchrun; TP=2): checkpoints without `latest` are
resumed, not overwritten; a --load folder that does not exist, a --save path that is a
file, diverged fp32 training and a frozen rank each end the run on every rank within
seconds, with an error naming the flag, file or step."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from launch import torchrun
from train_runs import (  # noqa: F401 (workdir: the corpus fixture)
    FLAGS,
    RUN_TIMEOUT_S,
    SCRIPT,
    metrics_rows,
    workdir,
)

SMALL = ["--tensor-parallel-size", "2", "--eval-iters", "0", "--log-interval", "1", "--no-progress"]


def _launch(workdir, *extra: str) -> subprocess.CompletedProcess:
    flags = FLAGS + ["--data-path", str(workdir / "corpus"), *SMALL, *extra]
    return torchrun([SCRIPT, *flags], 2, timeout=RUN_TIMEOUT_S)


def _digests(folder) -> dict[str, str]:
    return {
        os.path.relpath(os.path.join(root, n), folder): hashlib.sha256(
            open(os.path.join(root, n), "rb").read()
        ).hexdigest()
        for root, _, names in os.walk(folder)
        for n in names
    }


def _fails_on_both_ranks(proc: subprocess.CompletedProcess, *messages: str) -> None:
    assert proc.returncode != 0, proc.stdout[-2000:]
    for message in messages:
        assert proc.stderr.count(message) >= 2, (
            f"{message!r} not on both ranks:\n{proc.stderr[-4000:]}"
        )


@pytest.fixture(scope="module")
def saved(workdir):
    """6 steps, checkpoints at 3 and 6."""
    save = workdir / "faults_base"
    proc = _launch(workdir, "--train-iters", "6", "--save", str(save), "--save-interval", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p for p in os.listdir(save) if p.startswith("iter_")) == [
        "iter_0000003",
        "iter_0000006",
    ]
    return save


def test_checkpoints_without_latest_are_resumed_not_overwritten(workdir, saved):
    save = workdir / "no_latest"
    shutil.copytree(saved, save)
    os.remove(save / "latest")
    before = _digests(save / "iter_0000006")
    proc = _launch(
        workdir,
        "--train-iters",
        "9",
        "--save",
        str(save),
        "--load",
        str(save),
        "--save-interval",
        "3",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"resumed from {save}/iter_0000006 at iteration 6 (no 'latest' file in --load {save}"
        in proc.stdout
    ), proc.stdout[-2000:]
    assert _digests(save / "iter_0000006") == before  # the checkpoint resumed from is untouched
    assert (save / "latest").read_text().strip() == "iter_0000009"


def test_load_folder_that_does_not_exist_fails_on_both_ranks(workdir):
    typo, other = workdir / "no_such_folder", workdir / "typo_save"
    proc = _launch(workdir, "--train-iters", "3", "--load", str(typo), "--save", str(other))
    _fails_on_both_ranks(proc, f"--load {typo} does not exist")
    assert not other.exists()  # it stopped before making anything


def test_save_path_that_is_a_file_fails_on_both_ranks_at_startup(workdir):
    blocked = workdir / "blocked_save"
    blocked.write_text("not a folder\n")
    start = time.monotonic()
    proc = _launch(workdir, "--train-iters", "3", "--save", str(blocked))
    _fails_on_both_ranks(proc, f"--save {blocked}: tpcore: writing {blocked} failed: EEXIST")
    assert "iter" not in proc.stdout and blocked.read_text() == "not a folder\n"
    assert time.monotonic() - start < 90


def test_save_hf_folder_holding_another_models_files_fails_on_both_ranks_at_startup(
    workdir, tmp_path
):
    """A byte-level model exported beside another model's tokenizer.json would load with
    that tokenizer: refused before the first step, the folder untouched."""
    out = tmp_path / "exported"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    proc = _launch(workdir, "--train-iters", "3", "--save-hf", str(out))
    _fails_on_both_ranks(
        proc, f"{out} already holds ['tokenizer.json'], which the export would not write or replace"
    )
    assert "iter" not in proc.stdout and os.listdir(out) == ["tokenizer.json"]


def test_ranks_given_different_seeds_fail_on_every_rank_before_training(workdir, tmp_path):
    """A per-rank environment gives rank 1 another --seed: each rank would draw other
    replicated weights (norms, biases) and dropout masks, so the TP ranks' copies drift
    apart while the run exits 0. Every rank must refuse at start-up, naming the flag."""
    wrapper = tmp_path / "per_rank_seed.py"
    wrapper.write_text(
        "import os, sys\nfrom tpcore.train import main\n"
        "sys.exit(main(sys.argv[1:] + ['--seed', str(7 + int(os.environ['RANK']))]))\n"
    )
    save = tmp_path / "ckpt"
    flags = FLAGS + [
        "--data-path",
        str(workdir / "corpus"),
        *SMALL,
        "--train-iters",
        "3",
        "--save",
        str(save),
    ]
    proc = torchrun([wrapper, *flags], 2, timeout=RUN_TIMEOUT_S)
    _fails_on_both_ranks(
        proc,
        (
            "the ranks were given different training arguments: "
            "--seed: 7 on rank(s) [0], 8 on rank(s) [1]"
        ),
    )
    assert not save.exists()  # refused before the first step made anything


def test_diverged_fp32_run_stops_naming_the_step_and_saves_no_nan(workdir):
    save = workdir / "diverged"
    proc = _launch(
        workdir,
        "--train-iters",
        "60",
        "--lr",
        "1e6",
        "--lr-warmup-iters",
        "0",
        "--max-skipped-steps",
        "3",
        "--save",
        str(save),
        "--save-interval",
        "1",
    )
    _fails_on_both_ranks(proc, "consecutive steps", "--max-skipped-steps 3")
    rows = [line.split(",") for line in (save / "metrics.csv").read_text().splitlines()[1:]]
    skipped = [int(float(r[0])) for r in rows if float(r[5]) == 1.0]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3)), rows
    assert (
        f"step {skipped[-1]}: the gradients were NaN or inf "
        f"at 3 consecutive steps ({skipped[0]}-{skipped[-1]}" in proc.stderr
    )
    assert int(float(rows[-1][0])) == skipped[-1] < 60  # it stopped there
    latest = (save / "latest").read_text().strip()
    assert int(latest.removeprefix("iter_")) < skipped[-1]  # the failing step saved nothing
    for name in os.listdir(save / latest):
        if name.startswith("model_"):
            state = torch.load(save / latest / name, weights_only=True)["model"]
            assert all(t.isfinite().all() for t in state.values()), name


def test_frozen_rank_fails_the_other_within_the_timeout_naming_the_phase(workdir):
    """SIGSTOP rank 1 mid-run: rank 0 fails within --distributed-timeout-minutes (0.1 = 6 s),
    naming the step it was in, instead of waiting 10 minutes."""
    log = workdir / "frozen"
    flags = FLAGS + [
        "--data-path",
        str(workdir / "corpus"),
        *SMALL,
        "--train-iters",
        "100000",
        "--log-dir",
        str(log),
        "--distributed-timeout-minutes",
        "0.1",
    ]
    seen: dict[str, float] = {}

    def freeze_rank_1(run) -> None:
        """SIGSTOP rank 1 after three steps (past every start-up collective); once rank 0
        has failed, end the frozen rank (as torchrun's agent would, after its grace)."""
        if "stopped" not in seen:
            if metrics_rows(log) >= 3:
                os.kill(run.pids[1], signal.SIGSTOP)
                seen["stopped"] = time.monotonic()
        elif "failed" not in seen and "failed" in run.stderr():
            seen["failed"] = time.monotonic()
            os.kill(run.pids[1], signal.SIGKILL)

    proc = torchrun([SCRIPT, *flags], 2, timeout=RUN_TIMEOUT_S, watch=freeze_rank_1)
    text = proc.stderr
    assert "stopped" in seen, f"the run ended before three steps:\n{text[-3000:]}"
    assert "failed" in seen, f"rank 0 did not fail:\n{text[-3000:]}"
    assert (
        "tpcore: training step" in text
        and "a collective got no answer within --distributed-timeout-minutes 0.1" in text
    ), text[-3000:]
    waited = seen["failed"] - seen["stopped"]
    assert 4 < waited < 40, waited  # the group timeout (6 s), not the 600 s default
