"""A timeline picture of a pipeline schedule, drawn from the table `forward_backward` executes.

    python -m tpcore.pipeline_parallel.plot --schedule interleaved -p 4 -m 8 -v 2 --output pp.png

One row per pipeline rank, time to the right (a backward pass takes twice a forward, as
`schedule_table` assumes); each box is one pass of one micro-batch through one model chunk,
labelled with the micro-batch (and `.chunk` with virtual stages). Gaps are the bubble, whose
fraction the title gives. Needs matplotlib (`pip install 'tpcore[train]'`).
"""

from __future__ import annotations

import argparse

from .schedule_table import FORWARD, SCHEDULES, ScheduleTable, schedule_table

__all__ = ["plot_schedule", "main"]

# Forward passes in blues, backward in oranges; a darker shade for each later model chunk.
_FORWARD_COLORS = ("#9ecae1", "#4292c6", "#2171b5", "#08519c")
_BACKWARD_COLORS = ("#fdae6b", "#f16913", "#d94801", "#8c2d04")


def plot_schedule(table: ScheduleTable, path: str) -> list[tuple[int, float, float, str]]:
    """Draw `table` (from `schedule_table`) into the image file `path` (PNG, SVG, PDF);
    returns the boxes drawn: (rank, start, width, label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    boxes = []
    fig, ax = plt.subplots(figsize=(max(6.0, table.step_time * 0.28), 0.6 * table.p + 1.2))
    for rank, (actions, starts) in enumerate(zip(table.actions, table.starts)):
        for action, start in zip(actions, starts):
            forward = action.kind == FORWARD
            width = table.forward_time if forward else table.backward_time
            colors = _FORWARD_COLORS if forward else _BACKWARD_COLORS
            ax.broken_barh(
                [(start, width)],
                (rank - 0.4, 0.8),
                facecolors=colors[action.chunk % len(colors)],
                edgecolor="black",
                linewidth=0.5,
            )
            label = str(action.micro) + (f".{action.chunk}" if table.v > 1 else "")
            ax.text(start + width / 2, rank, label, ha="center", va="center", fontsize=7)
            boxes.append((rank, start, width, label))
    ax.set_yticks(range(table.p), [f"rank {r}" for r in range(table.p)])
    ax.invert_yaxis()
    ax.set_xlim(0, table.step_time)
    ax.set_xlabel("time (forward pass of one chunk = 1)")
    chunks = f", v={table.v}" if table.v > 1 else ""
    ax.set_title(
        f"{table.schedule}: p={table.p}, m={table.m}{chunks}; "
        f"bubble {table.bubble_fraction:.0%} of compute"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return boxes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    parser.add_argument("-p", "--pipeline-size", type=int, default=4)
    parser.add_argument("-m", "--micro-batches", type=int, default=8)
    parser.add_argument(
        "-v", "--chunks", type=int, default=None, help="model chunks per rank (interleaved: 2)"
    )
    parser.add_argument("--output", required=True, help="image file (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    v = args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)
    try:
        table = schedule_table(args.pipeline_size, args.micro_batches, v, args.schedule)
    except ValueError as e:
        parser.error(str(e))
    plot_schedule(table, args.output)
    print(f"{args.output}: {table.schedule}, bubble {table.bubble_fraction:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
