"""Contiguous gradient buffers, --overlap-grad-reduce, the distributed optimizer and
--overlap-param-gather against today's optimizer (`.grad`, `ParallelAdamW`) computed in the
same job on the same batches: the loss, the gradient norm and every parameter after each
step, for DP 4, TP 2 x DP 2 (sequence parallel, tied embedding used twice), PP 2 x DP 2 and
interleaved PP, fp32 / bf16 / fp16 with an overflow skip, gradient accumulation and active
clipping; and DP 4 against a single-process torch.optim.AdamW on the full batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from checks import assert_close
from dp_checks import (
    BASELINE,
    BUFFERS,
    DISTRIBUTED,
    DISTRIBUTED_OVERLAP,
    OVERLAP,
    Run,
    batches,
    config_for,
    setup,
)

LRS = [1e-2, 5e-3, 2e-2]
CLIP = 0.05  # below every step's norm: clipping is active
CANDIDATES = {
    "buffers": BUFFERS,
    "overlap": OVERLAP,
    "distributed": DISTRIBUTED,
    "distributed+overlap": DISTRIBUTED_OVERLAP,
}


def _compare(
    rank,
    world,
    tp,
    pp,
    v,
    variant,
    m,
    dtype_name,
    sequence_parallel=False,
    bucket_size=None,
    schedule="1f1b",
    lora=False,
):
    """Train 3 steps with each candidate and with today's optimizer; all must agree. With
    `lora`, every chunk's linear layers get adapters and the rest is frozen."""
    import dataclasses

    setup(tp, pp)
    dtype = getattr(torch, dtype_name)
    config = config_for(variant, pp * v * 1 if pp > 1 else 2, sequence_parallel=sequence_parallel)
    dp, dp_rank = dist.get_world_size(_dp()), dist.get_rank(_dp())
    data = [batches(config, m, dp, seed=10 * step)[dp_rank] for step in range(len(LRS))]
    prepare = _add_lora if lora else None
    runs = {"baseline": Run(config, BASELINE, v=v, dtype=dtype, schedule=schedule, prepare=prepare)}
    for name, options in CANDIDATES.items():
        if bucket_size is not None:
            options = dataclasses.replace(options, bucket_size=bucket_size)
        runs[name] = Run(config, options, v=v, dtype=dtype, schedule=schedule, prepare=prepare)
    if lora:  # the optimizer (and the buffers) hold the adapters and nothing else
        from tpcore.tensor_parallel import lora_adapters

        for name, run in runs.items():
            adapters = [a for c in run.chunks for a in lora_adapters(c).values()]
            held = run.grads.params if run.grads is not None else run.opt.params
            assert {id(p) for p in held} == {id(p) for a in adapters for p in (a.A, a.B)}, name
    # bf16: today's optimizer rounds the DP-mean gradient back into the bf16 .grad, the
    # buffers keep it in fp32: the two differ by bf16 rounding (checks.RTOL).
    tol = 1e-5 if dtype == torch.float32 else 2 * 2**-7
    for step, lr in enumerate(LRS):
        results = {name: run.step(data[step], lr, CLIP) for name, run in runs.items()}
        base_loss, base_norm, base_skip = results["baseline"]
        assert not base_skip and base_norm > CLIP, (step, base_norm)
        for name, (loss, norm, skipped) in results.items():
            assert not skipped
            assert math.isclose(loss, base_loss, rel_tol=tol), (name, step, loss, base_loss)
            assert math.isclose(norm, base_norm, rel_tol=tol), (name, step, norm, base_norm)
    base = runs["baseline"].params()
    for name, run in runs.items():
        got = run.params()
        assert got.keys() == base.keys()
        for key, value in base.items():
            assert_close(
                got[key], value, f"{name}: {key} after {len(LRS)} steps"
            )  # bf16 weights: bf16's tolerance
    # The runs moved the weights (a comparison of untouched weights proves nothing).
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            base.values(),
            Run(config, BASELINE, v=v, dtype=dtype, prepare=prepare).params().values(),
        )
    )


def _add_lora(chunks):
    import tpcore

    for chunk in chunks:
        tpcore.add_lora(chunk, rank=4, alpha=8, target_modules=["qkv", "proj", "fc1", "fc2"])


def _dp():
    from tpcore import parallel_state

    return parallel_state.get_data_parallel_group()


@pytest.mark.parametrize(
    "tp,pp,v,variant,m,dtype,sp,bucket",
    [
        (1, 1, 1, "llama", 2, "float32", False, 1000),  # DP 4, accumulation, several buckets
        (
            2,
            1,
            1,
            "gpt2",
            2,
            "float32",
            True,
            None,
        ),  # TP 2 x DP 2, sequence parallel, tied embedding used twice
        (1, 2, 1, "gpt2", 4, "float32", False, 500),  # PP 2 x DP 2, tied embedding across stages
        (1, 2, 2, "llama", 4, "float32", False, 700),  # interleaved PP 2 (2 chunks per rank) x DP 2
        (1, 1, 1, "gpt2", 1, "bfloat16", False, 1000),  # bf16 parameters, fp32 masters
        (
            2,
            1,
            1,
            "llama_kv1",
            2,
            "float32",
            True,
            300,
        ),  # 1 KV head copied on both TP ranks; DP slices cut the QKV weight mid-KV
    ],
    ids=["dp4", "tp2-dp2-sp", "pp2-dp2", "vpp2-dp2", "dp4-bf16", "tp2-dp2-kv1-sp"],
)
def test_buffers_and_distributed_optimizer_equal_todays_optimizer(
    cpu_ranks, tp, pp, v, variant, m, dtype, sp, bucket
):
    cpu_ranks.run(
        _compare, tp, pp, v, variant, m, dtype, sp, bucket, "interleaved" if v > 1 else "1f1b"
    )


@pytest.mark.parametrize(
    "tp,pp,variant,sp",
    [(2, 1, "llama", False), (2, 1, "llama_kv1", True), (1, 2, "gpt2", False)],
    ids=["tp2-dp2", "tp2-dp2-kv1-sp", "pp2-dp2"],
)
def test_lora_adapters_train_alike_with_every_optimizer(cpu_ranks, tp, pp, variant, sp):
    """Only the adapters train (frozen base: no buffers, no optimizer state); their partial
    gradients are summed over TP in the buffers' reduction as in finalize_model_grads."""
    cpu_ranks.run(
        _compare, tp, pp, 1, variant, 2 if pp == 1 else 4, "float32", sp, None, "1f1b", True
    )
