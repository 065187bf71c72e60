"""Where a GPT's parameters live across tensor- and pipeline-parallel ranks.

A layout is the TP size, the pipeline size p and the global layer indices of each of the
p x v virtual stages (stage s is chunk s // p of pipeline rank s % p). Stage 0 holds the
embedding, the last stage the final norm and the LM head. With tied embeddings the last
stage also holds a copy of the word embedding under the same name; the layout assigns
that name to the first stage, whose copy is the one checkpoints store and gathers send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm

__all__ = ["ParallelLayout", "model_chunks", "current_layout"]


@dataclass(frozen=True)
class ParallelLayout:
    """TP size, pipeline size and the layers of each virtual pipeline stage."""

    tensor_parallel_size: int
    """Ranks each sharded parameter is split over."""
    pipeline_parallel_size: int
    """Pipeline ranks; virtual stage s lives on pipeline rank s % pipeline_parallel_size."""
    stage_layers: tuple[tuple[int, ...], ...]
    """Global layer indices of each virtual stage, in stage order."""

    @property
    def virtual_size(self) -> int:
        """Model chunks per pipeline rank."""
        return len(self.stage_layers) // self.pipeline_parallel_size

    def pipeline_rank_of(self, name: str) -> int:
        """The pipeline rank holding parameter `name` (the first stage for the word embedding)."""
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            for stage, layers in enumerate(self.stage_layers):
                if layer in layers:
                    return stage % self.pipeline_parallel_size
            raise ValueError(
                f"tpcore: layer {layer} ({name}) is on no pipeline stage of {self.stage_layers}"
            )
        if name.startswith("embedding."):
            return 0
        return (len(self.stage_layers) - 1) % self.pipeline_parallel_size  # final norm, LM head

    def names_on(self, pipeline_rank: int, names: Sequence[str]) -> list[str]:
        """The `names` this layout places on `pipeline_rank`, in their order."""
        return [name for name in names if self.pipeline_rank_of(name) == pipeline_rank]

    def to_metadata(self) -> dict:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "virtual_pipeline_parallel_size": self.virtual_size,
            "pipeline_stage_layers": [list(layers) for layers in self.stage_layers],
        }

    @classmethod
    def from_metadata(cls, meta: dict) -> "ParallelLayout":
        """The layout a checkpoint's metadata records (format 1 had no pipeline: one stage)."""
        stages = meta.get("pipeline_stage_layers") or [
            list(range(meta["model_config"]["num_layers"]))
        ]
        return cls(
            meta["tensor_parallel_size"],
            meta.get("pipeline_parallel_size", 1),
            tuple(tuple(s) for s in stages),
        )


def model_chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """A GPTModel, or this rank's pipeline chunks, as a list."""
    return [model] if isinstance(model, nn.Module) else list(model)


def current_layout(
    chunks: Sequence[nn.Module], *, tp_group: dist.ProcessGroup, pp_group: dist.ProcessGroup | None
) -> ParallelLayout:
    """The layout of a running model from every rank's chunks (GPTModels). A collective over
    `pp_group` (each rank sends the first layer and count of each chunk); none without it.
    Raises ValueError, on every rank alike, unless the stages hold every layer once, in order."""
    pp = 1 if pp_group is None else dist.get_world_size(pp_group)
    mine = []
    for chunk in chunks:
        layers = [int(name) for name, _ in chunk.layers.named_children()]
        mine.append([layers[0], len(layers)])
    local = torch.tensor(mine, dtype=torch.int64, device=next(chunks[0].parameters()).device)
    spans = (
        comm.all_gather(local, 0, pp_group).tolist() if pp > 1 else mine
    )  # [rank * v + chunk] -> [first, count]
    v = len(chunks)
    stages = tuple(
        tuple(range(first, first + count))
        for first, count in (spans[(s % pp) * v + s // pp] for s in range(pp * v))
    )
    num_layers = chunks[0].config.num_layers
    if [i for layers in stages for i in layers] != list(range(num_layers)):
        raise ValueError(
            f"tpcore: the model chunks of the pipeline do not hold layers 0..{num_layers - 1} once "
            f"each, in order: {stages}"
        )
    return ParallelLayout(dist.get_world_size(tp_group), pp, stages)
