"""When the overlapped reductions and gathers happen, and the cases around them: buckets
start during the last micro-batch's backward and not before; an unused parameter holds its
bucket back to the step (still the right update), frozen parameters get no buffer; the fp16
overflow skip; parameter gathers in flight after the step and waited by the next forward;
DP 4 with the distributed optimizer against a single-process torch.optim.AdamW on the full
batch; bad combinations refused before any collective; a rank dying mid-reduction."""

from __future__ import annotations

import math
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from checks import assert_close
from dp_checks import (
    BASELINE,
    DISTRIBUTED,
    DISTRIBUTED_OVERLAP,
    OVERLAP,
    SEQ,
    Run,
    assert_same_params,
    batches,
    config_for,
    groups,
    setup,
)
from launch import warm_context
from tpcore.distributed.data_parallel import DataParallelGrads
from tpcore.models import GPTModel, ReferenceGPT
from tpcore.optimizer.distributed_adamw import DistributedAdamW
from tpcore.optimizer.setup import DataParallelOptions
from train_checks import BETAS, EPS, WD

CLIP = 0.05


def _micro_by_micro(rank, world):
    """Backward one micro-batch at a time: nothing reduces before the last one; during the
    last one's backward every bucket starts; an unused parameter holds its bucket (and, in
    order, all later ones) back until finish_grad_sync."""
    import dataclasses

    setup(1)
    config = config_for("llama", 2)
    for unused in (False, True):

        def prepare(chunks, unused=unused):
            if unused:  # beside the LM head: bucket 0, whose gradients are ready first
                chunks[0].lm_head.unused = nn.Parameter(torch.randn(8, 4))

        run = Run(config, dataclasses.replace(OVERLAP, bucket_size=2000), prepare=prepare)
        base = Run(config, BASELINE, prepare=prepare)
        assert run.grads.num_buckets >= 3
        data = batches(config, 3, 4, seed=1)[dist.get_rank()]
        run.grads.start_step(3)
        for micro, (ids, target) in enumerate(data):
            (run.chunks[0](ids, target) / 3).backward()
            started = run.grads.buckets_started
            if micro < 2:
                assert started == 0, f"micro-batch {micro} of 3 started {started} reductions"
            elif unused:
                assert started == 0, "a bucket holding an unused parameter started before the step"
            else:
                assert started == run.grads.num_buckets, (started, run.grads.num_buckets)
        run.grads.finish_grad_sync()
        assert run.grads.buckets_started == run.grads.num_buckets
        norm, _ = run.opt.step(1e-2, CLIP)
        base_loss, base_norm, _ = base.step(data, 1e-2, CLIP)
        assert math.isclose(norm, base_norm, rel_tol=1e-5), (norm, base_norm)
        assert_same_params(run, base, f"unused={unused}")


def test_buckets_start_in_the_last_micro_batch_backward(cpu_ranks):
    cpu_ranks.run(_micro_by_micro)


def _unused_frozen_fp16(rank, world, options_name):
    """TP 2 x DP 2, fp16 with loss scaling: a frozen and an unused parameter, and at step 2
    an inf in one rank's backward: every run skips that step alike and ends equal."""
    options = {
        "distributed": DISTRIBUTED,
        "distributed+overlap": DISTRIBUTED_OVERLAP,
        "overlap": OVERLAP,
    }[options_name]
    setup(2)
    config = config_for("gpt2", 2)

    def prepare(chunks):
        chunks[0].final_norm.bias.requires_grad_(False)
        chunks[0].unused = nn.Parameter(
            torch.randn(6, 5, dtype=torch.float16)
        )  # 2-D: weight decay applies

    runs = [
        Run(config, o, dtype=torch.float16, loss_scale=2.0**12, prepare=prepare)
        for o in (BASELINE, options)
    ]
    frozen = runs[1].chunks[0].final_norm.bias
    assert not hasattr(frozen, "main_grad") and all(p is not frozen for p in runs[1].grads.params)
    poison = {"on": False}
    for run in runs:

        def hook(module, args, out):
            if poison["on"] and dist.get_rank() == 1:
                out.register_hook(lambda g: torch.full_like(g, float("inf")))

        run.chunks[0].final_norm.register_forward_hook(hook)
    dp_rank = dist.get_rank(groups()[1])
    for step, lr in enumerate([1e-2, 2e-2, 5e-3]):
        poison["on"] = step == 1
        data = batches(config, 2, 2, seed=step)[dp_rank]
        (l0, n0, s0), (l1, n1, s1) = [run.step(data, lr, CLIP) for run in runs]
        assert s0 == s1 == (step == 1), (step, s0, s1)
        assert (
            runs[0].opt.loss_scale == runs[1].opt.loss_scale == (2.0**11 if step >= 1 else 2.0**12)
        )
        if not s0:
            # fp16 grads: today's optimizer accumulates two micro-batches in fp16, the buffers
            # in fp32.
            assert math.isclose(n0, n1, rel_tol=2e-3), (step, n0, n1)
    base, got = runs[0].params(), runs[1].params()
    for key, value in base.items():
        torch.testing.assert_close(
            got[key].float(),
            value.float(),
            rtol=2e-3,
            atol=2e-3,
            msg=lambda m: f"{options_name}: {key}: {m}",
        )
    assert torch.equal(
        got["0/final_norm.bias"],
        Run(config, BASELINE, dtype=torch.float16).params()["0/final_norm.bias"],
    )


@pytest.mark.parametrize("options", ["overlap", "distributed", "distributed+overlap"])
def test_unused_frozen_and_fp16_overflow_skip(cpu_ranks, options):
    cpu_ranks.run(_unused_frozen_fp16, options)


def _gather_overlap_and_dense(rank, world):
    """DP 4, distributed optimizer with both overlaps, 3 steps of 2 micro-batches against
    torch.optim.AdamW on the whole global batch; after each step gathers are in flight
    and the next forward waits for them."""
    setup(1)
    config = config_for("gpt2", 2)
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    import dataclasses

    run = Run(config, dataclasses.replace(DISTRIBUTED_OVERLAP, bucket_size=1500))
    dense.load_state_dict(run.chunks[0].to_dense().state_dict())
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in dense.parameters() if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in dense.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=BETAS,
        eps=EPS,
    )
    for step, lr in enumerate([1e-2, 5e-3, 2e-2]):
        data = batches(config, 2, 4, seed=step)
        loss, norm, _ = run.step(data[rank], lr, CLIP)
        assert len(run.opt.gather._launched) == run.grads.num_buckets, (
            "the parameter gathers should be in flight after the step"
        )
        ids = torch.cat([i for r in data for i, _ in r])
        target = torch.cat([t for r in data for _, t in r])
        dense_loss = dense(ids, target)
        dense_loss.backward()
        dense_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP))
        for group in adam.param_groups:
            group["lr"] = lr
        adam.step()
        adam.zero_grad()
        assert math.isclose(loss, float(dense_loss), rel_tol=1e-5) and math.isclose(
            norm, dense_norm, rel_tol=1e-5
        ), (loss, dense_loss, norm, dense_norm)
    with torch.no_grad():
        run.chunks[0](*data[0][0])  # a forward waits for every bucket it uses
    assert not run.opt.gather._launched
    got = dict(run.chunks[0].to_dense().named_parameters())
    for name, p in dense.named_parameters():
        assert_close(
            got[name].detach(), p.detach(), f"distributed optimizer vs torch AdamW: {name}"
        )


def test_distributed_optimizer_equals_torch_adamw_on_the_full_batch(cpu_ranks):
    cpu_ranks.run(_gather_overlap_and_dense)


def test_incompatible_options_are_refused():
    with pytest.raises(
        ValueError, match="--overlap-param-gather needs --use-distributed-optimizer"
    ):
        DataParallelOptions(overlap_param_gather=True)
    with pytest.raises(ValueError, match="--use-distributed-optimizer need"):
        DataParallelOptions(contiguous_buffers=False, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="--ddp-bucket-size must be an int >= 1"):
        DataParallelOptions(bucket_size=0)


def _misuse(rank, world):
    setup(1)
    config = config_for("gpt2", 2)
    run = Run(config, OVERLAP)
    try:
        DistributedAdamW(
            run.grads,
            is_replicated=lambda n: False,
            tp_group=groups()[0],
            lr=1e-3,
            weight_decay=0.0,
        )
    except ValueError as e:
        assert "reduce_scatter=True" in str(e)
    else:
        raise AssertionError("DistributedAdamW took all-reduced buffers")
    dist_run = Run(config, DISTRIBUTED)
    try:
        dist_run.opt.step(1e-3, 1.0)  # before finish_grad_sync
    except RuntimeError as e:
        assert "finish_grad_sync" in str(e)
    else:
        raise AssertionError("step() ran on unreduced gradients")


def test_misuse_raises_on_every_rank_before_any_collective(cpu_ranks):
    cpu_ranks.run(_misuse)


# ---------------------------------------------------------------------------------------
# A rank dying during a bucket's reduction
# ---------------------------------------------------------------------------------------

TIMEOUT_S = 8.0


def _dying_rank(rank: int, store_dir: str, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from datetime import timedelta

    import tpcore

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(store_dir, "store"), 2),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        tpcore.initialize_model_parallel(timeout=timedelta(seconds=TIMEOUT_S))
        config = config_for("gpt2", 2)
        torch.manual_seed(0)
        model = GPTModel(config)
        grads = DataParallelGrads(
            model,
            dp_group=tpcore.parallel_state.get_data_parallel_group(),
            overlap_grad_reduce=True,
            bucket_size=500,
        )
        if rank == 1:  # dies as its first bucket's reduction starts
            original = grads._start
            grads._start = lambda i, bucket: (original(i, bucket), os._exit(3))
        grads.start_step(1)
        ids = torch.randint(0, config.vocab_size, (2, SEQ))
        start = time.monotonic()
        model(ids, ids).backward()
        grads.finish_grad_sync()
        results.put((rank, "finished", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001 - what the survivor raised is the result
        results.put(
            (
                rank,
                f"{type(e).__name__}: {e}",
                time.monotonic() - start if "start" in locals() else -1.0,
            )
        )
        traceback.print_exc()


def test_a_rank_dying_mid_reduction_fails_the_other_within_the_timeout():
    ctx = warm_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [
            ctx.Process(target=_dying_rank, args=(r, store_dir, results), daemon=True)
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            rank, outcome, waited = results.get(timeout=120)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    assert rank == 0 and outcome != "finished", (rank, outcome)
    assert waited < TIMEOUT_S + 20, (
        f"the survivor waited {waited:.1f} s for a dead peer "
        f"(group timeout {TIMEOUT_S} s): {outcome}"
    )
    assert procs[1].exitcode == 3


def _bf16_reduction(rank, world):
    """--grad-reduce-in-bf16: bf16 buffers (half the bytes), the update within bf16's rounding
    of the fp32 one, and the fp32 masters' gradients still fp32."""
    import dataclasses

    setup(2)
    config = config_for("gpt2", 2)
    base = Run(config, BASELINE)
    run = Run(config, dataclasses.replace(DISTRIBUTED_OVERLAP, grad_reduce_in_bf16=True))
    assert all(b.grad_data.dtype == torch.bfloat16 for b in run.grads.buffers)
    for step, lr in enumerate([1e-2, 5e-3]):
        data = batches(config, 2, 2, seed=step)[dist.get_rank(groups()[1])]
        (_, n0, _), (_, n1, _) = base.step(data, lr, CLIP), run.step(data, lr, CLIP)
        assert math.isclose(n0, n1, rel_tol=2 * 2**-7), (n0, n1)
        assert all(x.master.grad.dtype == torch.float32 for x in run.opt.pieces)
    want, got = base.params(), run.params()
    moved = Run(config, BASELINE).params()
    for key, value in want.items():
        # Within bf16 rounding of the step itself (lr x a relative error of 2**-7 at most per step).
        torch.testing.assert_close(
            got[key], value, rtol=0, atol=2 * 1e-2 * 2 * 2**-7 + 1e-6, msg=lambda m: f"{key}: {m}"
        )
    assert any(not torch.equal(a, b) for a, b in zip(want.values(), moved.values()))


def test_grad_reduce_in_bf16(cpu_ranks):
    cpu_ranks.run(_bf16_reduction)
