"""Assemble the docs site's sources in build/docs-src (`make docs` then runs mkdocs on it).

The README is the home page; the guides and file formats in docs/ keep their names;
benchmarks/README.md becomes benchmarks/index.md; api.md lists the public modules, whose
docstrings mkdocstrings renders. Links are rewritten so that the ones that work on GitHub
(README -> docs/x.md) work on the site too.

Pictures are drawn here, from tpcore itself, not kept in the repository: a marker
`<!-- figure: NAME -->` in a guide (invisible on GitHub, where the guide gives the command
that draws it) becomes the picture on the site. FIGURES names them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "build" / "docs-src"

# The public API, one section per module (what the guides name).
API_MODULES = [
    "tpcore",
    "tpcore.parallel_state",
    "tpcore.comm",
    "tpcore.tensor_parallel",
    "tpcore.context_parallel",
    "tpcore.moe",
    "tpcore.models",
    "tpcore.pipeline_parallel",
    "tpcore.distributed",
    "tpcore.optimizer",
    "tpcore.checkpoint",
    "tpcore.data",
    "tpcore.train",
    "tpcore.hf",
    "tpcore.hf.gpt_bridge",
]


def _pipeline(schedule: str, v: int):
    def draw(path: Path) -> None:
        from tpcore.pipeline_parallel.plot import plot_schedule
        from tpcore.pipeline_parallel.schedule_table import schedule_table

        plot_schedule(schedule_table(4, 8, v, schedule), str(path))

    return draw


def _headline_ratios(path: Path) -> None:
    """The ratios of benchmarks/README.md's headline table, one bar each (the lower end of a
    range; log scale: they span 1.5x to 1369x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for line in (REPO / "benchmarks" / "README.md").read_text().split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("Claim", "---"):
            claim = re.match(r"[^,(]+", cells[0]).group(0).strip()
            for value, against in re.findall(r"([\d.]+)(?:-[\d.]+)?x vs ([^;(]+)", cells[3]):
                rows.append((f"{claim} vs {against.strip()}", float(value)))
    if not rows:
        raise SystemExit("tools/build_docs.py: no ratio found in benchmarks/README.md's table")
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color="#4292c6")
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("tpcore's speed over the baseline (log scale; conditions in the table)")
    for i, (_, value) in enumerate(rows):
        ax.text(value, i, f" {value:g}x", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _split(tp: int, kv_heads: int):
    def draw(path: Path) -> None:
        from tpcore.models.shard_plot import main as shard_plot

        shard_plot(["--tp", str(tp), "--kv-heads", str(kv_heads), "--output", str(path)])

    return draw


# The main job's metrics, where `make train` has run here; the site says how to draw the
# curve where it has not.
MAIN_JOB_METRICS = REPO / "checkpoints" / "gpt_small" / "metrics.csv"


def _loss_curve(path: Path) -> None:
    from tpcore.train import plot_loss_curve

    if not plot_loss_curve(str(MAIN_JOB_METRICS), str(path)):
        raise SystemExit("tools/build_docs.py: the loss curve needs matplotlib")


FIGURES = {
    "loss_curve": ("The main job's loss (make train)", _loss_curve),
    "tp_split": ("A GPT layer's weights at TP=2", _split(2, 4)),
    "tp_split_gqa": ("TP=4 with 2 KV heads: each KV head copied on two ranks", _split(4, 2)),
    "pipeline_gpipe": ("GPipe, p=4, m=8", _pipeline("gpipe", 1)),
    "pipeline_1f1b": ("1F1B, p=4, m=8", _pipeline("1f1b", 1)),
    "pipeline_interleaved": (
        "Interleaved 1F1B, p=4, m=8, two chunks per rank",
        _pipeline("interleaved", 2),
    ),
    "headline_ratios": ("The headline figures against their baselines", _headline_ratios),
}


def _figures(text: str, images: Path) -> str:
    def figure(match: re.Match) -> str:
        name = match.group(1)
        if name == "loss_curve" and not MAIN_JOB_METRICS.exists():
            return "(Run `make train`, then `make docs`, to draw the main job's loss curve here.)"
        if name not in FIGURES:
            raise SystemExit(
                f"tools/build_docs.py: unknown figure {name!r}; known: {sorted(FIGURES)}"
            )
        caption, draw = FIGURES[name]
        path = images / f"{name}.png"
        if not path.exists():
            draw(path)
        return f"![{caption}](images/{name}.png)"

    return re.sub(r"<!-- figure: ([a-z0-9_]+) -->", figure, text)


def _rewrite(text: str, mapping: dict[str, str]) -> str:
    """Relative link targets renamed by `mapping` (anchors kept); others as they are."""

    def link(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        return f"]({mapping.get(target, target)}{anchor})"

    return re.sub(r"\]\((?!https?:)([^)#\s]+)(#[^)\s]*)?\)", link, text)


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    (OUT / "benchmarks").mkdir(parents=True)
    images = OUT / "images"
    images.mkdir()
    guides = sorted((REPO / "docs").glob("*.md"))
    home = {f"docs/{g.name}": g.name for g in guides}
    home |= {
        "benchmarks/README.md": "benchmarks/index.md",
        "benchmarks/RESULTS.md": "benchmarks/RESULTS.md",
    }
    readme = _rewrite((REPO / "README.md").read_text(), home)
    (OUT / "index.md").write_text(_figures(readme, images))
    for g in guides:
        (OUT / g.name).write_text(_figures(g.read_text(), images))
    bench = {"README.md": "index.md", "RESULTS.md": "RESULTS.md"}
    bench_page = _rewrite((REPO / "benchmarks" / "README.md").read_text(), bench)
    (OUT / "benchmarks" / "index.md").write_text(
        _figures(bench_page, images).replace("](images/", "](../images/")
    )
    results = _rewrite((REPO / "benchmarks" / "RESULTS.md").read_text(), bench)
    (OUT / "benchmarks" / "RESULTS.md").write_text(results)
    sections = [f"## `{m}`\n\n::: {m}\n" for m in API_MODULES]
    (OUT / "api.md").write_text("# API reference\n\nFrom the docstrings.\n\n" + "\n".join(sections))
    print(f"docs sources in {OUT}")


if __name__ == "__main__":
    main()
