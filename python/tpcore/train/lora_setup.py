"""LoRA in the trainer (`--lora-rank`): which adapters a run trains, what its checkpoints
record about them, and how a checkpoint is taken up: a LoRA checkpoint of the same adapters
resumes; a checkpoint without adapters is the base the adapters fine-tune (its weights only,
from iteration 0, as Megatron's `--finetune`); anything else raises on every rank alike."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..tensor_parallel.adapters import add_lora
from .arguments import TrainArgs

__all__ = ["lora_settings", "checkpoint_role", "add_adapters"]

# What must match for a checkpoint's adapters to be resumed (dropout may change).
_SAME = ("rank", "alpha", "use_rslora", "target_modules")


def lora_settings(args: TrainArgs, base: dict | None = None) -> dict | None:
    """The adapters of this run as a checkpoint records them (None without `--lora-rank`);
    `base` says which weights they were trained on."""
    if args.lora_rank is None:
        return None
    return {
        "rank": args.lora_rank,
        "alpha": float(args.lora_alpha if args.lora_alpha is not None else args.lora_rank),
        "dropout": args.lora_dropout,
        "use_rslora": args.lora_use_rslora,
        "target_modules": args.lora_targets(),
        "base": base,
    }


def checkpoint_role(meta: dict, args: TrainArgs, directory: str) -> str:
    """ "resume" (every weight and the optimizer from it) or "base" (its weights only, under
    new adapters) for the checkpoint whose metadata is `meta`; raises ValueError when the
    checkpoint's adapters are not this run's."""
    saved = meta.get("lora")
    if saved is None:
        return "resume" if args.lora_rank is None else "base"
    described = (
        f"rank {saved['rank']}, alpha {saved['alpha']:g}"
        f"{', rsLoRA' if saved['use_rslora'] else ''} on {','.join(saved['target_modules'])}"
    )
    if args.lora_rank is None:
        raise ValueError(
            f"tpcore: checkpoint {directory} holds LoRA adapters ({described}); resume it with "
            f"--lora-rank {saved['rank']} --lora-alpha {saved['alpha']:g} "
            f"--lora-target-modules {','.join(saved['target_modules'])}"
            f"{' --lora-use-rslora' if saved['use_rslora'] else ''}"
        )
    mine = lora_settings(args)
    differ = [
        f"{k}: checkpoint {saved[k]!r}, flags {mine[k]!r}" for k in _SAME if saved[k] != mine[k]
    ]
    if differ:
        raise ValueError(
            f"tpcore: checkpoint {directory} holds other LoRA adapters ({described}): "
            + "; ".join(differ)
        )
    return "resume"


def add_adapters(chunks: Sequence[nn.Module], args: TrainArgs) -> None:
    """This rank's pipeline chunks get the run's adapters (a chunk without one of the target
    layers, e.g. a stage of embeddings only, gets none)."""
    targets = args.lora_targets()
    for chunk in chunks:
        present = [t for t in targets if any(n.endswith("." + t) for n, _ in chunk.named_modules())]
        if present:
            add_lora(
                chunk,
                rank=args.lora_rank,
                alpha=args.lora_alpha if args.lora_alpha is not None else args.lora_rank,
                target_modules=present,
                dropout=args.lora_dropout,
                use_rslora=args.lora_use_rslora,
            )
        else:
            chunk.requires_grad_(False)
