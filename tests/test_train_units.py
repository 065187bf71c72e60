"""Unit tests of tpcore.train's pieces against plain PyTorch and closed forms: arguments,
the lr schedule, the DP sampler, loss scaling, TP-aware norm/clipping/AdamW on the rank
pool, fp32 masters and the agreed fp16 skip, checkpoints (atomicity, errors, resharding),
metrics files. The end-to-end training runs are in test_train.py."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from checks import GPT_VARIANTS as VARIANTS, assert_close, expect_error, per_rank_tensor, setup_tp
from tpcore import parallel_state
from tpcore.data.sampler import micro_batch_indices
from tpcore.models import GPTConfig, GPTModel, ReferenceGPT, finalize_sequence_parallel_grads
from tpcore.models.sharding import rule_for, unshard
from tpcore.train import (
    CheckpointError, LossScaler, MetricsLogger, ParallelAdamW, TrainArgs, average_data_parallel_grads, grad_norm,
    learning_rate, load_checkpoint, load_dense_state_dict, parse_args, plot_loss_curve, read_metrics, save_checkpoint,
)

# ---------------------------------------------------------------------------------------
# 1. Arguments
# ---------------------------------------------------------------------------------------


def test_defaults_parse():
    args = parse_args([])
    assert args == TrainArgs()
    assert (args.micro_batch_size, args.lr, args.lr_decay_style, args.progress, args.bf16) == (4, 3e-4, "cosine", True, False)
    assert args.global_batch_size is None and args.lr_decay_iters is None


def test_flag_overrides_json_overrides_default(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"micro-batch-size": 2, "lr": 0.01, "num_layers": 3, "norm": "rmsnorm", "progress": False}))
    args = parse_args(["--config", str(cfg), "--micro-batch-size", "8", "--progress"])
    assert args.micro_batch_size == 8  # flag beats file
    assert args.lr == 0.01 and args.num_layers == 3 and args.norm == "rmsnorm"  # file beats default
    assert args.progress is True  # bool flag beats file
    assert args.hidden_size == 256 and args.seq_length == 128  # defaults elsewhere


def test_flag_overrides_yaml_overrides_default(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("hidden-size: 64\nnum_attention_heads: 4\nmin-lr: 1.0e-5\nlr: 2.0e-3\nbf16: true\nseed: 9\n")
    args = parse_args(["--seed", "11", "--config", str(cfg)])
    assert (args.hidden_size, args.num_attention_heads, args.min_lr, args.lr, args.bf16) == (64, 4, 1e-5, 2e-3, True)
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
        (["--hidden-size", "30", "--num-attention-heads", "8"], "hidden_size 30 is not divisible by num_attention_heads 8"),
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
    expect_error(FileNotFoundError, "does not exist", parse_args, ["--config", str(tmp_path / "none.yaml")])


def test_model_config_mapping():
    a = TrainArgs(untie_embeddings=True, disable_bias=True, seq_length=64, hidden_size=48, num_attention_heads=6, num_kv_heads=3,
                  norm="rmsnorm", activation="swiglu", position_embedding="rotary", ffn_hidden_size=80, sequence_parallel=True, recompute="full")
    c = a.model_config(300)
    assert c.tie_embeddings is False and c.bias is False
    assert c.max_position_embeddings == 64 and c.vocab_size == 300
    assert (c.hidden_size, c.num_attention_heads, c.num_kv_heads, c.ffn_hidden_size) == (48, 6, 3, 80)
    assert (c.norm, c.activation, c.position_embedding, c.sequence_parallel, c.recompute) == ("rmsnorm", "swiglu", "rotary", True, "full")
    d = TrainArgs(seq_length=64, max_position_embeddings=256).model_config()
    assert d.max_position_embeddings == 256 and d.tie_embeddings and d.bias and d.ffn_hidden_size == 4 * 256


# ---------------------------------------------------------------------------------------
# 2. Learning-rate schedule
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_learning_rate_schedule(style):
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 10, 50
    for i in range(80):
        got = learning_rate(i, lr=lr, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay, style=style)
        if i < warmup:
            want = lr * (i + 1) / warmup
        elif style == "constant":
            want = lr
        elif i >= decay:
            want = min_lr
        else:
            t = (i - warmup) / (decay - warmup)
            want = min_lr + (lr - min_lr) * (1 - t if style == "linear" else (1 + math.cos(math.pi * t)) / 2)
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), (style, i, got, want)
    assert learning_rate(warmup - 1, lr=lr, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay, style=style) == lr


def test_learning_rate_without_warmup_and_bad_style():
    assert learning_rate(0, lr=2.0, min_lr=0.5, warmup_iters=0, decay_iters=4, style="linear") == 2.0
    assert learning_rate(2, lr=2.0, min_lr=0.5, warmup_iters=0, decay_iters=4, style="linear") == 1.25
    assert learning_rate(4, lr=2.0, min_lr=0.5, warmup_iters=0, decay_iters=4, style="cosine") == 0.5
    expect_error(ValueError, "unknown lr decay style 'exp'", learning_rate, 5, lr=1.0, min_lr=0.0, warmup_iters=2, decay_iters=10, style="exp")


# ---------------------------------------------------------------------------------------
# 3. Data-parallel sampler
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("global_batch,micro,dp", [(8, 2, 2), (12, 1, 3), (16, 4, 1), (24, 2, 4), (6, 3, 2), (4, 1, 4)])
def test_micro_batches_cover_the_global_batch_once(global_batch, micro, dp):
    for step in (0, 1, 7):
        seen = []
        for m in range(global_batch // (micro * dp)):
            for r in range(dp):
                idx = micro_batch_indices(step, m, global_batch_size=global_batch, micro_batch_size=micro, dp_rank=r, dp_size=dp)
                assert len(idx) == micro
                seen.extend(idx)
        assert len(seen) == len(set(seen)) == global_batch
        assert sorted(seen) == list(range(step * global_batch, (step + 1) * global_batch))


def test_sampler_rejects_bad_sizes():
    expect_error(ValueError, "not divisible", micro_batch_indices, 0, 0, global_batch_size=10, micro_batch_size=2, dp_rank=0, dp_size=3)
    expect_error(ValueError, "not divisible", micro_batch_indices, 0, 0, global_batch_size=6, micro_batch_size=4, dp_rank=0, dp_size=1)
    expect_error(ValueError, "out of range", micro_batch_indices, 0, 2, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2)
    expect_error(ValueError, "out of range", micro_batch_indices, 0, 0, global_batch_size=8, micro_batch_size=2, dp_rank=2, dp_size=2)


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
# 5. TP-aware gradient norm, clipping and AdamW vs the dense model (rank pool)
# ---------------------------------------------------------------------------------------

BATCH, SEQ = 2, 8
BETAS, EPS, WD, CLIP = (0.9, 0.95), 1e-3, 0.1, 0.05
LRS = [1e-2, 5e-3, 2e-2]


def _batch(seed: int, config: GPTConfig, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, SEQ), generator=g), torch.randint(0, config.vocab_size, (batch, SEQ), generator=g)


def _groups():
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group()


def _optimizer(model, config, **kw):
    tp_group, dp_group = _groups()
    return ParallelAdamW(model, is_replicated=lambda n: rule_for(n, config)[0] == "replicated", tp_group=tp_group, dp_group=dp_group,
                         lr=LRS[0], weight_decay=WD, betas=BETAS, eps=EPS, **kw)


def _norm_and_adamw(rank, world, tp, variant, sequence_parallel):
    setup_tp(tp)
    tp_group, dp_group = _groups()
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    config = dataclasses.replace(VARIANTS[variant], sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    torch.manual_seed(0)
    model = GPTModel(config)
    names = [n for n, _ in model.named_parameters()]
    opt = _optimizer(model, config)
    dense_params = dict(dense.named_parameters())
    dense_opt = torch.optim.AdamW(
        [{"params": [p for p in dense.parameters() if p.dim() >= 2], "weight_decay": WD},
         {"params": [p for p in dense.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=LRS[0], betas=BETAS, eps=EPS,
    )
    assert any(p.dim() < 2 for p in dense.parameters()) and any(p.dim() >= 2 for p in dense.parameters())
    for step, lr in enumerate(LRS):
        batches = [_batch(100 * step + r, config) for r in range(dp)]  # one batch per DP rank
        ids, target = batches[dp_rank]
        model(ids, target).backward()
        if sequence_parallel:
            finalize_sequence_parallel_grads(model, tp_group)
        # Dense: the same loss over the DP ranks' batches (equal sizes: mean of means).
        dense(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        dense_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in dense.parameters()])).item()

        grads = [p.grad for p in model.parameters()]
        average_data_parallel_grads(grads, dp_group)
        for name, g in zip(names, grads):
            assert_close(unshard(g, rule_for(name, config), tp_group, config.vocab_size), dense_params[name].grad, f"step {step}: DP-mean grad of {name}")
        norm = grad_norm(grads, [rule_for(n, config)[0] == "replicated" for n in names], tp_group)
        assert math.isclose(norm, dense_norm, rel_tol=1e-5), (step, norm, dense_norm)
        assert norm > CLIP, "the test must exercise clipping"

        got_norm, skipped = opt.step(lr, CLIP)
        assert not skipped and math.isclose(got_norm, dense_norm, rel_tol=1e-5), (got_norm, dense_norm)
        assert all(p.grad is None for p in model.parameters())
        torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP)
        for group in dense_opt.param_groups:
            group["lr"] = lr
        dense_opt.step()
        dense_opt.zero_grad(set_to_none=True)
    got = dict(model.to_dense().named_parameters())
    for name, p in dense.named_parameters():
        assert_close(got[name].detach(), p.detach(), f"after {len(LRS)} AdamW steps: {name}")


@pytest.mark.parametrize(
    "tp,variant,sequence_parallel", [(1, "gpt2", False), (2, "llama", False), (2, "gpt2", True), (4, "llama", True)],
    ids=["tp1-gpt2", "tp2-llama", "tp2-gpt2-sp", "tp4-llama-sp"],
)
def test_grad_norm_clipping_and_adamw_match_dense(cpu_ranks, tp, variant, sequence_parallel):
    cpu_ranks.run(_norm_and_adamw, tp, variant, sequence_parallel)


def _dp_average(rank, world):
    setup_tp(2)
    _, dp_group = _groups()
    members = dist.get_process_group_ranks(dp_group)
    assert len(members) == 2 and rank in members
    shapes = [(3, 5), (7,), (2, 2, 2)]
    grads = [per_rank_tensor(s, rank, seed=i) for i, s in enumerate(shapes)]
    average_data_parallel_grads(grads, dp_group)
    for i, (g, s) in enumerate(zip(grads, shapes)):
        want = sum(per_rank_tensor(s, r, seed=i) for r in members) / len(members)
        assert_close(g, want, f"DP mean of gradient {i}")
        other = per_rank_tensor(s, rank ^ 1, seed=i)  # the TP partner does not take part
        assert not torch.allclose(g, (per_rank_tensor(s, rank, seed=i) + other) / 2)


def test_average_data_parallel_grads(cpu_ranks):
    cpu_ranks.run(_dp_average)


# ---------------------------------------------------------------------------------------
# 6. fp32 masters (bf16) and the agreed fp16 overflow skip (rank pool)
# ---------------------------------------------------------------------------------------


def _bf16_masters(rank, world):
    setup_tp(2)
    config = VARIANTS["gpt2"]
    torch.manual_seed(0)
    model = GPTModel(config, dtype=torch.bfloat16)
    opt = _optimizer(model, config)
    assert all(m.dtype == torch.float32 for m in opt.masters)
    assert all(torch.equal(m, p.float()) for p, m in zip(model.parameters(), opt.masters))
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW([{"params": [r for r in ref if r.dim() >= 2], "weight_decay": WD},
                                 {"params": [r for r in ref if r.dim() < 2], "weight_decay": 0.0}], lr=LRS[0], betas=BETAS, eps=EPS)
    for step, lr in enumerate(LRS[:2]):
        ids, target = _batch(step, config)  # the same batch on every DP rank: the DP mean is exact
        model(ids, target).backward()
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float().clone()
        _, skipped = opt.step(lr, 0.0)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        assert not skipped
        for p, m, r in zip(model.parameters(), opt.masters, ref):
            assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
            assert_close(m.detach(), r.detach(), f"step {step}: fp32 master")
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), "model weight is not the bf16 rounding of its master"
    # The masters keep the bits bf16 drops (they are not re-read from the bf16 weights).
    assert any((m != m.to(torch.bfloat16).float()).any() for m in opt.masters)


def test_bf16_model_has_fp32_masters(cpu_ranks):
    cpu_ranks.run(_bf16_masters)


def _fp16_skip(rank, world, inf_param, inf_rank):
    setup_tp(2)
    config = VARIANTS["gpt2"]
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    torch.manual_seed(0)
    model = GPTModel(config, dtype=torch.float16)
    opt = _optimizer(model, config, loss_scaler=LossScaler(2.0**10, window=1000))
    ids, target = _batch(0, config)
    (model(ids, target) * opt.loss_scale).backward()
    if rank == inf_rank:
        dict(model.named_parameters())[inf_param].grad.view(-1)[3] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.masters]
    norm, skipped = opt.step(LRS[0], 1.0)
    assert skipped and not math.isfinite(norm)
    assert opt.loss_scale == 2.0**9
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a skipped step changed the weights"
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, masters))
    assert all(p.grad is None for p in model.parameters())
    assert not opt.adam.state, "a skipped step must not start the AdamW moments"

    # A clean step: the norm is of the unscaled gradients (fp16 vs the fp32 dense model).
    (model(ids, target) * opt.loss_scale).backward()
    dense(ids, target).backward()
    dense_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in dense.parameters()])).item()
    norm, skipped = opt.step(LRS[0], 1.0)
    assert not skipped and opt.loss_scale == 2.0**9
    assert math.isclose(norm, dense_norm, rel_tol=2e-2), (norm, dense_norm)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(p.detach(), m.detach().half()) for p, m in zip(model.parameters(), opt.masters))
    return skipped


@pytest.mark.parametrize(
    "param,inf_rank",
    [
        ("layers.0.attention.qkv.weight", 0),  # TP-sharded; DP spreads the inf to the DP peer, the norm to the TP peers
        ("layers.0.attention.qkv.weight", 3),
        ("final_norm.weight", 1),  # replicated, on a TP rank whose copy the norm does not count
        ("final_norm.weight", 3),
    ],
)
def test_fp16_overflow_on_one_rank_skips_everywhere(cpu_ranks, param, inf_rank):
    assert cpu_ranks.run(_fp16_skip, param, inf_rank) == [False] * 4


# ---------------------------------------------------------------------------------------
# 7. Checkpoints (rank pool: world 4 = TP 2 x DP 2)
# ---------------------------------------------------------------------------------------

CKPT_CONFIG = VARIANTS["llama"]


def _make(config, seed):
    torch.manual_seed(seed)
    model = GPTModel(config)
    return model, _optimizer(model, config)


def _train_steps(model, opt, steps, first=0):
    for step in range(first, first + steps):
        ids, target = _batch(10 + step, model.config)
        model(ids, target).backward()
        opt.step(LRS[step % len(LRS)], CLIP)


def _dense_optimizer_state(opt, config, tp_group):
    out = {}
    for name, entry in opt.state_dict()["params"].items():
        for key, value in entry.items():
            out[f"{name}/{key}"] = value.clone() if key == "step" else unshard(value, rule_for(name, config), tp_group, config.vocab_size)
    return out


def _barrier_after(rank, fn):
    if rank == 0:
        fn()
    dist.barrier()


def _ckpt_save_and_errors(rank, world, root):
    setup_tp(2)
    tp_group, dp_group = _groups()
    config = CKPT_CONFIG
    save = os.path.join(root, "save")
    model, opt = _make(config, 0)
    _train_steps(model, opt, 2)
    path = save_checkpoint(save, 2, model, opt, consumed_samples=8, tp_group=tp_group, dp_group=dp_group, extra={"note": "unit"})
    assert path == os.path.join(save, "iter_0000002")
    if rank == 0:
        assert sorted(os.listdir(path)) == ["metadata.json", "model_tp00_pp00.pt", "model_tp01_pp00.pt"] + [f"rng_rank{r:05d}.pt" for r in range(4)]
        ref = {"model": {n: p.detach().clone() for n, p in model.to_dense().named_parameters()}}
    else:
        model.to_dense()  # a collective
    ref_opt = _dense_optimizer_state(opt, config, tp_group)
    if rank == 0:
        ref["optimizer"] = ref_opt
        torch.save(ref, os.path.join(root, "dense_ref.pt"))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())

    # Round trip into a freshly initialised model and optimizer.
    model2, opt2 = _make(config, 1)
    assert not torch.equal(model2.layers[0].attention.qkv.weight, model.layers[0].attention.qkv.weight)
    meta = load_checkpoint(save, model2, opt2, tp_group=tp_group)
    assert (meta["iteration"], meta["consumed_samples"], meta["note"], meta["tensor_parallel_size"]) == (2, 8, "unit", 2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, saved_model[k]), k
    loaded = opt2.state_dict()["params"]
    assert set(loaded) == set(saved_opt["params"])
    for name, entry in saved_opt["params"].items():
        assert set(loaded[name]) == set(entry) == {"exp_avg", "exp_avg_sq", "step"}, (name, set(loaded[name]))
        for key, value in entry.items():
            assert torch.equal(loaded[name][key], value), (name, key)
    _train_steps(model, opt, 1, first=2)  # the restored state continues identically
    _train_steps(model2, opt2, 1, first=2)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), f"step after restore differs: {n}"

    # A save killed before its rename leaves iter_N.tmp/: load ignores it, the next save removes it.
    leftover = os.path.join(save, "iter_0000009.tmp")

    def make_leftover():
        os.makedirs(leftover)
        with open(os.path.join(leftover, "model_tp00_pp00.pt"), "wb") as f:
            f.write(b"partial")

    _barrier_after(rank, make_leftover)
    model3, opt3 = _make(config, 2)
    assert load_checkpoint(save, model3, opt3, tp_group=tp_group)["iteration"] == 2
    save_checkpoint(save, 3, model, opt, consumed_samples=12, tp_group=tp_group, dp_group=dp_group)
    assert not os.path.exists(leftover)
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000003", "latest"]
    with open(os.path.join(save, "latest")) as f:
        assert f.read().strip() == "iter_0000003"

    # `latest` naming a directory that is not there, and a directory with no checkpoint.
    dangling, empty = os.path.join(root, "dangling"), os.path.join(root, "empty")

    def make_dangling():
        os.makedirs(dangling)
        os.makedirs(empty)
        with open(os.path.join(dangling, "latest"), "w") as f:
            f.write("iter_0000042\n")

    _barrier_after(rank, make_dangling)
    expect_error(CheckpointError, "not a complete checkpoint", load_checkpoint, dangling, model3, opt3, tp_group=tp_group)
    expect_error(CheckpointError, "no checkpoint in", load_checkpoint, empty, model3, opt3, tp_group=tp_group)

    # A truncated shard: every rank reads it (TP rank 1 for the replicated parameters) and names it.
    corrupt = os.path.join(root, "corrupt")
    bad_file = os.path.join(corrupt, "model_tp00_pp00.pt")

    def make_corrupt():
        shutil.copytree(path, corrupt)
        size = os.path.getsize(bad_file)
        with open(bad_file, "r+b") as f:
            f.truncate(size // 2)

    _barrier_after(rank, make_corrupt)
    expect_error(CheckpointError, f"{bad_file} is corrupt", load_checkpoint, corrupt, model3, opt3, tp_group=tp_group)

    # Another model shape: every differing field is listed.
    narrow = GPTModel(dataclasses.replace(config, hidden_size=32))
    expect_error(CheckpointError, "hidden_size: checkpoint 64, model 32", load_checkpoint, path, narrow, tp_group=tp_group)
    dist.barrier()


@pytest.fixture(scope="module")
def tp2_checkpoint(cpu_ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    cpu_ranks.run(_ckpt_save_and_errors, root)
    return root


def test_checkpoint_round_trip_and_errors(tp2_checkpoint):
    assert os.path.isfile(os.path.join(tp2_checkpoint, "dense_ref.pt"))


def _ckpt_reshard(rank, world, root, tp):
    setup_tp(tp)
    tp_group, _ = _groups()
    config = CKPT_CONFIG
    model, opt = _make(config, 3)
    meta = load_checkpoint(os.path.join(root, "save", "iter_0000002"), model, opt, tp_group=tp_group)
    assert meta["tensor_parallel_size"] == 2 and meta["iteration"] == 2
    ref = torch.load(os.path.join(root, "dense_ref.pt"))
    dense = dict(model.to_dense().named_parameters())
    assert set(dense) == set(ref["model"])
    for name, want in ref["model"].items():
        assert torch.equal(dense[name].detach(), want), f"TP={tp}: {name}"
    got = _dense_optimizer_state(opt, config, tp_group)
    assert set(got) == set(ref["optimizer"])
    for key, want in ref["optimizer"].items():
        assert torch.equal(got[key], want), f"TP={tp}: optimizer {key}"


@pytest.mark.parametrize("tp", [1, 4])
def test_tp2_checkpoint_loads_at_other_tp_sizes(cpu_ranks, tp2_checkpoint, tp):
    cpu_ranks.run(_ckpt_reshard, tp2_checkpoint, tp)


def test_load_dense_state_dict(tp2_checkpoint):
    config, state = load_dense_state_dict(os.path.join(tp2_checkpoint, "save", "iter_0000002"))
    assert config == CKPT_CONFIG
    ref = torch.load(os.path.join(tp2_checkpoint, "dense_ref.pt"))["model"]
    assert set(state) == set(ref)
    for name, want in ref.items():
        assert torch.equal(state[name], want), name
    ReferenceGPT(config).load_state_dict(state)  # the names and shapes of the dense model


# ---------------------------------------------------------------------------------------
# 8. Metrics logger
# ---------------------------------------------------------------------------------------


def _logger(log_dir, start_iter=0, active=True):
    return MetricsLogger(active=active, log_dir=str(log_dir), total_iters=6, start_iter=start_iter, log_interval=2, progress=False)


def _metrics(i):
    return dict(loss=5.0 - 0.5 * i, lr=1e-3 * i, grad_norm=0.25 * i, loss_scale=1.0, skipped=0.0, tokens_per_s=100.0 * i, step_ms=3.0)


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
    assert [learning_rate(i, style="cosine", **common) for i in (0, 9, 10, 50)] == [0.1, 1.0, 0.25, 0.25]
    assert learning_rate(50, style="constant", **common) == 1.0
