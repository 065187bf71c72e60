"""The MoE layer at EP 1, 2, 4 x TP 1, 2, 4 against its dense loop-over-experts reference
(`ReferenceMoE`, plain PyTorch) computed on every rank in the same job: output, input
gradient, router and expert gradients, balancing and z losses; both dispatchers, with and
without sequence parallelism, fp32 and bf16, capacity dropping. The router favours expert 0
and never picks the last expert, so loads are uneven and one expert receives no token."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpcore
from checks import assert_close, expect_error
from harness import DEVICES, pool_for
from tpcore import parallel_state
from tpcore.moe import MoEConfig, MoELayer, ReferenceMoE, RouterConfig

HIDDEN, FFN, EXPERTS, SEQ, BATCH = 16, 8, 8, 8, 3


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _config(case: dict) -> MoEConfig:
    routing = RouterConfig(
        EXPERTS,
        2,
        capacity_factor=case.get("capacity"),
        # dropping applies to each rank's tokens; the reference drops per slice then, and
        # the losses (which count all tokens of a TP group) are checked without it
        aux_loss_coeff=0.0 if case.get("capacity") else 0.1,
        z_loss_coeff=0.0 if case.get("capacity") else 0.01,
    )
    return MoEConfig(
        HIDDEN,
        FFN,
        routing,
        _swiglu,
        gated=True,
        sequence_parallel=case["sp"],
        dispatcher=case["dispatcher"],
    )


def _reference(config: MoEConfig, dtype: torch.dtype) -> ReferenceMoE:
    torch.manual_seed(0)
    ref = ReferenceMoE(config, dtype=dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
        # Every token's feature 0 is large (below): expert 0 is favoured, the last never chosen.
        ref.router.weight[:, 0] = 0.0
        ref.router.weight[0, 0], ref.router.weight[-1, 0] = 0.6, -4.0
    return ref


def _inputs(group_index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + group_index)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x[..., 0] = 3.0
    return x.to(dtype), torch.randn(SEQ, BATCH, HIDDEN, generator=g)


def _check_case(rank: int, world: int, case: dict) -> list[int]:
    tp, ep, dtype = case["tp"], case["ep"], case["dtype"]
    parallel_state.destroy_model_parallel()
    tpcore.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    config = _config(case)
    ref = _reference(config, dtype)
    # The reference: every TP group's tokens (each group is one data-parallel rank), the
    # sum of their losses; with capacity, each TP rank's slice of the tokens routed apart.
    chunks = tp if case.get("capacity") else 1
    ref_out, ref_x, ref_aux = [], [], []
    for g in range(world // tp):
        x, grad = _inputs(g, dtype)
        x = x.requires_grad_()
        flat = x.reshape(-1, HIDDEN)
        outs, aux = [], 0.0
        for piece in flat.chunk(chunks):
            outs.append(ref(piece.view(-1, 1, HIDDEN)).reshape(-1, HIDDEN))
            aux = aux + ref.aux_loss
        out = torch.cat(outs).view(x.shape)
        ((out.float() * grad).sum() + aux).backward()
        ref_out.append(out.detach())
        ref_x.append(x)
        ref_aux.append(aux.detach())

    layer = MoELayer(config, group=tp_group, expert_group=ep_group, dtype=dtype)
    layer.to_empty(device="cpu")
    local = EXPERTS // ep
    first = parallel_state.get_expert_model_parallel_rank() * local
    with torch.no_grad():
        layer.router.weight.copy_(ref.router.weight)
        layer.experts.fc1.weight.copy_(ref.experts.fc1.weight[first : first + local])
        layer.experts.fc2.weight.copy_(ref.experts.fc2.weight[first : first + local])
    g, tp_rank = rank // tp, dist.get_rank(tp_group)
    x, grad = _inputs(g, dtype)
    want_out, want_grad_x = ref_out[g], ref_x[g].grad
    if case["sp"]:
        x, grad = x.chunk(tp)[tp_rank], grad.chunk(tp)[tp_rank]
        want_out, want_grad_x = want_out.chunk(tp)[tp_rank], want_grad_x.chunk(tp)[tp_rank]
    x = x.requires_grad_()
    out = layer(x)
    (out.float() * grad).sum().backward()
    what = f"{case}"
    assert_close(out, want_out, f"{what} output")
    assert_close(x.grad, want_grad_x, f"{what} input grad")
    # The router's gradient is a share per rank (tokens), the experts' too where ep = 1;
    # at ep > 1 the ranks holding the same experts sum theirs.
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    assert_close(router_grad, ref.router.weight.grad, f"{what} router grad")
    expert_group = parallel_state.get_expert_data_parallel_group() if ep > 1 else None
    for name in ("fc1", "fc2"):
        got = getattr(layer.experts, name).weight.grad.clone()
        dist.all_reduce(got, group=expert_group)
        want = getattr(ref.experts, name).weight.grad[first : first + local]
        assert_close(got, want, f"{what} expert {name} grad")
    shares = layer.last_routing["aux_loss"] + layer.last_routing["z_loss"]
    dist.all_reduce(shares, group=tp_group)
    if not case.get("capacity"):
        assert float(ref_aux[g]) > 0
    assert_close(shares, ref_aux[g].to(shares.dtype), f"{what} aux + z loss")
    loads = layer.last_routing["tokens_per_expert"].clone()
    dist.all_reduce(loads)
    return loads.tolist()


CASES = [
    dict(tp=1, ep=1, sp=False, dispatcher="alltoall", dtype=torch.float32),
    dict(tp=1, ep=2, sp=False, dispatcher="alltoall", dtype=torch.float32),
    dict(tp=1, ep=4, sp=False, dispatcher="alltoall", dtype=torch.float32),
    dict(tp=2, ep=1, sp=False, dispatcher="alltoall", dtype=torch.float32),
    dict(tp=2, ep=2, sp=False, dispatcher="alltoall", dtype=torch.float32),
    dict(tp=2, ep=4, sp=True, dispatcher="alltoall", dtype=torch.float32),
    dict(tp=4, ep=2, sp=False, dispatcher="allgather", dtype=torch.float32),
    dict(tp=2, ep=2, sp=True, dispatcher="allgather", dtype=torch.float32),
    dict(tp=1, ep=4, sp=False, dispatcher="allgather", dtype=torch.bfloat16),
    dict(tp=2, ep=4, sp=False, dispatcher="alltoall", dtype=torch.bfloat16),
    dict(tp=2, ep=1, sp=True, dispatcher="alltoall", dtype=torch.bfloat16),
    dict(tp=1, ep=2, sp=False, dispatcher="alltoall", dtype=torch.float32, capacity=1.0),
    dict(tp=2, ep=4, sp=True, dispatcher="allgather", dtype=torch.float32, capacity=0.5),
]


def _all_cases(rank, world):
    loads = [_check_case(rank, world, case) for case in CASES]
    return loads


def test_moe_layer_equals_the_loop_over_experts(cpu_ranks):
    loads = cpu_ranks.run(_all_cases)[0]
    for case, load in zip(CASES, loads):
        assert load[-1] == 0, f"{case}: the last expert got tokens, the test lost its empty expert"
        routes = 4 * SEQ * BATCH // case["tp"] * 2  # every rank's tokens, 2 routes each
        if case.get("capacity"):
            assert sum(load) < routes, f"{case}: nothing was dropped: {load}"
        else:
            assert sum(load) == routes, f"{case}: routes lost: {load}"
            assert load[0] > 2 * min(load[:-1]), f"{case}: loads are not uneven: {load}"


def _bad_input(rank, world):
    tpcore.initialize_model_parallel(2, expert_model_parallel_size=2)
    config = _config(dict(sp=False, dispatcher="alltoall"))
    tp_group = parallel_state.get_tensor_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    layer = MoELayer(config, group=tp_group, expert_group=ep_group)
    layer.to_empty(device="cpu")
    # 5 x 3 tokens do not split over TP 2: raised on both TP ranks before any collective.
    expect_error(ValueError, "15 tokens", layer, torch.randn(5, 3, HIDDEN))
    odd = MoEConfig(HIDDEN, FFN, RouterConfig(3, 1), _swiglu, gated=True)
    expect_error(
        ValueError,
        "3 experts do not split over the 2",
        MoELayer,
        odd,
        group=tp_group,
        expert_group=ep_group,
    )
    layer(torch.randn(4, 3, HIDDEN))  # the groups still work
    return True


def test_moe_layer_bad_input_raises_on_every_rank(cpu_ranks):
    assert all(cpu_ranks.run(_bad_input))


def _expert_bias(rank, world):
    """DeepSeek-V3's balancing bias: the step moves each expert's bias by the rate towards
    the mean load; the bias changes which experts are chosen (not their weights), alike in
    MoELayer at EP 2 and in its reference."""
    tpcore.initialize_model_parallel(1, expert_model_parallel_size=2)
    routing = RouterConfig(EXPERTS, 2, score="sigmoid")
    config = MoEConfig(HIDDEN, FFN, routing, _swiglu, gated=True, expert_bias_update_rate=0.25)
    ref = _reference(config, torch.float32)
    layer = MoELayer(
        config,
        group=parallel_state.get_tensor_model_parallel_group(),
        expert_group=parallel_state.get_expert_model_parallel_group(),
    )
    layer.to_empty(device="cpu")
    tpcore.moe.reset_expert_biases(layer)
    assert torch.equal(layer.router.expert_bias, torch.zeros(EXPERTS))
    layer.update_expert_bias(torch.tensor([9, 1, 5, 5, 0, 10, 5, 5]))  # mean 5
    want = 0.25 * torch.tensor([-1.0, 1, 0, 0, 1, -1, 0, 0])
    assert torch.equal(layer.router.expert_bias, want)
    # A bias large enough to put the last expert (never chosen otherwise) in every top-2.
    first = parallel_state.get_expert_model_parallel_rank() * EXPERTS // 2
    with torch.no_grad():
        layer.router.expert_bias[-1] = 5.0
        ref.router.expert_bias.copy_(layer.router.expert_bias)
        layer.router.weight.copy_(ref.router.weight)
        layer.experts.fc1.weight.copy_(ref.experts.fc1.weight[first : first + EXPERTS // 2])
        layer.experts.fc2.weight.copy_(ref.experts.fc2.weight[first : first + EXPERTS // 2])
    x, _ = _inputs(rank, torch.float32)
    out = layer(x)
    loads = layer.last_routing["tokens_per_expert"]
    assert loads[-1] == SEQ * BATCH, loads
    assert_close(out, ref(x), "output with a balancing bias")
    return True


def test_expert_bias_balances_and_steers_the_choice(cpu_ranks):
    assert all(cpu_ranks.run(_expert_bias))


def _on_device(rank, world, device):
    """One rank's MoELayer (TP 1, EP 1) on `device` against ReferenceMoE on the same device:
    fp32 (a loop of matmuls on CUDA) and bf16 (torch._grouped_mm where the GPU has it)."""
    tpcore.initialize_model_parallel(1)
    for dtype in (torch.float32, torch.bfloat16):
        config = _config(dict(sp=False, dispatcher="alltoall"))
        ref = _reference(config, dtype).to(device)
        layer = MoELayer(
            config, group=parallel_state.get_tensor_model_parallel_group(), dtype=dtype
        )
        layer.to_empty(device=device)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(ref.get_parameter(name))
        x, grad = (t.to(device) for t in _inputs(rank, dtype))
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = layer(mine)
        want = ref(theirs)
        (out.float() * grad).sum().backward()
        ((want.float() * grad).sum() + ref.aux_loss).backward()
        assert_close(out, want, f"{device} {dtype} output")
        assert_close(mine.grad, theirs.grad, f"{device} {dtype} input grad")
        for name, p in layer.named_parameters():
            assert_close(p.grad, ref.get_parameter(name).grad, f"{device} {dtype} {name}")
    return True


@pytest.mark.parametrize("device", DEVICES)
def test_moe_layer_on_each_device(request, device):
    assert all(pool_for(request, device, 1).run(_on_device, device))
