"""GPTModel with MoE layers (a dense first layer, then experts with a gated shared expert,
balancing and z losses) against ReferenceGPT, plain PyTorch with every expert on one rank,
computed in the same job: the loss and every parameter's gradient, at TP x EP = 2 x 2 with
sequence parallelism, 1 x 4 with the all-gather dispatcher, and 2 x 1. Bad configurations
raise naming the problem."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import MOE_GPT as MOE
from checks import assert_close, expect_error
from tpcore import parallel_state
from tpcore.models import GPTModel, ReferenceGPT
from tpcore.tensor_parallel.shard_spec import shard, shard_spec


def _batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + dp_rank)
    ids = torch.randint(0, MOE.vocab_size, (2, 8), generator=g)
    return ids, torch.randint(0, MOE.vocab_size, (2, 8), generator=g)


def _check(rank, world, tp, ep, sp, dispatcher):
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    config = dataclasses.replace(MOE, sequence_parallel=sp, moe_token_dispatcher_type=dispatcher)
    dp = world // tp
    torch.manual_seed(0)
    ref = ReferenceGPT(config)
    total = 0.0
    for d in range(dp):
        ids, target = _batch(d)
        loss = ref(ids, target)
        total = total + loss + ref.aux_loss()
    total.backward()
    torch.manual_seed(0)
    model = GPTModel(config)
    ids, target = _batch(parallel_state.get_data_parallel_rank())
    loss = model(ids, target)
    loss.backward()
    # Gradients as a trainer sums them: shares over TP, then over the data-parallel ranks,
    # expert weights at EP > 1 over the ranks that hold the same experts.
    tpcore.sum_partial_grads(model, parallel_state.get_tensor_model_parallel_group())
    for p in model.parameters():
        expert = shard_spec(p).axis == "expert" and ep > 1
        group = (
            parallel_state.get_expert_data_parallel_group()
            if expert
            else parallel_state.get_data_parallel_group()
        )
        dist.all_reduce(p.grad, group=group)
    losses = torch.stack([loss.detach()])
    dist.all_reduce(losses, group=parallel_state.get_data_parallel_group())
    want = sum(ref(*_batch(d)) for d in range(dp))
    assert_close(losses[0], want.detach(), "summed loss")
    named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, shard(named[name].grad, p.shard_spec), f"{name} grad")
    return len(model.moe_layers())


@pytest.mark.parametrize(
    "tp,ep,sp,dispatcher",
    [(2, 2, True, "alltoall"), (1, 4, False, "allgather"), (2, 1, False, "alltoall")],
)
def test_moe_gpt_equals_the_dense_reference(cpu_ranks, tp, ep, sp, dispatcher):
    assert cpu_ranks.run(_check, tp, ep, sp, dispatcher) == [1] * 4


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(num_experts=None), "moe_ffn_hidden_size, moe_shared_expert_intermediate_size"),
        (dict(moe_router_topk=5), "moe_router_topk (5) exceeds num_experts (4)"),
        (dict(moe_layer_freq=[1]), "one 0 or 1 per layer (2)"),
        (dict(moe_shared_expert_intermediate_size=None), "moe_shared_expert_gate needs"),
        (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type must be one of"),
        (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor must be > 0"),
        (dict(moe_aux_loss_coeff=-1.0), "moe_aux_loss_coeff must be a finite number >= 0"),
        (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias needs"),
    ],
)
def test_bad_moe_configs_raise(change, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(MOE, **change)


def _experts_not_divisible(rank, world):
    tpcore.initialize_model_parallel(1, expert_model_parallel_size=4)
    six = dataclasses.replace(MOE, num_experts=6)
    expect_error(
        ValueError,
        "num_experts (6) is not divisible by the expert-parallel size (4)",
        GPTModel,
        six,
    )
    return True


def test_experts_not_divisible_by_ep_raise_on_every_rank(cpu_ranks):
    assert all(cpu_ranks.run(_experts_not_divisible))


def _generate_stops_together(rank, world):
    """Greedy generation at EP 2 with an end-of-document id that ends rank 0's sequence after
    one token: the EP peers keep stepping together (no rank waits in an all-to-all for one
    that stopped), and every rank's tokens are the dense model's, padded with that id."""
    from tpcore.models import generate

    tpcore.initialize_model_parallel(1, expert_model_parallel_size=2)
    torch.manual_seed(0)
    model = GPTModel(MOE)
    torch.manual_seed(0)
    dense = ReferenceGPT(MOE)
    prompt = torch.tensor([[1 + rank, 2, 3 + 5 * rank]])
    first = generate(model, prompt, 1, greedy=True)[:, -1]
    everyone = [torch.zeros_like(first) for _ in range(world)]
    dist.all_gather(everyone, first)
    eod = int(everyone[0])
    out = generate(model, prompt, 6, greedy=True, eod=eod)
    want = generate(dense, prompt, 6, greedy=True, eod=eod)
    assert torch.equal(out[:, : want.shape[1]], want), (out, want)
    assert (out[:, want.shape[1] :] == eod).all()
    return out.shape[1]


def test_generation_at_ep2_stops_together(cpu_ranks):
    lengths = cpu_ranks.run(_generate_stops_together)
    assert lengths[0] == lengths[1] and lengths[0] > 4  # rank 0 stepped on with its peer
