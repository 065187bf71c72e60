"""tpcore's ops under torch.compile / fake tensors / torch.export, against eager in the same rank.

Every op is a custom operator: opcheck verifies its schema, fake implementation, autograd
registration and AOT dispatch at TP 1, 2 and 4; a compiled GPTModel (fullgraph) gives the
eager loss and gradients with no graph break; the layers compile inside a user's model;
a TP=1 GPT exports.

What these checks are about (dynamo's tracing, fake kernels, functionalization, AOT
autograd's joint graph) happens before the backend, so most cases compile with `aot_eager`:
inductor's code generation costs a minute a case on a cold cache here and adds nothing to
them, since tpcore's ops reach inductor as opaque kernels. INDUCTOR_CASES run the full
inductor path: GPTs whose ops cover every tpcore op under inductor, and the user's model.
Inductor's own C++ kernels are generated without SIMD (`_scalar_inductor`): the vectorized
ones take g++ a third longer to build and hold no tpcore code.

The GPTs have one layer (every op of a layer is traced all the same; dynamo unrolls the
layers, so each one more costs as much again), except MULTI_LAYER_CASES, which pass the
residual stream, the sequence-parallel split and recompute from one layer to the next.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.library import opcheck

import tpcore
from checks import GPT_VARIANTS, GQA_VARIANTS, assert_close, per_rank_tensor, setup_tp
from tpcore.models import GPTModel, finalize_sequence_parallel_grads
from tpcore.tensor_parallel.random import MODEL_PARALLEL_RNG, REPLICATED_RNG

ops = torch.ops.tpcore
STATIC_CHECKS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
)
ALL_CHECKS = STATIC_CHECKS + ("test_aot_dispatch_dynamic",)


def _check(op, args, checks=STATIC_CHECKS) -> None:
    result = opcheck(op, args, test_utils=checks)
    failed = {k: v for k, v in result.items() if v != "SUCCESS"}
    assert not failed, f"{op}: {failed}"


def _opcheck_every_op(rank, world, tp):
    tp_rank, tp = setup_tp(tp)
    g = tpcore.parallel_state.get_tensor_model_parallel_group().group_name

    def leaf(shape, seed, dtype=torch.float32):
        return per_rank_tensor(shape, tp_rank, dtype, seed).requires_grad_()

    s, b, h, v = 2 * tp, 3, 8, 5  # sequence, batch, hidden, vocab rows per rank
    x = per_rank_tensor((s, b, h), tp_rank, seed=1)
    # Primitives (no autograd of their own: inputs without grad).
    for op, args in [
        (ops.all_reduce, (x, g)),
        (ops.all_gather, (x, 1, g)),
        (ops.all_gather, (x[0, 0, 0], 0, g)),
        (ops.reduce_scatter, (x, 0, g)),
        (ops.broadcast, (x, 0, g)),
        (ops.split, (x, -1, g)),
        (ops.all_reduce_start, (x, g)),
        (ops.all_gather_start, (x, g)),
        (ops.reduce_scatter_start, (x, g)),
    ]:
        _check(op, args, ALL_CHECKS)
    w = per_rank_tensor((4, h), tp_rank, seed=2)
    ids = torch.randint(0, v * tp - 1, (s, b), generator=torch.Generator().manual_seed(3))
    flat_logits = per_rank_tensor((s * b, v), tp_rank, seed=4)
    target = torch.randint(0, v * tp - 1, (s * b,), generator=torch.Generator().manual_seed(5))
    stats = ops.cross_entropy_forward(flat_logits, target, g, v * tp, 0.1, -100, 0.0)
    table = per_rank_tensor((v, h), tp_rank, seed=6)
    flat_h = per_rank_tensor((s * b, h), tp_rank, seed=7)
    for sp in (False, True):
        for mask in ([True, True, True], [True, False, False]):
            _check(
                ops.column_parallel_linear_backward,
                (
                    per_rank_tensor((s * (tp if sp else 1), b, 4), tp_rank, seed=8),
                    x,
                    w,
                    g,
                    sp,
                    mask,
                ),
                ALL_CHECKS,
            )
        _check(ops.row_parallel_linear_forward, (x, w, g, sp), ALL_CHECKS)
        _check(ops.vocab_parallel_embedding_forward, (ids, table, g, v * tp, sp), ALL_CHECKS)
        grad = per_rank_tensor((s // (tp if sp else 1), b, h), tp_rank, seed=9)
        _check(
            ops.vocab_parallel_embedding_backward, (grad, ids.reshape(-1), v, 0, g, sp), ALL_CHECKS
        )
    _check(ops.cross_entropy_forward, (flat_logits, target, g, v * tp, 0.1, -100, 1e-3), ALL_CHECKS)
    _check(
        ops.cross_entropy_backward,
        (flat_logits, target, stats[1], stats[2], g, v * tp, 0.1, 1e-3),
        ALL_CHECKS,
    )
    _check(
        ops.linear_cross_entropy_forward,
        (flat_h, table, target, g, v * tp, 0.0, -100, 0.0, 4),
        ALL_CHECKS,
    )
    _check(
        ops.linear_cross_entropy_backward,
        (flat_h, table, target, stats[1], stats[2], g, v * tp, 0.0, 0.0, 4, [True, True]),
        ALL_CHECKS,
    )

    # Layer ops, with autograd.
    for op in (
        ops.copy_to_tensor_parallel,
        ops.reduce_from_tensor_parallel,
        ops.scatter_to_tensor_parallel,
        ops.gather_from_tensor_parallel,
        ops.scatter_to_sequence_parallel,
        ops.reduce_scatter_to_sequence_parallel,
    ):
        _check(op, (leaf((s, b, h), 10), g))
    _check(ops.gather_from_sequence_parallel, (leaf((s, b, h), 11), g, True))
    _check(ops.gather_from_sequence_parallel, (leaf((s, b, h), 11), g, False))
    for sp in (False, True):
        _check(
            ops.column_parallel_linear,
            (leaf((s, b, h), 12), leaf((4, h), 13), leaf((4,), 14), g, False, sp),
        )
        _check(
            ops.row_parallel_linear,
            (leaf((s, b, h), 15), leaf((4, h), 16), leaf((4,), 17), g, True, sp),
        )
        _check(ops.vocab_parallel_embedding, (ids, leaf((v, h), 18), g, v * tp - 1, 1, sp))
    _check(
        ops.column_parallel_linear, (leaf((s, b, h), 12), leaf((4, h), 13), None, g, True, False)
    )
    _check(
        ops.row_parallel_linear, (leaf((s, b, h * tp), 15), leaf((4, h), 16), None, g, False, False)
    )
    logits = leaf((s, b, v), 19)
    target2 = target.view(s, b).clone()
    target2[0, 0] = -100
    for reduction in (0, 1, 2):
        _check(
            ops.vocab_parallel_cross_entropy,
            (logits, target2, g, v * tp - 1, 0.1, -100, reduction, 1e-3, False),
        )
        _check(
            ops.vocab_parallel_linear_cross_entropy,
            (
                leaf((s, b, h), 20),
                leaf((v, h), 21),
                target2,
                g,
                v * tp - 1,
                0.1,
                -100,
                reduction,
                1e-3,
                4,
            ),
        )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_opcheck_every_op(cpu_ranks, tp):
    cpu_ranks.run(_opcheck_every_op, tp, timeout=600)


BATCH, SEQ = 2, 8

# What docs/development.md states: compiling whole models is tested from torch 2.15; on torch
# 2.4 dynamo cannot trace the rotary tables (it makes the config's sizes symbolic). The ops
# themselves (opcheck above) and eager use work on every supported torch.
compile_tested = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 15),
    reason="whole-model torch.compile is tested from torch 2.15",
)


def _scalar_inductor():
    """Inductor with scalar C++ kernels: see the module's docstring."""
    return torch._inductor.config.patch({"cpp.vec_isa_ok": False})


@_scalar_inductor()  # inductor compiles at the first forward and the first backward
def _eager_and_compiled_gpt(
    rank,
    world,
    tp,
    variant,
    sequence_parallel,
    fused,
    recompute,
    dynamic,
    dropout,
    backend,
    num_layers,
):
    from torch._dynamo.testing import CompileCounterWithBackend

    setup_tp(tp)
    torch._dynamo.reset()
    config = dataclasses.replace(
        {**GPT_VARIANTS, **GQA_VARIANTS}[variant],
        sequence_parallel=sequence_parallel,
        fused_lm_head_loss=fused,
        recompute=recompute,
        dropout=dropout,
        attention_dropout=dropout,
        num_layers=num_layers,
    )
    tpcore.model_parallel_manual_seed(11)
    tracker = tpcore.get_rng_tracker()
    for stream in (MODEL_PARALLEL_RNG, REPLICATED_RNG):
        tracker.counter(stream, torch.device("cpu"))  # created now, so snapshots hold them
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPTModel(config))
    eager, model = models
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend=counter)
    g = torch.Generator().manual_seed(1)
    # Static: the second step runs the cached graphs. Dynamic: one graph, three shapes (no
    # batch of 1: dynamo gives size-1 dimensions a graph of their own).
    shapes = (
        [(BATCH, SEQ), (BATCH + 1, SEQ // 2), (BATCH + 2, 2 * SEQ)]
        if dynamic
        else [(BATCH, SEQ)] * 2
    )
    for step, shape in enumerate(shapes):
        ids = torch.randint(0, config.vocab_size, shape, generator=g)
        target = torch.randint(0, config.vocab_size, shape, generator=g)
        target[0, 0] = -100
        # Both draw their dropout masks from the same stream positions.
        streams = tracker.counter_snapshot()
        want = eager(ids, target)
        tracker.restore_counters(streams)
        got = compiled(ids, target)
        if step == 0:
            first_step_frames = counter.frame_count
        assert_close(got, want.detach(), f"step {step}: loss")
        want.backward()
        got.backward()
        if sequence_parallel:
            finalize_sequence_parallel_grads(eager)
            finalize_sequence_parallel_grads(model)
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert_close(q.grad, p.grad, f"step {step}: grad of {name}")
            p.grad = q.grad = None
    # fullgraph: no graph break; the later steps (new shapes under dynamic=True) run the first
    # step's graphs. (A dynamic first step calls the backend twice: dynamo restarts once when
    # the loss's float arguments cannot become graph inputs.)
    assert counter.frame_count == first_step_frames, (
        f"{counter.frame_count - first_step_frames} recompilations after the first step "
        f"for shapes {shapes}"
    )
    assert dynamic or first_step_frames == 1, f"{first_step_frames} compilations for one step"
    if dropout:  # in grad mode as the steps were, so the call reuses the last step's graph
        assert compiled(ids, target).detach() != model.eval()(ids, target).detach(), (
            "dropout must change the loss"
        )


# A covering set: every TP size, tied (gpt2) and untied (llama, qwen3) heads, sequence parallelism
# on and off, the fused head + loss and the plain one, selective recompute and none, static
# and dynamic shapes.
GPT_CASES = [
    (1, "gpt2", False, False, "none", False),
    (1, "llama", False, True, "selective", False),
    (2, "gpt2", True, True, "selective", False),
    (2, "llama", False, False, "none", False),
    (2, "llama", True, False, "selective", False),
    (4, "gpt2", False, True, "none", False),
    (4, "llama", True, True, "none", False),
    (2, "gpt2", True, False, "none", True),
    (2, "llama", False, True, "selective", True),
    # Qwen3's q / k norms (weights through copy_to_tensor_parallel), 16-wide heads; and on
    # KV heads replicated over TP.
    (2, "qwen3", True, False, "selective", False),
    (4, "qwen3_kv2", True, True, "none", False),
    # Gemma's (1 + weight) norms, GeGLU and scaled embeddings, one KV head replicated over TP.
    (2, "gemma", True, False, "selective", False),
]


# Hidden and attention dropout (tpcore's counter-based dropout: the same masks compiled and
# eager), in TP and sequence-parallel regions and replicated ones, under every recompute mode.
DROPOUT_CASES = [
    (2, "gpt2", True, True, "full", False),
    (2, "llama", False, False, "selective", False),
    (1, "gpt2", False, False, "none", True),
]


# Inductor too: sequence parallelism, the fused head + loss, dropout under full recompute
# (every other tpcore op reaches inductor in test_layers_compile_inside_a_user_model).
INDUCTOR_CASES = [(2, "gpt2", True, True, "full", False, 0.2)]

# Two layers: sequence parallelism and selective recompute across a layer boundary.
MULTI_LAYER_CASES = {(2, "llama", True, False, "selective", False, 0.0, "aot_eager")}


@compile_tested
@pytest.mark.parametrize(
    "tp,variant,sequence_parallel,fused,recompute,dynamic,dropout,backend",
    [(*case, 0.0, "aot_eager") for case in GPT_CASES]
    + [(*case, 0.2, "aot_eager") for case in DROPOUT_CASES]
    + [(*case, "inductor") for case in INDUCTOR_CASES],
)
def test_compiled_gpt_matches_eager(
    cpu_ranks, tp, variant, sequence_parallel, fused, recompute, dynamic, dropout, backend
):
    case = (tp, variant, sequence_parallel, fused, recompute, dynamic, dropout, backend)
    cpu_ranks.run(
        _eager_and_compiled_gpt, *case, 2 if case in MULTI_LAYER_CASES else 1, timeout=900
    )


def _backward_graph_overlaps(rank, world, tp, sequence_parallel):
    """The compiled column-parallel backward starts its input-gradient collective, computes the
    weight gradient, then waits (the functional-collective form), and equals eager."""
    from torch._dynamo.backends.common import aot_autograd

    setup_tp(tp)
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    layer = tpcore.ColumnParallelLinear(16, 8 * tp, sequence_parallel=sequence_parallel)
    x = per_rank_tensor((4, 2, 16), dist.get_rank(), seed=1).requires_grad_()
    compiled = torch.compile(
        layer, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True
    )
    got = compiled(x)
    got.square().sum().backward()
    want = layer(x.detach().requires_grad_())
    assert_close(got, want.detach(), "output")
    x_ref = x.detach().requires_grad_()
    weight_grad = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x_ref).square().sum().backward()
    assert_close(weight_grad, layer.weight.grad, "weight grad")
    assert_close(x.grad, x_ref.grad, "input grad (the started collective's result)")
    backward = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
    start = (
        "tpcore.reduce_scatter_start.default"
        if sequence_parallel
        else "tpcore.all_reduce_start.default"
    )
    assert start in backward, backward
    waits = [i for i, t in enumerate(backward) if t == "_c10d_functional.wait_tensor.default"]
    mms = [i for i, t in enumerate(backward) if t == "aten.mm.default"]
    assert waits and mms and backward.index(start) < mms[-1] < waits[-1], backward


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_compiled_backward_keeps_the_overlap(cpu_ranks, sequence_parallel):
    cpu_ranks.run(_backward_graph_overlaps, 2, sequence_parallel, timeout=600)


class _UserModel(torch.nn.Module):
    """A user's own model with tpcore layers in it: embedding, MLP, loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = tpcore.VocabParallelEmbedding(30, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.up = tpcore.ColumnParallelLinear(16, 32)
        self.down = tpcore.RowParallelLinear(32, 16, input_is_parallel=True)
        self.head = tpcore.ColumnParallelLinear(16, 32, bias=False)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embedding(ids))
        x = x + self.down(F.gelu(self.up(x)))
        return tpcore.vocab_parallel_cross_entropy(self.head(x), target, vocab_size=30)


@_scalar_inductor()
def _layers_in_user_model(rank, world, tp):
    setup_tp(tp)
    torch._dynamo.reset()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(_UserModel())
    eager, model = models
    compiled = torch.compile(model, fullgraph=True)  # inductor
    ids = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(2))
    want, got = eager(ids, target), compiled(ids, target)
    assert_close(got, want.detach(), "loss")
    want.backward()
    got.backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert_close(q.grad, p.grad, f"grad of {name}")
    # tpcore.hf's scaled embedding (Gemma's) compiles with no graph break.
    from tpcore.tensor_parallel import ScaledVocabParallelEmbedding

    scaled = ScaledVocabParallelEmbedding(30, 8, embed_scale=8**0.5)
    # fullgraph=True raises at a graph break, naming it
    assert torch.equal(
        torch.compile(scaled, fullgraph=True, backend="aot_eager")(ids), scaled(ids)
    ), "scaled embedding"
    # Split Phi-3 and OLMo 2 attentions compile with no graph break: Phi-3's reads its per-rank
    # head count from a RankConfig, OLMo 2's q / k norms span the heads of every rank.
    import copy

    import transformers

    import tpcore.hf

    small = dict(
        vocab_size=30,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    for family in ("Phi3", "Olmo2"):
        torch.manual_seed(5)  # the same dense model on every rank
        dense = getattr(transformers, f"{family}ForCausalLM")(
            getattr(transformers, f"{family}Config")(**small)
        ).eval()
        split = tpcore.hf.parallelize(copy.deepcopy(dense)).model
        hidden = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(4))
        rotary = split.rotary_emb(hidden, torch.arange(6)[None])
        attention = split.layers[0].self_attn
        with torch.no_grad():
            want = dense.model.layers[0].self_attn(hidden, rotary, None)[0]
            compiled_attention = torch.compile(attention, fullgraph=True, backend="aot_eager")
            assert_close(
                compiled_attention(hidden, rotary, None)[0],
                want,
                f"compiled split {family} attention",
            )
    # The functional collectives compile too.
    x = per_rank_tensor((4, 2 * tp), dist.get_rank(), seed=3)
    fn = torch.compile(
        lambda t: tpcore.comm.all_gather(tpcore.comm.reduce_scatter(t * 2, 1), 0) + 1,
        fullgraph=True,
    )  # inductor
    assert_close(
        fn(x),
        tpcore.comm.all_gather(tpcore.comm.reduce_scatter(x * 2, 1), 0) + 1,
        "compiled collectives",
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_layers_compile_inside_a_user_model(cpu_ranks, tp):
    cpu_ranks.run(_layers_in_user_model, tp, timeout=600)


def _export_and_dynamic(rank, world):
    setup_tp(1)
    torch.manual_seed(0)
    model = GPTModel(GPT_VARIANTS["llama"]).eval()
    ids = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    exported = torch.export.export(model, (ids,))
    nodes = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("tpcore" in t for t in nodes), nodes
    other = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    assert_close(exported.module()(other), model(other).detach(), "exported logits")
    # Dynamic shapes: one graph for every batch and sequence length, equal to eager; a batch
    # of 1 then gets one graph of its own (dynamo specialises sizes 0 and 1).
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    dynamic = torch.compile(model, dynamic=True, fullgraph=True, backend=counter)
    for step, (batch, seq) in enumerate(((2, 8), (3, 6), (4, 16))):
        ids = torch.randint(0, 50, (batch, seq), generator=torch.Generator().manual_seed(seq))
        assert_close(
            dynamic(ids), model(ids).detach(), f"dynamic shapes: logits of [{batch}, {seq}]"
        )
        if step == 0:
            first_step_frames = counter.frame_count
    assert counter.frame_count == first_step_frames, "recompiled for a new shape"
    ids = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(12))
    assert_close(dynamic(ids), model(ids).detach(), "dynamic shapes: logits of [1, 12]")
    assert counter.frame_count == first_step_frames + 1, "a batch of 1: one more graph"


@compile_tested
def test_export_and_dynamic_shapes(cpu_ranks):
    cpu_ranks.run(_export_and_dynamic, timeout=600)


def _eager_entries(rank, world, tp):
    """The eager entries (`tpcore._op_entry`: the operators called from C++) give what
    torch.ops gives, and dispatch like it: fake tensors get fake results with no collective."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpcore import _op_entry

    tp_rank, tp = setup_tp(tp)
    g = tpcore.parallel_state.get_tensor_model_parallel_group().group_name
    x = per_rank_tensor((4, 2, 8), tp_rank, seed=1)
    w = per_rank_tensor((6, 8), tp_rank, seed=2)
    outs, grads = [], []
    for call in (_op_entry.column_parallel_linear, ops.column_parallel_linear.default):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = call(xi, wi, None, g, True, False)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append((xi.grad, wi.grad))
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
    assert torch.equal(_op_entry.all_gather(x, 0, g), ops.all_gather.default(x, 0, g))
    with FakeTensorMode() as mode:
        fake_x, fake_w = mode.from_tensor(x), mode.from_tensor(w)
        out = _op_entry.column_parallel_linear(fake_x, fake_w, None, g, True, False)
        gathered = _op_entry.all_gather(fake_x, 0, g)
    assert tuple(out.shape) == (4, 2, 6 * tp) and tuple(gathered.shape) == (4 * tp, 2, 8)


@pytest.mark.parametrize("tp", [1, 2])
def test_eager_entries_match_torch_ops(cpu_ranks, tp):
    cpu_ranks.run(_eager_entries, tp, timeout=300)
