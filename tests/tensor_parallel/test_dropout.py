"""tpcore's counter-based dropout (`tpcore::dropout`, `tpcore.tracked_dropout`): the Philox
words against Random123's published known answer and a reference written here, the drop
rate, autograd, clear errors, the tracker's streams across TP / DP ranks, recompute and
checkpoints. Its torch.compile path is tested in test_compile.py (GPT with dropout)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.library import opcheck

import tpcore
from checks import assert_close, expect_error, setup_tp
from tpcore.tensor_parallel.random import MODEL_PARALLEL_RNG, REPLICATED_RNG, get_rng_tracker

ops = torch.ops.tpcore
M32 = 0xFFFFFFFF


def philox_words(key: int, block: int) -> list[int]:
    """Philox4x32-10 of counter (block lo, block hi, 0, 0) under a 64-bit key, in plain Python
    integers (Salmon et al. 2011): the reference the kernels are checked against."""
    c = [block & M32, (block >> 32) & M32, 0, 0]
    k0, k1 = key & M32, (key >> 32) & M32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c[3] ^ k1) & M32, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


def reference_keep(n: int, seed: int, offset: int, p: float) -> torch.Tensor:
    threshold = min(round(p * 2**32), M32)
    words = [w for b in range((n + 3) // 4) for w in philox_words(seed % 2**64, offset // 4 + b)]
    return torch.tensor([w >= threshold for w in words[:n]])


def kept_words(seed: int, offset: int) -> list[int]:
    """The four words of one block, read back through the op: a word is the largest threshold
    t (p = t / 2^32) at which its element is still kept."""
    x = torch.ones(4, dtype=torch.float64)
    state = torch.tensor([seed, offset])
    lo, hi = [0] * 4, [M32] * 4
    while lo != hi:
        mid = [(a + b + 1) // 2 for a, b in zip(lo, hi)]
        for i in range(4):
            kept = ops.dropout_apply(x, state, mid[i] / 2**32)[i].item() != 0
            lo[i], hi[i] = (mid[i], hi[i]) if kept else (lo[i], mid[i] - 1)
    return lo


def test_philox_known_answer():
    # Random123's kat_vectors: philox4x32-10, counter 0 and key 0.
    assert kept_words(0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert kept_words(2**40 + 3, 4 * 7) == philox_words(2**40 + 3, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_masks_and_values_match_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    # Sizes through the vectorized loop (32 blocks at a time) and its tail; block numbers
    # crossing 2^32 (the counter's high word).
    cases = [
        (1, 0, 0, 0.5),
        (5, 2**40 + 3, 8, 0.1),
        (1027, -1, 4 * (2**32 - 100), 0.3),
        (300, 7, 2**40, 0.5),
    ]
    for n, seed, offset, p in cases:
        x = (torch.rand(n, generator=g) + 0.5).to(dtype)  # no zeros: a zero output means dropped
        out = ops.dropout_apply(x, torch.tensor([seed, offset]), p)
        keep = reference_keep(n, seed, offset, p)
        assert torch.equal(out != 0, keep), (n, seed, offset)
        assert_close(out, x * keep / (1 - p), f"{dtype} n={n}")
    # Any layout: the mask follows the row-major order of the values.
    x = torch.randn(6, 10, generator=g).to(dtype).t()
    state = torch.tensor([11, 0])
    assert torch.equal(
        ops.dropout_apply(x, state, 0.4), ops.dropout_apply(x.contiguous(), state, 0.4)
    )


def test_drop_rate_and_identity():
    x = torch.ones(1 << 20)
    for p in (0.1, 0.3, 0.9):
        out = ops.dropout_apply(x, torch.tensor([5, 0]), p)
        assert abs((out == 0).float().mean().item() - p) < 0.003, p  # 1M draws: 4 sigma < 0.002
        assert abs(out.mean().item() - 1.0) < 0.01
    assert torch.equal(ops.dropout_apply(x, torch.tensor([5, 0]), 0.0), x)
    nan = torch.full((8,), float("nan"))
    assert ops.dropout_apply(nan, torch.tensor([1, 0]), 0.5).isnan().all(), (
        "a NaN stays NaN, as in F.dropout"
    )


def test_autograd_applies_the_same_mask():
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(3, 7, generator=g) + 0.5).requires_grad_()
    state = torch.tensor([9, 12])
    out = ops.dropout(x, state, 0.25)
    grad_out = torch.randn(3, 7, generator=g)
    out.backward(grad_out)
    keep = (out != 0).detach()
    assert_close(x.grad, grad_out * keep / 0.75, "input gradient")
    for op, args in [
        (ops.dropout_apply, (x.detach(), state, 0.25)),
        (ops.dropout, (x, state, 0.25)),
        (ops.rng_state_copy, (state,)),
    ]:
        result = opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_bad_arguments_raise_clear_errors():
    x, state = torch.ones(4), torch.tensor([1, 0])
    expect_error(ValueError, "p must be in [0, 1)", ops.dropout_apply, x, state, 1.0)
    expect_error(ValueError, "p must be in [0, 1)", ops.dropout, x, state, -0.1)
    expect_error(ValueError, "p must be in [0, 1)", tpcore.tracked_dropout, x, 1.5)
    expect_error(
        TypeError, "floating-point", ops.dropout_apply, torch.ones(4, dtype=torch.int64), state, 0.5
    )
    expect_error(ValueError, "int64 tensor [2]", ops.dropout_apply, x, state.float(), 0.5)
    expect_error(ValueError, "int64 tensor [2]", ops.dropout_apply, x, torch.tensor([1, 0, 0]), 0.5)
    expect_error(ValueError, "multiple of 4", ops.dropout_apply, x, torch.tensor([1, 6]), 0.5)
    expect_error(ValueError, "rng_state is on meta", ops.dropout_apply, x, state.to("meta"), 0.5)


def test_fork_under_compile_points_to_tracked_dropout():
    tracker = tpcore.tensor_parallel.random.RNGStatesTracker()
    tracker.add("tp", 3)

    def forked_dropout(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork("tp"):
            return torch.nn.functional.dropout(x, 0.5)

    assert forked_dropout(torch.ones(8)).shape == (8,)  # eager: fine
    torch._dynamo.reset()
    with pytest.raises(Exception, match="tracked_dropout"):
        torch.compile(forked_dropout, fullgraph=True)(torch.ones(8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_drops_the_elements_the_cpu_drops(dtype):
    x = torch.randn(3, 1001, generator=torch.Generator().manual_seed(2)).to(dtype)
    for seed, offset in [(0, 0), (2**40 + 3, 2**33 + 4)]:
        cpu = ops.dropout_apply(x, torch.tensor([seed, offset]), 0.3)
        cuda = ops.dropout_apply(x.cuda(), torch.tensor([seed, offset], device="cuda"), 0.3)
        assert torch.equal(cuda.cpu(), cpu), (dtype, seed, offset)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_tracked_dropout_inside_cuda_graph_capture_advances_between_replays():
    tracker = tpcore.tensor_parallel.random.RNGStatesTracker()
    tracker.add("tp", 11)
    x = torch.ones(4096, device="cuda")
    start = tracker.counter("tp", x.device).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no register_cuda_graph: the counter lives on the GPU
        out = tpcore.tracked_dropout(x, 0.5, "tp")
    tracker.restore_counters({("tp", str(x.device)): start})  # capture ran nothing
    masks = []
    for _ in range(2):
        graph.replay()
        masks.append(out.clone())
    assert not torch.equal(masks[0], masks[1]), "the counter did not advance between replays"
    tracker.restore_counters({("tp", str(x.device)): start})
    for mask in masks:
        assert torch.equal(tpcore.tracked_dropout(x, 0.5, "tp"), mask), (
            "a replay drew other masks than eager calls"
        )


def _streams(rank, world):
    tp_rank, tp = setup_tp(2, replicas=True)  # TP groups {0, 1}, {2, 3}
    get_rng_tracker().reset()
    expect_error(
        RuntimeError, "model_parallel_manual_seed", tpcore.tracked_dropout, torch.ones(8), 0.5
    )
    tpcore.model_parallel_manual_seed(7)
    x = torch.ones(64)
    per_rank = [torch.empty(64) for _ in range(world)]
    dist.all_gather(per_rank, tpcore.tracked_dropout(x, 0.5))
    assert not torch.equal(per_rank[0], per_rank[1]), "TP ranks must drop different elements"
    assert torch.equal(per_rank[0], per_rank[2]) and torch.equal(per_rank[1], per_rank[3]), (
        "DP replicas must agree"
    )
    dist.all_gather(per_rank, tpcore.tracked_dropout(x, 0.5, REPLICATED_RNG))
    assert all(torch.equal(m, per_rank[0]) for m in per_rank), (
        "the replicated stream must agree on every rank"
    )
    assert torch.equal(tpcore.tracked_dropout(x, 0.5, training=False), x)

    # A stream is a sequence: draws of 8 then 5 elements continue one draw of 13.
    tracker = get_rng_tracker()
    start = tracker.counter(MODEL_PARALLEL_RNG, x.device).tolist()
    both = torch.cat([tpcore.tracked_dropout(x[:8], 0.5), tpcore.tracked_dropout(x[:5], 0.5)])
    assert tracker.counter(MODEL_PARALLEL_RNG, x.device).tolist() == [start[0], start[1] + 16], (
        "5 elements take 2 blocks of 4"
    )
    tracker.restore_counters({(MODEL_PARALLEL_RNG, "cpu"): torch.tensor(start)})
    assert torch.equal(tpcore.tracked_dropout(x[:13], 0.5), both)

    # Recompute replays the masks; positions round-trip as ints.
    w = torch.randn(8, 8, requires_grad=True)
    fn = lambda t: tpcore.tracked_dropout(t @ w, 0.5)  # noqa: E731
    inp = torch.randn(4, 8, requires_grad=True)
    positions = tracker.counter_positions()
    plain = fn(inp)
    plain.sum().backward()
    want = (w.grad.clone(), inp.grad.clone())
    w.grad = inp.grad = None
    tracker.set_counter_positions(positions)
    recomputed = tpcore.recompute(fn, inp)
    assert torch.equal(recomputed, plain)
    tracker.counter(MODEL_PARALLEL_RNG, x.device)[1] += 400  # draws between forward and backward
    recomputed.sum().backward()
    assert torch.equal(w.grad, want[0]) and torch.equal(inp.grad, want[1]), (
        "recompute must redraw the forward's masks"
    )


def test_streams_across_ranks_recompute_and_positions(cpu_ranks):
    cpu_ranks.run(_streams)


def _checkpoint_resumes_streams(rank, world, root):
    import dataclasses

    from checks import GPT_VARIANTS
    from tpcore.models import GPTModel
    from tpcore.train import load_checkpoint, save_checkpoint
    from train_checks import CLIP, LRS, make_adamw, tp_dp_groups, train_batch

    setup_tp(2, replicas=True)
    tp_group, dp_group = tp_dp_groups()
    config = dataclasses.replace(GPT_VARIANTS["gpt2"], dropout=0.2, attention_dropout=0.2)
    losses = []
    for resume in (False, True):
        tpcore.model_parallel_manual_seed(
            3 if not resume else 99
        )  # resuming must restore the streams
        torch.manual_seed(0)
        model = GPTModel(config)
        opt = make_adamw(model, config)
        if resume:
            load_checkpoint(root, model, opt, tp_group=tp_group)
        else:
            for step in range(2):
                model(*train_batch(step, config)).backward()
                opt.step(LRS[step], CLIP)
            save_checkpoint(
                root, 2, model, opt, consumed_samples=4, tp_group=tp_group, dp_group=dp_group
            )
        losses.append(model(*train_batch(2, config)).item())
    assert losses[0] == losses[1], f"the step after resuming draws other dropout masks: {losses}"
    model.eval()
    assert model(*train_batch(2, config)).item() != losses[1], "dropout must change the loss"


def test_checkpoint_resumes_the_dropout_streams(cpu_ranks, tmp_path):
    cpu_ranks.run(_checkpoint_resumes_streams, os.path.join(str(tmp_path), "ckpt"))
