"""The MoE router against transformers' own routers computed in the same test (Mixtral's
softmax top-k, DeepSeek-V3's sigmoid top-k with its load-balancing bias) and transformers'
load-balancing loss; capacity dropping against a per-expert loop; bad configs."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.mixtral import modeling_mixtral

from checks import expect_error
from tpcore.moe import RouterConfig, route

TOKENS, HIDDEN = 37, 16


def _by_expert(experts: torch.Tensor, weights: torch.Tensor):
    """Each token's routes sorted by expert: routers may list them in any order."""
    order = experts.argsort(dim=-1)
    return experts.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("experts,k", [(8, 2), (4, 1), (6, 6)])
def test_softmax_routing_and_balancing_loss_match_mixtral(experts, k):
    config = transformers.MixtralConfig(
        hidden_size=HIDDEN, num_local_experts=experts, num_experts_per_tok=k
    )
    torch.manual_seed(0)
    router = modeling_mixtral.MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=1.0)
    x = torch.randn(TOKENS, HIDDEN).bfloat16().float()
    logits, their_weights, their_experts = router(x)
    mine = route(logits, RouterConfig(experts, k, aux_loss_coeff=1.0, z_loss_coeff=0.5))
    got = _by_expert(mine.experts, mine.weights)
    want = _by_expert(their_experts, their_weights)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert torch.equal(
        mine.tokens_per_expert, torch.bincount(their_experts.flatten(), minlength=experts)
    )
    # transformers' Mixtral counts tokens per expert, Megatron (and tpcore) routes: k times less.
    theirs = modeling_mixtral.load_balancing_loss_func((logits,), experts, k)
    torch.testing.assert_close(mine.aux_loss * k, theirs)
    z = 0.5 * torch.logsumexp(logits.double(), -1).square().mean()
    torch.testing.assert_close(mine.z_loss, z.float())  # float32's tolerance


def test_sigmoid_routing_with_bias_matches_deepseek_v3():
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    torch.manual_seed(0)
    router = modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=1.0)
    router.e_score_correction_bias.normal_(0, 0.5)  # the choice differs from the scores' order
    x = torch.randn(TOKENS, HIDDEN)
    logits, their_weights, their_experts = router(x)
    rc = RouterConfig(8, 3, score="sigmoid", scaling_factor=2.5)
    mine = route(logits, rc, expert_bias=router.e_score_correction_bias)
    got, want = _by_expert(mine.experts, mine.weights), _by_expert(their_experts, their_weights)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    unbiased = route(logits, rc)
    assert not torch.equal(_by_expert(unbiased.experts, unbiased.weights)[0], got[0])


def test_capacity_keeps_each_experts_heaviest_routes():
    torch.manual_seed(1)
    logits = torch.randn(TOKENS, 4) * 3
    config = RouterConfig(4, 2, capacity_factor=0.5)
    capacity = math.ceil(TOKENS * 2 / 4 * 0.5)
    assert config.capacity(TOKENS) == capacity
    dropless = route(logits, RouterConfig(4, 2))
    mine = route(logits, config)
    for e in range(4):  # a loop over experts: the routes to e, heaviest first, ties by token
        routes = [
            (-dropless.weights[t, j].item(), t, j)
            for t in range(TOKENS)
            for j in range(2)
            if dropless.experts[t, j] == e
        ]
        kept = {(t, j) for _, t, j in sorted(routes)[:capacity]}
        for _, t, j in routes:
            if (t, j) in kept:
                assert mine.experts[t, j] == e and mine.weights[t, j] == dropless.weights[t, j]
            else:
                assert mine.experts[t, j] == -1 and mine.weights[t, j] == 0
        assert mine.tokens_per_expert[e] == len(kept)
    assert (mine.experts == -1).any(), "nothing was dropped: the case tests nothing"


def test_bad_router_configs_name_the_problem():
    cases = [
        (dict(num_experts=0, top_k=1), "num_experts must be an int >= 1, got 0"),
        (dict(num_experts=4, top_k=5), "top_k 5 exceeds num_experts 4"),
        (dict(num_experts=4, top_k=2, score="relu"), "score must be softmax or sigmoid"),
        (dict(num_experts=4, top_k=2, capacity_factor=0), "capacity_factor must be > 0"),
        (dict(num_experts=4, top_k=2, aux_loss_coeff=-1), "aux_loss_coeff must be a finite"),
    ]
    for kwargs, message in cases:
        expect_error(ValueError, message, RouterConfig, **kwargs)
    expect_error(
        ValueError,
        "logits must be [tokens, 4], got [3, 5]",
        route,
        torch.zeros(3, 5),
        RouterConfig(4, 2),
    )
    expect_error(
        ValueError,
        "expert_bias is for the sigmoid score function",
        route,
        torch.zeros(3, 4),
        RouterConfig(4, 2),
        torch.zeros(4),
    )
