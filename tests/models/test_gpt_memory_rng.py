"""Model-parallel RNG, activation recompute (same masks, same grads) and its memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import assert_close, expect_error, setup_tp
from tpcore.models import GPTConfig, GPTModel, finalize_sequence_parallel_grads

CONFIG = GPTConfig(
    vocab_size=50,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    max_position_embeddings=32,
    make_vocab_size_divisible_by=4,
    dropout=0.1,
    attention_dropout=0.1,
)


def _gather(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


def _rng(rank, world):
    # world 4: TP groups {0,1}, {2,3}; DP replicas share a TP rank
    tp_rank, tp = setup_tp(2, replicas=True)
    tpcore.get_rng_tracker().reset()  # the pooled ranks keep earlier tests' seeds
    expect_error(
        RuntimeError,
        "model_parallel_manual_seed",
        lambda: tpcore.get_rng_tracker().fork().__enter__(),
    )
    tpcore.model_parallel_manual_seed(123)
    default = _gather(torch.rand(4))
    assert all(torch.equal(d, default[0]) for d in default), "default RNG must match on every rank"
    with tpcore.get_rng_tracker().fork():
        forked = _gather(torch.rand(4))
    after_fork = torch.rand(4)
    assert not torch.equal(forked[0], forked[1]), (
        "TP ranks must draw different model-parallel numbers"
    )
    assert torch.equal(forked[0], forked[2]) and torch.equal(forked[1], forked[3]), (
        "DP replicas must agree"
    )
    torch.manual_seed(123)
    torch.rand(4)
    assert torch.equal(after_fork, torch.rand(4)), (
        "fork must leave the default generator where it was"
    )


def test_model_parallel_rng(cpu_ranks):
    cpu_ranks.run(_rng)


def _loss_and_grads(config, ids, target):
    tpcore.model_parallel_manual_seed(5)
    model = GPTModel(config)
    loss = model(ids, target)
    loss.backward()
    if config.sequence_parallel:
        finalize_sequence_parallel_grads(model)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _recompute_same_result(rank, world, sp):
    setup_tp(2, replicas=True)
    g = torch.Generator().manual_seed(0)
    ids, target = (
        torch.randint(0, 50, (2, 16), generator=g),
        torch.randint(0, 50, (2, 16), generator=g),
    )
    base = dataclasses.replace(CONFIG, sequence_parallel=sp)
    ref_loss, ref_grads = _loss_and_grads(base, ids, target)
    for mode in ("selective", "full"):
        loss, grads = _loss_and_grads(dataclasses.replace(base, recompute=mode), ids, target)
        assert_close(loss, ref_loss, f"{mode}: loss with dropout")
        for name, grad in grads.items():
            assert_close(grad, ref_grads[name], f"{mode}: grad of {name}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_recompute_replays_dropout(cpu_ranks, sp):
    cpu_ranks.run(_recompute_same_result, sp)


def _saved_bytes(config, ids, target) -> int:
    """Bytes of distinct storages autograd saves during one forward."""
    tpcore.model_parallel_manual_seed(5)
    model = GPTModel(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.device.type != "meta":
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, target)
    return sum(saved.values())


def _activation_memory(rank, world):
    setup_tp(2, replicas=True)
    config = dataclasses.replace(CONFIG, num_layers=4, hidden_size=64, max_position_embeddings=128)
    ids = torch.randint(0, 50, (2, 128), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for sp in (False, True):
        for mode in ("none", "selective", "full"):
            sizes[(sp, mode)] = _saved_bytes(
                dataclasses.replace(config, sequence_parallel=sp, recompute=mode), ids, ids
            )
    for sp in (False, True):
        assert sizes[(sp, "none")] > sizes[(sp, "selective")] > sizes[(sp, "full")], sizes
    assert sizes[(True, "none")] < sizes[(False, "none")], sizes
    return sizes


def test_recompute_and_sequence_parallel_save_activation_memory(cpu_ranks):
    sizes = cpu_ranks.run(_activation_memory)[0]
    print("saved activation bytes per rank (TP=2):", sizes)
