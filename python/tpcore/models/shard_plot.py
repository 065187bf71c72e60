"""A picture of how a GPT layer's weights are split over tensor-parallel ranks, drawn from the
shard specs GPTModel attaches to them (`gpt_shard_specs`), not by hand.

    python -m tpcore.models.shard_plot --tp 2 --output split.png

One panel per weight, as the dense tensor `[out, in]`: each rank's pieces in its color, the
parts of fused tensors (q / k / v by whole heads, gate / up) marked. Column-parallel weights
(QKV, fc1) split their output rows: f before them (identity forward, all-reduce of the input
gradient backward). Row-parallel weights (proj, fc2) split their input columns: g after them
(all-reduce of the partial outputs forward). The embedding splits the vocabulary rows, padded.
A KV head copied on several ranks (fewer KV heads than ranks) is drawn in stripes, one a copy.
Needs matplotlib (`pip install 'tpcore[train]'`).
"""

from __future__ import annotations

import argparse

from .config import GPTConfig
from .gpt_specs import gpt_shard_specs

__all__ = ["plot_shards", "main"]

_RANK_COLORS = (
    "#4292c6",
    "#f16913",
    "#41ab5d",
    "#807dba",
    "#e7298a",
    "#a6761d",
    "#666666",
    "#d9d9d9",
)
_PANELS = (
    ("layers.0.attention.qkv.weight", "QKV: column-parallel, f before"),
    ("layers.0.attention.proj.weight", "attention proj: row-parallel, g after"),
    ("layers.0.mlp.fc1.weight", "fc1: column-parallel, f before"),
    ("layers.0.mlp.fc2.weight", "fc2: row-parallel, g after"),
    ("embedding.word.weight", "word embedding: vocabulary rows"),
)


def plot_shards(
    config: GPTConfig, tp: int, path: str
) -> dict[str, list[tuple[int, int, int, int]]]:
    """Draw the split of `config`'s first layer and embedding over `tp` ranks into `path`;
    returns per weight the blocks drawn: (rank, split dim, global start, length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if not 1 <= tp <= len(_RANK_COLORS):
        raise ValueError(f"tpcore: shard_plot draws 1 to {len(_RANK_COLORS)} ranks, got {tp}")
    specs = gpt_shard_specs(config)
    drawn: dict[str, list[tuple[int, int, int, int]]] = {}
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(3.2 * len(_PANELS), 3.6))
    for ax, (name, title) in zip(axes, _PANELS):
        spec = specs[name]
        rows, cols = spec.global_shape
        blocks = drawn.setdefault(name, [])
        holders: dict[tuple[int, int, int], list[int]] = {}  # a chunk -> the ranks holding it
        for rank in range(tp):
            dim, ranges = spec.at(tp, rank).ranges()
            for _, start, length in ranges:
                blocks.append((rank, dim, start, length))
                holders.setdefault((dim, start, length), []).append(rank)
        for (dim, start, length), ranks in holders.items():
            # a chunk copied on several ranks (GQA with fewer KV heads than ranks): one
            # stripe per copy across the other dim
            across = (cols if dim == 0 else rows) / len(ranks)
            for i, rank in enumerate(ranks):
                if dim == 0:
                    xy, w, h = (i * across, start), across, length
                else:
                    xy, w, h = (start, i * across), length, across
                ax.add_patch(Rectangle(xy, w, h, facecolor=_RANK_COLORS[rank], edgecolor="white"))
        offset = 0
        for part in spec.parts if spec.kind == "parts" and len(spec.parts) > 1 else ():
            ax.text(cols * 1.02, offset + part.size / 2, part.name, va="center", fontsize=8)
            offset += part.size
            if offset < rows:
                ax.axhline(offset, color="black", linewidth=1)
        ax.set_xlim(0, cols * 1.12)
        ax.set_ylim(rows, 0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"{'hidden' if spec.kind == 'vocab' else 'in'} ({cols})", fontsize=8)
        ax.set_ylabel(f"{'vocabulary' if spec.kind == 'vocab' else 'out'} ({rows})", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.legend(
        handles=[Patch(color=_RANK_COLORS[r], label=f"TP rank {r}") for r in range(tp)],
        loc="lower center",
        ncol=tp,
    )
    fig.suptitle(
        f"{config.num_attention_heads} query heads, {config.num_kv_heads} KV heads, "
        f"hidden {config.hidden_size}, vocabulary {config.vocab_size}: TP={tp}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=200)
    parser.add_argument("--output", required=True, help="image file (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    try:
        config = GPTConfig(
            vocab_size=args.vocab,
            num_layers=1,
            hidden_size=args.hidden,
            num_attention_heads=args.heads,
            num_kv_heads=args.kv_heads,
            ffn_hidden_size=args.ffn,
            activation="swiglu",
            norm="rmsnorm",
            position_embedding="rotary",
            make_vocab_size_divisible_by=8,
        )
        plot_shards(config, args.tp, args.output)
    except ValueError as e:
        parser.error(str(e))
    print(f"{args.output}: TP={args.tp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
