"""Tensor-parallel GPT vs the dense ReferenceGPT: loss and gradients for a few steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tpcore
from checks import GPT_VARIANTS as VARIANTS
from checks import GQA_VARIANTS, assert_close, expect_error, setup_tp
from tpcore.models import GPTConfig, GPTModel, ReferenceGPT, finalize_sequence_parallel_grads
from tpcore.tensor_parallel.shard_spec import unshard

BATCH, SEQ, STEPS, LR = 2, 8, 3, 0.5


def _dense_grads(model: GPTModel) -> dict[str, torch.Tensor]:
    return {n: unshard(p.grad, p.shard_spec) for n, p in model.named_parameters()}


def _equivalence(rank, world, tp, variant, sequence_parallel, fused, recompute):
    setup_tp(tp)
    config = dataclasses.replace(
        {**VARIANTS, **GQA_VARIANTS}[variant],
        sequence_parallel=sequence_parallel,
        fused_lm_head_loss=fused,
        recompute=recompute,
    )
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    torch.manual_seed(0)
    model = GPTModel(config)  # drawn from the same seed: TP-size invariant initialisation
    for (name, a), b in zip(model.to_dense().state_dict().items(), dense.state_dict().values()):
        assert torch.equal(a, b), f"init of {name} differs from the dense model"
    if sequence_parallel:
        tagged = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
        assert any("norm" in n for n in tagged), tagged
    g = torch.Generator().manual_seed(1)
    dense_opt, opt = (
        torch.optim.SGD(dense.parameters(), lr=LR),
        torch.optim.SGD(model.parameters(), lr=LR),
    )
    for step in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
        target = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g)
        target[0, 0] = -100
        dense_loss, loss = dense(ids, target), model(ids, target)
        assert_close(loss, dense_loss.detach(), f"step {step}: loss")
        dense_loss.backward()
        loss.backward()
        if sequence_parallel:
            finalize_sequence_parallel_grads(model)
        grads = _dense_grads(model)
        for name, p in dense.named_parameters():
            assert_close(grads[name], p.grad, f"step {step}: grad of {name}")
        for o in (dense_opt, opt):
            o.step()
            o.zero_grad()
    for (name, a), b in zip(model.to_dense().state_dict().items(), dense.state_dict().values()):
        assert_close(a, b, f"after {STEPS} steps: {name}")


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("fused", [False, True], ids=["ce", "fused-ce"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_matches_dense(cpu_ranks, tp, variant, sequence_parallel, fused, recompute):
    cpu_ranks.run(_equivalence, tp, variant, sequence_parallel, fused, recompute)


# Fewer KV heads than TP ranks: each rank holds a copy of its queries' KV head, whose
# gradient (summed over the copies) must be the dense one, and which stays equal across
# the copies through the SGD steps (to_dense reads the first copy).
KV_REPLICATED_CASES = [
    (4, "llama_kv2", False, False, "none"),
    (4, "llama_kv2", True, False, "selective"),
    (4, "llama_kv2", True, True, "full"),
    (2, "llama_kv1", False, True, "none"),
    (2, "llama_kv1", True, False, "full"),
    (4, "llama_kv1", True, True, "selective"),
]
# Heads of another width than hidden / heads (kv_channels): 8 x 16 = 128 and 8 x 4 = 32 wide
# attention in a 64-wide model; the QKV and output projections are not square. Qwen3's q / k
# norms: replicated weights whose gradient each rank's heads give part of. OLMoE's: over the
# whole projection, a mean of squares summed over TP.
HEAD_SHAPE_CASES = [
    (1, "llama_wide_heads", False, False, "none"),
    (2, "llama_wide_heads", True, True, "selective"),
    (4, "llama_wide_heads", False, False, "full"),
    (2, "llama_kv2_narrow_heads", False, True, "none"),
    (4, "llama_kv2_narrow_heads", True, False, "selective"),  # KV heads replicated
    (1, "qwen3", False, False, "none"),
    (2, "qwen3", True, True, "full"),
    (4, "qwen3", True, False, "selective"),
    (2, "qwen3_kv2", False, False, "selective"),
    (4, "qwen3_kv2", True, True, "none"),  # k norms on replicated KV heads
    (1, "olmo", False, False, "none"),
    (2, "olmo", True, True, "selective"),
    (4, "olmo", False, False, "full"),
    (4, "olmo_kv2", True, False, "selective"),  # a k-norm slice on two ranks
    (1, "gemma", False, False, "none"),
    (2, "gemma", True, True, "selective"),
    (4, "gemma", False, False, "full"),
]


@pytest.mark.parametrize(
    "tp,variant,sequence_parallel,fused,recompute", KV_REPLICATED_CASES + HEAD_SHAPE_CASES
)
def test_gqa_and_head_shapes_match_dense(
    cpu_ranks, tp, variant, sequence_parallel, fused, recompute
):
    cpu_ranks.run(_equivalence, tp, variant, sequence_parallel, fused, recompute)


def _logits(rank, world):
    tp_rank, tp = setup_tp(2)
    config = VARIANTS["llama"]
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    model = GPTModel.from_dense(dense)
    ids = torch.randint(
        0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2)
    )
    shard = model(ids)
    rows = shard.shape[-1]
    full = dense(ids)
    real = max(0, min(rows, config.vocab_size - tp_rank * rows))
    assert_close(
        shard[..., :real], full[..., tp_rank * rows : tp_rank * rows + real], "logits shard"
    )
    per_token = model(ids, ids, reduction="none")
    ref = torch.nn.functional.cross_entropy(
        full.reshape(-1, config.vocab_size), ids.reshape(-1), reduction="none"
    )
    assert_close(per_token, ref.view(BATCH, SEQ), "per-token loss")


def test_logits_and_per_token_loss(cpu_ranks):
    cpu_ranks.run(_logits)


def _qk_norm_collectives(rank, world):
    """Collectives of one backward on the TP group's shared-memory backend, with and without
    q / k norms."""
    setup_tp(2)
    shm = tpcore.shm.shm_backend_of(tpcore.parallel_state.get_tensor_model_parallel_group())
    assert shm is not None, "the TP group is not on the shared-memory backend"
    ids = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    counts = {}
    for norm in (False, True):
        torch.manual_seed(0)
        model = GPTModel(dataclasses.replace(VARIANTS["llama"], qk_norm=norm))
        loss = model(ids, ids)
        before = shm.fast_ops + shm.fallback_ops
        loss.backward()
        counts[norm] = shm.fast_ops + shm.fallback_ops - before
    return counts


def test_qk_norm_gradients_take_one_all_reduce_per_layer(cpu_ranks):
    """The q and k norms' weight gradients are summed over TP in one all-reduce per layer, not
    one per norm."""
    checked = [c for c in cpu_ranks.run(_qk_norm_collectives) if c is not None]
    assert len(checked) == 2, checked  # one TP group's two ranks
    for counts in checked:
        assert counts[True] - counts[False] == VARIANTS["llama"].num_layers, counts


def _bad_configs(rank, world):
    setup_tp(4)
    base = VARIANTS["gpt2"]
    expect_error(
        ValueError,
        "num_attention_heads (6) is not divisible by the tensor-parallel size (4)",
        GPTModel,
        dataclasses.replace(base, num_attention_heads=6, num_kv_heads=6, hidden_size=36),
    )
    three_kv = dataclasses.replace(base, hidden_size=48, num_attention_heads=12, num_kv_heads=3)
    expect_error(
        ValueError,
        "num_kv_heads (3) and the tensor-parallel size (4): one must divide the other",
        GPTModel,
        three_kv,
    )
    model = GPTModel(dataclasses.replace(base, sequence_parallel=True))
    ids = torch.zeros(2, 6, dtype=torch.long)
    expect_error(ValueError, "must be divisible by the tensor-parallel size 4", model, ids)
    expect_error(
        ValueError,
        "exceeds max_position_embeddings 16",
        model,
        torch.zeros(1, 20, dtype=torch.long),
    )
    expect_error(ValueError, "ids must be [batch, seq]", model, torch.zeros(8, dtype=torch.long))
    expect_error(IndexError, "token id 50 is out of range", model, torch.full((1, 8), 50))


def test_bad_inputs_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_configs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hidden_size=30), "not divisible by num_attention_heads"),
        (dict(kv_channels=0), "kv_channels must be a positive int"),
        (dict(kv_channels=5, position_embedding="rotary"), "even head dim, got 5"),
        (dict(num_kv_heads=3), "not divisible by num_kv_heads"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(activation="relu"), "activation must be one of"),
        (dict(recompute="some"), "recompute must be one of"),
        (dict(dropout=1.0), "dropout must be in [0, 1)"),
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(hidden_size=36, num_attention_heads=4, position_embedding="rotary"), "even head dim"),
        (dict(qk_norm_scope="heads"), "qk_norm_scope must be one of"),
        (dict(qk_norm_scope="projection", norm="rmsnorm"), "needs qk_norm=True and norm='rmsnorm'"),
        (dict(qk_norm_scope="projection", qk_norm=True), "got qk_norm=True, norm='layernorm'"),
    ],
)
def test_config_validation(kwargs, match):
    args = dict(vocab_size=50, num_layers=2, hidden_size=32, num_attention_heads=4)
    with pytest.raises(
        ValueError, match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        GPTConfig(**{**args, **kwargs})
