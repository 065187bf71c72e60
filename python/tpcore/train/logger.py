"""Training metrics on rank 0: console lines, a progress bar, CSV, TensorBoard, a loss-curve PNG."""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from typing import Sequence

from .._atomic import atomic_output
from ..checkpoint.integrity import describe_os_error

__all__ = ["MetricsLogger", "read_metrics", "plot_loss_curve"]

COLUMNS = [
    "iteration",
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "skipped",
    "tokens_per_s",
    "step_ms",
    "valid_loss",
]


def read_metrics(path: str) -> list[dict[str, float]]:
    """Rows of a metrics.csv as floats (empty cells are NaN)."""
    with open(path, newline="") as f:
        return [
            {k: float(v) if v != "" else math.nan for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def plot_loss_curve(csv_path: str, png_path: str) -> bool:
    """Training (and validation) loss against iteration as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = read_metrics(csv_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], label="train", linewidth=1)
    valid = [r for r in rows if not math.isnan(r["valid_loss"])]
    if valid:
        ax.plot(
            [r["iteration"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="valid"
        )
    ax.set(xlabel="iteration", ylabel="loss (nats/token)", title="tpcore GPT pretraining")
    ax.grid(alpha=0.3)
    ax.legend()
    with atomic_output(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True


class MetricsLogger:
    """Does nothing on ranks other than 0. Every iteration goes to `log_dir/metrics.csv`
    (and TensorBoard when installed); every `log_interval` a line is printed; a progress
    bar redraws in between when stdout is a terminal."""

    def __init__(
        self,
        *,
        active: bool,
        log_dir: str | None,
        total_iters: int,
        start_iter: int,
        log_interval: int,
        progress: bool,
        extra_columns: Sequence[str] = (),
    ) -> None:
        self.active, self.total, self.log_interval = active, total_iters, log_interval
        self.bar = active and progress and sys.stdout.isatty()
        self.csv_path = os.path.join(log_dir, "metrics.csv") if log_dir else None
        self.tensorboard = None
        self._csv = None
        if not active or not log_dir:
            return
        os.makedirs(log_dir, exist_ok=True)
        kept = []
        if start_iter > 0 and os.path.isfile(
            self.csv_path
        ):  # resuming: drop rows past the checkpoint
            with open(self.csv_path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if float(r["iteration"]) <= start_iter]
        self._file = open(self.csv_path, "w", newline="")
        self._csv = csv.DictWriter(self._file, COLUMNS + list(extra_columns))
        self._csv.writeheader()
        self._csv.writerows(kept)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(
                os.path.join(log_dir, "tensorboard"), purge_step=start_iter + 1
            )
        except ImportError:  # TensorBoard is optional
            pass

    def print(self, text: str) -> None:
        if self.active:
            print(("\r\033[K" if self.bar else "") + text, flush=True)

    def record(self, iteration: int, **metrics: float) -> None:
        """Metrics of step `iteration` (1-based); `valid_loss` may come alone for a step."""
        if not self.active:
            return
        if self._csv:
            try:
                self._csv.writerow(
                    {"iteration": iteration, **{k: repr(float(v)) for k, v in metrics.items()}}
                )
                self._file.flush()
            except (
                OSError
            ) as e:  # a full disk must not kill the run from rank 0 alone, mid-collective
                self.print(
                    f"tpcore: warning: {describe_os_error(e, self.csv_path)}; metrics are no "
                    "longer written to it"
                )
                self._csv = None
                try:
                    self._file.close()
                except OSError:
                    pass
        if self.tensorboard:
            for k, v in metrics.items():
                self.tensorboard.add_scalar(k, v, iteration)
        if "loss" in metrics and (iteration % self.log_interval == 0 or iteration == self.total):
            self.print(
                f"iter {iteration:>6}/{self.total} | loss {metrics['loss']:.4f} | lr "
                f"{metrics['lr']:.3e} | grad norm {metrics['grad_norm']:.3f} | "
                f"{metrics['tokens_per_s']:,.0f} tok/s | {metrics['step_ms']:.1f} ms/step"
                + (
                    f" | moe aux {metrics['moe_aux_loss']:.4f} z {metrics['moe_z_loss']:.4f} "
                    f"load max/mean {metrics['moe_load_max_over_mean']:.2f}"
                    if "moe_aux_loss" in metrics
                    else ""
                )
                + (" | skipped (non-finite gradients)" if metrics.get("skipped") else "")
            )
        elif "loss" in metrics and self.bar:
            done = int(30 * iteration / self.total)
            sys.stdout.write(
                f"\r[{'#' * done}{'.' * (30 - done)}] {iteration}/{self.total} loss "
                f"{metrics['loss']:.4f}"
            )
            sys.stdout.flush()

    def close(self) -> None:
        if self._csv:
            self._file.close()
            self._csv = None
        if self.tensorboard:
            self.tensorboard.close()


class StepTimer:
    """Wall time of a step, synchronising CUDA so the GPU's work is counted."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __enter__(self) -> "StepTimer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
