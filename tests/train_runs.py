"""The end-to-end pretraining runs the trainer tests share: the corpus, the flags, launching a
run under torchrun's environment, and comparing loss curves."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch

from harness import REPO_ROOT
from launch import torchrun
from tpcore.data import preprocess
from tpcore.train import read_metrics

# Long enough for the loss to fall from ln(257) = 5.55 to about 2.6 (it gets there by step
# 40) with three validations, short enough to run many times.
ITERS = 60
EVAL_INTERVAL = 20
FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(ITERS),
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "5",
    "--eval-interval",
    str(EVAL_INTERVAL),
    "--eval-iters",
    "2",
    "--log-interval",
    str(EVAL_INTERVAL),
    "--device",
    "cpu",
    "--seed",
    "7",
]
COMPARED = ("loss", "lr", "grad_norm", "valid_loss")
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A small corpus with a learnable pattern, preprocessed with the byte tokenizer."""
    root = tmp_path_factory.mktemp("train")
    g = torch.Generator().manual_seed(0)
    words = "the cat sat on a mat while the dog ran after a red ball in the warm sun".split()
    with open(root / "corpus.jsonl", "w") as f:
        for _ in range(300):
            n = int(torch.randint(5, 40, (), generator=g))
            f.write(
                json.dumps(
                    {
                        "text": " ".join(
                            words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g)
                        )
                    }
                )
                + "\n"
            )
    preprocess(str(root / "corpus.jsonl"), str(root / "corpus"), append_eod=True)
    return root


SCRIPT = str(REPO_ROOT / "examples" / "pretrain_gpt.py")


def command(nproc: int, flags: list[str]) -> list[str]:
    """The real launch command (torchrun for several ranks)."""
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
        ]
        if nproc > 1
        else [sys.executable]
    )
    return launcher + [SCRIPT] + flags


def train(workdir, name: str, nproc: int, *extra: str) -> tuple[list[dict], str]:
    """Run to completion; returns (metrics rows, stdout)."""
    out = workdir / name
    flags = FLAGS + ["--data-path", str(workdir / "corpus"), "--log-dir", str(out), *extra]
    proc = torchrun([SCRIPT, *flags], nproc, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"training run {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    # A clean run ends without torch's warnings of a store gone (a heartbeat outliving rank 0).
    assert "TCPStore" not in proc.stderr, f"training run {name}:\n{proc.stderr[-3000:]}"
    return read_metrics(str(out / "metrics.csv")), proc.stdout


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """torchrun's workers under `launcher_pid`, by their RANK (from /proc/PID/environ)."""
    out = {}
    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            out[int(env[b"RANK"])] = pid
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process under it (a launcher and its workers)."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Child processes, recursively (torchrun's workers leave its process group)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def metrics_rows(log_dir) -> int:
    """Steps logged so far to `log_dir`/metrics.csv (0 before the file exists)."""
    path = os.path.join(log_dir, "metrics.csv")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(f.read().splitlines()) - 1


def wait_for(predicate, procs, what: str, output=lambda: "", timeout: float = RUN_TIMEOUT_S):
    """Poll `predicate` until it holds; fail naming `what` when one of the launchers `procs`
    ends first (showing the tail of `output()`), or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        ended = any(p.poll() is not None for p in procs)
        assert not ended, f"the run ended before {what}:\n{output()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def assert_same_curves(a: list[dict], b: list[dict], exact: bool) -> None:
    assert len(a) == len(b) and a, (len(a), len(b))
    for key in COMPARED:
        x, y = (
            torch.tensor([r[key] for r in a], dtype=torch.float64),
            torch.tensor([r[key] for r in b], dtype=torch.float64),
        )
        if exact:
            assert torch.equal(x.nan_to_num(-1), y.nan_to_num(-1)), f"{key} differs: {x} vs {y}"
        else:  # same math, another reduction order: fp32 rounding only
            both = ~(x.isnan() | y.isnan())  # a run cut short also evaluates at its last step
            torch.testing.assert_close(
                x[both], y[both], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}"
            )


@pytest.fixture(scope="module")
def tp2_run(workdir):
    """The uninterrupted reference: TP=2, checkpoints every 10 steps, a sample at the end."""
    return train(
        workdir,
        "tp2",
        2,
        "--tensor-parallel-size",
        "2",
        "--save",
        str(workdir / "tp2"),
        "--save-interval",
        "10",
        "--sample-tokens",
        "20",
    )


@pytest.fixture(scope="module")
def tp1_run(workdir):
    return train(workdir, "tp1", 1, "--exit-interval", "20")
