"""Unit tests of tpcore.train's single-process pieces against closed forms: arguments, the
lr schedule, the DP sampler, loss scaling, metrics files. The optimizer is tested in
test_train_optimizer.py, checkpoints in test_train_checkpoint.py, whole training runs in
test_train.py."""

from __future__ import annotations

import json
import math
import os

import pytest

from checks import expect_error
from tpcore.data.sampler import micro_batch_indices
from tpcore.train import (
    LossScaler,
    MetricsLogger,
    TrainArgs,
    learning_rate,
    parse_args,
    plot_loss_curve,
    read_metrics,
)

# ---------------------------------------------------------------------------------------
# 1. Arguments
# ---------------------------------------------------------------------------------------


def test_defaults_parse():
    args = parse_args([])
    assert args == TrainArgs()
    assert (args.micro_batch_size, args.lr, args.lr_decay_style, args.progress, args.bf16) == (
        4,
        3e-4,
        "cosine",
        True,
        False,
    )
    assert args.global_batch_size is None and args.lr_decay_iters is None


def test_flag_overrides_json_overrides_default(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps(
            {
                "micro-batch-size": 2,
                "lr": 0.01,
                "num_layers": 3,
                "norm": "rmsnorm",
                "progress": False,
            }
        )
    )
    args = parse_args(["--config", str(cfg), "--micro-batch-size", "8", "--progress"])
    assert args.micro_batch_size == 8  # flag beats file
    assert args.lr == 0.01 and args.num_layers == 3 and args.norm == "rmsnorm"  # file beats default
    assert args.progress is True  # bool flag beats file
    assert args.hidden_size == 256 and args.seq_length == 128  # defaults elsewhere


def test_flag_overrides_yaml_overrides_default(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "hidden-size: 64\nnum_attention_heads: 4\nmin-lr: 1.0e-5\nlr: 2.0e-3\nbf16: true\nseed: 9\n"
    )
    args = parse_args(["--seed", "11", "--config", str(cfg)])
    assert (args.hidden_size, args.num_attention_heads, args.min_lr, args.lr, args.bf16) == (
        64,
        4,
        1e-5,
        2e-3,
        True,
    )
    assert args.seed == 11
    assert args.micro_batch_size == 4


def test_yaml_exponent_numbers_are_floats(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 3e-4\nmin-lr: 1e-5\ntrain-iters: 1e3\n")  # PyYAML reads these as strings
    args = parse_args(["--config", str(cfg)])
    assert (args.lr, args.min_lr, args.train_iters) == (3e-4, 1e-5, 1000)


def test_bool_flags():
    assert parse_args(["--no-progress"]).progress is False
    a = parse_args(["--bf16", "--untie-embeddings", "--disable-bias", "--sequence-parallel"])
    assert a.bf16 and a.untie_embeddings and a.disable_bias and a.sequence_parallel and not a.fp16
    assert parse_args(["--bf16", "--no-bf16"]).bf16 is False


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--bf16", "--fp16"], "--bf16 and --fp16"),
        (["--lr", "0.1", "--min-lr", "0.2"], "--min-lr"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be an int >= 1"),
        (["--train-iters", "-3"], "--train-iters must be an int >= 1"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an int >= 1"),
        (["--loss-scale-window", "0"], "--loss-scale-window"),
        (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0"),
        (["--eval-iters", "-1"], "--eval-iters must be >= 0"),
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
        (["--save-interval", "0"], "--save-interval must be >= 1"),
        (["--exit-interval", "0"], "--exit-interval must be >= 1"),
        (["--clip-grad", "-1"], "--clip-grad"),
        (
            ["--hidden-size", "30", "--num-attention-heads", "8"],
            "hidden_size 30 is not divisible by num_attention_heads 8",
        ),
        (["--num-layers", "0"], "num_layers"),
    ],
)
def test_bad_flag_values_raise(argv, match):
    expect_error(ValueError, match, parse_args, argv)


@pytest.mark.parametrize(
    "values,match",
    [
        ({"bogus-key": 1}, "unknown argument 'bogus-key'"),
        ({"norm": "batchnorm"}, "--norm must be one of"),
        ({"lr_decay_style": "exp"}, "--lr-decay-style must be one of"),
        ({"micro_batch_size": 2.5}, "micro_batch_size must be of type int"),
        ({"lr": "fast"}, "lr must be of type float"),
    ],
)
def test_bad_config_values_raise(tmp_path, values, match):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(values))
    expect_error(ValueError, match, parse_args, ["--config", str(cfg)])


def test_bad_choice_on_command_line_names_the_flag(capsys):
    with pytest.raises(SystemExit):  # argparse rejects it before TrainArgs
        parse_args(["--recompute", "some"])
    assert "--recompute" in capsys.readouterr().err
    expect_error(ValueError, "--device must be one of", TrainArgs, device="tpu")


def test_missing_config_file(tmp_path):
    expect_error(
        FileNotFoundError, "does not exist", parse_args, ["--config", str(tmp_path / "none.yaml")]
    )


def test_model_config_mapping():
    a = TrainArgs(
        untie_embeddings=True,
        disable_bias=True,
        seq_length=64,
        hidden_size=48,
        num_attention_heads=6,
        num_kv_heads=3,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rotary",
        ffn_hidden_size=80,
        sequence_parallel=True,
        recompute="full",
    )
    c = a.model_config(300)
    assert c.tie_embeddings is False and c.bias is False
    assert c.max_position_embeddings == 64 and c.vocab_size == 300
    assert (c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.ffn_hidden_size) == (
        48,
        6,
        3,
        80,
    )
    assert (c.norm, c.activation, c.position_embedding, c.sequence_parallel, c.recompute) == (
        "rmsnorm",
        "swiglu",
        "rotary",
        True,
        "full",
    )
    d = TrainArgs(seq_length=64, max_position_embeddings=256).model_config()
    assert (
        d.max_position_embeddings == 256
        and d.tie_embeddings
        and d.bias
        and d.ffn_hidden_size == 4 * 256
    )


# ---------------------------------------------------------------------------------------
# 2. Learning-rate schedule
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_learning_rate_schedule(style):
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 10, 50
    for i in range(80):
        got = learning_rate(
            i, lr=lr, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay, style=style
        )
        if i < warmup:
            want = lr * (i + 1) / warmup
        elif style == "constant":
            want = lr
        elif i >= decay:
            want = min_lr
        else:
            t = (i - warmup) / (decay - warmup)
            want = min_lr + (lr - min_lr) * (
                1 - t if style == "linear" else (1 + math.cos(math.pi * t)) / 2
            )
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), (style, i, got, want)
    assert (
        learning_rate(
            warmup - 1, lr=lr, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay, style=style
        )
        == lr
    )


def test_learning_rate_without_warmup_and_bad_style():
    assert (
        learning_rate(0, lr=2.0, min_lr=0.5, warmup_iters=0, decay_iters=4, style="linear") == 2.0
    )
    assert (
        learning_rate(2, lr=2.0, min_lr=0.5, warmup_iters=0, decay_iters=4, style="linear") == 1.25
    )
    assert (
        learning_rate(4, lr=2.0, min_lr=0.5, warmup_iters=0, decay_iters=4, style="cosine") == 0.5
    )
    expect_error(
        ValueError,
        "unknown lr decay style 'exp'",
        learning_rate,
        5,
        lr=1.0,
        min_lr=0.0,
        warmup_iters=2,
        decay_iters=10,
        style="exp",
    )


# ---------------------------------------------------------------------------------------
# 3. Data-parallel sampler
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "global_batch,micro,dp", [(8, 2, 2), (12, 1, 3), (16, 4, 1), (24, 2, 4), (6, 3, 2), (4, 1, 4)]
)
def test_micro_batches_cover_the_global_batch_once(global_batch, micro, dp):
    for step in (0, 1, 7):
        seen = []
        for m in range(global_batch // (micro * dp)):
            for r in range(dp):
                idx = micro_batch_indices(
                    step,
                    m,
                    global_batch_size=global_batch,
                    micro_batch_size=micro,
                    dp_rank=r,
                    dp_size=dp,
                )
                assert len(idx) == micro
                seen.extend(idx)
        assert len(seen) == len(set(seen)) == global_batch
        assert sorted(seen) == list(range(step * global_batch, (step + 1) * global_batch))


def test_sampler_rejects_bad_sizes():
    expect_error(
        ValueError,
        "not divisible",
        micro_batch_indices,
        0,
        0,
        global_batch_size=10,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=3,
    )
    expect_error(
        ValueError,
        "not divisible",
        micro_batch_indices,
        0,
        0,
        global_batch_size=6,
        micro_batch_size=4,
        dp_rank=0,
        dp_size=1,
    )
    expect_error(
        ValueError,
        "out of range",
        micro_batch_indices,
        0,
        2,
        global_batch_size=8,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=2,
    )
    expect_error(
        ValueError,
        "out of range",
        micro_batch_indices,
        0,
        0,
        global_batch_size=8,
        micro_batch_size=2,
        dp_rank=2,
        dp_size=2,
    )


# ---------------------------------------------------------------------------------------
# 4. Loss scaler
# ---------------------------------------------------------------------------------------


def test_loss_scaler():
    s = LossScaler(8.0, window=3, min_scale=2.0)
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    s.update(True)
    assert s.scale == 2.0  # not below min_scale
    s.update(False)
    s.update(False)
    assert s.scale == 2.0
    s.update(False)
    assert s.scale == 4.0  # `window` clean steps
    s.update(False)
    s.update(False)
    s.update(True)  # an overflow restarts the window
    assert s.scale == 2.0
    s.update(False)
    s.update(False)
    assert s.scale == 2.0
    t = LossScaler(1.0, window=3, min_scale=2.0)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.clean_steps) == (2.0, 2)
    t.update(False)
    assert t.scale == 4.0 and t.clean_steps == 0


# ---------------------------------------------------------------------------------------
# 5. Metrics logger
# ---------------------------------------------------------------------------------------


def _logger(log_dir, start_iter=0, active=True):
    return MetricsLogger(
        active=active,
        log_dir=str(log_dir),
        total_iters=6,
        start_iter=start_iter,
        log_interval=2,
        progress=False,
    )


def _metrics(i):
    return dict(
        loss=5.0 - 0.5 * i,
        lr=1e-3 * i,
        grad_norm=0.25 * i,
        loss_scale=1.0,
        skipped=0.0,
        tokens_per_s=100.0 * i,
        step_ms=3.0,
    )


def test_inactive_logger_writes_nothing(tmp_path, capsys):
    log = _logger(tmp_path / "logs", active=False)
    log.record(1, **_metrics(1))
    log.print("hello")
    log.close()
    assert not (tmp_path / "logs").exists()
    assert capsys.readouterr().out == ""


def test_metrics_csv_plot_and_resume(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    log = _logger(log_dir)
    for i in range(1, 7):
        extra = {"valid_loss": 4.0 - i / 3} if i % 3 == 0 else {}
        log.record(i, **_metrics(i), **extra)
    log.close()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iter")]
    assert [int(line.split()[1].split("/")[0]) for line in printed] == [2, 4, 6]

    csv_path = str(log_dir / "metrics.csv")
    rows = read_metrics(csv_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for i, r in enumerate(rows, 1):
        for k, v in _metrics(i).items():
            assert r[k] == v, (i, k, r[k], v)
        assert (r["valid_loss"] == 4.0 - i / 3) if i % 3 == 0 else math.isnan(r["valid_loss"])

    png = str(tmp_path / "curve.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plot_loss_curve(csv_path, png) is False and not os.path.exists(png)
    else:
        assert plot_loss_curve(csv_path, png) is True
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert not os.path.exists(png + ".tmp.png")

    # Resuming from iteration 4 drops the rows the checkpoint does not cover.
    log = _logger(log_dir, start_iter=4)
    log.record(5, **{**_metrics(5), "loss": 99.0})
    log.close()
    rows = read_metrics(csv_path)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["loss"] == _metrics(4)["loss"] and rows[4]["loss"] == 99.0
    assert rows[2]["valid_loss"] == 3.0

    # A fresh run (start_iter 0) starts the file over.
    log = _logger(log_dir)
    log.close()
    assert read_metrics(csv_path) == []


def test_decay_ending_before_warmup_ends_gives_min_lr():
    common = dict(lr=1.0, min_lr=0.25, warmup_iters=10, decay_iters=5)
    assert [learning_rate(i, style="cosine", **common) for i in (0, 9, 10, 50)] == [
        0.1,
        1.0,
        0.25,
        0.25,
    ]
    assert learning_rate(50, style="constant", **common) == 1.0


# ---------------------------------------------------------------------------------------
# 6. Devices
# ---------------------------------------------------------------------------------------


def test_a_missing_gpu_is_named_before_any_group(monkeypatch):
    import torch
    import torch.distributed as dist

    from tpcore.train import init_distributed

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")  # as under torchrun: no 1-rank job of its own
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    expect_error(RuntimeError, "--device cuda but CUDA is not available", init_distributed, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    expect_error(
        RuntimeError,
        "this rank needs GPU 1 (its local rank) but this host has 1",
        init_distributed,
        "cuda",
    )
    assert not dist.is_initialized()
