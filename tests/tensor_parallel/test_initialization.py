"""Sharded, TP-size invariant initialisation: every shard is the slice of the TP=1 tensor,
the draws follow their distributions, and no rank builds a full tensor."""

from __future__ import annotations

import math

import pytest
import torch

import tpcore
from checks import LargestAllocation, expect_error, setup_tp
from tpcore import ShardedInit
from tpcore.tensor_parallel.initialization import TILE_1D, TILE_2D, init_shard_


def _full(shape, init, seed=3, key="w", dtype=torch.float32):
    return init_shard_(torch.empty(shape, dtype=dtype), init, seed=seed, key=key, full_shape=shape)


# ---------------------------------------------------------------------------------------
# The tiled draw (one process)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,dim", [((3 * TILE_1D + 17,), 0), ((300, 1100), 0), ((300, 1100), 1), ((3, 130, 600), 1)]
)
def test_any_ranges_give_the_slices_of_the_full_draw(shape, dim):
    init = ShardedInit.normal(1.0)
    full = _full(shape, init)
    n = shape[dim]
    # Pieces made of several ranges (like the fused QKV rule), plus 5 padding rows at the end.
    cuts = [0, n // 7, n // 3, n // 2 + 1, n]
    ranges = [
        (cuts[0], cuts[1], cuts[2] - cuts[1]),
        (cuts[2] - cuts[1], cuts[3], cuts[4] - cuts[3]),
    ]
    local = sum(r[2] for r in ranges)
    piece_shape = list(shape)
    piece_shape[dim] = local + 5
    piece = torch.full(piece_shape, float("nan"))
    init_shard_(piece, init, seed=3, key="w", full_shape=shape, dim=dim, ranges=ranges)
    want = torch.cat([full.narrow(dim, g, length) for _, g, length in ranges], dim)
    assert torch.equal(piece.narrow(dim, 0, local), want)
    assert not piece.narrow(dim, local, 5).any(), "rows no range covers must be zero"


def test_draw_depends_on_seed_and_key_and_tiles_differ():
    init = ShardedInit.normal(1.0)
    shape = (2 * TILE_2D[0], 2 * TILE_2D[1])
    base = _full(shape, init)
    assert not torch.equal(base, _full(shape, init, seed=4)), "another seed must give other numbers"
    assert not torch.equal(base, _full(shape, init, key="v")), "another key must give other numbers"
    tiles = [
        base[i * TILE_2D[0] : (i + 1) * TILE_2D[0], j * TILE_2D[1] : (j + 1) * TILE_2D[1]]
        for i in (0, 1)
        for j in (0, 1)
    ]
    n = tiles[0].numel()
    for a in range(4):
        for b in range(a + 1, 4):
            corr = torch.corrcoef(torch.stack([tiles[a].reshape(-1), tiles[b].reshape(-1)]))[
                0, 1
            ].item()
            assert abs(corr) < 5 / math.sqrt(n), f"tiles {a} and {b} are correlated ({corr})"


def test_low_precision_is_the_rounding_of_the_fp32_draw():
    init = ShardedInit.normal(0.02)
    full = _full((200, 700), init)
    assert torch.equal(_full((200, 700), init, dtype=torch.bfloat16), full.to(torch.bfloat16))


def test_bad_ranges_and_shapes_raise():
    init = ShardedInit.constant(1.0)
    expect_error(
        ValueError,
        "does not fit full shape",
        init_shard_,
        torch.empty(4, 5),
        init,
        seed=0,
        key="w",
        full_shape=(8, 6),
    )
    expect_error(
        ValueError,
        "is outside",
        init_shard_,
        torch.empty(4, 6),
        init,
        seed=0,
        key="w",
        full_shape=(8, 6),
        ranges=[(0, 6, 4)],
    )


# Closed forms, with a fixed seed: the sample mean of n draws has standard error sd/sqrt(n);
# the sample standard deviation of a normal sd/sqrt(2n), of a uniform(-b, b) (b/sqrt(3))/sqrt(5n);
# the fraction of normal draws within one sd is 0.6827 with standard error sqrt(p(1-p)/n).
Z = 5.0


def test_normal_matches_its_closed_form():
    std, mean = 0.02, 0.1
    x = _full((1000, 1000), ShardedInit.normal(std, mean)).double()
    n = x.numel()
    assert abs(x.mean().item() - mean) < Z * std / math.sqrt(n)
    assert abs(x.std().item() / std - 1) < Z / math.sqrt(2 * n)
    p = math.erf(1 / math.sqrt(2))
    inside = ((x - mean).abs() < std).double().mean().item()
    assert abs(inside - p) < Z * math.sqrt(p * (1 - p) / n)


def test_uniform_matches_its_closed_form():
    bound = 1 / math.sqrt(300)
    x = _full((1000, 1000), ShardedInit.uniform(-bound, bound)).double()
    n = x.numel()
    sd = bound / math.sqrt(3)
    assert abs(x.mean().item()) < Z * sd / math.sqrt(n)
    assert abs(x.std().item() / sd - 1) < Z / math.sqrt(5 * n)
    assert x.min().item() >= -bound and x.max().item() <= bound
    assert x.min().item() < -bound * (1 - 1e-4) and x.max().item() > bound * (1 - 1e-4), (
        "the whole range is used"
    )


# ---------------------------------------------------------------------------------------
# Layers at TP 1, 2, 4 (rank pool)
# ---------------------------------------------------------------------------------------

IN, OUT, VOCAB, DIM = 48, 64, 37, 12


def _at_tp(tp, build, seed=7):
    """Build after `torch.manual_seed(seed)` with TP size `tp`; returns (tp_rank, tp, module)."""
    tpcore.destroy_model_parallel()
    tp_rank, tp = setup_tp(tp, replicas=True)
    torch.manual_seed(seed)
    return tp_rank, tp, build()


def _layers(rank, world, tp):
    custom = ShardedInit.normal(0.5)
    for cls, dim in ((tpcore.ColumnParallelLinear, 0), (tpcore.RowParallelLinear, 1)):
        for init_method in (None, custom):
            _, _, dense = _at_tp(1, lambda: cls(IN, OUT, init_method=init_method))
            tp_rank, tp, layer = _at_tp(tp, lambda: cls(IN, OUT, init_method=init_method))
            what = f"{cls.__name__} init_method={init_method}"
            assert torch.equal(layer.weight, dense.weight.chunk(tp, dim)[tp_rank]), what
            assert torch.equal(
                layer.bias, dense.bias.chunk(tp, 0)[tp_rank] if dim == 0 else dense.bias
            ), what
            if init_method is None:  # nn.Linear's bound 1/sqrt(in) for weight and bias
                for p in (dense.weight, dense.bias):
                    assert 0.9 / math.sqrt(IN) < p.abs().max() <= 1 / math.sqrt(IN), what
            else:
                assert not dense.bias.any(), "a ShardedInit weight keeps a zero bias"
        # Meta: no storage and no draw from the default generator.
        state = torch.get_rng_state()
        meta = cls(IN, OUT, device="meta")
        assert meta.weight.is_meta and torch.equal(torch.get_rng_state(), state)
    expect_error(
        ValueError,
        "init_method must be None, a ShardedInit, 'dense' or a callable",
        tpcore.ColumnParallelLinear,
        IN,
        OUT,
        init_method="normal",
    )

    _, _, dense = _at_tp(
        1,
        lambda: tpcore.VocabParallelEmbedding(
            VOCAB, DIM, padding_idx=33, make_vocab_size_divisible_by=8
        ),
    )
    tp_rank, tp, layer = _at_tp(
        tp,
        lambda: tpcore.VocabParallelEmbedding(
            VOCAB, DIM, padding_idx=33, make_vocab_size_divisible_by=8
        ),
    )
    rows = layer.weight.shape[0]
    assert torch.equal(
        layer.weight, tpcore.tensor_parallel.vocab_shard(dense.weight[:VOCAB], tp_rank, rows)
    ), "embedding rows"
    assert not dense.weight[VOCAB:].any() and not dense.weight[33].any(), (
        "padding rows and padding_idx are zero"
    )
    assert dense.weight[:VOCAB].std().item() > 0.5, "normal(0, 1) rows"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layer_shards_are_slices_of_the_tp1_layer(cpu_ranks, tp):
    cpu_ranks.run(_layers, tp)


def _no_full_weight(rank, world):
    setup_tp(4, replicas=True)
    big_in, big_out = 1024, 1024  # full weight 4 MiB, this rank's 1 MiB, a tile 256 KiB
    for cls in (
        tpcore.ColumnParallelLinear,
        tpcore.RowParallelLinear,
        tpcore.VocabParallelEmbedding,
    ):
        with LargestAllocation() as seen:
            layer = cls(big_in, big_out)
        local = max(p.untyped_storage().nbytes() for p in layer.parameters())
        assert local < big_in * big_out * 4
        assert seen.largest <= local, (
            f"{cls.__name__}: a {seen.largest}-byte tensor was made (shard {local})"
        )
        with LargestAllocation() as seen:  # the check sees the full weight where one is built
            cls(big_in, big_out, init_method="dense")
        assert seen.largest >= big_in * big_out * 4, (cls.__name__, seen.largest)


def test_layers_at_tp4_never_build_the_full_weight(cpu_ranks):
    cpu_ranks.run(_no_full_weight)
