"""The trainer with Megatron's data-parallel flags, launched like users launch it (torchrun):
DP 2 with --use-distributed-optimizer, --overlap-grad-reduce and --overlap-param-gather
trains the curve of TP 1 x DP 1 on the same global batch, and its checkpoint (DP-sharded
optimizer state) continues that curve in a single process without the distributed optimizer."""

from __future__ import annotations

import os

from train_runs import assert_same_curves, tp1_run, train, workdir  # noqa: F401 (fixtures)

DP_FLAGS = [
    "--micro-batch-size",
    "1",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--ddp-bucket-size",
    "5000",
]


def test_distributed_optimizer_run_equals_dp1_and_resumes_without_it(workdir, tp1_run):  # noqa: F811
    save = workdir / "dp2_distributed"
    rows, stdout = train(
        workdir,
        "dp2_distributed",
        2,
        *DP_FLAGS,
        "--exit-interval",
        "20",
        "--save",
        str(save),
        "--save-interval",
        "10",
    )
    assert (
        "TP 1 x DP 2 +distributed-optimizer +overlap-grad-reduce +overlap-param-gather" in stdout
    ), stdout[-2000:]
    assert_same_curves(rows, tp1_run[0], exact=False)
    files = sorted(os.listdir(save / "iter_0000010"))
    assert [f for f in files if f.startswith("optim_")] == [
        "optim_tp00_pp00_dp000.pt",
        "optim_tp00_pp00_dp001.pt",
    ], files
    resumed, stdout = train(
        workdir,
        "dp2_distributed_to_dp1",
        1,
        "--load",
        str(save / "iter_0000010"),
        "--exit-interval",
        "5",
    )
    assert "resumed from" in stdout and "at iteration 10" in stdout
    assert_same_curves(resumed, tp1_run[0][10:15], exact=False)
