"""The split picture draws, for every rank, the pieces its shard specs place, covering each
weight once (twice where GQA copies a KV head on two ranks)."""

from __future__ import annotations

import pytest

from tpcore.models import GPTConfig
from tpcore.models.gpt_specs import gpt_shard_specs
from tpcore.models.shard_plot import main, plot_shards


@pytest.mark.parametrize("tp,kv_heads", [(2, 4), (4, 2)])
def test_every_rank_is_drawn_where_its_spec_places_it(tmp_path, tp, kv_heads):
    config = GPTConfig(
        vocab_size=200,
        num_layers=1,
        hidden_size=64,
        num_attention_heads=8,
        num_kv_heads=kv_heads,
        ffn_hidden_size=128,
        activation="swiglu",
        norm="rmsnorm",
        position_embedding="rotary",
        make_vocab_size_divisible_by=8,
    )
    drawn = plot_shards(config, tp, str(tmp_path / "split.png"))
    assert (tmp_path / "split.png").read_bytes()[:4] == b"\x89PNG"
    specs = gpt_shard_specs(config)
    for name, blocks in drawn.items():
        spec = specs[name]
        want = [
            (r, dim, start, n)
            for r in range(tp)
            for dim, ranges in [spec.at(tp, r).ranges()]
            for _, start, n in ranges
        ]
        assert blocks == want, name
        size = spec.global_shape[want[0][1]]
        covered = sorted({(start, n) for _, _, start, n in blocks})
        assert covered[0][0] == 0 and sum(n for _, n in covered) == size, name
        copies = len(blocks) - len(covered)
        expect = (tp // kv_heads - 1) * 2 * kv_heads if "qkv" in name and kv_heads < tp else 0
        assert copies == expect, f"{name}: {copies} copied chunks"


def test_command_line_refuses_an_impossible_split(tmp_path, capsys):
    assert main(["--tp", "2", "--output", str(tmp_path / "a.png")]) == 0
    with pytest.raises(SystemExit):
        main(["--tp", "3", "--output", str(tmp_path / "b.png")])
    assert "cannot be split" in capsys.readouterr().err
