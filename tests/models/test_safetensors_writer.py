"""`SafetensorsWriter`: tensors written whole or from the parts they concatenate from
(along rows or columns, transposed views, another dtype, larger than one conversion
block) read back with the `safetensors` package equal to `torch.cat` of the parts."""

from __future__ import annotations

import pytest
import torch

from tpcore.models import GPTConfig
from tpcore.models.gpt_specs import gpt_shard_spec
from tpcore.safetensors_io import BLOCK_BYTES, SafetensorsWriter
from tpcore.tensor_parallel.shard_spec import merge, merged_views, shard

safetensors = pytest.importorskip("safetensors.torch")


def _write(
    path, items: list[tuple[str, torch.dtype, list[torch.Tensor], int]]
) -> dict[str, torch.Tensor]:
    """Write `items` (name, file dtype, parts, dim) with add_parts; the expected tensors."""
    expected = {name: torch.cat(parts, dim).to(dtype) for name, dtype, parts, dim in items}
    writer = SafetensorsWriter(
        str(path), [(name, dtype, list(expected[name].shape)) for name, dtype, _, _ in items]
    )
    for _, _, parts, dim in items:
        writer.add_parts(parts, dim)
    writer.close()
    return expected


def test_parts_along_rows_and_columns_converted_and_transposed(tmp_path):
    g = torch.Generator().manual_seed(0)
    big_cols = BLOCK_BYTES // 4 // 3 + 5  # a few rows per block: blocks end mid-tensor
    a = torch.randn(40, big_cols, generator=g)
    b = torch.randn(40, 7, generator=g)
    base = torch.randn(6, 9, generator=g)
    items = [
        ("rows_fp32", torch.float32, [a[:13], a[13:]], 0),
        ("columns_bf16", torch.bfloat16, [a, b, a[:, :3]], 1),
        (
            "transposed_views",
            torch.float16,
            [base[:, :4].t(), base[:, 4:].t()],
            0,
        ),  # non-contiguous views
        ("columns_of_transposed", torch.float32, [base[:2].t(), base[2:].t()], 1),
        ("vector", torch.bfloat16, [torch.randn(5, generator=g), torch.randn(3, generator=g)], 0),
        ("scalar_like", torch.float32, [torch.randn(1, generator=g)], 0),
    ]
    expected = _write(tmp_path / "x.safetensors", items)
    got = safetensors.load_file(str(tmp_path / "x.safetensors"))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_add_checks_shape_and_count(tmp_path):
    writer = SafetensorsWriter(str(tmp_path / "y.safetensors"), [("w", torch.float32, [4, 6])])
    with pytest.raises(ValueError, match=r"make \[4, 5\], its header says \[4, 6\]"):
        writer.add_parts([torch.zeros(4, 2), torch.zeros(4, 3)], 1)
    with pytest.raises(ValueError, match="its header says torch.float32"):
        writer.add(torch.zeros(4, 6, dtype=torch.float16))  # `add` takes the header's dtype only
    writer.add_parts([torch.zeros(4, 3), torch.zeros(4, 3)], 1)
    with pytest.raises(ValueError, match="more tensors than its header lists"):
        writer.add(torch.zeros(4, 6))
    writer.close()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "name",
    [
        "embedding.word.weight",
        "layers.0.attention.qkv.weight",
        "layers.0.mlp.fc1.weight",
        "layers.0.attention.proj.weight",
    ],
)
def test_merged_views_concatenate_to_merge(name, tp):
    """The views a streaming export writes are the merged tensor, whole or part by part
    (grouped-query attention with fewer KV heads than TP included)."""
    config = GPTConfig(
        vocab_size=50,
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        num_kv_heads=2,
        activation="swiglu",
        ffn_hidden_size=24,
    )
    full = torch.randn(
        *{
            "embedding.word.weight": (50, 16),
            "layers.0.attention.qkv.weight": (32, 16),
            "layers.0.mlp.fc1.weight": (48, 16),
            "layers.0.attention.proj.weight": (16, 16),
        }[name]
    )
    spec = gpt_shard_spec(name, config, tuple(full.shape)).at(tp, 0)
    pieces = [shard(full, spec.at(tp, r)) for r in range(tp)]
    dim, views = merged_views(pieces, spec)
    assert torch.equal(torch.cat(views, dim), full) and torch.equal(merge(pieces, spec), full)
    if spec.kind == "parts":
        for k, part in enumerate(full.split([p.size for p in spec.parts], spec.dim)):
            dim, views = merged_views(pieces, spec, part=k)
            assert torch.equal(torch.cat(views, dim), part), f"part {k}"
