"""Under torch.autocast (fp32 weights, bf16 compute) every layer and loss behaves like its
plain-PyTorch counterpart under the same autocast: output dtypes, gradient dtypes, values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcore
from checks import RTOL, assert_close, setup_tp
from harness import DEVICES, pool_for

IN, OUT, VOCAB = 16, 24, 40
LOW = torch.bfloat16


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, and equal up to bf16 rounding (the compute dtype) relative to |expected|."""
    assert actual.dtype == expected.dtype, (
        f"{what}: dtype {actual.dtype}, nn gives {expected.dtype}"
    )
    scale = expected.detach().abs().max().item()
    torch.testing.assert_close(
        actual.float(),
        expected.float(),
        rtol=RTOL[LOW],
        atol=RTOL[LOW] * max(scale, 1e-6),
        msg=lambda m: f"{what}: {m}",
    )


def _linears(tp_rank, tp, device, sp):
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, device=device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, IN, generator=g).to(device)
    upstream = torch.randn(8, 2, OUT, generator=g).to(device)
    for cls, x_layout, w_dim in (
        (tpcore.ColumnParallelLinear, 0, 0),
        (tpcore.RowParallelLinear, -1, 1),
    ):
        what = f"{cls.__name__} sp={sp}"
        dense.zero_grad()
        xr = x.clone().requires_grad_(True)
        with torch.autocast(device, dtype=LOW):
            y_ref = dense(xr)
        y_ref.backward(upstream.to(y_ref.dtype))
        kwargs = (
            dict(sequence_parallel=sp)
            if cls is tpcore.ColumnParallelLinear
            else dict(input_is_parallel=True, sequence_parallel=sp)
        )
        layer = cls.from_dense(dense, **kwargs)
        if cls is tpcore.ColumnParallelLinear:
            xin, out_of = (mine(x, 0) if sp else x), (lambda t: mine(t, -1))
        else:
            xin, out_of = mine(x, -1), (lambda t: mine(t, 0) if sp else t)
        xin = xin.clone().requires_grad_(True)
        with torch.autocast(device, dtype=LOW):
            y = layer(xin)
        _close(y, out_of(y_ref.detach()), f"{what}: output")
        y.backward(out_of(upstream).to(y.dtype))
        want_x = (mine(xr.grad, 0) if sp else xr.grad) if x_layout == 0 else mine(xr.grad, -1)
        _close(xin.grad, want_x, f"{what}: grad input")
        _close(layer.weight.grad, mine(dense.weight.grad, w_dim), f"{what}: grad weight")
        want_b = mine(dense.bias.grad, 0) if w_dim == 0 else dense.bias.grad
        _close(layer.bias.grad, want_b, f"{what}: grad bias")


def _losses(tp_rank, tp, device):
    g = torch.Generator().manual_seed(2)
    padded = tpcore.pad_vocab_size(VOCAB, tp, 4)
    target = torch.randint(0, VOCAB, (12,), generator=g).to(device)
    target[3] = -100
    for dtype in (torch.float32, LOW):  # logits from an fp32 or an autocast head
        logits = (3 * torch.randn(12, padded, generator=g)).to(device, dtype)
        ref = logits.clone().requires_grad_(True)
        with torch.autocast(device, dtype=LOW):
            ref_loss = F.cross_entropy(ref[:, :VOCAB], target, label_smoothing=0.1)
        ref_loss.backward()
        local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
        with torch.autocast(device, dtype=LOW):
            loss = tpcore.vocab_parallel_cross_entropy(
                local, target, vocab_size=VOCAB, label_smoothing=0.1
            )
        assert loss.dtype == torch.float32, (
            f"logits {dtype}: F.cross_entropy gives an fp32 loss under autocast"
        )
        assert_close(
            loss, ref_loss.detach(), f"logits {dtype}: loss"
        )  # fp32 math on the same values
        loss.backward()
        _close(local.grad, ref.grad.chunk(tp, -1)[tp_rank], f"logits {dtype}: grad")

    # The fused head + loss: F.linear in bf16 then F.cross_entropy in fp32.
    hidden = torch.randn(12, IN, generator=g).to(device)
    weight = torch.zeros(padded, IN)
    weight[:VOCAB] = torch.randn(VOCAB, IN, generator=g) / IN**0.5
    weight = weight.to(device)
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast(device, dtype=LOW):
        ref_loss = F.cross_entropy(F.linear(h_ref, w_ref[:VOCAB]), target)
    ref_loss.backward()
    h, w = (
        hidden.clone().requires_grad_(True),
        weight.chunk(tp, 0)[tp_rank].clone().requires_grad_(True),
    )
    with torch.autocast(device, dtype=LOW):
        loss = tpcore.vocab_parallel_linear_cross_entropy(
            h, w, target, vocab_size=VOCAB, chunk_size=5
        )
    _close(loss, ref_loss.detach(), "fused: loss")
    loss.backward()
    _close(h.grad, h_ref.grad, "fused: grad hidden")
    _close(w.grad, w_ref.grad.chunk(tp, 0)[tp_rank], "fused: grad weight")


def _autocast(rank, world, tp, device):
    tp_rank, tp = setup_tp(tp)
    for sp in (False, True):
        _linears(tp_rank, tp, device, sp)
    _losses(tp_rank, tp, device)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_layers_and_losses_under_autocast_match_nn(request, device, tp):
    pool_for(request, device, tp).run(_autocast, tp, device)
