"""Training that survives (issue 43): SIGTERM under --exit-signal-handler (reaching one
rank, mid-step or mid-save) stops every rank at the same step with a checkpoint and exit
code 0, and resuming gives the uninterrupted run's curve; --save-interval-minutes saves by
time; under torchrun --max-restarts a rank killed with SIGKILL makes torchrun restart the
workers, which resume from the newest checkpoint and end with the uninterrupted curve,
leaving nothing in /dev/shm. Only the last is about torchrun itself and runs it; the others
fork their ranks warm (launch.torchrun)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys

import pytest

from launch import torchrun
from tpcore.train import read_metrics
from train_runs import (  # noqa: F401 (workdir: a fixture)
    FLAGS,
    RUN_TIMEOUT_S,
    SCRIPT,
    assert_same_curves,
    command,
    kill_tree,
    metrics_rows,
    rank_pids,
    train,
    wait_for,
    workdir,
)

RUN = ["--eval-iters", "0", "--log-interval", "1", "--no-progress", "--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def uninterrupted(workdir):  # noqa: F811
    return train(workdir, "preempt_base", 2, *RUN)[0]


def _finish(proc: subprocess.Popen, out) -> tuple[int, str]:
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out.seek(0)
        raise AssertionError(f"the run did not end:\n{out.read()[-4000:]}") from None
    finally:
        kill_tree(proc.pid)
    out.seek(0)
    return proc.returncode, out.read()


def test_sigterm_on_one_rank_saves_and_the_resumed_curve_is_unchanged(
    workdir,  # noqa: F811
    uninterrupted,
):
    """SIGTERM to rank 1 alone, mid-run: both ranks stop after the same step, save it, exit
    0 naming the signal; --load continues to the uninterrupted run's curve."""
    save, log = workdir / "preempt_ckpt", workdir / "preempt"
    flags = FLAGS + ["--data-path", str(workdir / "corpus"), *RUN, "--log-dir", str(log)]
    flags += ["--save", str(save), "--exit-signal-handler"]
    signalled = []

    def sigterm_rank_1_after_five_steps(run) -> None:
        if not signalled and metrics_rows(log) >= 5:
            os.kill(run.pids[1], signal.SIGTERM)
            signalled.append(True)

    proc = torchrun(
        [SCRIPT, *flags], 2, timeout=RUN_TIMEOUT_S, watch=sigterm_rank_1_after_five_steps
    )
    text = proc.stdout + proc.stderr
    assert signalled, f"the run ended before five steps:\n{text[-3000:]}"
    assert proc.returncode == 0, text[-3000:]
    stopped = metrics_rows(log)
    assert 5 <= stopped < int(FLAGS[FLAGS.index("--train-iters") + 1]), stopped
    assert f"SIGTERM received: stopped after step {stopped}; its checkpoint is in" in text
    assert (save / f"iter_{stopped:07d}").is_dir()
    assert (save / "latest").read_text().strip() == f"iter_{stopped:07d}"
    rows, out_text = train(workdir, "preempt", 2, *RUN, "--load", str(save))
    assert "resumed from" in out_text
    assert_same_curves(uninterrupted, rows, exact=True)


SAVE_THEN_SIGNAL = """
import os, signal, sys
import tpcore.train.trainer as trainer
save = trainer._Training.save
def save_and_get_a_signal(self, iteration):
    # SIGTERM reaches rank 1 alone, while it writes the checkpoint of step 6
    if iteration == 6 and int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    save(self, iteration)
trainer._Training.save = save_and_get_a_signal
sys.argv = [sys.argv[0]] + sys.argv[1:]
exec(open({script!r}).read())
"""


def test_sigterm_during_a_save_stops_right_after_it(workdir, tmp_path):  # noqa: F811
    """The signal arrives during step 6's save on one rank: every rank stops there (no
    further step, no second save), with step 6 the newest checkpoint."""
    program = tmp_path / "signal_during_save.py"
    program.write_text(SAVE_THEN_SIGNAL.format(script=str(SCRIPT)))
    save, log = tmp_path / "ckpt", tmp_path / "log"
    proc = torchrun(
        [str(program), *FLAGS, "--data-path", str(workdir / "corpus"), *RUN, "--log-dir",
         str(log), "--save", str(save), "--save-interval", "3", "--exit-signal-handler"],
        2,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SIGTERM received: stopped after step 6" in proc.stdout
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000003", "iter_0000006"]
    assert [r["iteration"] for r in read_metrics(str(log / "metrics.csv"))] == list(range(1, 7))


def test_save_interval_minutes_saves_by_time(workdir, tmp_path):  # noqa: F811
    """--save-interval-minutes 0.002 (0.12 s) with no step interval: checkpoints in between,
    taken at the same steps on both ranks (each one complete), and the last at the end."""
    save = tmp_path / "ckpt"
    proc = torchrun(
        [SCRIPT, *FLAGS, "--data-path", str(workdir / "corpus"), *RUN, "--train-iters", "40",
         "--save", str(save), "--save-interval-minutes", "0.002"],
        2,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = sorted(p.name for p in save.glob("iter_*"))
    assert len(saved) >= 3 and saved[-1] == "iter_0000040", saved
    assert not list(save.glob("*.tmp")), "a save was left unfinished"


def test_rank_killed_under_max_restarts_resumes_the_curve(workdir, uninterrupted, tmp_path):  # noqa: F811
    """torchrun --max-restarts 1, --save/--load the same folder, checkpoints every 10 steps:
    SIGKILL rank 1 after the first checkpoint; the restarted workers resume from the newest
    one and end with the uninterrupted run's curve; /dev/shm holds nothing of theirs."""
    save, log = workdir / "restart_ckpt", workdir / "restart"
    flags = FLAGS + ["--data-path", str(workdir / "corpus"), *RUN, "--log-dir", str(log)]
    flags += ["--save", str(save), "--load", str(save), "--save-interval", "10"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
              "2", "--max-restarts", "1", "--monitor-interval", "0.2", SCRIPT]  # fmt: skip
    out = open(tmp_path / "out", "w+")
    proc = subprocess.Popen(launch + flags, stdout=out, stderr=subprocess.STDOUT, text=True)
    wait_for(
        lambda: (save / "iter_0000010").is_dir() and metrics_rows(log) >= 12, [proc], "step 12"
    )
    first = rank_pids(proc.pid)
    os.kill(first[1], signal.SIGKILL)
    code, text = _finish(proc, out)
    assert code == 0, text[-3000:]
    assert "resumed from" in text, text[-3000:]
    rows = read_metrics(str(log / "metrics.csv"))
    assert_same_curves(uninterrupted, rows, exact=True)
    left = [f for pid in first.values() for f in glob.glob(f"/dev/shm/tpcore-{pid}-*")]
    assert not left, left
