"""Column- and row-parallel linear vs nn.Linear with the same weights, every flag combination."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcore
from checks import assert_close, expect_error, setup_tp
from harness import DEVICES, pool_for

IN, OUT = 16, 24  # divisible by every TP size tested
SHAPES = [(10,), (8, 3)]  # 2-D and 3-D inputs ([tokens, in], [seq, batch, in])


def _inputs(shape, dtype, device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, IN, generator=g).to(device, dtype)
    grad = torch.randn(*shape, OUT, generator=g).to(device, dtype)
    return x, grad


def _reference(dense, x, grad):
    xr = x.clone().requires_grad_(True)
    y = dense(xr)
    y.backward(grad)
    return y.detach(), xr.grad


def _check_column(tp_rank, tp, dtype, device, shape, bias, gather_output, skip_bias_add, sp):
    what = (
        f"column shape={shape} bias={bias} gather={gather_output} skip_bias={skip_bias_add} sp={sp}"
    )
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias=bias, dtype=dtype, device=device)
    x, grad = _inputs(shape, dtype, device)
    y_ref, gx_ref = _reference(dense, x, grad)

    layer = tpcore.ColumnParallelLinear.from_dense(
        dense, gather_output=gather_output, skip_bias_add=skip_bias_add, sequence_parallel=sp
    )
    out_layout = (lambda t: t) if gather_output else (lambda t: mine(t, -1))
    xin = (mine(x, 0) if sp else x).clone().requires_grad_(True)
    out = layer(xin)
    if skip_bias_add:
        out, returned_bias = out
        assert returned_bias is layer.bias, what
        if bias:
            y_ref = y_ref - dense.bias.detach()
    assert_close(out, out_layout(y_ref), f"{what}: output")
    out.backward(out_layout(grad))
    assert_close(xin.grad, mine(gx_ref, 0) if sp else gx_ref, f"{what}: grad input")
    assert_close(layer.weight.grad, mine(dense.weight.grad, 0), f"{what}: grad weight")
    if bias and not skip_bias_add:
        assert_close(layer.bias.grad, mine(dense.bias.grad, 0), f"{what}: grad bias")


def _check_row(tp_rank, tp, dtype, device, shape, bias, input_is_parallel, skip_bias_add, sp):
    what = (
        f"row shape={shape} bias={bias} input_is_parallel={input_is_parallel} "
        f"skip_bias={skip_bias_add} sp={sp}"
    )
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, bias=bias, dtype=dtype, device=device)
    x, grad = _inputs(shape, dtype, device)
    y_ref, gx_ref = _reference(dense, x, grad)

    layer = tpcore.RowParallelLinear.from_dense(
        dense,
        input_is_parallel=input_is_parallel,
        skip_bias_add=skip_bias_add,
        sequence_parallel=sp,
    )
    out_layout = (lambda t: mine(t, 0)) if sp else (lambda t: t)
    xin = (mine(x, -1) if input_is_parallel else x).clone().requires_grad_(True)
    out = layer(xin)
    if skip_bias_add:
        out, returned_bias = out
        if not (sp and bias):
            assert returned_bias is layer.bias, what
        if bias:  # the caller adds the bias, as a fused bias-dropout-add would
            assert torch.equal(returned_bias, layer.bias), what
            out = out + returned_bias
    assert_close(out, out_layout(y_ref), f"{what}: output")
    out.backward(out_layout(grad))
    assert_close(xin.grad, mine(gx_ref, -1) if input_is_parallel else gx_ref, f"{what}: grad input")
    assert_close(layer.weight.grad, mine(dense.weight.grad, 1), f"{what}: grad weight")
    if bias:
        # The replicated bias gets the full gradient on every rank, sequence parallel or not.
        assert_close(layer.bias.grad, dense.bias.grad, f"{what}: grad bias")


def _frozen_column(tp_rank, tp, dtype, device):
    """A frozen column layer (a base under LoRA) under sequence parallelism: backward skips the
    second all-gather of the input (it only feeds the weight gradient); the input gradient is
    still right."""
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    torch.manual_seed(0)
    dense = nn.Linear(IN, OUT, dtype=dtype, device=device).requires_grad_(False)
    x, grad = _inputs((8, 2), dtype, device)
    y_ref, gx_ref = _reference(dense, x, grad)
    layer = tpcore.ColumnParallelLinear.from_dense(dense, sequence_parallel=True)
    layer.requires_grad_(False)
    xin = mine(x, 0).clone().requires_grad_(True)
    out = layer(xin)
    assert_close(out, mine(y_ref, -1), "frozen column: output")
    out.backward(mine(grad, -1))
    assert_close(xin.grad, mine(gx_ref, 0), "frozen column: grad input")
    assert layer.weight.grad is None and layer.bias.grad is None


def _linear_layers(rank, world, tp, dtype, device):
    tp_rank, tp = setup_tp(tp)
    flags = list(
        itertools.product(SHAPES, (True, False), (False, True), (False, True), (False, True))
    )
    for shape, bias, flag, skip_bias_add, sp in flags:
        if sp and len(shape) < 2:
            continue  # sequence parallelism needs [seq, batch, hidden]
        if not (flag and sp):  # gather_output excludes sequence parallelism
            _check_column(tp_rank, tp, dtype, device, shape, bias, flag, skip_bias_add, sp)
        if flag or not sp:  # sequence parallelism needs input_is_parallel
            _check_row(tp_rank, tp, dtype, device, shape, bias, flag, skip_bias_add, sp)
    _frozen_column(tp_rank, tp, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_linear_layers_match_nn_linear(request, device, tp, dtype):
    pool_for(request, device, tp).run(_linear_layers, tp, dtype, device)


def _mlp(rank, world, tp, dtype, sp, device):
    """column -> GeLU -> row equals the dense MLP, forward and backward."""
    tp_rank, tp = setup_tp(tp)
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    torch.manual_seed(0)
    up = nn.Linear(IN, 4 * IN, dtype=dtype, device=device)
    down = nn.Linear(4 * IN, IN, dtype=dtype, device=device)
    x = torch.randn(8, 2, IN, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    xr = x.clone().requires_grad_(True)
    y_ref = down(F.gelu(up(xr)))
    y_ref.square().sum().backward()

    tp_up = tpcore.ColumnParallelLinear.from_dense(up, sequence_parallel=sp)
    tp_down = tpcore.RowParallelLinear.from_dense(
        down, input_is_parallel=True, sequence_parallel=sp
    )
    layout = (lambda t: mine(t, 0)) if sp else (lambda t: t)
    xin = layout(x).clone().requires_grad_(True)
    y = tp_down(F.gelu(tp_up(xin)))
    assert_close(y, layout(y_ref.detach()), "mlp output")
    y.square().sum().backward()
    assert_close(xin.grad, layout(xr.grad), "mlp grad input")
    assert_close(tp_up.weight.grad, mine(up.weight.grad, 0), "mlp grad up.weight")
    assert_close(tp_up.bias.grad, mine(up.bias.grad, 0), "mlp grad up.bias")
    assert_close(tp_down.weight.grad, mine(down.weight.grad, 1), "mlp grad down.weight")
    assert_close(tp_down.bias.grad, down.bias.grad, "mlp grad down.bias")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_mlp_matches_dense(request, device, tp, dtype, sp):
    pool_for(request, device, tp).run(_mlp, tp, dtype, sp, device)


def _init_is_tp_invariant(rank, world, tp):
    tp_rank, tp = setup_tp(tp)
    mine = lambda t, dim: t.chunk(tp, dim)[tp_rank]  # noqa: E731
    for cls, dim in ((tpcore.ColumnParallelLinear, 0), (tpcore.RowParallelLinear, 1)):
        # init_method="dense": the full weight drawn exactly as nn.Linear draws it.
        torch.manual_seed(7)
        layer = cls(IN, OUT, init_method="dense")
        torch.manual_seed(7)
        dense = nn.Linear(IN, OUT)
        assert torch.equal(layer.weight, mine(dense.weight, dim)), f"{cls.__name__} dense init"
        assert torch.equal(layer.bias, mine(dense.bias, 0) if dim == 0 else dense.bias), (
            f"{cls.__name__} dense bias init"
        )
        # A custom init_method sees the full master weight; the bias starts at zero.
        torch.manual_seed(7)
        layer = cls(IN, OUT, init_method=partial(nn.init.normal_, std=0.02))
        torch.manual_seed(7)
        master = nn.init.normal_(torch.empty(OUT, IN), std=0.02)
        assert torch.equal(layer.weight, mine(master, dim)), f"{cls.__name__} init_method"
        assert not layer.bias.any(), f"{cls.__name__} custom init keeps a zero bias"
        back = layer.to_dense()
        assert torch.equal(back.weight, master) and not back.bias.any(), f"{cls.__name__}.to_dense"
        round_trip = cls.from_dense(dense).to_dense()
        assert torch.equal(round_trip.weight, dense.weight) and torch.equal(
            round_trip.bias, dense.bias
        )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_init_is_tp_invariant_and_dense_round_trips(cpu_ranks, tp):
    cpu_ranks.run(_init_is_tp_invariant, tp)


def _bad_input(rank, world):
    setup_tp(4)
    col, row = (
        tpcore.ColumnParallelLinear(IN, OUT),
        tpcore.RowParallelLinear(IN, OUT, input_is_parallel=True),
    )
    row_full = tpcore.RowParallelLinear(IN, OUT)
    expect_error(
        ValueError,
        "out_features (30) is not divisible by the tensor-parallel size (4)",
        tpcore.ColumnParallelLinear,
        IN,
        30,
    )
    expect_error(
        ValueError,
        "in_features (30) is not divisible by the tensor-parallel size (4)",
        tpcore.RowParallelLinear,
        30,
        OUT,
    )
    expect_error(ValueError, "positive int", tpcore.ColumnParallelLinear, 0, OUT)
    expect_error(ValueError, "input has last dim 15", col, torch.randn(3, 15))
    expect_error(ValueError, "input has last dim 16", row, torch.randn(3, IN))  # expects in/tp = 4
    expect_error(
        ValueError, "input has last dim 4 but in_features is 16", row_full, torch.randn(3, IN // 4)
    )
    expect_error(
        TypeError, "does not match weight dtype", col, torch.randn(3, IN, dtype=torch.bfloat16)
    )
    expect_error(TypeError, "floating-point", col, torch.ones(3, IN, dtype=torch.long))
    expect_error(ValueError, "input is on meta", col, torch.randn(3, IN, device="meta"))
    expect_error(
        ValueError,
        "gather_output=True cannot",
        tpcore.ColumnParallelLinear,
        IN,
        OUT,
        gather_output=True,
        sequence_parallel=True,
    )
    expect_error(
        ValueError,
        "needs input_is_parallel=True",
        tpcore.RowParallelLinear,
        IN,
        OUT,
        sequence_parallel=True,
    )
    row_sp = tpcore.RowParallelLinear(IN, OUT, input_is_parallel=True, sequence_parallel=True)
    expect_error(
        ValueError,
        "must be divisible by the tensor-parallel size 4",
        row_sp,
        torch.randn(6, 2, IN // 4),
    )
    expect_error(TypeError, "ProcessGroup", tpcore.ColumnParallelLinear, IN, OUT, group="tp")
    # Nothing above ran a collective: the group still works for a real step on every rank.
    assert_close(
        col(torch.ones(2, IN)).sum(), col(torch.ones(2, IN)).sum(), "layer usable after errors"
    )


def test_bad_input_raises_clear_errors_on_every_rank(cpu_ranks):
    cpu_ranks.run(_bad_input)


def test_layers_need_groups():
    with pytest.raises(RuntimeError, match="not initialized"):
        tpcore.ColumnParallelLinear(IN, OUT)
