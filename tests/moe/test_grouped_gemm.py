"""`grouped_linear` (torch._grouped_mm where the shapes suit it, a loop otherwise) against a
loop of plain matmuls, forward and both gradients: widths around the 16-byte rows the
grouped kernels need (fp32: multiples of 4; bf16: of 8), experts with no token, no token at
all, and a broadcast gradient (of a sum); on CPU and, where there is one, on a GPU."""

from __future__ import annotations

import pytest
import torch

from checks import assert_close
from harness import DEVICES
from tpcore.moe import grouped_linear

WIDTHS = [1, 3, 4, 5, 7, 8, 9, 16, 17, 24]


def _loop(x, weight, counts):
    return torch.cat([block @ weight[e].t() for e, block in enumerate(x.split(counts))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_equals_a_loop_of_matmuls(device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    g = torch.Generator().manual_seed(0)
    cases = 0
    for i, width_in in enumerate(WIDTHS):
        width_out = WIDTHS[(3 * i + 1) % len(WIDTHS)]
        for counts in ([3, 0, 7], [0, 0, 0], [1, 1, 1], [0, 5, 0]):
            x = torch.randn(sum(counts), width_in, generator=g).to(device, dtype)
            w = torch.randn(len(counts), width_out, width_in, generator=g).to(device, dtype)
            grad = torch.randn(sum(counts), width_out, generator=g).to(device, dtype)
            mine = [t.clone().requires_grad_() for t in (x, w)]
            theirs = [t.clone().requires_grad_() for t in (x, w)]
            out = grouped_linear(*mine, counts)
            want = _loop(*theirs, counts)
            out.backward(grad)
            want.backward(grad)
            what = f"{dtype} in {width_in} out {width_out} counts {counts}"
            assert_close(out, want, what)
            assert_close(mine[0].grad, theirs[0].grad, f"{what} input grad")
            assert_close(mine[1].grad, theirs[1].grad, f"{what} weight grad")
            cases += 1
    # A broadcast gradient (of a sum): zero strides, and no rows at all.
    for rows in (0, 6):
        x = torch.randn(rows, 8, dtype=dtype, device=device, requires_grad=True)
        w = torch.randn(2, 16, 8, dtype=dtype, device=device, requires_grad=True)
        grouped_linear(x, w, [rows, 0]).sum().backward()
        ones = torch.ones(16, rows, dtype=dtype, device=device)
        assert_close(w.grad[0], ones @ x.detach(), "sum's grad")
        assert torch.equal(w.grad[1], torch.zeros(16, 8, dtype=dtype, device=device))
    assert cases == len(WIDTHS) * 4


def test_grouped_linear_bad_shapes_raise():
    with pytest.raises(ValueError, match="counts"):
        grouped_linear(torch.zeros(4, 8), torch.zeros(2, 8, 8), [1, 2])
    with pytest.raises(ValueError, match="must be"):
        grouped_linear(torch.zeros(4, 8), torch.zeros(8, 8), [4])
