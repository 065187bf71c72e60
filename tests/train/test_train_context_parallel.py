"""Context-parallel pretraining through the CLI (Megatron's flags): the loss curves at CP 2
(ring), CP 2 x DP 2 (Ulysses, distributed optimizer), TP 2 x CP 2 with sequence
parallelism (all-gather) and CP 2 x PP 2 equal CP 1's (same global batch; RoPE, GQA); a
checkpoint saved at CP 2 resumes at CP 1; flags CP cannot honour raise before training."""

from __future__ import annotations

import pytest

from tpcore.train import parse_args
from train_runs import (  # noqa: F401 (workdir: a fixture)
    assert_same_curves,
    train,
    workdir,
)

MODEL = [
    "--position-embedding",
    "rotary",
    "--num-kv-heads",
    "2",
    "--train-iters",
    "40",
    "--eval-interval",
    "20",
]


@pytest.fixture(scope="module")
def cp1_run(workdir):  # noqa: F811
    return train(workdir, "cp1", 1, *MODEL)


@pytest.mark.parametrize(
    "name,nproc,flags",
    [
        ("cp2_p2p", 2, ["--context-parallel-size", "2"]),
        (
            "cp2_dp2_a2a",
            4,
            [
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "a2a",
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
            ],
        ),
        (
            "tp2_sp_cp2_allgather",
            4,
            [
                "--tensor-parallel-size",
                "2",
                "--sequence-parallel",
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "allgather",
            ],
        ),
        ("cp2_pp2", 4, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ],
)
def test_context_parallel_curves_equal_cp1(workdir, cp1_run, name, nproc, flags):  # noqa: F811
    rows, out = train(workdir, name, nproc, *MODEL, *flags)
    assert_same_curves(cp1_run[0], rows, exact=False)
    assert " x CP 2 (" in out


def test_checkpoint_at_cp2_resumes_at_cp1(workdir, cp1_run):  # noqa: F811
    """Saved halfway at CP 2 with the distributed optimizer (its slices over DP x CP),
    resumed at CP 1 without it: the curve of the uninterrupted CP 1 run."""
    save = str(workdir / "cp_ckpt")
    half = str(len(cp1_run[0]) // 2)
    ckpt = ["--save", save, "--save-interval", half]
    train(
        workdir,
        "cp_resume",
        2,
        *MODEL,
        *ckpt,
        "--context-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--exit-interval",
        half,
    )
    rows, out = train(workdir, "cp_resume", 1, *MODEL, "--load", save)
    assert "resumed from" in out
    assert_same_curves(cp1_run[0], rows, exact=False)


@pytest.mark.parametrize(
    "flags,match",
    [
        (
            ["--context-parallel-size", "3", "--seq-length", "16"],
            "--seq-length 16 is not divisible by 2 x --context-parallel-size (6)",
        ),
        (["--context-parallel-size", "0"], "--context-parallel-size"),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
                "--tensor-parallel-size",
                "2",
                "--num-attention-heads",
                "4",
            ],
            "heads must be divisible by tensor-parallel size x context-parallel size",
        ),
        (
            ["--context-parallel-size", "2", "--attention-dropout", "0.1"],
            "attention_dropout (0.1) with context-parallel size 2",
        ),
    ],
)
def test_bad_context_parallel_flags_raise(flags, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        parse_args(["--data-path", "x", *flags])
