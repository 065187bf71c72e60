"""Training arguments (issue 22): every numeric flag is range-checked with a message naming
the flag (torch's own messages, such as AdamW's "Invalid beta parameter", name none), and a
config file that does not parse is named. All raised by parse_args, before any process
group exists, so every rank raises alike."""

from __future__ import annotations

import dataclasses
import math

import pytest

from checks import expect_error
from tpcore.train import TrainArgs, parse_args


def numeric_fields() -> dict[str, str]:
    """name -> "int" / "float" of every numeric TrainArgs field (optional ones included)."""
    kinds = {}
    for f in dataclasses.fields(TrainArgs):
        kind = str(f.type).split(" ")[0]  # annotations are strings: "int", "float | None", ...
        if kind in ("int", "float"):
            kinds[f.name] = kind
    return kinds


def test_config_file_that_is_a_folder_or_upper_case_yaml(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        parse_args(["--config", str(tmp_path)])
    path = tmp_path / "run.YAML"
    path.write_text("lr: 0.5\n")  # YAML, not JSON, whatever the case of its extension
    assert parse_args(["--config", str(path)]).lr == 0.5


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1), got 1.5"),
        (["--adam-beta1", "-0.1"], "--adam-beta1 must be in [0, 1), got -0.1"),
        (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1), got 1.0"),
        (["--adam-eps", "0"], "--adam-eps must be a finite number > 0, got 0.0"),
        (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
        (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
        (["--clip-grad", "-1"], "--clip-grad must be a finite number >= 0, got -1.0"),
        (
            ["--initial-loss-scale", "inf"],
            "--initial-loss-scale must be a finite number > 0, got inf",
        ),
        (["--valid-fraction", "1"], "--valid-fraction must be in [0, 1), got 1.0"),
        (["--seed", "-1"], "--seed must be an int in [0, 4294967294], got -1"),
        (["--seed", str(2**32)], "--seed must be an int in [0, 4294967294], got 4294967296"),
        (
            ["--max-position-embeddings", "0"],
            "--max-position-embeddings must be an int >= 1, got 0",
        ),
        (
            ["--max-position-embeddings", "64"],
            "--max-position-embeddings 64 is shorter than --seq-length 128",
        ),
    ],
)
def test_bad_numeric_flags_name_the_flag(argv, match):
    expect_error(ValueError, match, parse_args, argv)


def _bad_values(kind: str) -> list:
    return [-1] if kind == "int" else [-1.0, math.nan, math.inf]


def test_every_numeric_flag_is_range_checked():
    """A negative, NaN or infinite value of any int / float flag raises naming the flag (or,
    for the model's shape, GPTConfig's field of the same name). A flag added without a range
    fails here."""
    fields = numeric_fields()
    assert {"adam_beta1", "lr", "seed", "num_layers", "valid_fraction"} <= fields.keys()
    for name, kind in fields.items():
        for value in _bad_values(kind):
            try:
                TrainArgs(**{name: value})
            except ValueError as e:
                assert f"--{name.replace('_', '-')}" in str(e) or f"{name} must" in str(e), (
                    f"{name}={value}: {e}"
                )
            else:
                raise AssertionError(f"--{name.replace('_', '-')} {value} was accepted")
    assert (
        TrainArgs(adam_beta1=0.0, adam_beta2=0.999, seed=0, lr=0.0, clip_grad=0.0).adam_beta2
        == 0.999
    )


def test_defaults_pass_their_own_ranges():
    args = TrainArgs()
    for name in numeric_fields():
        assert dataclasses.replace(args, **{name: getattr(args, name)}) == args


@pytest.mark.parametrize(
    "name, text, cause",
    [
        ("bad.yaml", "lr: [1, 2\nseed: 3\n", "is not valid YAML"),
        ("tabs.yml", "lr: 1\n\tseed: 3\n", "is not valid YAML"),
        ("bad.json", '{"lr": 1,}', "is not valid JSON"),
        ("latin1.json", b'{"sample_prompt": "caf\xe9"}', "is not UTF-8"),
    ],
)
def test_malformed_config_file_is_named(tmp_path, name, text, cause):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as info:
        parse_args(["--config", str(path)])
    message = str(info.value)
    assert str(path) in message and cause in message, message


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
        (
            ["--overlap-param-gather", "--overlap-grad-reduce"],
            "--overlap-param-gather needs --use-distributed-optimizer",
        ),
        (["--ddp-bucket-size", "0"], "--ddp-bucket-size must be an int >= 1"),
    ],
)
def test_bad_data_parallel_flags_name_the_flag(argv, match):
    expect_error(ValueError, match, parse_args, argv)


def test_ckpt_format_is_checked(monkeypatch):
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse_args(["--ckpt-format", "zarr"])
    argv = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    assert parse_args(argv).ckpt_format == "torch_dist"
    # A torch without DCP's CheckpointableTensor cannot take the optimizer's DP slices.
    import tpcore.train.arguments as arguments

    monkeypatch.setattr(arguments, "has_checkpointable", lambda: False)
    expect_error(ValueError, "needs torch 2.15 or newer", parse_args, argv)
    assert parse_args(["--ckpt-format", "torch_dist"]).ckpt_format == "torch_dist"


def test_data_parallel_flags_parse():
    args = parse_args(
        [
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--ddp-bucket-size",
            "5000",
            "--grad-reduce-in-bf16",
        ]
    )
    options = args.data_parallel_options()
    assert (
        options.use_distributed_optimizer,
        options.overlap_grad_reduce,
        options.overlap_param_gather,
        options.bucket_size,
        options.grad_reduce_in_bf16,
    ) == (True, True, True, 5000, True)
    assert not parse_args([]).data_parallel_options().use_distributed_optimizer


def test_kv_channels_and_qk_layernorm_reach_the_model():
    """--kv-channels and --qk-layernorm (Megatron's flags) set the head width and Qwen3's
    q / k norms."""
    config = parse_args(
        [
            "--kv-channels",
            "16",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "8",
            "--qk-layernorm",
        ]
    ).model_config(50)
    assert config.kv_channels == config.head_dim == 16 and config.qk_norm
    default = parse_args([]).model_config(50)
    assert default.kv_channels is None and not default.qk_norm
    assert default.qk_norm_scope == "head"
    olmoe = ["--qk-layernorm", "--norm", "rmsnorm", "--qk-norm-scope", "projection"]
    assert parse_args(olmoe).model_config(50).qk_norm_scope == "projection"
    expect_error(
        ValueError,
        "even head dim, got 5",
        parse_args,
        ["--kv-channels", "5", "--position-embedding", "rotary"],
    )
