"""GPT initialisation: every rank draws only its shards, and they are exactly the slices of
`ReferenceGPT` made after the same seed, for TP 1, 2, 4, tied and untied, fp32 and bf16."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tpcore
from checks import GPT_VARIANTS as VARIANTS
from checks import LargestAllocation, gpt_rule, setup_tp, slice_piece
from harness import DEVICES, pool_for
from tpcore.models import GPTConfig, GPTModel, ReferenceGPT
from tpcore.models.gpt import ParallelBlock, attach_gpt_shard_specs
from tpcore.models.initialization import initialize_gpt_parameters
from tpcore.models.reference_gpt import DenseBlock


def _shards_are_slices(rank, world, tp, variant, dtype, device):
    tp_rank, tp = setup_tp(tp)
    config = VARIANTS[variant]
    torch.manual_seed(5)
    dense = ReferenceGPT(config)  # fp32, CPU: the reference for every dtype and device
    after_dense = torch.get_rng_state()
    torch.manual_seed(5)
    model = GPTModel(config, dtype=dtype, device=device)
    assert torch.equal(torch.get_rng_state(), after_dense), (
        "both models take one seed from the default generator"
    )
    state = dense.state_dict()
    assert [n for n, _ in model.named_parameters()] == list(state), (
        "parameter names must not change"
    )
    for name, param in model.named_parameters():
        assert param.dtype == dtype and param.device.type == device
        want = slice_piece(state[name], gpt_rule(name, config), tp_rank, tp, config).to(dtype)
        assert torch.equal(param.detach().cpu(), want), f"TP={tp} {variant} {dtype}: {name}"
    merged = model.to_dense().state_dict()  # and the collective way back
    for name, want in state.items():
        assert torch.equal(merged[name].cpu(), want.to(dtype)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_gpt_shards_are_slices_of_reference_gpt(request, device, tp, variant, dtype):
    pool_for(request, device, tp).run(_shards_are_slices, tp, variant, dtype, device)


def _pipeline_stage_draws_global_layers(rank, world, tp):
    """A stage holding only global layer 2 (named layers.0) draws what the whole model does."""
    tp_rank, tp = setup_tp(tp)
    config = GPTConfig(
        vocab_size=50,
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        make_vocab_size_divisible_by=4,
    )
    dense = ReferenceGPT(config)
    dense.reset_parameters(seed=11)
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    stage = nn.Module()
    stage.layers = nn.ModuleList([ParallelBlock(config, group, None)]).to_empty(device="cpu")
    attach_gpt_shard_specs(stage, config, group)
    initialize_gpt_parameters(stage, config, seed=11, tensor_parallel=(tp_rank, tp), layer_offset=2)
    state = dense.state_dict()
    for name, param in stage.named_parameters():
        full = state[name.replace("layers.0.", "layers.2.")]
        assert torch.equal(param, slice_piece(full, gpt_rule(name, config), tp_rank, tp, config)), (
            name
        )
    other = dict(stage.named_parameters())["layers.0.attention.qkv.weight"]
    assert not torch.equal(
        other,
        slice_piece(
            state["layers.0.attention.qkv.weight"],
            gpt_rule("layers.0.attention.qkv.weight", config),
            tp_rank,
            tp,
            config,
        ),
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stage_draws_its_global_layers(cpu_ranks, tp):
    cpu_ranks.run(_pipeline_stage_draws_global_layers, tp)


def test_dense_stage_with_layer_offset_and_distributions():
    config = GPTConfig(
        vocab_size=3000,
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    dense = ReferenceGPT(config)
    dense.reset_parameters(seed=2)
    stage = nn.Module()
    stage.layers = nn.ModuleList([DenseBlock(config, device="meta")]).to_empty(device="cpu")
    initialize_gpt_parameters(stage, config, seed=2, layer_offset=3)
    for name, p in stage.named_parameters():
        assert torch.equal(
            p, dict(dense.named_parameters())[name.replace("layers.0.", "layers.3.")]
        ), name
    # GPT-2 / Megatron: normal(0, std), output projections std / sqrt(2 layers), norms one,
    # biases zero.
    std, out_std = config.init_std, config.init_std / math.sqrt(2 * config.num_layers)
    weights = {
        "proj.weight": out_std,
        "fc2.weight": out_std,
        "qkv.weight": std,
        "fc1.weight": std,
        "word.weight": std,
        "position.weight": std,
    }
    for suffix, sd in weights.items():
        x = torch.cat(
            [p.detach().reshape(-1) for n, p in dense.named_parameters() if n.endswith(suffix)]
        ).double()
        n = x.numel()
        assert abs(x.mean().item()) < 5 * sd / math.sqrt(n), suffix
        assert abs(x.std().item() / sd - 1) < 5 / math.sqrt(2 * n), (suffix, x.std().item(), sd)
    for name, p in dense.named_parameters():
        if "norm" in name:
            assert torch.equal(
                p, torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)
            ), name
        elif name.endswith("bias"):
            assert not p.any(), name


def _no_full_tensor(rank, world):
    setup_tp(4)
    config = GPTConfig(
        vocab_size=4000, num_layers=1, hidden_size=256, num_attention_heads=8, tie_embeddings=False
    )
    with LargestAllocation() as seen:
        model = GPTModel(config)
    local = max(p.untyped_storage().nbytes() for p in model.parameters())
    full = max(p.numel() * 4 for p in ReferenceGPT(config, device="meta").parameters())
    assert local * 3 < full
    assert seen.largest <= local, (
        f"a {seen.largest}-byte tensor was made; the largest shard has {local}"
    )
    meta = GPTModel(config, device="meta")  # still builds, allocates nothing
    assert all(p.is_meta for p in meta.parameters())


def test_gpt_at_tp4_never_builds_a_full_tensor(cpu_ranks):
    cpu_ranks.run(_no_full_tensor)


# A fresh process that builds models (a 1-rank group, learned positions: every meta-built
# nn.Embedding tpcore makes), gathers an embedding to dense, then trains a step of a tied GPT
# whose lookup routes its gradient to a sink (as a data-parallel trainer's does: an eager_only
# function); torch._dynamo and sympy must stay unimported: torch's Python `normal_` on meta
# tensors imported dynamo, and so did torch's lazy `torch.compiler.disable` at its first
# eager call (2 s of CPU each); `Module.to_empty` imported sympy (torch's Python
# `empty_like` of a meta tensor; 1.5 s).
_BUILDS_AND_TRAINS_MODELS = """
import sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import tpcore
from tpcore.models import GPTConfig, GPTModel, ReferenceGPT
from tpcore.tensor_parallel.gradient_sink import attach_gradient_sink
tpcore.initialize_model_parallel(1)
config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=50,
                   max_position_embeddings=8, position_embedding="learned")
GPTModel(config), ReferenceGPT(config)
tpcore.VocabParallelEmbedding(10, 4).to_dense()
built = ["torch._dynamo" in sys.modules, "sympy" in sys.modules]
model = GPTModel(config)
sunk = []
attach_gradient_sink(model.embedding.word.weight, lambda rows, g: sunk.append(g))
ids = torch.randint(0, 50, (2, 8))
model(ids, ids).backward()
assert sunk, "the lookup's gradient did not reach the sink"
print(*built, "torch._dynamo" in sys.modules, "sympy" in sys.modules)
tpcore.shutdown()
"""


def test_building_and_training_a_model_import_neither_dynamo_nor_sympy(tmp_path):
    import programs

    proc = programs.start(["-c", _BUILDS_AND_TRAINS_MODELS, str(tmp_path / "store")])
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert out.splitlines()[-1] == "False False False False", out
