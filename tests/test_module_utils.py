"""tpcore's `to_empty` against torch's `Module.to_empty`, computed in the same test."""

from __future__ import annotations

import torch
from torch import nn

from tpcore._module_utils import to_empty


def _layouts() -> nn.Module:
    """A meta module with every layout kind: a parameter, a frozen half-precision one, a
    transposed buffer (strided, dense) and an expanded one (overlapping)."""
    m = nn.Module()
    m.weight = nn.Parameter(torch.empty(3, 5, device="meta"))
    m.frozen = nn.Parameter(torch.empty(4, device="meta", dtype=torch.bfloat16), False)
    m.register_buffer("transposed", torch.empty(5, 3, device="meta").t())
    m.register_buffer("expanded", torch.empty(3, 1, device="meta").expand(3, 4))
    m.child = nn.Linear(2, 6, device="meta")
    return m


def test_to_empty_matches_torch_module_to_empty():
    ours, theirs = _layouts(), _layouts()
    to_empty(ours, "cpu")
    theirs.to_empty(device="cpu")
    mine, torchs = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == torchs.keys()
    for name, p in mine.items():
        q = torchs[name]
        assert type(p) is type(q) and p.requires_grad == q.requires_grad, name
    tensors = {**mine, **dict(ours.named_buffers())}
    expected = {**torchs, **dict(theirs.named_buffers())}
    assert tensors.keys() == expected.keys()
    for name, t in tensors.items():
        e = expected[name]
        assert (t.device, t.dtype, t.shape, t.stride()) == (e.device, e.dtype, e.shape, e.stride())
