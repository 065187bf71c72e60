"""Unit tests of tpcore.train's optimizer on the rank pool against plain PyTorch: the
TP-aware gradient norm, clipping and AdamW vs the dense model, the DP gradient mean, fp32
masters for bf16 models and the fp16 overflow skip agreed across ranks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from checks import (
    GPT_VARIANTS as VARIANTS,
)
from checks import (
    GQA_VARIANTS,
    assert_close,
    param_specs,
    per_rank_tensor,
    setup_tp,
)
from tpcore.models import GPTModel, ReferenceGPT, finalize_sequence_parallel_grads
from tpcore.tensor_parallel.shard_spec import unshard
from tpcore.train import LossScaler, average_data_parallel_grads, grad_norm
from train_checks import BETAS, CLIP, EPS, LRS, WD, make_adamw, tp_dp_groups, train_batch

# ---------------------------------------------------------------------------------------
# 1. TP-aware gradient norm, clipping and AdamW vs the dense model
# ---------------------------------------------------------------------------------------


def _norm_and_adamw(rank, world, tp, variant, sequence_parallel):
    setup_tp(tp, replicas=True)
    tp_group, dp_group = tp_dp_groups()
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    config = dataclasses.replace(
        {**VARIANTS, **GQA_VARIANTS}[variant], sequence_parallel=sequence_parallel
    )
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    torch.manual_seed(0)
    model = GPTModel(config)
    names = [n for n, _ in model.named_parameters()]
    opt = make_adamw(model, config)
    dense_params = dict(dense.named_parameters())
    dense_opt = torch.optim.AdamW(
        [
            {"params": [p for p in dense.parameters() if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in dense.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LRS[0],
        betas=BETAS,
        eps=EPS,
    )
    assert any(p.dim() < 2 for p in dense.parameters()) and any(
        p.dim() >= 2 for p in dense.parameters()
    )
    for step, lr in enumerate(LRS):
        batches = [train_batch(100 * step + r, config) for r in range(dp)]  # one batch per DP rank
        ids, target = batches[dp_rank]
        model(ids, target).backward()
        if sequence_parallel:
            finalize_sequence_parallel_grads(model, tp_group)
        # Dense: the same loss over the DP ranks' batches (equal sizes: mean of means).
        dense(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        dense_norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in dense.parameters()])
        ).item()

        grads = [p.grad for p in model.parameters()]
        average_data_parallel_grads(grads, dp_group)
        for name, g in zip(names, grads):
            assert_close(
                unshard(g, param_specs(model)[name]),
                dense_params[name].grad,
                f"step {step}: DP-mean grad of {name}",
            )
        # Copies of replicated KV heads (GQA with fewer KV heads than TP) count once.
        copies = [param_specs(model)[n].copied_elements() for n in names]
        assert any(copies) == (
            config.num_kv_heads < tp and dist.get_rank(tp_group) % (tp // config.num_kv_heads) != 0
        )
        norm = grad_norm(
            grads,
            [param_specs(model)[n].kind == "replicated" for n in names],
            tp_group,
            copies=copies,
        )
        assert math.isclose(norm, dense_norm, rel_tol=1e-5), (step, norm, dense_norm)
        assert norm > CLIP, "the test must exercise clipping"

        got_norm, skipped = opt.step(lr, CLIP)
        assert not skipped and math.isclose(got_norm, dense_norm, rel_tol=1e-5), (
            got_norm,
            dense_norm,
        )
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
    "tp,variant,sequence_parallel",
    [
        (1, "gpt2", False),
        (2, "llama", False),
        (2, "gpt2", True),
        (4, "llama", True),
        (4, "llama_kv2", True),
        (2, "llama_kv1", False),
    ],
    ids=[
        "tp1-gpt2",
        "tp2-llama",
        "tp2-gpt2-sp",
        "tp4-llama-sp",
        "tp4-llama-kv2-sp",
        "tp2-llama-kv1",
    ],
)
def test_grad_norm_clipping_and_adamw_match_dense(cpu_ranks, tp, variant, sequence_parallel):
    cpu_ranks.run(_norm_and_adamw, tp, variant, sequence_parallel)


def _dp_average(rank, world):
    setup_tp(2, replicas=True)
    _, dp_group = tp_dp_groups()
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
# 2. fp32 masters (bf16) and the agreed fp16 overflow skip (rank pool)
# ---------------------------------------------------------------------------------------


def _bf16_masters(rank, world):
    setup_tp(2, replicas=True)
    config = VARIANTS["gpt2"]
    torch.manual_seed(0)
    model = GPTModel(config, dtype=torch.bfloat16)
    opt = make_adamw(model, config)
    assert all(m.dtype == torch.float32 for m in opt.masters)
    assert all(torch.equal(m, p.float()) for p, m in zip(model.parameters(), opt.masters))
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(
        [
            {"params": [r for r in ref if r.dim() >= 2], "weight_decay": WD},
            {"params": [r for r in ref if r.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LRS[0],
        betas=BETAS,
        eps=EPS,
    )
    for step, lr in enumerate(LRS[:2]):
        ids, target = train_batch(
            step, config
        )  # the same batch on every DP rank: the DP mean is exact
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
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), (
                "model weight is not the bf16 rounding of its master"
            )
    # The masters keep the bits bf16 drops (they are not re-read from the bf16 weights).
    assert any((m != m.to(torch.bfloat16).float()).any() for m in opt.masters)


def test_bf16_model_has_fp32_masters(cpu_ranks):
    cpu_ranks.run(_bf16_masters)


def _fp16_skip(rank, world, inf_param, inf_rank):
    setup_tp(2, replicas=True)
    config = VARIANTS["gpt2"]
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    torch.manual_seed(0)
    model = GPTModel(config, dtype=torch.float16)
    opt = make_adamw(model, config, loss_scaler=LossScaler(2.0**10, window=1000))
    ids, target = train_batch(0, config)
    (model(ids, target) * opt.loss_scale).backward()
    if rank == inf_rank:
        dict(model.named_parameters())[inf_param].grad.view(-1)[3] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.masters]
    norm, skipped = opt.step(LRS[0], 1.0)
    assert skipped and not math.isfinite(norm)
    assert opt.loss_scale == 2.0**9
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), (
        "a skipped step changed the weights"
    )
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, masters))
    assert all(p.grad is None for p in model.parameters())
    assert not opt.adam.state, "a skipped step must not start the AdamW moments"

    # A clean step: the norm is of the unscaled gradients (fp16 vs the fp32 dense model).
    (model(ids, target) * opt.loss_scale).backward()
    dense(ids, target).backward()
    dense_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in dense.parameters()])
    ).item()
    norm, skipped = opt.step(LRS[0], 1.0)
    assert not skipped and opt.loss_scale == 2.0**9
    assert math.isclose(norm, dense_norm, rel_tol=2e-2), (norm, dense_norm)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(
        torch.equal(p.detach(), m.detach().half()) for p, m in zip(model.parameters(), opt.masters)
    )
    return skipped


@pytest.mark.parametrize(
    "param,inf_rank",
    [
        (
            "layers.0.attention.qkv.weight",
            0,
        ),  # TP-sharded; DP spreads the inf to the DP peer, the norm to the TP peers
        ("layers.0.attention.qkv.weight", 3),
        ("final_norm.weight", 1),  # replicated, on a TP rank whose copy the norm does not count
        ("final_norm.weight", 3),
    ],
)
def test_fp16_overflow_on_one_rank_skips_everywhere(cpu_ranks, param, inf_rank):
    assert cpu_ranks.run(_fp16_skip, param, inf_rank) == [False] * 4
