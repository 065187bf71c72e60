"""GPTModel with context parallelism against ReferenceGPT (plain PyTorch, whole sequences)
computed in the same job: the loss (the same on every CP rank) and every parameter's
gradient once summed over the data-and-context group, for each comm type at CP 4, CP 2 x
DP 2, TP 2 x CP 2 with sequence parallelism, GQA, 3 heads, qk-norm, recompute, learned
positions, the fused head + loss, MoE layers (balancing and z losses, EP 2); per-token
losses are each rank's slice; decoding; torch.compile. Bad configurations
raise on every rank before any collective."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcore
from checks import TINY_LLAMA as BASE
from checks import assert_close, expect_error
from tpcore import parallel_state
from tpcore.context_parallel import slice_sequence
from tpcore.models import GPTModel, ReferenceGPT
from tpcore.models.kv_cache import KVCache
from tpcore.tensor_parallel.shard_spec import shard, shard_spec

# balancing and z losses count the tokens of all TP x CP ranks
MOE = dict(
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_aux_loss_coeff=0.1,
    moe_z_loss_coeff=0.01,
)


def _batch(dp_rank: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + dp_rank)
    ids = torch.randint(0, BASE.vocab_size, (2, seq), generator=g)
    target = torch.randint(0, BASE.vocab_size, (2, seq), generator=g)
    target[0, 3] = -100  # ignored: the mean counts the group's tokens, not each rank's
    return ids, target


def _check(rank, world, case):
    tp, cp, seq = case["tp"], case["cp"], case["seq"]
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(
        tp, context_parallel_size=cp, expert_model_parallel_size=case.get("ep", 1)
    )
    config = dataclasses.replace(BASE, **case.get("config", {}))
    dp = world // (tp * cp)
    torch.manual_seed(0)
    ref = ReferenceGPT(config)
    total = sum(ref(*_batch(d, seq)) + ref.aux_loss() for d in range(dp))
    total.backward()
    torch.manual_seed(0)
    model = GPTModel(config)
    assert model.cp_size == cp
    cp_rank = parallel_state.get_context_parallel_rank()
    ids, target = _batch(parallel_state.get_data_parallel_rank(), seq)
    ids, target = (slice_sequence(t, 1, cp, cp_rank) for t in (ids, target))
    loss = model(ids, target)
    loss.backward()
    tpcore.sum_partial_grads(model, parallel_state.get_tensor_model_parallel_group())
    for p in model.parameters():  # as the trainer: shares summed over DP x CP
        expert = shard_spec(p).axis == "expert" and model.expert_group is not None
        group = (
            parallel_state.get_expert_data_parallel_group()
            if expert
            else parallel_state.get_data_context_parallel_group()
        )
        dist.all_reduce(p.grad, group=group)
    want = ref(*_batch(parallel_state.get_data_parallel_rank(), seq))
    assert_close(loss.detach(), want.detach(), f"{case} loss")
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, shard(named[name].grad, p.shard_spec), f"{case} {name} grad")
    if case.get("per_token"):  # reduction="none": this rank's tokens
        mine = model(ids, target, reduction="none")
        ids_all, target_all = _batch(parallel_state.get_data_parallel_rank(), seq)
        logits = ref(ids_all).float()
        full = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target_all.reshape(-1), reduction="none"
        ).view(target_all.shape)
        assert_close(mine.detach(), slice_sequence(full.detach(), 1, cp, cp_rank), "per token")
    return True


CASES = [
    dict(tp=1, cp=4, seq=16, config=dict(cp_comm_type="p2p"), per_token=True),
    dict(tp=1, cp=4, seq=24, config=dict(cp_comm_type="a2a")),
    dict(tp=1, cp=4, seq=8, config=dict(cp_comm_type="allgather", num_kv_heads=1)),
    dict(
        tp=1,
        cp=2,
        seq=12,
        config=dict(cp_comm_type="allgather", num_attention_heads=3, num_kv_heads=1, kv_channels=8),
    ),
    dict(
        tp=1,
        cp=2,
        seq=12,
        config=dict(
            cp_comm_type="p2p",
            position_embedding="learned",
            norm="layernorm",
            activation="gelu",
            bias=True,
            num_attention_heads=2,
            num_kv_heads=None,
            recompute="selective",
            fused_lm_head_loss=True,
        ),
    ),
    dict(  # OLMoE's q / k norms over the whole projection, summed over TP
        tp=2,
        cp=2,
        seq=12,
        config=dict(
            cp_comm_type="p2p", sequence_parallel=True, qk_norm=True, qk_norm_scope="projection"
        ),
    ),
    dict(
        tp=2,
        cp=2,
        seq=8,
        config=dict(cp_comm_type="a2a", sequence_parallel=True, qk_norm=True, recompute="full"),
    ),
    dict(tp=2, cp=2, seq=8, config=dict(cp_comm_type="allgather", sequence_parallel=True, **MOE)),
    dict(tp=1, cp=2, ep=2, seq=12, config=dict(cp_comm_type="p2p", **MOE)),
]


def _all_cases(rank, world):
    return all(_check(rank, world, case) for case in CASES)


def test_context_parallel_gpt_equals_the_reference(cpu_ranks):
    assert all(cpu_ranks.run(_all_cases))


def _bad_input(rank, world):
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(2, context_parallel_size=2)
    expect_error(
        ValueError,
        "attention_dropout (0.1) with context-parallel size 2",
        GPTModel,
        dataclasses.replace(BASE, attention_dropout=0.1),
    )
    expect_error(
        ValueError,
        "heads must be divisible by tensor-parallel size x context-parallel size",
        GPTModel,
        dataclasses.replace(BASE, num_attention_heads=2, num_kv_heads=2, cp_comm_type="a2a"),
    )
    torch.manual_seed(0)
    model = GPTModel(BASE)
    # 3 tokens per rank: the sequence (6) is not two chunks per CP rank
    expect_error(
        ValueError,
        "not divisible by 2 x context-parallel size (4)",
        model,
        torch.zeros(2, 3, dtype=torch.long),
    )
    expect_error(
        ValueError, "max_position_embeddings 32", model, torch.zeros(2, 20, dtype=torch.long)
    )
    # Decoding is not split: every CP rank decodes the whole prompt (the trainer's sample).
    torch.manual_seed(0)
    ref = ReferenceGPT(BASE)
    prompt = torch.randint(0, BASE.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.decode(prompt, KVCache(8))
        want = ref(prompt)[:, -1]
    assert_close(got, want.chunk(2, -1)[parallel_state.get_tensor_model_parallel_rank()], "decode")
    return model(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, 32)


def test_bad_input_raises_on_every_rank(cpu_ranks):
    assert all(cpu_ranks.run(_bad_input))


def test_bad_comm_type_raises():
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        dataclasses.replace(BASE, cp_comm_type="ring")


def _compiled(rank, world, comm):
    """torch.compile (aot_eager; attention under CP is a graph break) gives eager's loss and
    gradients at CP 2 x TP 2. One layer: a graph before the break and one after it (each
    more layer adds two graphs of the same code)."""
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(2, context_parallel_size=2)
    config = dataclasses.replace(BASE, cp_comm_type=comm, sequence_parallel=True, num_layers=1)
    torch.manual_seed(0)
    model = GPTModel(config)
    ids, target = (
        slice_sequence(t, 1, 2, parallel_state.get_context_parallel_rank()) for t in _batch(0, 8)
    )
    eager = model(ids, target)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")(ids, target)
    compiled.backward()
    assert_close(compiled.detach(), eager.detach(), f"{comm} compiled loss")
    for n, p in model.named_parameters():
        assert_close(p.grad, grads[n], f"{comm} compiled {n} grad")
    return True


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_compiled_context_parallel_gpt_matches_eager(cpu_ranks, comm):
    assert all(cpu_ranks.run(_compiled, comm))
