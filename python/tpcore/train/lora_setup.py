"""LoRA in the trainer (`--lora-rank`): which adapters a run trains, what its checkpoints
record about them, and how a checkpoint is taken up: a LoRA checkpoint of the same adapters
resumes; a checkpoint without adapters is the base the adapters fine-tune (its weights only,
from iteration 0, as Megatron's `--finetune`); anything else raises on every rank alike."""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch.distributed as dist
from torch import nn

from ..checkpoint.load import load_checkpoint
from ..hf.gpt_bridge.peft_export import export_peft_adapters
from ..tensor_parallel.adapters import add_lora, merge_lora
from .arguments import TrainArgs
from .guards import phase

__all__ = ["lora_settings", "checkpoint_role", "add_adapters", "load_lora_base", "finish_lora"]

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
    base = (saved.get("base") or {}).get("hf")
    if args.load_hf and base and os.path.realpath(base) != os.path.realpath(args.load_hf):
        differ.append(f"base: checkpoint {base}, --load-hf {args.load_hf}")
    if differ:
        raise ValueError(
            f"tpcore: checkpoint {directory} holds other LoRA adapters ({described}): "
            + "; ".join(differ)
        )
    return "resume"


def add_adapters(chunks: Sequence[nn.Module], args: TrainArgs) -> None:
    """This rank's pipeline chunks get the run's adapters (a chunk without one of the target
    layers, e.g. a stage of embeddings only, gets none)."""
    settings = lora_settings(args)
    for chunk in chunks:
        present = [
            t
            for t in settings["target_modules"]
            if any(n.endswith("." + t) for n, _ in chunk.named_modules())
        ]
        if present:
            add_lora(
                chunk,
                rank=args.lora_rank,
                alpha=settings["alpha"],
                target_modules=present,
                dropout=args.lora_dropout,
                use_rslora=args.lora_use_rslora,
            )
        else:
            chunk.requires_grad_(False)


def load_lora_base(
    path: str,
    chunks: Sequence[nn.Module],
    tp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup | None,
    args: TrainArgs,
) -> dict:
    """Load the weights (only) of the checkpoint at `path` into `chunks`, before adapters are
    added; returns the base as checkpoints of the run record it."""
    meta = load_checkpoint(
        path,
        chunks,
        None,
        tp_group=tp_group,
        pp_group=pp_group,
        load_rng=False,
        verify=args.verify_checkpoint,
    )
    return {
        "checkpoint": os.path.abspath(path),
        "run_id": meta.get("run_id"),
        "iteration": meta["iteration"],
    }


def finish_lora(
    chunks: Sequence[nn.Module],
    args: TrainArgs,
    pp_group: dist.ProcessGroup | None,
    dp_group: dist.ProcessGroup | None,
    log: Callable[[str], None],
) -> None:
    """At the end of a run: the adapters written for PEFT (`--save-peft`), then merged into the
    weights, so that the Hugging Face export and the sample are the fine-tuned model."""
    if args.save_peft:
        with phase(
            f"writing the LoRA adapters to --save-peft {args.save_peft}",
            args.distributed_timeout_minutes,
        ):
            export_peft_adapters(
                chunks,
                args.save_peft,
                lora=lora_settings(args),
                base_model=os.path.abspath(args.load_hf) if args.load_hf else args.save_hf,
                pp_group=pp_group,
                dp_group=dp_group,
            )
        log(f"tpcore: wrote the LoRA adapters for PEFT to {args.save_peft}")
    for chunk in chunks:
        merge_lora(chunk)
