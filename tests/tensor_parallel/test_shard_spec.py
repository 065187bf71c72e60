"""The shard spec on every parameter: its checks, and at TP 1, 2 and 4 that the specs of
tpcore's layers, of GPTModel (every variant, pipeline stages) and of `tpcore.hf`'s split
models rebuild the dense tensors, compared with plain slicing written out in the tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import tpcore
from checks import GPT_VARIANTS, GQA_VARIANTS, gpt_rule, setup_tp, slice_piece
from tpcore.models import GPTModel, ReferenceGPT
from tpcore.tensor_parallel.shard_spec import Part, ShardSpec, merge, shard, unshard


def test_spec_refuses_what_cannot_be_cut():
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        ShardSpec((4, 4), 0, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="do not add up"):
        ShardSpec((10, 4), 0, (Part("q", 4, 2), Part("k", 4, 2)))
    with pytest.raises(ValueError, match="dim 2 is outside"):
        ShardSpec((4, 4), 2)
    with pytest.raises(ValueError, match="cannot be split over the tensor-parallel size 4"):
        ShardSpec((6, 4), 0, (Part("", 6, 6),), tp_size=4)
    with pytest.raises(ValueError, match="replicated tensor"):
        ShardSpec((4,), None, vocab_multiple=8)


def test_spec_round_trips_through_json_and_counts_copies_once():
    # Q of 4 heads, K and V of 1 head at TP 4: ranks 1..3 hold copies of rank 0's K and V.
    parts = (Part("q", 8, 4), Part("k", 2, 1), Part("v", 2, 1))
    spec = ShardSpec((12, 3), 0, parts, tp_size=4, tp_rank=0)
    assert ShardSpec.from_dict(spec.to_dict(), 4, 0) == spec
    assert spec.local_shape == (6, 3) and spec.copied_elements() is None
    assert spec.at(4, 1).copied_elements() == (2 * 3, 6 * 3)
    full = torch.arange(36.0).view(12, 3)
    pieces = [shard(full, spec.at(4, r)) for r in range(4)]
    assert torch.equal(pieces[3][2:], full[8:]) and torch.equal(merge(pieces, spec), full)
    vocab = ShardSpec((10, 2), 0, vocab_multiple=4, tp_size=2)
    assert vocab.local_shape == (8, 2)  # 10 rows padded to 16
    assert vocab.at(2, 1).ranges() == (0, [(0, 8, 2)])


def _check_specs(
    module: nn.Module,
    dense: dict[str, torch.Tensor],
    tp: int,
    what: str,
    transposed=(),
    every: bool = True,
) -> None:
    """Each parameter's spec rebuilds `dense[name]`; with `every`, each carries one (else
    those without are the dense model's own, replicated, modules)."""
    for name, p in module.named_parameters():
        spec = getattr(p, "shard_spec", None)
        assert spec is not None or not every, f"{what}: {name} carries no shard spec"
        spec = spec or ShardSpec(tuple(p.shape))
        assert spec.kind == "replicated" or spec.tp_size == tp, f"{what}: {name}"
        want = dense[name].t() if name in transposed else dense[name]
        assert tuple(p.shape) == spec.local_shape and spec.global_shape == tuple(want.shape), (
            f"{what}: {name}"
        )
        assert torch.equal(unshard(p.detach(), spec, spec.group), want), (
            f"{what}: {name} does not rebuild the dense tensor"
        )


def _layers_and_gpt(rank, world, tp):
    tp_rank, _ = setup_tp(tp)
    torch.manual_seed(0)
    dense = {"col": nn.Linear(12, 8), "row": nn.Linear(8, 6), "emb": nn.Embedding(50, 6)}
    layers = {
        "col": tpcore.ColumnParallelLinear.from_dense(dense["col"]),
        "row": tpcore.RowParallelLinear.from_dense(dense["row"], input_is_parallel=True),
        "emb": tpcore.VocabParallelEmbedding.from_dense(
            dense["emb"], make_vocab_size_divisible_by=4
        ),
    }
    for key, layer in layers.items():
        _check_specs(layer, dict(dense[key].named_parameters()), tp, key)
    for variant, config in {**GPT_VARIANTS, **GQA_VARIANTS}.items():
        for sp in (False, True):
            config = dataclasses.replace(config, sequence_parallel=sp)
            torch.manual_seed(0)
            state = ReferenceGPT(config).state_dict()
            torch.manual_seed(0)
            model = GPTModel(config)
            _check_specs(model, state, tp, f"{variant} sp={sp}")
            for name, p in model.named_parameters():  # and the tests' own slicing of the layout
                assert torch.equal(
                    p.detach(),
                    slice_piece(state[name], gpt_rule(name, config), tp_rank, tp, config),
                ), f"{variant}: {name}"
                assert p.shard_spec.partial_grad == (
                    sp and getattr(p, "sequence_parallel", False)
                ), f"{variant}: {name}"
            assert sp == any(p.shard_spec.partial_grad for p in model.parameters()), variant
    config = GQA_VARIANTS["gemma"]  # a middle and a last pipeline stage (the tied head's copy)
    torch.manual_seed(0)
    state = ReferenceGPT(config).state_dict()
    for layers, pre, post in (([1], False, False), ([1], False, True)):
        torch.manual_seed(0)
        stage = GPTModel(config, layers=layers, pre_process=pre, post_process=post, _init=False)
        stage.load_dense_state_dict(state)
        _check_specs(stage, state, tp, f"stage {layers} post={post}")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_parameter_carries_a_spec_that_rebuilds_it(cpu_ranks, tp):
    cpu_ranks.run(_layers_and_gpt, tp)


def _hf_specs(rank, world, tp, family):
    import transformers

    from hf_families import FAMILIES

    setup_tp(tp)
    cls, make_config = FAMILIES[family]
    torch.manual_seed(0)
    dense = getattr(transformers, cls)(make_config()).eval()
    state = {name: p.detach().clone() for name, p in dense.named_parameters()}
    model = tpcore.hf.parallelize(dense)
    conv1d = {
        name
        for name, m in model.named_modules()
        for name in [f"{name}.weight"]
        if type(m).__name__ == "ColumnParallelLinear" and family == "gpt2"
    }
    conv1d |= {
        name
        for name, m in model.named_modules()
        for name in [f"{name}.weight"]
        if type(m).__name__ == "RowParallelLinear" and family == "gpt2"
    }
    _check_specs(model, state, tp, family, transposed=conv1d, every=False)
    replaced = [
        m
        for m in model.modules()
        if isinstance(
            m,
            (tpcore.ColumnParallelLinear, tpcore.RowParallelLinear, tpcore.VocabParallelEmbedding),
        )
    ]
    assert replaced and all(hasattr(p, "shard_spec") for m in replaced for p in m.parameters()), (
        family
    )


@pytest.mark.parametrize("family", ["gpt2", "llama", "phi3", "olmo2", "cohere", "mixtral"])
def test_hf_split_models_carry_specs_that_rebuild_them(cpu_ranks, family):
    for tp in (2, 4):
        cpu_ranks.run(_hf_specs, tp, family)
