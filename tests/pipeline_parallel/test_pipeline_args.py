"""The trainer's pipeline flags: parsed, validated before any process group exists (so a
bad combination raises on every rank alike)."""

from __future__ import annotations

import pytest

from checks import expect_error
from tpcore.train import parse_args


def test_pipeline_flags_parse():
    args = parse_args(
        [
            "--pipeline-model-parallel-size",
            "2",
            "--virtual-pipeline-model-parallel-size",
            "2",
            "--pipeline-schedule",
            "interleaved",
            "--num-layers",
            "8",
            "--pipeline-stage-layers",
            "1,3,2,2",
        ]
    )
    assert (
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        args.pipeline_schedule,
    ) == (2, 2, "interleaved")
    assert args.stage_layers() == [[0], [1, 2, 3], [4, 5], [6, 7]]
    assert parse_args(["--pipeline-model-parallel-size", "2"]).stage_layers() == [
        [0, 1],
        [2, 3],
    ]  # default: even split of 4 layers
    assert parse_args([]).schedule == "1f1b"
    # Megatron's convention: a virtual pipeline size > 1 alone selects the interleaved schedule.
    assert (
        parse_args(
            ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]
        ).schedule
        == "interleaved"
    )
    assert (
        parse_args(
            ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "1"]
        ).schedule
        == "1f1b"
    )
    # Checkpoints and the final sample work with pipeline parallelism.
    args = parse_args(
        [
            "--pipeline-model-parallel-size",
            "2",
            "--save",
            "ckpt",
            "--load",
            "ckpt",
            "--sample-tokens",
            "5",
        ]
    )
    assert (args.save, args.load, args.sample_tokens) == ("ckpt", "ckpt", 5)


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["--pipeline-model-parallel-size", "0"],
            "--pipeline-model-parallel-size must be an int >= 1",
        ),
        (["--pipeline-model-parallel-size", "8"], "4 layers cannot fill 8 stages"),
        (
            ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2"],
            "needs --virtual-pipeline-model-parallel-size >= 2",
        ),
        (
            [
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-schedule",
                "1f1b",
            ],
            (
                "--virtual-pipeline-model-parallel-size 2 runs the interleaved schedule, "
                "not --pipeline-schedule 1f1b"
            ),
        ),
        (
            ["--virtual-pipeline-model-parallel-size", "2"],
            "needs --pipeline-model-parallel-size >= 2",
        ),
        (
            ["--pipeline-schedule", "interleaved", "--virtual-pipeline-model-parallel-size", "2"],
            "needs --pipeline-model-parallel-size >= 2",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "1,2"],
            "sum to num_layers=4",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-stage-layers", "a,b"],
            "comma-separated ints",
        ),
    ],
)
def test_bad_pipeline_flags_raise(argv, match):
    expect_error(ValueError, match, parse_args, argv)


def test_bad_schedule_name_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--pipeline-schedule", "zigzag"])
    assert "--pipeline-schedule" in capsys.readouterr().err
