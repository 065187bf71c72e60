"""LoRA on the parallel layers vs the dense LoRA computation in plain PyTorch:
`y = x W^T + b + scale * dropout(x) A^T B^T`, outputs and the A / B / input gradients, at TP 1,
2 and 4; GPTModel's fused q|k|v and gate|up get one adapter per part; no collective added."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcore
from checks import GPT_VARIANTS, GQA_VARIANTS, MOE_GPT, assert_close, expect_error, setup_tp
from tpcore.models import GPTModel
from tpcore.tensor_parallel import get_rng_tracker, lora_adapters
from tpcore.tensor_parallel.shard_spec import shard, shard_spec, unshard

IN, OUT, RANK = 16, 24, 4


def _random_B(adapter: tpcore.LoRAAdapter, seed: int) -> torch.Tensor:
    """Give the adapter a nonzero B (it starts at zero; std 0.1: an update as large as the
    weights, not one that swamps them) drawn whole, this rank's piece kept;
    returns the whole B."""
    spec = shard_spec(adapter.B)
    full = torch.randn(spec.global_shape, generator=torch.Generator().manual_seed(seed)) * 0.1
    with torch.no_grad():
        adapter.B.copy_(shard(full, spec))
    return full.to(adapter.B.dtype)


def _layer_case(tp_rank, tp, column, *, bias, sp, flag, base_dtype, adapter_dtype, rslora, p):
    what = (
        f"{'column' if column else 'row'} bias={bias} sp={sp} flag={flag} base={base_dtype} "
        f"adapter={adapter_dtype} rslora={rslora} dropout={p}"
    )
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias=bias, dtype=base_dtype).requires_grad_(False)
    if column:
        layer = tpcore.ColumnParallelLinear.from_dense(
            dense, gather_output=flag, sequence_parallel=sp
        )
    else:
        layer = tpcore.RowParallelLinear.from_dense(
            dense, input_is_parallel=flag or sp, sequence_parallel=sp
        )
    layer.requires_grad_(False)
    alpha = 8.0
    layer.lora = tpcore.LoRAAdapter(
        layer, rank=RANK, alpha=alpha, dropout=p, use_rslora=rslora, dtype=adapter_dtype
    )
    A = unshard(layer.lora.A.detach(), shard_spec(layer.lora.A)).clone().requires_grad_(True)
    B = _random_B(layer.lora, seed=5).requires_grad_(True)
    assert A.shape == (RANK, IN) and B.shape == (OUT, RANK), what
    bound = 1 / math.sqrt(IN)  # nn.Linear's draw for A, as PEFT's
    assert A.abs().max() <= bound and A.std() > bound / 3, f"{what}: A's init"

    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 2, IN, generator=g).to(base_dtype)
    grad = torch.randn(8, 2, OUT, generator=g).to(base_dtype)
    # The input the layer sees on this rank, and the dense output / gradients it holds a piece of.
    if column:
        x_in = mine(x, 0) if sp else x
        y_piece = (lambda t: mine(t, -1)) if not flag else (lambda t: t)
    else:
        x_in = mine(x, -1) if (flag or sp) else x
        y_piece = (lambda t: mine(t, 0)) if sp else (lambda t: t)
    x_in = x_in.clone().requires_grad_(True)
    get_rng_tracker().reset()
    tpcore.model_parallel_manual_seed(11)
    y = layer(x_in)
    y.backward(y_piece(grad))
    tpcore.sum_partial_grads(layer)

    # The dropout masks: the same stream drawn again (the column layer's input is replicated:
    # one mask, from the replicated stream; the row layer's slice of it has its own).
    keep = torch.ones_like(x)
    if p:
        get_rng_tracker().reset()
        tpcore.model_parallel_manual_seed(11)
        stream = tpcore.REPLICATED_RNG if column else tpcore.MODEL_PARALLEL_RNG
        if column:
            keep = tpcore.tracked_dropout(torch.ones_like(x), p, stream)
        else:
            pieces = [torch.zeros_like(mine(x, -1)) for _ in range(tp)]
            pieces[tp_rank] = tpcore.tracked_dropout(torch.ones_like(mine(x, -1)), p, stream)
            keep = tpcore.comm.all_reduce(torch.cat(pieces, -1), layer.group)
        assert (keep == 0).any() and (keep != 0).any(), f"{what}: the masks drop nothing"

    scale = alpha / (math.sqrt(RANK) if rslora else RANK)
    xr = x.clone().requires_grad_(True)
    lora = F.linear(F.linear((xr * keep).to(A.dtype), A), B) * scale
    y_ref = (dense(xr) + lora).to(base_dtype)
    y_ref.backward(grad)
    assert_close(y, y_piece(y_ref.detach()), f"{what}: output")
    x_grad = mine(xr.grad, 0) if column and sp else xr.grad
    if not column and (flag or sp):
        x_grad = mine(xr.grad, -1)
    assert_close(x_in.grad, x_grad, f"{what}: input gradient")
    assert_close(unshard(layer.lora.A.grad, shard_spec(layer.lora.A)), A.grad, f"{what}: A grad")
    assert_close(unshard(layer.lora.B.grad, shard_spec(layer.lora.B)), B.grad, f"{what}: B grad")
    assert layer.weight.grad is None and (layer.bias is None or layer.bias.grad is None), what


LAYER_CASES = [  # column, bias, sp, flag (gather_output / input_is_parallel), dtypes, rslora, p
    (True, True, False, False, torch.float32, None, False, 0.0),
    (True, False, False, True, torch.float32, None, True, 0.0),
    (True, True, True, False, torch.float32, None, False, 0.0),
    (True, True, False, False, torch.bfloat16, torch.float32, False, 0.0),
    (True, False, True, False, torch.float32, None, False, 0.25),
    (False, True, False, True, torch.float32, None, False, 0.0),
    (False, True, False, False, torch.float32, None, True, 0.0),
    (False, True, True, True, torch.float32, None, False, 0.0),
    (False, False, True, True, torch.bfloat16, torch.float32, False, 0.0),
    (False, True, False, True, torch.float32, None, False, 0.25),
]


def _layers(rank, world, tp):
    tp_rank, tp = setup_tp(tp)
    for column, bias, sp, flag, base, adapter, rslora, p in LAYER_CASES:
        _layer_case(
            tp_rank, tp, column, bias=bias, sp=sp, flag=flag, base_dtype=base,
            adapter_dtype=adapter, rslora=rslora, p=p,
        )  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lora_layers_match_dense_lora(cpu_ranks, tp):
    cpu_ranks.run(_layers, tp)


def _lora_reference_params(dense, adapters, A_ref, B_ref, specs):
    """The dense model's parameters with each adapted weight replaced by W + scale * B A,
    built per part from the whole A and B (leaves whose gradients the test reads)."""
    params = dict(dense.named_parameters())
    for name, adapter in adapters.items():
        spec = specs[name]
        sizes = [p.size for p in spec.parts] if spec.dim == 0 else [spec.global_shape[0]]
        B_parts = B_ref[name].split(sizes, 0)
        A_parts = A_ref[name].split(adapter.rank, 0)
        delta = torch.cat([b @ a for b, a in zip(B_parts, A_parts)], 0) * adapter.scale
        params[f"{name}.weight"] = params[f"{name}.weight"] + delta
    return params


def _gpt(rank, world, tp, variant, sp):
    setup_tp(tp)
    config = dataclasses.replace({**GPT_VARIANTS, **GQA_VARIANTS}[variant], sequence_parallel=sp)
    torch.manual_seed(0)
    model = GPTModel(config)
    dense = model.to_dense().requires_grad_(False)
    targets = ["qkv", "proj", "fc1", "fc2"]
    names = tpcore.add_lora(model, rank=RANK, alpha=6, target_modules=targets)
    assert len(names) == 4 * config.num_layers, names
    adapters = lora_adapters(model)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for a in adapters.values() for p in (a.A, a.B)}
    specs = {n: shard_spec(model.get_submodule(n).weight) for n in adapters}
    parts = len(specs["layers.0.attention.qkv"].parts)
    assert adapters["layers.0.attention.qkv"].A.shape[0] == 3 * RANK and parts == 3
    A_ref, B_ref = {}, {}
    for i, (name, adapter) in enumerate(adapters.items()):
        A_ref[name] = unshard(adapter.A.detach(), shard_spec(adapter.A)).clone()
        B_ref[name] = _random_B(adapter, seed=100 + i)
    leaves = [t.requires_grad_(True) for t in (*A_ref.values(), *B_ref.values())]

    lora_params = [p for a in adapters.values() for p in (a.A, a.B)]
    opt, opt_ref = torch.optim.SGD(lora_params, lr=0.2), torch.optim.SGD(leaves, lr=0.2)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        ids = torch.randint(0, config.vocab_size, (2, 8), generator=g)
        params = _lora_reference_params(dense, adapters, A_ref, B_ref, specs)
        loss_ref = torch.func.functional_call(dense, params, (ids, ids))
        loss = model(ids, ids)
        assert_close(loss, loss_ref.detach(), f"step {step}: loss")
        loss.backward()
        loss_ref.backward()
        tpcore.sum_partial_grads(model)
        for name, adapter in adapters.items():
            A_grad = unshard(adapter.A.grad, shard_spec(adapter.A))
            assert_close(A_grad, A_ref[name].grad, f"step {step}: {name} A grad")
            B_grad = unshard(adapter.B.grad, shard_spec(adapter.B))
            assert_close(B_grad, B_ref[name].grad, f"step {step}: {name} B grad")
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()

    # Merged into the weights, the model computes the same; unmerged, the weights are back.
    # to_dense adds the adapters into the dense weights (before and after merging alike).
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    with torch.no_grad():
        before = {n: p.clone() for n, p in model.named_parameters()}
        logits = model(ids)
        params = _lora_reference_params(dense, adapters, A_ref, B_ref, specs)
        loss_ref = torch.func.functional_call(dense, params, (ids, ids))
        assert_close(model(ids, ids), loss_ref, "loss after training")
        for name, p in model.to_dense().named_parameters():
            assert_close(p, params[name], f"to_dense: {name}")
        tpcore.merge_lora(model)
        assert not torch.equal(model.layers[0].mlp.fc1.weight, before["layers.0.mlp.fc1.weight"])
        assert_close(model(ids), logits, "merged logits")
        for name, p in model.to_dense().named_parameters():
            assert_close(p, params[name], f"to_dense of the merged model: {name}")
        tpcore.unmerge_lora(model)
        for n, p in model.named_parameters():
            assert_close(p, before[n], f"{n} after unmerge")
        assert_close(model(ids), logits, "unmerged logits")


GPT_CASES = [  # tp, variant, sequence_parallel
    (1, "llama", False),
    (2, "llama", True),
    (4, "gpt2", False),
    (2, "llama_kv1", False),  # KV heads copied over TP ranks: B's K/V rows summed over copies
    (4, "llama_kv2", True),
]


@pytest.mark.parametrize("tp,variant,sp", GPT_CASES)
def test_gpt_lora_trains_like_dense_lora_and_merges(cpu_ranks, tp, variant, sp):
    cpu_ranks.run(_gpt, tp, variant, sp)


def _collectives(rank, world, sp):
    """Collectives on the TP group's shared-memory backend for one training step's forward and
    backward, then the partial-gradient sum: the frozen model and the same with adapters.
    (A frozen base takes fewer than a trained one: no weight gradients, so sequence
    parallelism's column layers do not gather their input again in backward.)"""
    setup_tp(2)
    group = tpcore.parallel_state.get_tensor_model_parallel_group()
    shm = tpcore.shm.shm_backend_of(group)
    assert shm is not None, "the TP group is not on the shared-memory backend"
    ops = lambda: shm.fast_ops + shm.fallback_ops  # noqa: E731
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    counts = {}
    for lora in (False, True):
        torch.manual_seed(0)
        model = GPTModel(dataclasses.replace(GPT_VARIANTS["llama"], sequence_parallel=sp))
        model.requires_grad_(False)
        if lora:
            tpcore.add_lora(model, rank=RANK, alpha=8, target_modules=["qkv", "proj", "fc1", "fc2"])
        # The first norm trainable in both: backward runs through every layer down to it.
        model.layers[0].input_norm.requires_grad_(True)
        start = ops()
        model(ids, ids).backward()
        middle = ops()
        tpcore.sum_partial_grads(model)
        counts[lora] = (middle - start, ops() - middle)
    return counts


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_lora_adds_no_collective_to_the_layers(cpu_ranks, sp):
    """Forward and backward issue exactly the base model's collectives; the adapters' partial
    gradients take one all-reduce per step, which sequence parallelism's norms already need."""
    checked = [c for c in cpu_ranks.run(_collectives, sp) if c is not None]
    assert len(checked) == 2, checked  # one TP group's two ranks
    for counts in checked:
        assert counts[True][0] == counts[False][0], counts
        assert counts[False][1] == (1 if sp else 0) and counts[True][1] == 1, counts


def _bad_input(rank, world):
    setup_tp(2)
    torch.manual_seed(0)
    model = GPTModel(GPT_VARIANTS["llama"])

    def add(**kw):
        return tpcore.add_lora(model, **{"rank": 4, "alpha": 8, "target_modules": ["qkv"], **kw})

    cases = [
        ({"rank": 0}, "LoRA rank must be a positive int, got 0"),
        ({"rank": 2.5}, "LoRA rank must be a positive int, got 2.5"),
        ({"alpha": -1}, "LoRA alpha must be a positive number, got -1"),
        ({"dropout": 1.0}, "LoRA dropout must be in [0, 1), got 1.0"),
        ({"target_modules": []}, "target_modules must be module names, got []"),
        (
            {"target_modules": ["qkv", "q_proj"]},
            "target_modules ['q_proj'] match no parallel linear layer; "
            "the model's are named ['fc1', 'fc2', 'proj', 'qkv']",
        ),
        (
            {"target_modules": ["attention"]},
            "not ColumnParallelLinear or RowParallelLinear: "
            "['layers.0.attention (ParallelAttention)'",
        ),
        ({"target_modules": "nothing.*"}, "target_modules ['nothing.*'] match no parallel"),
    ]
    for kwargs, message in cases:
        expect_error(ValueError, message, add, **kwargs)
    assert all(p.requires_grad for p in model.parameters()), "a refused add_lora froze the model"
    assert add(target_modules=r"layers\.0\..*\.qkv") == ["layers.0.attention.qkv"]
    expect_error(ValueError, "['layers.0.attention.qkv'] already have an adapter", add)
    qkv, proj = model.layers[0].attention.qkv, model.layers[0].attention.proj
    proj.lora = tpcore.LoRAAdapter(proj, rank=2, alpha=1)
    expect_error(
        ValueError, "input of shape [8, 2, 63], expected [..., 64]", qkv, torch.ones(8, 2, 63)
    )
    expect_error(ValueError, "input of shape [3, 64], expected [..., 32]", proj, torch.ones(3, 64))
    fc1 = model.layers[1].mlp.fc1
    expect_error(
        ValueError, "LoRA rank must be a positive int", tpcore.LoRAAdapter, fc1, rank=-1, alpha=1
    )
    # Expert weights (a dense layer, then an MoE layer) take no adapter: named, nothing frozen;
    # the attention of the same model takes them.
    moe = GPTModel(MOE_GPT)
    for targets in (["qkv", "fc1"], r".*\.fc2"):
        expect_error(
            ValueError,
            "match mixture-of-experts weights ['layers.1.mlp.experts.fc",
            tpcore.add_lora,
            moe,
            rank=4,
            alpha=8,
            target_modules=targets,
        )
    assert all(p.requires_grad for p in moe.parameters()), "a refused add_lora froze the model"
    adapted = tpcore.add_lora(moe, rank=4, alpha=8, target_modules=["qkv", "proj"])
    assert adapted == [f"layers.{i}.attention.{n}" for i in (0, 1) for n in ("qkv", "proj")]


def test_bad_lora_options_raise_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_input)
