"""Pipeline point-to-point messages on gloo: batched and fused exchanges deliver the right
tensors, shape/dtype mismatches are clear errors on the receiver, sent activations can
drop their storage and still back-propagate; bad pipeline input raises on every rank
before any message; a rank that dies mid-schedule fails the others within the timeout."""

from __future__ import annotations

import os
import queue
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import GPT_VARIANTS as VARIANTS
from checks import assert_close, expect_error, per_rank_tensor
from launch import warm_context
from tpcore import parallel_state
from tpcore.models import ReferenceGPT
from tpcore.pipeline_parallel import (
    activation_shape,
    build_gpt_stages,
    forward_backward,
    gpt_forward_step,
    p2p,
)

SHAPE = [4, 2, 8]


def _exchanges(rank, world, dtype):
    tpcore.initialize_model_parallel(pipeline_parallel_size=4)
    group = parallel_state.get_pipeline_model_parallel_group()
    r = dist.get_rank(group)
    act = lambda s: per_rank_tensor(SHAPE, s, dtype, seed=1)  # noqa: E731  what stage s sends forward
    grad = lambda s: per_rank_tensor(SHAPE, s, dtype, seed=2)  # noqa: E731  what stage s sends backward
    for check in (True, False):
        # One batch with both neighbours in both directions at once.
        sends, recvs = [], []
        if r < 3:
            sends.append((act(r), r + 1, p2p.FORWARD_TAG, "act"))
            recvs.append((SHAPE, r + 1, p2p.BACKWARD_TAG, "grad"))
        if r > 0:
            sends.append((grad(r), r - 1, p2p.BACKWARD_TAG, "grad"))
            recvs.append((SHAPE, r - 1, p2p.FORWARD_TAG, "act"))
        got = p2p.batch_send_recv(sends, recvs, dtype=dtype, check_shapes=check)
        want = ([grad(r + 1)] if r < 3 else []) + ([act(r - 1)] if r > 0 else [])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == dtype and torch.equal(g, w)
        # The fused pairs of 1F1B's steady state, then the single messages.
        if r % 2 == 0:
            assert torch.equal(
                p2p.send_forward_recv_backward(act(r), check_shapes=check), grad(r + 1)
            )
            p2p.send_forward(act(r) * 2, check_shapes=check)
            assert torch.equal(
                p2p.recv_backward(SHAPE, dtype=dtype, check_shapes=check), grad(r + 1) * 2
            )
        else:
            assert torch.equal(
                p2p.send_backward_recv_forward(grad(r), check_shapes=check), act(r - 1)
            )
            assert torch.equal(
                p2p.recv_forward(SHAPE, dtype=dtype, check_shapes=check), act(r - 1) * 2
            )
            p2p.send_backward(grad(r) * 2, check_shapes=check)
    if r == 3:
        expect_error(
            ValueError, "pipeline stage 3 of 4 has no next stage", p2p.send_forward, act(r)
        )
    if r == 0:
        expect_error(ValueError, "has no previous stage", p2p.recv_forward, SHAPE, dtype=dtype)
    expect_error(
        ValueError,
        "is not another rank of the pipeline group",
        p2p.batch_send_recv,
        [(act(r), r, 1, "act")],
        [],
        dtype=dtype,
    )
    expect_error(
        ValueError,
        "tag 70000 is outside",
        p2p.batch_send_recv,
        [],
        [(SHAPE, (r + 1) % 4, 70000, "act")],
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_and_fused_exchanges(cpu_ranks, dtype):
    cpu_ranks.run(_exchanges, dtype)


def _mismatch(rank, world):
    tpcore.initialize_model_parallel(pipeline_parallel_size=2)
    group = parallel_state.get_pipeline_model_parallel_group()
    r = dist.get_rank(group)
    cases = [
        (
            torch.zeros(8, 2, 8),
            [4, 2, 8],
            torch.float32,
            "expected [4, 2, 8] float32 but pipeline rank 0 sent [8, 2, 8] float32",
        ),
        (
            torch.zeros(2, 4, 8),
            [4, 2, 8],
            torch.float32,
            "expected [4, 2, 8] float32 but pipeline rank 0 sent [2, 4, 8] float32",
        ),  # same size
        (
            torch.zeros(4, 2, 8, dtype=torch.bfloat16),
            [4, 2, 8],
            torch.float32,
            "expected [4, 2, 8] float32 but pipeline rank 0 sent [4, 2, 8] bfloat16",
        ),
    ]
    for sent, expected, dtype, message in cases:
        if r == 0:
            p2p.send_forward(sent)
        else:
            expect_error(
                ValueError,
                "pipeline rank 1: the activation of micro-batch 5: " + message,
                p2p.batch_send_recv,
                [],
                [(expected, 0, p2p.FORWARD_TAG, "the activation of micro-batch 5")],
                dtype=dtype,
            )
            # The sender still waits on its payload: take it (unchecked) so the pair can go on.
            p2p.recv_forward(list(sent.shape), dtype=sent.dtype, check_shapes=False)


def test_shape_mismatch_is_a_clear_error_on_the_receiver(cpu_ranks):
    cpu_ranks.run(_mismatch)


def _released_backward(rank, world):
    torch.manual_seed(rank)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    out = torch.tanh(x @ w) + x  # the last op (add) does not save its output
    grad = torch.randn(4, 8)
    ref_w, ref_x = torch.autograd.grad(out, (w, x), grad, retain_graph=True)
    assert p2p.release_storage(out)
    assert out.numel() == 1 and out.untyped_storage().nbytes() == out.element_size()
    p2p.backward_from(out, grad)
    assert_close(w.grad, ref_w, "weight grad after release")
    assert_close(x.grad, ref_x, "input grad after release")
    assert not p2p.release_storage(x[1:])  # a view: its base would stay alive


def test_release_storage_then_backward(cpu_ranks):
    cpu_ranks.run(_released_backward)


# ---------------------------------------------------------------------------------------
# Bad input raises on every rank before any message
# ---------------------------------------------------------------------------------------


def _bad_pipeline_input(rank, world):
    tpcore.initialize_model_parallel(pipeline_parallel_size=4)
    config = VARIANTS["gpt2"]  # 2 layers: fewer than 4 stages
    expect_error(ValueError, "2 layers cannot fill 4 stages", build_gpt_stages, config)
    deep = type(config)(**{**config.__dict__, "num_layers": 8})
    expect_error(
        ValueError,
        "layer 3 is placed 2 times",
        build_gpt_stages,
        deep,
        layers_per_stage=[[0, 1, 2, 3], [3, 4], [5, 6], [7]],
    )
    expect_error(
        ValueError, "sum to num_layers=8", build_gpt_stages, deep, layers_per_stage=[2, 2, 2, 1]
    )
    expect_error(
        ValueError,
        "layers [4, 5, 6, 7] are placed on no stage",
        build_gpt_stages,
        deep,
        layers_per_stage=[[0], [1], [2], [3]],
    )
    expect_error(
        ValueError,
        "stage 2 has no layers",
        build_gpt_stages,
        deep,
        layers_per_stage=[[0], [1, 2, 3, 4, 5, 6, 7], [], []],
    )
    expect_error(ValueError, "not consecutive indices", tpcore.models.GPTModel, deep, layers=[0, 2])
    torch.manual_seed(0)
    chunks = build_gpt_stages(deep, _init=False)
    shape = activation_shape(deep, 2, 8)
    batches = [(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))] * 4
    step = gpt_forward_step(chunks, batches)
    expect_error(
        ValueError,
        "num_micro_batches must be a positive int",
        forward_backward,
        step,
        num_micro_batches=0,
        tensor_shape=shape,
        dtype=torch.float32,
    )
    expect_error(
        ValueError,
        "micro-batches (6) to be a multiple of the pipeline size (4)",
        forward_backward,
        step,
        num_micro_batches=6,
        tensor_shape=shape,
        dtype=torch.float32,
        schedule="interleaved",
        num_model_chunks=2,
    )
    expect_error(
        ValueError,
        "tensor_shape must be positive ints",
        forward_backward,
        step,
        num_micro_batches=4,
        tensor_shape=[8, 0, 32],
        dtype=torch.float32,
    )
    bad = batches[:3] + [(torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long))]
    expect_error(
        ValueError,
        (
            "micro-batch 3 of [batch, seq] = [2, 6] makes activations [6, 2, 32], "
            "but the pipeline sends [8, 2, 32]"
        ),
        gpt_forward_step,
        chunks,
        bad,
        tensor_shape=shape,
    )
    return "raised"


def test_bad_pipeline_input_raises_on_every_rank_before_any_message(cpu_ranks):
    assert cpu_ranks.run(_bad_pipeline_input) == ["raised"] * 4


def _disagreeing_pipeline_ranks(rank, world):
    tpcore.initialize_model_parallel(pipeline_parallel_size=world)
    config = type(VARIANTS["gpt2"])(**{**VARIANTS["gpt2"].__dict__, "num_layers": world})
    torch.manual_seed(0)
    chunks = build_gpt_stages(config)
    batches = [(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))] * 8
    args = dict(
        num_micro_batches=4, tensor_shape=activation_shape(config, 2, 8), dtype=torch.float32
    )
    # One rank differs; without the check: a wait on a message that never comes, or (one
    # rank forward-only) unread gradients left in the links and a silent return.
    for name, value in (
        ("num_micro_batches", 8),
        ("forward_only", True),
        ("loss_scale", 2.0),
        ("check_shapes", False),
        ("tensor_shape", [float(d) for d in args["tensor_shape"]]),
    ):
        mine = {**args, name: value} if rank == 1 else args
        expect_error(
            ValueError,
            f"disagree on {name}",
            forward_backward,
            gpt_forward_step(chunks, batches),
            **mine,
        )
    # A list and a tuple, an int and a float agree; the pipeline still runs.
    shape = list(args["tensor_shape"]) if rank % 2 else tuple(args["tensor_shape"])
    loss = forward_backward(
        gpt_forward_step(chunks, batches),
        **{**args, "tensor_shape": shape, "loss_scale": 1 if rank else 1.0},
    )
    return float(loss)


def test_pipeline_ranks_that_disagree_raise_on_every_rank(cpu_ranks):
    losses = cpu_ranks.run(_disagreeing_pipeline_ranks)
    assert len(set(losses)) == 1, losses


# ---------------------------------------------------------------------------------------
# A rank dying mid-schedule
# ---------------------------------------------------------------------------------------

GROUP_TIMEOUT_S = 15


def _dying_rank(rank, world, store_path, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    tpcore.initialize_model_parallel(
        pipeline_parallel_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )
    config = type(VARIANTS["gpt2"])(**{**VARIANTS["gpt2"].__dict__, "num_layers": world})
    torch.manual_seed(0)
    chunks = build_gpt_stages(config, _init=False)
    for chunk in chunks:
        chunk.load_dense_state_dict(ReferenceGPT(config).state_dict())
    batches = [(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))] * 8
    inner = gpt_forward_step(chunks, batches)

    def step(chunk, micro, x):
        if rank == 2 and micro == 3:
            os._exit(7)  # dies between messages, in the middle of the steady state
        return inner(chunk, micro, x)

    start = time.monotonic()
    try:
        forward_backward(
            step,
            num_micro_batches=8,
            tensor_shape=activation_shape(config, 2, 8),
            dtype=torch.float32,
        )
        results.put((rank, "finished", "", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - what matters is that it raises, and how fast
        results.put((rank, type(e).__name__, str(e), time.monotonic() - start))


def test_a_rank_dying_mid_schedule_fails_every_other_rank_within_the_timeout():
    world = 4
    ctx = warm_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_dying_rank,
                args=(r, world, os.path.join(tmp, "store"), results),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got = {}
        deadline = (
            time.monotonic() + 120 + 2 * GROUP_TIMEOUT_S
        )  # spawning and importing torch take most of it
        try:
            while len(got) < world - 1 and time.monotonic() < deadline:
                try:
                    rank, kind, message, elapsed = results.get(timeout=1)
                    got[rank] = (kind, message, elapsed)
                except queue.Empty:
                    pass
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    assert procs[2].exitcode == 7
    assert sorted(got) == [0, 1, 3], (
        f"ranks that never reported (hung): {sorted(set(range(world)) - {2} - set(got))}"
    )
    for rank, (kind, message, elapsed) in got.items():
        assert kind == "RuntimeError", (rank, kind, message)
        assert f"tpcore: pipeline rank {rank}:" in message, message
        assert elapsed < GROUP_TIMEOUT_S + 10, (rank, elapsed)


# ---------------------------------------------------------------------------------------
# The embedding group and pipeline stages of GPTModel
# ---------------------------------------------------------------------------------------


def test_embedding_groups_join_the_first_and_last_stage():
    from tpcore.parallel_state import rank_layout

    layout = rank_layout(16, 2, 4)  # TP adjacent, then DP (2), then PP (4 stages of 4 ranks)
    assert layout.pipeline[0] == [0, 4, 8, 12] and layout.embedding[0] == [0, 12]
    assert layout.embedding == [[g[0], g[-1]] for g in layout.pipeline]
    assert rank_layout(4, 2, 1).embedding == [[0], [1], [2], [3]]  # no pipeline: every rank alone


def _live_embedding_group(rank, world):
    state = tpcore.initialize_model_parallel(pipeline_parallel_size=4)
    assert parallel_state.is_pipeline_first_stage() == (
        rank == 0
    ) and parallel_state.is_pipeline_last_stage() == (rank == 3)
    if rank in (0, 3):
        assert dist.get_process_group_ranks(parallel_state.get_embedding_group()) == [0, 3]
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=state.embedding_group)
        assert t.item() == 5.0
    else:
        expect_error(
            RuntimeError,
            f"pipeline stage {rank} is neither the first nor the last",
            parallel_state.get_embedding_group,
        )
    config = type(VARIANTS["gpt2"])(**{**VARIANTS["gpt2"].__dict__, "num_layers": 8})
    torch.manual_seed(0)
    (chunk,) = build_gpt_stages(config, _init=False)
    names = [n for n, _ in chunk.named_parameters()]
    assert all(
        n.startswith(f"layers.{2 * rank}.") or n.startswith(f"layers.{2 * rank + 1}.")
        for n in names
        if n.startswith("layers.")
    )
    assert ("embedding.word.weight" in names) == (
        rank in (0, 3)
    )  # tied: the last stage holds a copy
    assert ("embedding.position.weight" in names) == (rank == 0) and (
        "final_norm.weight" in names
    ) == (rank == 3)
    assert set(names) <= {n for n, _ in ReferenceGPT(config, device="meta").named_parameters()}
    expect_error(ValueError, "this is one pipeline stage", chunk.to_dense)
    if rank == 1:
        expect_error(
            ValueError,
            "this pipeline stage takes hidden states",
            chunk,
            torch.zeros(2, 8, dtype=torch.long),
        )
        expect_error(
            ValueError,
            "has no LM head",
            chunk,
            torch.zeros(8, 2, 32),
            torch.zeros(2, 8, dtype=torch.long),
        )


def test_live_embedding_group_and_gpt_stages(cpu_ranks):
    cpu_ranks.run(_live_embedding_group)
