"""The trainer's --autocast mode: GPTModel's loss and gradients under torch.autocast equal
the dense ReferenceGPT's under the same autocast, at TP 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch

from checks import GPT_VARIANTS, RTOL, gpt_rule, setup_tp, slice_piece
from tpcore.models import GPTModel, ReferenceGPT
from tpcore.pipeline_parallel import gpt_forward_step
from tpcore.train.arguments import parse_args
from tpcore.train.trainer import precision


def test_autocast_flag_and_its_conflicts():
    assert precision(parse_args([])) == (torch.float32, None)
    assert precision(parse_args(["--autocast", "bf16"])) == (torch.float32, torch.bfloat16)
    assert precision(parse_args(["--autocast", "fp16"])) == (torch.float32, torch.float16)
    assert precision(parse_args(["--bf16"])) == (torch.bfloat16, None)
    with pytest.raises(ValueError, match="--autocast keeps fp32 weights"):
        parse_args(["--autocast", "bf16", "--fp16"])


def _close(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} vs {expected.dtype}"
    scale = expected.abs().max().item()
    rtol = RTOL[torch.bfloat16]
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-6), msg=lambda m: f"{what}: {m}"
    )


def _autocast_gpt(rank, world, tp, variant):
    tp_rank, tp = setup_tp(tp)
    config = GPT_VARIANTS[variant]
    torch.manual_seed(0)
    dense = ReferenceGPT(config)
    model = GPTModel.from_dense(dense)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    target = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = dense(ids, target)
    ref.backward()
    # The trainer's forward step (one pipeline stage holding the whole model).
    loss = gpt_forward_step([model], [(ids, target)], autocast_dtype=torch.bfloat16)(0, 0, None)
    loss.backward()
    _close(loss, ref.detach(), "loss")
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, name
        want = slice_piece(dense_grads[name], gpt_rule(name, config), tp_rank, tp, config)
        _close(param.grad, want, f"grad {name}")


@pytest.mark.parametrize("variant", sorted(GPT_VARIANTS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_under_autocast_matches_dense_under_autocast(cpu_ranks, tp, variant):
    cpu_ranks.run(_autocast_gpt, tp, variant)
